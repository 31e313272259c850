"""Chaos soak: real drafters and verifiers (loopback subprocesses) SIGKILLed / SIGTERMed at random points of random
generations and restarted on the same port; every output must equal the fault-free output exactly.

First runs each prompt with every worker up (the fault-free reference and its wall time; for tiny float64 models
also checked against the target model's own greedy decoding in this process), then runs --generations generations
over one long-lived Coordinator. Each generation draws faults with --kill-probability: a victim (the verifier the
session is pinned on with --pinned-bias, else any worker that is up), a signal (SIGKILL or SIGTERM) and a point (the
n-th text callback, or a timer within the fault-free wall time). A killed worker is restarted on its port after
--restart-delay. Reports:

    completed, faults by kind, mismatches (must be 0), lost tokens (must be 0), generations failed cleanly
    (GenerationFailed whose partial output is a prefix of the reference), p50/p99 of the latency faults add,
    and a final JSON summary line. Exits 1 on any mismatch, lost token or unclean failure.

    .venv/bin/python scripts/chaos.py --generations 30 --seed 1
    .venv/bin/python scripts/chaos.py --target-model qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct --dtype auto --device auto --generations 50

With --serve it runs the HTTP service under load and faults instead (scripts/chaos_serve.py, `--serve --help`).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos_common import PROMPTS, Slot, log, percentile  # this script's directory is on sys.path
from coordinator import Coordinator, GenerationOptions
from coordinator.api import GenerationFailed
from coordinator.fleet.local_workers import LocalWorkerSpec
from coordinator.fleet.resilience import ResilienceConfig


@dataclass
class Reference:
    prompt: str
    token_ids: list[int]
    text: str
    finish_reason: str
    wall_s: float


@dataclass
class Outcome:
    index: int
    prompt: int
    faults: list[str] = field(default_factory=list)
    status: str = ""  # "ok", "failed-cleanly", "mismatch", "lost-tokens", "unclean"
    wall_s: float = 0.0
    added_s: float = 0.0
    failover_round_s: float | None = None
    lost: int = 0  # tokens missing from a completed generation
    stats: dict = field(default_factory=dict)
    detail: str = ""


def model_reference(model_name: str, prompts_ids: list[list[int]], max_new: int, dtype: str) -> list[list[int]]:
    from specmesh.runtime.models import load_model
    from tests.helpers import reference_greedy
    loaded = load_model(model_name, device="cpu", dtype=dtype)
    return [reference_greedy(loaded.model, ids, max_new, set(loaded.eos_token_ids)) for ids in prompts_ids]


def main() -> int:
    if "--serve" in sys.argv[1:]:
        import chaos_serve  # the HTTP scenario, with its own flags (this script's directory is on sys.path)
        return chaos_serve.main([a for a in sys.argv[1:] if a != "--serve"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true",
                        help="run the HTTP scenario instead: `coordinator serve` in front of the workers, concurrent "
                        "streaming clients, kills, pauses and restarts, leak sampling (scripts/chaos_serve.py; its "
                        "flags: chaos.py --serve --help)")
    parser.add_argument("--generations", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault schedule (victims, signals, points)")
    parser.add_argument("--kill-probability", type=float, default=0.5,
                        help="chance that a generation gets a fault; each further fault (up to --max-faults) "
                             "follows with the same chance")
    parser.add_argument("--max-faults", type=int, default=2, help="faults per generation at most")
    parser.add_argument("--sigkill-share", type=float, default=0.6,
                        help="share of faults that are SIGKILL (else SIGTERM)")
    parser.add_argument("--pinned-bias", type=float, default=0.5,
                        help="chance that the victim is the verifier the session is pinned on")
    parser.add_argument("--restart-delay", type=float, default=0.5, help="seconds between a worker's exit and restart")
    parser.add_argument("--verifiers", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--drafters", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--target-model", default="tiny-random-qwen2")
    parser.add_argument("--draft-model", default="tiny-random-qwen2-b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (0: torch's choice)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--draft-tokens", default="3", help="k, or 'adaptive'")
    parser.add_argument("--temperature", type=float, default=0.0, help=">0: seeded sampling (seed fixed per prompt)")
    parser.add_argument("--grace", type=float, default=1.0, help="workers' SIGTERM drain period")
    parser.add_argument("--verify-timeout", type=float, default=2.0)
    parser.add_argument("--propose-timeout", type=float, default=2.0)
    parser.add_argument("--retry-budget", type=float, default=30.0)
    parser.add_argument("--breaker-reset", type=float, default=1.0)
    parser.add_argument("--overlap", action="store_true",
                        help="start a faulted generation without waiting for earlier restarts (faults pile up)")
    parser.add_argument("--restart-timeout", type=float, default=300.0,
                        help="seconds a killed worker has to be SERVING again")
    parser.add_argument("--time-limit", type=float, default=900.0,
                        help="no new generation starts after this many seconds of soak")
    parser.add_argument("--no-model-check", action="store_true",
                        help="skip checking the fault-free output against in-process greedy decoding (tiny models)")
    parser.add_argument("--json", dest="json_path", help="also write the summary and every generation here")
    args = parser.parse_args()
    if args.generations < 1 or not 0 <= args.kill_probability <= 1:
        parser.error("--generations must be >= 1 and --kill-probability in [0, 1]")

    rng = random.Random(args.seed)
    draft_tokens = None if args.draft_tokens == "adaptive" else int(args.draft_tokens)
    threads = args.threads or None
    resilience = ResilienceConfig(verify_timeout_s=args.verify_timeout, propose_timeout_s=args.propose_timeout,
                                  retry_budget_s=args.retry_budget, backoff_initial_s=0.05, backoff_max_s=0.5,
                                  breaker_fail_max=1, breaker_reset_s=args.breaker_reset)
    started = time.monotonic()
    outcomes: list[Outcome] = []
    fault_counts: dict[str, int] = {}
    seen_lag: list[float] = []
    with tempfile.TemporaryDirectory(prefix="specmesh-chaos-") as log_dir:
        extra = ("--grace", str(args.grace))
        slots = [Slot(f"verifier{i}", LocalWorkerSpec("verifier", args.target_model, args.device, args.dtype,
                                                      threads, 0, extra), log_dir) for i in range(args.verifiers)]
        slots += [Slot(f"drafter{i}", LocalWorkerSpec("drafter", args.draft_model, args.device, args.dtype,
                                                      threads, 0, extra), log_dir) for i in range(args.drafters)]
        try:
            for slot in slots:
                slot.start(wait=False)
            for slot in slots:
                slot.worker.wait_serving(timeout_s=1800)
                slot.up.set()
            log(f"workers up in {time.monotonic() - started:.1f} s: "
                + ", ".join(f"{s.name}@{s.address}" for s in slots))
            verifiers = [s for s in slots if s.spec.role == "verifier"]
            drafters = [s for s in slots if s.spec.role == "drafter"]
            with Coordinator([s.address for s in verifiers], [s.address for s in drafters] or None,
                             resilience=resilience) as c:
                options = [GenerationOptions(max_new_tokens=args.max_new_tokens, draft_tokens=draft_tokens,
                                             temperature=args.temperature, seed=1000 + i, chat=False)
                           for i in range(len(PROMPTS))]
                references = baseline(c, options, args)
                if not references:
                    return 1
                soak(c, args, rng, slots, verifiers, references, options, outcomes, fault_counts, seen_lag)
        finally:
            for slot in slots:
                slot.stop()
        restarts = [t for s in slots for t in s.restart_s]
        restart_failures = sum(s.restart_failures for s in slots)
    return report(args, outcomes, fault_counts, restarts, restart_failures, seen_lag, time.monotonic() - started)


def baseline(c: Coordinator, options: list[GenerationOptions], args) -> list[Reference] | None:
    """Each prompt twice with every worker up: both runs must agree; the faster wall time is the baseline."""
    c.generate(PROMPTS[0], GenerationOptions(max_new_tokens=4, draft_tokens=options[0].draft_tokens, chat=False))
    references = []
    for prompt, option in zip(PROMPTS, options):
        runs = []
        for _ in range(2):
            t0 = time.monotonic()
            r = c.generate(prompt, option)
            runs.append((time.monotonic() - t0, r))
        if runs[0][1].token_ids != runs[1][1].token_ids:
            log(f"fault-free runs disagree for {prompt!r}: not deterministic, cannot soak")
            return None
        r = runs[0][1]
        references.append(Reference(prompt, r.token_ids, r.text, r.finish_reason, min(t for t, _ in runs)))
        log(f"reference {len(references) - 1}: {len(r.token_ids)} tokens ({r.finish_reason}) in "
            f"{references[-1].wall_s:.2f} s")
    if args.temperature == 0 and not args.no_model_check and args.target_model.startswith("tiny-random-"):
        ids = [c.encode_prompt(p, chat=False) for p in PROMPTS]
        for i, want in enumerate(model_reference(args.target_model, ids, args.max_new_tokens, args.dtype)):
            if references[i].token_ids != want:
                log(f"fault-free output of prompt {i} differs from the target's own greedy decoding")
                return None
        log("fault-free outputs equal the target model's own greedy decoding")
    return references


def soak(c: Coordinator, args, rng: random.Random, slots: list[Slot], verifiers: list[Slot],
         references: list[Reference], options: list[GenerationOptions], outcomes: list[Outcome],
         fault_counts: dict[str, int], seen_lag: list[float]) -> None:
    soak_started = time.monotonic()

    def measure_lag(slot: Slot) -> None:
        """How long after a restarted worker is SERVING (to a fresh channel) the coordinator's pool sees it."""
        pool = c.verifiers if slot.spec.role == "verifier" else c.drafters
        endpoint = next(e for e in pool.endpoints if e.address == slot.address)
        up_at = time.monotonic()
        while not endpoint.serving and time.monotonic() - up_at < 120:
            time.sleep(0.02)
        seen_lag.append(time.monotonic() - up_at)

    for slot in slots:
        slot.on_up = lambda slot: threading.Thread(target=measure_lag, args=(slot,), daemon=True).start()
    for index in range(args.generations):
        if time.monotonic() - soak_started > args.time_limit:
            log(f"time limit reached after {index} generations")
            break
        p = rng.randrange(len(PROMPTS))
        ref = references[p]
        outcome = Outcome(index, p)
        # Draw this generation's faults up front, so one seed gives one schedule.
        plan = []
        while len(plan) < args.max_faults and rng.random() < args.kill_probability:
            point = ("callback", rng.randint(1, max(1, len(ref.token_ids) // 2))) if rng.random() < 0.6 else \
                ("timer", rng.uniform(0.0, ref.wall_s))
            plan.append({"signal": signal.SIGKILL if rng.random() < args.sigkill_share else signal.SIGTERM,
                         "pinned": rng.random() < args.pinned_bias, "pick": rng.random(), "point": point})
        if plan and not args.overlap:
            # A faulted generation starts from a full fleet, as the coordinator sees it (every endpoint SERVING with
            # a breaker that lets calls through; bounded wait): its faults are the only ones it sees. Fault-free
            # generations run while earlier restarts are still under way.
            for slot in slots:
                slot.up.wait(timeout=max(0.0, slot.restart_deadline - time.monotonic()))
            endpoints = [e for pool in (c.verifiers, c.drafters) if pool is not None for e in pool.endpoints]
            wait_until = time.monotonic() + 30
            while not all(e.usable() for e in endpoints) and time.monotonic() < wait_until:
                time.sleep(0.02)
        deadline = time.monotonic() + args.restart_timeout  # a killed worker must be back by then
        lock = threading.Lock()

        def inject(fault: dict) -> None:
            with lock:
                pinned = next((s for s in verifiers for e in c.verifiers.endpoints
                               if e.address == s.address and e.sessions > 0), None)
                up = [s for s in slots if s.up.is_set()]
                victim = pinned if fault["pinned"] and pinned in up else (
                    up[int(fault["pick"] * len(up))] if up else None)
                signame = "sigkill" if fault["signal"] == signal.SIGKILL else "sigterm"
                if victim is None or not victim.signal(fault["signal"], args.restart_delay, args.grace, deadline):
                    outcome.faults.append(f"{signame}-skipped(no worker up)")
                    return
                kind = f"{signame}-{victim.spec.role}"
                fault_counts[kind] = fault_counts.get(kind, 0) + 1
                where = "@cb" if fault["point"][0] == "callback" else "@t"
                outcome.faults.append(f"{kind}{'(pinned)' if victim is pinned else ''}:{victim.name}"
                                      f"{where}{fault['point'][1]:.3g}")

        calls = [0]
        by_call = {}
        for fault in plan:
            if fault["point"][0] == "callback":
                by_call.setdefault(fault["point"][1], []).append(fault)

        def on_text(text: str) -> None:
            calls[0] += 1
            for fault in by_call.pop(calls[0], []):
                inject(fault)

        done = threading.Event()
        timers = []
        for fault in plan:
            if fault["point"][0] == "timer":
                def fire(fault=fault) -> None:
                    if not done.wait(fault["point"][1]):
                        inject(fault)
                timers.append(threading.Thread(target=fire, daemon=True))
        t0 = time.monotonic()
        for timer in timers:
            timer.start()
        try:
            result = c.generate(ref.prompt, options[p], on_text=on_text)
            tokens, text, finish, error = result.token_ids, result.text, result.finish_reason, None
            outcome.stats = result.stats
            rounds = result.rounds
        except GenerationFailed as e:
            tokens, text, finish, error = e.partial.token_ids, e.partial.text, "error", str(e)
            outcome.stats = e.partial.stats
            rounds = e.partial.rounds
        except Exception as e:  # anything else escaping generate() is a bug: not a clean failure
            tokens, text, finish, error, rounds = [], "", "unclean", f"{type(e).__name__}: {e}", []
        outcome.wall_s = time.monotonic() - t0
        done.set()
        for timer in timers:
            timer.join()
        outcome.added_s = outcome.wall_s - ref.wall_s
        verify = [r.verify_s for r in rounds]
        if len(verify) >= 3 and (outcome.stats.get("failovers") or outcome.stats.get("retries")):
            outcome.failover_round_s = max(verify) - statistics.median(verify)

        if finish == "unclean":
            outcome.status, outcome.detail = "unclean", error
        elif tokens != ref.token_ids[:len(tokens)] or len(tokens) > len(ref.token_ids):
            first = next((i for i, (a, b) in enumerate(zip(tokens, ref.token_ids)) if a != b), len(ref.token_ids))
            outcome.status, outcome.detail = "mismatch", f"first differing token at {first}"
        elif finish == "error":
            outcome.status, outcome.detail = "failed-cleanly", f"{len(tokens)}/{len(ref.token_ids)} tokens: {error}"
        elif len(tokens) < len(ref.token_ids) and finish != "stop":
            outcome.lost = len(ref.token_ids) - len(tokens)
            outcome.status, outcome.detail = "lost-tokens", f"{outcome.lost} tokens short"
        elif text != ref.text or finish != ref.finish_reason:
            outcome.status, outcome.detail = "mismatch", f"text or finish reason differ ({finish})"
        else:
            outcome.status = "ok"
        outcomes.append(outcome)
        s = outcome.stats
        log(f"gen {index + 1:3d}/{args.generations} p{p} {outcome.status:14s} {len(tokens):3d} tok "
            f"{outcome.wall_s:6.2f} s ({outcome.added_s:+.2f}) retries={s.get('retries', 0)} "
            f"failovers={s.get('failovers', 0)} degraded={s.get('degraded_rounds', 0)} "
            f"resyncs={s.get('resyncs', 0)} faults={outcome.faults or '-'}"
            + (f" | {outcome.detail}" if outcome.detail else ""))


def report(args, outcomes: list[Outcome], fault_counts: dict[str, int], restart_s: list[float],
           restart_failures: int, seen_lag: list[float], total_s: float) -> int:
    restarts = len(restart_s)
    def count(status: str) -> int:
        return sum(o.status == status for o in outcomes)

    faulted = [o for o in outcomes if o.status == "ok" and any("skipped" not in f for f in o.faults)]
    # A failover proper: the session moved while another verifier was up. When every verifier was hit in one
    # generation it waited for a restart instead (an outage, reported apart).
    outage = [o for o in faulted if sum("-verifier" in f for f in o.faults) >= args.verifiers]
    failed_over = [o for o in faulted if o.stats.get("failovers") and o not in outage]
    added = [o.added_s for o in faulted]
    # Wall time against the fault-free wall time means something only when the generation drafted like the
    # fault-free one did (with a degraded drafter it decodes target-only: faster or slower depending on acceptance).
    added_failover = [o.added_s for o in failed_over if not o.stats.get("degraded_rounds")]
    rounds = [o.failover_round_s for o in failed_over if o.failover_round_s is not None]
    clean = [o.added_s for o in outcomes if o.status == "ok" and not o.faults]
    summary = {
        "generations": len(outcomes),
        "completed": count("ok"),
        "faults_injected": sum(fault_counts.values()),
        "faults_by_kind": dict(sorted(fault_counts.items())),
        "restarts": restarts,
        "restart_to_serving_p50_s": percentile(restart_s, 50),
        "restart_to_serving_max_s": round(max(restart_s), 2) if restart_s else None,
        "coordinator_sees_restart_p50_s": percentile(seen_lag, 50),
        "coordinator_sees_restart_max_s": round(max(seen_lag), 2) if seen_lag else None,
        "restart_failures": restart_failures,
        "mismatches": count("mismatch"),
        "lost_tokens": sum(o.lost for o in outcomes),
        "lost_token_generations": count("lost-tokens"),
        "failed_cleanly": count("failed-cleanly"),
        "failed_uncleanly": count("unclean"),
        "generations_with_failover": len(failed_over),
        "generations_with_every_verifier_down": len(outage),
        "added_latency_outage_max_s": round(max(o.added_s for o in outage), 3) if outage else None,
        "retries": sum(o.stats.get("retries", 0) for o in outcomes),
        "failovers": sum(o.stats.get("failovers", 0) for o in outcomes),
        "degraded_rounds": sum(o.stats.get("degraded_rounds", 0) for o in outcomes),
        "resyncs": sum(o.stats.get("resyncs", 0) for o in outcomes),
        "added_latency_failover_p50_s": percentile(added_failover, 50),
        "added_latency_failover_p99_s": percentile(added_failover, 99),
        "added_latency_any_fault_p50_s": percentile(added, 50),
        "added_latency_any_fault_p99_s": percentile(added, 99),
        "failover_round_extra_p50_s": percentile(rounds, 50),
        "failover_round_extra_p99_s": percentile(rounds, 99),
        "fault_free_jitter_p50_s": percentile(clean, 50),
        "total_s": round(total_s, 1),
        "seed": args.seed,
        "target_model": args.target_model,
        "draft_model": args.draft_model if args.drafters else None,
    }
    print(f"generations completed    {summary['completed']}/{summary['generations']}")
    print(f"faults injected          {summary['faults_injected']} {summary['faults_by_kind']} "
          f"({restarts} restarts, {restart_failures} failed; kill to SERVING p50 "
          f"{summary['restart_to_serving_p50_s']} s, the coordinator sees it p50 "
          f"{summary['coordinator_sees_restart_p50_s']} s / max {summary['coordinator_sees_restart_max_s']} s later)")
    print(f"mismatches               {summary['mismatches']}")
    print(f"lost tokens              {summary['lost_tokens']}")
    print(f"failed cleanly           {summary['failed_cleanly']} (uncleanly: {summary['failed_uncleanly']})")
    print(f"retries/failovers        {summary['retries']}/{summary['failovers']} "
          f"(degraded rounds {summary['degraded_rounds']}, resyncs {summary['resyncs']})")
    print(f"every verifier down      {len(outage)} generations, waited for a restart: at most "
          f"{summary['added_latency_outage_max_s']} s added")
    print(f"latency a failover adds  p50 {summary['added_latency_failover_p50_s']} s, "
          f"p99 {summary['added_latency_failover_p99_s']} s over the fault-free wall time "
          f"({len(added_failover)} generations without degraded rounds); the failover round itself p50 "
          f"{summary['failover_round_extra_p50_s']} s, p99 {summary['failover_round_extra_p99_s']} s")
    for o in outcomes:
        if o.status in ("mismatch", "lost-tokens", "unclean"):
            print(f"  generation {o.index} (prompt {o.prompt}): {o.status}: {o.detail}; faults {o.faults}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"summary": summary, "generations": [o.__dict__ for o in outcomes]},
                                                   indent=1, default=str))
    print(json.dumps(summary), flush=True)
    return 1 if summary["mismatches"] or summary["lost_token_generations"] or summary["failed_uncleanly"] else 0


if __name__ == "__main__":
    sys.exit(main())
