"""Leak sampling for long runs (scripts/chaos.py --serve, scripts/fuzz.py): resident memory, open file descriptors and
threads of named processes (psutil), and the sessions each worker holds (its Info), sampled on a thread; after the
load stops, waiting until every worker's sessions drain to zero (EndSession, else the idle TTL), and the growth of a
process's resident memory between two samples of the same process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from coordinator.fleet.worker_client import RemoteWorker, WorkerError


@dataclass(frozen=True)
class ProcessSample:
    """One look at one process: which (pid), when (monotonic seconds) and what it held."""

    pid: int
    at_s: float
    rss_bytes: int
    fds: int
    threads: int


def sample_process(pid: int) -> ProcessSample | None:
    """None when the process is gone (a killed worker between restarts)."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            return ProcessSample(pid, time.monotonic(), process.memory_info().rss, process.num_fds(),
                                 process.num_threads())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def active_sessions(address: str, role: str, timeout_s: float = 1.0) -> int | None:
    """The sessions a worker holds now (Info.active_sessions, idle-expired first); None when it does not answer
    (down, restarting, paused)."""
    client = RemoteWorker(address, role)
    try:
        return client.info(timeout_s).active_sessions
    except WorkerError:
        return None
    finally:
        client.close()


@dataclass
class Series:
    """Everything sampled of one named process (its pid may change when a killed worker is restarted)."""

    processes: list[ProcessSample] = field(default_factory=list)
    sessions: list[tuple[float, int]] = field(default_factory=list)  # (monotonic s, active sessions)

    def last_of(self, pid: int) -> ProcessSample | None:
        return next((s for s in reversed(self.processes) if s.pid == pid), None)

    def summary(self, since_s: float = 0.0) -> dict:
        """Peaks over the run; first and last sample of the latest pid seen since `since_s` and its RSS growth between
        them (the same process: a restart is not growth; `pids` > 1 says the process was restarted)."""
        samples = [s for s in self.processes if s.at_s >= since_s]
        if not samples:
            return {}
        by_pid: dict[int, list[ProcessSample]] = {}
        for s in samples:
            by_pid.setdefault(s.pid, []).append(s)
        latest = by_pid[samples[-1].pid]
        first, last = latest[0], latest[-1]
        return {"pids": len(by_pid), "pid": first.pid, "span_s": round(last.at_s - first.at_s, 1),
                "rss_first_mb": round(first.rss_bytes / 2**20, 1), "rss_last_mb": round(last.rss_bytes / 2**20, 1),
                "rss_max_mb": round(max(s.rss_bytes for s in samples) / 2**20, 1),
                "rss_growth_pct": round(100 * (last.rss_bytes - first.rss_bytes) / first.rss_bytes, 2),
                "fds_first": first.fds, "fds_last": last.fds, "fds_max": max(s.fds for s in samples),
                "threads_first": first.threads, "threads_last": last.threads,
                "threads_max": max(s.threads for s in samples),
                "sessions_max": max((n for t, n in self.sessions if t >= since_s), default=None),
                "sessions_last": self.sessions[-1][1] if self.sessions else None}


@dataclass(frozen=True)
class Watched:
    """A process to sample: its current pid (a callable: restarts change it), and, for a worker, its address and
    role (to read its sessions)."""

    pid: Callable[[], int | None]
    address: str | None = None
    role: str | None = None


class Sampler:
    """Samples every watched process each `interval_s` on a daemon thread, until stop()."""

    def __init__(self, watched: dict[str, Watched], interval_s: float = 2.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.watched, self.interval_s = watched, interval_s
        self.series: dict[str, Series] = {name: Series() for name in watched}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def sample_now(self) -> None:
        for name, w in self.watched.items():
            pid = w.pid()
            sample = sample_process(pid) if pid is not None else None
            if sample is not None:
                self.series[name].processes.append(sample)
            if w.address is not None:
                sessions = active_sessions(w.address, w.role)
                if sessions is not None:
                    self.series[name].sessions.append((time.monotonic(), sessions))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_now()
            self._stop.wait(self.interval_s)

    def summary(self, since_s: float = 0.0) -> dict[str, dict]:
        return {name: series.summary(since_s) for name, series in self.series.items()}


def wait_drained(workers: dict[str, tuple[str, str]], timeout_s: float, interval_s: float = 0.5) -> float | None:
    """Seconds until every worker ({name: (address, role)}) answers Info with zero sessions; None if some worker still
    held sessions (or did not answer) after `timeout_s`."""
    started = time.monotonic()
    while True:
        counts = [active_sessions(address, role) for address, role in workers.values()]
        if all(n == 0 for n in counts):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            return None
        time.sleep(interval_s)
