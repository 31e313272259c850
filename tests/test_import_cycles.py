"""No import circles among the project's own modules: coordinator/, specmesh/, drafter/, verifier/, specmesh_bench/
and scripts/ (whose scripts import each other by bare name: their directory is on sys.path when one runs); and the
layering rules of docs/architecture.md#source-layout: which room may import which.

Every import counts, wherever it is written: at module level, inside a function (a lazy import still ties the two
modules together, and makes the order in which they can be loaded depend on which runs first) and under
`if TYPE_CHECKING:` (a circle a type checker has to untangle is one a reader has to untangle too). An import names one
module: `from a.b import c` is an edge to a.b.c when that is a module, else to a.b; the parent packages Python loads
on the way (a, a.b) are not edges of their own. Read with ast, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "specmesh", "drafter", "verifier", "specmesh_bench")
SCRIPTS = "scripts"


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the packages and the scripts (by bare name) under `root`."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    for path in sorted((root / SCRIPTS).glob("*.py")):
        modules[path.stem] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `name` (at `path`) imports, anywhere in its code."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(resolve(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..y import z
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else resolve(base))
    return {target for target in found if target is not None and target != name}


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    return "; ".join(f"{m} imports {', '.join(sorted(graph[m] & members))}" for m in component)


def test_no_import_cycles_among_the_projects_modules():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(describe(c, graph) for c in found)


def test_the_graph_sees_the_imports_it_must():
    """Guards the test above against a walker that finds nothing: edges of every kind it resolves are there."""
    graph = import_graph()
    assert len(graph) > 100
    assert "specmesh.worker.role" in graph["specmesh.worker.server"]  # from a.b.c import Name
    assert "coordinator.api" in graph["coordinator"]  # from a import submodule, inside a function
    assert "chaos_common" in graph["chaos_serve"] and "chaos_serve" in graph["chaos"]  # scripts, by bare name
    assert "specmesh.v1.specmesh_pb2" in graph["specmesh.worker.server"]  # from a.b import module as alias


def test_a_circle_is_found(tmp_path):
    """Lazy, TYPE_CHECKING and relative imports all close a circle."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / SCRIPTS).mkdir()
    (tmp_path / "specmesh" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    from specmesh.b import B\n")
    (tmp_path / "specmesh" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "coordinator" / "c.py").write_text("import specmesh.a\n")
    (tmp_path / SCRIPTS / "one.py").write_text("def main():\n    import two\n")
    (tmp_path / SCRIPTS / "two.py").write_text("from one import main\n")
    assert sorted(cycles(import_graph(tmp_path))) == [["one", "two"], ["specmesh.a", "specmesh.b"]]


# The layering rules of docs/architecture.md#source-layout. Each rule: (who, what it must not import, the exceptions
# allowed as (importer, imported) prefixes, why). A module matches a name when it is that module or inside it.
def within(module: str, *names: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


# What the coordinator may take from specmesh.runtime: names and files it needs before its workers start, no engine.
COORDINATOR_RUNTIME = ("specmesh.runtime", "specmesh.runtime.atomic_files", "specmesh.runtime.catalog",
                       "specmesh.runtime.engine", "specmesh.runtime.gguf_cache", "specmesh.runtime.model_spec",
                       "specmesh.runtime.tokenizer")
PRODUCT = ("coordinator", "specmesh", "drafter", "verifier")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []

    def forbid(who, forbidden, why, allowed=lambda importer, imported: False):
        for importer in sorted(graph):
            if not who(importer):
                continue
            for imported in sorted(graph[importer]):
                if forbidden(imported) and not allowed(importer, imported):
                    found.append(f"{importer} imports {imported}: {why}")

    forbid(lambda m: within(m, "specmesh") and not within(m, "specmesh.rayserve"),
           lambda m: within(m, "coordinator", "drafter", "verifier", "specmesh_bench"),
           "specmesh/ is the core the others stand on (only specmesh.rayserve composes them)")
    forbid(lambda m: within(m, "drafter"), lambda m: within(m, "verifier", "coordinator", "specmesh_bench"),
           "a service imports specmesh/ only")
    forbid(lambda m: within(m, "verifier"), lambda m: within(m, "drafter", "coordinator", "specmesh_bench"),
           "a service imports specmesh/ only")
    forbid(lambda m: within(m, "coordinator"),
           lambda m: within(m, "drafter", "verifier", "specmesh.worker")
           or (within(m, "specmesh.runtime") and m not in COORDINATOR_RUNTIME),
           "the coordinator is a client of the workers: no service, worker server or engine")
    forbid(lambda m: within(m, "coordinator"), lambda m: within(m, "specmesh_bench"),
           "the benchmarks are outside the product; the CLI alone hands them their commands",
           allowed=lambda importer, imported: importer == "coordinator.cli")
    forbid(lambda m: within(m, "coordinator.loop"), lambda m: within(m, "coordinator.fleet", "coordinator.serving"),
           "the loop is flat and gRPC-free")
    forbid(lambda m: within(m, "coordinator.drafting", "coordinator.fleet"),
           lambda m: within(m, "coordinator.api", "coordinator.cli", "coordinator.serving"),
           "the drafting decision and the fleet sit below the API")
    forbid(lambda m: within(m, "coordinator") and not within(m, "coordinator.serving"),
           lambda m: within(m, "coordinator.serving"), "serving is the top room: only the CLI starts it",
           allowed=lambda importer, imported: importer == "coordinator.cli")
    forbid(lambda m: within(m, *PRODUCT), lambda m: within(m, "specmesh_bench"),
           "nothing in the product imports the benchmarks",
           allowed=lambda importer, imported: importer == "coordinator.cli")
    return found


def test_every_room_imports_only_what_the_layering_allows():
    found = layering_violations(import_graph())
    assert not found, "layering broken (docs/architecture.md#source-layout):\n" + "\n".join(found)


def test_the_loop_is_grpc_free():
    tree = ast.parse((REPO / "coordinator" / "loop.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "grpc" not in imported, "coordinator/loop.py must stay gRPC-free: a flat function over two interfaces"


def test_a_layering_violation_is_found(tmp_path):
    """Each kind of rule fires: the core importing upwards, the coordinator importing an engine or the bench."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / SCRIPTS).mkdir()
    (tmp_path / "specmesh" / "runtime").mkdir()
    (tmp_path / "specmesh" / "runtime" / "__init__.py").write_text("")
    (tmp_path / "specmesh" / "runtime" / "ik_engine.py").write_text("")
    (tmp_path / "specmesh" / "runtime" / "catalog.py").write_text("")
    (tmp_path / "specmesh" / "core.py").write_text("def f():\n    import coordinator.api\n")
    (tmp_path / "coordinator" / "api.py").write_text("from specmesh.runtime import ik_engine, catalog\n")
    (tmp_path / "coordinator" / "cli.py").write_text("import specmesh_bench\n")
    (tmp_path / "coordinator" / "other.py").write_text("import specmesh_bench\n")
    found = layering_violations(import_graph(tmp_path))
    assert any(line.startswith("specmesh.core imports coordinator.api") for line in found)
    assert any(line.startswith("coordinator.api imports specmesh.runtime.ik_engine") for line in found)
    assert not any("specmesh.runtime.catalog" in line for line in found)
    assert any(line.startswith("coordinator.other imports specmesh_bench") for line in found)
    assert not any(line.startswith("coordinator.cli") for line in found)
