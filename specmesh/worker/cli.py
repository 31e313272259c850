"""`drafter serve` / `verifier serve`: run one worker until SIGTERM or SIGINT.

Prints one machine-readable line to stdout as soon as the port is bound (`LISTENING <host>:<port>`), so a parent
process that asked for port 0 learns the real port, then loads the model while health reports NOT_SERVING.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from specmesh.ops import config as flag_config
from specmesh.runtime import linear_backends
from specmesh.ops.config import add_config_argument
from specmesh.ops.flags import (DefaultsHelpFormatter, add_logging_flags, add_metrics_flags,
                                add_server_security_flags)
from specmesh.wire.limits import DEFAULT_MAX_DRAFT_TOKENS
from specmesh.ops.logs import configure_logging
from specmesh.ops.metrics import serve_metrics
from specmesh.ops.preflight import check_port, check_tls_files, with_fix
from specmesh.runtime import model_thread
from specmesh.runtime.engine import ENGINES, NO_DETERMINISTIC_LLAMACPP, choose_engine
from specmesh.runtime.huge_pages import add_huge_pages_argument, huge_page_bytes
from specmesh.runtime.model_spec import check_model
from specmesh.wire.printable import printable
from specmesh.wire.security import TlsFiles, exposure_warning, load_token
from specmesh.worker.config import FaultInjection, ModelConfig, ServerConfig
from specmesh.worker.lifeline import SignalStop, exit_when_stdin_closes
from specmesh.worker.role import WorkerRole
from specmesh.worker.server import WorkerServer
from specmesh.worker.session_store import SessionLimits


def add_serve_arguments(parser: argparse.ArgumentParser, default_model: str) -> None:
    parser.add_argument("--model", default=default_model,
                        help="catalog name, tiny-random-* preset, .gguf path, HF directory or hub id")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16|float64; auto = bf16 on CUDA "
                        "and on CPUs with avx512_bf16/AMX, else float32")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="model runtime: ik runs a GGUF file quantized with ik_llama.cpp (exact per session), "
                        "llamacpp with llama-cpp-python, transformers runs any HF model in torch (exact in float32, "
                        "GPUs); auto = ik (else llamacpp) for GGUF files and catalog models on CPU unless --dtype is "
                        "given, else transformers")
    parser.add_argument("--repack", action=argparse.BooleanOptionalAction, default=True,
                        help="ik engine: repack the weights at load into the layouts of its faster kernels (about 2x "
                        "a step); exact, since the engine then never runs a one-row pass (docs/engines.md); "
                        "--no-repack keeps the weights as the file has them")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="a new session starts from the cached keys/values of a finished one that shares its "
                        "prefix (turn n of a conversation prefills only what it added); --no-prefix-cache for "
                        "benchmarks of decoding alone")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                        help="answers independent of the load: a session's logits never depend on the other sessions "
                        "in flight, on how its tokens were split into passes, on a prefix-cache resume or on a "
                        "failover, so greedy and seeded answers repeat (transformers: every pass computes fixed "
                        "16-token chunks; ik: always). --no-deterministic: the transformers engine's plain batched "
                        "passes, and in bfloat16 (the GPU and AMX/AVX512-BF16 CPU default of --dtype auto) answers "
                        "then vary with the load (default: on; llamacpp has no such mode and runs without it)")
    parser.add_argument("--linear-backend", choices=linear_backends.BACKENDS, default="auto",
                        help="CPU linear layers: onednn runs them with oneDNN's inner product, which makes a pass over a "
                        "few tokens (verifying k drafts, batched sessions) far cheaper than torch's default kernels; "
                        "auto = onednn on CPU where it supports the dtype")
    add_huge_pages_argument(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of the model (default: torch's choice; llamacpp, ik: the usable cores)")
    parser.add_argument("--max-sessions", type=int, default=64, help="KV-cache sessions kept, LRU-evicted")
    parser.add_argument("--session-ttl", type=float, default=600.0,
                        help="seconds an idle session's KV cache is kept")
    parser.add_argument("--max-draft-tokens", type=int, default=DEFAULT_MAX_DRAFT_TOKENS,
                        help="largest k accepted")
    parser.add_argument("--max-context-length", type=int, default=None,
                        help="longest token history accepted (default: the model's maximum; llama.cpp: at most "
                        "16384, and its KV cache holds this many tokens shared by all sessions)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds in-flight calls may finish after SIGTERM")
    parser.add_argument("--exit-on-stdin-eof", action="store_true",
                        help="stop as on SIGTERM when stdin reaches end of file: a parent process that starts this "
                        "worker keeps stdin open, so the worker ends with its parent however the parent ends "
                        "(the coordinator's local workers use it; default: off)")
    parser.add_argument("--inject-latency", type=float, default=0.0,
                        help="testing: wait this many seconds before every Propose/Verify")
    add_metrics_flags(parser)
    add_logging_flags(parser, level="INFO")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-cache-bytes", type=int, default=None,
                        help="KV-cache memory across sessions; least recently used sessions are evicted beyond it "
                        "(default: unlimited)")
    limits.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024,
                        help="largest request or response, in bytes")
    limits.add_argument("--max-concurrent-rpcs", type=int, default=64,
                        help="calls in progress at once; more are answered RESOURCE_EXHAUSTED")
    add_server_security_flags(parser.add_argument_group("security"))


class LoadAbandoned(BaseException):
    """Raised on the main thread by SIGTERM/SIGINT while the model loads. A BaseException, like KeyboardInterrupt,
    so that no `except Exception` inside a model loader swallows it."""


@dataclass(frozen=True)
class RoleCommand:
    """What `<role> serve` adds to the flags every worker shares."""

    name: str  # "drafter" or "verifier": the program, its config file section, its logs
    default_model: str
    add_arguments: Callable[[argparse.ArgumentParser], None]  # the role's own flags
    make_role: Callable[[argparse.Namespace, ModelConfig], WorkerRole]  # the role from the parsed flags


def build_parser(command: RoleCommand) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `drafter` or `verifier` command's parser and its `serve` subcommand's."""
    role = command.name
    parser = argparse.ArgumentParser(prog=role, description=f"specmesh {role} service", allow_abbrev=False,
                                     formatter_class=DefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help=f"run the {role} gRPC service", allow_abbrev=False,
                                formatter_class=DefaultsHelpFormatter)
    add_serve_arguments(serve, command.default_model)
    command.add_arguments(serve)
    add_config_argument(serve)
    return parser, serve


