"""Coordinator, drafter and two verifiers on four "hosts": network namespaces joined by a bridge that lives in a fifth
("switch") namespace, so the root namespace is never touched. Mid-generation the link of the verifier the session is
pinned on is cut (its switch port goes down: packets vanish, no RST, no ICMP), which only the Verify deadline and
keepalive can notice; the session must fail over to the other verifier and produce exactly the target's greedy output.

The namespaces come from specmesh_bench/netns.py (shared with the split-host benchmark). Needs root
(CAP_NET_ADMIN) and `ip`; skips with the reason otherwise. The coordinator side runs in its namespace as
this module run as a script (`python -m tests.chaos.test_multihost '<json config>'`), talking over stdin/stdout:

    driver -> test   READY                 every endpoint SERVING
    driver -> test   PINNED <address>      first text of the generation arrived; waits for one line on stdin
    test -> driver   <any line>            the link is cut: go on
    driver -> test   RESULT <json>         token ids, stats, timings, breaker and health transitions
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from specmesh_bench.netns import Mesh, MeshUnavailable, remove_stale_namespaces

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.213.7"  # private /24, used only inside this test's namespaces
HOSTS = {"coord": 1, "drafter": 2, "v1": 11, "v2": 12}
VERIFIER_PORT, DRAFTER_PORT = 50052, 50051
VERIFY_TIMEOUT_S = 1.5
GENERATION_BOUND_S = 15.0  # the whole faulted generation, cut and failover included
HEALTH_WAIT_S = 40.0  # a cut link shows in health once TCP_USER_TIMEOUT / keepalive (10 s / 20+10 s) give up
STARTUP_TIMEOUT_S = 120.0


@pytest.fixture
def mesh():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    remove_stale_namespaces()
    m = Mesh(HOSTS, SUBNET, cwd=REPO)
    try:
        try:
            m.build()
        except MeshUnavailable as e:
            pytest.skip(f"cannot build a namespace network here: {e}")
        yield m
    finally:
        m.close()


class Lines:
    """Reads a process's stdout lines on a thread so the test can wait for one with a timeout."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.process.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        self.lines.put("")  # EOF

    def expect(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {prefix!r} line within {timeout_s:.0f} s; seen: {self.seen[-5:]}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line[len(prefix):].strip()
            if line == "" and self.process.poll() is not None:
                raise AssertionError(f"driver exited ({self.process.returncode}) before {prefix!r}; "
                                     f"seen: {self.seen[-5:]}")


def test_cut_link_of_pinned_verifier_fails_over_across_hosts(mesh, tiny, prompt, expected):
    from tests.chaos.conftest import DRAFT, MAX_NEW, TARGET

    python = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
    verifiers = {"v1": f"{mesh.address('v1')}:{VERIFIER_PORT}", "v2": f"{mesh.address('v2')}:{VERIFIER_PORT}"}
    drafter = f"{mesh.address('drafter')}:{DRAFTER_PORT}"
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="specmesh-multihost-") as logs:
        for host, role, model, port in (("v1", "verifier", TARGET, VERIFIER_PORT),
                                        ("v2", "verifier", TARGET, VERIFIER_PORT),
                                        ("drafter", "drafter", DRAFT, DRAFTER_PORT)):
            mesh.popen(host, [python, "-m", role, "serve", "--model", model, "--dtype", "float64", "--device", "cpu",
                              "--host", mesh.address(host), "--port", str(port), "--threads", "1", "--grace", "1"],
                       f"{logs}/{host}.log", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        config = {"verifiers": list(verifiers.values()), "drafter": drafter, "prompt_ids": list(prompt),
                  "max_new_tokens": MAX_NEW, "verify_timeout_s": VERIFY_TIMEOUT_S, "health_wait_s": HEALTH_WAIT_S,
                  "startup_timeout_s": STARTUP_TIMEOUT_S}
        driver = mesh.popen("coord", [python, "-m", "tests.chaos.test_multihost", json.dumps(config)],
                            f"{logs}/driver.log", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        out = Lines(driver)

        def logs_tail() -> str:
            return "\n".join(f"--- {p.name}\n" + "".join(p.read_text(errors="replace").splitlines(True)[-15:])
                             for p in sorted(Path(logs).glob("*.log")))

        try:
            out.expect("READY", STARTUP_TIMEOUT_S + 10)
            pinned = out.expect("PINNED", 30)
            assert pinned in verifiers.values(), f"pinned on an unknown verifier {pinned!r}"
            mesh.cut(next(h for h, a in verifiers.items() if a == pinned))
            cut_at = time.monotonic()
            driver.stdin.write(b"cut\n")
            driver.stdin.flush()
            result = json.loads(out.expect("RESULT", GENERATION_BOUND_S + HEALTH_WAIT_S + 15))
        except (AssertionError, OSError, ValueError) as e:  # OSError: the driver died (broken pipe)
            raise AssertionError(f"{type(e).__name__}: {e}\n{logs_tail()}") from None
        assert driver.wait(timeout=30) == 0, logs_tail()

    print(f"pinned {pinned} cut at +{cut_at - begun:.1f} s; driver result: {json.dumps(result)}")
    other = next(a for a in verifiers.values() if a != pinned)
    assert result["error"] is None, result["error"]
    assert result["token_ids"] == expected, "the output differs from the target's greedy output"
    assert result["generation_s"] < GENERATION_BOUND_S, f"the faulted generation took {result['generation_s']} s"
    assert result["stats"]["failovers"] >= 1, result["stats"]
    assert result["stats"]["retries"] >= 1, result["stats"]
    assert result["visited"] == [pinned, other], f"the session's verifiers, in order: {result['visited']}"
    breaker = f"verifier@{pinned}"
    transitions = {(name, old, new) for name, old, new, _ in result["breaker_transitions"]}
    assert (breaker, "closed", "open") in transitions, result["breaker_transitions"]
    assert not any(name == f"verifier@{other}" and new == "open" for name, _, new in transitions), transitions
    health = {(address, status): n for address, status, n in result["health_log"]}
    assert health.get((pinned, "NOT_SERVING"), 0) >= 1, \
        f"health never reported the cut verifier NOT_SERVING within {HEALTH_WAIT_S} s: {result['health_log']}"
    assert health.get((other, "NOT_SERVING"), 0) == 0, result["health_log"]


# ---- the coordinator side, run inside the coordinator's namespace ----

def drive(config: dict) -> int:
    from coordinator import Coordinator, GenerationOptions
    from coordinator.api import GenerationFailed
    from coordinator.fleet.resilience import ResilienceConfig

    resilience = ResilienceConfig(verify_timeout_s=config["verify_timeout_s"], propose_timeout_s=2.0,
                                  retry_budget_s=20.0, backoff_initial_s=0.05, backoff_max_s=0.5,
                                  breaker_fail_max=1, breaker_reset_s=30.0)

    def say(line: str) -> None:
        print(line, flush=True)

    with Coordinator(config["verifiers"], config["drafter"], resilience=resilience,
                     connect_timeout_s=config["startup_timeout_s"]) as c:
        deadline = time.monotonic() + config["startup_timeout_s"]
        pools = [c.verifiers, c.drafters]
        while not all(e.serving for pool in pools for e in pool.endpoints):
            if time.monotonic() > deadline:
                raise SystemExit("not every worker became SERVING")
            time.sleep(0.05)
        say("READY")
        pinned: list[str] = []  # the verifier holding the session at each text callback, in order

        def on_text(text: str) -> None:
            holder = next((e.address for e in c.verifiers.endpoints if e.sessions > 0), None)
            if holder is None:
                return  # the final flush of held-back text comes after the session has ended
            pinned.append(holder)
            if len(pinned) == 1:
                say(f"PINNED {pinned[0]}")
                sys.stdin.readline()  # the test cuts the link, then answers

        error, tokens, stats = None, [], {}
        started = time.monotonic()
        try:
            result = c.generate(list(config["prompt_ids"]), GenerationOptions(
                max_new_tokens=config["max_new_tokens"], draft_tokens=3), on_text=on_text)
            tokens, stats = result.token_ids, result.stats
        except GenerationFailed as e:
            error, tokens, stats = str(e), e.partial.token_ids, e.partial.stats
        generation_s = time.monotonic() - started
        # The pinned verifier's health stream only breaks when TCP gives up on the unacknowledged bytes.
        health_deadline = time.monotonic() + config["health_wait_s"]
        while pinned and not c.verifiers.health_log[(pinned[0], "NOT_SERVING")] \
                and time.monotonic() < health_deadline:
            time.sleep(0.05)
        visited = list(dict.fromkeys(pinned))
        say("RESULT " + json.dumps({
            "error": error, "token_ids": tokens, "stats": stats, "generation_s": round(generation_s, 3),
            "health_s": round(time.monotonic() - started, 3),
            "breaker_transitions": [[*key, n] for key, n in c.breaker_transitions.items()],
            "health_log": [[*key, n] for key, n in c.verifiers.health_log.items()],
            "visited": visited}))
    return 0


if __name__ == "__main__":
    sys.exit(drive(json.loads(sys.argv[1])))
