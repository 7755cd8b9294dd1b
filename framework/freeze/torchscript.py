"""Legacy TorchScript path (``freeze=script`` / ``freeze=trace``): deprecated upstream, kept for old
deployments. The static graph of this framework is torch.export; this path warns once.

``freeze.ignore`` and ``freeze.export_methods`` use TorchScript's own mechanisms: the named methods
get exactly the markers ``@torch.jit.ignore`` / ``@torch.jit.export`` set, on a per-instance
subclass, so the user's classes are not modified and the originals are restored after scripting.

Fingerprint namespace ``torchscript-v1``: a structural hash of the frozen TorchScript graph (node
kinds, output types, input positions, scalar constants). It is a different namespace from the
export fingerprint; the two are never comparable.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from framework.config.schema import FreezeConfig

TS_NAMESPACE = "torchscript-v1"
_MANGLE = re.compile(r"___torch_mangle_\d+\.")


def warn_deprecated(mode: str) -> None:
    """Warn (once per process, Python's default filter for a fixed call site) that TorchScript is legacy."""
    warnings.warn(
        f"freeze.mode={mode} uses TorchScript, which is deprecated upstream; use freeze=export "
        "(torch.export) for the artifact and executor=compile for execution",
        FutureWarning,
        stacklevel=3,
    )


@contextmanager
def _quiet_torch_deprecations() -> Iterator[None]:
    # torch.jit.* emits one deprecation warning per scripted function; ours above says it once.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit.*is deprecated")
        yield


def _split(model: nn.Module, entry: str) -> tuple[nn.Module, str]:
    """A ``freeze.ignore`` / ``export_methods`` entry -> (module, method name)."""
    modules = dict(model.named_modules())
    if entry in modules and entry != "":
        return modules[entry], "forward"
    owner, _, name = entry.rpartition(".")
    if owner in modules and callable(getattr(type(modules[owner]), name, None)):
        return modules[owner], name
    raise ValueError(
        f"freeze entry {entry!r} names neither a submodule nor a method of one; valid: a submodule path "
        f"(e.g. {next((n for n in modules if n), '<none>')!r}) or 'path.method' / 'method' for the root"
    )


def _marked(fn: Callable[..., Any], marker: Callable[[Any], Any]) -> Callable[..., Any]:
    """A copy of ``fn`` carrying the marker, so the user's class is left untouched.

    A copy (same code, globals, closure, annotations) rather than a wrapper: TorchScript resolves
    string annotations (``from __future__ import annotations``) through the function's globals.
    """
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    copy.__doc__ = fn.__doc__
    return marker(copy)


@contextmanager
def _marks(model: nn.Module, ignore: list[str], export_methods: list[str]) -> Iterator[None]:
    """Apply @torch.jit.ignore / @torch.jit.export markers to single instances, then restore them."""
    per_module: dict[int, tuple[nn.Module, dict[str, Callable[..., Any]]]] = {}
    for entries, marker in ((ignore, torch.jit.ignore), (export_methods, torch.jit.export)):
        for entry in entries:
            mod, name = _split(model, entry)
            ns = per_module.setdefault(id(mod), (mod, {}))[1]
            ns[name] = _marked(getattr(type(mod), name), marker)
    originals = []
    for mod, ns in per_module.values():
        originals.append((mod, type(mod)))
        mod.__class__ = type(type(mod).__name__, (type(mod),), ns)
    try:
        yield
    finally:
        for mod, cls in originals:
            mod.__class__ = cls


def _user_frame(exc: BaseException) -> str:
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
    f = frames[-1] if frames else None
    return f"{os.path.basename(f.filename)}:{f.lineno} `{(f.line or '').strip()}`" if f else "<unknown>"


def script_model(model: nn.Module, cfg: FreezeConfig) -> torch.jit.ScriptModule:
    """``torch.jit.script`` with ``cfg.ignore`` / ``cfg.export_methods``; ValueError naming the construct."""
    warn_deprecated("script")
    with _quiet_torch_deprecations(), _marks(model, cfg.ignore, cfg.export_methods):
        try:
            return torch.jit.script(model)
        except torch.jit.frontend.FrontendError as e:
            raise ValueError(f"freeze=script: TorchScript cannot compile this construct:\n{e}") from e
        except RuntimeError as e:
            raise ValueError(
                f"freeze=script: TorchScript cannot compile the model; list the offending submodule or "
                f"method in freeze.ignore, or use freeze=export:\n{e}"
            ) from e


def trace_model(model: nn.Module, example_inputs: tuple, cfg: FreezeConfig) -> torch.jit.ScriptModule:
    """``torch.jit.trace`` of ``forward``; ValueError naming the failing line and why."""
    warn_deprecated("trace")
    if cfg.ignore or cfg.export_methods:
        raise ValueError(
            f"freeze.ignore={cfg.ignore} / freeze.export_methods={cfg.export_methods} need freeze=script; "
            "trace records forward only"
        )
    with _quiet_torch_deprecations():
        try:
            return torch.jit.trace(model, tuple(example_inputs))
        except (TypeError, RuntimeError) as e:
            raise ValueError(
                f"freeze=trace: torch.jit.trace failed at {_user_frame(e)}: {e}. Under tracing, shape "
                "reads are traced tensors, so Python values computed from shapes (a bool passed to "
                "enable_gqa, an int used for control flow) become Tensors; use freeze=script or "
                "freeze=export"
            ) from e


def freeze_torchscript(module: torch.jit.ScriptModule, cfg: FreezeConfig) -> torch.jit.ScriptModule:
    """``torch.jit.freeze`` for inference: weights inlined as constants, ``export_methods`` kept."""
    with _quiet_torch_deprecations():
        return torch.jit.freeze(module.eval(), preserved_attrs=list(cfg.export_methods))


def _type(v: torch._C.Value) -> str:
    return _MANGLE.sub("", str(v.type()))


def _nodes(block: Any, pos: dict[Any, int], out: list[tuple]) -> None:
    for node in block.nodes():
        inputs = tuple(pos.get(i, -1) for i in node.inputs())
        const = None
        if node.kind() == "prim::Constant" and node.outputsSize() == 1:
            ival = node.output().toIValue()
            const = ival if isinstance(ival, (bool, int, float, str)) or ival is None else type(ival).__name__
        out.append((node.kind(), inputs, tuple(_type(o) for o in node.outputs()), const))
        for o in node.outputs():
            pos[o] = len(pos)
        for sub in node.blocks():
            for v in sub.inputs():  # loop counters and carried values
                pos[v] = len(pos)
            _nodes(sub, pos, out)


def ts_summary(module: torch.jit.ScriptModule) -> list[tuple]:
    """Canonical node list of ``module.forward``'s graph: (kind, input positions, output types, const)."""
    graph = module.graph
    pos = {v: i for i, v in enumerate(graph.inputs())}
    out: list[tuple] = [("input", (), tuple(_type(v) for v in graph.inputs()), None)]
    _nodes(graph, pos, out)
    out.append(("return", tuple(pos.get(v, -1) for v in graph.outputs()), (), None))
    return out


def ts_fingerprint(module: torch.jit.ScriptModule) -> str:
    doc = json.dumps({"namespace": TS_NAMESPACE, "nodes": ts_summary(module)}, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()
