"""`coordinator generate ...`, `coordinator serve ...`, `coordinator models list|pull` and `coordinator bench ...`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType

from coordinator.drafting.policies import DEFAULT_POLICY, POLICIES
from coordinator.stream_flush import DEFAULT_STREAM_FLUSH_S, check_stream_flush_s
from specmesh.runtime import catalog
from specmesh.ops import config as flag_config
from specmesh.ops.config import add_config_argument
from specmesh.ops.flags import DefaultsHelpFormatter, add_client_security_flags, add_logging_flags, add_metrics_flags
from specmesh.ops.preflight import with_fix
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from specmesh.runtime.engine import ENGINES
from specmesh.runtime.gguf_cache import COST_CACHING_ENGINES, cost_cache_on
from specmesh.wire.printable import printable


def shown(value: object, limit: int = 20_000) -> str:
    """An error message, or what the user typed, as printed: printable (no control characters, valid UTF-8 whatever
    argv held, bounded), line breaks kept (a worker's log tail)."""
    return printable(value, limit, newlines=True)


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """Where the workers are (or which models to start locally), and how to reach them."""
    p.add_argument("--drafter", action="append", default=None,
                   help="drafter HOST:PORT or dns:///NAME:PORT; may be repeated (default: start one locally)")
    p.add_argument("--verifier", action="append", default=None,
                   help="verifier HOST:PORT or dns:///NAME:PORT; may be repeated (default: start one locally)")
    p.add_argument("--suffix-drafter", action="append", default=None,
                   help="suffix drafter HOST:PORT (`drafter serve --method suffix`, the target's model); may be "
                   "repeated. Drafting becomes hybrid: the suffix draft where its match is long enough, the draft "
                   "model's elsewhere where that pays")
    p.add_argument("--suffix", action=argparse.BooleanOptionalAction, default=None,
                   help="start a local suffix drafter (the target's tokenizer, no weights) beside the drafter and "
                   "draft hybrid; --no-suffix drafts with the drafter alone (default: on where the verifier is "
                   "started locally; with --verifier addresses, give --suffix-drafter or --suffix)")
    p.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL,
                   help="model for a locally started drafter")
    p.add_argument("--draft-requantize", default="auto", metavar="TYPE|auto|none",
                   help="a locally started model drafter runs its GGUF requantized to this type (drafter serve --requantize: auto = q4_0 on the ik engine where the file's weights are wider; none = the file as it is; docs/engines.md#a-cheaper-drafter)")
    p.add_argument("--target-model", default=DEFAULT_TARGET_MODEL,
                   help="model for a locally started verifier")
    p.add_argument("--dtype", default="auto", help="dtype of locally started workers")
    p.add_argument("--device", default="auto", help="device of locally started workers")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="model runtime of locally started workers: llamacpp (GGUF, quantized), transformers (torch); "
                   "auto = llamacpp for GGUF/catalog models on CPU unless --dtype is given")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="locally started workers: answers independent of the concurrent load, the prefix cache and "
                   "failover, so greedy and seeded answers repeat; --no-deterministic: the transformers engine's plain "
                   "batched passes (in bfloat16 answers then vary with the load) "
                   "(default: on where the engine has it; llamacpp has not)")
    p.add_argument("--draft-tokens", "--draft", type=int, default=None,
                   help="fixed draft length k; 0 = target-only decoding (default: adaptive)")
    p.add_argument("--draft-policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help="how adaptive k is chosen: heuristic = +2 after a fully accepted round, -1 otherwise (HF's); "
                   "cost = the k maximising measured tokens/s from acceptance rate, draft and verify times, "
                   "down to k = 0 when drafting does not pay")
    p.add_argument("--pipeline", action="store_true",
                   help="draft the next round while the verifier checks this one, betting that every draft is "
                   "accepted (pays when drafter and verifier run on different hosts; same output either way)")
    p.add_argument("--stream-flush-ms", type=float, default=DEFAULT_STREAM_FLUSH_S * 1000,
                   help="target-only stretches stream from the verifier, which may hold tokens this long and send "
                   "them together: fewer wake-ups of both sides' gRPC threads per token; the first token of each "
                   "stretch goes at once, and generations with stop strings get every token at once (0: always)")
    p.add_argument("--no-stream-guesses", dest="stream_guesses", action="store_false",
                   help="streamed steps check no guess of the next token (by default, while drafting, a verifier "
                   "whose one-token step runs a spare row anyway checks one there: ik, repacked and exact)")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds to wait at start for a SERVING verifier (and drafter)")
    p.add_argument("--unreachable-timeout", type=float, default=5.0,
                   help="seconds to wait at start when every verifier (or drafter) refuses connections or its name "
                   "does not resolve, before giving up with that cause (workers that answer but still load their "
                   "model are waited for up to --connect-timeout; TLS mismatches fail at once)")
    add_resilience_arguments(p)
    add_client_security_flags(p)
    add_metrics_flags(p)
    p.add_argument("--record", default=None, help="append one JSON line per generation to this file (default: off)")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text")
    add_fleet_arguments(p)
    add_logging_flags(p, level="WARNING")
    p.add_argument("--max-new-tokens", "--max", type=int, default=256, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random when sampling)")
    p.add_argument("--stop", action="append", default=[], help="stop string; may be repeated")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats) instead")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to bind")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    from coordinator.serving.admission import AdmissionConfig
    d = AdmissionConfig()
    p.add_argument("--max-concurrent-requests", type=int, default=d.max_active,
                   help="generations running at once, each one session on the verifier fleet (keep it within the "
                   "verifiers' --max-sessions, or sessions evict each other's KV caches)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests waiting for a running slot; beyond that a request is refused at once with HTTP "
                   "429 and Retry-After (0: refuse whenever every slot is busy)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="on SIGTERM: seconds running requests may finish while new ones get 503; then they are "
                   "cancelled")
    add_fleet_arguments(p)
    add_logging_flags(p, level="INFO")


