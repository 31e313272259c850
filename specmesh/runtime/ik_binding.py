"""The C calls of ik_llama.cpp that the ik engine needs, bound from the library that `ik-llama-cpp-python` ships.

The package's own Python layer is thin (ctypes over its vendored `libllama`) and binds the older llama.cpp API only
partly: no KV-cache calls, no model facts, no log control. Everything here is bound from the same library with
explicit argument types, so a wrong type fails loudly instead of corrupting memory. The struct layouts
(`llama_model_params`, `llama_context_params`, `llama_batch`) are the package's, pinned with its version
(`ik-llama-cpp-python==0.1.5`); tests/specmesh/runtime/test_ik_engine.py checks that their defaults read back as
llama.h documents them, which a shifted field would break.

The library is the row-invariant build where `make setup` made one (ik_build.py: the same source with one-row passes
taking the multi-row arithmetic), else the wheel's own. `row_invariant` says which: the ik engine's exact steps are
one row on the first, two on the second.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import threading
from types import SimpleNamespace

log = logging.getLogger(__name__)

_bound: SimpleNamespace | None = None
_bind_lock = threading.Lock()
# ggml's log callback: (level, text, user data). Kept referenced for the process's life: the library calls it.
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_native_log = logging.getLogger("ik_llama.cpp")


@_LOG_CALLBACK
def _forward_native_log(level: int, text: bytes | None, _user: int) -> None:
    # The library prints its model card and memory plan (hundreds of lines per context) at info level: debug here.
    if text and _native_log.isEnabledFor(logging.DEBUG):
        _native_log.debug(text.decode(errors="replace").rstrip())


def available() -> bool:
    """Whether the ik_llama.cpp library loads here (the wheel is x86-64 Linux, built for AVX2)."""
    try:
        bind()
    except (ImportError, OSError) as e:
        log.debug("ik_llama.cpp unavailable: %s", e)
        return False
    return True


def bind() -> SimpleNamespace:
    """The package's bindings plus the extra calls, with native logging routed to Python's (debug level)."""
    global _bound
    with _bind_lock:
        if _bound is not None:
            return _bound
        row_invariant = _select_library()
        from ik_llama_cpp import _ctypes_api as api

        lib = api._lib
        p, i32, u64, b = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_bool

        def fn(name, argtypes, restype):
            f = getattr(lib, name)
            f.argtypes, f.restype = argtypes, restype
            return f

        _bound = SimpleNamespace(
            api=api,
            kv_cache_seq_rm=fn("llama_kv_cache_seq_rm", [p, i32, i32, i32], b),
            kv_cache_clear=fn("llama_kv_cache_clear", [p], None),
            n_ctx_train=fn("llama_n_ctx_train", [p], i32),
            n_layer=fn("llama_n_layer", [p], i32),
            model_size=fn("llama_model_size", [p], u64),
            meta_val_str=fn("llama_model_meta_val_str", [p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t], i32),
            vocab_eos=fn("llama_vocab_eos", [p], i32),
            token_eot=fn("llama_token_eot", [p], i32),
            supports_gpu_offload=fn("llama_supports_gpu_offload", [], b),
            print_system_info=fn("llama_print_system_info", [], ctypes.c_char_p),
            log_set=fn("llama_log_set", [_LOG_CALLBACK, p], None),
            row_invariant=row_invariant,
        )
        _bound.log_set(_forward_native_log, None)
        api.llama_backend_init()
        return _bound


def _select_library() -> bool:
    """Point the package at the row-invariant build, or away from it where the wheel is asked for, if it has not
    loaded its library yet (it loads it on import, from IK_LLAMA_CPP_LIB_PATH where set: a worker inherits its
    parent's choice unless told otherwise); whether the library it loads is that build."""
    from specmesh.runtime import ik_build

    built = ik_build.installed_library()
    if built is None:
        return False
    chosen = os.environ.get("IK_LLAMA_CPP_LIB_PATH")
    is_built = chosen is not None and os.path.realpath(chosen) == os.path.realpath(built)
    if "ik_llama_cpp._ctypes_api" not in sys.modules:
        if ik_build.wheel_requested() and is_built:
            del os.environ["IK_LLAMA_CPP_LIB_PATH"]
            is_built = False
        elif not ik_build.wheel_requested() and chosen is None:
            os.environ["IK_LLAMA_CPP_LIB_PATH"] = str(built)
            is_built = True
    return is_built


def meta(lib: SimpleNamespace, model: int, key: str) -> str | None:
    """A GGUF metadata value of the loaded model as text, None when the file has no such key."""
    buffer = ctypes.create_string_buffer(256)
    if lib.meta_val_str(model, key.encode(), buffer, ctypes.sizeof(buffer)) < 0:
        return None
    return buffer.value.decode(errors="replace")


def kv_bytes_per_token(lib: SimpleNamespace, model: int) -> int:
    """K and V in f16 for every layer, key/value heads only (GQA), from the GGUF's attention metadata."""
    arch = meta(lib, model, "general.architecture") or "llama"
    n_embd = int(meta(lib, model, f"{arch}.embedding_length") or 0)
    n_head = int(meta(lib, model, f"{arch}.attention.head_count") or 1)
    n_head_kv = int(meta(lib, model, f"{arch}.attention.head_count_kv") or n_head)
    head_dim = int(meta(lib, model, f"{arch}.attention.key_length") or n_embd // max(1, n_head))
    return lib.n_layer(model) * 2 * n_head_kv * head_dim * 2


def system_info() -> str | None:
    """The CPU features the library was built with (AVX2, ...), for benchmark reports."""
    try:
        return bind().print_system_info().decode(errors="replace").strip()
    except (ImportError, OSError):
        return None


def build_features(info: str | None) -> list[str]:
    """The x86 vector extensions a build was compiled with, from llama_print_system_info ("AVX2 = 1 | ...")."""
    return [name.lower() for name, on in re.findall(r"(AVX[A-Z0-9_]*|AMX[A-Z0-9_]*|FMA|F16C) = (\d+)", info or "")
            if on != "0"]


def build_description(repack: bool) -> str:
    """What runs, for Info, logs and reports: the package and its version, the widest vector extension its build
    uses (the PyPI wheel: avx2, whatever the CPU has), whether it is the row-invariant build made here (ik_build.py)
    and whether the weights are repacked at load."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = f"ik-llama-cpp-python {version('ik-llama-cpp-python')}"
    except PackageNotFoundError:
        package = "ik_llama.cpp"
    features = build_features(system_info())
    widest = next((f for f in ("avx512", "avx2", "avx") if f in features), None)
    origin = "row-invariant build" if bind().row_invariant else "wheel"
    return f"{package} ({widest or 'no avx'} {origin}), repack {'on' if repack else 'off'}"
