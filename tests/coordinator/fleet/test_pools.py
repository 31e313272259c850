"""Worker pools (coordinator/fleet/pools.py) over fake workers: where sessions go, health as the Watch stream reports it,
breakers taking endpoints out, and target expansion."""

from __future__ import annotations

import pytest

from coordinator.fleet.pools import WorkerPool, expand_targets
from coordinator.fleet.polling import wait_until
from coordinator.fleet.resilience import NoWorkerAvailable, ResilienceConfig
from tests.coordinator.fleet.fake_workers import FakeFleet

CONFIG = ResilienceConfig(breaker_fail_max=1, breaker_reset_s=60.0)


@pytest.fixture
def fakes():
    return FakeFleet("verifier", 3)


@pytest.fixture
def pool(fakes):
    """The three fake verifiers in a pool, all SERVING."""
    pool = WorkerPool(fakes.addresses, "verifier", CONFIG, connect=fakes.connect)
    assert wait_until(lambda: all(e.serving for e in pool.endpoints), 5.0)
    yield pool
    pool.close()


def test_pick_spreads_sessions_and_breaks_ties_by_listed_order(pool):
    a, b, c = pool.endpoints
    assert pool.pick() is a
    a.sessions = 1
    assert pool.pick() is b
    b.sessions = c.sessions = 1
    assert pool.pick() is a, "all equal again: the earliest listed"
    assert pool.pick(avoid=a) is b


def test_a_session_goes_where_its_prefix_is_cached_within_the_slack(pool):
    from coordinator.fleet.pools import AFFINITY_MIN_TOKENS, AFFINITY_SLACK
    a, b, c = pool.endpoints
    conversation = tuple(range(100, 100 + 2 * AFFINITY_MIN_TOKENS))
    b.recent_histories.append(conversation)  # turn 1 ended on b
    c.recent_histories.append(conversation[:AFFINITY_MIN_TOKENS - 1] + (7,))  # too short a shared prefix to count
    turn2 = conversation + (1, 2, 3)
    assert pool.pick(tokens=turn2) is b
    assert pool.pick(tokens=turn2[:AFFINITY_MIN_TOKENS - 1]) is a, "a short shared prefix: least loaded"
    assert pool.pick(tokens=(5,) + turn2) is a, "nothing shared: least loaded"
    b.sessions = AFFINITY_SLACK
    assert pool.pick(tokens=turn2) is b, "within the slack"
    b.sessions = AFFINITY_SLACK + 1
    assert pool.pick(tokens=turn2) is a, "too busy: balance wins"
    b.sessions = 0
    assert pool.pick(avoid=b, tokens=turn2) is a, "failover never returns to the endpoint it leaves"
    b.breaker.record_failure()
    assert pool.pick(tokens=turn2) is a


def test_an_ended_session_is_remembered_where_it_ran(pool):
    from coordinator.fleet.remote_sessions import FaultStats, PinnedSession
    session = PinnedSession(pool, list(range(50)), FaultStats())
    endpoint = session.attach()
    session.sync.history.extend([1, 2])
    session.sync.server_length = 52  # the worker held all of it
    session.end("s")
    assert list(endpoint.recent_histories) == [tuple(range(50)) + (1, 2)] and endpoint.sessions == 0


def test_pick_avoids_an_endpoint_only_when_there_is_a_choice(pool):
    a, b, c = pool.endpoints
    b.breaker.record_failure()
    c.breaker.record_failure()
    assert pool.pick(avoid=a) is a, "the only usable endpoint, even if it just failed"


def test_an_open_breaker_takes_an_endpoint_out_until_it_may_probe():
    config = ResilienceConfig(breaker_fail_max=1, breaker_reset_s=0.2)
    fakes = FakeFleet("verifier", 2)
    pool = WorkerPool(fakes.addresses, "verifier", config, connect=fakes.connect)
    try:
        assert wait_until(lambda: all(e.serving for e in pool.endpoints), 5.0)
        a, b = pool.endpoints
        a.breaker.record_failure()
        assert a.breaker.state == "open" and not a.usable() and pool.pick() is b
        assert wait_until(a.usable, 5.0), "after breaker_reset_s a probe may go"
        b.sessions = 5
        assert pool.pick() is b, "a closed breaker before a probing one, however busy"
        b.breaker.record_failure()
        assert pool.pick() is a
    finally:
        pool.close()


def test_health_decides_which_endpoints_are_usable(pool, fakes):
    a, b, c = pool.endpoints
    fakes[0].kill()
    assert wait_until(lambda: not a.serving, 5.0)
    assert not a.usable() and a.breaker.state == "closed" and pool.pick() is b
    fakes[0].restart()
    assert wait_until(lambda: a.serving, 5.0) and pool.pick() is a
    assert pool.health_log[(a.address, "NOT_SERVING")] == 1 and pool.health_log[(a.address, "SERVING")] == 2


def test_no_usable_endpoint_raises_no_worker_available(pool, fakes):
    for worker in fakes.workers.values():
        worker.kill()
    assert wait_until(lambda: not any(e.serving for e in pool.endpoints), 5.0)
    with pytest.raises(NoWorkerAvailable, match="no verifier is serving"):
        pool.pick()
    assert pool.wait_any_serving(0.1) is None
    fakes[2].restart()
    assert pool.wait_any_serving(5.0) is pool.endpoints[2]


def test_close_closes_every_client(pool, fakes):
    pool.close()
    assert all(worker.closed for worker in fakes.workers.values())


def test_a_pool_needs_an_address():
    with pytest.raises(ValueError, match="no drafter address"):
        WorkerPool(["dns:///localhost:not-a-port"], "drafter", CONFIG, connect=FakeFleet("drafter", 0).connect)


def test_targets_expand_to_addresses():
    assert expand_targets(["a:1", "b:2", "a:1"]) == ["a:1", "b:2"]
    assert "127.0.0.1:50051" in expand_targets(["dns:///localhost:50051"])
    assert expand_targets(["dns:///localhost:not-a-port"]) == [], "an unresolvable target is skipped"


def test_set_addresses_adds_new_workers_and_retires_departed_ones(fakes):
    """The pool Ray feeds (specmesh/rayserve/ingress.py): a new address joins; one that left takes no new session,
    moves its sessions on at their next call, and is closed once none is pinned to it; one that comes back first is
    taken back."""
    first, second, third = fakes.addresses
    pool = WorkerPool([first, second], "verifier", CONFIG, connect=fakes.connect)
    try:
        assert wait_until(lambda: all(e.serving for e in pool.endpoints), 5.0)
        assert pool.set_addresses([first, second]) == ([], [])
        added, retired = pool.set_addresses([second, third])
        assert (added, retired) == ([third], [first])
        b, c = pool.endpoints  # nothing was pinned to the first: closed at once
        assert [e.address for e in pool.endpoints] == [second, third] and fakes[0].closed
        assert wait_until(lambda: c.serving, 5.0)
        assert pool.set_addresses([second, third]) == ([], [])
        b.sessions = 1  # a generation pinned to the second when it leaves
        assert pool.set_addresses([third]) == ([], [second])
        assert b in pool.endpoints and b.retired and not b.usable() and not fakes[1].closed
        assert pool.pick() is c and pool.pick(avoid=c) is c
        assert pool.first_serving() is c
        assert pool.set_addresses([second, third]) == ([], [])  # back before its sessions moved: taken back
        assert not b.retired and b.usable()
        pool.set_addresses([third])
        b.sessions = 0  # the session moved on
        pool.set_addresses([third])
        assert pool.endpoints == [c] and fakes[1].closed
    finally:
        pool.close()
