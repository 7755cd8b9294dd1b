"""Canonical structural fingerprint of an exported graph, its node list, and a readable diff.

Why structural and canonical: the verification step compares graphs across ranks, runs and machines.
Node names (``linear_3``), parameter FQNs (which change under FSDP/compile wrapping) and parameter
values (which change every step) must not enter the hash; what the graph *computes* must. Each node
is described by its op kind, its canonical operator name, the positions of its input nodes (edges
by position, never by name), its constant arguments, and its output shapes and dtypes. The summary
is made of JSON primitives and tuples only, so it survives a save/load round trip unchanged and
its sha256 is identical in every process.

Namespace: this is the *export* fingerprint (``EXPORT_NAMESPACE``). TorchScript graphs are hashed by
``framework.freeze.torchscript.ts_fingerprint`` in a different namespace; the two never compare equal.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram

EXPORT_NAMESPACE = "export-v1"

Summary = list[tuple]


def _target_name(node: fx.Node, input_kinds: dict[str, str]) -> str:
    if node.op == "placeholder":
        # The kind (parameter, buffer, user input ...) is structural; the name is not.
        return input_kinds.get(node.name, "input")
    if node.op in ("get_attr", "output"):
        return node.op
    t = node.target
    if isinstance(t, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return str(t.name()) if isinstance(t, torch._ops.OpOverload) else f"hop.{t.name()}"
    if isinstance(t, str):  # call_method / call_module on a plain fx graph
        return t if node.op == "call_method" else "module"
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', repr(t))}"


def _meta(val: Any) -> Any:
    """Output shape and dtype of a node, from the fake value export recorded in ``node.meta["val"]``."""
    if isinstance(val, torch.Tensor):
        return (tuple(int(s) if isinstance(s, int) else str(s) for s in val.shape), str(val.dtype))
    if isinstance(val, (list, tuple)):
        return tuple(_meta(v) for v in val)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym:{type(val).__name__}"
    if val is None or isinstance(val, (bool, int, float)):
        return val
    return type(val).__name__


def _arg(a: Any, pos: dict[fx.Node, int]) -> Any:
    """Arguments with node references replaced by the input node's position ``%i``."""
    if isinstance(a, fx.Node):
        return f"%{pos[a]}"
    if isinstance(a, (list, tuple)):
        return tuple(_arg(x, pos) for x in a)
    if isinstance(a, dict):
        return tuple((str(k), _arg(v, pos)) for k, v in sorted(a.items()))
    if a is None or isinstance(a, (bool, int, float)):
        return a
    if isinstance(a, str):
        return repr(a)  # quoted, so it never reads as a node reference
    if isinstance(a, torch.device):
        # The graph is the same computation on meta, CPU or CUDA: keep the device out of the hash.
        return "device"
    return str(a)  # dtype, device, layout, memory_format: their str is canonical


def _graph_and_kinds(obj: ExportedProgram | fx.GraphModule) -> tuple[fx.Graph, dict[str, str]]:
    if isinstance(obj, ExportedProgram):
        kinds = {
            s.arg.name: s.kind.name.lower() for s in obj.graph_signature.input_specs if hasattr(s.arg, "name")
        }
        return obj.graph, kinds
    if isinstance(obj, fx.GraphModule):
        return obj.graph, {}
    raise ValueError(f"expected an ExportedProgram or fx.GraphModule, got {type(obj).__name__}")


def graph_summary(obj: ExportedProgram | fx.GraphModule) -> Summary:
    """Canonical node list: one ``(op, target, args, out_meta)`` tuple per node, in graph order."""
    graph, kinds = _graph_and_kinds(obj)
    pos: dict[fx.Node, int] = {}
    out: Summary = []
    for i, node in enumerate(graph.nodes):
        pos[node] = i
        args = (_arg(node.args, pos), _arg(node.kwargs, pos))
        # The output node's own meta is set by deserialisation but not by export; its inputs carry it.
        meta = None if node.op == "output" else _meta(node.meta.get("val"))
        out.append((node.op, _target_name(node, kinds), args, meta))
    return out


def _canonical_json(summary: Summary, namespace: str) -> str:
    return json.dumps({"namespace": namespace, "nodes": summary}, separators=(",", ":"), sort_keys=True)


def summary_fingerprint(summary: Summary, namespace: str = EXPORT_NAMESPACE) -> str:
    return hashlib.sha256(_canonical_json(summary, namespace).encode()).hexdigest()


def graph_fingerprint(obj: ExportedProgram | fx.GraphModule) -> str:
    """sha256 of the canonical summary; equal for the same model code, config and input shapes."""
    return summary_fingerprint(graph_summary(obj))


def _op_counts(summary: Summary) -> Counter[str]:
    return Counter(n[1] for n in summary if n[0] == "call_function")


def graph_diff(a: Summary, b: Summary) -> str:
    """Human-readable difference: the first differing node (index, both sides) and operator counts.

    Returns "" when the summaries are equal.
    """
    if a == b:
        return ""
    lines = [f"graphs differ: {len(a)} vs {len(b)} nodes"]
    for i in range(max(len(a), len(b))):
        left = a[i] if i < len(a) else None
        right = b[i] if i < len(b) else None
        if left != right:
            lines.append(f"first differing node #{i}:\n  a: {left}\n  b: {right}")
            break
    ca, cb = _op_counts(a), _op_counts(b)
    for op in sorted(set(ca) | set(cb)):
        if ca[op] != cb[op]:
            delta = cb[op] - ca[op]
            lines.append(f"  {'+' if delta > 0 else '-'}{abs(delta)} {op} ({ca[op]} -> {cb[op]})")
    return "\n".join(lines)


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def save_fingerprint(path: Path, summary: Summary, namespace: str = EXPORT_NAMESPACE) -> None:
    """Write ``{"namespace", "fingerprint", "nodes"}`` as JSON, for a later reference check."""
    doc = {"namespace": namespace, "fingerprint": summary_fingerprint(summary, namespace), "nodes": summary}
    Path(path).write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")


def load_fingerprint(path: Path) -> tuple[str, Summary]:
    """Read a file written by ``save_fingerprint``; returns ``(fingerprint, summary)``.

    Raises ValueError when the file is not one (another JSON, not JSON: was a traceback mid-run) or
    the stored fingerprint does not match its own node list (a hand-edited or truncated file).
    """
    try:
        doc = json.loads(Path(path).read_text())
        summary = [_tuples(n) for n in doc["nodes"]]
        fp = summary_fingerprint(summary, doc["namespace"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(
            f"{path} is not a fingerprint.json written by freeze=export ({type(e).__name__}: {why})"
        ) from None
    if fp != doc["fingerprint"]:
        raise ValueError(
            f"{path}: stored fingerprint {doc['fingerprint']} does not match its node list ({fp})"
        )
    return fp, summary


__all__ = [
    "EXPORT_NAMESPACE",
    "Summary",
    "graph_diff",
    "graph_fingerprint",
    "graph_summary",
    "load_fingerprint",
    "save_fingerprint",
    "summary_fingerprint",
]
