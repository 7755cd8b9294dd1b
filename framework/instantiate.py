"""Safe instantiation: every ``_target_`` a config names must be on a default-deny allowlist.

Configs are data, shared across teams as recipes; a ``_target_`` turns data into a call. Hydra 1.3
has only a blocklist, and alias paths slipped past it (advisory GHSA-37p2-j732-x8pj:
``logging.os.system`` reaches ``os.system`` through an allowed-looking module). So a target passes
only if its dotted path starts with an allowed module prefix AND every module and object met while
resolving it really lives under an allowed prefix: ``framework.entry.os.system`` is refused because
``framework.entry.os`` is the module ``os``; a function imported into an allowed module is refused
when its ``__module__`` is not allowed. Nothing outside the allowlist is ever imported.

``check_targets`` runs at compose time (``framework.entry``), before anything runs;
``safe_instantiate`` is the only way framework code should call ``hydra.utils.instantiate``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

TARGET_KEY = "_target_"


def _prefixes(allow: list[str]) -> list[str]:
    """``torch.optim.`` and ``torch.optim`` both mean the module ``torch.optim`` and what lies below it."""
    return [a.rstrip(".") for a in allow if a.strip(".")]


def is_allowed_name(name: str, allow: list[str]) -> bool:
    """True when the dotted ``name`` is one of the allowed modules or lies below one."""
    return any(name == p or name.startswith(p + ".") for p in _prefixes(allow))


def _home(obj: Any) -> str:
    """The module an object really belongs to (a module's own name; a function's or class's module)."""
    if isinstance(obj, ModuleType):
        return obj.__name__
    home = getattr(obj, "__module__", None)
    return home if isinstance(home, str) else type(obj).__module__


def check_target(path: Any, allow: list[str], where: str = "_target_") -> None:
    """Raise ValueError unless ``path`` and everything it resolves through are on the allowlist."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}={path!r}: a _target_ must be a dotted path string")
    if not is_allowed_name(path, allow):
        raise ValueError(
            f"{where}={path!r} is not on the instantiation allowlist run.instantiate_allow={allow}; "
            "configs are data: add the module prefix to run.instantiate_allow (in conf/ or on the command line) "
            "if you trust it"
        )
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
        if not is_allowed_name(home, allow):
            raise ValueError(
                f"{where}={path!r} is refused: {dotted!r} is really {home!r}, which is not on the "
                f"instantiation allowlist {allow} (an alias path, see GHSA-37p2-j732-x8pj)"
            )


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


def check_targets(cfg: DictConfig | dict[str, Any], allow: list[str]) -> int:
    """Check every ``_target_`` of a config (the ``hydra`` node excepted); return how many there are.

    The ``hydra`` node comes only from conf/ and the command line: recipes that set it are refused
    when they are registered (framework.recipes), so it is not scanned here.
    """
    if isinstance(cfg, DictConfig):
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    else:
        container = cfg
    assert isinstance(container, dict)
    targets = [(k, v) for k, v in find_targets(container) if not k.startswith("hydra.")]
    for key, value in targets:
        check_target(value, allow, where=key)
    return len(targets)


def safe_instantiate(node: DictConfig | dict[str, Any], allow: list[str], **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` after checking every ``_target_`` in ``node`` against ``allow``."""
    from hydra.utils import instantiate

    container = (
        OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node
    )
    for key, value in find_targets(container):
        check_target(value, allow, where=key)
    return instantiate(node, **kwargs)
