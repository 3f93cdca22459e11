"""The library's shape, held: no file above 480 lines (one idea each), no import cycle between its modules at run
time (imports under ``if TYPE_CHECKING:`` are for annotations only and do not count), and no code that branches on a
strategy's name (a strategy says what it is: ``data_axis``, ``splits_backward``, capabilities)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainkit", "trainkit_strategies")
LIMIT = 480


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere but under ``if TYPE_CHECKING:`` (``from package
    import submodule`` counts as importing the submodule)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {m for m in found if m in modules and m != name}


def long_files(root: Path) -> dict[str, int]:
    lengths = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in _modules(root).values()}
    return {name: n for name, n in lengths.items() if n > LIMIT}


def import_cycles(root: Path) -> list[list[str]]:
    modules = _modules(root)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def name_branches(root: Path, names: set[str]) -> list[str]:
    """Comparisons in the library with one of ``names`` (a string, or one in a literal tuple, list or set)."""
    found = []
    for path in _modules(root).values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            literals = [e for side in sides for e in (side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set)
                                                      else [side])]
            if any(isinstance(e, ast.Constant) and e.value in names for e in literals):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


# trainkit_strategies' folders by role, lowest first: a module imports only from its own group or a lower one, so a
# newcomer reads them bottom up (the contract's leaves, communication, planning, host offload, state, the contract,
# the axes, their composition) and an axis never reaches into the composer.
LAYERS = [
    {"errors", "precision"},
    {"communication"},
    {"capabilities"},
    {"planning"},
    {"offload"},
    {"init"},
    {"state"},
    {"axis", "base", "parts", "ranks", "registry", "wrapper"},
    {"data_parallel", "sharding", "tensor", "context", "experts", "pipeline"},
    {"parallel"},
    {"__init__"},
]


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(root: Path) -> list[str]:
    """Imports of trainkit_strategies from a group to a higher one in ``LAYERS`` (or from a group it does not list)."""
    rank = {group: i for i, layer in enumerate(LAYERS) for group in layer}
    modules = {n: p for n, p in _modules(root).items() if n.split(".")[0] == "trainkit_strategies"}
    found = []
    for name, path in sorted(modules.items()):
        for target in sorted(_imports(name, path, modules)):
            here, there = rank.get(_group(name), -1), rank.get(_group(target), len(LAYERS))
            if there > here:
                found.append(f"{name} -> {target}")
    return found


def test_no_library_file_exceeds_the_limit():
    long = long_files(ROOT)
    assert not long, f"split these by responsibility (at most {LIMIT} lines): {long}"


def test_the_import_graph_has_no_cycle():
    cycles = import_cycles(ROOT)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_strategy_folders_import_one_way():
    upward = upward_imports(ROOT)
    assert not upward, "imports against the layering (tests/unit/test_structure.py, LAYERS): " + "; ".join(upward)


def test_no_code_branches_on_a_strategy_name():
    from trainkit_strategies import available

    branches = name_branches(ROOT, set(available()))
    assert not branches, branches


AXES_FOLDERS = ("tensor", "context", "experts", "pipeline")  # each axis's folder (``trainkit_strategies/axis.py``)


def thread_locals(root: Path) -> list[str]:
    """Files of the axes' folders that make a ``threading.local``: what a layer needs at run time is installed on
    the module by its axis's transform, not entered around every forward, backward and pipeline stage."""
    found = []
    for folder in AXES_FOLDERS:
        for path in sorted((root / "trainkit_strategies" / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                attribute = isinstance(node, ast.Attribute) and node.attr == "local" and \
                    isinstance(node.value, ast.Name) and node.value.id == "threading"
                imported = isinstance(node, ast.ImportFrom) and node.module == "threading" and \
                    any(a.name == "local" for a in node.names)
                if attribute or imported:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_thread_local_in_the_axes_code():
    found = thread_locals(ROOT)
    assert not found, f"install what a layer needs on the module instead (trainkit_strategies/axis.py): {found}"


def test_the_thread_local_check_sees_one(tmp_path):
    for folder in AXES_FOLDERS:
        (tmp_path / "trainkit_strategies" / folder).mkdir(parents=True)
    (tmp_path / "trainkit_strategies" / "context" / "a.py").write_text("import threading\n_l = threading.local()\n")
    (tmp_path / "trainkit_strategies" / "experts" / "b.py").write_text("from threading import local\n")
    assert thread_locals(tmp_path) == ["trainkit_strategies/context/a.py:2", "trainkit_strategies/experts/b.py:1"]


def test_the_checks_see_a_cycle_and_a_long_file(tmp_path):
    """The checks above fail where they should: on modules that import each other (one of them inside a function,
    which still runs), and on a file longer than the limit; an import for annotations only is no cycle."""
    package = tmp_path / "trainkit"
    package.mkdir()
    (tmp_path / "trainkit_strategies").mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from trainkit import b\n")
    (package / "b.py").write_text("def f():\n    from trainkit.a import x\n" + "\n" * LIMIT)
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainkit import d\n")
    (package / "d.py").write_text("from trainkit import c\n")
    (package / "e.py").write_text("def f(s):\n    return s.name == 'ddp' or s.kind in ('zero2', 'other')\n")
    assert import_cycles(tmp_path) == [["trainkit.a", "trainkit.b", "trainkit.a"]]
    assert long_files(tmp_path) == {"trainkit/b.py": LIMIT + 2}
    assert len(name_branches(tmp_path, {"ddp", "zero2"})) == 2
    strategies = tmp_path / "trainkit_strategies"
    for folder in ("communication", "tensor"):
        (strategies / folder).mkdir()
        (strategies / folder / "__init__.py").write_text("")
    (strategies / "__init__.py").write_text("")
    (strategies / "communication" / "comm.py").write_text("from trainkit_strategies.tensor import layers\n")
    (strategies / "tensor" / "layers.py").write_text("from trainkit_strategies.communication import comm\n")
    assert upward_imports(tmp_path) == ["trainkit_strategies.communication.comm -> trainkit_strategies.tensor.layers"]


def test_importing_trainkit_leaves_dynamo_unimported():
    """torch._dynamo is imported only when compilation is asked for: imported with trainkit, before the process group
    started, it left a rank's heartbeat thread unable to beat, so a frozen peer went unnoticed
    (tests/e2e/test_peer_failure.py, "freeze")."""
    import subprocess
    import sys

    code = ("import sys, trainkit, trainkit.cli, trainkit.demo.gpt, trainkit_strategies.parallel.strategy, "
            "trainkit_strategies.registry as r\n[r.strategy_class(n) for n in r.available()]\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_the_strategy_class_is_the_steps_contract_and_its_parts_live_apart():
    """``Strategy``'s own methods are the step's (about fifteen); ranks, gradient parts, checkpointing and planning
    come from classes in files of their own, and no member is defined twice along the way."""
    import inspect

    from trainkit_strategies.base import Strategy
    from trainkit_strategies.parts import GradientParts
    from trainkit_strategies.planning.reports import Planning
    from trainkit_strategies.ranks import Ranks
    from trainkit_strategies.state.checkpointing import Checkpointing

    own = sorted(n for n, v in vars(Strategy).items() if not n.startswith("_") and callable(v))
    assert len(own) <= 16, own
    parts = [Ranks, GradientParts, Checkpointing, Planning]
    assert all(issubclass(Strategy, part) for part in parts)
    files = {inspect.getsourcefile(part) for part in parts} | {inspect.getsourcefile(Strategy)}
    assert len(files) == len(parts) + 1
    members = [n for cls in (Strategy, *parts) for n in vars(cls) if not n.startswith("__")]
    assert len(members) == len(set(members)), sorted(n for n in members if members.count(n) > 1)
