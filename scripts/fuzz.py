"""Longer fuzz run against real worker subprocesses: random and malformed Verify/Propose/EndSession requests and raw
garbage on the socket. Prints requests tried, answers by status code, crashes and hangs (both must be 0), then checks
that a valid generation is still exact. Exits non-zero on any crash, hang or wrong output.

    python scripts/fuzz.py --examples 2000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
from hypothesis import HealthCheck, given, settings

from coordinator import Coordinator, GenerationOptions
from coordinator.local_workers import LocalWorker, LocalWorkerSpec
from coordinator.worker_client import RemoteWorker
from specmesh.runtime.models import load_model

# The request strategies are the test suite's (tests/ is not an installed package): reach them from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fuzz_strategies import END, PROPER, PROPOSE, VERIFY, call, send_garbage  # noqa: E402
from tests.helpers import reference_greedy  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1000, help="requests per kind (default: 1000)")
    parser.add_argument("--garbage", type=int, default=200, help="raw garbage connections (default: 200)")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a call counts as a hang")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    answers: Counter = Counter()
    crashes: list[str] = []
    hangs: list[str] = []
    log_dir = tempfile.mkdtemp(prefix="specmesh-fuzz-")
    verifier = LocalWorker(LocalWorkerSpec("verifier", "tiny-random-qwen2", "cpu", "float64", threads=1), log_dir)
    drafter = LocalWorker(LocalWorkerSpec("drafter", "tiny-random-qwen2-b", "cpu", "float64", threads=1), log_dir)
    started = time.monotonic()
    try:
        for worker in (verifier, drafter):
            worker.wait_serving()
        clients = {"verifier": RemoteWorker(verifier.address, "verifier"),
                   "drafter": RemoteWorker(drafter.address, "drafter")}

        def record(kind: str, code: grpc.StatusCode, request) -> None:
            answers[(kind, code.name)] += 1
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                hangs.append(f"{kind}: {request!r:.300}")
            elif code not in PROPER:
                crashes.append(f"{kind} answered {code.name}: {request!r:.300}")
            for worker in (verifier, drafter):
                if worker.process.poll() is not None:
                    crashes.append(f"{worker.spec.role} process died (status {worker.process.returncode})")
                    raise SystemExit(_report(answers, crashes, hangs, started, ok_after=False))

        fuzz = settings(max_examples=args.examples, deadline=None, database=None, derandomize=False,
                        suppress_health_check=list(HealthCheck))
        def fuzzer(kind: str, strategy, method):
            @fuzz
            @given(request=strategy)
            def run(request) -> None:
                record(kind, call(method, request, args.timeout), request)
            return run

        for kind, strategy, method in (("Verify", VERIFY, clients["verifier"].stub.Verify),
                                       ("Propose", PROPOSE, clients["drafter"].stub.Propose),
                                       ("EndSession", END, clients["verifier"].stub.EndSession)):
            fuzzer(kind, strategy, method)()
            print(f"{kind}: {sum(n for (k, _), n in answers.items() if k == kind)} requests", file=sys.stderr)

        rng = random.Random(args.seed)
        for _ in range(args.garbage):
            garbage = rng.randbytes(rng.randint(1, 4096))
            try:
                send_garbage(verifier.port, garbage, reply_timeout_s=1)
                answers[("raw-socket", "closed")] += 1
            except OSError as e:
                crashes.append(f"raw socket: {e}")
        if not clients["verifier"].is_serving():
            crashes.append("verifier stopped serving after raw garbage")

        tiny = load_model("tiny-random-qwen2", device="cpu", dtype="float64")
        prompt = tiny.tokenizer("def main():")["input_ids"]
        expected = reference_greedy(tiny.model, prompt, 32, set(tiny.eos_token_ids))
        with Coordinator(verifier.address, drafter.address, tokenizer=tiny.tokenizer) as c:
            ok_after = c.generate(list(prompt), GenerationOptions(max_new_tokens=32)).token_ids == expected
        for client in clients.values():
            client.close()
    finally:
        verifier.stop()
        drafter.stop()
    return _report(answers, crashes, hangs, started, ok_after)


def _report(answers: Counter, crashes: list[str], hangs: list[str], started: float, ok_after: bool) -> int:
    tried = sum(n for (kind, _), n in answers.items())
    print(f"\nrequests tried: {tried} in {time.monotonic() - started:.0f} s")
    for (kind, code), n in sorted(answers.items()):
        print(f"  {kind:12s} {code:20s} {n}")
    print(f"crashes: {len(crashes)}\nhangs: {len(hangs)}\nvalid generation exact afterwards: {ok_after}")
    for line in (crashes + hangs)[:20]:
        print("  " + line)
    print(json.dumps({"requests": tried, "answers": {f"{k}:{c}": n for (k, c), n in answers.items()},
                      "crashes": len(crashes), "hangs": len(hangs), "exact_after": ok_after}))
    return 0 if ok_after and not crashes and not hangs else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
