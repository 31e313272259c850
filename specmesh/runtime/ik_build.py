"""ik_llama.cpp built here with row-invariant kernels: a one-row pass gives the bits a multi-row pass gives.

Why: with repacked weights (the ik engine's default, about 2x faster) the PyPI wheel's matrix kernels take another
arithmetic for one row of activations than for two or more: `if constexpr (nrc_y == 1)` branches in
`ggml/src/iqk/iqk_gemm_*.cpp` fold the activation's scale into the weights' scales, or sum the K-quants' block minimums
in another order (`process_min_r4_b32`). Rounding then differs (max |logit diff| 0.55 on the 1.5B default target), so
an exact engine on the wheel never runs a one-row pass: its one-token step computes two rows, 38 ms against 27 ms for
one row here (2-core Zen 4). This build compiles the same source (the binding's own source distribution, pinned by
hash) with the repacked kernels' one-row branches off (46 of the 83: in the plain layouts' kernels the one-row branch
is the only correct code for one row, and its rounding already matches), so one row takes the multi-row arithmetic:
the exact engine's one-token step is one row (the engine checks that on each model at load). Passes of two rows and
more compute what they computed before, bit for bit (their code is untouched), so greedy output is the same tokens
as on the wheel's exact engine. Measured exact, repacked and plain, on Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K,
IQ4_XS and IQ4_NL (docs/engines.md).

What is built: `libggml` and `libllama` only, with the wheel's instruction set (AVX2, FMA, F16C; a native AVX-512
build measured slower with repack, docs/engines.md), without ik's flash attention kernels (the engine runs attention
without them; they are most of a full build's compile time). About 100 s on 2 cores, once per environment; the
result is kept in the virtual environment (`<prefix>/lib/specmesh-engines/`) and, for the next clone on the same
machine, in `~/.cache/specmesh/engines/`. The binding loads it through its own `IK_LLAMA_CPP_LIB_PATH`
(ik_binding.py); `SPECMESH_IK_BUILD=wheel` loads the wheel's library instead. Where the build fails (no compiler,
no network for the source), `make setup` says why and the engine runs on the wheel, exact with two-row steps.

`python -m specmesh.runtime.ik_build` builds it if missing (what `make setup` runs); `--check` only reports.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from specmesh.runtime import catalog

PACKAGE = "ik-llama-cpp-python"
VERSION = "0.1.5"  # the binding's pinned version (pyproject.toml): its struct layouts match this source only
SDIST_SHA256 = "33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad"
SOURCE_DIR = "vendor/ik_llama.cpp"  # inside the source distribution
KERNEL_GLOB = "ggml/src/iqk/iqk_gemm_*.cpp"
ONE_ROW_BRANCH = "if constexpr (nrc_y == 1)"
MULTI_ROW_ARITHMETIC = "if constexpr (false && nrc_y == 1)"  # the branch compiled out; the general code takes the row
# In this version's repacked kernels (of 83 in all): another count means another source, which this patch was not
# made for.
ONE_ROW_BRANCHES = 46
_FUNCTION = re.compile(r"^(?:static\s+|inline\s+|IQK_ALWAYS_INLINE\s+|IQK_NOINLINE\s+)*(?:[\w:<>,*&]+\s+)+\**(\w+)\s*\(")
_REPACKED = re.compile(r"_r(?:4|8|16)(?:_|$)")
# Built without ik's flash attention kernels, the source does not link: ggml.c calls iqk_fa_work_buffer_size, which
# only the kernels define, and the stand-in for iqk_flash_attn_noalibi has an older parameter list (no `sinks`), so it
# defines another (C++) function. Both are replaced by stand-ins of the header's signatures; neither is called where no
# graph has a flash attention node (the engine never asks for one).
FLASH_ATTENTION_FILE = "ggml/src/iqk/iqk_flash_attn.cpp"
NO_FLASH_ATTENTION_STANDIN = "#else\n\nbool iqk_flash_attn_noalibi("  # the stale stand-in, up to the file's #endif
NO_FLASH_ATTENTION_STANDINS = """#else

// specmesh (ik_build.py): stand-ins of the header's signatures for a build without the flash attention kernels.
size_t iqk_fa_work_buffer_size(const struct ggml_tensor *, int) { return 0; }

bool iqk_flash_attn_noalibi(int, int, float, int, int, long, long, int, int, long, long, int, int, long, long,
                            int, int, long, int, int, int, int, int, int, int, int, int, int,
                            const void *, const void *, const void *, const void *, const void *, float, float,
                            float *, void *, barrier_t, void *, int, int, int) {
    return false;
}

