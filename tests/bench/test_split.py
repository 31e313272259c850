"""The split-host benchmark end to end on tiny models (network namespaces, pinned workers, a short link delay), the
delay relay it falls back on without netem, and its refusals. Speed is not asserted: the benchmark measures it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from specmesh_bench.netns import Mesh, MeshUnavailable, unavailable_reason

TINY = ["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2", "--dtype", "float64",
        "--engine", "transformers", "--device", "cpu"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", "bench", "--topology", "split", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def namespaces():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the split topology cannot run here: {reason}")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the split topology needs two cores: one for each worker")


def test_split_bench_sweeps_delays_with_every_mode_and_baseline(namespaces, tmp_path):
    done = bench(*TINY, "--modes", "target-only,adaptive-cost,pipelined,pipelined-cost,hf-target",
                 "--delays-ms", "0,20", "--classes", "code", "--limit-prompts", "1", "--max-new-tokens", "8",
                 "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["topology"] == "split" and report["config"]["link_delay"] in ("netem", "relay")
    assert [run["rtt_ms"] for run in report["runs"]] == [0.0, 40.0]
    for run in report["runs"]:
        assert {r["mode"] for r in run["rows"]} == {"target-only", "adaptive-cost", "pipelined", "pipelined-cost"}
        # The draft model is the target itself, in float64: every mode gives target-only's greedy output.
        assert all(r["diverges_at"] is None and r["new_tokens"] > 0 for r in run["rows"])
        assert run["measured_rtt_ms"] is not None
    assert [r["mode"] for r in report["baseline_rows"]] == ["hf-target"]
    assert report["baseline_rows"][0]["token_ids"] == report["runs"][0]["rows"][0]["token_ids"]
    # The links really delay: every round of the second run waited out at least one round trip (pipelined drafts
    # every round; target-only streams its tokens and waits out one round trip in all). The delay is long beside a
    # tiny model's round (about 13 ms, ±50% on a shared machine): a 4 ms round trip once read slower undelayed.
    slow, fast = (next(r for r in run["rows"] if r["mode"] == "pipelined") for run in reversed(report["runs"]))
    assert slow["verify_s"] >= slow["rounds"] * 0.040 and slow["verify_s"] > fast["verify_s"]
    table = (tmp_path / "bench.md").read_text()
    assert "| 20 | 40 |" in table and "| hf-target |" in table and "split hosts" in table
    assert (tmp_path / "bench.png").stat().st_size > 1000
    rerendered = subprocess.run([sys.executable, "-m", "coordinator", "bench", "--from-json",
                                 str(tmp_path / "bench.json")], capture_output=True, text=True, timeout=120)
    assert rerendered.returncode == 0 and "| 20 | 40 |" in rerendered.stdout


def test_split_bench_says_why_when_netem_is_asked_for_and_missing(namespaces, tmp_path):
    with Mesh({"probe": 1}, "10.213.10") as mesh:
        reason = mesh.netem_unavailable_reason()
    if reason is None:
        pytest.skip("tc netem works here: the refusal cannot be exercised")
    done = bench(*TINY, "--link-delay", "netem", "--delays-ms", "1", "--limit-prompts", "1")
    assert done.returncode == 3 and "netem" in done.stderr, done.stderr[-2000:]


def test_split_bench_refuses_one_core_for_both_workers():
    done = bench("--drafter-cpu", "0", "--verifier-cpu", "0")
    assert done.returncode == 2 and "must differ" in done.stderr


def test_the_relay_delays_each_direction_and_keeps_the_bytes():
    with socket.socket() as echo:
        echo.bind(("127.0.0.1", 0))
        echo.listen()

        def serve() -> None:
            conn, _ = echo.accept()
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)
        threading.Thread(target=serve, daemon=True).start()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        relay = subprocess.Popen([sys.executable, "-m", "specmesh_bench.delay_relay", "--delay-ms", "50",
                                  "--route", f"127.0.0.1:{port}=127.0.0.1:{echo.getsockname()[1]}"],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert relay.stdout.readline().strip() == "RELAYING"
            payload = bytes(range(256)) * 1000
            with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
                started = time.monotonic()
                client.sendall(payload)
                received = b""
                while len(received) < len(payload):
                    received += client.recv(65536)
                elapsed = time.monotonic() - started
            assert received == payload
            assert elapsed >= 0.1, "50 ms each way: the echo cannot come back sooner than 100 ms"
        finally:
            relay.terminate()
            relay.wait(timeout=10)


def test_mesh_reports_what_it_lacks():
    if unavailable_reason() is None:
        with Mesh({"a1": 1}, "10.213.11") as mesh:
            assert mesh.address("a1") == "10.213.11.1" and mesh.address("router") == "10.213.11.254"
            names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert mesh.ns("a1") in names
        assert mesh.ns("a1") not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    else:
        with pytest.raises(MeshUnavailable):
            Mesh({"a1": 1}, "10.213.11").build()
