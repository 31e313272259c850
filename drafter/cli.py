"""`drafter serve ...`: a draft model (--method model, the default), prompt lookup (--method ngram) or SuffixDecoding
(--method suffix)."""

from __future__ import annotations

import argparse
import dataclasses

from drafter.config import METHODS, BatchingConfig, DrafterConfig
from specmesh.decoding.prompt_lookup import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM
from drafter.service import DrafterRole
from drafter.suffix import SuffixConfig
from specmesh.runtime import requantize
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL
from specmesh.runtime.engine import choose_engine
from specmesh.worker.cli import RoleCommand, serve_main
from specmesh.worker.config import ModelConfig

BATCHING = BatchingConfig()
SUFFIX = SuffixConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Drafter-only flags: how drafts are made."""
    group = parser.add_argument_group("drafting method (drafter only)")
    group.add_argument("--method", choices=METHODS, default="model",
                       help="model: run the draft model --model; ngram: prompt lookup (copy what followed the latest "
                       "earlier occurrence of the last n tokens); suffix: SuffixDecoding (the most frequent "
                       "continuation of the longest match, in a suffix tree over the session and one over earlier "
                       "requests' outputs, shared by all sessions). ngram and suffix load no weights: --model then "
                       "only names the tokenizer: give the target's (default: model)")
    group.add_argument("--requantize", default="auto", metavar="TYPE|auto|none",
                       help="model: run a copy of the draft model's GGUF file with its weights requantized to TYPE "
                       "(q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k), made once with ik_llama.cpp's quantizer "
                       "and cached. Drafts are verified, so a drafter may trade a little agreement for speed: the "
                       "default model in q4_0 steps about 1.6x faster on the ik engine and agrees with the target "
                       "nearly as often (docs/engines.md#a-cheaper-drafter). auto: q4_0 on the ik engine where the "
                       "file's weights average more than 4.6 bits, else the file as it is; none: the file as it is")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="ngram, suffix: logits width reported to the coordinator (default: the --model config's "
                       "vocab_size, else the tokenizer's size); must not exceed the verifier's")
    group.add_argument("--ngram-max", type=int, default=None,
                       help=f"ngram: longest n-gram matched (default: {DEFAULT_MAX_NGRAM})")
    group.add_argument("--ngram-min", type=int, default=None,
                       help=f"ngram: shortest n-gram matched (default: {DEFAULT_MIN_NGRAM})")
    suffix = parser.add_argument_group("SuffixDecoding (drafter only, --method suffix)")
    suffix.add_argument("--suffix-max-depth", type=int, default=None,
                        help="longest substring the suffix trees index, in tokens: a match and the draft after it "
                        f"fit in it (default: {SUFFIX.max_depth})")
    suffix.add_argument("--suffix-max-tokens", type=int, default=None,
                        help="tokens the global tree keeps of finished requests, the oldest requests evicted first "
                        f"(about 200 bytes each; default: {SUFFIX.max_tokens})")
    suffix.add_argument("--suffix-max-requests", type=int, default=None,
                        help=f"finished requests the global tree keeps (default: {SUFFIX.max_requests})")
    suffix.add_argument("--suffix-index-prompts", action="store_true",
                        help="the global tree also indexes finished requests' prompts, not only their outputs "
                        "(a request repeated with the same prompt is then drafted from its first token)")
    suffix.add_argument("--suffix-spec-factor", type=float, default=None,
                        help="draft at most this many tokens per matched token (the paper's alpha; "
                        f"default: {SUFFIX.spec_factor})")
    suffix.add_argument("--suffix-min-prob", type=float, default=None,
                        help="stop a draft where its estimated probability falls below this "
                        f"(default: {SUFFIX.min_prob})")
    batching = parser.add_argument_group("batching (drafter only, --method model)")
    batching.add_argument("--max-batch-size", type=int, default=BATCHING.max_batch_size,
                          help="Propose calls of different sessions draft together: each draft step is one forward "
                          "pass of up to this many sessions, a call arriving meanwhile joins at the next step, and "
                          "each session stops at its own k; 1 turns cross-session batching off "
                          f"(default: {BATCHING.max_batch_size})")
    batching.add_argument("--max-batch-wait", type=float, default=BATCHING.max_batch_wait_s,
                          help="seconds a new batch may wait for recently answered sessions to send their next call, "
                          "so that they draft together from the first step; 0 never waits "
                          f"(default: {BATCHING.max_batch_wait_s})")


def make_role(args: argparse.Namespace, model: ModelConfig) -> DrafterRole:
    if args.method == "model":  # the others load no weights
        model = dataclasses.replace(model, requantize=args.requantize)  # checks the value
        asked_a_type = model.requantize not in (requantize.AUTO, requantize.NONE)
        if asked_a_type and choose_engine(args.engine, args.model, args.device, args.dtype) == "transformers":
            raise ValueError(f"--requantize {args.requantize} applies to GGUF models on the ik or llamacpp engine; "
                             "this drafter runs transformers (give --requantize none)")
    return DrafterRole(DrafterConfig(model, method=args.method, vocab_size=args.vocab_size, ngram_min=args.ngram_min,
                                     ngram_max=args.ngram_max, suffix_max_depth=args.suffix_max_depth,
                                     suffix_max_tokens=args.suffix_max_tokens,
                                     suffix_max_requests=args.suffix_max_requests,
                                     suffix_spec_factor=args.suffix_spec_factor, suffix_min_prob=args.suffix_min_prob,
                                     suffix_index_prompts=args.suffix_index_prompts,
                                     batching=BatchingConfig(max_batch_size=args.max_batch_size,
                                                                  max_batch_wait_s=args.max_batch_wait)))


COMMAND = RoleCommand("drafter", DEFAULT_DRAFT_MODEL, add_arguments, make_role)


def main(argv: list[str] | None = None) -> int:
    return serve_main(COMMAND, argv)
