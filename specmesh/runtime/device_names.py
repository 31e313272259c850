"""Which device names a flag accepts, checked without torch: a coordinator checks its flags before it starts its
workers, and importing torch there (a second of CPU) would delay them. devices.resolve_device maps a name to a
device."""

from __future__ import annotations

import re


def check_device_name(name: str) -> str:
    """The name, normalised ("auto", "cpu", "cuda" or "cuda:N"); ValueError for anything else, so that a typo fails
    loudly instead of surfacing later as an obscure tensor placement error."""
    normal = name.strip().lower()
    if normal in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", normal):
        return normal
    raise ValueError(f"unknown device {name!r}: expected auto, cpu, cuda or cuda:N")
