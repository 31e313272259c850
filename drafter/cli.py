"""`drafter serve ...`: a draft model (--method model, the default) or prompt lookup (--method ngram)."""

from drafter.service import build_server
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL
from specmesh.worker.cli import serve_main


def main(argv: list[str] | None = None) -> int:
    return serve_main("drafter", build_server, DEFAULT_DRAFT_MODEL, argv)
