"""Telling whether other processes computed during a cost probe's call, and the probes' turns on one machine
(specmesh/worker/machine_load.py), with real processes."""

from __future__ import annotations

import subprocess
import sys
import time

from specmesh.worker.machine_load import OthersCpu, machine_busy_s, probe_turn


def test_a_process_computing_beside_a_call_is_seen():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # past its start
        with OthersCpu() as during:
            time.sleep(0.5)
    finally:
        busy.kill()
        busy.wait()
    assert during.busy and during.others_s > 0.3 and during.wall_s >= 0.5


def test_own_cpu_is_not_counted_as_others_and_a_call_of_a_few_milliseconds_is_never_judged(monkeypatch):
    assert machine_busy_s() > 0
    from specmesh.worker import machine_load
    machine = iter([100.0, 100.5])  # the machine's busy seconds before and after: 0.5 s in all, this process's included
    monkeypatch.setattr(machine_load, "machine_busy_s", lambda: next(machine))
    own = time.process_time()
    with OthersCpu() as during:
        while time.process_time() - own < 0.3:  # this process computing is not another one
            pass
    own = time.process_time() - own
    assert abs(during.others_s - (0.5 - own)) < 0.01
    monkeypatch.undo()
    with OthersCpu() as short:
        pass
    assert short.others_s is not None and not short.busy, "within the ticks' rounding"


def test_a_turn_waits_for_another_process_holding_it(tmp_path):
    lock = tmp_path / "costs" / "probe.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
         "from specmesh.worker.machine_load import probe_turn\n"
         f"with probe_turn(Path({str(lock)!r})):\n    print('held', flush=True)\n    time.sleep(1.0)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with probe_turn(lock):
            waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert waited > 0.5


def test_without_a_lock_file_the_call_runs_without_turns(tmp_path):
    (tmp_path / "costs").write_text("a file where the cache's folder would be")
    ran = []
    with probe_turn(tmp_path / "costs" / "probe.lock"):
        ran.append(1)
    assert ran == [1]