def add_resilience_arguments(p: argparse.ArgumentParser) -> None:
    from coordinator.fleet.resilience import ResilienceConfig
    d = ResilienceConfig()
    p.add_argument("--rpc-timeout", type=float, default=d.verify_timeout_s,
                   help="deadline of one Verify or Propose attempt, seconds")
    p.add_argument("--retry-budget", type=float, default=d.retry_budget_s,
                   help="seconds one step may spend retrying and failing over")
    p.add_argument("--breaker-fail-max", type=int, default=d.breaker_fail_max,
                   help="consecutive failures that open a worker's circuit breaker")
    p.add_argument("--breaker-reset", type=float, default=d.breaker_reset_s,
                   help="seconds before an open breaker lets a probe through")


def resilience_from(args: argparse.Namespace):
    from coordinator.fleet.resilience import ResilienceConfig
    return ResilienceConfig(verify_timeout_s=args.rpc_timeout, propose_timeout_s=args.rpc_timeout,
                            retry_budget_s=args.retry_budget, breaker_fail_max=args.breaker_fail_max,
                            breaker_reset_s=args.breaker_reset)


def security_from(args: argparse.Namespace):
    from specmesh.wire.security import ClientSecurity, TlsFiles, load_token
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name)
    return ClientSecurity(tls=tls, token=load_token(args.token_file))


