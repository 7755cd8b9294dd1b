"""No loader in the framework's source may unpickle (or eval) what it reads.

Data files, tokenizers, checkpoints and compile caches come from other teams; a loader that
unpickles runs their code. A scan of every source file's syntax tree, not a grep: it fails when
someone adds ``np.load`` without ``allow_pickle=False``, ``torch.load`` without
``weights_only=True``, ``pickle.load(s)``, an ``Unpickler`` subclass without ``find_class``,
``yaml.load`` without a safe loader, or eval/exec. It spans the whole tree (framework/, train.py,
benchmarks/), so it mirrors no single module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    [*(ROOT / "framework").rglob("*.py"), ROOT / "train.py", *(ROOT / "benchmarks").rglob("*.py")]
)
# module alias -> functions that unpickle (or run code) whatever keyword they get.
ALWAYS_UNSAFE = {
    "pickle": {"load", "loads"},
    "cPickle": {"load", "loads"},
    "dill": {"load", "loads"},
    "cloudpickle": {"load", "loads"},
    "marshal": {"load", "loads"},
    "shelve": {"open"},
    "joblib": {"load"},
    "yaml": {"unsafe_load", "full_load", "unsafe_load_all", "full_load_all"},
    "pd": {"read_pickle"},
    "pandas": {"read_pickle"},
}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(
        k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords
    )


def unsafe_loaders(source: str, filename: str = "<src>") -> list[str]:
    """``file:line: what`` for every unsafe loader call in ``source``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ClassDef):
            bases = {_dotted(b) for b in node.bases}
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            if bases & {"pickle.Unpickler", "Unpickler"} and "find_class" not in methods:
                found.append(f"{filename}:{node.lineno}: Unpickler subclass {node.name} without find_class")
            continue
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        module, _, func = name.rpartition(".")
        where = f"{filename}:{node.lineno}: {name}"
        if func in ALWAYS_UNSAFE.get(module.split(".")[-1], set()) or name in (
            "pickle.Unpickler",
            "eval",
            "exec",
        ):
            found.append(where)
        elif name in ("np.load", "numpy.load") and not _keyword_is(node, "allow_pickle", False):
            found.append(f"{where} without allow_pickle=False")
        elif name == "torch.load" and not _keyword_is(node, "weights_only", True):
            found.append(f"{where} without weights_only=True")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = next((k.value for k in node.keywords if k.arg == "Loader"), None)
            if loader is None or _dotted(loader).split(".")[-1] not in SAFE_YAML_LOADERS:
                found.append(f"{where} without a safe Loader")
    return found


@pytest.mark.parametrize(
    "snippet",
    [
        "import numpy as np\nnp.load('x.npy')",
        "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
        "import torch\ntorch.load('x.pt')",
        "import torch\ntorch.load('x.pt', weights_only=False)",
        "import pickle\npickle.loads(b'')",
        "import pickle\nclass U(pickle.Unpickler):\n    pass",
        "import yaml\nyaml.load('a: 1', Loader=yaml.Loader)",
        "import yaml\nyaml.unsafe_load('a: 1')",
        "eval('1')",
    ],
)
def test_the_scan_catches_each_unsafe_loader(snippet: str) -> None:
    assert unsafe_loaders(snippet), snippet


def test_the_scan_accepts_safe_calls() -> None:
    safe = (
        "import numpy as np, torch, yaml\n"
        "np.load('x.npy', allow_pickle=False)\n"
        "torch.load('x.pt', weights_only=True)\n"
        "yaml.load('a: 1', Loader=yaml.CSafeLoader)\n"
        "np.memmap('x.bin', dtype=np.uint16, mode='r')\n"
        "model.eval()\n"
    )
    assert unsafe_loaders(safe) == []


def test_no_unsafe_loader_in_the_source() -> None:
    assert len(SOURCES) > 40  # the scan sees the tree
    found = [hit for path in SOURCES for hit in unsafe_loaders(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []
