"""The benchmark's prompt set and the selection of prompts a run measures."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.json")


def load_prompts(path: Path, classes: list[str], limit: str | None, ids: list[str] | None) -> list[dict]:
    prompts = json.loads(path.read_text())["prompts"]
    known = sorted({p["class"] for p in prompts})
    for c in classes:
        if c not in known:
            raise ValueError(f"unknown prompt class {c!r}; {path.name} has {', '.join(known)}")
    if ids:
        missing = set(ids) - {p["id"] for p in prompts}
        if missing:
            raise ValueError(f"unknown prompt ids: {', '.join(sorted(missing))}")
        prompts = [p for p in prompts if p["id"] in ids]
    per_class: dict[str, int] = {}
    if limit:
        if "=" in limit:
            for item in limit.split(","):
                name, _, n = item.partition("=")
                per_class[name.strip()] = int(n)
        else:
            per_class = {c: int(limit) for c in classes}
    selected = []
    for c in classes:
        of_class = [p for p in prompts if p["class"] == c]
        selected += of_class[:per_class[c]] if c in per_class else of_class
    if not selected:
        raise ValueError("no prompts selected")
    return selected
