"""Whether a model spec names a model this machine can load, with the engine, device and dtype asked for: checked
before a worker binds its port or a coordinator starts one, so that a typo in a name, a GGUF path that is not there
or an engine that cannot run the model is one line naming the cause and the fix (a ValueError), instead of a worker
that fails in its log after it started (for a name that is no model: after a minute of retrying the Hugging Face
Hub).

A spec is, in the order load_model and the engines try them: a catalog name (`coordinator models list`; fetched when
loaded), a tiny-random-* preset, a .gguf file, a local Hugging Face model directory, or a Hugging Face Hub id. A Hub
id is accepted when it is in the local Hugging Face cache or the Hub says it exists; when the Hub cannot be reached
it is refused (its loading could only fail), and when the Hub answers something else the load decides.
"""

from __future__ import annotations

import os
from pathlib import Path

from specmesh.runtime import catalog

HUB_TIMEOUT_S = 10.0
# Files one of which a local model (or tokenizer-only) directory holds.
MODEL_DIR_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")
NO_MODEL_FIX = ("check the spelling; `coordinator models list` shows the catalog, or give a .gguf file, a model "
                "directory or a Hugging Face Hub id")


def check_model(spec: str, flag: str = "--model", engine: str = "auto", device: str = "auto",
                dtype: str = "auto") -> None:
    """ValueError (one line: the cause, then the fix) unless `spec` can be loaded with `engine` on `device` in
    `dtype`; `flag` is the flag that gave the spec (--model, --target-model, --draft-model)."""
    check_engine(spec, flag, engine, device, dtype)
    check_source(spec, flag)


def check_engine(spec: str, flag: str, engine: str, device: str, dtype: str) -> None:
    from specmesh.runtime.device_names import check_device_name
    from specmesh.runtime.engine import ENGINES, ik_available, is_gguf_spec, llamacpp_available

    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r} is no engine: pass one of {', '.join(ENGINES)}")
    try:
        check_device_name(device)
    except ValueError as e:
        raise ValueError(f"--device: {e}") from None
    if dtype != "auto":
        from specmesh.runtime.devices import resolve_dtype  # torch: only for a float dtype, which needs it anyway

        try:
            resolve_dtype(dtype, "cpu")
        except ValueError as e:
            raise ValueError(f"--dtype: {e}") from None
    if engine not in ("llamacpp", "ik"):
        return
    if not is_gguf_spec(spec):
        raise ValueError(f"--engine {engine} runs GGUF files, and {flag} {spec!r} is neither a catalog name nor a "
                         ".gguf file: pass --engine transformers (or auto), or a GGUF model")
    if dtype != "auto":
        raise ValueError(f"--dtype {dtype} asks for float weights, and --engine {engine} runs the GGUF's own quantized "
                         "weights: drop --dtype, or pass --engine transformers")
    if engine == "llamacpp" and not llamacpp_available():
        raise ValueError("--engine llamacpp needs llama-cpp-python, which is not installed: pip install "
                         "llama-cpp-python, or pass --engine auto")
    if engine == "ik" and not ik_available():
        raise ValueError("--engine ik needs ik_llama.cpp, whose library does not load here (ik-llama-cpp-python has "
                         "x86-64 Linux wheels only): pass --engine llamacpp or auto")


def check_source(spec: str, flag: str) -> None:
    from specmesh.runtime.tiny_presets import TINY_PRESETS

    if spec in catalog.CATALOG or spec in TINY_PRESETS:
        return
    path = Path(spec).expanduser()
    if spec.startswith("tiny-random-") and not path.exists():
        raise ValueError(f"{flag} {spec!r} is no tiny preset: pass one of {', '.join(TINY_PRESETS)}")
    if path.suffix.lower() == ".gguf":
        if path.is_file():
            return
        why = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"{flag} {spec!r}: no GGUF file there (the path {why}): check the path, or pass a catalog "
                         "model (`coordinator models list`)")
    if path.is_dir():
        if any((path / name).is_file() for name in MODEL_DIR_FILES):
            return
        raise ValueError(f"{flag} {spec!r} is a directory without a model in it (no {' or '.join(MODEL_DIR_FILES)}): "
                         "pass the model's own directory, or a .gguf file")
    if path.exists():
        raise ValueError(f"{flag} {spec!r} is a file, not a .gguf file nor a model directory: pass a .gguf file or "
                         "the directory of a Hugging Face model")
    if spec.startswith(("/", "./", "../", "~")):  # a path, not a Hub id
        raise ValueError(f"{flag} {spec!r}: no such file or directory: check the path, or pass a catalog model "
                         "(`coordinator models list`)")
    check_hub_id(spec, flag)


def check_hub_id(spec: str, flag: str) -> None:
    """A spec that is no catalog name, preset or path: a Hugging Face Hub id, cached here or on the Hub."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.utils import GatedRepoError, HFValidationError, RepositoryNotFoundError, validate_repo_id

    not_a_model = f"{flag} {spec!r} names no model: no catalog name, tiny preset, file or directory"
    try:
        validate_repo_id(spec)
    except HFValidationError:
        raise ValueError(f"{not_a_model}, nor a valid Hugging Face Hub id: {NO_MODEL_FIX}") from None
    if any(isinstance(try_to_load_from_cache(spec, name), str) for name in MODEL_DIR_FILES):
        return  # downloaded before: loads offline
    if constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"{not_a_model}, nor in the Hugging Face cache, and the Hub is switched off (HF_HUB_OFFLINE): "
                         f"{NO_MODEL_FIX}, or unset HF_HUB_OFFLINE to download it")
    try:
        HfApi().model_info(spec, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return  # it exists; access is the download's question (a token, an accepted licence)
    except RepositoryNotFoundError:
        raise ValueError(f"{not_a_model}, nor a model on the Hugging Face Hub: {NO_MODEL_FIX}") from None
    except Exception as e:
        if unreachable(e):
            raise ValueError(f"{flag} {spec!r} is no catalog name, tiny preset, file or directory here, nor in the "
                             "Hugging Face cache, and the Hugging Face Hub cannot be reached to fetch it "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:200]}): connect to the network, or pass "
                             "a model that is here (`coordinator models list` shows the catalog)") from None
        # Any other answer (a mirror without the model API, a server error): loading the model will tell.


def unreachable(error: BaseException) -> bool:
    """A failure to reach the Hub at all (no route, no name resolution, a timeout), whichever HTTP client raised it."""
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"TransportError", "ConnectionError", "ConnectError", "Timeout", "TimeoutException",
                         "OfflineModeIsEnabled"}) or isinstance(error, (ConnectionError, TimeoutError))


def check_requantize(choice: str, flag: str) -> None:
    """A requantize setting (a GGUF type, auto or none) before any worker starts: ValueError naming the flag."""
    from specmesh.runtime.requantize import check_choice

    try:
        check_choice(choice)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
