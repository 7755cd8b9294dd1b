"""One composition per ``python train.py`` launch instead of two: Hydra's mode probe, skipped where it
can only find nothing.

Before it runs or sweeps, Hydra 1.3 composes the whole config once just to read ``hydra.mode``
(``Hydra.get_mode``, called by ``_run_hydra``), then composes it again for the run. The probe's answer
is None unless something sets ``hydra.mode``: nothing under conf/ does, a recipe may not touch
``hydra`` (framework.launch.recipe_check), so only the command line can, through ``hydra.mode=`` or a
``hydra/GROUP=OPTION`` choice (a plugin's config). Without either, ``skip_mode_probe`` answers None
as the probe would, and the launch composes once: ~0.4 s of CPU less for every ``python train.py``
(a refusal, a dry run, each run). With either, Hydra probes as before; a composition that fails is
reported by the run's own composition either way (the probe swallowed its error).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


def may_set_mode(overrides: Sequence[str]) -> bool:
    """Whether a command-line override can set ``hydra.mode``: ``hydra.mode=...`` itself (with any
    of ``+``, ``++``, ``~``) or a ``hydra/GROUP=OPTION`` choice, whose config could set it."""
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in ("hydra", "hydra.mode") or key.startswith("hydra/"):
            return True
    return False


@contextlib.contextmanager
def skip_mode_probe(argv: Sequence[str]) -> Iterator[None]:
    """Within: ``Hydra.get_mode`` answers None without composing when no override in ``argv`` may
    set ``hydra.mode`` (see the module docstring); otherwise it is Hydra's own."""
    from hydra._internal.hydra import Hydra

    probe = Hydra.get_mode

    def get_mode(self: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        if may_set_mode(overrides):
            return probe(self, config_name, overrides)
        return None

    Hydra.get_mode = get_mode  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = probe  # type: ignore[method-assign]
