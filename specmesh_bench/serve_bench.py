"""`coordinator bench-serve`: multi-turn conversations through `coordinator serve` and the official `openai` client,
one server per decoding mode, reporting tokens/s and time to first token per turn against target-only.

The workload (conversations.json, written for this benchmark) repeats itself the way real traffic does: code edits
that return the whole function each turn (`edit`), a JSON tool-call loop (`tools`), questions over one document with
quoted answers (`document`); `prose` is the control, where nothing repeats. Each turn is one chat request, streamed,
greedy (temperature 0), `--max-tokens` at most; the reply is appended to that mode's own history before the next turn.

Fairness: every mode gets workers of its own, all started at the beginning, one at a time (each worker's cost probe,
which runs once it is SERVING, then runs on a quiet machine): a verifier (its own prefix cache), and its own drafters (a model drafter, and
fresh suffix trees or an n-gram drafter), then one `coordinator serve` per mode pointing at them. Modes:

    target-only  the verifier alone (`--draft-tokens 0`): the baseline every ratio is taken against
    hybrid       model drafter + suffix drafter (`--suffix-drafter`): suffix drafts where the match is long
    hybrid-no-guesses  the same without the streamed steps' free guesses (`--no-stream-guesses`); on request only
    suffix       the suffix drafter alone (`drafter serve --method suffix` as `--drafter`)
    ngram        the n-gram drafter (prompt lookup within the request)
    model        the model drafter, `--draft-policy` (default cost)

Conversations run interleaved: for each conversation every mode runs all its turns before the next mode does, the
modes' order rotating by one per conversation, so that a machine whose speed drifts slows every mode alike; the
conversations themselves alternate between classes. Each server gets one short warm-up request first.

Measured per turn: prompt and completion tokens (the response's usage), time to the first streamed text (TTFT), total
seconds, tokens/s (completion tokens / total seconds, as the client sees them), and, from the server's `--record` file
(the HTTP response carries no specmesh stats), rounds, drafted and accepted tokens; from the verifier's Info, the
prompt tokens its prefix cache reused. Every turn's text is compared with target-only's at the same turn (greedy
output is identical wherever the engine's passes are exact; once a mode's history differs, later prompts differ too).

    coordinator bench-serve --json serve.json --markdown serve.md
    coordinator bench-serve --modes target-only,hybrid,suffix --classes edit,prose --conversations-per-class 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.drafting.policies import DEFAULT_POLICY, POLICIES
from coordinator.fleet.polling import wait_until
from specmesh.ops.flags import DefaultsHelpFormatter
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from specmesh.runtime.engine import ENGINES

DEFAULT_WORKLOAD = Path(__file__).with_name("conversations.json")
MODES = {
    "target-only": "the verifier alone (--draft-tokens 0)",
    "hybrid": "model drafter + suffix drafter (--suffix-drafter): the suffix draft where its match is long",
    "hybrid-no-guesses": "hybrid without the streamed steps' free guesses (coordinator serve --no-stream-guesses)",
    "suffix": "suffix drafter alone (drafter serve --method suffix)",
    "ngram": "n-gram drafter (drafter serve --method ngram)",
    "model": "model drafter",
}
DEFAULT_MODES = ("target-only", "hybrid", "suffix", "ngram", "model")  # hybrid-no-guesses on request: a comparison
REFERENCE = "target-only"
REPEATING_CLASSES = ("edit", "tools", "document")  # the classes that repeat themselves
CONTROL_CLASSES = ("prose",)  # nothing repeats: the policy should back off
TURN_ROLES = ("user", "tool")  # what a turn sends; the system message is the conversation's "system"
# The targets (measured, never asserted): speed over target-only from turn 2 in the repeating classes, the
# floor for every class, and turn N's time to first token over turn 1's.
TARGET_SPEEDUP, TARGET_CLASS_FLOOR, TARGET_TTFT_GROWTH = 1.4, 0.98, 1.2
WARMUP_MESSAGES = [{"role": "user", "content": "Reply with the single word: ready."}]
# `coordinator serve` has no lifeline flag of its own: this starts it with the workers' (specmesh/worker/lifeline.py),
# so it ends when this process does, however this process ends (its stdin is a pipe only this process holds).
SERVE_WITH_LIFELINE = ("import sys; from specmesh.worker.lifeline import exit_when_stdin_closes; "
                       "exit_when_stdin_closes(20.0); from coordinator.cli import main; sys.exit(main(sys.argv[1:]))")


# ---------------------------------------------------------------------------------------------- the workload

def workload_problems(data: object) -> list[str]:
    """What is wrong with a workload file's content (empty: nothing)."""
    if not isinstance(data, dict) or not isinstance(data.get("conversations"), list) or not data["conversations"]:
        return ["expected an object with a non-empty list 'conversations'"]
    problems, seen = [], set()
    for n, conversation in enumerate(data["conversations"]):
        if not isinstance(conversation, dict):
            problems.append(f"conversation {n}: not an object")
            continue
        name = conversation.get("id")
        where = f"conversation {name!r}" if isinstance(name, str) and name else f"conversation {n}"
        if not isinstance(name, str) or not name:
            problems.append(f"{where}: needs a non-empty string 'id'")
        elif name in seen:
            problems.append(f"{where}: duplicate id")
        seen.add(name)
        if not isinstance(conversation.get("class"), str) or not conversation["class"]:
            problems.append(f"{where}: needs a non-empty string 'class'")
        system = conversation.get("system")
        if system is not None and (not isinstance(system, str) or not system.strip()):
            problems.append(f"{where}: 'system' must be a non-empty string when given")
        turns = conversation.get("turns")
        if not isinstance(turns, list) or not turns:
            problems.append(f"{where}: needs a non-empty list 'turns'")
            continue
        for t, turn in enumerate(turns, 1):
            if not isinstance(turn, dict) or turn.get("role") not in TURN_ROLES:
                problems.append(f"{where}, turn {t}: needs 'role' {' or '.join(TURN_ROLES)}")
            elif not isinstance(turn.get("content"), str) or not turn["content"].strip():
                problems.append(f"{where}, turn {t}: needs a non-empty string 'content'")
        if isinstance(turns[0], dict) and turns[0].get("role") != "user":
            problems.append(f"{where}: the first turn must be the user's")
    return problems


