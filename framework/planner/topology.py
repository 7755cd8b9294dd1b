"""Declared topology: the NCCL environment and its validation, NCCL topology XML, mesh shapes.

The variables' table (each one's check, the debugging ones, the removed, owned and multicast
names) is framework.planner.nccl_variables; this module applies it. Only names in the table pass
(``check_variable_name``): the group exports its variables into every
rank, so ``LD_PRELOAD`` or ``PYTHONPATH`` there would be code execution, and an unknown ``NCCL_*``
name is a typo NCCL would ignore (refused with the nearest known name).

NVLink multicast stays off on the lent multi-GPU machines (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): a value that would turn it on is
refused, and ``apply_nccl_environment`` never overrides one that is already set.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import warnings
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from framework.config.schema import MeshConfig, NcclConfig
from framework.planner.nccl_variables import (
    KNOWN_VARIABLES,
    MULTICAST_OFF,
    OWNED_VARIABLES,
    REMOVED_VARIABLES,
    NcclDebugVariableWarning,
)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_multicast(name: str, value: str) -> None:
    if name in MULTICAST_OFF and value.strip() != MULTICAST_OFF[name]:
        raise ValueError(
            f"{name}={value!r} would turn NVLink multicast on; valid: {MULTICAST_OFF[name]!r} "
            "(the multi-GPU machines keep multicast off: it can take a shared host's GPUs out of service)"
        )


def known_names() -> list[str]:
    """Every variable name ``nccl.env`` / ``nccl.preset_env`` may hold (the typed fields' own excepted)."""
    return sorted(n for n in (*KNOWN_VARIABLES, *MULTICAST_OFF) if n not in OWNED_VARIABLES)


def check_variable_name(name: str, source: str = "nccl.env") -> None:
    """Refuse a name this table does not know, naming it (and the nearest known name for an NCCL one).

    Why an allowlist: the NCCL environment is exported into every rank before the process group
    starts, so an arbitrary name is a process-level setting (``LD_PRELOAD`` loads a library into every
    rank, ``PYTHONPATH`` runs a ``sitecustomize``). An unknown ``NCCL_*`` name is refused too: NCCL
    ignores a misspelled variable silently. The multicast switches are allowed with their "off" value.
    """
    if name in KNOWN_VARIABLES or name in MULTICAST_OFF or name in REMOVED_VARIABLES:
        return
    if not _ENV_NAME.fullmatch(name):
        raise ValueError(f"{source}: {name!r} is not a valid environment variable name")
    if name.startswith(("NCCL_", "TORCH_NCCL_")):
        near = difflib.get_close_matches(name, [*known_names(), *OWNED_VARIABLES], n=1, cutoff=0.6)
        if not near:
            hint = "see KNOWN_VARIABLES in framework/planner/topology.py"
        elif near[0] in OWNED_VARIABLES:
            hint = f"did you mean {near[0]}? (set it through {OWNED_VARIABLES[near[0]]})"
        else:
            hint = f"did you mean {near[0]}?"
        raise ValueError(f"{source}.{name} is not an NCCL variable this framework knows (NCCL 2.30); {hint}")
    raise ValueError(
        f"{source}.{name} is refused: only NCCL_* / TORCH_NCCL_* variables known to framework/planner/topology.py "
        "may be set through the nccl group (it exports them into every rank); set other variables in "
        "the launching environment"
    )


def validate_variable(name: str, value: str) -> str:
    """Check one variable; return the value to set (legacy levels become names). Warns, see module."""
    check_variable_name(name)
    if name in REMOVED_VARIABLES:
        raise ValueError(f"{name} is removed or deprecated; use {REMOVED_VARIABLES[name]}")
    value = str(value)
    _check_multicast(name, value)
    spec = KNOWN_VARIABLES.get(name)
    if spec is None:  # a multicast switch, checked above
        return value
    checked = spec.check(name, value)
    if spec.debugging:
        warnings.warn(
            f"{name}={checked} is one of NCCL's debugging variables: NCCL advises against it in "
            "production (it can cost performance or hang); keep it as a workaround only",
            NcclDebugVariableWarning,
            stacklevel=3,
        )
    return checked


def nccl_environment(cfg: NcclConfig, run_dir: Path | None, procs_per_node: int) -> dict[str, str]:
    """The validated environment for ``cfg``: preset variables, then ``env``, then the typed fields.

    Pure apart from reading ``cfg.topo_file`` (which must describe ``procs_per_node`` GPUs) and
    emitting warnings; sets nothing. ``run_dir`` anchors a relative ``topo_dump_file``.
    Raises ValueError for any refused variable or value, an owned variable set in ``env`` or
    ``preset_env``, a missing socket interface when the preset requires one, a dump file without
    a run dir, or a topology file that does not parse or does not match ``procs_per_node``.
    """
    merged: dict[str, str] = {}
    for source, variables in (("nccl.preset_env", cfg.preset_env), ("nccl.env", cfg.env)):
        for name, value in variables.items():
            if name in OWNED_VARIABLES:
                raise ValueError(f"{source}.{name} is not allowed: set {OWNED_VARIABLES[name]} instead")
            check_variable_name(name, source)
            merged[name] = str(value)

    if cfg.async_error_handling not in (0, 1, 2, 3):
        raise ValueError(
            f"nccl.async_error_handling={cfg.async_error_handling} is not valid; valid: 0, 1, 2, 3"
        )
    merged["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = str(cfg.async_error_handling)

    if cfg.socket_ifname is not None:
        merged["NCCL_SOCKET_IFNAME"] = cfg.socket_ifname
    elif cfg.require_socket_ifname:
        raise ValueError(
            f"nccl preset {cfg.preset!r} needs nccl.socket_ifname (e.g. eth0, =ens1f0, ^docker): "
            "NCCL would otherwise pick an interface itself"
        )

    if cfg.topo_file is not None:
        topo = Path(cfg.topo_file).expanduser().resolve()
        try:
            check_topology(parse_topology_xml(topo), procs_per_node)
        except ValueError as e:
            raise ValueError(f"nccl.topo_file={cfg.topo_file!r}: {e}") from e
        merged["NCCL_TOPO_FILE"] = str(topo)

    if cfg.topo_dump_file is not None:
        dump = Path(cfg.topo_dump_file).expanduser()
        if not dump.is_absolute():
            if run_dir is None:
                raise ValueError(
                    f"nccl.topo_dump_file={cfg.topo_dump_file!r} is relative to the run dir, but no run dir "
                    "was given; pass run_dir or an absolute path"
                )
            dump = Path(run_dir) / dump
        merged["NCCL_TOPO_DUMP_FILE"] = str(dump.resolve())

    return {name: validate_variable(name, value) for name, value in merged.items()}


def apply_nccl_environment(env: dict[str, str]) -> None:
    """Set ``env`` in ``os.environ``; call before the process group (or the ranks) start.

    A multicast switch already in the environment is never touched, whatever ``env`` says; one
    that would turn multicast on is refused (ValueError) even when absent. Any other variable
    overrides the inherited one, with a warning when the value differs.
    """
    for name, value in env.items():
        _check_multicast(name, value)
    for name, value in env.items():
        if name in MULTICAST_OFF and name in os.environ:
            continue
        old = os.environ.get(name)
        if old is not None and old != value:
            warnings.warn(f"{name}: the config's {value!r} replaces the inherited {old!r}", stacklevel=2)
        os.environ[name] = value


def describe_nccl(env: dict[str, str]) -> str:
    """A few lines for the log: every variable set, debugging ones marked."""
    if not env:
        return "NCCL environment: nothing set (NCCL detects the topology itself)"
    lines = [f"NCCL environment ({len(env)} variables):"]
    for name in sorted(env):
        spec = KNOWN_VARIABLES.get(name)
        tag = "  [debugging]" if spec is not None and spec.debugging else ""
        lines.append(f"  {name}={env[name]}{tag}")
    return "\n".join(lines)


def nccl_version() -> str | None:
    """NCCL's version as ``"2.21.5"`` (plus a suffix if any) when CUDA is available, else None."""
    import torch

    if not torch.cuda.is_available():
        return None
    return ".".join(str(part) for part in torch.cuda.nccl.version())


def write_nccl_record(run_dir: Path, env: dict[str, str]) -> Path:
    """Write ``run_dir/nccl.json`` (effective environment and NCCL version); rank 0 only."""
    path = Path(run_dir) / "nccl.json"
    record = {
        "nccl_version": nccl_version(),
        "env": dict(sorted(env.items())),
        "debugging_variables": sorted(
            n for n in env if n in KNOWN_VARIABLES and KNOWN_VARIABLES[n].debugging
        ),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


# ------------------------------------------------------------------------------------------------
# NCCL topology XML (what NCCL_TOPO_DUMP_FILE writes and NCCL_TOPO_FILE reads).
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopologySummary:
    """What the planner and the launch checks need from a topology file."""

    num_gpus: int
    num_nics: int  # <nic> elements (one physical adapter each)
    num_net_devices: int  # <net> elements (ports NCCL can use)
    nvlinks_per_gpu: tuple[int, ...]  # sum of <nvlink count=...> per GPU, ordered by the GPU's dev


def _int_attr(path: Path, elem: ET.Element, attr: str) -> int:
    raw = elem.get(attr)
    if raw is None:
        raise ValueError(f"{path}: <{elem.tag}> has no {attr!r} attribute")
    try:
        return int(raw, 0)
    except ValueError:
        raise ValueError(f"{path}: <{elem.tag} {attr}={raw!r}> is not an integer") from None


def parse_topology_xml(path: Path) -> TopologySummary:
    """Summarise an NCCL topology file (root ``<system>``; GPUs are ``<gpu dev=...>`` in pci nodes).

    Raises ValueError naming the file when it is missing, malformed, not rooted at ``<system>``,
    or when a GPU or NVLink lacks its ``dev`` / ``count``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: topology file not found")
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise ValueError(f"{path}: malformed XML ({e})") from None
    if root.tag != "system":
        raise ValueError(f"{path}: root element is <{root.tag}>, expected <system> (NCCL topology format)")
    nvlinks: dict[int, int] = {}
    for gpu in root.iter("gpu"):
        dev = _int_attr(path, gpu, "dev")
        if dev in nvlinks:
            raise ValueError(f"{path}: two <gpu> elements with dev={dev}")
        nvlinks[dev] = sum(_int_attr(path, link, "count") for link in gpu.iter("nvlink"))
    return TopologySummary(
        num_gpus=len(nvlinks),
        num_nics=sum(1 for _ in root.iter("nic")),
        num_net_devices=sum(1 for _ in root.iter("net")),
        nvlinks_per_gpu=tuple(nvlinks[d] for d in sorted(nvlinks)),
    )


def check_topology(summary: TopologySummary, procs_per_node: int) -> None:
    """Refuse a topology file whose GPU count differs from the processes per node (one GPU each)."""
    if summary.num_gpus != procs_per_node:
        raise ValueError(
            f"the NCCL topology file describes {summary.num_gpus} GPUs but the mesh runs {procs_per_node} "
            "processes per node (one GPU each); the file must describe one node of this mesh"
        )


# ------------------------------------------------------------------------------------------------
# Mesh shapes.
# ------------------------------------------------------------------------------------------------


# Ranks in one job: the largest runs today have ~10**5 GPUs. Bounded because the layout code counts
# the world size's divisors (mesh=99999999999 used to hang the launcher, even in a dry run).
MAX_WORLD_SIZE = 2**20


def validate_mesh(cfg: MeshConfig) -> None:
    """Refuse an empty shape, a non-positive (or non-integer) entry, or more than MAX_WORLD_SIZE ranks;
    see MeshConfig for the meaning."""
    if len(cfg.shape) == 0:
        raise ValueError("mesh.shape=[] is empty; valid: a list of positive integers, e.g. [8] or [2, 4]")
    for s in cfg.shape:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"mesh.shape={list(cfg.shape)} has entry {s!r}; valid: positive integers only")
    if math.prod(cfg.shape) > MAX_WORLD_SIZE:
        raise ValueError(
            f"mesh.shape={list(cfg.shape)} is {math.prod(cfg.shape)} ranks; valid: sizes whose product "
            f"is at most {MAX_WORLD_SIZE}"
        )
