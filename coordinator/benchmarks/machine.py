"""What a benchmark ran on: the CPU's vector and matrix extensions, the kernels torch picked, llama.cpp's build."""

from __future__ import annotations

import os
import re

CPU_FLAG = re.compile(r"avx2|avx512.*|amx.*|avx_vnni.*")


def cpu_features(llama_system_info: str | None = None) -> dict:
    """The vector/matrix extensions this run could use: the CPU's flags (/proc/cpuinfo), the kernels torch picked and,
    when llama.cpp ran, the features its build uses (from llama_print_system_info)."""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = sorted(f for f in line.split(":", 1)[1].split() if CPU_FLAG.fullmatch(f))
                    break
    except OSError:
        pass
    try:
        import torch

        torch_capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - old torch, no torch: just not reported
        torch_capability = None
    out = {"cpu_flags": flags, "torch_cpu_capability": torch_capability, "cpu_count": os.cpu_count()}
    if llama_system_info:
        out["llamacpp_system_info"] = llama_system_info.strip()
        out["llamacpp_cpu_features"] = [name.lower() for name, on in
                                        re.findall(r"([A-Za-z0-9_]+) = (\d+)", llama_system_info)
                                        if on != "0" and CPU_FLAG.fullmatch(name.lower())]
    return out


def llamacpp_system_info() -> str | None:
    try:
        import llama_cpp

        return llama_cpp.llama_print_system_info().decode(errors="replace")
    except Exception:  # noqa: BLE001 - not installed or too old: not reported
        return None