def load_workload(path: Path) -> list[dict]:
    """The conversations of a workload file; ValueError saying what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read workload {path}: {e}") from None
    problems = workload_problems(data)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"workload {path}: {'; '.join(problems[:5])}{more}")
    return data["conversations"]


def select_conversations(conversations: list[dict], classes: list[str] | None = None,
                         per_class: int | None = None, max_turns: int | None = None) -> list[dict]:
    """The conversations a run measures, alternating between classes (edit 1, tools 1, ..., edit 2, ...): traffic
    mixes its kinds, and a class's second conversation then finds what the first left in the global suffix tree
    only after other traffic passed. `max_turns` cuts every conversation to its first turns."""
    known = list(dict.fromkeys(c["class"] for c in conversations))
    classes = classes or known
    unknown = [c for c in classes if c not in known]
    if unknown:
        raise ValueError(f"unknown class(es) {', '.join(unknown)}; the workload has {', '.join(known)}")
    by_class = {c: [conv for conv in conversations if conv["class"] == c][:per_class] for c in classes}
    selected = []
    for i in range(max(len(v) for v in by_class.values())):
        selected += [by_class[c][i] for c in classes if i < len(by_class[c])]
    if max_turns is not None:
        selected = [{**conv, "turns": conv["turns"][:max_turns]} for conv in selected]
    return selected


def first_messages(conversation: dict) -> list[dict]:
    return [{"role": "system", "content": conversation["system"]}] if conversation.get("system") else []


def rotated(modes: list[str], index: int) -> list[str]:
    """The modes' order for the index-th conversation: each conversation starts one mode later."""
    shift = index % len(modes)
    return modes[shift:] + modes[:shift]


