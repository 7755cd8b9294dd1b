"""The structure of a checkout, measured: what issue 29's closing note reports.

    python benchmarks/structure.py [ROOT ...]      # default: this checkout

Static, from every import (function-level ones too) of ``ROOT/framework``, read by the same walk that
tests/test_structure.py holds to the layers (``modules``, ``edges``): modules, lines, import
edges, import cycles (strongly connected groups of modules), the depth of the import graph (the
longest chain of modules, cycles collapsed) and, where ``tests/test_structure.py`` declares layers,
the imports that go up a layer.

Dynamic, from a real default run (``python train.py`` on CPU, in a subprocess with ROOT first on the
path): torch's global optimizer step pre-hook stops the run at its first optimizer step (over more than 100 elements: the launcher's optimizer
probe steps a 20-element stand-in first) and records
(a) the call stack at that moment, restricted to ROOT's own files: the longest path a newcomer follows
from ``train.py`` to the first step, in files and in lines of the functions on it; and (b) every
function of ROOT that ran before it (construction included), in files and lines.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from tests.test_structure import edges as import_edges  # noqa: E402  (the one import walk)
from tests.test_structure import modules as framework_modules  # noqa: E402


def _sccs(nodes: list[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    graph = {n: sorted(b for a, b in edges if a == n) for n in nodes}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    out.append(comp)
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]
                counter[0] += 1
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(graph[nxt])))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return out


def _depth(nodes: list[str], edges: set[tuple[str, str]], comps: list[list[str]]) -> int:
    """Longest chain of modules in the import graph with each cycle collapsed to one node."""
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    dag: dict[int, set[int]] = {i: set() for i in range(len(comps))}
    for a, b in edges:
        if comp_of[a] != comp_of[b]:
            dag[comp_of[a]].add(comp_of[b])
    memo: dict[int, int] = {}

    def longest(i: int) -> int:
        if i not in memo:
            memo[i] = 1 + max((longest(j) for j in dag[i]), default=0)
        return memo[i]

    sys.setrecursionlimit(10_000)
    return max(longest(i) for i in dag)


def _upward(root: Path, edges: set[tuple[str, str]]) -> int | None:
    """Imports from a lower layer to a higher one, by the layer list the checkout's own test declares."""
    test = root / "tests" / "test_structure.py"
    if not test.exists():
        return None
    ns: dict = {}
    for node in ast.parse(test.read_text()).body:  # the constants only: LAYERS, FACES, IN_MODELS
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("LAYERS", "FACES", "IN_MODELS"):
                ns[node.targets[0].id] = ast.literal_eval(node.value)
    layers, faces, in_models = ns.get("LAYERS", []), ns.get("FACES", set()), ns.get("IN_MODELS", set())

    def layer(m: str) -> str | None:
        parts = m.split(".")
        if len(parts) < 2:
            return None
        if parts[1] in in_models:
            return "models"
        if len(parts) == 2 and parts[1] in faces:
            return "faces"
        return parts[1]

    rank = {name: i for i, name in enumerate(layers)}
    return sum(
        1 for a, b in edges if layer(a) in rank and layer(b) in rank and rank[layer(b)] > rank[layer(a)]
    )


def static(root: Path) -> dict:
    mods = framework_modules(root)
    edges = {(name, target) for name, _, target, _ in import_edges(root)}
    comps = _sccs(sorted(mods), edges)
    cycles = [sorted(c) for c in comps if len(c) > 1]
    top = [m for m in mods if m.count(".") == 1 and mods[m].name != "__init__.py"]
    return {
        "modules": len(mods),
        "flat modules in framework/": len(top),
        "lines": sum(len(p.read_text().splitlines()) for p in mods.values()),
        "import edges": len(edges),
        "import cycles": len(cycles),
        "depth (modules)": _depth(sorted(mods), edges, comps),
        "upward imports": _upward(root, edges),
    }


PROBE = r"""
import inspect, json, os, runpy, sys, torch
root = os.path.realpath(sys.argv[1]); out = sys.argv[2]
ran = {}
def inside(name):
    return not name.startswith("<") and os.path.realpath(name).startswith(root + os.sep)
def prof(frame, event, arg):
    if event == "call":
        co = frame.f_code
        f = os.path.realpath(co.co_filename)
        if inside(co.co_filename) and (co.co_filename, co.co_firstlineno) not in ran:
            ran[(co.co_filename, co.co_firstlineno)] = (f, co.co_name)
def lines(f, first, name):
    try:
        src = open(f).read().splitlines()
        import ast
        for n in ast.walk(ast.parse("\n".join(src))):
            if getattr(n, "lineno", None) == first and hasattr(n, "end_lineno") and \
               isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                return n.end_lineno - n.lineno + 1
        return len(src) if name == "<module>" else 1
    except Exception:
        return 1
class Stop(BaseException):
    pass
def hook(opt, args, kwargs):
    if sum(p.numel() for g in opt.param_groups for p in g["params"]) <= 100:
        return  # the launcher's optimizer probe (a 20-element stand-in), not training
    sys.setprofile(None)
    stack = []
    for fi in inspect.stack():
        f = os.path.realpath(fi.filename)
        if inside(fi.filename) and fi.function != "<module>":
            code = fi.frame.f_code
            stack.append((f, code.co_firstlineno, getattr(code, "co_qualname", fi.function)))
    stack = stack[::-1]
    rel = lambda f: os.path.relpath(f, root)
    res = {
        "path": [f"{rel(f)}:{l} {n}" for f, l, n in stack],
        "path files": len({f for f, _, _ in stack}),
        "path lines": sum(lines(f, l, n.rpartition('.')[2]) for f, l, n in stack),
        "ran files": len({f for f, _ in ran.values()}),
        "ran functions": len(ran),
        "ran lines": sum(lines(f, l, n) for (_, l), (f, n) in ran.items()),
    }
    json.dump(res, open(out, "w"))
    raise Stop
from torch.optim.optimizer import register_optimizer_step_pre_hook
register_optimizer_step_pre_hook(hook)
sys.argv = ["train.py"] + sys.argv[3:]
os.chdir(root)
sys.setprofile(prof)
try:
    runpy.run_path(os.path.join(root, "train.py"), run_name="__main__")
except Stop:
    pass
except SystemExit:
    pass
"""


def dynamic(root: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "path.json"
        env = {**os.environ, "PYTHONPATH": str(root), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-c", PROBE, str(root), str(out), f"hydra.run.dir={tmp}/run"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if not out.exists():
            raise SystemExit(
                f"{root}: the default run stopped before its first optimizer step:\n{proc.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


def main(roots: list[Path]) -> None:
    rows = {str(r): {**static(r), **dynamic(r)} for r in roots}
    keys = [k for k in next(iter(rows.values())) if k != "path"]
    width = max(len(k) for k in keys)
    print(f"{'':{width}}  " + "  ".join(f"{r:>24}" for r in rows))
    for k in keys:
        print(f"{k:{width}}  " + "  ".join(f"{str(v[k]):>24}" for v in rows.values()))
    for r, v in rows.items():
        print(f"\n{r}: the path from train.py to the first optimizer step")
        for step in v["path"]:
            print("  " + step)


if __name__ == "__main__":
    main([Path(a).resolve() for a in sys.argv[1:]] or [HERE])
