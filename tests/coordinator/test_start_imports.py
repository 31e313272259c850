"""`coordinator generate` imports no torch: not before its local workers start (its flag checks), nor while they load
(the tokenizer, the loop): on 2 cores its second of CPU came before the workers started, or beside their loading."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
from specmesh.runtime.model_spec import check_model
from specmesh.runtime.gguf_cache import gguf_source
from specmesh.runtime.tokenizer import GgufTokenizer, load_tokenizer, tokenizer_dir
check_model({spec!r}, "--target-model", "auto", "auto", "auto")
gguf_source({spec!r})
print("torch" in sys.modules)
"""


@pytest.mark.parametrize("spec", ["qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"])
def test_checking_a_catalog_model_imports_no_torch(spec):
    done = subprocess.run([sys.executable, "-c", CHECK.format(spec=spec)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_bad_device_is_refused_without_torch():
    done = subprocess.run([sys.executable, "-c", "import sys\nfrom specmesh.runtime.model_spec import check_model\n"
                           "try:\n    check_model('qwen2.5-coder-1.5b-instruct', '--target-model', 'auto', 'gpu')\n"
                           "except ValueError as e:\n    print(e)\nprint('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["--device: unknown device 'gpu': expected auto, cpu, cuda or cuda:N", "False"]


LOAD = """
import sys
from specmesh.runtime.tokenizer import load_tokenizer
tokenizer = load_tokenizer({spec!r}, progress=False)
import coordinator.api, coordinator.cli, coordinator.loop, coordinator.translation
print(type(tokenizer).__name__, "torch" in sys.modules)
"""


def test_loading_a_catalog_tokenizer_and_the_coordinator_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", LOAD.format(spec="qwen2.5-coder-1.5b-instruct")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Qwen2Tokenizer", "False"]


def test_a_saved_tokenizer_loads_as_auto_tokenizer_would(tmp_path):
    """The class tokenizer_config.json names, as AutoTokenizer picks it (same class, same ids, same chat text); a
    config naming no class this transformers has falls back to AutoTokenizer."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from specmesh.runtime.catalog import DEFAULT_TARGET_MODEL
    from specmesh.runtime.gguf_cache import gguf_source
    from specmesh.runtime.tokenizer import load_saved_tokenizer, load_tokenizer, tokenizer_dir

    load_tokenizer(DEFAULT_TARGET_MODEL, progress=False)  # the cached tokenizer exists from here on
    _, label, key = gguf_source(DEFAULT_TARGET_MODEL)
    saved = tokenizer_dir(label, key)
    direct, auto = load_saved_tokenizer(saved), AutoTokenizer.from_pretrained(saved)
    chat = [{"role": "user", "content": "Fix: ünïcödé 🎉  x\n\tdef f():\n    return 1"}]
    text = direct.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert type(direct) is type(auto)
    assert text == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert direct(text)["input_ids"] == auto(text)["input_ids"]
    copy = tmp_path / "tokenizer"
    shutil.copytree(saved, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "NoSuchTokenizerClass"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    fallback = load_saved_tokenizer(copy)  # AutoTokenizer's choice (the tokenizer.json, as it reads it)
    assert fallback(text)["input_ids"] == auto(text)["input_ids"]
