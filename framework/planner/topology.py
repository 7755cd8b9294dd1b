"""Declared topology: the NCCL environment and its validation, NCCL topology XML, mesh shapes.

Why a table of NCCL variables: NCCL reads its variables when a communicator starts, on every rank,
and most mistakes are silent there (an unknown level string is ignored, a removed variable is no
longer read, a misspelled subsystem logs nothing). Checking each value against what NCCL 2.30
accepts turns those into a ``ValueError`` before any rank starts. NCCL's own documentation splits
its variables into system configuration (fine in scripts) and "debugging" ones that "should not be
used in production": each debugging variable set is flagged with one ``NcclDebugVariableWarning``.
Only names in the table pass (``check_variable_name``): the group exports its variables into every
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from framework.config.schema import MeshConfig, NcclConfig


class NcclDebugVariableWarning(UserWarning):
    """A variable from NCCL's "Debugging" list is set: fine as a workaround, not for production."""


# ------------------------------------------------------------------------------------------------
# Value checkers: each takes (name, value) and returns the value to set, or raises ValueError.
# ------------------------------------------------------------------------------------------------

Checker = Callable[[str, str], str]

# Legacy integer path levels (NCCL docs: "integer values are discouraged"); larger integers mean SYS.
_LEGACY_LEVELS = {0: "LOC", 1: "PIX", 2: "PXB", 3: "PHB", 4: "SYS"}


