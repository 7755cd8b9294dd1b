"""A key's rule, the builders every group's table uses, the bounds they share, and the check that runs a table.

An entry is one of:
- a value rule: ``ok(value, cfg)`` decides (a relation to other keys reads ``cfg``), ``valid`` says
  what is valid (text, or a function of ``cfg`` when it depends on other keys);
- ``typed``: the schema type alone constrains the key (a bool, an Enum: OmegaConf refuses anything
  else at compose time);
- ``checked_by``: another pre-launch check owns the rule (the planner, the NCCL table, the local
  resources check, the allowlist); the table names it so that each rule lives in one place, and
  ``bad`` still gives a value the generated test proves it refuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from framework.config.schema import Config

INT64_MAX = 2**63 - 1  # step counters, sizes and seeds end up in int64 tensors and JSON

# Bounds on counts that the launcher or a rank loops over or holds in memory before the first step
# (each used to hang or fill the host: train.global_batch_size=1e11 counted its divisors one by one,
# train.eval_batches=1e8 built 12 GB of validation batches in 69 s).
MAX_LAYERS = 4096
MAX_GLOBAL_BATCH = 2**20  # sequences per step; the largest published runs use a few thousand
MAX_PREFETCH = 1024  # global batches held ahead in the data thread's queue
MAX_EVAL_BATCHES = 100_000
# Validation batches are built up front (int64 tokens on every rank): 2**28 tokens = 2 GiB.
MAX_EVAL_TOKENS = 2**28
# Upper bounds for every other number (model.moe.router_aux_loss_coef=1e18 and nccl.timeout_s=1e300
# were accepted; the second was an OverflowError traceback in every rank). Each is far above any
# published setting, so a bound only ever stops a typo or a runaway value.
MAX_WIDTH = 2**20  # model.dim, ffn_dim and expert widths: the widest published FFN is 53248
MAX_HEADS = 2**12  # attention heads: the largest published models have 128
MAX_POSITIONS = 2**24  # tokens of context (16M): the longest published contexts are 1-10M
MAX_STEPS = 10**9  # optimizer steps (and step intervals): three years at 10 steps a second
MAX_RESTARTS = 1000  # elastic restarts of the ranks: each reloads the last checkpoint
MAX_TIMEOUT_S = 7 * 24 * 3600  # a collective's timeout: a week (datetime.timedelta overflows at ~1e14 s)
MAX_RATE_GBPS = 1e6  # a link or memory bandwidth in GB/s: HBM3e is 8e3
MAX_EXPERTS = 2**16  # routed experts per layer; the largest published models have a few hundred

Valid = str | Callable[[Config], str]


@dataclass(frozen=True)
class Rule:
    valid: Valid = ""
    ok: Callable[[Any, Config], bool] | None = None
    # Out-of-range values for the generated test (each, set alone on the default config, is refused).
    bad: tuple[Any, ...] = ()
    # Other keys the test sets together with a bad value, when the rule only applies in that context.
    context: tuple[tuple[str, Any], ...] = ()
    typed: bool = False
    checked_by: str = ""


TYPED = Rule(typed=True)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(lo: int, hi: int = INT64_MAX, *, bad: tuple[Any, ...] = (), what: str = "") -> Rule:
    """An integer in [lo, hi]; ``what`` explains the special values (``0 = off``)."""
    top = "" if hi == INT64_MAX else f" and <= {hi}"
    text = f"an integer >= {lo}{top}" + (f" ({what})" if what else "")
    above = (hi + 1,) if hi < INT64_MAX else ()
    return Rule(text, lambda v, _c: is_int(v) and lo <= v <= hi, bad or (lo - 1, *above, 10**1000))


def number(
    lo: float,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    what: str = "",
    bad: tuple[Any, ...] = (),
) -> Rule:
    """A finite number in the interval; nan and inf are never valid (they poison every later step)."""

    def ok(v: Any, _c: Config) -> bool:
        if not is_number(v) or not math.isfinite(v):
            return False
        above = v > lo if lo_open else v >= lo
        below = v < hi if hi_open else v <= hi
        return above and below

    low = f"{'>' if lo_open else '>='} {lo:g}"
    high = "" if hi == math.inf else f" and {'<' if hi_open else '<='} {hi:g}"
    text = f"a finite number {low}{high}" + (f" ({what})" if what else "")
    above = () if hi == math.inf else (hi if hi_open else hi * 10 if hi > 0 else hi + 1,)
    default_bad = (math.nan, math.inf, lo if lo_open else lo - 1, *above)
    return Rule(text, ok, bad or default_bad)


def name(what: str = "a non-empty name") -> Rule:
    return Rule(what, lambda v, _c: isinstance(v, str) and v.strip() != "", ("",))


def optional_path(what: str = "") -> Rule:
    """None (unset) or a non-empty path; ``what`` names the check that looks at the file itself."""
    text = "unset (null) or a non-empty path" + (f"; {what}" if what else "")
    return Rule(text, lambda v, _c: v is None or (isinstance(v, str) and v.strip() != ""), ("",))


def optional_name(what: str) -> Rule:
    return Rule(what, lambda v, _c: v is None or (isinstance(v, str) and v.strip() != ""), ("",))


def names_list(what: str) -> Rule:
    return Rule(what, lambda v, _c: all(isinstance(s, str) and s.strip() for s in v), ([""],))


def family_name(c: Config) -> str:
    return getattr(c.model.family, "value", c.model.family)


ABSENT = object()


def value_at(cfg: Config, key: str) -> Any:
    """The value at a dotted key; ``ABSENT`` for another family's key (``model.sliding_window``
    under Llama: the key does not exist there, so no rule of it applies)."""
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part, ABSENT)
        if obj is ABSENT:
            return ABSENT
    return obj


def show(value: Any) -> str:
    """The value as the user wrote it, cut to one readable line (a 1000-digit int stays short)."""
    if isinstance(value, Enum):
        value = value.value
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:24]}...({len(text)} characters)"


def check_table(cfg: Config, rules: Mapping[str, Rule], group: str = "") -> None:
    """Raise ValueError (one line: key, value, what is valid) at the first key of ``rules`` (in table
    order; only ``group``'s keys when given) whose rule fails. A key absent from ``cfg`` (another
    family's) is skipped."""
    for key, rule in rules.items():
        if rule.ok is None or (group and not key.startswith(f"{group}.")):
            continue
        value = value_at(cfg, key)
        if value is not ABSENT and not rule.ok(value, cfg):
            valid = rule.valid(cfg) if callable(rule.valid) else rule.valid
            raise ValueError(f"{key}={show(value)} is not valid; valid: {valid}")
