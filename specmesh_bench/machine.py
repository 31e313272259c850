"""What a benchmark ran on: the CPU's model, vector and matrix extensions, the kernels torch picked, llama.cpp's
build; and the run itself: the command line, the date and the specmesh revision (run_record)."""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import subprocess
from pathlib import Path

CPU_FLAG = re.compile(r"avx2|avx512.*|amx.*|avx_vnni.*")


def cpu_features(llama_system_info: str | None = None) -> dict:
    """The vector/matrix extensions this run could use: the CPU's flags (/proc/cpuinfo), the kernels torch picked and,
    when llama.cpp ran, the features its build uses (from llama_print_system_info)."""
    flags: list[str] = []
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name") and model is None:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = sorted(f for f in line.split(":", 1)[1].split() if CPU_FLAG.fullmatch(f))
                    break
    except OSError:
        pass
    try:
        import torch

        torch_capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - old torch, no torch: just not reported
        torch_capability = None
    out = {"cpu_model": model or platform.processor() or None, "cpu_flags": flags,
           "torch_cpu_capability": torch_capability, "cpu_count": os.cpu_count(), "usable_cpus": usable_cpus()}
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


def usable_cpus() -> int | None:
    """The CPUs this process may run on (its affinity), which a container or taskset may hold below cpu_count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def specmesh_revision() -> dict | None:
    """The git commit of the specmesh checkout that ran, and whether tracked files differed from it (None: not a git
    checkout, or no git). Read-only: rev-parse and diff-index touch neither the index nor the work tree."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "diff-index", "--quiet", "HEAD", "--"], capture_output=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": dirty.returncode != 0}


def run_record(prog: str, argv: list[str], llama_system_info: str | None = None) -> dict:
    """What a saved report needs to say where it came from: the command line as typed (prog + argv), the date (UTC),
    the specmesh revision and the machine (CPU model, flags, cores, memory, OS, Python, torch)."""
    try:
        import torch

        torch_version = torch.__version__
    except Exception:  # noqa: BLE001 - no torch: not reported
        torch_version = None
    return {
        "argv": list(argv),
        "command": " ".join([prog, shlex.join(argv)] if argv else [prog]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "specmesh_revision": specmesh_revision(),
        "load_average": load_average(),  # at the start; bench adds load_average_end: a busy host makes noisy numbers
        "machine": {**cpu_features(llama_system_info), "memory_gib": memory_gib(), "os": platform.platform(),
                    "python": platform.python_version(), "torch": torch_version},
    }
