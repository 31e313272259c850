"""`python scripts/bench.py ...` is `coordinator bench ...`: the side-by-side benchmark (coordinator/benchmarks/)."""

from __future__ import annotations

import sys

from coordinator.benchmarks.bench import main

if __name__ == "__main__":
    sys.exit(main())