def serve_main(command: RoleCommand, argv: list[str] | None = None) -> int:
    role = command.name
    parser, serve = build_parser(command)
    argv = sys.argv[1:] if argv is None else argv
    # Flags also come from SPECMESH_* variables and a --config TOML file (specmesh/ops/config.py).
    flag_config.apply(serve, role, flag_config.load(flag_config.config_file(argv[1:])))
    args = parser.parse_args(argv)
    configure_logging(role, args.log_format, args.log_level)
    try:
        tls = TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca) if (args.tls_cert or args.tls_ca) else None
        check_tls_files(args.tls_cert, args.tls_key, args.tls_ca)
        token = load_token(args.token_file)
        config = ServerConfig(host=args.host, port=args.port, tls=tls, token=token,
                              max_message_bytes=args.max_message_bytes, max_concurrent_rpcs=args.max_concurrent_rpcs,
                              limits=SessionLimits(max_sessions=args.max_sessions, idle_ttl_s=args.session_ttl,
                                                   max_cache_bytes=args.max_cache_bytes),
                              max_draft_tokens=args.max_draft_tokens, max_context_length=args.max_context_length)
        model = ModelConfig(model=args.model, engine=args.engine, device=args.device, dtype=args.dtype,
                            linear_backend=args.linear_backend, threads=args.threads, repack=args.repack,
                            prefix_cache=args.prefix_cache, deterministic=args.deterministic)
        faults = FaultInjection(inject_latency_s=args.inject_latency)
        # What the flags get wrong, in one line with the fix, before the port is bound and the model loads.
        check_model(args.model, "--model", args.engine, args.device, args.dtype)
        if args.deterministic and choose_engine(args.engine, args.model, args.device, args.dtype) == "llamacpp":
            raise ValueError(NO_DETERMINISTIC_LLAMACPP)
        check_port(args.host, args.port, "--port")
        check_port(args.metrics_host, args.metrics_port, "--metrics-port")
        warning = exposure_warning(args.host, tls, token)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        try:
            server = WorkerServer(command.make_role(args, model), config, faults)
        except RuntimeError as e:  # gRPC's "Failed to bind": taken since the check above
            if "bind" not in str(e).lower():
                raise
            raise ValueError(f"could not listen on {args.host}:{args.port}: in use, or not an address of this "
                             "machine: pass another --port (0 picks a free one) or --host") from None
    except (ValueError, OSError) as e:
        print(f"{role}: error: {printable(with_fix(e), 20_000)}", file=sys.stderr)
        return 2

    loading = threading.Event()

    def abandon_load(signum, frame) -> None:
        # On the main thread, when it gets to the signal; SignalStop's own thread has logged it and started the stop.
        if loading.is_set():
            raise LoadAbandoned  # nothing is served yet: do not spend minutes loading a model nobody will use

    # Every SIGTERM/SIGINT is logged and answered whatever the main thread is doing: the first stops the server
    # (in-flight calls get --grace seconds) and the process ends within --grace + 10 s; a second ends it at once.
    SignalStop(lambda: server.stop(0 if loading.is_set() else args.grace), args.grace, state=server.state,
               on_main_thread=abandon_load).install()
    if args.exit_on_stdin_eof:
        exit_when_stdin_closes(hard_exit_after_s=args.grace + 30)
    model_thread.use_main_thread()  # every forward pass on this thread: see specmesh/runtime/model_thread.py
    server.start()
    print(f"LISTENING {server.address}", flush=True)
    metrics_port = serve_metrics(args.metrics_port, args.metrics_host)
    if metrics_port is not None:
        print(f"METRICS http://{args.metrics_host}:{metrics_port}/metrics", flush=True)
    try:
        loading.set()
        server.load()
        loading.clear()  # inside the try: a signal from here on is a normal graceful stop
    except LoadAbandoned:
        loading.clear()
        logging.getLogger(role).warning("stopped while loading the model")
        server.stop(grace=0)
        return 0
    except Exception as e:  # a model that cannot load is fatal for a worker: say why and exit non-zero
        loading.clear()
        logging.getLogger(role).error("could not load model %r: %s", args.model, e)
        server.stop(grace=0)
        return 1
    on_huge_pages = huge_page_bytes()
    if on_huge_pages:  # the weights, where the worker started on huge pages (specmesh/runtime/huge_pages.py)
        logging.getLogger(role).info("%.0f MiB on transparent huge pages", on_huge_pages / 2**20)
    print(f"READY {server.address}", flush=True)
    # Until the server has stopped (in-flight calls drained), this thread runs the engines' forward passes.
    model_thread.serve_on_main_thread(server.terminated)
    # Calls cancelled at the end of the grace period may still be waiting for their turn on this thread: give it to
    # them (a cancelled call costs no forward pass), so that no thread is left blocked when the interpreter exits.
    model_thread.serve_on_main_thread(server.drained)
    return 0
