"""The package graph: folders say where code runs, and imports only go one way.

core/        pure and shared by every process: imports nothing else of ours
rank/        inside worker processes: core only
inference/   the engines the server samples through: core, and rank (the embedded sampler's calls,
             which the embedded engine makes through ``server.workers.ProcessBackend.sampler``)
node/        the agent of a node other than the server's: core, and rank (to start ranks)
server/      the event loop: core, inference, and rank (to start ranks and read their calls)
cli.py       the entry point (cli_keys.py: its keys command): anything

Every import counts, also one inside a function (a deferred import is still a dependency).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parents[2] / "hosted_tinker"
MAY_IMPORT = {
    "core": {"core"},
    "rank": {"core", "rank"},
    "inference": {"core", "inference", "rank"},
    "node": {"core", "node", "rank"},
    "server": {"core", "inference", "rank", "server"},
}


def folder_of(module: str) -> str:
    """``hosted_tinker.server.api.app`` -> ``server``; a module at the top -> its own name."""
    return module.split(".")[1]


@cache
def tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the checks below."""
    return ast.parse(path.read_text())


@cache
def edges() -> dict[str, set[str]]:
    """Top-level folder (or module) -> the folders its modules import."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(("hosted_tinker", *path.relative_to(PACKAGE).with_suffix("").parts))
        if module.count(".") == 0:
            continue
        source = folder_of(module) if module.count(".") >= 1 else module
        targets = graph.setdefault(source, set())
        for node in ast.walk(tree(path)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("hosted_tinker.") and (PACKAGE / name.split(".")[1]).exists():
                    targets.add(folder_of(name))
                elif name.startswith("hosted_tinker.") and (PACKAGE / f"{name.split('.')[1]}.py").exists():
                    targets.add(name.split(".")[1])
    return graph


def test_every_folder_imports_only_what_it_may():
    graph = edges()
    assert set(MAY_IMPORT) <= set(graph), "a folder this test knows is gone: update MAY_IMPORT"
    for folder, imported in graph.items():
        if folder in MAY_IMPORT:
            assert imported <= MAY_IMPORT[folder], f"{folder}/ imports {sorted(imported - MAY_IMPORT[folder])}"
        else:  # a top-level module (cli, __main__): no folder may import it
            assert not any(folder in graph[name] for name in MAY_IMPORT), f"a folder imports {folder}"


def test_the_folder_graph_has_no_cycle():
    graph = {k: v - {k} for k, v in edges().items()}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import cycle: {' -> '.join([*path[path.index(node) :], node])}"
        if node in done:
            return
        for nxt in graph.get(node, ()):
            visit(nxt, [*path, node])
        done.add(node)

    for node in graph:
        visit(node, [])


@cache
def module_edges() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (an import of a package counts as its
    ``__init__``; a name imported from a module, as that module)."""
    modules = {
        ".".join(("hosted_tinker", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = graph.setdefault(module, set())
        for node in ast.walk(tree(path)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                names = names or [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            targets.update(name for name in names if name in modules and name != module)
    return graph


def test_no_module_imports_one_that_imports_it():
    """Not even for type checking: a circle of modules is one module in two files."""
    graph = module_edges()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import cycle: {' -> '.join([*path[path.index(node) :], node])}"
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


PERSISTENCE = "hosted_tinker.server.persistence"


def test_persistence_is_the_servers_bottom_layer():
    """What the server keeps is read and written in one folder, which depends on nothing of the
    server's above it (services, routes, workers) and only on ``core``."""
    graph = module_edges()
    for module, targets in graph.items():
        if module.startswith(PERSISTENCE):
            above = sorted(t for t in targets if not t.startswith((PERSISTENCE, "hosted_tinker.core")))
            assert not above, f"{module} imports {above}"
    rows = {"store", "store_rows", "schema", "records", "sequences"}
    strays = [m for m in graph if m.startswith("hosted_tinker.server.") and m.rsplit(".", 1)[1] in rows]
    assert all(m.startswith(PERSISTENCE) for m in strays), strays


TESTS = PACKAGE.parent / "tests"
# test_vllm collects test_sampling's tests again, against vLLM (a fixture of its own named as theirs)
RECOLLECTED = {("tests.e2e.test_vllm", "tests.e2e.test_sampling")}


def test_no_test_module_imports_another():
    """What tests share lives in ``tests/support/`` (and fixtures in a conftest.py): a test
    module, or a benchmark, that imports a test module depends on that module's other tests. A
    conftest's fixtures reach its folder's tests by name; importing the conftest too registers
    them a second time, under the importer's name."""
    found = set()
    for path in [*TESTS.rglob("*.py"), *(PACKAGE.parent / "benchmarks").glob("*.py")]:
        importer = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[-1].startswith(("test_", "conftest")):
                    found.add((importer, node.module))
    assert found == RECOLLECTED


def test_the_clis_own_commands_load_no_engine():
    """``keys ...``, ``--help``, a wrong flag and a wrong ``--backend-option`` answer without
    torch, transformers or the tinker SDK (which loads torch): 0.3 s a call rather than 2.5 s.
    ``serve`` loads them once its options are checked and it starts."""
    import subprocess
    import sys

    heavy = ("torch", "transformers", "tinker", "numpy")
    probe = f"import sys, hosted_tinker.cli; print([m for m in {heavy!r} if m in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    check = (
        "import sys; from hosted_tinker.rank.plans import plan_options\n"
        "for backend, values, devices in [('peft', {}, ['cpu']), ('ddp', {'bucket_mb': '1'}, ['cpu'] * 2),"
        " ('megatron', {'tp': '3'}, ['cpu'] * 2)]:\n"
        "    try: plan_options(backend, values, devices, 3600.0)\n"
        "    except ValueError: pass\n"
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
