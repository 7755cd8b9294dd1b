"""The NCCL variables this framework knows: each one's check, which are NCCL's "debugging" ones, the
removed names, the ones a typed ``NcclConfig`` field owns and the multicast switches.

Why a table of NCCL variables: NCCL reads its variables when a communicator starts, on every rank,
and most mistakes are silent there (an unknown level string is ignored, a removed variable is no
longer read, a misspelled subsystem logs nothing). Checking each value against what NCCL 2.30
accepts turns those into a ``ValueError`` before any rank starts (framework.planner.topology
applies the table). NCCL's own documentation splits its variables into system configuration (fine
in scripts) and "debugging" ones that "should not be used in production": each debugging variable
set is flagged with one ``NcclDebugVariableWarning``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


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
