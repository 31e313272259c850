"""A verifier SIGKILLed while concurrent generations run on it: the sessions fail over to the other verifier, which
rebuilds their keys/values from the token history, and every answer, greedy and seeded, is the one the same request
got without the fault (tiny models in bfloat16, the workers' default options)."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

from coordinator import Coordinator, GenerationOptions
from tests.chaos.conftest import running_fleet
from tests.chaos.test_faults import FAST, pinned

TEXTS = ("def fibonacci(n):\n    ", "Once upon a time", "SELECT * FROM users WHERE", "import numpy as np\n")
MAX_NEW = 40


def test_answers_repeat_across_a_verifier_sigkill_under_load(tiny):
    work = [(text, GenerationOptions(max_new_tokens=MAX_NEW, chat=False, draft_tokens=3)) for text in TEXTS]
    work += [(text, GenerationOptions(max_new_tokens=MAX_NEW, chat=False, draft_tokens=2, temperature=0.9, top_p=0.95,
                                      seed=7 + i)) for i, text in enumerate(TEXTS)]
    with running_fleet(dtype="bfloat16") as fleet:
        workers = [fleet.start(role, wait=False) for role in ("verifier", "verifier", "drafter")]
        for worker in workers:
            worker.wait_serving(fleet.load_timeout_s)
        v1, v2, drafter = workers
        with Coordinator([v1.address, v2.address], drafter.address, tokenizer=tiny.tokenizer, resilience=FAST) as c:
            fault_free = [c.generate(text, options).token_ids for text, options in work]
            killed = []

            def kill_once(text: str) -> None:
                if not killed:
                    killed.append(fleet.by_address(pinned(c)))
                    killed[0].kill()

            def answer(i: int) -> list[int]:
                text, options = work[i]
                return c.generate(text, options, on_text=kill_once if i == 0 else None).token_ids

            with ThreadPoolExecutor(len(work)) as pool:
                faulted = list(pool.map(answer, range(len(work))))
        assert killed and killed[0].process.returncode == -signal.SIGKILL
        differ = [i for i in range(len(work)) if faulted[i] != fault_free[i]]
        assert not differ, f"{len(differ)} of {len(work)} answers changed across the failover: requests {differ}"
