"""Where one target-only round's time goes, layer by layer, on the real target model.

Each layer adds one thing to the one below, measured in the same process run on the same prompt (median over
--steps one-token steps after a warm-up):

    engine      the model engine's forward for one new token (specmesh/runtime), logits copied out
    ik loop     (ik engine) ik_llama.cpp's own one-token loop on the C API, as the bench's ik-target runs it, and the
                prompt's prefill each way: the engine's passes of at most 31 tokens against the loop's one pass
    verifier    + VerifyEngine: session sync, history hashing, batching queue, model-thread hand-off, accept/reject
    grpc        + protobuf and gRPC to a verifier subprocess on loopback (the server's threads, the client's stub)
    grpc stream the same steps as one Decode stream (target-only decoding's wire form): the time between tokens
    coordinator + the coordinator's loop: retries, breakers, fleet, incremental detokenisation (a full generation,
                target-only: streamed)
    hf          HF transformers' own generate() per token on the same model and kernels (transformers engine only)

and, with --drafts K, a verify of K drafts in VerifyEngine against one forward over the same K + 1 tokens on a KV
cache, the way HF's assisted generation verifies (transformers engine only).

    python scripts/profile_round.py --engine ik
    python scripts/profile_round.py --engine llamacpp
    python scripts/profile_round.py --engine transformers --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from coordinator import Coordinator, GenerationOptions
from coordinator.fleet.local_workers import LocalWorker, LocalWorkerSpec
from specmesh.runtime.catalog import DEFAULT_TARGET_MODEL
from specmesh.wire.history import EMPTY_HASH, TokenHistory
from specmesh.runtime.engine import load_engine
from specmesh.decoding.sampling import SamplingParams
from specmesh.v1 import specmesh_pb2 as pb
from verifier.engine import VerifyEngine

PROMPT = "Write a Python function that checks whether a number is prime."


def median_ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 1)


def timed_steps(step, steps: int) -> list[float]:
    step()  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def profile_in_process(args, prompt: list[int]) -> dict:
    engine = load_engine(args.model, engine=args.engine, device="cpu", dtype=args.dtype, threads=args.threads,
                         progress=False)
    sequence, tokens = engine.new_sequence(), list(prompt)
    sequence.logits_for(tokens, 1)

    def engine_step() -> None:
        tokens.append(int(sequence.logits_for(tokens, 1)[0].argmax()))

    results = {"engine": median_ms(timed_steps(engine_step, args.steps))}
    if getattr(engine, "engine", "") == "ik":
        results.update(ik_loop_ms(engine, prompt, args.steps))
    verifier, history = VerifyEngine(engine), TokenHistory()

    def verifier_step() -> None:
        base = len(history)
        new = [] if base else list(prompt)
        outcome = verifier.verify("profile", base, history.hash_at(base) if base else EMPTY_HASH, new, [], [],
                                  SamplingParams(), 0)
        history.extend([*new, outcome.verdict.next_token])

    verifier_step()  # the prefill
    results["verifier"] = median_ms(timed_steps(verifier_step, args.steps))
    if args.drafts:
        def verify_drafts() -> None:
            base = len(history)  # the drafts are rejected (they are arbitrary): each call verifies K of them anew
            outcome = verifier.verify("profile", base, history.hash_at(base), [], [1] * args.drafts, [],
                                      SamplingParams(), 0)
            history.extend([1] * outcome.verdict.accepted + [outcome.verdict.next_token])

        results[f"verify {args.drafts} drafts"] = median_ms(timed_steps(verify_drafts, max(3, args.steps // 4)))
    if getattr(engine, "engine", "") == "transformers":
        results["hf"] = hf_per_token_ms(engine.model, prompt, args.steps)
        if args.drafts:
            results[f"hf forward {args.drafts + 1} tokens"] = hf_forward_ms(engine.model, prompt, args.drafts + 1,
                                                                           max(3, args.steps // 4))
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    return results


def ik_loop_ms(engine, prompt: list[int], steps: int) -> dict:
    """ik_llama.cpp's own loop (the bench's ik-target: the C API on a context of its own, the prompt in one pass)
    beside the engine's: a step each, and the prefill of the prompt each way (the engine's passes of at most 31
    tokens, bit-identical to one-token decoding, against the loop's one pass)."""
    from specmesh_bench.ik_baseline import IkGreedyLoop

    loop = IkGreedyLoop(engine.path, len(prompt) + steps + 64, engine.threads)
    try:
        loop.generate(prompt, 4, set())  # warm-up
        prefills, engine_prefills, step_ms = [], [], []
        for _ in range(3):
            new, elapsed, first = loop.generate(prompt, steps + 1, set())
            prefills.append(first)
            step_ms.append((elapsed - first) / steps)
            sequence = engine.new_sequence()
            started = time.perf_counter()
            sequence.logits_for(list(prompt), 1)
            engine_prefills.append(time.perf_counter() - started)
            sequence.rollback(0)
        return {"ik loop (C API)": median_ms(step_ms), f"prefill {len(prompt)} tok: engine": median_ms(engine_prefills),
                f"prefill {len(prompt)} tok: ik loop": median_ms(prefills)}
    finally:
        loop.close()


