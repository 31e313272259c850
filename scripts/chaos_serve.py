"""`scripts/chaos.py --serve`: the HTTP service under load while workers fail.

`coordinator serve` (the OpenAI API, a subprocess) runs in front of --drafters drafters and --verifiers verifiers
(loopback subprocesses). --clients threads stream requests through the official `openai` client: completions and chat,
greedy and seeded sampling, over a fixed set of prompts. First every distinct request runs with no fault (the
reference outputs and the fault-free latency), then --requests requests run while a fault loop SIGKILLs, SIGTERMs
(both followed by a restart on the same port) and pauses (SIGSTOP, then SIGCONT after --pause: a hung worker) random
workers. The loop never takes the last running verifier (so every request must succeed), never kills --spare (only
pauses it: a worker that lives through the whole soak, for the leak check), and stops once --fault-share of the
requests have been sent, so the tail shows the recovery.

All along, a sampler records the RSS, open fds and threads of every process and the sessions each worker holds
(Info). After the load stops the sessions must drain to zero (EndSession, else --session-ttl) and the RSS of every
process that lived through the soak must grow less than --max-rss-growth percent. Reports requests sent, succeeded,
failed, mismatches against the reference (greedy and seeded), tokens lost, p50/p99 latency without and with faults,
the recovery after the last fault, and the leak figures; then one JSON line. Exits 1 when a target is missed.

    .venv/bin/python scripts/chaos.py --serve --requests 500 --clients 8 --max-tokens 16
    .venv/bin/python scripts/chaos.py --serve --requests 40 --clients 4 --target-model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --dtype auto --device auto --threads 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from chaos_common import PROMPTS, Slot, log, percentile  # this script's directory is on sys.path
from specmesh_bench.soak import Sampler, Watched, wait_drained
from coordinator.fleet.local_workers import LocalWorkerSpec
from coordinator.fleet.polling import wait_until


@dataclass(frozen=True)
class RequestSpec:
    """One distinct request: its answer must be the same whatever faults happen."""

    prompt: int
    chat: bool
    seed: int | None  # None: greedy

    @property
    def name(self) -> str:
        return f"p{self.prompt}-{'chat' if self.chat else 'cmpl'}-{'greedy' if self.seed is None else self.seed}"


@dataclass
class Answer:
    spec: RequestSpec
    started_s: float = 0.0
    latency_s: float = 0.0
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    phase: str = ""  # "fault-free", "faults", "after-faults"


@dataclass
class FaultLog:
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (monotonic s, kind, worker)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, worker: str, at: float | None = None) -> None:
        with self.lock:
            self.events.append((time.monotonic() if at is None else at, kind, worker))

    def windows(self, role: str, margin_s: float) -> list[tuple[float, float]]:
        """When a worker of `role` was faulted: from each fault to its worker's next resume or restart, plus
        `margin_s` (the coordinator notices a worker is back within a breaker reset)."""
        out = []
        for i, (at, kind, worker) in enumerate(self.events):
            if worker.startswith(role) and kind not in ("resume", "up"):
                back = next((t for t, k, w in self.events[i + 1:] if w == worker and k in ("resume", "up")),
                            float("inf"))
                out.append((at, back + margin_s))
        return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="chaos.py --serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=500, help="requests sent while faults happen (default: 500)")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default: 8)")
    p.add_argument("--seeds", type=int, default=2, help="sampling seeds per prompt and endpoint; each seeded request "
                   "also runs greedy (default: 2)")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of seeded requests (default: 0.8)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default: 16)")
    p.add_argument("--draft-tokens", type=int, default=3, help="fixed draft length k of the server (default: 3)")
    p.add_argument("--verifiers", type=int, default=3, help="verifier processes (default: 3)")
    p.add_argument("--drafters", type=int, default=1, choices=(0, 1, 2), help="drafter processes (default: 1)")
    p.add_argument("--target-model", default="tiny-random-qwen2", help="(default: tiny-random-qwen2)")
    p.add_argument("--draft-model", default="tiny-random-qwen2-b", help="(default: tiny-random-qwen2-b)")
    p.add_argument("--device", default="cpu", help="(default: cpu)")
    p.add_argument("--dtype", default="float64", help="(default: float64)")
    p.add_argument("--threads", type=int, default=1, help="threads per worker, 0: the engine's choice (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seeds the request order and fault schedule (default: 0)")
    p.add_argument("--fault-interval", type=float, nargs=2, default=(1.0, 4.0), metavar=("MIN", "MAX"),
                   help="seconds between faults, drawn uniformly (default: 1 4)")
    p.add_argument("--fault-share", type=float, default=0.8,
                   help="faults stop once this share of the requests was sent (default: 0.8)")
    p.add_argument("--kinds", default="sigkill:0.4,sigterm:0.3,pause:0.3",
                   help="fault kinds and weights (default: sigkill:0.4,sigterm:0.3,pause:0.3)")
    p.add_argument("--roles", default="verifier,drafter",
                   help="roles the fault loop may hit; 'verifier' keeps the drafter up, so that every seeded request "
                   "is compared exactly (default: verifier,drafter)")
    p.add_argument("--pause", type=float, default=4.0, help="seconds a paused worker stays stopped (default: 4)")
    p.add_argument("--spare", default="verifier0",
                   help="worker never killed, only paused, so that one worker lives through the soak; '' for none "
                   "(default: verifier0)")
    p.add_argument("--restart-delay", type=float, default=0.5, help="seconds from exit to restart (default: 0.5)")
    p.add_argument("--grace", type=float, default=1.0, help="workers' SIGTERM drain seconds (default: 1)")
    p.add_argument("--session-ttl", type=float, default=20.0,
                   help="workers' idle session TTL: sessions whose EndSession was lost drain by then (default: 20)")
    p.add_argument("--rpc-timeout", type=float, default=2.0, help="coordinator's deadline per RPC (default: 2)")
    p.add_argument("--retry-budget", type=float, default=60.0,
                   help="coordinator's retry budget per step (default: 60)")
    p.add_argument("--breaker-reset", type=float, default=1.0, help="coordinator's breaker reset (default: 1)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="client timeout of one request, seconds (default: 300)")
    p.add_argument("--sample-interval", type=float, default=2.0, help="leak sampling period, seconds (default: 2)")
    p.add_argument("--max-rss-growth", type=float, default=5.0,
                   help="percent RSS growth allowed for a process that lived through the soak (default: 5)")
    p.add_argument("--load-timeout", type=float, default=1800.0, help="seconds for workers to load (default: 1800)")
    p.add_argument("--json", dest="json_path", help="also write the summary and every request here")
    args = p.parse_args(argv)
    kinds = {}
    for item in args.kinds.split(","):
        kind, _, weight = item.partition(":")
        if kind not in ("sigkill", "sigterm", "pause"):
            p.error(f"--kinds: unknown fault kind {kind!r}")
        kinds[kind] = float(weight or 1)
    args.kinds = kinds
    if args.requests < 1 or args.clients < 1 or args.verifiers < 1 or not 0 <= args.fault_share <= 1:
        p.error("--requests, --clients and --verifiers must be >= 1, --fault-share in [0, 1]")
    return args


class Server:
    """`coordinator serve` as a subprocess on a free loopback port, with the given flags (workers, defaults)."""

    def __init__(self, flags: list[str], log_dir: str) -> None:
        command = [sys.executable, "-m", "coordinator", "serve", "--port", "0", *flags]
        self.log_path = os.path.join(log_dir, "coordinator.log")
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file,
                                            stdin=subprocess.DEVNULL)
        found: list[str] = []

        def read() -> None:
            for raw in self.process.stdout:  # keeps draining, so the server never blocks on a full pipe
                line = raw.decode(errors="replace").strip()
                if line.startswith("LISTENING ") and not found:
                    found.append(line.split(" ", 1)[1])
        threading.Thread(target=read, daemon=True).start()
        wait_until(lambda: found or self.process.poll() is not None, 600)
        if not found:
            self.stop()
            raise RuntimeError(f"coordinator serve did not start; see {self.log_path}:\n"
                               + Path(self.log_path).read_text(errors="replace")[-3000:])
        self.url = found[0]

    def health(self) -> dict:
        try:
            return httpx.get(self.url + "/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def ask(client: openai.OpenAI, model: str, spec: RequestSpec, args) -> Answer:
    """One streamed request; its text, finish reason and usage, or the error that ended it."""
    answer = Answer(spec, started_s=time.monotonic())
    sampling = {"temperature": 0.0} if spec.seed is None else {"temperature": args.temperature, "seed": spec.seed}
    common = dict(model=model, max_tokens=args.max_tokens, stream=True, stream_options={"include_usage": True},
                  **sampling)
    try:
        if spec.chat:
            stream = client.chat.completions.create(
                messages=[{"role": "user", "content": PROMPTS[spec.prompt]}], **common)
        else:
            stream = client.completions.create(prompt=PROMPTS[spec.prompt], **common)
        for chunk in stream:
            if chunk.usage is not None:
                answer.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                piece = choice.delta.content if spec.chat else choice.text
                answer.text += piece or ""
                answer.finish = choice.finish_reason or answer.finish
        if answer.finish is None:
            answer.error = "the stream ended without a finish reason"
    except (openai.OpenAIError, httpx.HTTPError) as e:
        answer.error = f"{type(e).__name__}: {e}"
    answer.latency_s = time.monotonic() - answer.started_s
    return answer


def run_requests(base_url: str, model: str, specs: list[RequestSpec], args, phase_of) -> list[Answer]:
    """Send `specs` from --clients threads (each its own client), in order; phase_of(started_s) labels each."""
    answers: list[Answer] = []
    next_index = [0]
    lock = threading.Lock()

    def client_loop() -> None:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=args.request_timeout)
        while True:
            with lock:
                if next_index[0] >= len(specs):
                    break
                spec = specs[next_index[0]]
                next_index[0] += 1
            answer = ask(client, model, spec, args)
            answer.phase = phase_of(answer.started_s)
            with lock:
                answers.append(answer)
                done = len(answers)
            if done % 50 == 0 or answer.error:
                log(f"  {done}/{len(specs)} answered" + (f"; {spec.name} FAILED: {answer.error}" if answer.error
                                                          else ""))
        client.close()

    threads = [threading.Thread(target=client_loop, name=f"client{i}", daemon=True) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


class FaultLoop:
    """Faults at random intervals on a thread until stop(): SIGKILL / SIGTERM (then a restart) or a pause."""

    def __init__(self, args, rng: random.Random, slots: list[Slot], faults: FaultLog) -> None:
        self.args, self.rng, self.slots, self.faults = args, rng, slots, faults
        self.paused: set[str] = set()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fault-loop", daemon=True)
        self.pausers: list[threading.Thread] = []

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        for pauser in self.pausers:
            pauser.join()

    def running(self, slot: Slot) -> bool:
        return slot.up.is_set() and slot.name not in self.paused

    def _run(self) -> None:
        kinds, weights = list(self.args.kinds), list(self.args.kinds.values())
        while not self.stopping.wait(self.rng.uniform(*self.args.fault_interval)):
            kind = self.rng.choices(kinds, weights)[0]
            with self.lock:
                verifiers_running = [s for s in self.slots if s.spec.role == "verifier" and self.running(s)]
                victims = [s for s in self.slots if self.running(s) and s.spec.role in self.args.roles.split(",")
                           and not (s.spec.role == "verifier" and len(verifiers_running) < 2)
                           and not (kind != "pause" and s.name == self.args.spare)]
                if not victims:
                    continue
                victim = self.rng.choice(victims)
                at = time.monotonic()  # before the signal: a request ending just after it counts as overlapping
                if kind == "pause":
                    self.paused.add(victim.name)
                    victim.worker.process.send_signal(signal.SIGSTOP)
                    pauser = threading.Thread(target=self._resume, args=(victim,), daemon=True)
                    self.pausers.append(pauser)
                    pauser.start()
                else:
                    signum = signal.SIGKILL if kind == "sigkill" else signal.SIGTERM
                    deadline = time.monotonic() + self.args.load_timeout
                    if not victim.signal(signum, self.args.restart_delay, self.args.grace, deadline):
                        continue
            self.faults.add(kind, victim.name, at)
            log(f"  fault: {kind} {victim.name}")

    def _resume(self, slot: Slot) -> None:
        time.sleep(self.args.pause)
        with self.lock:
            slot.worker.process.send_signal(signal.SIGCONT)
            self.paused.discard(slot.name)
        self.faults.add("resume", slot.name)


def server_flags(args, slots: list[Slot]) -> list[str]:
    flags = ["--default-max-tokens", str(args.max_tokens),
             "--draft-tokens", str(args.draft_tokens if args.drafters else 0),
             "--rpc-timeout", str(args.rpc_timeout), "--retry-budget", str(args.retry_budget),
             "--breaker-fail-max", "1", "--breaker-reset", str(args.breaker_reset), "--log-level", "WARNING"]
    for slot in slots:
        flags += [f"--{slot.spec.role}", slot.address]
    return flags


def distinct_specs(args) -> list[RequestSpec]:
    return [RequestSpec(p, chat, seed) for p in range(len(PROMPTS)) for chat in (False, True)
            for seed in [None, *range(1000 + 10 * p, 1000 + 10 * p + args.seeds)]]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    started = time.monotonic()
    threads = args.threads or None
    with tempfile.TemporaryDirectory(prefix="specmesh-chaos-serve-") as log_dir:
        extra = ("--grace", str(args.grace), "--session-ttl", str(args.session_ttl))
        slots = [Slot(f"verifier{i}", LocalWorkerSpec("verifier", args.target_model, args.device, args.dtype,
                                                      threads, 0, extra_args=extra), log_dir)
                 for i in range(args.verifiers)]
        slots += [Slot(f"drafter{i}", LocalWorkerSpec("drafter", args.draft_model, args.device, args.dtype,
                                                      threads, 0, extra_args=extra), log_dir)
                  for i in range(args.drafters)]
        server = None
        try:
            for slot in slots:
                slot.start(wait=False)
            for slot in slots:
                slot.worker.wait_serving(timeout_s=args.load_timeout)
                slot.up.set()
            server = Server(server_flags(args, slots), log_dir)
            log(f"fleet and HTTP server up in {time.monotonic() - started:.1f} s: {server.url}, "
                + ", ".join(f"{s.name}@{s.address}" for s in slots))
            return soak(args, rng, slots, server, started)
        finally:
            if server is not None:
                server.stop()
            for slot in slots:
                slot.stop()


def soak(args, rng: random.Random, slots: list[Slot], server: Server, started: float) -> int:
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    watched = {"coordinator": Watched(lambda: server.process.pid)}
    for slot in slots:
        watched[slot.name] = Watched(lambda slot=slot: slot.worker.process.pid if slot.worker else None,
                                     slot.address, slot.spec.role)
    faults = FaultLog()
    for slot in slots:
        slot.on_up = lambda slot: faults.add("up", slot.name)
    specs = distinct_specs(args)
    with Sampler(watched, args.sample_interval) as sampler:
        # Fault-free: every distinct request twice, the first run the reference, the second (warm) the latency
        # baseline; both must agree.
        log(f"fault-free: {2 * len(specs)} requests ({len(specs)} distinct) at {args.clients} clients")
        first = run_requests(server.url, model, specs, args, lambda t: "warm-up")
        free = run_requests(server.url, model, specs, args, lambda t: "fault-free")
        references = {a.spec: a for a in first}
        broken = [a for a in first + free if a.error]
        if broken:
            log(f"fault-free request {broken[0].spec.name} failed: {broken[0].error}")
            return 1
        disagree = [a.spec.name for a in free if (a.text, a.finish, a.completion_tokens) != (
            references[a.spec].text, references[a.spec].finish, references[a.spec].completion_tokens)]
        if disagree:
            log(f"fault-free runs disagree for {disagree}: not deterministic, cannot compare")
            return 1
        warm_s = time.monotonic()
        sampler.sample_now()

        plan = [rng.choice(specs) for _ in range(args.requests)]
        loop = FaultLoop(args, rng, slots, faults)
        fault_until = max(1, int(args.fault_share * len(plan)))
        recovered: dict = {}

        def watch_recovery() -> None:
            """Once the fault loop has stopped: from the last fault until every worker runs again and the
            coordinator's /health lists every verifier as SERVING."""
            loop.stop()
            last = max((at for at, kind, _ in faults.events if kind != "up"), default=time.monotonic())
            verifiers = sorted(s.address for s in slots if s.spec.role == "verifier")
            wait_until(lambda: all(s.up.is_set() for s in slots)
                       and sorted(server.health().get("verifiers_serving", [])) == verifiers,
                       args.load_timeout, interval_s=0.05)
            recovered["at"] = time.monotonic()
            recovered["s"] = recovered["at"] - last

        log(f"faults: {len(plan)} requests at {args.clients} clients; faults stop after request {fault_until}")
        counted = CountingSpecs(plan, threshold=fault_until)
        stopper = threading.Thread(target=lambda: (counted.reached.wait(), watch_recovery()), daemon=True)
        loop.start()
        stopper.start()
        answers = run_requests(server.url, model, counted, args,
                               lambda t: "after-faults" if t >= recovered.get("at", float("inf")) else "faults")
        stopper.join()
        drain_s = wait_drained({s.name: (s.address, s.spec.role) for s in slots},
                               timeout_s=args.session_ttl + 60)
        sampler.sample_now()
    return report(args, free, references, answers, faults, recovered, drain_s, sampler, warm_s, slots,
                  time.monotonic() - started)


