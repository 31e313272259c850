"""`python scripts/bench_concurrency.py ...` is `coordinator bench-concurrency ...` (coordinator/benchmarks/)."""

from __future__ import annotations

import sys

from coordinator.benchmarks.concurrency import main

if __name__ == "__main__":
    sys.exit(main())
