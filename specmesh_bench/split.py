"""The split-host benchmark (`coordinator bench --topology split`): drafter, verifier and coordinator on three "hosts"
(network namespaces on one bridge, specmesh_bench/netns.py), the drafter and the verifier each pinned to a
core of its own with one thread, and a one-way delay on every link, swept over `--delays-ms`.

The workers start once and stay up across the sweep. For each delay, the specmesh modes run in the coordinator's
namespace (the ordinary bench, given the workers' addresses, so rows, summaries and the analytic bound are the same
as a local run's); specmesh target-only runs at every delay, as the baseline that pays the same round trips. The
in-process baselines (HF target-only, llama.cpp target-only for GGUF targets) run once, pinned to the verifier's core
with the same thread count: what the target alone does on the verifier's hardware, with no network at all.

Delays come from `tc netem` on each host's egress (one-way d per path, RTT 2d). Where the kernel has no netem,
`--link-delay auto` falls back to a user-space relay in the switch namespace that holds every byte for d in each
direction (specmesh_bench/delay_relay.py), and the report says so; `--link-delay netem` then fails. Without
root or iproute2 the command says why and exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from specmesh_bench.analysis import add_relative, summarize
from specmesh_bench.engines import requested_engines
from specmesh_bench.modes import Mode
from specmesh_bench.netns import Mesh, remove_stale_namespaces, unavailable_reason

HOSTS = {"coord": 1, "drafter": 2, "verifier": 3}
SUBNET = "10.213.9"  # private /24, used only inside the benchmark's namespaces
PORTS = {"drafter": 50051, "verifier": 50052}
DEFAULT_DELAYS_MS = (0.0, 1.0, 5.0, 20.0)
DEFAULT_SPLIT_MODES = "target-only,adaptive,adaptive-cost,pipelined,pipelined-cost,hf-target,llama-target"
LINK_DELAYS = ("auto", "netem", "relay")
UNAVAILABLE = 3  # exit status when namespaces or the asked-for delay method cannot be had here
STARTUP_TIMEOUT_S = 1800.0


class SplitUnavailable(Exception):
    """The split topology cannot run here; the message says why."""


def delays(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected one-way delays in ms like 0,1,5,20, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("split topology (--topology split)")
    group.add_argument("--delays-ms", type=delays, default=list(DEFAULT_DELAYS_MS),
                       help="one-way link delays to sweep, ms (round trip = twice; default: 0,1,5,20)")
    group.add_argument("--link-delay", choices=LINK_DELAYS, default="auto",
                       help="how links get their delay: tc netem, a user-space relay in the switch namespace, or "
                       "auto (netem where the kernel has it, else the relay; the report says which)")
    group.add_argument("--drafter-cpu", type=int, default=0, help="the core the drafter is pinned to")
    group.add_argument("--verifier-cpu", type=int, default=1,
                       help="the core the verifier (and the in-process baselines) are pinned to")


class StartedWorker:
    """A worker process in its namespace, whose stdout is read on a thread until it prints READY."""

    def __init__(self, process: subprocess.Popen, role: str, log_path: str) -> None:
        self.process, self.role, self.log_path = process, role, log_path
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.process.stdout:
            self.lines.put(raw.decode(errors="replace").strip())
        self.lines.put("")

    def wait_line(self, prefix: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return
            if not line and self.process.poll() is not None:
                break
        tail = "".join(Path(self.log_path).read_text(errors="replace").splitlines(True)[-20:])
        raise RuntimeError(f"{self.role} printed no {prefix} line (exit status {self.process.poll()}); its log:\n"
                           f"{tail}")


def sub_bench_argv(args: argparse.Namespace, modes: list[Mode], verifier: str, drafter: str, json_path: Path,
                   threads: int, baseline_cpu: int | None) -> list[str]:
    """The ordinary bench, run in the coordinator's namespace against the split workers."""
    argv = [sys.executable, "-m", "specmesh_bench.bench", "--verifier", verifier, "--drafter", drafter,
            "--modes", ",".join(m.name for m in modes), "--json", str(json_path),
            "--target-model", args.target_model, "--draft-model", args.draft_model, "--dtype", args.dtype,
            "--device", args.device, "--engine", args.engine, "--linear-backend", args.linear_backend,
            "--max-new-tokens", str(args.max_new_tokens), "--prompts", str(args.prompts), "--classes", args.classes,
            "--repeats", str(args.repeats), "--hf-prompt-lookup-tokens", str(args.hf_prompt_lookup_tokens),
            "--llama-flash-attn", args.llama_flash_attn, "--threads", str(threads),
            "--stream-flush-ms", str(args.stream_flush_ms)]
    for flag, value in (("--target-engine", args.target_engine), ("--draft-engine", args.draft_engine),
                        ("--limit-prompts", args.limit_prompts), ("--prompt-ids", args.prompt_ids)):
        if value:
            argv += [flag, value]
    if args.no_chat:
        argv.append("--no-chat")
    if baseline_cpu is not None:
        argv += ["--baseline-cpus", str(baseline_cpu)]
    return argv


