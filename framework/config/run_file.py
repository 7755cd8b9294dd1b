"""A run's ``config.yaml`` read back (``generate --config``, ``export-hf --config``): the typed
config, or one line saying what the file is instead, never its content.

Why never the content: OmegaConf's error quotes the offending key, and a file that is not YAML
config (``--config /etc/passwd``) parses as one long key: the error line quoted the whole file.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config.schema import Config, to_config

VALID = "valid: a run's config.yaml (RUN_DIR/config.yaml)"


def read_run_config(path: Path, named: str) -> Config:
    """The typed config in ``path``; ValueError naming ``named`` (``--config=PATH``) and what the
    file is: missing, a folder or device, not YAML text, not a mapping, or keys and values the
    schema refuses (the first such key, cut short)."""
    if not path.is_file():
        what = (
            "does not exist"
            if not path.exists()
            else "is a folder"
            if path.is_dir()
            else "is not a regular file (a FIFO, a socket or a device)"
        )
        raise ValueError(f"{named} {what}; {VALID}")
    try:
        raw = OmegaConf.load(path)
    except UnicodeDecodeError:
        raise ValueError(f"{named} is not a run's config.yaml (not text); {VALID}") from None
    except Exception as e:  # noqa: BLE001 - yaml's and OmegaConf's parse errors, any kind
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"{named} is not a run's config.yaml (not YAML{where}); {VALID}") from None
    if not isinstance(raw, DictConfig):
        raise ValueError(f"{named} is not a run's config.yaml (a YAML list, not a mapping); {VALID}")
    try:
        return to_config(raw)
    except (OmegaConfBaseException, TypeError, ValueError, AttributeError) as e:
        key = getattr(e, "full_key", None) or "?"
        raise ValueError(
            f"{named} is not a run's config.yaml (the schema refuses its key {_short(str(key))}: "
            f"{type(e).__name__}); {VALID}"
        ) from None


def _short(text: str, most: int = 40) -> str:
    """``text`` quoted, cut to ``most`` characters: a key may be a whole file's content."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}...({len(text)} characters)"
