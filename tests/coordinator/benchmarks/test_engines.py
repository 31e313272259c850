"""The engine each side of a benchmark asks for and runs."""

from __future__ import annotations

import pytest

from coordinator.benchmarks.bench import build_parser
from coordinator.benchmarks.engines import requested_engines, resolved_engines


def test_bench_engine_flags_override_per_side():
    args = build_parser().parse_args(["--engine", "transformers", "--draft-engine", "llamacpp",
                                      "--target-model", "tiny-random-qwen2"])
    assert requested_engines(args) == {"target": "transformers", "draft": "llamacpp"}
    assert resolved_engines(args)["target"] == "transformers"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--engine", "onnx"])
