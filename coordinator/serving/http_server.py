"""Running the HTTP API: uvicorn, with a drain on SIGTERM.

On SIGTERM the server first drains: /health answers 503 ("draining") so load balancers stop routing to it, new
requests get 503 with Retry-After, and the requests running or waiting go on, for up to `grace_s` seconds. Then what is
still running is cancelled and uvicorn stops as usual. SIGINT (Ctrl-C) stops at once, cancelling what runs.
"""

from __future__ import annotations

import logging
import signal
import threading

import uvicorn

from coordinator.serving.http_api import CompletionsAPI

log = logging.getLogger("specmesh.http")

CANCEL_WAIT_S = 5.0  # after the grace period: how long cancelled generations get to end their sessions


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, api: CompletionsAPI, grace_s: float) -> None:
        super().__init__(config)
        self.api, self.grace_s = api, grace_s

    def handle_exit(self, sig: int, frame) -> None:
        # Called in the signal handler: only flip the state here, and wait in a thread.
        if sig == signal.SIGTERM and not self.api.admission.draining:
            self.api.admission.drain()
            threading.Thread(target=self._drain_then_exit, args=(sig, frame), name="http-drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain_then_exit(self, sig: int, frame) -> None:
        admission = self.api.admission
        log.info("draining: %d requests running, %d waiting; new requests get 503 for up to %.0f s",
                 admission.active, admission.waiting, self.grace_s)
        if not admission.wait_idle(self.grace_s):
            cancelled = self.api.cancel_all("the server is shutting down")
            log.warning("grace period over: %d generations cancelled", cancelled)
            admission.wait_idle(CANCEL_WAIT_S)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self.api.cancel_all("the server is shutting down")  # nothing left after a drain; Ctrl-C: stop them now
        await super().shutdown(sockets)
