"""Ray smoke run, for real: specmesh on Ray Serve over a Ray cluster of three nodes on this machine.

    .venv/bin/python scripts/ray_smoke.py                     # or: make ray-smoke (the default model pair)
    .venv/bin/python scripts/ray_smoke.py --target-model tiny-random-qwen2 --draft-model tiny-random-qwen2-b \\
        --dtype float64 --max-tokens 24                       # the small version `make test` runs

Needs the `ray` extra (`make setup EXTRAS=test,ray`). Steps, each printed with its wall time:

 1. A Ray cluster of three nodes (specmesh/rayserve/local_cluster.py): `ray start --head` and two `ray start
    --address=...`, each its own raylet on its own loopback address, with its own CPUs and custom resources: the
    head offers `specmesh_head` (the coordinator ingress and the drafter go there), every node one
    `specmesh_verifier` (a verifier replica a node; the killed node is never the head, which holds the GCS).
 2. The application (specmesh/rayserve/app.py) with `serve.run`: verifier autoscaling from 1 to 2 replicas on
    ongoing generations. Start-up time: from `serve.run` to the ingress answering /health.
 3. Baseline: --prompts requests at once through the `openai` client, streamed, temperature 0. Meanwhile the
    verifier deployment's replica count is watched (serve.status()); the load should scale it from 1 to 2.
 4. Once two verifier replicas serve, on two nodes: the same requests again, and once every stream has
    --kill-after-chunks chunks, the node of the verifier replica holding the most sessions is killed (SIGKILL to its
    raylet, workers and agents). Every request must succeed with the baseline's output. Recovery: the time until Ray
    has a replacement replica serving (it answers Serve's broadcast), and until the coordinator's pool uses it.
 5. Idle: the verifier deployment must scale back down to 1 replica.
 6. Overhead (unless --no-overhead): `coordinator serve` on the same worker replicas (their gRPC addresses), and the
    same greedy request one at a time, alternating between that server and the Ray ingress, --overhead-rounds each.
 7. Everything stopped: Serve, the driver, every process of every node.

A JSON summary goes to stdout's last line and to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from specmesh.rayserve.local_cluster import LocalRayCluster, NodeSpec, free_port

APP = "specmesh"
PROMPTS = [
    ("completion", "def fib(n):"),
    ("chat", "Write a Python function that checks whether a number is prime."),
    ("completion", "class Stack:\n    \"\"\"A LIFO stack.\"\"\""),
    ("chat", "Reverse a list in Python."),
]
T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:8.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target-model", default=None, help="verifier model (default: coordinator serve's)")
    p.add_argument("--draft-model", default=None, help="drafter model (default: coordinator serve's)")
    p.add_argument("--engine", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="CPU threads of each worker's model")
    p.add_argument("--inject-latency", type=float, default=0.0,
                   help="testing: seconds each Propose/Verify waits first (tiny models finish too fast to be "
                   "killed mid-generation or to load a verifier long enough for autoscaling)")
    p.add_argument("--prompts", type=int, default=3, choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--kill-after-chunks", type=int, default=2)
    p.add_argument("--target-ongoing", type=float, default=1.0,
                   help="verifier autoscaling: generations per replica")
    p.add_argument("--downscale-delay", type=float, default=60.0, help="verifier autoscaling: seconds")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--no-overhead", dest="overhead", action="store_false",
                   help="skip the comparison with coordinator serve on the same workers")
    p.add_argument("--overhead-rounds", type=int, default=3)
    p.add_argument("--overhead-tokens", type=int, default=64)
    p.add_argument("--out", default="/var/tmp/specmesh-ray-smoke/result.json")
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.kill_after_chunks < 1 or args.overhead_rounds < 1:
        p.error("--max-tokens, --kill-after-chunks and --overhead-rounds must be >= 1")
    return args


def serve_args(args: argparse.Namespace) -> list[str]:
    out = ["--engine", args.engine, "--dtype", args.dtype, "--draft-tokens", "4", "--retry-budget", "300"]
    if args.target_model:
        out += ["--target-model", args.target_model]
    if args.draft_model:
        out += ["--draft-model", args.draft_model]
    return out


def app_args(args: argparse.Namespace) -> dict:
    worker = {"grace_s": 5.0, "inject_latency_s": args.inject_latency,
              **({"threads": args.threads} if args.threads else {})}
    return {
        "serve_args": serve_args(args),
        "coordinator": {"num_cpus": 0.5, "resources": {"specmesh_head": 0.5}},
        "drafter": {"num_cpus": 0.5, "resources": {"specmesh_head": 0.5}},
        "verifier": {"num_cpus": 0.5, "resources": {"specmesh_verifier": 1}},
        "verifier_scaling": {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                             "target_ongoing_requests": args.target_ongoing, "upscale_delay_s": 1.0,
                             "downscale_delay_s": args.downscale_delay, "look_back_period_s": 2.0,
                             "metrics_interval_s": 0.5},
        "worker": worker,
        "discovery_interval_s": 0.5,
    }


def cluster_nodes() -> list[NodeSpec]:
    # One verifier slot a node: two replicas always run on two raylets, and the replacement of a killed one has a
    # node to go to (the head, or the other worker node). The head is never the node killed (it holds the GCS).
    return [NodeSpec("head", num_cpus=2, resources={"specmesh_head": 1, "specmesh_verifier": 1}),
            NodeSpec("node-a", num_cpus=1, resources={"specmesh_verifier": 1}),
            NodeSpec("node-b", num_cpus=1, resources={"specmesh_verifier": 1})]


class ReplicaWatch:
    """The verifier deployment's running replicas, read from serve.status() twice a second; every change logged."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int]] = []  # (seconds since start, running replicas)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def running(self) -> int:
        from ray import serve
        try:
            deployment = serve.status().applications[APP].deployments["verifier"]
        except KeyError:
            return 0
        return int(deployment.replica_states.get("RUNNING", 0))

    def _run(self) -> None:
        last = None
        while not self._stop.wait(0.5):
            try:
                count = self.running()
            except Exception as e:  # noqa: BLE001 - a missed sample
                say(f"serve.status() failed: {e}")
                continue
            if count != last:
                self.events.append((round(time.monotonic() - T0, 1), count))
                say(f"autoscaling: verifier replicas running: {last} -> {count}")
                last = count

    def start(self) -> ReplicaWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def wait_for(self, count: int, timeout_s: float) -> float | None:
        """Seconds until `count` replicas run (None if not within timeout_s)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.running() == count:
                return time.monotonic() - started
            time.sleep(0.5)
        return None


def request(client, kind: str, prompt: str, max_tokens: int, stream: bool, progress: list | None = None) -> dict:
    common = dict(model=client.models.list().data[0].id, max_tokens=max_tokens, temperature=0)
    started = time.monotonic()  # the request alone
    if kind == "chat":
        call = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=stream, **common)
    else:
        call = client.completions.create(prompt=prompt, stream=stream, **common)
    if not stream:
        choice = call.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return {"text": text, "finish_reason": choice.finish_reason, "seconds": time.monotonic() - started}
    pieces, finish = [], None
    for chunk in call:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        piece = (choice.delta.content if kind == "chat" else choice.text) or ""
        pieces.append(piece)
        if progress is not None:
            progress[0] += 1
        finish = choice.finish_reason or finish
    return {"text": "".join(pieces), "finish_reason": finish, "seconds": time.monotonic() - started}


def run_requests(client, prompts, max_tokens: int, progress: list[list[int]] | None = None) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(request, client, kind, prompt, max_tokens, True,
                               progress[i] if progress is not None else None)
                   for i, (kind, prompt) in enumerate(prompts)]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as e:  # noqa: BLE001 - a failed request is a result to report
                results.append({"error": f"{type(e).__name__}: {e}"})
        return results


def describe_verifiers(timeout_s: float = 10.0) -> list[dict]:
    from ray import serve
    handle = serve.get_deployment_handle("verifier", app_name=APP)
    replies = handle.broadcast("describe").results(timeout_s=timeout_s, return_exceptions=True)
    return [r for r in replies if isinstance(r, dict)]


def describe_drafters(timeout_s: float = 10.0) -> list[dict]:
    from ray import serve
    handle = serve.get_deployment_handle("drafter", app_name=APP)
    return [r for r in handle.broadcast("describe").results(timeout_s=timeout_s, return_exceptions=True)
            if isinstance(r, dict)]


def coordinator_fleet() -> dict:
    from ray import serve
    return serve.get_deployment_handle("coordinator", app_name=APP).fleet.remote().result(timeout_s=10)


def usable_verifiers(fleet: dict) -> list[str]:
    return sorted(e["address"] for e in fleet.get("verifier", []) if e["serving"] and not e["retired"])


def wait_until(predicate, timeout_s: float, step_s: float = 0.25):
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    return None


def http_get(url: str, timeout_s: float = 5.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except Exception:  # noqa: BLE001 - not up yet
        return None


def same(a: list[dict], b: list[dict]) -> list[bool]:
    return [x.get("text") == y.get("text") and x.get("finish_reason") == y.get("finish_reason") and "error" not in y
            for x, y in zip(a, b)]


def overhead(args, ray_client, verifiers: list[str], drafters: list[str], stack: ExitStack) -> dict:
    """`coordinator serve` over the same worker replicas, against the Ray ingress: one greedy request at a time."""
    import openai
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "coordinator", "serve", "--host", "127.0.0.1", "--port", str(port),
               *[a for v in verifiers for a in ("--verifier", v)], *[a for d in drafters for a in ("--drafter", d)],
               *serve_args(args)]
    log = open(Path(args.workdir) / "coordinator-serve.log", "wb")
    stack.callback(log.close)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop() -> None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    stack.callback(stop)
    if not wait_until(lambda: (http_get(f"http://127.0.0.1:{port}/health") or {}).get("status") == "ok", 300):
        raise RuntimeError(f"coordinator serve did not start; see {log.name}")
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=args.request_timeout)
    kind, prompt = PROMPTS[0]
    times: dict[str, list[float]] = {"ray": [], "direct": []}
    texts: dict[str, set[str]] = {"ray": set(), "direct": set()}
    for round_ in range(args.overhead_rounds + 1):  # the first round warms both paths up, not counted
        for name, client in (("direct", direct), ("ray", ray_client)) if round_ % 2 else \
                (("ray", ray_client), ("direct", direct)):
            reply = request(client, kind, prompt, args.overhead_tokens, stream=False)
            texts[name].add(reply["text"])
            if round_:
                times[name].append(reply["seconds"])
    ray_s, direct_s = statistics.median(times["ray"]), statistics.median(times["direct"])
    result = {"ray_s": [round(t, 3) for t in times["ray"]], "direct_s": [round(t, 3) for t in times["direct"]],
              "ray_median_s": round(ray_s, 3), "direct_median_s": round(direct_s, 3),
              "ray_over_direct": round(ray_s / direct_s, 4), "same_text": texts["ray"] == texts["direct"]
              and len(texts["ray"]) == 1}
    say(f"overhead: Ray ingress {ray_s:.3f} s vs coordinator serve {direct_s:.3f} s (median of "
        f"{args.overhead_rounds}): {ray_s / direct_s:.3f}x; same text: {result['same_text']}")
    return result


def run(args: argparse.Namespace) -> dict:
    import openai
    import ray
    from ray import serve

    from specmesh.rayserve.app import build_app
    summary: dict = {"pass": False}
    prompts = PROMPTS[:args.prompts]
    with ExitStack() as stack:
        say("step 1: a Ray cluster of three nodes")
        started = time.monotonic()
        cluster = stack.enter_context(LocalRayCluster(cluster_nodes()))
        args.workdir = cluster.temp_dir
        summary["nodes"] = {n.name: n.ip for n in cluster.nodes}
        say(f"cluster up in {time.monotonic() - started:.1f} s at {cluster.address}: "
            + ", ".join(f"{n.name} {n.ip} {dict(n.spec.resources)}" for n in cluster.nodes))
        ray.init(address=cluster.address, _node_ip_address=cluster.ips[0], log_to_driver=False,
                 logging_level="WARNING")
        stack.callback(ray.shutdown)
        http_port = free_port(cluster.ips[0])
        serve.start(http_options={"host": cluster.ips[0], "port": http_port}, proxy_location="HeadOnly")
        stack.callback(serve.shutdown)
        base = f"http://{cluster.ips[0]}:{http_port}"

        say("step 2: serve.run(build_app(...))")
        started = time.monotonic()
        serve.run(build_app(app_args(args)), name=APP, route_prefix="/", blocking=False)
        health = wait_until(lambda: (http_get(f"{base}/health") or {}).get("status") == "ok", args.start_timeout)
        if not health:
            raise RuntimeError("the Ray ingress never answered /health ok")
        summary["startup_s"] = round(time.monotonic() - started, 1)
        verifiers = describe_verifiers()
        say(f"application up in {summary['startup_s']} s; verifiers {[v['address'] for v in verifiers]}, "
            f"drafters {[d['address'] for d in describe_drafters()]}")
        watch = ReplicaWatch().start()
        stack.callback(watch.stop)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=args.request_timeout,
                               max_retries=0)

        say(f"step 3: baseline, {len(prompts)} streamed requests at once (the load that should scale 1 -> 2)")
        started = time.monotonic()
        baseline = run_requests(client, prompts, args.max_tokens)
        summary["baseline_s"] = round(time.monotonic() - started, 1)
        for (kind, prompt), result in zip(prompts, baseline):
            say(f"  baseline {kind:10s} {result.get('seconds', 0):6.1f} s {result.get('finish_reason')} "
                f"{(result.get('text') or result.get('error', ''))[:60]!r}")
        if any("error" in r for r in baseline):
            raise RuntimeError(f"baseline requests failed: {[r.get('error') for r in baseline]}")
        scaled_up = watch.wait_for(2, args.start_timeout)
        if scaled_up is None:
            raise RuntimeError("the verifier deployment did not scale up to 2 replicas")
        two = wait_until(lambda: len(usable_verifiers(coordinator_fleet())) == 2, args.start_timeout, 0.5)
        if not two:
            raise RuntimeError(f"no two verifier replicas in the coordinator's pool: "
                               f"{coordinator_fleet()}, {describe_verifiers()}")
        summary["scaled_up"] = True
        say(f"two verifiers serve, on two nodes: {usable_verifiers(coordinator_fleet())}")

        say("step 4: the same requests, the node of the busiest verifier killed mid-generation")
        progress = [[0] for _ in prompts]
        kill: dict = {}

        def killer() -> None:
            if not wait_until(lambda: all(p[0] >= args.kill_after_chunks for p in progress), args.request_timeout,
                              0.05):
                return
            replicas = describe_verifiers()
            victim = max((r for r in replicas if not r["address"].startswith(cluster.ips[0] + ":")),
                         key=lambda r: r["sessions"])
            node = cluster.node_by_ip(victim["address"].rsplit(":", 1)[0])
            kill.update(address=victim["address"], sessions={r["address"]: r["sessions"] for r in replicas},
                        node=node.name, chunks=[p[0] for p in progress], at=time.monotonic())
            pids = node.kill()
            say(f"  killed node {node.name} ({len(pids)} processes: raylet, workers, agents) holding verifier "
                f"{victim['address']}; sessions {kill['sessions']}; chunks so far {kill['chunks']}")
            # Recovery, timed from the kill while the requests still run: a replacement answering Serve's
            # broadcast (its model loaded: its constructor has returned), then in the coordinator's pool.
            dead = node.ip + ":"
            if wait_until(lambda: len([v for v in describe_verifiers() if not v["address"].startswith(dead)]) == 2,
                          args.start_timeout, 0.25):
                kill["back_at"] = time.monotonic()
                say(f"  a replacement verifier serves, {kill['back_at'] - kill['at']:.1f} s after the kill")
            if wait_until(lambda: len(usable_verifiers(coordinator_fleet())) == 2, args.start_timeout, 0.25):
                kill["pool_at"] = time.monotonic()
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        started = time.monotonic()
        killed_run = run_requests(client, prompts, args.max_tokens, progress)
        thread.join(args.start_timeout)
        summary["kill_run_s"] = round(time.monotonic() - started, 1)
        for (kind, prompt), result in zip(prompts, killed_run):
            say(f"  kill-run {kind:10s} {result.get('seconds', 0):6.1f} s {result.get('finish_reason')} "
                f"{(result.get('text') or result.get('error', ''))[:60]!r}")
        if not kill:
            raise RuntimeError(f"the kill never happened (chunks {[p[0] for p in progress]})")
        matches = same(baseline, killed_run)
        summary["kill"] = {k: v for k, v in kill.items() if not k.endswith("at")}
        summary["failed_requests"] = sum("error" in r for r in killed_run)
        summary["mismatches"] = matches.count(False)
        say(f"outputs equal with and without the kill: {matches}")

        summary["replica_back_s"] = round(kill["back_at"] - kill["at"], 1) if "back_at" in kill else None
        summary["in_coordinator_pool_s"] = round(kill["pool_at"] - kill["at"], 1) if "pool_at" in kill else None
        say(f"Ray brought the replica back: serving {summary['replica_back_s']} s after the kill, in the "
            f"coordinator's pool after {summary['in_coordinator_pool_s']} s: {usable_verifiers(coordinator_fleet())}")
        after = request(client, *prompts[0], args.max_tokens, stream=False)
        summary["after_recovery_same"] = after["text"] == baseline[0]["text"]

        say("step 5: idle; the verifier deployment should scale back down to 1")
        scaled_down = watch.wait_for(1, args.downscale_delay + 120)
        summary["scaled_down"] = scaled_down is not None
        summary["scaled_down_after_idle_s"] = round(scaled_down, 1) if scaled_down is not None else None
        if args.overhead:  # on the fleet as it stays: the same worker replicas behind both servers
            say("step 6: overhead against coordinator serve on the same workers, one greedy request at a time")
            summary["overhead"] = overhead(args, client, [v["address"] for v in describe_verifiers()],
                                           [d["address"] for d in describe_drafters()], stack)
        summary["replica_events"] = watch.events
        summary["pass"] = bool(summary["failed_requests"] == 0 and summary["mismatches"] == 0
                               and summary["replica_back_s"] is not None and summary["scaled_up"]
                               and summary["scaled_down"] and summary["after_recovery_same"]
                               and summary.get("overhead", {}).get("same_text", True))
        say("step 7: stopping Serve and every node")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
    except Exception as e:  # noqa: BLE001 - reported as the run's result
        summary = {"pass": False, "error": f"{type(e).__name__}: {e}"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    say(("PASS" if summary["pass"] else "FAIL") + f": summary in {out}")
    print(json.dumps(summary))
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
