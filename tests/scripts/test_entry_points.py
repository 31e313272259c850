"""The scripts run from the repository root as the README shows them (`python scripts/NAME.py`). The benchmark scripts
are thin entry points of the coordinator's benchmark commands (specmesh_bench/): same flags, same help. The
tools import the installed packages, no sys.path edits (fuzz.py alone reaches into tests/ for its strategies)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specmesh_bench import bench, concurrency

REPO = Path(__file__).resolve().parents[2]


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH: this checkout, whichever checkout of the project is pip-installed (editable) in this environment.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "120"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)


def options(help_text: str) -> str:
    """The help text from its options on: the usage line above them names the program."""
    return help_text[help_text.index("options:"):]


@pytest.mark.parametrize("name, module", [("bench.py", bench), ("bench_concurrency.py", concurrency)])
def test_benchmark_scripts_are_the_coordinator_commands(name, module, monkeypatch):
    run = script(name, "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: {name} ")
    monkeypatch.setenv("COLUMNS", "120")
    assert options(run.stdout) == options(module.build_parser("coordinator bench").format_help())


@pytest.mark.parametrize("name", ["chaos.py", "fuzz.py", "profile_round.py", "profile_cores.py", "worker_memory.py",
                                  "ray_smoke.py", "ab_hybrid.py"])
def test_tool_scripts_start(name):
    run = script(name, "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: {name} ")


def test_chaos_serve_has_its_own_flags():
    run = script("chaos.py", "--serve", "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: chaos.py --serve ")
    assert "--clients" in run.stdout and "--draft-model" in run.stdout


def test_profile_cores_reports_every_process_on_tiny_models():
    run = script("profile_cores.py", "--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2",
                 "--dtype", "float64", "--prompts", "1", "--max-new-tokens", "4", "--threads", "1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[2] for line in lines] == ["target-only", "adaptive", "target-only", "HF"]
    assert all("verifier" in line and "drafter" in line and "coordinator" in line for line in lines[:3])
    assert "cores" in lines[3]


def test_profile_cores_omp_team_experiment_on_a_tiny_model():
    run = script("profile_cores.py", "--omp-team-experiment", "--target-model", "tiny-random-qwen2", "--dtype",
                 "float64", "--steps", "2", "--threads", "2")
    assert run.returncode == 0, run.stderr
    assert [line.split(" one-token")[0].strip() for line in run.stdout.splitlines()] == [
        "alone", "another thread holds an OpenMP team", "that thread has ended"]


def test_worker_memory_reads_both_workers_and_fails_a_worker_over_its_ratio():
    # A tiny model's weights are kilobytes beside the runtime's few hundred MiB: far over 1.15x, so the check fails.
    run = script("worker_memory.py", "--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2",
                 "--dtype", "float64", "--generations", "3", "--max-new-tokens", "4", "--threads", "1")
    assert run.returncode == 1, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith(("| verifier ", "| drafter "))]
    assert len(rows) == 2 and all("x) |" in row for row in rows)
    assert "FAILED: verifier holds more than 1.15x its weights" in run.stderr
    assert "FAILED: drafter holds more than 1.15x its weights" in run.stderr
