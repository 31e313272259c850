"""Ending with the parent process: a worker started by another process (the coordinator's local workers) watches its
stdin, which the parent holds open and never writes to. End of file means the parent is gone, however it ended
(SIGTERM, Ctrl-C, SIGKILL, a crash): the kernel closes its end of the pipe in every case.

Why a pipe rather than prctl(PR_SET_PDEATHSIG): the death signal fires when the parent *thread* that started the
child exits, not the parent process, so a worker started from a short-lived thread (a restart in a fault loop, a
test's helper thread) would be killed while its parent is still running; it is also Linux-only. A pipe's write end
belongs to the process and is closed exactly when the last holder is gone (Popen's pipes are close-on-exec and not
inherited by the parent's other children)."""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)


def exit_when_stdin_closes(hard_exit_after_s: float) -> threading.Thread:
    """Watch stdin from a daemon thread; at end of file send this process SIGTERM (the normal graceful stop), and if
    it is still running `hard_exit_after_s` later (a forward pass that never returns), end it with os._exit."""

    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass  # the parent never writes; anything it did is ignored
        except OSError:
            pass  # stdin closed under us: the same as end of file
        log.warning("stdin closed: the parent process is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(hard_exit_after_s)
        log.error("still running %.0f s after the parent went away; exiting now", hard_exit_after_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread
