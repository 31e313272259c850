"""--record FILE.jsonl: one JSON line per generation (prompt, output, token ids, sampling, per-round counts and
timings), appended safely from concurrent generations. `scripts/report.py` summarises such files."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class Recorder:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, *, session_id: str, prompt, prompt_ids: list[int], options, result) -> None:
        entry = {
            "time": time.time(),
            "session_id": session_id,
            "prompt": prompt if isinstance(prompt, str) else None,
            "prompt_ids": prompt_ids,
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "sampling": {"temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k,
                         "seed": result.stats.get("seed"), "max_new_tokens": options.max_new_tokens,
                         "draft_tokens": options.draft_tokens, "stop": list(options.stop)},
            "stats": result.stats,
            "rounds": [{"drafted": r.drafted, "accepted": r.accepted, "draft_s": round(r.draft_s, 6),
                        "verify_s": round(r.verify_s, 6), **({"source": r.source} if r.source else {})}
                       for r in result.rounds],
        }
        line = json.dumps(entry, ensure_ascii=False) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line)
