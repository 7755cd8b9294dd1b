"""Every rank runs one resolved config in one run dir: checked across ranks before the first
collective of training, naming the differing keys or the ranks' run dirs (``check_same_config``), and
for torchrun what each rank composed before rank 0 resolves it (``check_same_composition``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import OmegaConf

from framework.config.schema import Config, flatten, to_yaml
from framework.parallel.process import DistEnv


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


def check_same_config(cfg: Config, env: DistEnv, run_dir: Path | None = None) -> str:
    """All ranks must run the same resolved config in the same run dir; stop naming the differing
    keys, or the ranks' run dirs, otherwise.

    Why the run dir: under torchrun each rank composes its own config, and a ``RUN_STAMP`` that
    differs between ranks (exported per host) puts them in different run dirs. The configs agree,
    but rank 0 then writes the run files where the others never look and every checkpoint save
    fails (each rank's files land in its own ``checkpoints/``)."""
    digest = config_hash(cfg)
    if env.world_size == 1:
        return digest
    flat = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    _check_ranks_agree(env, run_dir, digest, flat, "resolved")
    return digest


def check_same_composition(env: DistEnv, run_dir: Path, composed: dict[str, Any]) -> None:
    """``check_same_config`` for what each torchrun rank composed (its command line, unresolved),
    before rank 0 alone resolves it: the ranks would otherwise all run rank 0's config silently."""
    if env.world_size == 1:
        return
    digest = hashlib.sha256(json.dumps(composed, sort_keys=True, default=str).encode()).hexdigest()
    _check_ranks_agree(env, run_dir, digest, flatten(composed), "composed")


def _check_ranks_agree(
    env: DistEnv, run_dir: Path | None, digest: str, flat: dict[str, Any], what: str
) -> None:
    mine = (digest, str(run_dir) if run_dir is not None else None)
    pairs: list[tuple[str, str | None]] = [("", None)] * env.world_size
    dist.all_gather_object(pairs, mine)
    dirs = [d for _, d in pairs]
    if len(set(dirs)) > 1:
        differ = {r: d for r, d in enumerate(dirs) if d != dirs[0]}
        raise ValueError(
            f"ranks {sorted(differ)} run in a different run dir than rank 0 ({dirs[0]}): "
            f"{', '.join(f'rank {r}: {d}' for r, d in sorted(differ.items())[:4])}. Every rank must share "
            "one run dir: export the same RUN_STAMP on every host (or none, and pass the same --rdzv-id "
            "to torchrun)"
        )
    hashes = [h for h, _ in pairs]
    if len(set(hashes)) == 1:
        return
    flats: list[dict[str, Any]] = [{}] * env.world_size
    dist.all_gather_object(flats, flat)
    bad = sorted({k for f in flats for k in set(f) | set(flats[0]) if f.get(k) != flats[0].get(k)})
    ranks = [r for r, h in enumerate(hashes) if h != hashes[0]]
    raise ValueError(f"ranks {ranks} {what} a different config than rank 0; differing keys: {bad}")