def print_summary(result) -> None:
    s = result.stats
    faults = f"; {s['retries']} retries, {s['failovers']} failovers, {s['degraded_rounds']} rounds without drafts" \
        if s["retries"] or s["failovers"] or s["degraded_rounds"] else ""
    rate = "n/a" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.1%}"
    # Drafting in fewer than half of the rounds (or not at all): what the policy decided and why, instead of an
    # acceptance rate over a handful of drafts and a mean accepted length near 1 (coordinator/api.py, drafting_note).
    drafting = s.get("draft_note") or (f"acceptance rate {rate}; mean accepted length "
                                       f"{s['mean_accepted_length']:.2f} tokens/round")
    # Hybrid drafting: which source drafted how many rounds.
    sources = (f"; drafted by the suffix drafter in {s['suffix_rounds']} rounds, the draft model in "
               f"{s['model_rounds']}" if "suffix_rounds" in s else "")
    if s.get("model_openings_declined") and not s.get("model_rounds"):  # its session would not have paid for itself
        sources += " (its session's opening could not pay in this generation's budget)"
    # Streamed steps that checked a free guess of the next token (DecodeRequest.guess), and the right ones.
    guesses = (f"; {s['stream_guesses_accepted']} of {s['stream_guesses']} stream guesses right"
               if s.get("stream_guesses") else "")
    print(f"\n[{result.finish_reason}] {s['new_tokens']} new tokens in {s['elapsed_s']:.2f} s "
          f"({s['tokens_per_s']:.2f} tokens/s); {drafting}{sources}{guesses}; {s['rounds']} rounds{faults}"
          f"; engine {_engines(s)}"
          + (f"; draft tokenizer {s['draft_tokenizer']}" if s.get("draft_tokenizer") else ""),
          file=sys.stderr)


def _engines(stats: dict) -> str:
    verifier, drafter = stats.get("verifier_engine") or "?", stats.get("drafter_engine")
    verifier_build, drafter_build = stats.get("verifier_engine_build"), stats.get("drafter_engine_build")
    if drafter in (None, verifier) and drafter_build in (None, verifier_build):
        return verifier + (f" ({verifier_build})" if verifier_build else "")
    return (f"verifier {verifier}" + (f" ({verifier_build})" if verifier_build else "")
            + f", drafter {drafter or 'model-free'}" + (f" ({drafter_build})" if drafter_build else ""))


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError, one line naming the cause and the fix, for flags that cannot work: checked before anything starts,
    instead of a local worker that fails in its log (specmesh/runtime/model_spec.py) or a traceback."""
    from specmesh.ops.preflight import check_port, check_tls_files
    from specmesh.runtime.model_spec import check_model, check_requantize
    resilience_from(args), security_from(args)
    check_tls_files(args.tls_cert, args.tls_key, args.tls_ca)
    if args.verifier is None:
        check_model(args.target_model, "--target-model", args.engine, args.device, args.dtype)
    if args.draft_tokens != 0 and args.drafter is None:
        check_model(args.draft_model, "--draft-model", args.engine, args.device, args.dtype)
        check_requantize(args.draft_requantize, "--draft-requantize")
    check_port(args.metrics_host, args.metrics_port, "--metrics-port")


def start_failed(error: Exception) -> int:
    """Print why the workers could not be used at start; the exit status: 2 for a cause the user can fix (one line,
    with the fix), else 1 (coordinator/fleet/connect_errors.py)."""
    from coordinator.api import TokenizerMismatch
    from coordinator.fleet.connect_errors import start_failure
    message, status = start_failure(error, user_error=isinstance(error, TokenizerMismatch))
    print(f"coordinator: error: {shown(message)}", file=sys.stderr)
    return status


@contextmanager
def connected(args: argparse.Namespace, progress: bool, while_loading: Callable[[], None] | None = None) -> Iterator:
    """A Coordinator over the given workers, or over local worker subprocesses started for the duration.
    `while_loading`: the caller's own slow preparations, run while local workers load (or at once without any)."""
    from coordinator.fleet.local_workers import LocalWorkerSpec, local_workers
    need_drafter = args.draft_tokens != 0
    specs = []
    determinism = {None: (), True: ("--deterministic",), False: ("--no-deterministic",)}[args.deterministic]
    if args.verifier is None:
        specs.append(LocalWorkerSpec("verifier", args.target_model, args.device, args.dtype, engine=args.engine,
                                     extra_args=determinism))
    if need_drafter and args.drafter is None:
        specs.append(LocalWorkerSpec("drafter", args.draft_model, args.device, args.dtype, engine=args.engine,
                                     extra_args=(*determinism, "--requantize", args.draft_requantize)))
    if need_drafter and local_suffix_drafter(args):  # model-free: reads the target's tokenizer only
        specs.append(LocalWorkerSpec("drafter", args.target_model, "cpu", "auto", extra_args=("--method", "suffix"),
                                     name=SUFFIX_DRAFTER))
    from specmesh.ops.metrics import serve_metrics
    metrics_port = serve_metrics(args.metrics_port, args.metrics_host)
    if metrics_port is not None:
        print(f"METRICS http://{args.metrics_host}:{metrics_port}/metrics", file=sys.stderr, flush=True)
    # The coordinator's tokenizer (the target's: what the verifier serves) loads while the workers do.
    tokenizer = TokenizerPreload(args.target_model) if specs and args.verifier is None else None

    def prepare() -> None:
        if tokenizer is not None:
            tokenizer.start()
        if while_loading is not None:
            while_loading()
    with ExitStack() as stack:
        if specs:
            addresses = stack.enter_context(local_workers(specs, progress=progress, while_loading=prepare))
        else:
            addresses = {}
            prepare()
        from coordinator.api import Coordinator  # torch and transformers: seconds, spent while the workers load
        suffix_drafter = args.suffix_drafter or ([addresses[SUFFIX_DRAFTER]] if SUFFIX_DRAFTER in addresses else None)
        yield stack.enter_context(Coordinator(
            verifier=args.verifier or [addresses["verifier"]],
            drafter=(args.drafter or [addresses["drafter"]]) if need_drafter else None,
            suffix_drafter=suffix_drafter if need_drafter else None,
            tokenizer=tokenizer.result() if tokenizer is not None else None,
            resilience=resilience_from(args), security=security_from(args), record=args.record,
            connect_timeout_s=args.connect_timeout, unreachable_timeout_s=args.unreachable_timeout))


