"""The measured-cost cache: a GGUF worker measures its costs once per model file, engine, threads and CPU, and a
restart reads them back (ready sooner); engines without a model file of their own always measure."""

from __future__ import annotations

from types import SimpleNamespace

from specmesh.worker import cost_probe
from specmesh.worker.cost_probe import cached_costs, cost_cache_key


def test_costs_are_measured_once_per_key_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    engine = SimpleNamespace(path=model, engine="ik", threads=2)
    calls = []

    def measure():
        calls.append(1)
        return [[0, 0.1], [4, 0.13]]

    key = cost_cache_key("verifier", engine)
    assert cached_costs(key, measure) == [[0, 0.1], [4, 0.13]]
    assert cached_costs(key, measure) == [[0, 0.1], [4, 0.13]] and len(calls) == 1  # read back, not measured
    assert cached_costs(cost_cache_key("drafter", engine), measure) and len(calls) == 2  # another role: its own
    model.write_bytes(b"GGUF, another file")  # a changed model file is another key
    assert cost_cache_key("verifier", engine) != key
    monkeypatch.setattr(cost_probe, "COST_CACHE_TTL_S", 0.0)  # too old: measured again
    cached_costs(key, measure)
    assert len(calls) == 3


def test_no_cache_without_a_model_file_or_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    assert cost_cache_key("verifier", SimpleNamespace(engine="transformers")) is None
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("SPECMESH_COST_CACHE", "0")
    assert cost_cache_key("verifier", SimpleNamespace(path=model, engine="ik", threads=2)) is None
    calls = []
    cached_costs(None, lambda: calls.append(1))
    cached_costs(None, lambda: calls.append(1))
    assert len(calls) == 2