def messages_digest(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- the fleet

def worker_specs(args: argparse.Namespace, mode: str) -> list[tuple[str, object]]:
    """(kind, LocalWorkerSpec) of each worker a mode runs on: verifier, drafter, suffix_drafter."""
    from coordinator.fleet.local_workers import LocalWorkerSpec
    cache = ("--no-prefix-cache",) if args.no_prefix_cache else ()
    verifier = LocalWorkerSpec("verifier", args.target_model, args.device, args.dtype, args.threads,
                               engine=args.engine, extra_args=cache)
    model = LocalWorkerSpec("drafter", args.draft_model, args.device, args.dtype, args.threads, engine=args.engine,
                            extra_args=cache)

    def model_free(method: str) -> LocalWorkerSpec:  # reads the target's tokenizer only: no weights
        return LocalWorkerSpec("drafter", args.target_model, "cpu", "auto", extra_args=("--method", method))
    return {"target-only": [("verifier", verifier)],
            "model": [("verifier", verifier), ("drafter", model)],
            "hybrid": [("verifier", verifier), ("drafter", model), ("suffix_drafter", model_free("suffix"))],
            "hybrid-no-guesses": [("verifier", verifier), ("drafter", model), ("suffix_drafter", model_free("suffix"))],
            "suffix": [("verifier", verifier), ("drafter", model_free("suffix"))],
            "ngram": [("verifier", verifier), ("drafter", model_free("ngram"))]}[mode]


def serve_arguments(args: argparse.Namespace, mode: str, addresses: dict[str, str], record: Path) -> list[str]:
    """`coordinator serve`'s flags for a mode over its workers."""
    argv = ["serve", "--host", "127.0.0.1", "--port", "0", "--verifier", addresses["verifier"],
            "--record", str(record), "--log-level", "WARNING",
            # Long prompts queue behind their prefill on a CPU: measure, do not time out.
            "--rpc-timeout", "900", "--retry-budget", "900"]
    if mode == REFERENCE:
        return argv + ["--draft-tokens", "0"]
    argv += ["--drafter", addresses["drafter"], "--draft-policy", args.draft_policy]
    if "suffix_drafter" in addresses:
        argv += ["--suffix-drafter", addresses["suffix_drafter"]]
    if mode == "hybrid-no-guesses":
        argv += ["--no-stream-guesses"]
    return argv


class ServeProcess:
    """One `coordinator serve` subprocess on a free loopback port: its URL once it prints LISTENING, and the lines
    its --record file gains."""

    def __init__(self, argv: list[str], record: Path, log_path: Path, timeout_s: float = 600.0) -> None:
        self.record, self.log_path = record, log_path
        self._record_offset = 0
        self._log = open(log_path, "ab")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SPECMESH_") or k in ("SPECMESH_TOKEN", "SPECMESH_TOKEN_FILE", "SPECMESH_CACHE_DIR")}
        # Its own process group: a terminal's Ctrl-C reaches this process only, which stops the server itself.
        self.process = subprocess.Popen([sys.executable, "-c", SERVE_WITH_LIFELINE, *argv], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, env=env, process_group=0)
        self._listening: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.timeout_s = timeout_s
        self.url = ""

    def _read_stdout(self) -> None:
        for raw in self.process.stdout:  # drained to the end: the server never blocks on a full pipe
            line = raw.decode(errors="replace").strip()
            if line.startswith("LISTENING ") and not self._listening:
                self._listening.append(line.split(" ", 1)[1])

    def wait_listening(self) -> str:
        wait_until(lambda: self._listening or self.process.poll() is not None, self.timeout_s)
        if not self._listening:
            raise RuntimeError(f"coordinator serve did not start; its log:\n{self.log_tail()}")
        self.url = self._listening[0]
        return self.url

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    def new_records(self) -> list[dict]:
        """The generations recorded since the last call (the server writes a line before it ends the response)."""
        try:
            with self.record.open("rb") as f:
                f.seek(self._record_offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[:data.rfind(b"\n") + 1]
        self._record_offset += len(complete)
        return [json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip()]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        if not self._log.closed:
            self._log.close()


@dataclass
class ModeServer:
    mode: str
    addresses: dict[str, str]
    serve: ServeProcess
    workers: dict[str, dict] = field(default_factory=dict)  # kind -> what its Info says
    client: object = None  # openai.OpenAI
    verifier: object = None  # RemoteWorker, for the prefix cache counters


def worker_info(address: str, role: str) -> dict:
    from coordinator.fleet.worker_client import RemoteWorker
    worker = RemoteWorker(address, role)
    try:
        info = worker.info()
    finally:
        worker.close()
    return {"address": address, "model": info.model_name, "engine": info.engine or "model-free",
            "dtype": info.dtype, "device": info.device}


@contextmanager
def mode_servers(args: argparse.Namespace, modes: list[str], log_dir: Path) -> Iterator[dict[str, ModeServer]]:
    """Every mode's workers (started one at a time) and its `coordinator serve`; all stopped on exit."""
    import openai

    from coordinator.fleet.local_workers import local_workers
    from coordinator.fleet.worker_client import RemoteWorker
    with ExitStack() as stack:
        addresses: dict[str, dict[str, str]] = {}
        for mode in modes:
            addresses[mode] = {}
            for kind, spec in worker_specs(args, mode):
                progress(f"{mode}: starting {kind} {spec.model}")
                # One at a time: its cost probe has run (on a quiet machine) before the next worker starts.
                started = stack.enter_context(local_workers([spec], progress=False, one_at_a_time=True))
                addresses[mode][kind] = started[spec.role]
        servers = {}
        for mode in modes:  # started together: nothing measures while they load
            record = log_dir / f"{mode}.record.jsonl"
            serve = ServeProcess(serve_arguments(args, mode, addresses[mode], record), record,
                                 log_dir / f"{mode}.serve.log")
            stack.callback(serve.stop)
            servers[mode] = ModeServer(mode, addresses[mode], serve)
        for server in servers.values():
            url = server.serve.wait_listening()
            progress(f"{server.mode}: coordinator serve on {url}")
            server.client = openai.OpenAI(base_url=f"{url}/v1", api_key="bench-serve", max_retries=0,
                                          timeout=args.request_timeout)
            stack.callback(server.client.close)
            server.workers = {kind: worker_info(address, "verifier" if kind == "verifier" else "drafter")
                              for kind, address in server.addresses.items()}
            server.verifier = RemoteWorker(server.addresses["verifier"], "verifier")
            stack.callback(server.verifier.close)
        yield servers


def progress(message: str) -> None:
    print(f"bench-serve: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- one turn

def stream_turn(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed, greedy chat request: text, usage, time to the first text and in total."""
    started = time.perf_counter()
    ttft, pieces, usage, finish = None, [], None, None
    stream = client.chat.completions.create(model=model, messages=messages, stream=True, temperature=0,
                                            max_tokens=max_tokens, stream_options={"include_usage": True})
    for chunk in stream:
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta is not None and choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - started
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    total = time.perf_counter() - started
    return {"text": "".join(pieces), "ttft_s": ttft, "total_s": total, "finish_reason": finish,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None}


def prefix_counters(server: ModeServer) -> tuple[int, int]:
    info = server.verifier.info()
    return info.prefix_cache_hits, info.prefix_cache_reused_tokens


def turn_row(conversation: dict, mode: str, turn: int, position: int, messages: list[dict], reply: dict,
             record: dict | None, prefix_before: tuple[int, int], prefix_after: tuple[int, int]) -> dict:
    stats = (record or {}).get("stats", {})
    completion = reply["completion_tokens"]
    if completion is None:
        completion = stats.get("new_tokens", 0)
    rounds = stats.get("rounds")
    return {
        "conversation": conversation["id"], "class": conversation["class"], "mode": mode, "turn": turn,
        "position": position,  # where the mode ran in this conversation's rotated order (0 = first)
        "prompt_tokens": reply["prompt_tokens"] if reply["prompt_tokens"] is not None else len(
            (record or {}).get("prompt_ids", [])),
        "completion_tokens": completion,
        "ttft_s": None if reply["ttft_s"] is None else round(reply["ttft_s"], 4),
        "total_s": round(reply["total_s"], 4),
        "tokens_per_s": round(completion / reply["total_s"], 3) if reply["total_s"] > 0 else None,
        "finish_reason": reply["finish_reason"],
        "rounds": rounds, "drafted_rounds": stats.get("drafted_rounds"),
        "drafted_tokens": stats.get("drafted_tokens"), "accepted_tokens": stats.get("accepted_tokens"),
        "acceptance_rate": stats.get("acceptance_rate"),
        "tokens_per_round": round(completion / rounds, 4) if rounds else None,
        "suffix_rounds": stats.get("suffix_rounds"), "model_rounds": stats.get("model_rounds"),
        "draft_s": stats.get("draft_s"), "verify_s": stats.get("verify_s"),
        "prefix_cache_hit": prefix_after[0] > prefix_before[0],
        "prefix_reused_tokens": prefix_after[1] - prefix_before[1],
        "prompt_digest": messages_digest(messages),
        "text": reply["text"],
    }


def run_conversation(server: ModeServer, model: str, conversation: dict, max_tokens: int,
                     position: int) -> list[dict]:
    """Every turn of a conversation through one mode's server, the mode's own replies in its history."""
    messages = first_messages(conversation)
    rows = []
    server.serve.new_records()  # skip anything recorded before (the warm-up)
    for turn, message in enumerate(conversation["turns"], 1):
        messages.append({"role": message["role"], "content": message["content"]})
        before = prefix_counters(server)
        reply = stream_turn(server.client, model, messages, max_tokens)
        after = prefix_counters(server)
        records = server.serve.new_records()
        row = turn_row(conversation, server.mode, turn, position, messages, reply, records[-1] if records else None,
                       before, after)
        rows.append(row)
        messages.append({"role": "assistant", "content": reply["text"]})
        rate = "n/a" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
        ttft = "n/a" if row["ttft_s"] is None else f"{row['ttft_s']:.2f} s"
        progress(f"{conversation['id']} {server.mode:>11s} turn {turn}: {row['completion_tokens']} tokens in "
                 f"{row['total_s']:.2f} s ({row['tokens_per_s'] or 0:.2f} tok/s), TTFT {ttft}, prompt "
                 f"{row['prompt_tokens']} ({row['prefix_reused_tokens']} cached), acceptance {rate}")
    return rows


def mark_reference(rows: list[dict], reference: str = REFERENCE) -> None:
    """Set each row's same_prompt and same_text: whether its prompt (its mode's history) and its reply equal the
    reference mode's at the same conversation and turn (None where the reference did not run)."""
    base = {(r["conversation"], r["turn"]): r for r in rows if r["mode"] == reference}
    for row in rows:
        ref = base.get((row["conversation"], row["turn"]))
        row["same_prompt"] = None if ref is None else row["prompt_digest"] == ref["prompt_digest"]
        row["same_text"] = None if ref is None else row["text"] == ref["text"]


# ---------------------------------------------------------------------------------------------- aggregation

def aggregate(rows: list[dict]) -> dict:
    """Totals of a set of turns: tokens/s = all completion tokens / all seconds (long turns weigh more), acceptance =
    accepted / drafted, tokens per round = tokens / rounds (target-only: 1), mean TTFT."""
    tokens = sum(r["completion_tokens"] for r in rows)
    seconds = sum(r["total_s"] for r in rows)
    drafted = sum(r["drafted_tokens"] or 0 for r in rows)
    accepted = sum(r["accepted_tokens"] or 0 for r in rows)
    rounds = sum(r["rounds"] or 0 for r in rows)
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    prompt = sum(r["prompt_tokens"] for r in rows)
    compared = [r for r in rows if r.get("same_text") is not None]
    return {"turns": len(rows), "completion_tokens": tokens, "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 4) if seconds > 0 else None,
            "ttft_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "tokens_per_round": round(tokens / rounds, 4) if rounds else None,
            "prompt_tokens": prompt, "prefix_reused_tokens": sum(r.get("prefix_reused_tokens") or 0 for r in rows),
            "compared": len(compared), "identical": sum(1 for r in compared if r["same_text"])}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def ttft_growth(rows: list[dict]) -> dict | None:
    """TTFT of each conversation's last turn over its first turn's, averaged over the conversations (None without
    two turns with text); `last_turn` is the highest last turn."""
    ratios, last_turns = [], []
    for conversation in dict.fromkeys(r["conversation"] for r in rows):
        turns = sorted((r for r in rows if r["conversation"] == conversation), key=lambda r: r["turn"])
        if len(turns) >= 2 and turns[0]["ttft_s"] and turns[-1]["ttft_s"] is not None:
            ratios.append(turns[-1]["ttft_s"] / turns[0]["ttft_s"])
            last_turns.append(turns[-1]["turn"])
    if not ratios:
        return None
    return {"ratio": round(statistics.fmean(ratios), 4), "last_turn": max(last_turns), "conversations": len(ratios)}


def summarize(rows: list[dict], modes: list[str], reference: str = REFERENCE) -> dict:
    """Per turn, per class and overall figures of every mode, with ratios against `reference` (None when it did not
    run) over the same turns, and the issue's targets checked (measured, never asserted)."""
    has_ref = reference in modes and any(r["mode"] == reference for r in rows)
    classes = list(dict.fromkeys(r["class"] for r in rows))

    def of(mode: str, rows_: Iterable[dict]) -> list[dict]:
        return [r for r in rows_ if r["mode"] == mode]

    def with_speedup(mode: str, selection: list[dict]) -> dict:
        agg = aggregate(of(mode, selection))
        ref = aggregate(of(reference, selection)) if has_ref else None
        agg["speedup"] = ratio(agg["tokens_per_s"], ref["tokens_per_s"]) if ref else None
        agg["ttft_ratio"] = ratio(agg["ttft_s"], ref["ttft_s"]) if ref else None
        return agg

    per_turn, per_class = [], []
    for cls in classes:
        in_class = [r for r in rows if r["class"] == cls]
        for turn in sorted({r["turn"] for r in in_class}):
            at_turn = [r for r in in_class if r["turn"] == turn]
            per_turn += [{"class": cls, "turn": turn, "mode": m, **with_speedup(m, at_turn)} for m in modes
                         if of(m, at_turn)]
        for mode in modes:
            if of(mode, in_class):
                per_class.append({"class": cls, "mode": mode, "all": with_speedup(mode, in_class),
                                  "from_turn_2": with_speedup(mode, [r for r in in_class if r["turn"] >= 2]),
                                  "ttft_growth": ttft_growth(of(mode, in_class))})
    repeating = [r for r in rows if r["class"] in REPEATING_CLASSES]
    control = [r for r in rows if r["class"] in CONTROL_CLASSES]
    overall = []
    for mode in modes:
        if not of(mode, rows):
            continue
        mine = [c for c in per_class if c["mode"] == mode]
        speedups = [(c["all"]["speedup"], c["class"]) for c in mine if c["all"]["speedup"] is not None]
        growths = [(c["ttft_growth"]["ratio"], c["class"]) for c in mine
                   if c["class"] in REPEATING_CLASSES and c["ttft_growth"]]
        overall.append({"mode": mode, "all": with_speedup(mode, rows),
                        "repeating_from_turn_2": with_speedup(mode, [r for r in repeating if r["turn"] >= 2])
                        if repeating else None,
                        "repeating": with_speedup(mode, repeating) if repeating else None,
                        "control": with_speedup(mode, control) if control else None,
                        "worst_class": ({"class": min(speedups)[1], "speedup": min(speedups)[0]}
                                        if speedups else None),
                        "worst_ttft_growth": ({"class": max(growths)[1], "ratio": max(growths)[0]}
                                              if growths else None),
                        "first_difference": first_difference(of(mode, rows))})
    return {"reference": reference if has_ref else None, "modes": [m for m in modes if of(m, rows)],
            "classes": classes, "per_turn": per_turn, "per_class": per_class, "overall": overall,
            "targets": targets(overall, reference if has_ref else None)}


def first_difference(rows: list[dict]) -> dict | None:
    """The first turn (in run order) whose reply differs from the reference's on the same prompt."""
    for row in rows:
        if row.get("same_prompt") and row.get("same_text") is False:
            return {"conversation": row["conversation"], "turn": row["turn"]}
    return None


def targets(overall: list[dict], reference: str | None) -> list[dict]:
    """The issue's targets per mode: {mode, check, target, value, met} (met None where it cannot be measured)."""
    checks = []
    speedup_of = {o["mode"]: (o["repeating_from_turn_2"] or {}).get("speedup") for o in overall}
    for o in overall:
        mode = o["mode"]
        growth = o["worst_ttft_growth"]
        checks.append({"mode": mode, "check": "TTFT, last turn / turn 1 (worst repeating class)",
                       "target": f"<= {TARGET_TTFT_GROWTH}", "value": growth["ratio"] if growth else None,
                       "met": None if growth is None else growth["ratio"] <= TARGET_TTFT_GROWTH})
        if reference is None or mode == reference:
            continue
        speedup = speedup_of[mode]
        checks.append({"mode": mode, "check": "repeating classes from turn 2, vs target-only",
                       "target": f">= {TARGET_SPEEDUP}x", "value": speedup,
                       "met": None if speedup is None else speedup >= TARGET_SPEEDUP})
        worst = o["worst_class"]
        checks.append({"mode": mode, "check": "every class, vs target-only (worst class)",
                       "target": f">= {TARGET_CLASS_FLOOR}x", "value": worst["speedup"] if worst else None,
                       "met": None if worst is None else worst["speedup"] >= TARGET_CLASS_FLOOR})
        rivals = {m: speedup_of[m] for m in ("ngram", "model") if m in speedup_of and m != mode}
        if mode in ("hybrid", "suffix") and rivals and speedup is not None:
            checks.append({"mode": mode, "check": f"ahead of {' and '.join(rivals)} (repeating, from turn 2)",
                           "target": "> " + ", ".join(f"{m} {v:.2f}x" for m, v in rivals.items() if v is not None),
                           "value": speedup,
                           "met": all(v is None or speedup > v for v in rivals.values())})
        compared = o["all"]["compared"]
        checks.append({"mode": mode, "check": "greedy output identical to target-only (turns)",
                       "target": "all", "value": f"{o['all']['identical']}/{compared}",
                       "met": None if not compared else o["all"]["identical"] == compared})
    return checks


# ---------------------------------------------------------------------------------------------- markdown

def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def markdown(report: dict) -> str:
    summary = report["summary"]
    modes, reference = summary["modes"], summary["reference"]
    config = report["config"]
    vs = f"vs {reference}" if reference else "vs –"
    lines = [f"## bench-serve: {config['target_model']} (draft {config['draft_model']}), max_tokens "
             f"{config['max_tokens']}", ""]
    run = report.get("run") or {}
    machine = run.get("machine") or {}
    if run:
        lines += [f"- command: `{run.get('command')}`", f"- date: {run.get('date')}; load average at start "
                  f"{run.get('load_average')}, at end {report.get('load_average_end')}",
                  f"- machine: {machine.get('cpu_model')}, {machine.get('usable_cpus')} usable CPUs, "
                  f"{machine.get('memory_gib')} GiB; flags {', '.join(machine.get('cpu_flags') or []) or '–'}"]
    for mode, fleet in (report.get("fleet") or {}).items():
        workers = "; ".join(f"{kind} {w['model']} ({w['engine']}"
                            + ("" if w["engine"] == "model-free" else f", {w['dtype']}") + ")"
                            for kind, w in fleet.items())
        lines.append(f"- {mode}: {workers}")
    conversations = report.get("conversations") or []
    lines += [f"- workload: {len(conversations)} conversation(s) of {', '.join(summary['classes']) or '–'}, "
              f"{sum(c['turns'] for c in conversations)} turns per mode; each conversation runs through every mode "
              f"in turn, the modes' order rotating", ""]
    if report.get("error"):
        lines += [f"**The run stopped early:** {report['error']}", ""]

    lines += ["### Overall", "",
              f"tokens/s = completion tokens / seconds over the turns; ratio {vs} on the same turns. Repeating = "
              f"{', '.join(REPEATING_CLASSES)}; control = {', '.join(CONTROL_CLASSES)}.", "",
              f"| mode | repeating, turns ≥ 2: tok/s | {vs} | repeating, all turns | {vs} | control: tok/s | {vs} "
              f"| worst class | acceptance | tokens/round | TTFT last/first turn (worst repeating) | identical |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in summary["overall"]:
        rep2, rep, ctl = o["repeating_from_turn_2"] or {}, o["repeating"] or {}, o["control"] or {}
        worst = o["worst_class"]
        growth = o["worst_ttft_growth"]
        lines.append(
            f"| {o['mode']} | {fmt(rep2.get('tokens_per_s'))} | {fmt(rep2.get('speedup'), suffix='x')} | "
            f"{fmt(rep.get('tokens_per_s'))} | {fmt(rep.get('speedup'), suffix='x')} | "
            f"{fmt(ctl.get('tokens_per_s'))} | {fmt(ctl.get('speedup'), suffix='x')} | "
            f"{'–' if worst is None else '%s %.2fx' % (worst['class'], worst['speedup'])} | "
            f"{pct(o['all']['acceptance_rate'])} | {fmt(o['all']['tokens_per_round'])} | "
            f"{'–' if growth is None else '%.2f (%s)' % (growth['ratio'], growth['class'])} | "
            f"{o['all']['identical']}/{o['all']['compared']} |")

    lines += ["", "### Targets (measured, not asserted)", "", "| mode | check | target | measured | met |",
              "|---|---|---|---|---|"]
    for t in summary["targets"]:
        value = t["value"] if isinstance(t["value"], str) else fmt(t["value"])
        met = "–" if t["met"] is None else "yes" if t["met"] else "**no**"
        lines.append(f"| {t['mode']} | {t['check']} | {t['target']} | {value} | {met} |")

    lines += ["", "### Per class", "",
              f"| class | mode | tok/s | {vs} | tok/s turns ≥ 2 | {vs} | acceptance | tokens/round | TTFT turn 1 "
              f"| TTFT last turn | last/first | identical |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_turn = {(p["class"], p["turn"], p["mode"]): p for p in summary["per_turn"]}
    for c in summary["per_class"]:
        turns = sorted(t for (cls, t, m) in by_turn if cls == c["class"] and m == c["mode"])
        first, last = by_turn[(c["class"], turns[0], c["mode"])], by_turn[(c["class"], turns[-1], c["mode"])]
        growth = c["ttft_growth"]
        lines.append(
            f"| {c['class']} | {c['mode']} | {fmt(c['all']['tokens_per_s'])} | {fmt(c['all']['speedup'], suffix='x')} "
            f"| {fmt(c['from_turn_2']['tokens_per_s'])} | {fmt(c['from_turn_2']['speedup'], suffix='x')} | "
            f"{pct(c['all']['acceptance_rate'])} | {fmt(c['all']['tokens_per_round'])} | "
            f"{fmt(first['ttft_s'], suffix=' s')} | {fmt(last['ttft_s'], suffix=' s')} (turn {turns[-1]}) | "
            f"{'–' if growth is None else fmt(growth['ratio'])} | {c['all']['identical']}/{c['all']['compared']} |")

    keys = sorted({(p["class"], p["turn"]) for p in summary["per_turn"]},
                  key=lambda k: (summary["classes"].index(k[0]), k[1]))
    header = "| class | turn | prompt tokens | " + " | ".join(modes) + " |"
    rule = "|---|---|---|" + "---|" * len(modes)

    def prompt_tokens(cls: str, turn: int) -> str:
        cell = by_turn.get((cls, turn, reference or modes[0]))
        return "–" if cell is None or not cell["turns"] else f"{cell['prompt_tokens'] / cell['turns']:.0f}"

    def table(title: str, note: str, cell) -> list[str]:
        out = ["", f"### Per turn: {title}", "", note, "", header, rule]
        for cls, turn in keys:
            cells = [cell(by_turn[(cls, turn, m)]) if (cls, turn, m) in by_turn else "–" for m in modes]
            out.append(f"| {cls} | {turn} | {prompt_tokens(cls, turn)} | " + " | ".join(cells) + " |")
        return out

    lines += table("tokens/s", f"tok/s ({vs}), over the class's conversations at that turn.",
                   lambda p: f"{fmt(p['tokens_per_s'])} ({fmt(p['speedup'], suffix='x')})")
    lines += table("time to first token", "mean seconds to the first streamed text; in brackets the share of the "
                   "prompt the verifier's prefix cache reused.",
                   lambda p: f"{fmt(p['ttft_s'])} s ({pct(p['prefix_reused_tokens'] / p['prompt_tokens'])})"
                   if p["prompt_tokens"] else fmt(p["ttft_s"]))
    lines += table("acceptance, tokens per round", "accepted / drafted draft tokens, and tokens committed per "
                   "verification round (target-only: 1).",
                   lambda p: f"{pct(p['acceptance_rate'])}, {fmt(p['tokens_per_round'])}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the command

def run(args: argparse.Namespace, conversations: list[dict], modes: list[str]) -> dict:
    """Start everything, run the conversations, return the report (with "error" set if the run stopped early)."""
    from specmesh_bench.machine import load_average, run_record
    report: dict = {"run": run_record(args.prog, args.argv),
                    "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                               if k not in ("prog", "argv")},
                    "conversations": [{"id": c["id"], "class": c["class"], "turns": len(c["turns"])}
                                      for c in conversations],
                    "fleet": {}, "rows": []}
    rows: list[dict] = report["rows"]
    with tempfile.TemporaryDirectory(prefix="specmesh-bench-serve-") as log_dir:
        servers: dict[str, ModeServer] = {}
        try:
            with mode_servers(args, modes, Path(log_dir)) as servers:
                report["fleet"] = {mode: s.workers for mode, s in servers.items()}
                model = servers[modes[0]].client.models.list().data[0].id
                for mode in modes:  # first requests pay for allocators, channels and lazy setup
                    stream_turn(servers[mode].client, model, list(WARMUP_MESSAGES), 4)
                for index, conversation in enumerate(conversations):
                    for position, mode in enumerate(rotated(modes, index)):
                        rows += run_conversation(servers[mode], model, conversation, args.max_tokens, position)
                    mark_reference(rows)
        except (Exception, KeyboardInterrupt) as e:  # a run that stops still reports what it measured, and why
            interrupted = isinstance(e, KeyboardInterrupt)
            logs = "" if interrupted else "".join(f"\n--- {mode} serve log ---\n{s.serve.log_tail()}"
                                                  for mode, s in servers.items())
            report["error"] = "interrupted" if interrupted else f"{type(e).__name__}: {e}"
            progress(f"error: {report['error']}{logs}")
    mark_reference(rows)
    report["load_average_end"] = load_average()
    report["summary"] = summarize(rows, modes)
    return report


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma list of: " + "; ".join(f"{m} = {what}" for m, what in MODES.items()))
    parser.add_argument("--target-model", default=DEFAULT_TARGET_MODEL, help="the verifiers' model")
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL, help="the model drafters' model")
    parser.add_argument("--engine", default="auto", choices=ENGINES, help="engine of the verifiers and model drafters")
    parser.add_argument("--dtype", default="auto", help="dtype of the verifiers and model drafters")
    parser.add_argument("--device", default="auto", help="device of the verifiers and model drafters")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of each verifier and model drafter (default: the worker's choice)")
    parser.add_argument("--draft-policy", choices=POLICIES, default=DEFAULT_POLICY,
                        help="draft-length policy of the speculative modes' servers")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="start the verifiers and model drafters with --no-prefix-cache (every turn prefills "
                        "its whole conversation)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD, help="conversations (JSON)")
    parser.add_argument("--classes", default=None,
                        help="comma list of the workload's classes to run (default: all; the workload's: edit, "
                        "tools, document, prose)")
    parser.add_argument("--conversations-per-class", type=int, default=None,
                        help="the first N conversations of each class (default: all)")
    parser.add_argument("--max-turns", type=int, default=None,
                        help="the first N turns of each conversation (default: all)")
    parser.add_argument("--request-timeout", type=float, default=1800.0, help="seconds one request may take")
    parser.add_argument("--json", type=Path, default=None, help="write the report (JSON) here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables (markdown) here")
    return parser


def parse_modes(text: str) -> list[str]:
    """The modes of --modes, in order; ValueError naming unknown or repeated ones."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if len(set(modes)) != len(modes) or not modes:
        raise ValueError(f"--modes must name each mode once, got {text!r}")
    return modes


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        modes = parse_modes(args.modes)
        for flag in ("max_tokens", "conversations_per_class", "max_turns"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
        classes = [c.strip() for c in args.classes.split(",") if c.strip()] if args.classes else None
        conversations = select_conversations(load_workload(args.workload), classes, args.conversations_per_class,
                                              args.max_turns)
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        import openai  # noqa: F401 - a test dependency of specmesh: say so before anything starts
    except ImportError:
        print(f"{parser.prog}: error: the benchmark drives the server with the official openai client: "
              "pip install 'openai>=1.40' (or the project's [test] extra)", file=sys.stderr)
        return 2
    args.prog, args.argv = parser.prog, argv
    report = run(args, conversations, modes)
    table = markdown(report)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table, encoding="utf-8")
    return 0 if not report.get("error") else 130 if report["error"] == "interrupted" else 1


if __name__ == "__main__":
    sys.exit(main())