SUFFIX_DRAFTER = "suffix-drafter"  # the local suffix drafter's name among the local workers


def local_suffix_drafter(args: argparse.Namespace) -> bool:
    """Whether to start a local suffix drafter (hybrid drafting): --suffix, or by default where the verifier is
    started locally too (the suffix drafter must read the verifier's tokenizer: a remote verifier's model may not be
    --target-model), unless --no-suffix or --suffix-drafter addresses are given."""
    if args.suffix_drafter:
        return False
    return args.suffix if args.suffix is not None else args.verifier is None


class TokenizerPreload:
    """Loads a model's tokenizer on a thread (the import of transformers and the GGUF's vocabulary: seconds) while
    the local workers load; result() is None where that failed, and the Coordinator then loads it and reports why."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._tokenizer = None
        self._thread = threading.Thread(target=self._load, name="tokenizer-preload", daemon=True)

    def _load(self) -> None:
        try:
            from specmesh.runtime.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.model, progress=False)
        except Exception:  # noqa: BLE001 - the Coordinator loads it again and says what failed
            self._tokenizer = None

    def start(self) -> None:
        self._thread.start()

    def result(self):
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        return self._tokenizer


class BadOptions(ValueError):
    """Generation options that cannot work, found while the local workers were loading."""


def generate(args: argparse.Namespace) -> int:
    streamed: list[str] = []  # the text shown so far, for the report of an interrupted run
    try:
        return run_generation(args, streamed)
    except KeyboardInterrupt:
        # Ctrl-C: whatever was running (loading workers, a gRPC call) has unwound and the local workers are stopped
        # (or, on a second Ctrl-C during that, end by themselves with this process: coordinator/fleet/local_workers.py).
        text = "".join(streamed)
        if args.json:
            print(json.dumps({"status": "interrupted", "text": text}))
        print(f"\ncoordinator: interrupted after {len(text)} characters of output", file=sys.stderr)
        return 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


def run_generation(args: argparse.Namespace, streamed: list[str]) -> int:
    """`coordinator generate`; every piece of text it prints (or would print, with --json) is appended to
    `streamed`."""
    from coordinator.fleet.worker_client import WorkerError
    from specmesh.ops.logs import configure_logging
    try:
        configure_logging("coordinator", args.log_format, args.log_level)
        check_arguments(args)
    except ValueError as e:
        print(f"coordinator: error: {shown(with_fix(e))}", file=sys.stderr)
        return 2
    prepared: dict = {}

    def prepare() -> None:
        """While the local workers load: the heavy imports (torch, transformers) and the options' checks. Bad
        options stop the workers at once."""
        from coordinator.api import GenerationOptions
        try:
            prepared["options"] = GenerationOptions(
                max_new_tokens=args.max_new_tokens, draft_tokens=args.draft_tokens, draft_policy=args.draft_policy,
                pipeline=args.pipeline, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=tuple(args.stop), chat=not args.no_chat,
                stream_flush_s=args.stream_flush_ms / 1000, stream_guesses=args.stream_guesses)
        except ValueError as e:
            raise BadOptions(str(with_fix(e))) from None
    with ExitStack() as stack:
        try:
            coordinator = stack.enter_context(connected(args, progress=not args.json, while_loading=prepare))
        except BadOptions as e:
            print(f"coordinator: error: {shown(e)}", file=sys.stderr)
            return 2
        except WorkerError as e:
            return start_failed(e)
        from coordinator.api import GenerationFailed
        options = prepared["options"]

        def emit(text: str) -> None:
            streamed.append(text)
            if not args.json:
                sys.stdout.write(text)
                sys.stdout.flush()

        try:
            result = coordinator.generate(args.prompt, options, on_text=emit)
            status = 0
        except GenerationFailed as e:
            result, status = e.partial, 1
            print(f"\ncoordinator: error: {shown(e)}", file=sys.stderr)
        except ValueError as e:
            print(f"coordinator: error: {shown(e)}", file=sys.stderr)
            return 2
        # Before the local workers stop (half a second: the interpreters' teardown), not after.
        if args.json:
            print(json.dumps({"status": "ok" if status == 0 else "error", "text": result.text,
                              "token_ids": result.token_ids, "prompt_tokens": result.prompt_tokens,
                              "finish_reason": result.finish_reason, "stats": result.stats}), flush=True)
        else:
            print_summary(result)
        if args.verifier is None and args.drafter is None and not args.suffix_drafter:
            measure_costs_for_later_runs(coordinator)
    return status


def determinism_line(coordinator) -> str:
    """Whether the same request always gets the same answer here, from what the workers report (Info)."""
    varying = [f"the {role} ({info.engine}, {info.dtype})"
               for role, info in (("verifier", coordinator.verifier_info), ("drafter", coordinator.drafter_info))
               if info is not None and not info.deterministic]
    if not varying:
        return "deterministic: the same request gets the same answer whatever else runs (greedy, and seeded sampling)"
    llamacpp = any(info is not None and info.engine == "llamacpp" and not info.deterministic
                   for info in (coordinator.verifier_info, coordinator.drafter_info))
    return (f"answers vary with the concurrent load: {' and '.join(varying)} run without --deterministic, so greedy "
            "and seeded answers may differ between identical requests; start the workers with --deterministic for "
            f"repeatable answers{' (llamacpp has no such mode: --engine ik or transformers)' if llamacpp else ''} "
            "(docs/engines.md#determinism)")


# How long `coordinator generate` waits, after its answer, for local workers to measure their costs (seconds of probe
# calls on a quiet machine: a verify of up to 16 drafts and a 4-token proposal, 3 times each).
COSTS_FOR_LATER_RUNS_S = 60.0


def measure_costs_for_later_runs(coordinator) -> None:
    """After the answer: when the local workers have not measured their costs yet (they do while they serve nothing,
    and a generation keeps them busy), give them up to COSTS_FOR_LATER_RUNS_S to finish, once, for the runs after
    this one. GGUF workers cache their costs for 6 hours (specmesh/worker/cost_probe.py), so the next `make run`
    starts its cost policy from them; without this, workers stopped after each answer would never measure them, and
    the cost policy would never draft. Not for engines that keep no cache (transformers), nor with
    SPECMESH_COST_CACHE=0: their next start measures again whatever this one does. Ctrl-C skips it."""
    engines = [info.engine for info in (coordinator.verifier_info, coordinator.drafter_info) if info is not None]
    if not coordinator.costs_pending() or not cost_cache_on() \
            or any(engine not in COST_CACHING_ENGINES for engine in engines if engine):
        return
    print(f"coordinator: the workers measure their costs for later runs' draft policy (once; cached for 6 h; at most "
          f"{COSTS_FOR_LATER_RUNS_S:.0f} s; Ctrl-C skips it)", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        measured = coordinator.wait_for_costs(COSTS_FOR_LATER_RUNS_S)
    except KeyboardInterrupt:
        print("coordinator: skipped: the next run measures them again", file=sys.stderr)
        return
    took = time.monotonic() - started
    print(f"coordinator: costs measured in {took:.1f} s: later runs start from them" if measured else
          f"coordinator: the workers had not measured their costs after {took:.0f} s (a busy machine?): the next run "
          "measures them again", file=sys.stderr)


def serve(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from coordinator.serving.admission import AdmissionConfig
    from coordinator.serving.http_api import create_app
    from coordinator.serving.http_server import DrainingServer
    from coordinator.fleet.worker_client import WorkerError
    from specmesh.ops.logs import configure_logging
    from specmesh.ops.preflight import bind_problem
    try:
        configure_logging("coordinator", args.log_format, args.log_level)
        check_arguments(args)
        if args.draft_tokens is not None and not 0 <= args.draft_tokens <= 64:
            raise ValueError(f"draft_tokens must be in 0..64, got {args.draft_tokens}")
        if not args.grace >= 0:
            raise ValueError(f"grace must be >= 0 seconds, got {args.grace}")
        check_stream_flush_s(args.stream_flush_ms / 1000, "--stream-flush-ms")
        admission = AdmissionConfig(max_active=args.max_concurrent_requests, max_queue=args.max_queue)
        try:
            listener = socket.create_server((args.host, args.port))  # bound first: port 0 gets a real port to report
        except (OSError, OverflowError) as e:
            raise ValueError(bind_problem(args.host, args.port, e)) from None
    except ValueError as e:
        print(f"coordinator: error: {shown(with_fix(e))}", file=sys.stderr)
        return 2
    # uvicorn stops gracefully on SIGTERM, restores the previous handler and raises the signal again: with the default
    # handler that would end the process before the with-block below stops the local workers, leaving them running.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        with connected(args, progress=True) as coordinator:
            app = create_app(coordinator, default_max_tokens=args.default_max_tokens,
                             draft_tokens=args.draft_tokens, draft_policy=args.draft_policy,
                             pipeline=args.pipeline, admission=admission, stream_flush_s=args.stream_flush_ms / 1000,
                             stream_guesses=args.stream_guesses)
            host, port = listener.getsockname()[:2]
            print(f"coordinator: {determinism_line(coordinator)}", file=sys.stderr, flush=True)
            print(f"LISTENING http://{host}:{port}", flush=True)
            # SIGTERM drains first (coordinator/serving/http_server.py); the timeout only bounds uvicorn's own wait after it.
            config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5)
            DrainingServer(config, app.state.completions, args.grace).run(sockets=[listener])
    except WorkerError as e:
        return start_failed(e)
    return 0


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)  # a requested, graceful stop


def models_list(args: argparse.Namespace) -> int:
    for name, entry in catalog.CATALOG.items():
        state = "fetched" if catalog.is_fetched(name) else "not fetched"
        print(f"{name:32s} {entry.size / 1e6:8.1f} MB  {state:12s} {entry.description}")
    return 0


def models_pull(args: argparse.Namespace) -> int:
    names = list(catalog.CATALOG) if "all" in args.name else args.name
    for name in names:
        if name not in catalog.CATALOG:
            print(f"coordinator: error: unknown model '{printable(name)}'; known: {', '.join(catalog.CATALOG)}",
                  file=sys.stderr)
            return 2
        try:
            path = catalog.fetch(name, progress=True)
        except Exception as e:  # a failed download or checksum: say which and why
            print(f"coordinator: error: pulling {name} failed: {shown(e)}", file=sys.stderr)
            return 1
        print(f"{name}: {path}")
    return 0


LEAF_PARSERS: dict[str, argparse.ArgumentParser] = {}

# Benchmarks are commands with their own parsers in the top-level package specmesh_bench/ (outside the product: it
# may import engines), imported only when one runs: they load torch. The one place coordinator/ reaches it.
BENCHMARK_COMMANDS = {
    "bench": "side-by-side benchmark: target-only, speculative, n-gram and HF transformers baselines",
    "bench-concurrency": "aggregate tokens/s of concurrent generations with and without cross-session batching",
    "bench-serve": "multi-turn conversations through `coordinator serve`: tokens/s and TTFT per turn, per mode",
}


def benchmark_module(command: str) -> ModuleType:
    """The module of a benchmark command: build_parser(prog) and main(argv, prog)."""
    from specmesh_bench import bench, concurrency, serve_bench
    return {"bench": bench, "bench-concurrency": concurrency, "bench-serve": serve_bench}[command]


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: with prefix matching, adding a flag could break a user's command line (--draft
    # once meant --draft-tokens, until --draft-policy made it ambiguous); --draft and --max are explicit aliases now.
    # DefaultsHelpFormatter everywhere: --help shows every default (subparsers do not inherit a formatter).
    options = dict(allow_abbrev=False, formatter_class=DefaultsHelpFormatter)
    parser = argparse.ArgumentParser(prog="coordinator", description="specmesh coordinator: distributed speculative "
                                     "decoding over gRPC drafter and verifier services", **options)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text with speculative decoding", **options)
    add_generate_arguments(gen)
    add_config_argument(gen)
    LEAF_PARSERS["generate"] = gen
    gen.set_defaults(func=generate)
    srv = commands.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                              **options)
    add_serve_arguments(srv)
    add_config_argument(srv)
    LEAF_PARSERS["serve"] = srv
    srv.set_defaults(func=serve)
    for name, help_text in BENCHMARK_COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False, **options)  # main() hands its arguments on
    models = commands.add_parser("models", help="the built-in model catalog", **options)
    models_commands = models.add_subparsers(dest="models_command", required=True)
    models_commands.add_parser("list", help="list catalog models", **options).set_defaults(func=models_list)
    pull = models_commands.add_parser("pull", help="download, assemble and verify a catalog model", **options)
    pull.add_argument("name", nargs="+", help="catalog model name(s), or 'all'")
    pull.set_defaults(func=models_pull)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Flags also come from SPECMESH_* variables and a --config TOML file (specmesh/ops/config.py).
    command = argv[0] if argv else None
    if command in BENCHMARK_COMMANDS:
        return benchmark_module(command).main(argv[1:], prog=f"coordinator {command}")
    if command in LEAF_PARSERS:
        leaf = LEAF_PARSERS[command]
        flag_config.apply(leaf, command, flag_config.load(flag_config.config_file(argv[1:])))
    args = parser.parse_args(argv)
    return args.func(args)
