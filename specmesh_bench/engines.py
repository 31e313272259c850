"""The engine each side of a benchmark asks for, and what "auto" resolves to."""

from __future__ import annotations

import argparse

from specmesh.runtime.engine import choose_engine


def requested_engines(args: argparse.Namespace) -> dict[str, str]:
    """The --engine asked for on each side (--target-engine / --draft-engine override --engine)."""
    return {"target": args.target_engine or args.engine, "draft": args.draft_engine or args.engine}


def resolved_engines(args: argparse.Namespace) -> dict[str, str]:
    """What "auto" resolves to for each side's model (specmesh.runtime.engine.choose_engine, as the workers do)."""
    asked = requested_engines(args)
    return {"target": choose_engine(asked["target"], args.target_model, args.device, args.dtype),
            "draft": choose_engine(asked["draft"], args.draft_model, args.device, args.dtype)}
