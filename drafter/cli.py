"""`drafter serve ...`: a draft model (--method model, the default) or prompt lookup (--method ngram)."""

from __future__ import annotations

import argparse

from drafter.config import METHODS, BatchingConfig, DrafterConfig
from drafter.ngram import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM
from drafter.service import DrafterRole
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL
from specmesh.worker.cli import RoleCommand, serve_main
from specmesh.worker.config import ModelConfig

BATCHING = BatchingConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Drafter-only flags: how drafts are made."""
    group = parser.add_argument_group("drafting method (drafter only)")
    group.add_argument("--method", choices=METHODS, default="model",
                       help="model: run the draft model --model; ngram: prompt lookup (copy what followed the latest "
                       "earlier occurrence of the last n tokens), no weights loaded, --model then only names the "
                       "tokenizer: give the target's (default: model)")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="ngram: logits width reported to the coordinator (default: the --model config's "
                       "vocab_size, else the tokenizer's size); must not exceed the verifier's")
    group.add_argument("--ngram-max", type=int, default=None,
                       help=f"ngram: longest n-gram matched (default: {DEFAULT_MAX_NGRAM})")
    group.add_argument("--ngram-min", type=int, default=None,
                       help=f"ngram: shortest n-gram matched (default: {DEFAULT_MIN_NGRAM})")
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
    return DrafterRole(DrafterConfig(model, method=args.method, vocab_size=args.vocab_size, ngram_min=args.ngram_min,
                                     ngram_max=args.ngram_max,
                                     batching=BatchingConfig(max_batch_size=args.max_batch_size,
                                                                  max_batch_wait_s=args.max_batch_wait)))


COMMAND = RoleCommand("drafter", DEFAULT_DRAFT_MODEL, add_arguments, make_role)


def main(argv: list[str] | None = None) -> int:
    return serve_main(COMMAND, argv)
