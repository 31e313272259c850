import pytest

from specmesh.runtime.models import load_model


@pytest.fixture(scope="session")
def tiny_target():
    return load_model("tiny-random-qwen2", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def tiny_unrelated_draft():
    return load_model("tiny-random-qwen2-b", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def tiny_other_tokenizer():
    return load_model("tiny-random-llama", device="cpu", dtype="float64")
