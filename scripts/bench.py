"""`python scripts/bench.py ...` is `coordinator bench ...`: the side-by-side benchmark (specmesh_bench/)."""

from __future__ import annotations

import sys

from specmesh_bench.bench import main

if __name__ == "__main__":
    sys.exit(main())
