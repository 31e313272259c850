"""The measured-cost cache: a GGUF worker measures its costs once per model file, engine, threads and CPU, and a
restart reads them back (reported from its first Info); engines without a model file of their own always measure."""

from __future__ import annotations

from types import SimpleNamespace

from specmesh.worker import cost_probe
from specmesh.worker.cost_probe import cost_cache_key, read_cached_costs, write_cached_costs


def test_costs_are_cached_per_key_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    engine = SimpleNamespace(path=model, engine="ik", threads=2)
    key = cost_cache_key("verifier", engine)
    assert read_cached_costs(key) is None  # never measured
    write_cached_costs(key, [[0, 0.1], [4, 0.13]])
    assert read_cached_costs(key) == [[0, 0.1], [4, 0.13]]
    assert read_cached_costs(cost_cache_key("drafter", engine)) is None  # another role: its own
    model.write_bytes(b"GGUF, another file")  # a changed model file is another key
    assert cost_cache_key("verifier", engine) != key
    monkeypatch.setattr(cost_probe, "COST_CACHE_TTL_S", 0.0)  # too old: measured again
    assert read_cached_costs(key) is None


def test_no_cache_without_a_model_file_or_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    assert cost_cache_key("verifier", SimpleNamespace(engine="transformers")) is None
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("SPECMESH_COST_CACHE", "0")
    assert cost_cache_key("verifier", SimpleNamespace(path=model, engine="ik", threads=2)) is None
    write_cached_costs(None, [[0, 0.1]])  # nothing to keep it under
    assert read_cached_costs(None) is None and not (tmp_path / "costs").exists()


def test_a_cache_that_cannot_be_written_is_only_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a directory")
    write_cached_costs({"role": "verifier"}, [[0, 0.1]])
    assert "could not cache the measured costs" in caplog.text