class CountingSpecs(list):
    """The request plan; indexing it counts the requests sent and sets `reached` at `threshold`."""

    def __init__(self, specs: list[RequestSpec], threshold: int) -> None:
        super().__init__(specs)
        self.threshold = threshold
        self.reached = threading.Event()

    def __getitem__(self, index):
        if isinstance(index, int) and index + 1 >= self.threshold:
            self.reached.set()
        return super().__getitem__(index)


def report(args, free: list[Answer], references: dict, answers: list[Answer], faults: FaultLog, recovered: dict,
           drain_s: float | None, sampler: Sampler, warm_s: float, slots: list[Slot], total_s: float) -> int:
    # A round whose drafter is down verifies no drafts (k = 0): greedy output stays the same, but sampling then
    # draws from the target directly instead of accepting or rejecting drafts, which follows the same distribution
    # with other random numbers. Seeded requests are therefore compared exactly only when no drafter fault overlapped
    # them; the others are counted apart.
    drafter_down = faults.windows("drafter", margin_s=args.breaker_reset + args.rpc_timeout)
    groups: dict[str, list[Answer]] = {"greedy": [], "seeded": [], "seeded-drafter-faulted": []}
    mismatches, lost, no_usage = [], 0, 0
    for a in answers:
        if a.error:
            continue
        ref = references[a.spec]
        ended_s = a.started_s + a.latency_s
        group = "greedy" if a.spec.seed is None else "seeded-drafter-faulted" if any(
            a.started_s < end and ended_s > start for start, end in drafter_down) else "seeded"
        groups[group].append(a)
        if (a.text, a.finish) != (ref.text, ref.finish):
            mismatches.append((group, f"{a.spec.name}: got {a.text!r} ({a.finish}), want {ref.text!r} ({ref.finish})"))
            if ref.text.startswith(a.text):  # a stream that ended early: what it lacks was lost
                lost += (ref.completion_tokens or 0) - (a.completion_tokens or 0)
        no_usage += a.completion_tokens is None
    differ = {group: sum(g == group for g, _ in mismatches) for group in groups}
    failed = [a for a in answers if a.error]
    kinds: dict[str, int] = {}
    for _, kind, _ in faults.events:
        if kind not in ("resume", "up"):
            kinds[kind] = kinds.get(kind, 0) + 1
    leaks = sampler.summary(since_s=warm_s)
    lived = {name: s for name, s in leaks.items() if s and s["pids"] == 1}
    grew = {name: s["rss_growth_pct"] for name, s in lived.items() if s["rss_growth_pct"] >= args.max_rss_growth}

    def latency(phase: str) -> dict:
        values = [a.latency_s for a in (free if phase == "fault-free" else answers) if a.phase == phase
                  and not a.error]
        return {"n": len(values), "p50_s": percentile(values, 50), "p99_s": percentile(values, 99)}

    summary = {
        "requests_sent": len(answers),
        "succeeded": len(answers) - len(failed),
        "failed": len(failed),
        "differing_greedy": differ["greedy"],
        "greedy_compared": len(groups["greedy"]),
        "differing_seeded": differ["seeded"],
        "seeded_compared": len(groups["seeded"]),
        "differing_seeded_drafter_faulted": differ["seeded-drafter-faulted"],
        "seeded_drafter_faulted": len(groups["seeded-drafter-faulted"]),
        "tokens_lost": lost,
        "answers_without_usage": no_usage,
        "faults": sum(kinds.values()),
        "faults_by_kind": dict(sorted(kinds.items())),
        "restarts": sum(s.restarts for s in slots),
        "restart_failures": sum(s.restart_failures for s in slots),
        "restart_to_serving_p50_s": percentile([t for s in slots for t in s.restart_s], 50),
        "restart_to_serving_max_s": percentile([t for s in slots for t in s.restart_s], 100),
        "latency_fault_free": latency("fault-free"),
        "latency_with_faults": latency("faults"),
        "latency_after_recovery": latency("after-faults"),
        "recovery_after_last_fault_s": round(recovered["s"], 2) if "s" in recovered else None,
        "sessions_drained_s": None if drain_s is None else round(drain_s, 1),
        "leaks": leaks,
        "rss_growth_over_limit": grew,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "target_model": args.target_model,
        "draft_model": args.draft_model if args.drafters else None,
        "seed": args.seed,
        "total_s": round(total_s, 1),
    }
    print(f"requests sent / succeeded / failed   {summary['requests_sent']} / {summary['succeeded']} / "
          f"{summary['failed']}")
    print(f"outputs differing from fault-free    greedy {differ['greedy']}/{len(groups['greedy'])}, seeded "
          f"{differ['seeded']}/{len(groups['seeded'])}; seeded while the drafter was down "
          f"{differ['seeded-drafter-faulted']}/{len(groups['seeded-drafter-faulted'])} (not compared: rounds "
          "without drafts sample the same distribution with other random numbers)")
    print(f"tokens lost                          {lost} ({no_usage} answers without usage)")
    print(f"faults                               {summary['faults']} {summary['faults_by_kind']}, "
          f"{summary['restarts']} restarts ({summary['restart_failures']} failed; signal to SERVING p50 "
          f"{summary['restart_to_serving_p50_s']} s, max {summary['restart_to_serving_max_s']} s)")
    for phase in ("fault_free", "with_faults", "after_recovery"):
        s = summary[f"latency_{phase}"]
        print(f"latency {phase.replace('_', ' '):28s} p50 {s['p50_s']} s, p99 {s['p99_s']} s ({s['n']} requests)")
    print(f"recovery after the last fault        {summary['recovery_after_last_fault_s']} s "
          "(every worker running, every verifier SERVING in /health)")
    print(f"sessions drained to zero             {summary['sessions_drained_s']} s after the load stopped")
    print("process (pids > 1: restarted; its row is the last process, growth judged only for one that lived "
          "through the soak)")
    print(f"{'':14s} {'pids':>4s} {'RSS first→last MB':>20s} {'growth':>7s} {'fds':>10s} {'threads':>10s} "
          f"{'sessions max→last':>18s}")
    for name, s in leaks.items():
        if s:
            growth = f"{s['rss_growth_pct']:6.2f}%" if s["pids"] == 1 else "restart"
            print(f"{name:14s} {s['pids']:4d} {s['rss_first_mb']:9.1f}→{s['rss_last_mb']:<9.1f} "
                  f"{growth:>7s} {s['fds_first']:4d}→{s['fds_last']:<5d} "
                  f"{s['threads_first']:4d}→{s['threads_last']:<5d} {s['sessions_max']}→{s['sessions_last']}")
    for group, line in mismatches[:10]:
        print(f"  differs ({group}) {line}")
    for a in failed[:10]:
        print(f"  failed {a.spec.name}: {a.error}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"summary": summary, "requests": [
            {"spec": a.spec.name, "phase": a.phase, "started_s": round(a.started_s, 3),
             "latency_s": round(a.latency_s, 3), "error": a.error, "completion_tokens": a.completion_tokens,
             "same_as_fault_free": (a.text, a.finish) == (references[a.spec].text, references[a.spec].finish)}
            for a in answers], "faults": faults.events}, indent=1))
    print(json.dumps(summary), flush=True)
    ok = (not failed and not differ["greedy"] and not differ["seeded"] and not lost and not no_usage
          and drain_s is not None and not grew)
    return 0 if ok else 1
