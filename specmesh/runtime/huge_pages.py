"""Model weights on transparent huge pages: a worker re-executes itself once, at its start, with glibc's
`glibc.malloc.hugetlb=1` tunable, so that the memory its engine allocates for the weights is advised for huge pages.

Why: decoding streams every weight once a token. On 4 KiB pages that is about 300,000 pages a token for the 1.5B
target (its 1.2 GB of weights), and the TLB misses show in the matrix kernels. Measured on a 2-core AMD EPYC VM
(docs/engines.md#huge-pages): ik's one-token decode ran 10-14% faster on huge pages; the ik worker's decode rate went
from 0.88-0.93x to 0.96x of ik's own loop with both on huge pages, and to 1.02x of the loop as a C API user runs it.
The llama.cpp engine maps its weights from the file (page cache, 4 KiB pages): there only its other allocations get
them.

Why a re-execution: glibc reads its tunables when the process starts, and most Linux distributions (and this VM) set
transparent huge pages to `madvise`, so memory gets them only where it is advised. The weights are allocated inside
the engine's C library (ik_llama.cpp reads the GGUF file into a malloc'd buffer); the tunable is the one switch that
reaches that allocation. The re-execution happens before anything heavy is imported (tens of milliseconds) and only
where it changes something: Linux, glibc 2.35 or later, THP in `madvise` mode (`always` needs nothing, `never` gives
nothing), the tunable not set yet, and huge pages not turned off with `--no-huge-pages` (or SPECMESH_HUGE_PAGES=0,
or `huge-pages = false` in the --config file).

The cost: on a VM whose host backs guest memory lazily, faulting in huge pages is slower than 4 KiB pages that the
guest recycles: loading the 1.5B target in a bare process took 2.9 s against 0.9 s there, though a worker's time to
READY did not move (medians 3.06 s against 3.04 s).
"""

from __future__ import annotations

import argparse
import os
import sys

from specmesh.ops import config as flag_config

TUNABLE = "glibc.malloc.hugetlb"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)  # the first glibc with glibc.malloc.hugetlb


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), None where there is none."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None (musl, macOS)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def tunables_with_huge_pages(tunables: str | None) -> str | None:
    """GLIBC_TUNABLES with glibc.malloc.hugetlb=1 added; None when it already names hugetlb (set by us, or by the
    user, whose value stands)."""
    entries = [t for t in (tunables or "").split(":") if t]
    if any(t.split("=", 1)[0] == TUNABLE for t in entries):
        return None
    return ":".join([*entries, f"{TUNABLE}=1"])


def started_with_huge_pages(environ: dict[str, str] | None = None) -> bool:
    """Whether this process's malloc advises huge pages (glibc.malloc.hugetlb set and not 0 when it started)."""
    tunables = (os.environ if environ is None else environ).get("GLIBC_TUNABLES") or ""
    values = [t.split("=", 1)[1] for t in tunables.split(":") if t.startswith(TUNABLE + "=")]
    return bool(values) and values[-1] != "0"


def huge_pages_requested(role: str, argv: list[str]) -> bool:
    """--huge-pages / --no-huge-pages as the worker's full parser will read it: the command line over
    SPECMESH_HUGE_PAGES over the --config file (specmesh/ops/config.py), on by default."""
    parser = argparse.ArgumentParser(add_help=False)
    add_huge_pages_argument(parser)
    try:
        flag_config.apply(parser, role, flag_config.load(flag_config.config_file(argv)))
    except SystemExit:  # a bad value or file: the full parser reports it, on the run that does not re-execute
        return False
    return parser.parse_known_args(argv)[0].huge_pages


def add_huge_pages_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                        help="start with glibc's malloc advising transparent huge pages (glibc.malloc.hugetlb=1), so "
                        "that the engine's weights sit on 2 MiB pages: decoding ran 10-14%% faster on them "
                        "(docs/engines.md); only where the kernel's THP mode is madvise")


def tunable_helps() -> bool:
    """Whether glibc's tunable changes what pages this process gets: Linux with THP in madvise mode and a glibc that
    has it (with `always` every allocation gets huge pages already, with `never` none can)."""
    version = glibc_version()
    return sys.platform == "linux" and thp_mode() == "madvise" and version is not None and version >= MIN_GLIBC


def on_huge_pages(with_tunable: bool) -> bool:
    """Whether a process's large allocations get huge pages: always under THP `always`, with the tunable under
    `madvise`."""
    mode = thp_mode()
    return mode == "always" or (mode == "madvise" and with_tunable)


def environment_for_huge_pages(role: str, argv: list[str], environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute the worker with, or None where that would change nothing."""
    if not tunable_helps():
        return None
    tunables = tunables_with_huge_pages(environ.get("GLIBC_TUNABLES"))
    if tunables is None or not huge_pages_requested(role, argv):
        return None
    return {**environ, "GLIBC_TUNABLES": tunables}


def reexec_with_huge_pages(role: str) -> None:
    """Replace this process (same pid, same open files: a parent's pipes stay connected) with itself started with
    the huge-page tunable, where that changes something; return otherwise. Call it first thing in the worker's
    `__main__`, before the imports that allocate."""
    environment = environment_for_huge_pages(role, sys.argv[1:], dict(os.environ))
    if environment is not None:
        _reexec(environment)


def reexec_on_huge_pages_if_possible() -> bool:
    """The same for any command (`coordinator bench --baseline-huge-pages`): True where this process is on huge pages
    already, else re-execute on the tunable where that helps; False where it cannot (THP `never` or absent, no glibc
    with the tunable, or the user's own hugetlb=0)."""
    if on_huge_pages(started_with_huge_pages()):
        return True
    tunables = tunables_with_huge_pages(os.environ.get("GLIBC_TUNABLES"))  # None: the user set hugetlb=0
    if not tunable_helps() or tunables is None:
        return False
    _reexec({**os.environ, "GLIBC_TUNABLES": tunables})
    return True  # not reached: the process is replaced


def workers_on_huge_pages(role: str = "verifier") -> bool:
    """Whether a worker this process starts (it inherits this environment) gets huge pages."""
    return on_huge_pages(started_with_huge_pages()
                         or environment_for_huge_pages(role, ["serve"], dict(os.environ)) is not None)


def _reexec(environment: dict[str, str]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)


def huge_page_bytes() -> int | None:
    """Bytes of this process's memory on transparent huge pages (AnonHugePages), None where unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
