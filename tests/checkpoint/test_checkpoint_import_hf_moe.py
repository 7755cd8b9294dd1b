"""Hugging Face MoE checkpoints (``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, tiny and random, made
here) on 2 gloo ranks, the logits equal to transformers' within 1e-5 (fp32, CPU) in two layouts:

* FSDP shards the stacked experts on the expert dim, so each rank reads only its own experts'
  per-expert tensors from the files;
* expert parallelism (``parallel.ep=2`` through ``parallelize``): each rank reads half the experts and
  feeds its own rows, which all-to-all dispatches to the rank holding their experts and back;

and on 4 ranks in the layouts ep composes with: ep=2 x dp_shard=2 (dp_shard 4), ep=2 x tp=2 and
ep=2 x pp=2 (the logits from the last stage, through the schedule).

The 1-rank parity, both ways, is tests/models/test_models_moe_families.py's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in the dev extra: the parity tests compare with its models")

from framework.checkpoint import init_from  # noqa: E402
from framework.config.schema import Config, Strategy  # noqa: E402
from framework.models import build_model  # noqa: E402
from framework.parallel import build_mesh, parallelize  # noqa: E402
from framework.planner.resolve import make_plan  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.models.test_models_moe_families import SEQ, TOL, hf_model, imported_cfg, tokens  # noqa: E402


def _fsdp_logits(rank: int, world: int, models: dict) -> dict:
    out = {}
    for family, (path, expected) in models.items():
        cfg = imported_cfg(path)
        full = Config(model=cfg)
        full.mesh.shape = [world]
        full.sharding.strategy = Strategy.fsdp
        full.train.seq_len, full.train.global_batch_size, full.train.micro_batch_size = SEQ, world, 1
        plan = make_plan(full)
        model = parallelize(
            build_model(cfg, SEQ), build_mesh(plan, "cpu"), plan, full.sharding, full.bucketing, full.executor,
            torch.device("cpu"), 0, load_weights=init_from.load,
        )  # fmt: skip
        experts = model.get_parameter("layers.0.feed_forward.experts.gate_up_proj")
        assert experts.to_local().shape[0] == cfg.moe.num_experts // world  # this rank's experts only
        with torch.no_grad():
            out[f"{family}/fsdp"] = (model(tokens()) - expected).abs().max().item()
        # ep=2 (parallel.ep, borrowed from dp_shard=2): each rank reads its half of the experts from
        # the files, and feeds its own row, which all-to-all dispatches to the experts' ranks and back.
        full.sharding.strategy = Strategy.auto
        full.parallel.dp_shard, full.parallel.ep = world, 2
        plan = make_plan(full)
        model = parallelize(
            build_model(cfg, SEQ), build_mesh(plan, "cpu"), plan, full.sharding, full.bucketing, full.executor,
            torch.device("cpu"), 0, load_weights=init_from.load,
        )  # fmt: skip
        experts = model.get_parameter("layers.0.feed_forward.experts.gate_up_proj")
        assert "ep" in experts.device_mesh.mesh_dim_names and experts.to_local().shape[0] == 2
        with torch.no_grad():  # this rank's row of the batch
            mine = model(tokens()[rank : rank + 1])
        out[f"{family}/ep2"] = (mine - expected[rank : rank + 1]).abs().max().item()
    return out


def test_two_gloo_ranks_fsdp_and_ep_equal_transformers(tmp_path) -> None:
    models = {}
    for family in ("qwen3_moe", "mixtral"):
        hf = hf_model(family)
        hf.save_pretrained(tmp_path / family, max_shard_size="60KB")
        with torch.no_grad():
            models[family] = (tmp_path / family, hf(tokens()).logits)
    out = run_ranks(_fsdp_logits, 2, models, timeout_s=300)
    print("HF MoE -> framework, 2 gloo ranks, max |logits diff|:", out)
    for diffs in out:
        assert len(diffs) == 4 and max(diffs.values()) <= TOL, diffs


LAYOUTS = [{"dp_shard": 4, "ep": 2}, {"dp_shard": 2, "tp": 2, "ep": 2}, {"pp": 2, "dp_shard": 2, "ep": 2}]


def _layout_logits(rank: int, world: int, models: dict, x: torch.Tensor) -> dict:
    """Each family's HF checkpoint through ``parallelize`` in each layout; each data-parallel rank
    feeds its own row of ``x``: the max |logits diff| against transformers' row (-1: a pipeline rank
    without the last stage, which holds no logits)."""
    from framework.parallel import dp_mesh_info
    from framework.parallel.pipeline import is_pipeline
    from framework.parallel.pipeline_run import pipeline_logits

    out = {}
    for family, (path, expected) in models.items():
        for layout in LAYOUTS:
            full = Config(model=imported_cfg(path))
            full.mesh.shape = [world]
            full.train.seq_len, full.train.global_batch_size = SEQ, 4
            for k, v in layout.items():
                setattr(full.parallel, k, v)
            plan = make_plan(full)
            mesh = build_mesh(plan, "cpu")
            model = parallelize(
                build_model(full.model, SEQ), mesh, plan, full.sharding, full.bucketing, full.executor,
                torch.device("cpu"), 0, load_weights=init_from.load,
            )  # fmt: skip
            row, _ = dp_mesh_info(mesh, plan)
            mine = x[row : row + 1]
            with torch.no_grad():
                if is_pipeline(model):
                    logits = pipeline_logits(model, mine, mine, torch.device("cpu"))
                else:
                    logits = model(mine)
            key = f"{family}/{plan.layout.short()}"
            out[key] = -1.0 if logits is None else (logits - expected[row : row + 1]).abs().max().item()
    return out


def test_four_gloo_ranks_ep_with_dp_shard_tp_and_pp_equal_transformers(tmp_path) -> None:
    x = torch.randint(0, 256, (4, SEQ), generator=torch.Generator().manual_seed(2))
    models = {}
    for family in ("qwen3_moe", "mixtral"):
        hf = hf_model(family)
        hf.save_pretrained(tmp_path / family, max_shard_size="60KB")
        with torch.no_grad():
            models[family] = (tmp_path / family, hf(x).logits)
    out = run_ranks(_layout_logits, 4, models, x, timeout_s=300)
    worst = {key: max(d[key] for d in out) for key in out[0]}
    print("HF MoE -> framework, 4 gloo ranks, max |logits diff|:", worst)
    for diffs in out:
        assert len(diffs) == 2 * len(LAYOUTS) and max(diffs.values()) <= TOL, diffs
    assert min(worst.values()) >= 0, worst  # every layout's logits were compared on some rank
