"""Line numbers in the docs that follow the code: every ``FILE.py:LINE NAME`` in docs/architecture.md.

Why: a map that says ``framework/train/trainer.py:205 train`` is worth reading only while line 205 is
where ``train`` starts, and every edit above it moves it. The name is the reference; the line is
derived from it (``python -m framework.docs`` rewrites it, ``--check`` and the test suite fail while
one is stale), so nobody keeps line numbers by hand. A name that no longer exists in its file
raises: the map must be edited, by a person, to the code's new shape.

``NAME`` is a function, class or module-level assignment of ``FILE``, dotted through classes and
functions as Python's ``__qualname__`` is (``StepRunner.step``, ``StepRunner.step.<locals>.attempt``);
the line is its ``def`` / ``class`` line (after decorators) or the assignment's first line.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "docs" / "architecture.md",)

# A path under the repository root, a line, a dotted name.
REF = re.compile(
    r"(?<![\w/])((?:framework|tests|benchmarks)/[\w/]+\.py|train\.py):(\d+) "
    r"([A-Za-z_]\w*(?:\.(?:<locals>|[A-Za-z_]\w*))*)"
)


@functools.cache
def _definitions(path: Path, mtime: float) -> dict[str, int]:
    """Every qualified name defined in the file, with its line. ``mtime`` keys the cache."""
    tree = ast.parse(path.read_text(), str(path))
    out: dict[str, int] = {}

    def walk(body: list[ast.stmt], prefix: str, in_function: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + node.name
                out.setdefault(name, node.lineno)
                inner = name + (".<locals>." if not isinstance(node, ast.ClassDef) else ".")
                walk(node.body, inner, not isinstance(node, ast.ClassDef))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not in_function:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        out.setdefault(prefix + t.id, node.lineno)

    walk(tree.body, "", False)
    return out


def line_of(file: str, name: str) -> int:
    """The line where ``name`` is defined in ``file`` (relative to the root); ValueError when the
    file or the name is gone."""
    path = ROOT / file
    if not path.is_file():
        raise ValueError(f"{file}:{name}: no such file")
    found = _definitions(path, path.stat().st_mtime).get(name)
    if found is None:
        raise ValueError(f"{file}: no definition of {name} (edit the reference to the code's new shape)")
    return found


def render(page: str) -> str:
    """``page`` with the line of every ``FILE.py:LINE NAME`` set to where NAME is defined now."""
    return REF.sub(lambda m: f"{m.group(1)}:{line_of(m.group(1), m.group(3))} {m.group(3)}", page)


def references(page: str) -> list[tuple[str, int, str]]:
    """(file, line as written, name) of every reference of the page."""
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in REF.finditer(page)]
