"""DeepSeek-V3 (the ``deepseek_v3_tiny`` recipe's model) trained on 2 gloo ranks against one process.

The recipe as shipped (multi-head latent attention, one dense layer then three MoE layers with a
shared expert, group-limited sigmoid routing, routed_scaling_factor 2.5) with the aux-loss-free bias
update after every optimizer step (so step 2 routes by the biases step 1 set), trained 2 steps by the
framework's ``train_step`` (AdamW, clipping that clips) on the same global batch: loss and gradient
norm of every step within rtol 1e-5 of one process, and the routers' biases equal, in each layout:
expert parallelism (ep=2, and with full activation checkpointing: backward reruns the all-to-alls),
tensor parallelism (tp=2: the latent attention whole on each TP rank, the dense MLP sharded) and a
pipeline (pp=2, cut by cost: the dense layer is cheaper than an MoE one). And ``gpt_oss_tiny`` (the
other family on the layer-kind stack) under FSDP, tp=2, pp=2 and expert parallelism (ep=2: its biased
experts sharded with their biases, the same all-to-all dispatch).
"""

from __future__ import annotations

import functools

import torch

from framework.config.schema import ActivationCheckpointing, Config
from framework.launch.recipes import compose_recipe
from framework.models import build_model, materialize
from framework.parallel import build_mesh, dp_mesh_info, parallelize
from framework.planner.resolve import make_plan
from framework.train.loop import train_step
from framework.train.optimizers import build_optimizer, build_scheduler
from framework.train.runner import _update_biases
from tests.dist import run_ranks

SEQ, GLOBAL_BATCH, STEPS, RTOL = 16, 8, 2, 1e-5
CPU = torch.device("cpu")
LAYOUTS = [{"ep": 2}, {"ep": 2, "ac": "full"}, {"tp": 2}, {"pp": 2}]


def make_cfg(world: int, recipe: str = "deepseek_v3_tiny", **parallel: object) -> Config:
    cfg = compose_recipe(recipe)
    cfg.mesh.shape = [world]
    cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = SEQ, GLOBAL_BATCH, 0
    cfg.train.grad_clip, cfg.train.warmup_steps = 0.3, 0
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def run_steps(model: torch.nn.Module, cfg: Config, dp_rank: int, dp_size: int, micro: int) -> dict:
    opt = build_optimizer(model, cfg.train, CPU)
    sched = build_scheduler(opt, cfg.train)
    opt.register_step_post_hook(functools.partial(_update_biases, model))
    steps = []
    n = GLOBAL_BATCH // dp_size
    for b in batches():
        mine = b[dp_rank * n : (dp_rank + 1) * n]
        mbs = [(mine[i : i + micro, :-1], mine[i : i + micro, 1:]) for i in range(0, n, micro)]
        r = train_step(model, opt, sched, mbs, cfg.train.grad_clip, CPU)
        steps.append((r.loss, r.grad_norm))
    biases = {
        n.removeprefix("_orig_mod."): b.tolist()
        for n, b in model.named_buffers()
        if n.endswith("expert_bias")
    }
    return {"steps": steps, "biases": biases}


def reference(recipe: str = "deepseek_v3_tiny") -> dict:
    cfg = make_cfg(1, recipe)
    model = build_model(cfg.model, SEQ)
    materialize(model, CPU, 0)
    return run_steps(model, cfg, 0, 1, GLOBAL_BATCH)


def _worker(
    rank: int, world: int, recipe: str = "deepseek_v3_tiny", layouts: list | None = None
) -> list[dict]:
    out = []
    for layout in LAYOUTS if layouts is None else layouts:
        cfg = make_cfg(world, recipe, **{k: v for k, v in layout.items() if k != "ac"})
        cfg.sharding.activation_checkpointing = ActivationCheckpointing(layout.get("ac", "none"))
        plan = make_plan(cfg)
        mesh = build_mesh(plan, "cpu")
        model = build_model(cfg.model, SEQ)
        model = parallelize(model, mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, CPU, 0)
        dp_rank, dp_size = dp_mesh_info(mesh, plan)
        result = run_steps(model, cfg, dp_rank, dp_size, plan.micro_batch_size)
        name = plan.layout.short() + (f" ac={layout['ac']}" if "ac" in layout else "")
        out.append({"layout": name, **result})
    return out


def test_two_gloo_ranks_ep_tp_pp_train_as_one_process() -> None:
    ref = reference()
    assert len(ref["biases"]) == 3 and all(
        any(ref["biases"][k]) for k in ref["biases"]
    )  # 3 MoE layers, moved
    worst = {}
    for rank in run_ranks(_worker, 2):
        for r in rank:
            for got, want in zip(r["steps"], ref["steps"], strict=True):
                for name, a, b in zip(("loss", "grad_norm"), got, want, strict=True):
                    assert abs(a - b) <= RTOL * abs(b), (r["layout"], name, a, b)
                    worst[r["layout"]] = max(worst.get(r["layout"], 0.0), abs(a - b) / abs(b))
            # a pipeline rank holds its own layers' routers
            for name, bias in r["biases"].items():
                torch.testing.assert_close(bias, ref["biases"][name], rtol=0, atol=0)
    print("deepseek_v3_tiny, 2 gloo ranks, worst relative loss/grad-norm difference:", worst)
    assert len(worst) == len(LAYOUTS), worst


GPT_OSS_LAYOUTS = [{"dp_shard": 2}, {"tp": 2}, {"pp": 2}]


def test_gpt_oss_on_two_gloo_ranks_fsdp_tp_pp_trains_as_one_process() -> None:
    """``gpt_oss_tiny`` (sinks, sliding and full layers, biased experts) trained 2 steps: FSDP over its
    stacked experts, tp=2 (attention and the MoE layer whole on each TP rank) and pp=2, loss and
    gradient norm within rtol 1e-5 of one process."""
    ref = reference("gpt_oss_tiny")
    worst = {}
    for rank in run_ranks(_worker, 2, "gpt_oss_tiny", GPT_OSS_LAYOUTS):
        for r in rank:
            for got, want in zip(r["steps"], ref["steps"], strict=True):
                for name, a, b in zip(("loss", "grad_norm"), got, want, strict=True):
                    assert abs(a - b) <= RTOL * abs(b), (r["layout"], name, a, b)
                    worst[r["layout"]] = max(worst.get(r["layout"], 0.0), abs(a - b) / abs(b))
    print("gpt_oss_tiny, 2 gloo ranks, worst relative loss/grad-norm difference:", worst)
    assert len(worst) == len(GPT_OSS_LAYOUTS), worst


def test_gpt_oss_expert_parallel_trains_as_one_process() -> None:
    """``gpt_oss_tiny`` under ep=2: each rank holds two of the four experts with their biases (the
    stacks and the biases sharded by expert), tokens moved by the all-to-all dispatch the other MoE
    families use; 2 steps' loss and gradient norm within rtol 1e-5 of one process."""
    ref = reference("gpt_oss_tiny")
    worst = 0.0
    for rank in run_ranks(_worker, 2, "gpt_oss_tiny", [{"ep": 2}]):
        for r in rank:
            assert "e2" in r["layout"], r["layout"]
            for got, want in zip(r["steps"], ref["steps"], strict=True):
                for name, a, b in zip(("loss", "grad_norm"), got, want, strict=True):
                    assert abs(a - b) <= RTOL * abs(b), (r["layout"], name, a, b)
                    worst = max(worst, abs(a - b) / abs(b))
    print("gpt_oss_tiny ep=2 on 2 gloo ranks, worst relative loss/grad-norm difference:", worst)
