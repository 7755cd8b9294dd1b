"""How far the config travels: follow ``cfg`` from ``framework.launch.entry.run_job`` through the calls
that pass it (or a value computed from it), and count the files entered; and count the call sites of
the planner's resolving functions. A static measure (issue 29's closing note), read from the AST:

    python benchmarks/cfg_flow.py [ROOT]

A name is carried when it is a parameter that got the config, or is assigned from an expression that
reads a carried name (``job = prepare(dcfg, ...)``, ``cfg = job.cfg``). A call carries it on when an
argument reads a carried name and the callee is a framework function found by name: imported
(``from framework.x import f``, ``import framework.x as m; m.f``), of the same module, a class
(its ``__init__``) or ``self.method``. Calls through other objects are not followed, so the counts are
a lower bound. "Re-entries": calls from one file into another file the walk had already entered.

Last, issue 41's counts: the rank-side files that read the root run config (read from the AST: a
file that names the ``Config`` root or a ``DictConfig``, or reads a root group, ``cfg.train`` or
``p.cfg.data``, off a name bound to it), listed; and the lines that read each derived value there
(``framework.config.run_values`` derives them once).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

RESOLVERS = ("fixed_degrees", "resolve_batch", "make_plan", "resolve", "load_plan")


@dataclass
class Func:
    module: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    cls: str | None = None

    @property
    def params(self) -> list[str]:
        a = self.node.args
        names = [p.arg for p in (*a.posonlyargs, *a.args)]
        return names[1:] if self.cls is not None else names

    @property
    def kwonly(self) -> list[str]:
        return [p.arg for p in self.node.args.kwonlyargs]


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    funcs: dict[str, Func] = field(default_factory=dict)  # "f", "Class.method"
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # alias -> (module, name)


def load(root: Path) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for p in sorted((root / "framework").rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        m = Module(".".join(parts), p, ast.parse(p.read_text()))
        for n in m.tree.body:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                m.funcs[n.name] = Func(m.name, n)
            elif isinstance(n, ast.ClassDef):
                for f in n.body:
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                        m.funcs[f"{n.name}.{f.name}"] = Func(m.name, f, n.name)
        for n in ast.walk(m.tree):  # function-level imports too
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("framework"):
                for a in n.names:
                    m.imports[a.asname or a.name] = (n.module, a.name)
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.startswith("framework"):
                        m.imports[a.asname or a.name] = (a.name, None)
        mods[m.name] = m
    return mods


def target(mods: dict[str, Module], here: Func, call: ast.Call) -> Func | None:
    """The framework function ``call`` runs, when it can be told by name."""
    m, f = mods[here.module], call.func
    if isinstance(f, ast.Name):
        if f.id in m.funcs:
            return m.funcs[f.id]
        if f"{f.id}.__init__" in m.funcs:
            return m.funcs[f"{f.id}.__init__"]
        if f.id in m.imports:
            return lookup(mods, *m.imports[f.id])
    elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        base = f.value.id
        if base == "self" and here.cls is not None:
            return m.funcs.get(f"{here.cls}.{f.attr}")
        if base in m.imports:
            mod, name = m.imports[base]
            module = mod if name is None else f"{mod}.{name}"
            return lookup(mods, module, f.attr)
    return None


def lookup(mods: dict[str, Module], module: str, name: str | None) -> Func | None:
    if name is None or module not in mods:
        sub = f"{module}.{name}" if name else module
        return None if sub not in mods else None
    m = mods[module]
    if name in m.funcs:
        return m.funcs[name]
    if f"{name}.__init__" in m.funcs:
        return m.funcs[f"{name}.__init__"]
    if name in m.imports:  # re-exported
        return lookup(mods, *m.imports[name])
    return None


def reads(expr: ast.AST, carried: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in carried for n in ast.walk(expr))


def carried_names(func: Func, params: set[str]) -> set[str]:
    carried = set(params)
    for _ in range(10):  # to a fixpoint
        before = len(carried)
        for n in ast.walk(func.node):
            value, targets = None, []
            if isinstance(n, ast.Assign):
                value, targets = n.value, n.targets
            elif isinstance(n, ast.AnnAssign | ast.AugAssign) and n.value is not None:
                value, targets = n.value, [n.target]
            elif isinstance(n, ast.For):
                value, targets = n.iter, [n.target]
            elif isinstance(n, ast.withitem) and n.optional_vars is not None:
                value, targets = n.context_expr, [n.optional_vars]
            if value is not None and reads(value, carried):
                for t in targets:
                    carried |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
        if len(carried) == before:
            return carried
    return carried


def walk(
    mods: dict[str, Module], start: Func, params: set[str], reached: set[str] | None = None
) -> tuple[list[str], int]:
    """Files entered, in order, and the calls into a file already entered before; ``reached``
    takes the name of every function the config reaches."""
    entered: list[str] = [start.module]
    seen: set[tuple[int, frozenset[str]]] = set()
    reentries = 0
    stack = [(start, frozenset(params))]
    while stack:
        func, got = stack.pop()
        if (id(func.node), got) in seen:
            continue
        seen.add((id(func.node), got))
        if reached is not None:
            reached.add(f"{func.module}.{func.node.name}")
        carried = carried_names(func, set(got))
        for call in (n for n in ast.walk(func.node) if isinstance(n, ast.Call)):
            callee = target(mods, func, call)
            if callee is None:
                continue
            names = callee.params
            passed = {names[i] for i, a in enumerate(call.args) if i < len(names) and reads(a, carried)}
            passed |= {k.arg for k in call.keywords if k.arg and reads(k.value, carried)}
            if not passed:
                continue
            if callee.module != func.module:
                if callee.module in entered:
                    reentries += 1
                else:
                    entered.append(callee.module)
            stack.append((callee, frozenset(passed)))
    return entered, reentries


def call_sites(root: Path) -> dict[str, dict[str, int]]:
    """Per resolving function of the planner: its calls, by file (definitions and imports are not
    calls; a bare ``resolve(...)`` counts only where it was imported from framework.planner.resolve)."""
    out: dict[str, dict[str, int]] = {name: {} for name in RESOLVERS}
    for p in sorted([*(root / "framework").rglob("*.py"), *(root / "benchmarks").glob("*.py")]):
        if p.name == "cfg_flow.py":
            continue
        tree = ast.parse(p.read_text())
        planner_resolve = p.name == "resolve.py" and p.parent.name == "planner" or any(
            isinstance(n, ast.ImportFrom)
            and n.module == "framework.planner.resolve"
            and any(a.name == "resolve" for a in n.names)
            for n in ast.walk(tree)
        )
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            if isinstance(f, ast.Name):
                name = f.id
            elif isinstance(f, ast.Attribute) and f.attr != "resolve":
                name = f.attr
            else:
                name = None
            if name in out and (name != "resolve" or planner_resolve):
                rel = str(p.relative_to(root))
                out[name][rel] = out[name].get(rel, 0) + 1
    return out


def planner_reach(mods: dict[str, Module], module: str, func: str, params: set[str]) -> list[str]:
    """The planner functions the config reaches from ``module.func`` (a rank's start)."""
    reached: set[str] = set()
    walk(mods, mods[module].funcs[func], params, reached)
    return sorted(f for f in reached if f.startswith("framework.planner."))


# Issue 41's counts: the rank side is framework/ outside the packages that run before the ranks start
# (config, launch, planner).
LAUNCH_SIDE = ("config", "launch", "planner")
# The root config's types, and the names a root config is bound to (``cfg``, ``config``, ``dcfg``,
# ``p.cfg``, ``run.cfg``): a ``ModelConfig`` named ``cfg`` has none of the root's groups.
ROOT_TYPES = ("Config", "DictConfig")
ROOT_NAMES = ("cfg", "config", "dcfg")
# A derived value read on the rank side off the config it is derived from (a train group,
# ``cfg.train.X``, ``train_cfg.X``, ``t = cfg.train; t.X``; the checkpoint dir), not off the record.
DERIVED = {
    "train.seq_len": r"(cfg\.train|train_cfg|\bt)\.seq_len\b",
    "train.micro_batch_size": r"(cfg\.train|train_cfg|\bt)\.micro_batch_size\b",
    "train.global_batch_size": r"(cfg\.train|train_cfg|\bt)\.global_batch_size\b",
    "checkpoint root (from checkpoint.dir)": r"Path\(cfg\.checkpoint\.dir\)",
    "gradient accumulation (from the plan)": r"\bplan\.grad_accum_steps\b",
    "data shard count (from the plan)": r"\bplan\.dp_degree\b",
    "rows per data shard (global batch // dp size)": r"global_batch_size\s*//\s*(self\.)?dp_size",
    "compute dtype (from the device)": r"\bcompute_dtype\(",
}


def root_groups(root: Path) -> set[str]:
    """The root ``Config``'s fields (its groups), from framework/config/schema.py's text."""
    tree = ast.parse((root / "framework" / "config" / "schema.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _bound_to_root(expr: ast.AST) -> bool:
    return (isinstance(expr, ast.Name) and expr.id in ROOT_NAMES) or (
        isinstance(expr, ast.Attribute) and expr.attr == "cfg"
    )


def reads_root(tree: ast.Module, groups: set[str]) -> int:
    """How many places of ``tree`` read the root config: its type named, or a root group read off a
    name bound to it."""
    n = 0
    for x in ast.walk(tree):
        if isinstance(x, ast.Name) and x.id in ROOT_TYPES:
            n += 1
        elif isinstance(x, ast.Constant) and x.value in ROOT_TYPES:  # a string annotation
            n += 1
        elif isinstance(x, ast.Attribute) and x.attr in groups and _bound_to_root(x.value):
            n += 1
    return n


def rank_side_reads(root: Path) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """({rank-side file reading the root config: its reads}, {derived value: {file: lines reading it}})."""
    files = [
        p for p in sorted((root / "framework").rglob("*.py"))
        if p.relative_to(root / "framework").parts[0] not in LAUNCH_SIDE
    ]  # fmt: skip
    texts = {str(p.relative_to(root)): p.read_text() for p in files}
    groups = root_groups(root)
    readers = {f: n for f, t in texts.items() if (n := reads_root(ast.parse(t), groups))}
    out: dict[str, dict[str, int]] = {}
    for name, pattern in DERIVED.items():
        rx = re.compile(pattern)
        counts = {f: sum(1 for ln in t.splitlines() if rx.search(ln)) for f, t in texts.items()}
        out[name] = {f: n for f, n in counts.items() if n}
    return readers, out


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    mods = load(root)
    entered, reentries = walk(mods, mods["framework.launch.entry"].funcs["run_job"], {"dcfg"})
    print(f"cfg from launch.entry.run_job enters {len(entered)} files; {reentries} calls re-enter one")
    trainer = mods["framework.train.trainer"].funcs["run"]
    reach = planner_reach(mods, "framework.train.trainer", "run", set(trainer.params) - {"run_dir", "keep"})
    print(f"from train.trainer.run (every rank) the config reaches {len(reach)} planner functions: {reach}")
    for name, files in call_sites(root).items():
        total = sum(files.values())
        inside = sum(v for k, v in files.items() if k.startswith("framework/"))
        print(f"{name}: {total} call sites ({inside} in framework/): {files}")
    readers, derived = rank_side_reads(root)
    print(f"rank-side files (framework/ outside {', '.join(LAUNCH_SIDE)}) reading the root config: {len(readers)}")
    for f, n in sorted(readers.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {f}: {n}")
    for name, files in derived.items():
        print(f"{name}: {sum(files.values())} rank-side lines in {len(files)} files: {files}")


if __name__ == "__main__":
    main()
