"""Safe instantiation: every ``_target_`` a config names must be on a default-deny allowlist.

Configs are data, shared across teams as recipes; a ``_target_`` turns data into a call. Hydra 1.3
has only a blocklist, and alias paths slipped past it (advisory GHSA-37p2-j732-x8pj:
``logging.os.system`` reaches ``os.system`` through an allowed-looking module). So the allowlist
is exact names: the callback and optimizer classes the docs name (``BUILTIN_ALLOW``), plus what
``run.instantiate_allow`` adds. There a package may be granted whole, written with its trailing dot
(``mypkg.``): the user's own code, trusted on the command line or in conf/, never by a recipe. Under
a prefix, every module and object met while resolving the path must really live under an allowed
prefix too: ``mypkg.os.system`` is refused because ``mypkg.os`` is the module ``os``. Nothing grants
``framework.`` by default: a config could then call any framework function (a data tool, the
command line's ``main``) with arguments it chose. Nothing outside the allowlist is ever imported.

``check_targets`` runs at compose time (``framework.launch.entry``), before anything runs;
``safe_instantiate`` is the only way framework code should call ``hydra.utils.instantiate``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from framework.config.schema import SHIPPED_CALLBACKS

TARGET_KEY = "_target_"
# torch.optim's optimizer classes: what optimizer._target_ may name (conf/optimizer/*.yaml and "your
# own class" in docs/configuration.md). Named one by one, never the module: torch.optim holds
# functions and submodules too.
TORCH_OPTIMIZERS = (
    "ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon", "NAdam",
    "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam",
)  # fmt: skip
# Always allowed, before run.instantiate_allow: exact classes only, so that no config can call a
# framework function (a data tool, a command's main) with arguments it chose.
BUILTIN_ALLOW = (*SHIPPED_CALLBACKS.values(), *(f"torch.optim.{name}" for name in TORCH_OPTIMIZERS))


def _prefixes(allow: list[str]) -> list[str]:
    """The entries that grant a module and what lies below it: those written with a trailing dot."""
    return [a.rstrip(".") for a in allow if a.endswith(".") and a.strip(".")]


def is_allowed_name(name: str, allow: list[str]) -> bool:
    """True when the dotted ``name`` is an exact entry, or one of the prefix entries' modules or below one."""
    return name in allow or any(name == p or name.startswith(p + ".") for p in _prefixes(allow))


def _leads_to_prefix(dotted: str, allow: list[str]) -> bool:
    """True for the packages a prefix entry lies in (``hydra``, ``hydra._internal`` of
    ``hydra._internal.core_plugins.``): the path down to a granted module, not a place of its own."""
    return any(p.startswith(dotted + ".") for p in _prefixes(allow))


def _home(obj: Any) -> str:
    """The module an object really belongs to (a module's own name; a function's or class's module)."""
    if isinstance(obj, ModuleType):
        return obj.__name__
    home = getattr(obj, "__module__", None)
    return home if isinstance(home, str) else type(obj).__module__