def hf_per_token_ms(model, prompt: list[int], steps: int) -> float:
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=steps + 1, do_sample=False, min_new_tokens=steps + 1)
        total = time.perf_counter() - started
    return round(1000 * (total - prefill) / steps, 1)


def hf_forward_ms(model, prompt: list[int], tokens: int, repeats: int) -> float:
    """One forward over `tokens` new tokens after the prompt, on a DynamicCache (HF's assisted-generation verify)."""
    import torch
    from transformers import DynamicCache

    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
            started = time.perf_counter()
            model(input_ids=torch.tensor([[1] * tokens]), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - started)
    return median_ms(times[1:])


def profile_served(args, prompt: list[int]) -> dict:
    with tempfile.TemporaryDirectory(prefix="specmesh-profile-") as log_dir:
        worker = LocalWorker(LocalWorkerSpec("verifier", args.model, "cpu", args.dtype, threads=args.threads,
                                             engine=args.engine), log_dir)
        try:
            worker.wait_serving(1800)
            from coordinator.fleet.worker_client import RemoteWorker
            remote, history = RemoteWorker(worker.address, "verifier"), TokenHistory()

            def grpc_step() -> None:
                base = len(history)
                new = [] if base else list(prompt)
                reply = remote.stub.Verify(pb.VerifyRequest(session_id="profile", context=pb.ContextSync(
                    base_length=base, base_hash=history.hash_at(base) if base else EMPTY_HASH, new_tokens=new)),
                    timeout=60)
                history.extend([*new, reply.next_token])

            grpc_step()
            results = {"grpc": median_ms(timed_steps(grpc_step, args.steps))}
            # The same steps as one Decode stream (what target-only decoding sends): the time between tokens.
            arrivals = []
            for _ in remote.stub.Decode(pb.DecodeRequest(session_id="profile-stream", context=pb.ContextSync(
                    base_length=0, base_hash=EMPTY_HASH, new_tokens=list(prompt)), max_tokens=args.steps + 2),
                    timeout=600):
                arrivals.append(time.perf_counter())
            results["grpc stream"] = median_ms([b - a for a, b in zip(arrivals[1:], arrivals[2:])])
            remote.close()
            with Coordinator(worker.address) as coordinator:
                options = GenerationOptions(max_new_tokens=args.steps + 1, draft_tokens=0, chat=False)
                coordinator.generate(list(prompt), options)  # warm-up
                result = coordinator.generate(list(prompt), options)
                rounds = result.rounds[1:]  # round 0 holds the prefill
                results["coordinator"] = median_ms([r.verify_s + r.draft_s for r in rounds])
            return results
        finally:
            worker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_TARGET_MODEL)
    parser.add_argument("--engine", default="auto", choices=("auto", "transformers", "llamacpp", "ik"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=24, help="one-token steps timed per layer (default: 24)")
    parser.add_argument("--drafts", type=int, default=0, help="also time a verify of this many drafts (default: 0)")
    args = parser.parse_args(argv)
    from specmesh.runtime import model_thread
    from specmesh.runtime.tokenizer import load_tokenizer

    model_thread.use_main_thread()  # as in a worker process: every forward on the main thread (all calls are here)

    prompt = load_tokenizer(args.model, progress=False)(PROMPT)["input_ids"]
    results = {**profile_in_process(args, prompt), **profile_served(args, prompt)}
    print(f"{args.model}, engine {args.engine}, dtype {args.dtype}, median ms per one-token step:")
    for layer, ms in results.items():
        print(f"  {layer:22s} {ms:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