def _bad(name: str, value: str, valid: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not valid; valid: {valid}")


def _level(names: tuple[str, ...]) -> Checker:
    """A path level by name, or a legacy integer mapped to its name (the name is what we set)."""

    def check(name: str, value: str) -> str:
        v = value.strip()
        if v.upper() in names:
            return v.upper()
        if re.fullmatch(r"\d+", v):
            return _LEGACY_LEVELS[min(int(v), 4)]
        raise _bad(
            name, value, f"{', '.join(names)} or a legacy integer 0..4 (0=LOC 1=PIX 2=PXB 3=PHB 4=SYS)"
        )

    return check


def _choice(choices: tuple[str, ...], *, case_sensitive: bool = False) -> Checker:
    def check(name: str, value: str) -> str:
        for c in choices:
            if value == c or (not case_sensitive and value.upper() == c.upper()):
                return c
        raise _bad(name, value, ", ".join(choices))

    return check


def _int(minimum: int | None = None) -> Checker:
    def check(name: str, value: str) -> str:
        if not re.fullmatch(r"-?\d+", value.strip()) or (minimum is not None and int(value) < minimum):
            raise _bad(name, value, "an integer" + (f" >= {minimum}" if minimum is not None else ""))
        return value.strip()

    return check


def _text(name: str, value: str) -> str:
    if not value.strip():
        raise _bad(name, value, "a non-empty string")
    return value


_BOOL = _choice(("0", "1"))

# NCCL 2.30 names (src/init.cc ncclAlgoStr / ncclProtoStr / ncclFuncStr); NCCL compares them
# case-insensitively and, since 2.24, fails on an unknown one.
NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")
NCCL_PROTOS = ("LL", "LL128", "Simple")
NCCL_FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
# NCCL_DEBUG_SUBSYS names (src/debug.cc); NCCL ignores an unknown one silently, we refuse it.
NCCL_SUBSYSTEMS = (
    "INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC",
    "CALL", "PROXY", "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "ALL",
)  # fmt: skip


def _element_list(name: str, value: str, items: str, elems: tuple[str, ...]) -> None:
    body = items[1:] if items.startswith("^") else items
    lowered = {e.lower() for e in elems}
    for token in body.split(","):
        if token.strip().lower() not in lowered:
            raise _bad(name, value, f"a comma list (optionally ^ to exclude) of {', '.join(elems)}")


def _algo_list(elems: tuple[str, ...]) -> Checker:
    """NCCL's parseList grammar: ``[list][;func:list]...``, ``list`` = ``[^]elem[,elem...]``.

    Only the first entry may lack a ``func:`` prefix (NCCL refuses otherwise), e.g.
    ``ring,tree;allreduce:^tree`` or ``allreduce:tree;broadcast:ring``.
    """

    def check(name: str, value: str) -> str:
        entries = value.split(";")
        for i, entry in enumerate(entries):
            func, sep, items = entry.partition(":")
            if not sep:
                func, items = "", entry
                if i > 0:
                    raise _bad(name, value, "only the first ';' entry may omit the 'function:' prefix")
            elif func.strip().lower() not in {f.lower() for f in NCCL_FUNCS}:
                raise _bad(name, value, f"function prefixes {', '.join(NCCL_FUNCS)} (case-insensitive)")
            _element_list(name, value, items.strip(), elems)
        return value

    return check


def _subsystems(name: str, value: str) -> str:
    _element_list(name, value, value.strip(), NCCL_SUBSYSTEMS)
    return value


def _launch_mode(name: str, value: str) -> str:
    if value.upper() == "GROUP":
        raise ValueError(f"{name}=GROUP was removed in NCCL 2.9; valid: PARALLEL (or leave it unset)")
    return _choice(("PARALLEL",))(name, value)


@dataclass(frozen=True)
class NcclVariable:
    check: Checker
    debugging: bool = False  # listed in the "Debugging" section of NCCL's environment docs


_SYS, _DBG = False, True

# What NCCL 2.30 (and PyTorch's ProcessGroupNCCL) read. Values as NCCL's environment docs give them.
KNOWN_VARIABLES: dict[str, NcclVariable] = {
    # System configuration.
    "NCCL_SOCKET_IFNAME": NcclVariable(_text),
    "NCCL_SOCKET_FAMILY": NcclVariable(_choice(("AF_INET", "AF_INET6"))),
    "NCCL_SOCKET_NTHREADS": NcclVariable(_int(1)),
    "NCCL_NSOCKS_PERTHREAD": NcclVariable(_int(1)),
    "NCCL_CROSS_NIC": NcclVariable(_choice(("0", "1", "2"))),
    "NCCL_IB_HCA": NcclVariable(_text),
    "NCCL_IB_TIMEOUT": NcclVariable(_int(0)),
    "NCCL_IB_RETRY_CNT": NcclVariable(_int(0)),
    "NCCL_IB_GID_INDEX": NcclVariable(_int()),
    "NCCL_IB_ADDR_FAMILY": NcclVariable(_choice(("AF_INET", "AF_INET6"))),
    "NCCL_IB_ADDR_RANGE": NcclVariable(_text),
    "NCCL_IB_ROCE_VERSION_NUM": NcclVariable(_choice(("1", "2"))),
    "NCCL_IB_SL": NcclVariable(_int(0)),
    "NCCL_IB_TC": NcclVariable(_int(0)),
    "NCCL_IB_FIFO_TC": NcclVariable(_int(0)),
    "NCCL_IB_RETURN_ASYNC_EVENTS": NcclVariable(_BOOL),
    "NCCL_NET": NcclVariable(_text),
    "NCCL_NET_PLUGIN": NcclVariable(_text),
    "NCCL_TUNER_PLUGIN": NcclVariable(_text),
    "NCCL_PROFILER_PLUGIN": NcclVariable(_text),
    "NCCL_TOPO_FILE": NcclVariable(_text),
    "NCCL_TOPO_DUMP_FILE": NcclVariable(_text),
    "NCCL_TOPO_DUMP_FILE_RANK": NcclVariable(_int(0)),
    "NCCL_IGNORE_CPU_AFFINITY": NcclVariable(_BOOL),
    "NCCL_CONF_FILE": NcclVariable(_text),
    "NCCL_DEBUG": NcclVariable(_choice(("VERSION", "WARN", "INFO", "ABORT", "TRACE"))),
    "NCCL_DEBUG_FILE": NcclVariable(_text),
    "NCCL_DEBUG_SUBSYS": NcclVariable(_subsystems),
    "NCCL_DEBUG_TIMESTAMP_FORMAT": NcclVariable(_text),
    "NCCL_DEBUG_TIMESTAMP_LEVELS": NcclVariable(_text),
    "NCCL_COLLNET_ENABLE": NcclVariable(_BOOL),
    "NCCL_COLLNET_NODE_THRESHOLD": NcclVariable(_int(1)),
    "NCCL_HOSTID": NcclVariable(_text),
    "NCCL_SET_THREAD_NAME": NcclVariable(_BOOL),
    "NCCL_MNNVL_ENABLE": NcclVariable(_choice(("0", "1", "2"))),
    "NCCL_NVLS_ENABLE": NcclVariable(_choice(("0", "1", "2"))),  # guarded: only 0 passes, see below
    # Debugging ("should not be used in production nor retained in scripts").
    "NCCL_NET_GDR_LEVEL": NcclVariable(_level(("LOC", "PIX", "PXB", "PHB", "SYS")), _DBG),
    "NCCL_NET_GDR_READ": NcclVariable(_BOOL, _DBG),
    "NCCL_NET_GDR_C2C": NcclVariable(_BOOL, _DBG),
    "NCCL_P2P_LEVEL": NcclVariable(_level(("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")), _DBG),
    "NCCL_P2P_DISABLE": NcclVariable(_BOOL, _DBG),
    "NCCL_P2P_DIRECT_DISABLE": NcclVariable(_BOOL, _DBG),
    "NCCL_P2P_PXN_LEVEL": NcclVariable(_choice(("0", "1", "2")), _DBG),
    "NCCL_PXN_DISABLE": NcclVariable(_BOOL, _DBG),
    "NCCL_NVB_DISABLE": NcclVariable(_BOOL, _DBG),
    "NCCL_SHM_DISABLE": NcclVariable(_BOOL, _DBG),
    "NCCL_IB_DISABLE": NcclVariable(_BOOL, _DBG),
    "NCCL_IB_AR_THRESHOLD": NcclVariable(_int(0), _DBG),
    "NCCL_IB_QPS_PER_CONNECTION": NcclVariable(_int(1), _DBG),
    "NCCL_IB_SPLIT_DATA_ON_QPS": NcclVariable(_BOOL, _DBG),
    "NCCL_IB_PCI_RELAXED_ORDERING": NcclVariable(_choice(("0", "1", "2")), _DBG),
    "NCCL_IB_ADAPTIVE_ROUTING": NcclVariable(_BOOL, _DBG),
    "NCCL_NET_SHARED_BUFFERS": NcclVariable(_BOOL, _DBG),
    "NCCL_NET_SHARED_COMMS": NcclVariable(_BOOL, _DBG),
    "NCCL_ALGO": NcclVariable(_algo_list(NCCL_ALGOS), _DBG),
    "NCCL_PROTO": NcclVariable(_algo_list(NCCL_PROTOS), _DBG),
    "NCCL_BUFFSIZE": NcclVariable(_int(1), _DBG),
    "NCCL_NTHREADS": NcclVariable(_choice(("64", "128", "256", "512")), _DBG),
    "NCCL_MAX_CTAS": NcclVariable(_int(1), _DBG),
    "NCCL_MIN_CTAS": NcclVariable(_int(1), _DBG),
    "NCCL_CGA_CLUSTER_SIZE": NcclVariable(_int(0), _DBG),
    "NCCL_LAUNCH_MODE": NcclVariable(_launch_mode, _DBG),
    "NCCL_CUMEM_ENABLE": NcclVariable(_BOOL, _DBG),
    "NCCL_DMABUF_ENABLE": NcclVariable(_BOOL, _DBG),
    "NCCL_P2P_NET_CHUNKSIZE": NcclVariable(_int(1), _DBG),
    "NCCL_P2P_LL_THRESHOLD": NcclVariable(_int(0), _DBG),
    "NCCL_COMM_BLOCKING": NcclVariable(_BOOL, _DBG),
    "NCCL_GRAPH_MIXING_SUPPORT": NcclVariable(_BOOL, _DBG),
    "NCCL_GRAPH_REGISTER": NcclVariable(_BOOL, _DBG),
    "NCCL_LOCAL_REGISTER": NcclVariable(_BOOL, _DBG),
    "NCCL_SET_STACK_SIZE": NcclVariable(_BOOL, _DBG),
    # PyTorch ProcessGroupNCCL (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": NcclVariable(_choice(("0", "1", "2", "3"))),
    "TORCH_NCCL_BLOCKING_WAIT": NcclVariable(_BOOL),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": NcclVariable(_BOOL),
    "TORCH_NCCL_ENABLE_MONITORING": NcclVariable(_BOOL),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": NcclVariable(_int(1)),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": NcclVariable(_int(0)),
    "TORCH_NCCL_DESYNC_DEBUG": NcclVariable(_BOOL),
    "TORCH_NCCL_ENABLE_TIMING": NcclVariable(_BOOL),
    "TORCH_NCCL_AVOID_RECORD_STREAMS": NcclVariable(_BOOL),
    "TORCH_NCCL_HIGH_PRIORITY": NcclVariable(_BOOL),
    "TORCH_NCCL_NAN_CHECK": NcclVariable(_BOOL),
    "TORCH_NCCL_PROPAGATE_ERROR": NcclVariable(_BOOL),
    "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": NcclVariable(_BOOL),
}

# Removed or deprecated: refused, with what to use instead (NCCL release notes; PyTorch renamed its
# unprefixed variables to TORCH_NCCL_*).
REMOVED_VARIABLES: dict[str, str] = {
    "NCCL_IB_GDR_LEVEL": "NCCL_NET_GDR_LEVEL (renamed in NCCL 2.4.0; the old name is no longer read)",
    "NCCL_IB_CUDA_SUPPORT": "NCCL_NET_GDR_LEVEL (NCCL_IB_CUDA_SUPPORT was removed in NCCL 2.4.0)",
    "NCCL_SINGLE_RING_THRESHOLD": "nothing: removed in NCCL 2.3, NCCL tunes this itself",
    "NCCL_LL_THRESHOLD": "NCCL_PROTO to restrict protocols (the threshold was removed in NCCL 2.5)",
    "NCCL_TREE_THRESHOLD": "NCCL_ALGO to restrict algorithms (the threshold was removed in NCCL 2.5)",
    "NCCL_MAX_NCHANNELS": "NCCL_MAX_CTAS (since NCCL 2.17)",
    "NCCL_MIN_NCHANNELS": "NCCL_MIN_CTAS (since NCCL 2.17)",
    "NCCL_CHECK_POINTERS": "NCCL_CHECK_MODE (since NCCL 2.29.7)",
    "NCCL_CHECKS_DISABLE": "nothing: removed in NCCL 2.2.12",
    "NCCL_ASYNC_ERROR_HANDLING": "nccl.async_error_handling (sets TORCH_NCCL_ASYNC_ERROR_HANDLING)",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
}

# Variables a typed NcclConfig field owns: set through the field, never through env/preset_env.
OWNED_VARIABLES: dict[str, str] = {
    "NCCL_SOCKET_IFNAME": "nccl.socket_ifname",
    "NCCL_TOPO_FILE": "nccl.topo_file",
    "NCCL_TOPO_DUMP_FILE": "nccl.topo_dump_file",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "nccl.async_error_handling",
}

# NVLink multicast switches and the one value each may take: the value that keeps multicast off.
MULTICAST_OFF: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

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
