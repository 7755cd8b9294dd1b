"""torch.export at static shapes, after a pre-check that names every cause of dynamism.

Why a pre-check: ``torch.export.export`` stops at the first data-dependent guard, and a compile
graph break only shows up once ``torch.compile(fullgraph=True)`` fails at run time. A user fixing
a model wants the whole list at once, each with the submodule it lives in. Two real tools give it:

- ``torch._dynamo.explain`` runs the model once under Dynamo and returns every graph break with its
  user stack (the execution path is ``torch.compile(fullgraph=True)``, where each break is fatal);
- ``torch.export.draft_export`` keeps tracing past data-dependent errors and reports each one; the
  draft graph's nodes carry ``nn_module_stack``, which gives the exact module path of each
  occurrence (``block.0`` and ``block.1`` for one shared class).

Both are keyed by source location; a location seen by both is reported once.
"""

from __future__ import annotations

import inspect
import linecache
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.export import ExportedProgram

from framework.config.schema import FreezeConfig

Location = tuple[str, int]  # (absolute filename, line)


@dataclass(frozen=True)
class GraphIssue:
    """One cause of dynamism or one graph break, at one source line."""

    kind: str  # "graph break" | "data-dependent" | "export error"
    module_paths: tuple[str, ...]  # "" is the root module
    location: str  # "file.py:12 `if y.sum() > 0:`"
    detail: str

    def __str__(self) -> str:
        paths = ", ".join(p or "<root>" for p in self.module_paths) or "<unknown module>"
        return f"[{self.kind}] in {paths} at {self.location}: {self.detail}"


class StaticGraphError(ValueError):
    """The model cannot be frozen into one static graph; ``issues`` lists every cause found."""

    def __init__(self, issues: list[GraphIssue]) -> None:
        self.issues = issues
        body = "\n".join(f"  {i + 1}. {issue}" for i, issue in enumerate(issues))
        super().__init__(
            f"freeze=export: the model is not one static graph ({len(issues)} issue(s)); fix each "
            f"(make it branchless, torch.where / torch.cond, or move it out of forward):\n{body}"
        )


def _loc_str(loc: Location) -> str:
    code = linecache.getline(loc[0], loc[1]).strip()
    return f"{os.path.basename(loc[0])}:{loc[1]} `{code}`"


def _method_lines(model: nn.Module) -> list[tuple[str, str, range]]:
    """(module path, filename, line range) of every Python method defined by each submodule's class."""
    out = []
    for path, mod in model.named_modules():
        for cls in type(mod).__mro__:
            if cls in (nn.Module, object) or cls.__module__.startswith("torch.nn."):
                continue
            for fn in vars(cls).values():
                code = getattr(fn, "__code__", None)
                if code is None:
                    continue
                try:
                    n = len(inspect.getsourcelines(fn)[0])
                except (OSError, TypeError):
                    continue
                out.append(
                    (
                        path,
                        os.path.abspath(code.co_filename),
                        range(code.co_firstlineno, code.co_firstlineno + n),
                    )
                )
    return out


def _paths_by_class(model: nn.Module, loc: Location) -> tuple[str, ...]:
    """Fallback when no graph node names the module: every instance whose class holds that line."""
    hits = [p for p, f, lines in _method_lines(model) if f == loc[0] and loc[1] in lines]
    return tuple(dict.fromkeys(hits))


class _Traced(Exception):  # noqa: N818 - a signal, not an error
    """Raised by the function ``_trace_only`` compiles: the graph was captured whole; nothing ran."""


def _trace_only(_gm: torch.fx.GraphModule, _example_inputs: list) -> object:
    def run(*_args: object) -> None:
        raise _Traced

    return run


def _fullgraph_break(model: nn.Module, example_inputs: tuple) -> BaseException | None:
    """What ``torch.compile(model, fullgraph=True)`` meets, without running the graph it captures:
    None when the model is one graph, else the error of its first graph break. Not running it is
    what lets a meta-device model with data-dependent sizes (an MoE layer's per-expert counts,
    captured as unbacked sizes) be checked: there is no data to run them on."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        torch.compile(model, fullgraph=True, dynamic=False, backend=_trace_only)(*example_inputs)
    except _Traced:
        return None
    except Exception as e:  # noqa: BLE001 - any failure to capture one graph is a finding
        return e
    finally:
        torch._dynamo.reset()
    return None


def _graph_breaks(model: nn.Module, example_inputs: tuple) -> list[tuple[Location, str]]:
    """Every Dynamo graph break (innermost user frame, first line of the reason).

    First the model is traced as ``torch.compile(fullgraph=True)`` traces it (``_fullgraph_break``);
    only when that breaks does ``explain`` list every break: it runs the model once for real (the
    code between the breaks too) and resets Dynamo's caches, so call it before compiling. Where it
    cannot run (a data-dependent value on the meta device), the first break is the one reported.
    """
    import torch._dynamo

    first = _fullgraph_break(model, example_inputs)
    if first is None:
        return []
    try:
        explanation = torch._dynamo.explain(model)(*example_inputs)
    except Exception:  # noqa: BLE001 - explain could not run the model: report the break we have
        return [(_first_user_frame(first), str(first).strip().splitlines()[0] if str(first).strip() else "")]
    out = []
    for reason in explanation.break_reasons:
        if not reason.user_stack:
            continue
        frame = reason.user_stack[-1]
        out.append(
            ((os.path.abspath(frame.filename), int(frame.lineno)), reason.reason.strip().splitlines()[0])
        )
    return out


def _first_user_frame(error: BaseException) -> Location:
    """The innermost frame outside torch of a Dynamo error's user stack (``<torch.compile>`` if none)."""
    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(getattr(error, "real_stack", None) or []):
        if not os.path.abspath(frame.filename).startswith(torch_dir):
            return (os.path.abspath(frame.filename), int(frame.lineno or 0))
    return ("<torch.compile>", 0)


