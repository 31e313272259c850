"""A worker restarts itself once with glibc's huge-page tunable, only where that changes something, and keeps its pid
and pipes; the flag and its variable turn it off."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

from specmesh.runtime import huge_pages
from specmesh.runtime.huge_pages import (environment_for_huge_pages, huge_pages_requested, thp_mode,
                                        tunables_with_huge_pages)


def test_the_thp_mode_is_the_bracketed_word(tmp_path):
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    assert thp_mode(str(enabled)) == "madvise"
    enabled.write_text("[always] madvise never\n")
    assert thp_mode(str(enabled)) == "always"
    assert thp_mode(str(tmp_path / "absent")) is None


def test_the_tunable_is_added_once_and_a_users_own_value_stands():
    assert tunables_with_huge_pages(None) == "glibc.malloc.hugetlb=1"
    assert tunables_with_huge_pages("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert tunables_with_huge_pages("glibc.malloc.hugetlb=1") is None  # the re-executed process: no loop
    assert tunables_with_huge_pages("glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2") is None


def test_huge_pages_are_on_by_default_and_the_flag_the_variable_and_the_config_file_turn_them_off(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.delenv("SPECMESH_HUGE_PAGES", raising=False)
    monkeypatch.delenv("SPECMESH_CONFIG", raising=False)
    assert huge_pages_requested("verifier", ["serve", "--port", "0"])
    assert not huge_pages_requested("verifier", ["serve", "--no-huge-pages"])
    config = tmp_path / "specmesh.toml"
    config.write_text("[verifier]\nhuge-pages = false\n")
    assert not huge_pages_requested("verifier", ["serve", "--config", str(config)])
    assert huge_pages_requested("drafter", ["serve", "--config", str(config)])  # the verifier's table only
    monkeypatch.setenv("SPECMESH_HUGE_PAGES", "0")
    assert not huge_pages_requested("verifier", ["serve"])
    assert huge_pages_requested("verifier", ["serve", "--huge-pages"])  # the command line wins
    monkeypatch.setenv("SPECMESH_HUGE_PAGES", "maybe")
    assert not huge_pages_requested("verifier", ["serve"])  # the full parser says what is wrong, without a restart


@pytest.mark.parametrize("mode, glibc, tunables, expected", [
    ("madvise", (2, 36), None, True),
    ("always", (2, 36), None, False),  # every allocation gets them already
    ("never", (2, 36), None, False),  # none can
    (None, (2, 36), None, False),  # no THP in this kernel
    ("madvise", (2, 31), None, False),  # a glibc without the tunable
    ("madvise", None, None, False),  # musl
    ("madvise", (2, 36), "glibc.malloc.hugetlb=1", False),  # already restarted
])
def test_the_worker_restarts_only_where_it_changes_something(monkeypatch, mode, glibc, tunables, expected):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: mode)
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: glibc)
    monkeypatch.delenv("SPECMESH_HUGE_PAGES", raising=False)
    environ = {"PATH": "/usr/bin"} | ({"GLIBC_TUNABLES": tunables} if tunables else {})
    environment = environment_for_huge_pages("verifier", ["serve"], environ)
    if expected:
        assert environment == {"PATH": "/usr/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    else:
        assert environment is None



def test_a_process_reads_whether_it_started_on_huge_pages():
    assert huge_pages.started_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"})
    assert not huge_pages.started_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert not huge_pages.started_with_huge_pages({})


@pytest.mark.parametrize("mode, tunables, on, restarts", [
    ("madvise", None, True, True),
    ("madvise", "glibc.malloc.hugetlb=0", False, False),  # the user's own value stands: no restart, so no loop
    ("always", None, True, False),  # on huge pages already
    ("never", None, False, False),
])
def test_the_bench_restarts_on_huge_pages_where_that_helps(monkeypatch, mode, tunables, on, restarts):
    """`coordinator bench --baseline-huge-pages`."""
    started = []
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: mode)
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(huge_pages, "_reexec", started.append)
    if tunables is None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", tunables)
    assert huge_pages.reexec_on_huge_pages_if_possible() is on
    assert [e["GLIBC_TUNABLES"] for e in started] == (["glibc.malloc.hugetlb=1"] if restarts else [])

def test_this_machines_glibc_version_is_read():
    if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
        pytest.skip("not glibc")
    major, minor = huge_pages.glibc_version()
    assert major == 2 and minor > 0


def restarts_here() -> bool:
    return environment_for_huge_pages("verifier", ["serve"], {}) is not None


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = [e.decode(errors="replace") for e in f.read().split(b"\0") if b"=" in e]
    return dict(e.split("=", 1) for e in entries)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
@pytest.mark.parametrize("off", [False, True])
def test_a_real_worker_process_restarts_itself_with_the_tunable_in_place(off):
    """The started process (same pid, its stdout still the parent's pipe) runs with the tunable and serves; with
    --no-huge-pages it runs as started."""
    if not off and not restarts_here():
        pytest.skip("this machine gives huge pages no way in (THP mode, glibc)")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "SPECMESH_HUGE_PAGES")}
    with tempfile.TemporaryDirectory() as cwd:
        process = subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", "tiny-random-llama",
                                    "--port", "0", "--exit-on-stdin-eof", *(["--no-huge-pages"] if off else [])],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                   cwd=cwd, text=True)
        try:
            deadline = time.monotonic() + 120
            lines = []
            for line in process.stdout:
                lines.append(line)
                if line.startswith("READY") or time.monotonic() > deadline:
                    break
            assert any(line.startswith("READY") for line in lines), lines
            tunables = environ_of(process.pid).get("GLIBC_TUNABLES", "")
            assert ("glibc.malloc.hugetlb=1" in tunables) == (not off)
        finally:
            process.stdin.close()
            assert process.wait(timeout=60) == 0


@pytest.mark.real_models
def test_the_real_target_worker_holds_its_weights_on_huge_pages_and_decodes_the_same_tokens(tmp_path):
    """The default target's worker (ik): its log reports the weights on huge pages (more than the 0.9 GiB of the
    Q4_K_M file), and its greedy tokens equal those of a worker started with --no-huge-pages."""
    from coordinator import Coordinator, GenerationOptions
    from coordinator.fleet.local_workers import LocalWorker, LocalWorkerSpec
    from specmesh.runtime.catalog import DEFAULT_TARGET_MODEL

    if not restarts_here():
        pytest.skip("this machine gives huge pages no way in (THP mode, glibc)")
    tokens, logs = {}, {}
    for off in (False, True):
        log_dir = tmp_path / ("off" if off else "on")
        log_dir.mkdir()
        worker = LocalWorker(LocalWorkerSpec("verifier", DEFAULT_TARGET_MODEL, "cpu", "auto",
                                             extra_args=("--no-huge-pages",) if off else ()), str(log_dir))
        try:
            worker.wait_serving(600)
            with Coordinator(worker.address) as coordinator:
                tokens[off] = coordinator.generate("Write a haiku about page tables.",
                                                   GenerationOptions(max_new_tokens=24, draft_tokens=0)).token_ids
            logs[off] = worker.log_tail(200)
        finally:
            worker.stop()
    on_pages = re.search(r"(\d+) MiB on transparent huge pages", logs[False])
    assert on_pages and int(on_pages.group(1)) > 900, logs[False]
    assert "MiB on transparent huge pages" not in logs[True]
    assert tokens[False] == tokens[True] and len(tokens[False]) >= 8
