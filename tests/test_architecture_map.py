"""docs/architecture.md's source map is the tree: every path it names exists, and every package is on it.

The map is the ```text block under "## Source layout": each line that starts with a path (a word with a slash) names
a folder or file of the repository. A package added without a line on the map, or a room moved without its line,
fails here, as a broken link in the docs does (tests/test_readme_commands.py)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
PRODUCT_AND_BENCH = ("coordinator", "specmesh", "drafter", "verifier", "specmesh_bench")


def source_map(text: str) -> list[str]:
    """The paths at the start of the lines of the ```text block under '## Source layout'."""
    section = text.split("## Source layout", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "docs/architecture.md: the Source layout section has no ```text map"
    paths = []
    for line in block.group(1).splitlines():
        first = line.split()[0] if line.strip() else ""
        if "/" in first and not line.startswith(" " * 10):  # a continuation line is indented past the paths
            paths.append(first)
    return paths


def packages(root: Path) -> set[str]:
    """Every package folder of the product and the benchmarks, as 'a/b/'."""
    return {str(init.parent.relative_to(root)) + "/" for name in PRODUCT_AND_BENCH
            for init in (root / name).rglob("__init__.py")}


def test_every_path_on_the_map_exists():
    missing = [path for path in source_map(ARCHITECTURE.read_text()) if not (REPO / path).exists()]
    assert not missing, f"docs/architecture.md maps paths that are not in the tree: {missing}"


def test_every_package_is_on_the_map():
    on_map = set(source_map(ARCHITECTURE.read_text()))
    absent = sorted(packages(REPO) - on_map)
    assert not absent, f"packages missing from docs/architecture.md's source map: {absent}"


def test_the_map_reader_finds_paths_and_skips_prose(tmp_path):
    text = ("## Source layout\n\n```text\nalpha/            one room\n  alpha/beta/     another,\n"
            "                  continued/ here\n```\n")
    assert source_map(text) == ["alpha/", "alpha/beta/"]
    (tmp_path / "coordinator" / "inner").mkdir(parents=True)
    (tmp_path / "coordinator" / "__init__.py").write_text("")
    (tmp_path / "coordinator" / "inner" / "__init__.py").write_text("")
    assert packages(tmp_path) == {"coordinator/", "coordinator/inner/"}
