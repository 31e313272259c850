"""Structured logs: one JSON object per line (with request and session ids) for machines, readable lines for
terminals. `auto` picks JSON unless stderr is a TTY."""

from __future__ import annotations

import contextvars
import logging
import sys

from pythonjsonlogger.json import JsonFormatter

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("specmesh_request_id", default="")
session_id: contextvars.ContextVar[str] = contextvars.ContextVar("specmesh_session_id", default="")
LOG_FORMATS = ("auto", "json", "text")


class _Ids(logging.Filter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_role = self.process
        record.request_id = request_id.get()
        record.session_id = session_id.get()
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (it may be swapped, e.g. by test runners)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(process: str, log_format: str = "auto", level: str = "INFO") -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be auto, json or text, got {log_format!r}")
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    handler = _StderrHandler()
    handler.addFilter(_Ids(process))
    if use_json:
        handler.setFormatter(JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s %(process_role)s %(request_id)s %(session_id)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger", "process_role": "process"}))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
