"""`python scripts/bench_concurrency.py ...` is `coordinator bench-concurrency ...` (specmesh_bench/)."""

from __future__ import annotations

import sys

from specmesh_bench.concurrency import main

if __name__ == "__main__":
    sys.exit(main())
