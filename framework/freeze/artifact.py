"""The frozen artifact on disk: ``frozen/model.pt2`` (torch.export.save) + ``frozen/manifest.json``.

Why a manifest checked *before* loading: an exported program is tied to the torch release that
wrote it (operator schemas and the serialisation format change between minor versions). Loading
first and failing deep inside deserialisation, or worse loading silently, is what the "ABI check"
prevents: ``load_artifact`` compares the manifest with the running environment, says exactly which
field differs, and only then calls ``torch.export.load`` (torch's own format, no arbitrary pickle).
After loading, the graph's fingerprint must equal the manifest's: a swapped or edited model.pt2 is
refused too.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from framework.freeze.fingerprint import EXPORT_NAMESPACE, graph_fingerprint

FORMAT_VERSION = 1
FROZEN_DIR = "frozen"
MODEL_FILE = "model.pt2"
MANIFEST_FILE = "manifest.json"


class ArtifactMismatchError(ValueError):
    """The artifact does not fit the running environment, or its files do not fit each other."""


def _framework_version() -> str:
    try:
        return importlib.metadata.version("framework")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def environment() -> dict[str, Any]:
    """Versions that decide whether an artifact can be loaded here; CUDA/NCCL are None on CPU builds."""
    nccl = None
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    return {
        "framework": _framework_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": platform.python_version(),
    }


def _input_spec(ep: ExportedProgram) -> list[dict[str, Any]]:
    user = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    spec = []
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in user:
            val = node.meta["val"]
            spec.append({"name": node.name, "shape": list(val.shape), "dtype": str(val.dtype)})
    return spec


def _params(ep: ExportedProgram) -> tuple[int, dict[str, int]]:
    """(number of parameter elements, elements per dtype); a tied weight is counted once."""
    seen: set[int] = set()
    per_dtype: Counter[str] = Counter()
    for name in ep.graph_signature.parameters:
        t = ep.state_dict[name]
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        per_dtype[str(t.dtype)] += t.numel()
    return sum(per_dtype.values()), dict(sorted(per_dtype.items()))


def build_manifest(ep: ExportedProgram, extra: dict[str, Any]) -> dict[str, Any]:
    num_params, dtypes = _params(ep)
    return {
        "format_version": FORMAT_VERSION,
        **environment(),
        "fingerprint_namespace": EXPORT_NAMESPACE,
        "fingerprint": graph_fingerprint(ep),
        "input_spec": _input_spec(ep),
        "param_dtypes": dtypes,
        "num_params": num_params,
        "extra": extra,
    }


def save_artifact(ep: ExportedProgram, out_dir: Path, manifest_extra: dict[str, Any]) -> Path:
    """Write ``out_dir/frozen/{model.pt2, manifest.json}``; returns the ``frozen`` directory.

    The manifest is written last, so a directory with a manifest always has its model file.
    ``manifest_extra`` must be JSON-serialisable (run config, git commit ...).
    """
    frozen = Path(out_dir) / FROZEN_DIR
    frozen.mkdir(parents=True, exist_ok=True)
    manifest = build_manifest(ep, manifest_extra)
    text = json.dumps(manifest, indent=2, sort_keys=True)  # fails before writing anything if not JSON
    torch.export.save(ep, frozen / MODEL_FILE)
    tmp = frozen / (MANIFEST_FILE + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(frozen / MANIFEST_FILE)
    return frozen


def check_manifest(manifest: dict[str, Any]) -> None:
    """The ABI check: raise ArtifactMismatchError naming every field that does not fit this process."""
    here = environment()
    problems = []
    if manifest.get("format_version") != FORMAT_VERSION:
        problems.append(
            f"format_version: artifact {manifest.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    if manifest.get("fingerprint_namespace") != EXPORT_NAMESPACE:
        problems.append(
            f"fingerprint_namespace: artifact {manifest.get('fingerprint_namespace')!r}, "
            f"expected {EXPORT_NAMESPACE!r} (a torch.export artifact)"
        )
    theirs = str(manifest.get("torch"))
    if _major_minor(theirs) != _major_minor(here["torch"]):
        problems.append(
            f"torch: artifact written by {theirs}, running {here['torch']} (major.minor must match)"
        )
    if problems:
        raise ArtifactMismatchError("frozen artifact refused (ABI check):\n  " + "\n  ".join(problems))


def load_artifact(path: Path) -> ExportedProgram:
    """Check the manifest, then ``torch.export.load`` and verify the graph fingerprint.

    ``path`` is the directory ``save_artifact`` returned, or the run directory that contains it.
    Raises ArtifactMismatchError (a ValueError) for a missing file, an incompatible environment or a
    fingerprint that differs from the manifest's.
    """
    frozen = Path(path)
    if not (frozen / MANIFEST_FILE).exists() and (frozen / FROZEN_DIR).is_dir():
        frozen = frozen / FROZEN_DIR
    missing = [n for n in (MANIFEST_FILE, MODEL_FILE) if not (frozen / n).is_file()]
    if missing:
        raise ArtifactMismatchError(f"frozen artifact refused: missing {missing} in {frozen}")
    manifest = json.loads((frozen / MANIFEST_FILE).read_text())
    check_manifest(manifest)
    ep = torch.export.load(frozen / MODEL_FILE)
    fp = graph_fingerprint(ep)
    if fp != manifest.get("fingerprint"):
        raise ArtifactMismatchError(
            f"frozen artifact refused (ABI check): fingerprint of {frozen / MODEL_FILE} is {fp}, "
            f"manifest says {manifest.get('fingerprint')}"
        )
    return ep