def worker_argv(args: argparse.Namespace, role: str, host_address: str, threads: int) -> list[str]:
    engines = requested_engines(args)
    model, engine = ((args.target_model, engines["target"]) if role == "verifier"
                     else (args.draft_model, engines["draft"]))
    return [sys.executable, "-m", role, "serve", "--model", model, "--host", host_address, "--port", str(PORTS[role]),
            "--device", args.device, "--dtype", args.dtype, "--engine", engine, "--threads", str(threads),
            "--linear-backend", args.linear_backend, "--grace", "1", "--no-prefix-cache"]  # see specmesh_runs.py


def check_cpus(args: argparse.Namespace) -> None:
    allowed = os.sched_getaffinity(0)
    for flag, cpu in (("--drafter-cpu", args.drafter_cpu), ("--verifier-cpu", args.verifier_cpu)):
        if cpu not in allowed:
            raise ValueError(f"{flag} {cpu} is not a CPU this process may use ({sorted(allowed)})")
    if args.drafter_cpu == args.verifier_cpu:
        raise ValueError("--drafter-cpu and --verifier-cpu must differ: each worker has a core of its own")


def run_split(args: argparse.Namespace, modes: list[Mode], classes: list[str], skipped: dict,
              on_progress: Callable[[dict], None] | None = None) -> dict:
    """Every delay of the sweep, baselines once; returns the split report, and hands the report so far to
    `on_progress` after each delay. Raises SplitUnavailable with the reason when namespaces or the asked-for delay
    method cannot be had here."""
    reason = unavailable_reason()
    if reason:
        raise SplitUnavailable(reason)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (`timeout`, a scheduler) must unwind like Ctrl-C does, so that the namespaces and the workers in
        # them are removed; Python's default would end the process on the spot.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    threads = args.threads[0] if args.threads else 1
    remove_stale_namespaces()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="specmesh-split-") as tmp, Mesh(HOSTS, SUBNET, cwd=Path.cwd()) as mesh:
        method = args.link_delay
        if method != "relay" and any(args.delays_ms):
            netem_reason = mesh.netem_unavailable_reason()
            if netem_reason and method == "netem":
                raise SplitUnavailable(netem_reason)
            if netem_reason:
                print(f"bench: note: {netem_reason}: links get their delay from a user-space relay instead",
                      file=sys.stderr)
                method = "relay"
            else:
                method = "netem"
        elif method == "auto":
            method = "netem"  # nothing to delay: no qdisc is ever set
        workers = {}
        for role, cpu in (("verifier", args.verifier_cpu), ("drafter", args.drafter_cpu)):
            log_path = f"{tmp}/{role}.log"
            process = mesh.popen(role, worker_argv(args, role, mesh.address(role), threads), log_path, cpus={cpu},
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
            workers[role] = worker = StartedWorker(process, role, log_path)
            # One at a time, so that each warm-up cost probe (the cost policy's prior) runs on a quiet machine.
            worker.wait_line("READY", STARTUP_TIMEOUT_S)
            print(f"bench: {worker.role} SERVING in its namespace", file=sys.stderr, flush=True)

        runs, baseline_rows, first = [], [], None
        spec_modes = [m for m in modes if m.kind == "specmesh"]
        baseline_modes = [m for m in modes if m.kind != "specmesh"]
        for i, delay in enumerate(args.delays_ms):
            addresses = link_addresses(mesh, method, delay, tmp)
            print(f"bench: one-way delay {delay:g} ms ({method}), round trip {2 * delay:g} ms", file=sys.stderr,
                  flush=True)
            json_path = Path(tmp) / f"delay-{i}.json"
            with_baselines = i == 0 and bool(baseline_modes)
            argv = sub_bench_argv(args, spec_modes + (baseline_modes if with_baselines else []),
                                  addresses["verifier"], addresses["drafter"], json_path, threads,
                                  args.verifier_cpu if with_baselines else None)
            driver = mesh.popen("coord", argv, f"{tmp}/coord-{i}.log", stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL)
            follow_log(driver, f"{tmp}/coord-{i}.log")
            if driver.returncode != 0:
                raise RuntimeError(f"the coordinator-side bench at delay {delay:g} ms exited with status "
                                   f"{driver.returncode}")
            sub = json.loads(json_path.read_text())
            for process in addresses.get("relays", []):
                process.terminate()
                process.wait(timeout=10)
            first = first or sub
            rows = [dict(r, one_way_delay_ms=delay) for r in sub["rows"] if r["kind"] == "specmesh"]
            if with_baselines:
                baseline_rows = [r for r in sub["rows"] if r["kind"] != "specmesh"]
            runs.append({"one_way_delay_ms": delay, "rtt_ms": 2 * delay, "rows": rows,
                         "measured_rtt_ms": (sub["info"].get("rtt_ms") or {}).get("verifier")})
            if on_progress is not None:  # what is measured so far survives a run cut short
                on_progress(split_report(args, modes, classes, skipped, first, runs, baseline_rows, method, threads,
                                         started))
    return split_report(args, modes, classes, skipped, first, runs, baseline_rows, method, threads, started)


def split_report(args: argparse.Namespace, modes: list[Mode], classes: list[str], skipped: dict, first: dict,
                 runs: list[dict], baseline_rows: list[dict], method: str, threads: int, started: float) -> dict:
    """The report of the delays run so far: each delay's rows with the baselines' for speedups and summaries."""
    done = []
    for run in runs:
        rows = [dict(r) for r in run["rows"]] + [dict(r) for r in baseline_rows]
        add_relative(rows)
        done.append({**run, "rows": [r for r in rows if r["kind"] == "specmesh"],
                     "summary": summarize(rows, modes, classes)})
    config = dict(first["config"], modes=[m.name for m in modes], topology="split", delays_ms=args.delays_ms,
                  link_delay=method, drafter_cpu=args.drafter_cpu, verifier_cpu=args.verifier_cpu, threads=threads,
                  wall_s=round(time.time() - started, 1))
    return {"topology": "split", "info": first["info"], "config": config, "skipped_modes": skipped,
            "prompts": first["prompts"], "prompt_counts": first["prompt_counts"], "baseline_rows": baseline_rows,
            "runs": done}


def link_addresses(mesh: Mesh, method: str, delay_ms: float, tmp: str) -> dict:
    """Set every link's delay; the addresses the coordinator reaches the workers at (the relay's, for the relay)."""
    if method == "netem":
        for host in HOSTS:
            mesh.set_delay(host, delay_ms)
        return {role: f"{mesh.address(role)}:{port}" for role, port in PORTS.items()}
    router = mesh.address("router")
    routes = [arg for role, port in PORTS.items() for arg in ("--route", f"{router}:{port}={mesh.address(role)}:{port}")]
    log_path = f"{tmp}/relay-{delay_ms:g}.log"
    process = mesh.popen("router", [sys.executable, "-m", "specmesh_bench.delay_relay", "--delay-ms",
                                    str(delay_ms), *routes], log_path,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    StartedWorker(process, "delay relay", log_path).wait_line("RELAYING", 60)
    return {**{role: f"{router}:{port}" for role, port in PORTS.items()}, "relays": [process]}


def follow_log(process: subprocess.Popen, log_path: str) -> None:
    """Wait for the process, copying its log (the bench's per-row progress lines) to stderr as it grows."""
    with open(log_path, errors="replace") as log:
        while True:
            done = process.poll() is not None
            for line in log:
                print(line, end="", file=sys.stderr, flush=True)
            if done:
                return
            time.sleep(0.5)
