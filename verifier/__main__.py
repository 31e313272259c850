"""`python -m verifier` and the `verifier` command: the worker restarts itself on huge pages first, before the imports
that allocate (specmesh/runtime/huge_pages.py)."""

import sys


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # this process's own command line; main(argv) in-process (tests) never restarts the caller
        from specmesh.runtime.huge_pages import reexec_with_huge_pages

        reexec_with_huge_pages("verifier")
    from verifier.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
