"""Longer fuzz run against real worker subprocesses and `coordinator serve` in front of them: random and malformed
Verify/Propose/EndSession requests, raw garbage on the gRPC socket, and HTTP requests to the OpenAI API (malformed
JSON, wrong types, huge values, invalid UTF-8, lone surrogates, unknown fields, oversized bodies, other routes and
methods). Prints requests tried, answers by status code, crashes (a gRPC handler error, a 5xx, a dead process),
hangs (all must be 0) and each server's resident memory after a warm-up and at the end, then checks that a valid
generation is still exact. Exits non-zero on any crash, hang, wrong output or RSS growth over --max-rss-growth.

    python scripts/fuzz.py --examples 2000 --http-examples 4000     # 10,200 requests
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
import httpx
from hypothesis import HealthCheck, given, settings

from chaos_serve import Server  # this script's directory is on sys.path
from coordinator import Coordinator, GenerationOptions
from specmesh_bench.soak import sample_process
from coordinator.fleet.local_workers import LocalWorker, LocalWorkerSpec
from coordinator.fleet.worker_client import RemoteWorker
from specmesh.runtime.models import load_model

# The request strategies are the test suite's (tests/ is not an installed package): reach them from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fuzz_strategies import (END, FOUND_END, FOUND_HTTP, FOUND_PROPOSE, FOUND_VERIFY, HTTP_REQUEST,  # noqa: E402
                                   PROPER, PROPOSE, VERIFY, call, found, http_call, send_garbage)
from tests.helpers import reference_greedy  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1000, help="requests per kind (default: 1000)")
    parser.add_argument("--garbage", type=int, default=200, help="raw garbage connections (default: 200)")
    parser.add_argument("--http-examples", type=int, default=1000,
                        help="HTTP requests to coordinator serve (default: 1000)")
    parser.add_argument("--warmup", type=int, default=300,
                        help="requests each server gets before its 'before' RSS is taken (default: 300)")
    parser.add_argument("--max-rss-growth", type=float, default=5.0,
                        help="percent RSS growth from after the warm-up to the end allowed per server (default: 5)")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="seconds before a call counts as a hang (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the raw garbage (default: 0)")
    args = parser.parse_args()

    answers: Counter = Counter()
    crashes: list[str] = []
    hangs: list[str] = []
    log_dir = tempfile.mkdtemp(prefix="specmesh-fuzz-")
    verifier = LocalWorker(LocalWorkerSpec("verifier", "tiny-random-qwen2", "cpu", "float64", threads=1), log_dir)
    drafter = LocalWorker(LocalWorkerSpec("drafter", "tiny-random-qwen2-b", "cpu", "float64", threads=1), log_dir)
    started = time.monotonic()
    server = None
    rss: dict[str, list[int]] = {}  # server name -> [after warm-up, at the end] resident bytes
    try:
        for worker in (verifier, drafter):
            worker.wait_serving()
        server = Server(["--verifier", verifier.address, "--drafter", drafter.address, "--default-max-tokens", "6",
                         "--log-level", "WARNING"], log_dir)
        pids = {"verifier": verifier.process.pid, "drafter": drafter.process.pid, "coordinator": server.process.pid}

        def take_rss(names: tuple[str, ...]) -> None:
            for name in names:
                sample = sample_process(pids[name])
                if sample is not None:
                    rss.setdefault(name, []).append(sample.rss_bytes)
        clients = {"verifier": RemoteWorker(verifier.address, "verifier"),
                   "drafter": RemoteWorker(drafter.address, "drafter")}

        def record(kind: str, code: grpc.StatusCode, request) -> None:
            answers[(kind, code.name)] += 1
            if sum(n for (k, _), n in answers.items() if k != "HTTP") == args.warmup:
                take_rss(("verifier", "drafter"))
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                hangs.append(f"{kind}: {request!r:.300}")
            elif code not in PROPER:
                crashes.append(f"{kind} answered {code.name}: {request!r:.300}")
            for worker in (verifier, drafter):
                if worker.process.poll() is not None:
                    crashes.append(f"{worker.spec.role} process died (status {worker.process.returncode})")
                    raise SystemExit(_report(answers, crashes, hangs, started, False, rss, args.max_rss_growth))

        fuzz = settings(max_examples=args.examples, deadline=None, database=None, derandomize=False,
                        suppress_health_check=list(HealthCheck))
        def fuzzer(kind: str, strategy, method, found_before):
            @fuzz
            @given(request=strategy)
            @found("request", found_before)  # every input found failing so far first, then random ones
            def run(request) -> None:
                record(kind, call(method, request, args.timeout), request)
            return run

        for kind, strategy, method, found_before in (
                ("Verify", VERIFY, clients["verifier"].stub.Verify, FOUND_VERIFY),
                ("Propose", PROPOSE, clients["drafter"].stub.Propose, FOUND_PROPOSE),
                ("EndSession", END, clients["verifier"].stub.EndSession, FOUND_END)):
            fuzzer(kind, strategy, method, found_before)()
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

        http = httpx.Client(base_url=server.url, timeout=args.timeout)
        http_sent = [0]

        @settings(fuzz, max_examples=args.http_examples)
        @given(request=HTTP_REQUEST)
        @found("request", FOUND_HTTP)
        def fuzz_http(request) -> None:
            status, failed = http_call(http, *request)
            answers[("HTTP", str(status))] += 1
            http_sent[0] += 1
            if http_sent[0] == args.warmup:
                take_rss(("coordinator",))
            if status == "hang":
                hangs.append(f"HTTP: {request!r:.300}")
            elif failed:
                crashes.append(f"HTTP answered {status}: {request!r:.300}")
            if server.process.poll() is not None:
                crashes.append(f"coordinator serve died (status {server.process.returncode})")
                raise SystemExit(_report(answers, crashes, hangs, started, False, rss, args.max_rss_growth))

        fuzz_http()
        print(f"HTTP: {http_sent[0]} requests", file=sys.stderr)
        http.close()

        tiny = load_model("tiny-random-qwen2", device="cpu", dtype="float64")
        prompt = tiny.tokenizer("def main():")["input_ids"]
        expected = reference_greedy(tiny.model, prompt, 32, set(tiny.eos_token_ids))
        with Coordinator(verifier.address, drafter.address, tokenizer=tiny.tokenizer) as c:
            ok_after = c.generate(list(prompt), GenerationOptions(max_new_tokens=32)).token_ids == expected
        for client in clients.values():
            client.close()
        take_rss(("verifier", "drafter", "coordinator"))
    finally:
        if server is not None:
            server.stop()
        verifier.stop()
        drafter.stop()
    return _report(answers, crashes, hangs, started, ok_after, rss, args.max_rss_growth)


def _report(answers: Counter, crashes: list[str], hangs: list[str], started: float, ok_after: bool,
            rss: dict[str, list[int]], max_growth_pct: float) -> int:
    tried = sum(n for (kind, _), n in answers.items())
    print(f"\nrequests tried: {tried} in {time.monotonic() - started:.0f} s")
    for (kind, code), n in sorted(answers.items()):
        print(f"  {kind:12s} {code:20s} {n}")
    print(f"crashes: {len(crashes)}\nhangs: {len(hangs)}\nvalid generation exact afterwards: {ok_after}")
    growth = {}
    for name, samples in rss.items():
        if len(samples) == 2:
            growth[name] = round(100 * (samples[1] - samples[0]) / samples[0], 2)
            print(f"RSS {name:12s} {samples[0] / 2**20:8.1f} MB after the warm-up, {samples[1] / 2**20:8.1f} MB at the "
                  f"end ({growth[name]:+.2f}%)")
    for line in (crashes + hangs)[:20]:
        print("  " + line)
    print(json.dumps({"requests": tried, "answers": {f"{k}:{c}": n for (k, c), n in answers.items()},
                      "crashes": len(crashes), "hangs": len(hangs), "exact_after": ok_after,
                      "rss_mb": {name: [round(b / 2**20, 1) for b in samples] for name, samples in rss.items()},
                      "rss_growth_pct": growth}))
    grew = any(g >= max_growth_pct for g in growth.values())
    return 0 if ok_after and not crashes and not hangs and not grew else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
