"""A requantized GGUF copy (specmesh/runtime/requantize.py) on a real model (smollm2-135m-instruct, Q4_1 as
shipped): the choices are checked, "auto" narrows only files with wider weights, the copy is made once, shared by
workers starting together, remade when its source changes, and loads with the source's tokenizer; the drafter's flag
rejects what cannot apply."""

from __future__ import annotations

import os
import threading

import pytest

from specmesh.runtime import requantize
from specmesh.runtime.engine import ik_available
from specmesh.runtime.gguf_files import gguf_file
from specmesh.worker.config import ModelConfig

SMOL = "smollm2-135m-instruct"


def test_settings_are_checked_on_construction():
    assert ModelConfig("m", requantize="Q4_0").requantize == "q4_0"
    assert ModelConfig("m", requantize="auto").requantize == "auto"
    with pytest.raises(ValueError, match="unknown type 'q3'.*q4_0.*auto.*none"):
        ModelConfig("m", requantize="q3")
    with pytest.raises(ValueError, match="unknown type 'iq4_ks'"):  # ik-only: llama.cpp could not load the copy
        requantize.check_type("iq4_ks")


@pytest.fixture(scope="module")
def smol_file():
    return gguf_file(SMOL, progress=False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.network
def test_auto_narrows_wider_weights_only(smol_file, cache, tmp_path, monkeypatch):
    assert requantize.weight_bits(smol_file) > requantize.WIDER_THAN_AUTO_BITS  # Q4_1: 5 bits a weight
    assert requantize.auto_type(smol_file) == "q4_0"
    copy = requantize.requantized(smol_file, "q4_0")
    assert requantize.weight_bits(copy) == pytest.approx(4.5, abs=0.05)  # every matrix, the output layer included
    assert requantize.auto_type(copy) is None  # already 4-bit: run as it is
    # The decision is read once per source file (the gguf package takes seconds to parse a model's metadata).
    with monkeypatch.context() as patched:
        patched.setattr(requantize, "weight_bits", lambda path: pytest.fail("read again"))
        assert requantize.auto_type(smol_file) == "q4_0" and requantize.auto_type(copy) is None
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    assert requantize.auto_type(junk) is None


@pytest.mark.network
def test_the_copy_is_made_once_shared_and_remade_when_the_source_changes(smol_file, cache, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(smol_file.read_bytes())
    copies: list = []
    workers = [threading.Thread(target=lambda: copies.append(requantize.requantized(source, "q4_0")))
               for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(set(copies)) == 1 and copies[0].exists()
    made = copies[0].stat().st_mtime_ns
    assert requantize.requantized(source, "q4_0") == copies[0] and copies[0].stat().st_mtime_ns == made  # reused
    assert sorted(p.name for p in copies[0].parent.iterdir() if p.suffix != ".lock") == [copies[0].name]  # no debris
    os.utime(source, ns=(made + 10**9, made + 10**9))  # a replaced source file: a new copy
    assert requantize.requantized(source, "q4_0") != copies[0]


def test_a_failing_quantizer_is_a_clear_error(cache, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(RuntimeError, match="requantizing .*bad.gguf to Q4_0 failed"):
        requantize.requantized(bad, "q4_0")
    assert not any(p.name.startswith("bad-") for p in (cache / "requantized").iterdir())  # no partial file left


@pytest.mark.network
@pytest.mark.skipif(not ik_available(), reason="ik_llama.cpp does not load here")
def test_an_engine_runs_the_copy_with_the_sources_tokenizer(cache):
    from specmesh.runtime.ik_engine import IkLlamaEngine

    shipped = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=2, progress=False)
    narrowed = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=2, progress=False, requantize="auto")
    try:
        assert (shipped.dtype, narrowed.dtype) == ("Q4_1", "Q4_0")
        assert narrowed.fingerprint == shipped.fingerprint and narrowed.vocab_size == shipped.vocab_size
        assert narrowed.build.endswith("weights requantized to Q4_0") and "requantized" not in shipped.build
        assert narrowed.weights_bytes < shipped.weights_bytes
        prompt = shipped.tokenizer("def add(a, b):\n    return")["input_ids"]
        last = [engine.new_sequence().logits_for(prompt, 1)[-1] for engine in (shipped, narrowed)]
        assert int(last[0].argmax()) == int(last[1].argmax())  # nearly the same model
    finally:
        shipped.close()
        narrowed.close()


def test_the_drafter_refuses_a_type_where_it_cannot_apply(capsys):
    from drafter.cli import main

    assert main(["serve", "--model", "tiny-random-llama", "--port", "0", "--requantize", "q4_0"]) == 2
    assert "--requantize q4_0 applies to GGUF models" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny-random-llama", "--port", "0", "--requantize", "q9"]) == 2
    assert "unknown type 'q9'" in capsys.readouterr().err


def test_the_coordinator_checks_its_drafters_setting_before_starting_workers(capsys):
    from coordinator.cli import main

    assert main(["generate", "--prompt", "hi", "--draft-requantize", "q9"]) == 2
    assert "--draft-requantize: requantize: unknown type 'q9'" in capsys.readouterr().err