def _innermost_user_frame(stack: list[dict], filenames: dict[int, str]) -> Location | None:
    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(stack):
        name = filenames.get(frame["filename"], frame["filename"])
        if isinstance(name, str) and not name.startswith(torch_dir):
            return (os.path.abspath(name), int(frame["line"]))
    return None


def _data_dependent(
    model: nn.Module, example_inputs: tuple
) -> tuple[list[tuple[Location, str]], dict[Location, list[str]]]:
    """draft_export's failures by location, and the module paths of draft-graph nodes at each location."""
    from torch._logging.structured import INTERN_TABLE

    ep = torch.export.draft_export(model, example_inputs)
    report = ep._report  # DraftExportReport: the documented result of draft_export
    # The report's file table only holds names first seen in this call (torch interns each file
    # name once per process); the process-wide intern table has them all.
    filenames = {i: name for name, i in INTERN_TABLE.items()} | report.str_to_filename
    found = []
    for failure in report.failures:
        data = failure.data if isinstance(failure.data, dict) else {}
        loc = _innermost_user_frame(data.get("user_stack", []), filenames)
        if loc is not None:
            expr = data.get("expr", "")
            found.append((loc, f"{failure.failure_type.name.lower()}: cannot decide `{expr}` at trace time"))
    paths: dict[Location, list[str]] = {}
    for node in ep.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        trace = node.meta.get("stack_trace")
        if not stack or not trace:
            continue
        frame = traceback_last_frame(trace)
        if frame is not None:
            path = list(stack.values())[-1][0]
            paths.setdefault(frame, [])
            if path not in paths[frame]:
                paths[frame].append(path)
    return found, paths


def traceback_last_frame(stack_trace: str) -> Location | None:
    """(filename, line) of the last ``File "...", line N`` entry of a formatted stack trace."""
    for line in reversed(stack_trace.splitlines()):
        line = line.strip()
        if line.startswith('File "') and ", line " in line:
            name, rest = line[len('File "') :].split('", line ', 1)
            return (os.path.abspath(name), int(rest.split(",", 1)[0]))
    return None


def _merge(
    model: nn.Module,
    sources: Iterable[tuple[str, list[tuple[Location, str]]]],
    paths: dict[Location, list[str]],
) -> list[GraphIssue]:
    seen: dict[Location, GraphIssue] = {}
    for kind, items in sources:
        for loc, detail in items:
            if loc in seen:
                continue
            mods = tuple(paths.get(loc, ())) or _paths_by_class(model, loc)
            seen[loc] = GraphIssue(kind, mods, _loc_str(loc), detail)
    return list(seen.values())


def find_graph_issues(
    model: nn.Module, example_inputs: tuple, export_error: BaseException | None, check_graph_breaks: bool
) -> list[GraphIssue]:
    """Every graph break (if asked) and, after a failed export, every data-dependent cause."""
    breaks = _graph_breaks(model, example_inputs) if check_graph_breaks else []
    dd: list[tuple[Location, str]] = []
    paths: dict[Location, list[str]] = {}
    draft_error: BaseException | None = None
    if export_error is not None:
        try:
            dd, paths = _data_dependent(model, example_inputs)
        except Exception as e:  # noqa: BLE001 - draft export itself failed; report why below
            draft_error = e
    export_items: list[tuple[Location, str]] = []
    if export_error is not None:
        text = str(export_error).strip()
        first = f"{type(export_error).__name__}: {text.splitlines()[0] if text else ''}"
        loc = traceback_last_frame(text)
        if loc is not None:
            export_items.append((loc, first))
    sources = [("data-dependent", dd), ("export error", export_items), ("graph break", breaks)]
    issues = _merge(model, sources, paths)
    if export_error is not None and not issues:
        detail = first
        if draft_error is not None:
            detail += f" (draft_export also failed: {type(draft_error).__name__}: {draft_error})"
        issues.append(GraphIssue("export error", (), "<torch.export>", detail))
    return issues


def export_model(model: nn.Module, example_inputs: tuple, cfg: FreezeConfig) -> torch.export.ExportedProgram:
    """``torch.export.export`` at the shapes of ``example_inputs`` (no dynamic dims).

    ``cfg.strict`` is torch.export's ``strict`` (trace with Dynamo instead of running Python).
    With ``cfg.check_graph_breaks`` the model also runs once under ``torch._dynamo.explain``, so a
    break that ``torch.compile(fullgraph=True)`` would hit later is reported now.
    Raises StaticGraphError (a ValueError) listing every issue with its module path.
    """
    meta_params = any(p.is_meta for p in model.parameters())
    meta_inputs = all(t.is_meta for t in example_inputs if isinstance(t, torch.Tensor))
    if meta_params and not meta_inputs:
        raise ValueError(
            "freeze: the model is on the meta device but the example inputs are not: pass meta inputs "
            "(the graph is traced with fake tensors, no weights are needed) or materialize the model"
        )
    ep: ExportedProgram | None = None
    error: BaseException | None = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
        try:
            ep = torch.export.export(model, tuple(example_inputs), strict=cfg.strict)
        except Exception as e:  # noqa: BLE001 - every export failure goes into the issue report
            error = e
        if error is not None or cfg.check_graph_breaks:
            issues = find_graph_issues(model, tuple(example_inputs), error, cfg.check_graph_breaks)
            if issues:
                raise StaticGraphError(issues) from error
    assert ep is not None
    return ep
