"""How a worker process ends: on SIGTERM or SIGINT (SignalStop), and with the process that started it
(exit_when_stdin_closes).

Signals. A worker's main thread runs every forward pass (specmesh/runtime/model_thread.py), and Python runs a signal
handler only on the main thread, between two bytecodes: while a forward pass runs in C, a handler waits for it, and
forever if the pass never returns. So the handlers on the main thread do nothing but abandon a model load; the
signals themselves are read from `signal.set_wakeup_fd`, which the C-level handler writes each signal's number into
the moment it arrives, by a thread of their own. That thread logs every signal with what the worker is doing, and:
the first one starts the graceful stop on another thread and arms a deadline (grace + EXIT_MARGIN_S: past it the
process logs every thread's stack and leaves with os._exit(1)); any later one ends the process at once
(os._exit(128 + signal)): a second Ctrl-C is how a person says "now". No state of the stop (one that raised, one
that hangs, one that finished while something else keeps the process alive) can make a signal go unanswered. One
thing no Python thread outlasts: native code that never returns while holding the GIL starves them all. If that
happens once the signal was seen, faulthandler's watchdog (a C thread, no GIL needed) still dumps the stacks and
exits BACKSTOP_S after the deadline; before, the signal waits for the GIL (forward passes release it: torch ops and
the llama.cpp calls do).

Parent. A worker started by another process (the coordinator's local workers) watches its stdin, which the parent
holds open and never writes to. End of file means the parent is gone, however it ended (SIGTERM, Ctrl-C, SIGKILL, a
crash): the kernel closes its end of the pipe in every case, and the worker sends itself SIGTERM.

Why a pipe rather than prctl(PR_SET_PDEATHSIG): the death signal fires when the parent *thread* that started the
child exits, not the parent process, so a worker started from a short-lived thread (a restart in a fault loop, a
test's helper thread) would be killed while its parent is still running; it is also Linux-only. A pipe's write end
belongs to the process and is closed exactly when the last holder is gone (Popen's pipes are close-on-exec and not
inherited by the parent's other children)."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

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


EXIT_MARGIN_S = 10.0  # after the first signal, how long beyond the grace period the process may take to end
BACKSTOP_S = 3.0  # how long after the deadline faulthandler's watchdog ends a process whose Python threads are stuck
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def main_thread_at() -> str:
    """Where the main thread is now: the innermost function, file and line ("?" if it cannot be seen)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "?"
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def exit_now(code: int, message: str, *args, stacks: bool = False) -> None:
    """Log `message` (and every thread's stack), then os._exit(code). The logging runs on a helper thread given two
    seconds: a blocked stderr (a full pipe nobody reads) must not keep the process alive."""

    def say() -> None:
        log.error(message, *args)
        if stacks:
            try:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    try:
        helper = threading.Thread(target=say, name="exit-log", daemon=True)
        helper.start()
        helper.join(2.0)
    finally:  # even if no thread can be started
        os._exit(code)


class SignalStop:
    """SIGTERM and SIGINT for a worker process: every one logged and answered, whatever the main thread is doing (the
    module's docstring says how). `stop()` is the graceful stop (it may block for the grace period); `state()` says
    what the worker is doing, for the log lines; `on_main_thread(signum, frame)`, if given, also runs on the main
    thread when it gets to the signal (what abandons a model load)."""

    def __init__(self, stop: Callable[[], None], grace_s: float, state: Callable[[], str] = lambda: "",
                 on_main_thread: Callable | None = None, exit_margin_s: float = EXIT_MARGIN_S) -> None:
        self._stop, self._state, self._on_main_thread = stop, state, on_main_thread
        self.deadline_s = max(grace_s, 0.0) + exit_margin_s
        self._lock = threading.Lock()
        self.received: list[int] = []  # signal numbers, in the order they came
        self.first_at = 0.0  # time.monotonic() of the first signal
        self._ended = threading.Event()  # set by uninstall(): the deadline no longer applies
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None

    def install(self) -> None:
        """From the main thread (Python's rule for signal handlers)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block; the pipe never fills (read at once)
        self._pipe = (read_fd, write_fd)
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle_on_main_thread)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._read, args=(read_fd,), name="signals", daemon=True).start()

    def uninstall(self) -> None:
        """Restore the previous handlers (for callers that go on running after the worker, tests); from the main
        thread."""
        self._ended.set()
        if self.received:
            faulthandler.cancel_dump_traceback_later()
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self._pipe[1])  # the reading thread sees end of file and ends; it closes its end
        self._pipe = None

    def _handle_on_main_thread(self, signum, frame) -> None:
        # Nothing else here: logging or starting threads from a handler can deadlock on a lock the interrupted code
        # holds, and the reading thread acts on the signal anyway.
        if self._on_main_thread is not None:
            self._on_main_thread(signum, frame)

    def _read(self, read_fd: int) -> None:
        try:
            while chunk := os.read(read_fd, 64):
                for signum in chunk:
                    try:
                        self.receive(signum)
                    except Exception:  # a signal that cannot be acted on (no thread can be started): end now
                        log.exception("could not act on signal %d", signum)
                        exit_now(1, "exiting now: a signal could not be acted on")
        finally:
            os.close(read_fd)

    def _describe(self) -> str:
        try:
            state = self._state()
        except Exception as e:  # a log line must not depend on the state being readable
            state = f"state unknown: {e!r}"
        return f"{state}{'; ' if state else ''}main thread in {main_thread_at()}"

    def receive(self, signum: int) -> None:
        """Act on one signal (called by the reading thread; tests may call it directly)."""
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        if signum not in SIGNALS:
            log.info("received %s (%s): ignored", name, self._describe())
            return
        with self._lock:
            self.received.append(signum)
            first = len(self.received) == 1
            if first:
                self.first_at = time.monotonic()
        if not first:
            exit_now(128 + signum, "received %s %.1f s after %s (%s): exiting now", name,
                     time.monotonic() - self.first_at, signal.Signals(self.received[0]).name, self._describe())
            return
        # The deadline first: even a log line that cannot be written (a full stderr pipe) cannot keep the process.
        threading.Thread(target=self._exit_at_deadline, name="exit-deadline", daemon=True).start()
        try:
            faulthandler.dump_traceback_later(self.deadline_s + BACKSTOP_S, exit=True, file=sys.stderr)
        except (AttributeError, OSError, ValueError, RuntimeError):  # a stderr without a file descriptor
            pass
        log.info("received %s (%s): stopping; the process ends within %g s, at once on another signal", name,
                 self._describe(), self.deadline_s)
        threading.Thread(target=self._run_stop, name="stop", daemon=True).start()

    def _run_stop(self) -> None:
        try:
            self._stop()
        except BaseException:
            log.exception("the stop raised (%s); the process still ends", self._describe())

    def _exit_at_deadline(self) -> None:
        if self._ended.wait(self.deadline_s):
            return
        exit_now(1, "still running %g s after %s (%s): exiting now; every thread's stack follows",
                 self.deadline_s, signal.Signals(self.received[0]).name, self._describe(), stacks=True)
