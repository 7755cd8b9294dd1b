"""The ``freeze`` config group: a static graph of the model, its fingerprint and an artifact.

``freeze=export`` is the path: ``torch.export`` at static shapes (after a pre-check that lists every
cause of dynamism with its module path), a canonical structural fingerprint, and an artifact
(``frozen/model.pt2`` + ``manifest.json``) that is refused on load when the environment differs.
``freeze=script`` / ``freeze=trace`` are the deprecated TorchScript path (``frozen/model.ts``).
``freeze=none`` does nothing. The trainer calls ``freeze(...)`` once, after build and before
parallelize; only rank 0 passes ``write=True``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from framework.config.schema import FreezeConfig, FreezeMode
from framework.freeze.artifact import (
    FROZEN_DIR,
    ArtifactMismatchError,
    environment,
    load_artifact,
    save_artifact,
)
from framework.freeze.export import GraphIssue, StaticGraphError, export_model
from framework.freeze.fingerprint import (
    Summary,
    graph_diff,
    graph_fingerprint,
    graph_summary,
    load_fingerprint,
    save_fingerprint,
    summary_fingerprint,
)
from framework.freeze.torchscript import (
    TS_NAMESPACE,
    freeze_torchscript,
    script_model,
    trace_model,
    ts_fingerprint,
    ts_summary,
)

FINGERPRINT_FILE = "fingerprint.json"
TS_MODEL_FILE = "model.ts"


@dataclass
class FrozenResult:
    """What ``freeze`` produced. ``program`` is the ExportedProgram or frozen ScriptModule (None for none)."""

    mode: FreezeMode
    fingerprint: str | None
    summary: Summary | None
    artifact: Path | None
    seconds: float
    program: ExportedProgram | torch.jit.ScriptModule | None = None


def _freeze_export(
    model: nn.Module, example_inputs: tuple, cfg: FreezeConfig, out_dir: Path | None, extra: dict[str, Any]
) -> tuple[ExportedProgram, str, Summary, Path | None]:
    ep = export_model(model, example_inputs, cfg)
    summary = graph_summary(ep)
    artifact = None
    if out_dir is not None:
        artifact = save_artifact(ep, out_dir, extra)
        save_fingerprint(artifact / FINGERPRINT_FILE, summary)
    return ep, summary_fingerprint(summary), summary, artifact


def _freeze_torchscript(
    model: nn.Module, example_inputs: tuple, cfg: FreezeConfig, out_dir: Path | None
) -> tuple[torch.jit.ScriptModule, str, Summary, Path | None]:
    if cfg.mode == FreezeMode.script:
        module = script_model(model, cfg)
    else:
        module = trace_model(model, example_inputs, cfg)
    if cfg.ignore:
        frozen = module.eval()
    elif any(t.is_meta for t in module.parameters()):
        # The trainer freezes the meta-device model (no weights): torch.jit.freeze inlines weights
        # as constants and so needs real ones (on meta it fails in aten::equal). The graph is the
        # scripted / traced one; weights come from checkpoints, as with freeze=export.
        frozen = module.eval()
    else:
        frozen = freeze_torchscript(module, cfg)
    summary = ts_summary(frozen)
    artifact = None
    if out_dir is not None:
        if cfg.ignore:
            raise ValueError(
                f"freeze.ignore={cfg.ignore} leaves Python calls in the TorchScript module, which "
                "TorchScript cannot save; run without an output directory or drop freeze.ignore"
            )
        artifact = Path(out_dir) / FROZEN_DIR
        artifact.mkdir(parents=True, exist_ok=True)
        frozen.save(str(artifact / TS_MODEL_FILE))
        save_fingerprint(artifact / FINGERPRINT_FILE, summary, TS_NAMESPACE)
    return frozen, ts_fingerprint(frozen), summary, artifact


def freeze(
    model: nn.Module,
    example_inputs: tuple,
    cfg: FreezeConfig,
    out_dir: Path | None,
    write: bool = True,
    manifest_extra: dict[str, Any] | None = None,
) -> FrozenResult:
    """Freeze ``model`` at the shapes of ``example_inputs`` as ``cfg.mode`` says.

    Every rank freezes (each gets the fingerprint, for a cross-rank check); files go to
    ``out_dir/frozen`` only when ``out_dir`` is set and ``write`` is true (rank 0).
    Raises StaticGraphError / ValueError naming what cannot be frozen.
    """
    start = time.perf_counter()
    if cfg.mode == FreezeMode.none:
        return FrozenResult(cfg.mode, None, None, None, 0.0)
    target = Path(out_dir) if out_dir is not None and write else None
    if cfg.mode == FreezeMode.export:
        program, fp, summary, artifact = _freeze_export(
            model, example_inputs, cfg, target, manifest_extra or {}
        )
    else:
        program, fp, summary, artifact = _freeze_torchscript(model, example_inputs, cfg, target)
    return FrozenResult(cfg.mode, fp, summary, artifact, time.perf_counter() - start, program)


__all__ = [
    "ArtifactMismatchError",
    "FrozenResult",
    "GraphIssue",
    "StaticGraphError",
    "environment",
    "export_model",
    "freeze",
    "graph_diff",
    "graph_fingerprint",
    "graph_summary",
    "load_artifact",
    "load_fingerprint",
    "save_artifact",
    "save_fingerprint",
    "script_model",
    "trace_model",
    "ts_fingerprint",
]