#endif
"""
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    # The wheel's instruction set (its kernels run on any x86-64 CPU with AVX2).
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    # The engine never runs flash attention (ik_engine.py); its kernels are most of a full build's compile time.
    "-DGGML_IQK_FLASH_ATTENTION=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",  # libllama finds the libggml beside it
)
# Named by what makes it: another patch or other options give another directory, never a stale build.
_RECIPE = hashlib.sha256(json.dumps([SDIST_SHA256, ONE_ROW_BRANCH, MULTI_ROW_ARITHMETIC, _REPACKED.pattern,
                                     NO_FLASH_ATTENTION_STANDINS, CMAKE_OPTIONS]).encode()).hexdigest()[:10]
BUILD_NAME = f"ik-llama-cpp-python-{VERSION}-row-invariant-avx2-{_RECIPE}"
LIBRARIES = ("libllama.so", "libggml.so")
RECORD = "build.json"
SELECT_ENV = "SPECMESH_IK_BUILD"  # "wheel": load the wheel's library even where this build exists


def install_dir(prefix: Path | None = None) -> Path:
    """Where the build lives: in the environment the binding is installed in."""
    return Path(prefix or sys.prefix) / "lib" / "specmesh-engines" / BUILD_NAME


def machine_cache_dir() -> Path:
    """Where a build is kept for other environments on this machine (another clone's `make setup` copies it)."""
    return catalog.cache_dir() / "engines" / BUILD_NAME


def _complete(directory: Path) -> bool:
    return (directory / RECORD).is_file() and all((directory / name).is_file() for name in LIBRARIES)


def installed_library() -> Path | None:
    """The row-invariant build's libllama in this environment, None where it is not built."""
    directory = install_dir()
    return directory / "libllama.so" if _complete(directory) else None


def wheel_requested() -> bool:
    """SPECMESH_IK_BUILD=wheel: run the wheel's library even where the row-invariant build exists."""
    return os.environ.get(SELECT_ENV, "").strip().lower() == "wheel"


def record() -> dict | None:
    """What the installed build recorded (its source, options and compile time), None where there is none."""
    try:
        return json.loads((install_dir() / RECORD).read_text())
    except (OSError, ValueError):
        return None


def _repacked_kernel_branches(text: str) -> list[int]:
    """Offsets of the one-row branches inside repacked-layout kernels (a top-level function whose name has _r4, _r8
    or _r16: `mul_mat_q4_k_r4_q8_k`, `process_min_r4_b32`, ...). The plain layouts' one-row branches are left: there
    they are the only correct code for one row (compiled out, a plain Q4_K one-row pass came out wrong), and their
    one-row passes already give the multi-row bits."""
    offsets, function, position = [], "", 0
    for line in text.splitlines(keepends=True):
        if line[:1].isalpha() and (match := _FUNCTION.match(line)):
            function = match.group(1)
        if ONE_ROW_BRANCH in line and _REPACKED.search(function):
            offsets.append(position + line.index(ONE_ROW_BRANCH))
        position += len(line)
    return offsets


def patch_source(source: Path) -> int:
    """Patch the ik_llama.cpp tree `source`: the repacked kernels' one-row branches off (how many there were), and the
    stand-ins that a build without ik's flash attention kernels lacks. Refuses a tree where either does not apply as
    it did on the pinned version's: its kernels are not the ones this patch was measured on."""
    kernels = {path: path.read_text() for path in sorted(source.glob(KERNEL_GLOB))}
    branches = {path: _repacked_kernel_branches(kernel) for path, kernel in kernels.items()}
    found = sum(len(offsets) for offsets in branches.values())
    if found != ONE_ROW_BRANCHES:
        raise RuntimeError(f"{source}: {found} one-row branches in repacked kernels, expected {ONE_ROW_BRANCHES} "
                           f"({PACKAGE} {VERSION}'s); not patching another source")
    attention = source / FLASH_ATTENTION_FILE
    text = attention.read_text()
    if text.count(NO_FLASH_ATTENTION_STANDIN) != 1:
        raise RuntimeError(f"{attention}: not the {PACKAGE} {VERSION} source this patch was made for")
    for path, offsets in branches.items():
        kernel = kernels[path]
        for offset in reversed(offsets):
            kernel = kernel[:offset] + MULTI_ROW_ARITHMETIC + kernel[offset + len(ONE_ROW_BRANCH):]
        path.write_text(kernel)
    stale = text.index(NO_FLASH_ATTENTION_STANDIN)
    attention.write_text(text[:stale] + NO_FLASH_ATTENTION_STANDINS)
    return found


def _download_source(into: Path) -> Path:
    """The pinned source distribution, through pip (its cache makes a second download free), hash-checked."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-binary", ":all:", f"{PACKAGE}=={VERSION}", "-d", str(into)], check=True,
                   capture_output=True, text=True)
    archive = next(into.glob("*.tar.gz"))
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{archive.name}: sha256 {digest}, expected {SDIST_SHA256}")
    return archive


def _extract_source(archive: Path, into: Path) -> Path:
    """Only the vendored ik_llama.cpp tree of the archive."""
    with tarfile.open(archive) as tar:
        root = tar.getnames()[0].split("/")[0]
        prefix = f"{root}/{SOURCE_DIR}/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(into, members=members, filter="data")
    return into / root / SOURCE_DIR


def _compile(source: Path, build: Path, jobs: int) -> None:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    for command in (["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_OPTIONS],
                    ["cmake", "--build", str(build), "--target", "llama", "ggml", "-j", str(jobs)]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
            raise RuntimeError(f"{command[0]} {command[1]} failed (exit {done.returncode}):\n{tail}")


def _copy_build(source: Path, target: Path) -> None:
    """`source`'s libraries and record into `target`, whole or not at all (a sibling directory, renamed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    for name in (*LIBRARIES, RECORD):
        shutil.copy2(source / name, partial / name)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def _find_built(build: Path, name: str) -> Path:
    return next(path for path in build.rglob(name) if path.is_file() and not path.is_symlink())


def build(jobs: int | None = None) -> Path:
    """Build (or copy from this machine's cache) and install; the installed directory. Raises with the reason."""
    target = install_dir()
    if _complete(target):
        return target
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"built for x86-64 Linux only (the wheel's platform); this is {platform.system()} "
                           f"{platform.machine()}")
    cached = machine_cache_dir()
    with catalog.file_lock(cached.parent / ".build.lock"):
        if not _complete(cached):
            for tool in ("cmake", "c++", "cc"):
                if not shutil.which(tool):
                    raise RuntimeError(f"no {tool} on PATH")
            started = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="specmesh-ik-build-") as scratch:
                work = Path(scratch)
                archive = _download_source(work / "download")
                source = _extract_source(archive, work / "source")
                branches = patch_source(source)
                jobs = jobs or len(os.sched_getaffinity(0))
                _compile(source, work / "build", jobs)
                staged = work / "staged"
                staged.mkdir()
                for name in LIBRARIES:
                    shutil.copy2(_find_built(work / "build", name), staged / name)
                (staged / RECORD).write_text(json.dumps({
                    "package": PACKAGE, "version": VERSION, "sdist_sha256": SDIST_SHA256,
                    "one_row_branches_off": branches, "cmake_options": list(CMAKE_OPTIONS),
                    "compile_s": round(time.monotonic() - started, 1), "jobs": jobs,
                    "cpu_flags": _cpu_flags(),
                }, indent=2) + "\n")
                _copy_build(staged, cached)
    _copy_build(cached, target)
    return target


