"""The engine each side of a benchmark asks for and runs."""

from __future__ import annotations

import pytest

from specmesh_bench.bench import build_parser
from specmesh_bench.engines import requested_engines, resolved_engines


def test_bench_engine_flags_override_per_side():
    args = build_parser().parse_args(["--engine", "transformers", "--draft-engine", "llamacpp",
                                      "--target-model", "tiny-random-qwen2"])
    assert requested_engines(args) == {"target": "transformers", "draft": "llamacpp"}
    assert resolved_engines(args)["target"] == "transformers"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--engine", "onnx"])


def test_the_header_names_each_engines_build_and_the_llama_baselines_flags():
    from specmesh_bench.reports import header_notes

    report = {"config": {}, "info": {
        "verifier_engine": "ik", "drafter_engine": "ik", "draft": "d",
        "verifier_engine_build": "ik-llama-cpp-python 0.1.5 (avx2 build), repack on",
        "drafter_engine_build": "ik-llama-cpp-python 0.1.5 (avx2 build), repack on",
        "llamacpp": {"version": "0.3.36", "threads": 2, "flash_attn": False, "gguf": "/m/t.gguf",
                     "build": {"GGML_NATIVE": "ON", "GGML_CPU_REPACK": "ON"}},
        "ik": {"package": "ik-llama-cpp-python", "version": "0.1.5", "threads": 2, "gguf": "/m/t.gguf",
               "build": "ik-llama-cpp-python 0.1.5 (avx2 build), repack off"}}}
    text = "\n".join(header_notes(report))
    assert "- engine builds: verifier ik-llama-cpp-python 0.1.5 (avx2 build), repack on; drafter " in text
    assert "llama-cpp-python 0.3.36 (built with GGML_NATIVE=ON GGML_CPU_REPACK=ON;" in text
    assert "- ik_llama.cpp baseline: ik-llama-cpp-python 0.1.5 (avx2 build), repack off, 2 threads" in text


def test_llama_cpp_build_flags_are_read_from_the_installs_ggml_config(tmp_path):
    from types import SimpleNamespace

    from specmesh_bench.llamacpp_baseline import build_flags

    package = tmp_path / "site" / "llama_cpp"
    package.mkdir(parents=True)
    config = tmp_path / "site" / "lib" / "cmake" / "ggml"
    config.mkdir(parents=True)
    (config / "ggml-config.cmake").write_text('set(GGML_NATIVE "ON")\nset(GGML_AVX2 "OFF")\nset(OTHER "x")\n')
    assert build_flags(SimpleNamespace(__file__=str(package / "__init__.py"))) == {"GGML_NATIVE": "ON",
                                                                                  "GGML_AVX2": "OFF"}
    assert build_flags(SimpleNamespace(__file__=str(tmp_path / "none" / "llama_cpp" / "__init__.py"))) is None
