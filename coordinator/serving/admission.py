"""Admission control for the HTTP API: how many generations run at once, how many requests may wait for one, and
the drain on shutdown.

Beyond `max_active` running and `max_queue` waiting, a request is refused at once (HTTP 429 with Retry-After)
instead of queueing without bound; while the server drains, every new request is refused (503). Everything here runs
on the server's event loop, except `wait_idle`, which any thread may call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

RETRY_AFTER_S = 1  # what a refused client is told to wait before trying again (whole seconds, as HTTP wants)


@dataclass(frozen=True)
class AdmissionConfig:
    max_active: int = 32  # generations running at once (each one session on the verifier fleet)
    max_queue: int = 64   # requests waiting for a running slot; more are refused

    def __post_init__(self) -> None:
        if self.max_active < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {self.max_active}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")


class Refused(Exception):
    """A request not admitted: `status` is the HTTP status to answer (429 overloaded, 503 draining)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class Admission:
    def __init__(self, config: AdmissionConfig = AdmissionConfig()) -> None:
        self.config = config
        self.active = 0
        self.waiting = 0
        self.draining = False
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the server's event loop
        self._idle = threading.Event()
        self._idle.set()

    async def enter(self) -> Callable[[], None]:
        """Wait for a running slot (or raise Refused); returns the function that gives the slot back, to be called
        on the event loop exactly once, when the generation has ended."""
        if self.draining:
            raise Refused(503, "shutting_down", "the server is shutting down; retry on another replica")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_active)
        if self._slots.locked() and self.waiting >= self.config.max_queue:
            raise Refused(429, "server_overloaded",
                          f"the server is at capacity ({self.active} requests running, {self.waiting} waiting); "
                          f"retry after {RETRY_AFTER_S} s")
        self.waiting += 1
        self._idle.clear()
        try:
            await self._slots.acquire()
        except BaseException:  # the request was cancelled while it waited
            self.waiting -= 1
            self._set_idle_if_empty()
            raise
        self.waiting -= 1
        self.active += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1
                self._slots.release()
                self._set_idle_if_empty()
        return release

    def _set_idle_if_empty(self) -> None:
        if self.active == 0 and self.waiting == 0:
            self._idle.set()

    def drain(self) -> None:
        """Refuse new requests from now on; those running or waiting go on."""
        self.draining = True

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no request runs or waits (True), or `timeout_s` passed (False). Any thread."""
        return self._idle.wait(timeout_s)
