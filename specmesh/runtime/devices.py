"""Device / dtype resolution and CPU tuning shared by every model loader."""

from __future__ import annotations

import functools

import torch

from specmesh.runtime.device_names import check_device_name

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def resolve_device(name: str) -> torch.device:
    """Map "auto" / "cpu" / "cuda" / "cuda:N" to a torch.device (anything else: ValueError, device_names)."""
    name = check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True if the CPU advertises bf16 arithmetic (AVX512-BF16 or AMX).

    Without it bf16 matmuls are emulated on CPU and end up slower than fp32.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass  # non-Linux: be conservative
    return False


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """Resolve a dtype name; "auto" picks bf16 only where it is fast."""
    name = name.strip().lower()
    if name == "auto":
        dev = torch.device(device)
        if dev.type == "cuda" or (dev.type == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPE_ALIASES[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}: expected auto, " + ", ".join(_DTYPE_ALIASES)
        ) from None


def configure_cpu(threads: int | None = None) -> None:
    """Process-wide CPU tuning; call before running a model on CPU."""
    # GGUF-dequantised fp32 weights contain many denormals; without
    # flush-to-zero the matmuls take the slow microcode path (~5x slower).
    torch.set_flush_denormal(True)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16", "float32", ... (torch's repr without the "torch." prefix)."""
    return str(dtype).removeprefix("torch.")
