"""`verifier serve ...`"""

from specmesh.runtime.catalog import DEFAULT_TARGET_MODEL
from specmesh.worker.cli import serve_main
from verifier.service import build_server


def main(argv: list[str] | None = None) -> int:
    return serve_main("verifier", build_server, DEFAULT_TARGET_MODEL, argv)
