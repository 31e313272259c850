"""One dedicated thread for every forward pass of a worker.

gRPC runs each call on whichever pool thread took it. Both torch (OpenMP) and llama.cpp's CPU backend keep a team of
compute threads per *calling* thread, so forwards issued from ten handler threads build ten teams whose idle members
spin on the same two cores. Running all forwards on one long-lived thread keeps exactly one team, warm.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ModelThread:
    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ident: int | None = None
        self._executor.submit(self._remember_ident).result()

    def _remember_ident(self) -> None:
        self._ident = threading.get_ident()

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the model thread (directly when already on it: nested calls must not deadlock)."""
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        return self._executor.submit(fn, *args, **kwargs).result()
