"""`verifier serve ...`"""

from __future__ import annotations

import argparse

from specmesh.runtime.catalog import DEFAULT_TARGET_MODEL
from specmesh.worker.cli import RoleCommand, serve_main
from specmesh.worker.config import ModelConfig
from verifier.config import BatchingConfig, VerifierConfig
from verifier.service import VerifierRole

DEFAULTS = BatchingConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Verifier-only flags: cross-session batching."""
    group = parser.add_argument_group("batching (verifier only)")
    group.add_argument("--max-batch-size", type=int, default=DEFAULTS.max_batch_size,
                       help="Verify calls of different sessions that arrive while the model is busy run together in "
                       "one forward pass of up to this many sessions; 1 turns cross-session batching off "
                       f"(default: {DEFAULTS.max_batch_size})")
    group.add_argument("--max-batch-wait", type=float, default=DEFAULTS.max_batch_wait_s,
                       help="seconds a forward pass may wait for recently answered sessions to send their next call, "
                       "so that they join it instead of alternating with it; 0 never waits "
                       f"(default: {DEFAULTS.max_batch_wait_s})")


def make_role(args: argparse.Namespace, model: ModelConfig) -> VerifierRole:
    return VerifierRole(VerifierConfig(model, BatchingConfig(max_batch_size=args.max_batch_size,
                                                             max_batch_wait_s=args.max_batch_wait)))


COMMAND = RoleCommand("verifier", DEFAULT_TARGET_MODEL, add_arguments, make_role)


def main(argv: list[str] | None = None) -> int:
    return serve_main(COMMAND, argv)