def check_target(path: Any, allow: list[str], where: str = "_target_") -> Any:
    """Raise ValueError unless ``path`` is an exact entry of ``BUILTIN_ALLOW`` or ``allow``, or lies under
    a prefix entry of ``allow`` with everything it resolves through; return what it resolves to
    (importing only allowed modules), for checks of its kind."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}={path!r}: a _target_ must be a dotted path string")
    extra, allow = list(allow), [*BUILTIN_ALLOW, *allow]
    if not is_allowed_name(path, allow):
        raise ValueError(
            f"{where}={path!r} is not on the instantiation allowlist (the shipped callbacks, torch.optim's "
            f"optimizer classes, and run.instantiate_allow={extra}); configs are data: add the class "
            "(or your package as `mypkg.`) to run.instantiate_allow (in conf/ or on the command line) if "
            "you trust it"
        )
    exact = path in allow  # named whole: trusted as written, whatever modules it passes through
    parts = path.split(".")
    try:
        obj: Any = importlib.import_module(parts[0])
    except ImportError as e:
        raise ValueError(f"{where}={path!r} cannot be resolved: {e}") from e
    for i in range(1, len(parts)):
        dotted = ".".join(parts[: i + 1])
        if hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
        elif isinstance(obj, ModuleType):
            try:
                obj = importlib.import_module(dotted)
            except ImportError as e:
                raise ValueError(f"{where}={path!r} cannot be resolved: {e}") from e
        else:
            raise ValueError(f"{where}={path!r} cannot be resolved: no attribute {parts[i]!r}")
        home = _home(obj)
        if not exact and not _leads_to_prefix(dotted, allow) and not is_allowed_name(home, allow):
            raise ValueError(
                f"{where}={path!r} is refused: {dotted!r} is really {home!r}, which is not on the "
                f"instantiation allowlist {allow} (an alias path, see GHSA-37p2-j732-x8pj)"
            )
    return obj


def find_targets(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every ``_target_`` in a nested container, as (key path, value)."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if k == TARGET_KEY:
                found.append((key, v))
            else:
                found.extend(find_targets(v, key))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found.extend(find_targets(v, f"{prefix}[{i}]"))
    return found


# What Hydra itself instantiates under ``hydra.*`` (launchers, sweepers and their samplers,
# callbacks) and what ``logging.config.dictConfig`` calls for ``hydra.job_logging`` /
# ``hydra.hydra_logging`` (``class`` and ``()`` name a callable that gets the node's keys).
# Narrow on purpose: ``hydra.utils.call`` or ``logging.config.fileConfig`` (which evals) would be
# instantiation of anything.
HYDRA_ALLOW = [
    "hydra._internal.core_plugins.", "hydra.experimental.callbacks.", "hydra_plugins.", "optuna.",
    "framework.launch.run_dir_guard.RunDirCheck", "framework.launch.sweep.SweepSummary",  # conf/config.yaml's
]  # fmt: skip
LOGGING_ALLOW = [
    "logging.StreamHandler", "logging.FileHandler", "logging.NullHandler", "logging.Formatter",
    "logging.Filter", "logging.handlers.", "colorlog.",
]  # fmt: skip
LOGGING_CALLABLE_KEYS = ("()", "class")


def check_targets(cfg: DictConfig | dict[str, Any], allow: list[str]) -> int:
    """Check every ``_target_`` of a config, the ``hydra`` node included; return how many there are.

    ``hydra.*`` is checked against ``allow`` plus ``HYDRA_ALLOW`` (Hydra's own plugins), literally
    (Hydra instantiates it before our code runs, so an interpolated target there is refused), and
    so are the callables its logging config names. Recipes cannot reach ``hydra.*`` at all
    (framework.launch.recipe_check); this is the check on the composed result.
    """
    if isinstance(cfg, DictConfig):
        hydra_node = cfg.get("hydra") if "hydra" in cfg else None
        rest = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if hydra_node is not None else cfg
        container = OmegaConf.to_container(rest, resolve=True, throw_on_missing=False)
        hydra_tree = OmegaConf.to_container(hydra_node, resolve=False) if hydra_node is not None else None
    else:
        container = {k: v for k, v in cfg.items() if k != "hydra"}
        hydra_tree = cfg.get("hydra")
    assert isinstance(container, dict)
    targets = find_targets(container)
    for key, value in targets:
        check_target(value, allow, where=key)
    return len(targets) + (check_hydra_targets(hydra_tree, allow) if hydra_tree is not None else 0)


def check_hydra_targets(hydra_tree: Any, allow: list[str]) -> int:
    """Check the unresolved ``hydra`` node's targets and logging callables (see ``check_targets``)."""
    if isinstance(hydra_tree, DictConfig):
        hydra_tree = OmegaConf.to_container(hydra_tree, resolve=False)
    found = [(k, v, HYDRA_ALLOW) for k, v in find_targets(hydra_tree, "hydra")]
    for section in ("job_logging", "hydra_logging"):
        node = hydra_tree.get(section) if isinstance(hydra_tree, dict) else None
        found += [
            (k, v, LOGGING_ALLOW) for k, v in find_keys(node, LOGGING_CALLABLE_KEYS, f"hydra.{section}")
        ]
    for key, value, names in found:
        if isinstance(value, str) and "${" in value:
            raise ValueError(f"{key}={value!r}: a target under hydra.* must be a literal dotted path")
        if isinstance(value, str) and is_allowed_name(value, names):
            # Hydra's own: every object met while resolving it must still live in its package.
            check_target(value, [*allow, *names], where=key)
        else:
            check_target(value, allow, where=key)  # anything else: the user's allowlist, as outside hydra.*
    return len(found)


def find_keys(node: Any, names: tuple[str, ...], prefix: str) -> list[tuple[str, Any]]:
    """Every value under a key in ``names`` in a nested container, as (key path, value)."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}.{k}"
            found += [(key, v)] if k in names else find_keys(v, names, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += find_keys(v, names, f"{prefix}[{i}]")
    return found


def safe_instantiate(node: DictConfig | dict[str, Any], allow: list[str], **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` after checking every ``_target_`` in ``node`` against ``allow``."""
    from hydra.utils import instantiate

    container = (
        OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node
    )
    for key, value in find_targets(container):
        check_target(value, allow, where=key)
    return instantiate(node, **kwargs)
