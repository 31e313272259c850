"""What `coordinator generate` does before its local workers start, and the tokenizer it loads while they do, import
no torch: on 2 cores its second of CPU came before the workers started, or beside their loading."""

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
