"""The packages stand in layers and import only downward (the order is framework/__init__.py's docstring).

Every import of every module is read with ``ast``, function-level imports too: an import from a lower
layer up to a higher one fails, naming the file, the line and the import; so does any cycle of modules.
The same walk (``modules``, ``edges``, for any checkout's root) is what benchmarks/structure.py counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "framework"

# ground first; a module imports its own package or one earlier in this list
LAYERS = [
    "config", "record", "kernels", "models", "data", "planner", "freeze",
    "parallel", "checkpoint", "verify", "train", "generate", "launch", "faces",
]
FACES = {"worker", "recipes", "docs", "plots", "__main__"}  # `python -m framework[.X]` kept at its old name

# The imports still to be cut (issue 29), each with what is left to do. The list may only shrink: an
# entry that no longer occurs fails too, so that it is struck.
KNOWN: dict[tuple[str, str], str] = {}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of ``root/framework`` by its dotted name (a package by its ``__init__``)."""
    return {module_name(p, root): p for p in sorted((root / "framework").rglob("*.py"))}


def layer_of(module: str) -> str | None:
    """The layer of ``framework.X...``; None for the package itself."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    head = parts[1]
    if len(parts) == 2 and head in FACES:
        return "faces"
    return head


def imports(path: Path, name: str, known: dict[str, Path]) -> list[tuple[int, str, str]]:
    """(line, imported framework module, source text) for every import in the file."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != "framework" and target != name:
                out.append((node.lineno, target, ast.get_source_segment(source, node) or ""))
    return out


def edges(root: Path = ROOT) -> list[tuple[str, int, str, str]]:
    """(module, line, imported module, source text) for every import inside ``root/framework``."""
    known = modules(root)
    return [(name, line, target, text) for name, path in known.items() for line, target, text in
            imports(path, name, known)]


def test_every_module_has_a_layer() -> None:
    unknown = sorted({m for m in modules() if layer_of(m) is not None and layer_of(m) not in LAYERS})
    assert not unknown, f"modules outside every layer (add them to a package or to LAYERS): {unknown}"


def test_imports_only_run_down_the_layers() -> None:
    upward = []
    for name, line, target, text in edges():
        src, dst = layer_of(name), layer_of(target)
        if (name, target) in KNOWN:
            continue
        if src in LAYERS and dst in LAYERS and LAYERS.index(dst) > LAYERS.index(src):
            path = modules()[name].relative_to(ROOT)
            upward.append(f"{path}:{line}: {text.strip()} ({src} imports {dst}, a higher layer)")
    assert not upward, "imports from a lower layer up to a higher one:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, as a closed list of nodes, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for name, _, target, _ in edges():
        src, dst = layer_of(name), layer_of(target)
        if src and dst and src != dst and (name, target) not in KNOWN:
            graph.setdefault(src, set()).add(dst)
    assert find_cycle(graph) is None, f"packages import each other in a loop: {find_cycle(graph)}"


def test_no_cycle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for name, line, target, text in edges():
        if (name, target) in KNOWN:
            continue
        graph.setdefault(name, set()).add(target)
        where.setdefault((name, target), f"{modules()[name].relative_to(ROOT)}:{line}: {text.strip()}")
    cycle = find_cycle(graph)
    assert cycle is None, "modules import each other in a loop:\n" + "\n".join(
        where[(a, b)] for a, b in zip(cycle, cycle[1:], strict=False))


def test_every_known_exception_still_occurs() -> None:
    seen = {(name, target) for name, _, target, _ in edges()}
    gone = sorted(set(KNOWN) - seen)
    assert not gone, f"cut already: strike these from KNOWN: {gone}"


def test_find_cycle_sees_a_loop_and_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None


REPO_WIDE = {"test_benchmarks.py", "test_docs.py", "test_structure.py", "test_suite.py"}  # tests of the repository itself, not of one layer


def test_tests_mirror_the_layers() -> None:
    """A layer's tests live in ``tests/<layer>/``; only the repository-wide ones stay at the top."""
    top = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert top == REPO_WIDE, f"move {sorted(top - REPO_WIDE)} into tests/<layer>/"
    folders = {p.parent.name for p in (ROOT / "tests").glob("*/test_*.py")}
    assert folders <= set(LAYERS), f"tests/{sorted(folders - set(LAYERS))}/ is not a layer of {LAYERS}"
