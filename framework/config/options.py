"""A field of one option set (``only_with``): the config reference and the launcher read its metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from enum import Enum
from typing import Any


def only_with(
    selector: str, *options: Enum | bool, default: Any = dataclasses.MISSING, factory: Any = None
) -> Any:
    """A field of one option (or a few): it means something only while ``selector`` (a config key)
    is one of ``options``. Set to anything but its default under another option, it would do
    nothing, so the launcher refuses it (``framework.config.rules.keys.check_option_fields``, one line naming
    the option) and the config reference says which option it belongs to."""
    meta = {"only_with": (selector, options)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)