def _cpu_flags() -> list[str]:
    """The CPU's vector and matrix extensions, for the build's record."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            line = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return []
    return sorted(f for f in line.partition(":")[2].split() if f.startswith(("avx", "amx", "fma", "f16c")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.runtime.ik_build", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether the build is installed")
    parser.add_argument("--jobs", type=int, default=None, help="compile jobs (default: the CPUs this process may use)")
    args = parser.parse_args(argv)
    if _complete(install_dir()):
        made = record() or {}
        print(f"ik_llama.cpp: row-invariant build installed ({install_dir()}; compiled in {made.get('compile_s')} s)")
        return 0
    if args.check:
        print("ik_llama.cpp: no row-invariant build here; the engine runs the wheel's library (two-row exact steps)")
        return 1
    print(f"ik_llama.cpp: building the row-invariant kernels (once per machine: about 2 minutes on 2 cores)",
          flush=True)
    try:
        directory = build(args.jobs)
    except (RuntimeError, OSError, subprocess.CalledProcessError, StopIteration) as e:
        reason = (getattr(e, "stderr", None) or str(e) or type(e).__name__).strip()
        print(f"ik_llama.cpp: row-invariant build failed, the engine runs the wheel's library (two-row exact steps): "
              f"{reason}", file=sys.stderr)
        return 1
    print(f"ik_llama.cpp: row-invariant build installed in {directory} "
          f"(compiled in {(record() or {}).get('compile_s')} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
