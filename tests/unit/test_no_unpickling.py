"""No code path of trainkit unpickles what it reads: unpickling runs whatever code the bytes name, so a checkpoint,
an export or any file a user is handed could take over the process. Checkpoints are safetensors and JSON; a
``torch.load`` must pass ``weights_only=True``.

The source of ``trainkit`` and ``trainkit_strategies`` is scanned (``ast``, aliases followed) for the modules that
unpickle (``pickle``, ``dill``, ``cloudpickle``, ``shelve``, ``marshal``, ``joblib``), ``torch.load`` without
``weights_only=True``, ``numpy.load(allow_pickle=True)`` and ``pandas.read_pickle``. Not scanned:
``all_gather_object`` / ``broadcast_object``, which pickle inside torch.distributed between the ranks of one job
(processes trainkit started, or a launcher started, over the run's own connections): they load no file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
LOADERS = {"pandas.read_pickle"}


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _true(call: ast.Call, keyword: str) -> bool:
    return any(k.arg == keyword and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def unpickling(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each place in ``source`` that may unpickle."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                aliases[alias.asname or top] = alias.name if alias.asname else top
                if top in MODULES:
                    found.append((node.lineno, f"imports {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            if node.module.split(".")[0] in MODULES:
                found.append((node.lineno, f"imports from {node.module}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases) or ""
        if name.split(".")[0] in {"numpy", "np"} and name.endswith(".load") and _true(node, "allow_pickle"):
            found.append((node.lineno, f"{name}(allow_pickle=True)"))
        elif name in ("torch.load", "torch.serialization.load") and not _true(node, "weights_only"):
            found.append((node.lineno, f"{name} without weights_only=True"))
        elif name in LOADERS:
            found.append((node.lineno, name))
    return found


def test_no_code_path_unpickles():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {what}"
                 for package in ("trainkit", "trainkit_strategies") for path in sorted((ROOT / package).rglob("*.py"))
                 for line, what in unpickling(path.read_text())]
    assert not offenders, ("these may unpickle what they read (use safetensors or JSON, or "
                           "torch.load(weights_only=True)):\n" + "\n".join(offenders))


@pytest.mark.parametrize("source", [
    "import pickle\npickle.loads(b'')", "from pickle import loads as l", "import dill", "import cloudpickle as cp",
    "import torch\ntorch.load('f')", "import torch as t\nt.load('f', weights_only=False)",
    "from torch import load\nload('f')",
    "import numpy as np\nnp.load('f', allow_pickle=True)", "import pandas as pd\npd.read_pickle('f')",
    "import shelve", "import marshal",
])
def test_the_scan_finds_each_way_to_unpickle(source):
    """The scan passes over today's code because nothing unpickles; these show it would not pass over one that did."""
    assert unpickling(source)


def test_the_scan_passes_a_safe_load():
    assert not unpickling("import torch\ntorch.load('f', weights_only=True)\nimport numpy as np\nnp.load('f')")
