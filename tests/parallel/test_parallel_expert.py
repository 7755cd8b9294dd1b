"""Expert parallelism (framework.parallel.expert) on real gloo ranks, against one process.

Two levels: the MoE layer alone (``shard_experts`` on a 2-rank ep mesh: outputs and every gradient
equal, rtol 1e-5), and a decoder whose blocks are MoE blocks, built by ``parallelize`` from the plan
of ``parallel.ep`` with the other degrees, trained 2 steps by the framework's ``train_step`` (AdamW,
clipping that clips) on the same global batch: loss and gradient norm of every step within rtol 1e-5
of one process. All the 4-rank layouts run in one process group (one fork of 4 ranks), as they are
the expensive part on a 2-core machine.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from framework.checkpoint import Checkpointer
from framework.config.schema import (
    ActivationCheckpointing,
    AuxLossScope,
    CompileScope,
    Config,
    ExecutorConfig,
    ExecutorMode,
    ModelFamily,
    PPSchedule,
    RouterScore,
)
from framework.data.sampler import BatchSampler
from framework.models import build_model, materialize
from framework.models.moe import ExpertKernel, MoE, MoEConfig
from framework.models.parts.decoder import Decoder
from framework.models.parts.sparse import take_load
from framework.parallel import build_mesh, dp_mesh_info, parallelize
from framework.parallel.expert import ExpertParallel, expert_major_order, shard_experts
from framework.planner.resolve import make_plan
from framework.train.loop import train_step
from framework.train.optimizers import build_optimizer, build_scheduler
from framework.train.runner import _update_biases
from tests.dist import run_ranks

TOKENS = 24  # per rank, layer tests
SEQ, GLOBAL_BATCH, STEPS, RTOL = 16, 8, 2, 1e-5
CPU = torch.device("cpu")
NUM_EXPERTS = 8


# ------------------------------------------------------------------------------------------------
# The layer alone
# ------------------------------------------------------------------------------------------------


def _cfg(kernel: ExpertKernel, shared: int) -> MoEConfig:
    return MoEConfig(
        dim=16,
        moe_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=shared,
        kernel=kernel,
    )


def _inputs(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(world * TOKENS, 16, generator=g), torch.randn(world * TOKENS, 16, generator=g)


def _reference(world: int, kernel: ExpertKernel, shared: int) -> dict[str, torch.Tensor]:
    """One process, the whole batch, every expert."""
    torch.manual_seed(0)
    moe = MoE(_cfg(kernel, shared))
    x, g = _inputs(world)
    x.requires_grad_()
    out = moe(x)
    (out * g).sum().backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return {"out": out.detach(), "x.grad": x.grad, **grads}


def _ep_rank(rank: int, world: int, kernel: ExpertKernel, shared: int) -> dict[str, torch.Tensor]:
    """This rank's tokens, this rank's experts; the replicated parameters' gradients all-reduced, as the
    data-parallel wrapper over the ep axis does."""
    torch.manual_seed(0)
    moe = shard_experts(MoE(_cfg(kernel, shared)), init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    assert isinstance(moe.experts, ExpertParallel)
    assert moe.experts.down_proj.placements == (Shard(0),) and moe.experts.down_proj.shape[0] == 8
    x, g = (t[rank * TOKENS : (rank + 1) * TOKENS] for t in _inputs(world))
    x.requires_grad_()
    out = moe(x)
    (out * g).sum().backward()
    grads = {}
    for n, p in moe.named_parameters():
        grad = p.grad
        if isinstance(grad, DTensor):
            grad = grad.to_local()  # this rank's experts' gradients
        else:
            dist.all_reduce(grad)
        grads[n] = grad
    return {"out": out.detach(), "x.grad": x.grad, **grads}


def test_ep2_layer_equals_one_process() -> None:
    world = 2
    nl = 8 // world
    for kernel, shared in ((ExpertKernel.AUTO, 0), (ExpertKernel.LOOP, 1)):
        ref = _reference(world, kernel, shared)
        for r, got in enumerate(run_ranks(_ep_rank, world, kernel, shared)):
            rows = slice(r * TOKENS, (r + 1) * TOKENS)
            torch.testing.assert_close(got["out"], ref["out"][rows], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["x.grad"], ref["x.grad"][rows], rtol=1e-5, atol=1e-6)
            for name in ("experts.gate_up_proj", "experts.down_proj"):
                torch.testing.assert_close(got[name], ref[name][r * nl : (r + 1) * nl], rtol=1e-5, atol=1e-6)
            for name in ref:
                if name.startswith(("gate.", "shared_experts.")):
                    torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6)
        assert ref["experts.down_proj"].abs().sum() > 0


def test_expert_major_order() -> None:
    # 2 source ranks x 2 local experts: rows arrive (s0 e0: 2, s0 e1: 1, s1 e0: 1, s1 e1: 3)
    recv = torch.tensor([[2, 1], [1, 3]])
    assert expert_major_order(recv).tolist() == [0, 1, 3, 2, 4, 5, 6]


# ------------------------------------------------------------------------------------------------
# A decoder with MoE blocks, through parallelize
# ------------------------------------------------------------------------------------------------


def make_cfg(world: int, aux: float = 0.0, scope: str = "global", layers: int = 2, **parallel: int) -> Config:
    """Tiny Qwen3-MoE (8 experts, top 2, untied for the pipeline). The load-balancing loss is off
    unless ``aux`` (its coefficient) is given: the layouts below are about the experts; the loss
    over the data-parallel ranks has its own tests (``test_aux_loss_*``), which turn it on, with
    ``scope`` (``model.moe.aux_loss_scope``). ``parallel``: its degrees, and ``pp_schedule`` by name."""
    cfg = Config()
    cfg.mesh.shape = [world]
    m = cfg.model
    m.family, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim = (
        ModelFamily.qwen3_moe,
        32,
        layers,
        4,
        2,
        64,
    )
    m.tie_embeddings = False
    m.moe.num_experts, m.moe.num_experts_per_tok, m.moe.moe_intermediate_size = NUM_EXPERTS, 2, 16
    m.moe.router_aux_loss_coef = aux
    m.moe.aux_loss_scope = AuxLossScope[scope]
    cfg.train.seq_len = SEQ
    cfg.train.global_batch_size = GLOBAL_BATCH
    cfg.train.grad_clip = 0.3
    cfg.train.warmup_steps = 0
    for k, v in parallel.items():
        setattr(cfg.parallel, k, PPSchedule[v] if k == "pp_schedule" else v)
    return cfg


def moe_decoder(cfg: Config) -> Decoder:
    """The family's decoder on meta, as the trainer builds it."""
    return build_model(cfg.model, SEQ)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def run_steps(
    model: torch.nn.Module, cfg: Config, dp_rank: int, dp_size: int, micro: int, steps: int = STEPS
) -> list[tuple]:
    opt = build_optimizer(model, cfg.train, CPU)
    sched = build_scheduler(opt, cfg.train)
    out = []
    n = GLOBAL_BATCH // dp_size
    for b in batches()[:steps]:
        mine = b[dp_rank * n : (dp_rank + 1) * n]
        mbs = [(mine[i : i + micro, :-1], mine[i : i + micro, 1:]) for i in range(0, n, micro)]
        r = train_step(model, opt, sched, mbs, cfg.train.grad_clip, CPU)
        out.append((r.loss, r.grad_norm, r.aux))
    return out


def reference_steps(
    aux: float = 0.0, groups: tuple[int, int] | None = None, scope: str = "global", layers: int = 2
) -> list[tuple]:
    """One process over the whole global batch. ``groups`` (dp size, micro batch): one micro batch
    per accumulation step of that data-parallel layout, holding every rank's rows of that step (rank
    0's micro batch i, then rank 1's ...): the tokens one load-balancing loss spans there."""
    cfg = make_cfg(1, aux, scope, layers)
    model = moe_decoder(cfg)
    materialize(model, CPU, 0)
    if groups is None:
        return run_steps(model, cfg, 0, 1, GLOBAL_BATCH)
    dp, micro = groups
    opt = build_optimizer(model, cfg.train, CPU)
    sched = build_scheduler(opt, cfg.train)
    out = []
    n = GLOBAL_BATCH // dp
    for b in batches():
        steps = [torch.cat([b[r * n + i : r * n + i + micro] for r in range(dp)]) for i in range(0, n, micro)]
        r = train_step(model, opt, sched, [(m[:, :-1], m[:, 1:]) for m in steps], cfg.train.grad_clip, CPU)
        out.append((r.loss, r.grad_norm, r.aux))
    return out


def parallel_model(cfg: Config) -> tuple[torch.nn.Module, object, object]:
    plan = make_plan(cfg)
    mesh = build_mesh(plan, "cpu")
    model = parallelize(moe_decoder(cfg), mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, CPU, 0)
    return model, mesh, plan


def _layouts_worker(rank: int, world: int, layouts: list[dict]) -> list[dict]:
    out = []
    for layout in layouts:
        parallel = {k: v for k, v in layout.items() if k != "ac"}
        cfg = make_cfg(world, **parallel)
        cfg.sharding.activation_checkpointing = ActivationCheckpointing(layout.get("ac", "none"))
        model, mesh, plan = parallel_model(cfg)
        experts = {n: p for n, p in model.named_parameters() if "experts." in n}
        assert experts, "no expert weights"
        for n, p in experts.items():  # global shape, this rank's E / ep experts (then FSDP's share)
            assert isinstance(p, DTensor) and p.shape[0] == NUM_EXPERTS, (n, p)
            assert "ep" in p.device_mesh.mesh_dim_names, (n, p.device_mesh)
        dp_rank, dp_size = dp_mesh_info(mesh, plan)
        out.append(
            {
                "layout": plan.layout.short(),
                "steps": run_steps(model, cfg, dp_rank, dp_size, plan.micro_batch_size),
            }
        )
    return out


def _check(results: list[list[dict]], reference: list[tuple]) -> float:
    """Loss, gradient norm (and the load-balancing term where one was added) of every step and rank
    within RTOL of one process's; returns the largest relative difference."""
    worst = 0.0
    for rank_results in results:
        for r in rank_results:
            for got, want in zip(r["steps"], reference, strict=True):
                for name, a, b in zip(("loss", "grad_norm", "aux"), got, want, strict=True):
                    assert (a is None) == (b is None), (r["layout"], name, a, b)
                    if a is not None:
                        assert abs(a - b) <= RTOL * abs(b), (r["layout"], name, a, b)
                        worst = max(worst, abs(a - b) / abs(b))
    return worst


def test_decoder_ep2_matches_one_process() -> None:
    """ep=2 on 2 ranks, and with full activation checkpointing (backward reruns the all-to-alls)."""
    ref = reference_steps()
    _check(run_ranks(_layouts_worker, 2, [{"ep": 2}, {"ep": 2, "ac": "full"}]), ref)


def test_decoder_ep_composed_on_4_ranks_matches_one_process() -> None:
    """ep=2 x dp_shard=2 (dp_shard 4 = 2 replicas of each expert shard x ep 2), ep=4 (every dp_shard
    rank its own experts), HSDP with ep (dp_replicate 2 x dp_shard 2, ep 2), ep=2 x tp=2 (TP on
    attention, the MoE layer whole on each TP rank) and ep=2 x pp=2."""
    ref = reference_steps()
    layouts = [
        {"dp_shard": 4, "ep": 2},
        {"dp_shard": 4, "ep": 4},
        {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
        {"dp_shard": 2, "tp": 2, "ep": 2},
        {"pp": 2, "dp_shard": 2, "ep": 2},
    ]
    _check(run_ranks(_layouts_worker, 4, layouts), ref)


def test_torch_2_11s_nested_expert_units_match_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FSDP2's per-parameter mesh (torch 2.11, the GPU machines' torch) the experts are a unit
    of their own inside each block's: ep=2 x dp_shard=2 and HSDP with ep still equal one process."""
    from framework.parallel import data_parallel

    monkeypatch.setattr(data_parallel, "ShardPlacementResult", None)  # the forked ranks inherit it
    layouts = [{"dp_shard": 4, "ep": 2}, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}]
    _check(run_ranks(_layouts_worker, 4, layouts), reference_steps())


def _compile_worker(rank: int, world: int) -> dict:
    """ep=2 built eager, then compiled per block (``aot_eager`` through a backend that records each
    graph's calls), each trained the same 2 steps with the load-balancing loss on."""
    from torch._dynamo.utils import counters

    graphs: list[list[str]] = []

    @torch._dynamo.register_backend(name="recorded_aot_eager")  # type: ignore[misc]
    def recorded(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    out: dict = {}
    for mode in (ExecutorMode.eager, ExecutorMode.compile):
        cfg = make_cfg(world, AUX, ep=2)
        cfg.executor = ExecutorConfig(mode=mode, scope=CompileScope.block, backend="recorded_aot_eager")
        counters.clear()
        model, mesh, plan = parallel_model(cfg)
        dp_rank, dp_size = dp_mesh_info(mesh, plan)
        out[mode.value] = run_steps(model, cfg, dp_rank, dp_size, plan.micro_batch_size)
    out["graph_breaks"] = dict(counters["graph_break"])
    out["graphs"] = graphs
    return out


def test_ep2_compiles_each_moe_block_as_one_graph_with_eager_losses() -> None:
    """``executor=compile`` under ``parallel.ep=2``: each MoE block is one graph (fullgraph, so a
    break would raise, which the launcher's ladder would turn into a fallback to eager), holding the
    counts' and the rows' all-to-alls; loss and gradient norm of each step equal eager's (rtol 1e-5).
    It fell back before: FSDP2's hooks on the experts' own unit, nested in the block, are skipped by
    Dynamo (framework.parallel.data_parallel.ExpertShards)."""
    for r in run_ranks(_compile_worker, 2):
        assert r["graph_breaks"] == {}, r["graph_breaks"]
        a2a = [g for g in r["graphs"] if sum("all_to_all_single" in t for t in g) >= 3]
        assert a2a, "no compiled graph holds the all-to-alls (counts, dispatch, combine)"
        for (loss, norm, _), (ref_loss, ref_norm, _) in zip(r["compile"], r["eager"], strict=True):
            assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (r["compile"], r["eager"])
            assert abs(norm - ref_norm) <= RTOL * abs(ref_norm), (r["compile"], r["eager"])
        print(f"ep=2 compile vs eager: {r['compile']} vs {r['eager']}")


# ------------------------------------------------------------------------------------------------
# The load-balancing loss over the data-parallel ranks' tokens
# ------------------------------------------------------------------------------------------------

AUX = 0.1  # large enough that each rank's own loss (of its tokens alone) misses rtol 1e-5 (checked)


def _aux_worker(rank: int, world: int, layouts: list[dict]) -> list[dict]:
    """Each layout (its degrees, and ``micro``: the micro batch, the plan's by default) trained with
    the load-balancing loss on; with ``local``, also with each rank's loss over its own tokens only
    (``token_group`` unset: what every rank computed before), which must miss the reference."""
    out = []
    for layout in layouts:
        parallel = {k: v for k, v in layout.items() if k not in ("micro", "local", "scope", "layers")}
        cfg = make_cfg(world, AUX, layout.get("scope", "global"), layout.get("layers", 2), **parallel)
        r: dict = {}
        for local in (False, True) if layout.get("local") else (False,):
            model, mesh, plan = parallel_model(cfg)
            if local:
                for m in model.modules():
                    if isinstance(m, Decoder):
                        m.token_group = None
            dp_rank, dp_size = dp_mesh_info(mesh, plan)
            micro = layout.get("micro", plan.micro_batch_size)
            r["layout"] = f"{plan.layout.short()} micro {micro}"
            r["local" if local else "steps"] = run_steps(model, cfg, dp_rank, dp_size, micro)
        out.append(r)
    return out


def test_aux_loss_over_data_parallel_ranks_matches_one_process() -> None:
    """With ``model.moe.router_aux_loss_coef`` on, dp_shard=2 and ep=2 (ep's ranks are dp_shard's:
    they hold other tokens) reproduce one process over the global batch within rtol 1e-5 on the loss
    and the gradient norm: the counts and probabilities are all-reduced over the data-parallel ranks
    (autograd's all_reduce, so the routers' gradients are the whole batch's). Each rank's own loss,
    as before, misses. With 2 micro batches per rank, each forward's loss spans the two ranks' micro
    batches of that step: one process whose micro batches hold those rows computes the same."""
    ref = reference_steps(AUX)
    results = run_ranks(_aux_worker, 2, [{"dp_shard": 2, "local": True}, {"ep": 2}])
    _check(results, ref)
    for rank_results in results:
        local = rank_results[0]["local"]
        assert any(abs(a[1] - b[1]) > RTOL * abs(b[1]) for a, b in zip(local, ref, strict=True)), (local, ref)
    accumulated = reference_steps(AUX, groups=(2, 2))
    _check(run_ranks(_aux_worker, 2, [{"dp_shard": 2, "micro": 2}, {"ep": 2, "micro": 2}]), accumulated)


def test_aux_loss_over_hsdp_and_tp_matches_one_process() -> None:
    """4 ranks: HSDP with ep (dp_replicate 2 x dp_shard 2, ep 2: the loss spans all 4 ranks' tokens)
    and ep=2 x tp=2 (the TP ranks hold the same tokens: the loss spans the 2 data-parallel ranks, not
    4, or every count would be doubled)."""
    ref = reference_steps(AUX)
    layouts = [{"dp_replicate": 2, "dp_shard": 2, "ep": 2}, {"dp_shard": 2, "tp": 2, "ep": 2}]
    _check(run_ranks(_aux_worker, 4, layouts), ref)


def test_layer_scope_on_one_rank_equals_a_hand_computation() -> None:
    """``model.moe.aux_loss_scope=layer`` on one process: the step's loss is the cross-entropy plus
    the coefficient times the mean over layers of ``E * sum_e f_e P_e``, each layer's ``f`` (the share
    of its top-k assignments per expert) and ``P`` (its mean router probability) computed here from
    its router logits; the step's ``aux`` (``moe_aux_loss``) is that mean, the term the loss added.
    transformers' coupled loss (``global``) over the same logits is another number."""
    cfg = make_cfg(1, AUX, "layer")
    model = moe_decoder(cfg)
    materialize(model, CPU, 0)
    b = batches()[0]
    x, y = b[:, :-1], b[:, 1:]
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        logits = [m.stats.router_logits for m in model.modules() if isinstance(m, MoE)]
    per_layer = []
    for r in logits:
        probs = torch.softmax(r.float(), -1)
        chosen = torch.nn.functional.one_hot(probs.topk(2, -1).indices, NUM_EXPERTS).sum(1).float()
        per_layer.append(NUM_EXPERTS * (chosen.mean(0) * probs.mean(0)).sum())
    hand = torch.stack(per_layer).mean().item()
    opt = build_optimizer(model, cfg.train, CPU)
    r = train_step(model, opt, build_scheduler(opt, cfg.train), [(x, y)], cfg.train.grad_clip, CPU)
    assert len(per_layer) == 2 and r.aux is not None
    assert abs(r.aux - hand) <= 1e-6 * hand, (r.aux, hand)
    assert abs(r.loss - (ce.item() + AUX * hand)) <= 1e-6 * r.loss, (r.loss, ce.item(), hand)
    probs = [torch.softmax(r.float(), -1) for r in logits]
    chosen = [torch.nn.functional.one_hot(p.topk(2, -1).indices, NUM_EXPERTS).sum(1).float() for p in probs]
    coupled = NUM_EXPERTS * (torch.cat(chosen).mean(0) * torch.cat(probs).mean(0)).sum().item()
    assert abs(coupled - hand) > 1e-4 * hand, (coupled, hand)
    print(f"layer scope, one rank: aux {r.aux:.6f} = hand {hand:.6f} (global scope: {coupled:.6f})")


def test_aux_loss_under_pp2_matches_one_process() -> None:
    """pp=2 on 2 ranks with the load-balancing loss on (coefficient 0.1, ``aux_loss_scope=layer``):
    each stage injects its layers' share into backward through its output (Megatron's
    MoEAuxLossAutoScaler), the schedule's micro batches scale it as the loss; loss, gradient norm and
    the term match one process over the same micro batches within rtol 1e-5: 1F1B over 2 micro
    batches, and ZB-V (4 layers, 2 stages per rank, 4 micro batches), whose split backward takes
    the injected gradient in its input pass."""
    ref = reference_steps(AUX, groups=(1, GLOBAL_BATCH // 2), scope="layer")
    worst = _check(run_ranks(_aux_worker, 2, [{"pp": 2, "scope": "layer"}]), ref)
    zbv = {"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2, "pp_microbatches": 4, "layers": 4}
    ref = reference_steps(AUX, groups=(1, GLOBAL_BATCH // 4), scope="layer", layers=4)
    worst = max(worst, _check(run_ranks(_aux_worker, 2, [{**zbv, "scope": "layer"}]), ref))
    print(f"pp=2 (1F1B, ZB-V) with the aux loss: max relative difference {worst:.1e} (loss, grad norm, aux)")


def test_aux_loss_under_ep2_x_pp2_matches_one_process() -> None:
    """ep=2 x pp=2 on 4 ranks (dp_shard 2 = ep 2, 2 micro batches per rank): the stage's share spans
    both data-parallel ranks' micro batch i (an all-reduce per stage and micro batch), as one process
    whose micro batches hold those rows computes it; rtol 1e-5 on loss, gradient norm and the term."""
    ref = reference_steps(AUX, groups=(2, GLOBAL_BATCH // 4), scope="layer")
    layout = {"pp": 2, "dp_shard": 2, "ep": 2, "scope": "layer"}
    worst = _check(run_ranks(_aux_worker, 4, [layout]), ref)
    print(f"ep=2 x pp=2 with the aux loss: max relative difference {worst:.1e} (loss, grad norm, aux)")


def _step1_load(model: torch.nn.Module) -> dict[str, tuple[list[int], int]]:
    """Per sparse block of ``model`` (its single-process name): tokens routed per expert and dropped."""
    return {name: (load.tolist(), int(dropped)) for name, load, dropped in take_load(model)}


def _load_worker(rank: int, world: int, layouts: list[dict]) -> list[dict[str, tuple[list[int], int]]]:
    """Each layout trained one step; its blocks' expert load since the build (step 1's)."""
    out = []
    for layout in layouts:
        cfg = make_cfg(
            world, layers=layout.get("layers", 2), **{k: v for k, v in layout.items() if k != "layers"}
        )
        model, mesh, plan = parallel_model(cfg)
        dp_rank, dp_size = dp_mesh_info(mesh, plan)
        run_steps(model, cfg, dp_rank, dp_size, plan.micro_batch_size, steps=1)
        out.append(_step1_load(model))
    return out


def test_step1_expert_load_under_pp2_equals_one_process() -> None:
    """Issue 25: step 1's expert load (what ``balance_row`` writes to metrics.jsonl) under pp=2 counts
    the step's micro batches only, not the schedule's shape probe (one more forward of each stage on
    its first step: the first micro batch again on stage 0, uninitialised inputs on stage 1): each
    block's tokens per expert equal one process's over the same batch, exactly. 1F1B (one stage per
    rank, the probe's input sent across ranks) and ZB-V (4 layers, 2 stages per rank, the probe's
    shapes handed between one rank's stages)."""
    zbv = {"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2, "pp_microbatches": 4, "layers": 4}
    results = run_ranks(_load_worker, 2, [{"pp": 2}, zbv])
    for i, layers in enumerate((2, 4)):
        cfg = make_cfg(1, layers=layers)
        model = moe_decoder(cfg)
        materialize(model, CPU, 0)
        run_steps(model, cfg, 0, 1, GLOBAL_BATCH, steps=1)
        want = _step1_load(model)
        got = {name: v for rank in results for name, v in rank[i].items()}
        assert got == want, (i, got, want)
        assert sum(want["layers.0"][0]) == GLOBAL_BATCH * SEQ * 2  # every token's top-2, once
    print(f"step 1's expert load under pp=2 (1F1B, ZB-V) = one process's: {want}")


def test_a_pipeline_wrapper_names_its_stages_token_group() -> None:
    """``token_group_of`` on the pipeline wrapper (what the bias update and the balance row are given)
    is its stages' data-parallel group: the wrapper registers the stages' layers, not the stages, and
    found no Decoder, so under pp x dp the sigmoid routers' bias summed one rank's load only."""
    from framework.models import token_group_of
    from framework.parallel.pipeline import PipelineModel, cut_stage

    stage = cut_stage(moe_decoder(make_cfg(2)), range(0, 1), True, False)
    group = object()
    stage.token_group = group
    assert token_group_of(PipelineModel([stage], [0], 2)) is group and token_group_of(stage) is group


def test_global_scope_under_a_pipeline_becomes_layer_with_one_warning_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The launcher takes ``layer`` for ``global`` under pp (config.yaml gets it) with one warning
    line, only where the loss is on; a pipeline built from code takes it too."""
    from framework.launch.prelaunch import aux_scope_under_pipeline
    from framework.parallel.pipeline import cut_stage

    with caplog.at_level(logging.WARNING, logger="framework"):
        piped = aux_scope_under_pipeline(make_cfg(2, AUX), pp=2)
        kept = [
            aux_scope_under_pipeline(make_cfg(2, AUX), pp=1),
            aux_scope_under_pipeline(make_cfg(2, 0.0), pp=2),
            aux_scope_under_pipeline(make_cfg(2, AUX, "layer"), pp=2),
        ]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(
        "model.moe.aux_loss_scope=global under parallel.pp=2: the load-balancing loss is each layer's"
    ), lines
    assert piped.model.moe.aux_loss_scope is AuxLossScope["layer"]
    assert [c.model.moe.aux_loss_scope.name for c in kept] == ["global", "global", "layer"]
    stage = cut_stage(moe_decoder(make_cfg(2, AUX)), range(0, 1), True, False)
    assert stage.inject_aux and stage.aux_per_layer and stage.num_moe_layers == 2


# ------------------------------------------------------------------------------------------------
# DCP: resume bitwise at the same layout, reshard across ep degrees 2 -> 1 -> 4
# ------------------------------------------------------------------------------------------------


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Hashes of the full model and optimizer state (collective; every rank gets the whole)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": _h(v) for k, v in msd.items()}
    out |= {f"optim.{fqn}.{k}": _h(v) for fqn, st in osd.get("state", {}).items() for k, v in st.items()}
    return out


def _h(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(
        t.view(-1).view(torch.uint8).numpy().tobytes() + str((t.dtype, t.shape)).encode()
    ).hexdigest()


def _ckpt_worker(rank: int, world: int, root: str, ep: int, load: int | None, steps: int, save: bool) -> dict:
    """Build the MoE decoder at ``ep`` (dp_shard = world), load step ``load`` (with the sampler's
    state), train ``steps`` steps on the sampler's batches, save; at world 2 also load the saved
    step again into a fresh model and train the same steps: the resumed run's state must be the
    unbroken run's, bit for bit."""
    cfg = make_cfg(world, dp_shard=world, ep=ep)
    checkpointer = Checkpointer(cfg.checkpoint, Path(root))

    def build(at: int | None) -> tuple:
        model, mesh, plan = parallel_model(cfg)
        dp_rank, dp_size = dp_mesh_info(mesh, plan)
        opt, sched = build_optimizer(model, cfg.train, CPU), None
        sched = build_scheduler(opt, cfg.train)
        sampler = BatchSampler(None, 256, SEQ, GLOBAL_BATCH, plan.micro_batch_size, dp_rank, dp_size, seed=5)
        if at is not None:
            extra = checkpointer.load(checkpointer.root / f"step_{at:06d}", model, opt, sched)
            sampler.load_state_dict(extra["data"])
        return model, opt, sched, sampler

    def train(
        model: torch.nn.Module, opt: object, sched: object, sampler: BatchSampler, n: int
    ) -> list[float]:
        return [
            train_step(model, opt, sched, sampler.next_batch(), cfg.train.grad_clip, CPU).loss
            for _ in range(n)
        ]

    model, opt, sched, sampler = build(load)
    start = sampler.consumed_batches
    # get_state_dict fills an empty optimizer state by a step of zero gradients (AdamW's step count
    # then starts at 1): digest only a loaded one
    out = {"loaded": _digest(model, opt) if load is not None else None, "start": start}
    out["losses"] = train(model, opt, sched, sampler, steps)
    out["final"] = _digest(model, opt)
    if save:
        checkpointer.save(start + steps, model, opt, sched, {"data": sampler.state_dict()})
        assert checkpointer.last_error is None, checkpointer.last_error
    if load is None and world == 2:  # same layout: save mid-way, resume, compare bitwise
        model, opt, sched, sampler = build(None)
        train(model, opt, sched, sampler, 1)
        checkpointer.save(1, model, opt, sched, {"data": sampler.state_dict()})
        del model, opt, sched, sampler
        model, opt, sched, sampler = build(1)
        resumed = train(model, opt, sched, sampler, steps - 1)
        out["resumed"] = resumed
        out["resumed_final"] = _digest(model, opt)
    checkpointer.close()
    return out


def test_checkpoint_resumes_bitwise_and_reshards_across_ep_degrees(tmp_path: Path) -> None:
    """ep=2 saves at step 2 (and, resumed from its step 1, ends bitwise where the unbroken run
    ends); one process without ep loads step 2 with the same bits, trains step 3 on the same global
    batch (the sampler's position is the global one) and saves; ep=4 on 4 ranks loads step 3 with the
    same bits and trains step 4. Losses follow one unbroken process within rtol 1e-5."""
    root = str(tmp_path)
    ref_cfg = make_cfg(1)
    ref = moe_decoder(ref_cfg)
    materialize(ref, CPU, 0)
    ref_opt = build_optimizer(ref, ref_cfg.train, CPU)
    ref_sched = build_scheduler(ref_opt, ref_cfg.train)
    ref_sampler = BatchSampler(None, 256, SEQ, GLOBAL_BATCH, GLOBAL_BATCH, 0, 1, seed=5)
    ref_losses = [
        train_step(ref, ref_opt, ref_sched, ref_sampler.next_batch(), 0.3, CPU).loss for _ in range(4)
    ]

    ep2 = run_ranks(_ckpt_worker, 2, root, 2, None, 2, True)
    for r in ep2:
        assert r["resumed"] == r["losses"][1:], "resumed losses differ from the unbroken run's"
        assert r["resumed_final"] == r["final"], "resumed state differs from the unbroken run's"
    one = run_ranks(_ckpt_worker, 1, root, 1, 2, 1, True)[0]
    assert one["start"] == 2 and one["loaded"] == ep2[0]["final"], "ep=2 -> 1: state changed on load"
    four = run_ranks(_ckpt_worker, 4, root, 4, 3, 1, False)
    for r in four:
        assert r["start"] == 3 and r["loaded"] == one["final"], "1 -> ep=4: state changed on load"
    losses = [*ep2[0]["losses"], *one["losses"], *four[0]["losses"]]
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= RTOL * abs(want), (losses, ref_losses)


class _AllReduces(TorchDispatchMode):
    """Records the element count and dtype of every functional all-reduce (forward and backward) in
    ``calls``, and of every tensor of ``dist.all_reduce``'s (c10d's in-place op) in ``c10d``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, torch.dtype]] = []
        self.c10d: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops._c10d_functional.all_reduce.default:
            self.calls.append((args[0].numel(), args[0].dtype))
        elif func is torch.ops.c10d.allreduce_.default:
            self.c10d += [(t.numel(), t.dtype) for t in args[0]]
        return func(*args, **(kwargs or {}))


def _aux_count_worker(rank: int, world: int, scope: str) -> dict:
    """One step's forwards and backwards (2 micro batches a rank) under ``_AllReduces``, and the plan's
    aux rows. No gradient clipping: its norm's all-reduce is not the aux loss's."""
    cfg = make_cfg(world, AUX, scope, dp_shard=world)
    cfg.train.micro_batch_size = GLOBAL_BATCH // world // 2
    model, mesh, plan = parallel_model(cfg)
    dp_rank, _ = dp_mesh_info(mesh, plan)
    n = GLOBAL_BATCH // world
    mine = batches()[0][dp_rank * n : (dp_rank + 1) * n]
    micro = cfg.train.micro_batch_size
    with _AllReduces() as seen:
        for i in range(0, n, micro):
            model(mine[i : i + micro, :-1], mine[i : i + micro, 1:]).backward()
    rows = [(c.collective, c.calls, c.bytes_per_call) for c in plan.comm if c.collective.startswith("aux_")]
    return {"seen": [(k, str(t)) for k, t in seen.calls], "planned": rows, "accum": plan.grad_accum_steps}


@pytest.mark.parametrize(("scope", "values"), [("global", 2 * NUM_EXPERTS + 1), ("layer", 2 * (2 * NUM_EXPERTS + 1))])
def test_planned_aux_all_reduce_is_what_the_runtime_sends(scope: str, values: int) -> None:
    """Issue 25: the plan's comm table lists the load-balancing loss's all-reduce as the runtime runs
    it on dp_shard=2 (2 layers, 8 experts): per micro batch one fp32 all-reduce of 2 E + 1 values
    (global; 2 E + 1 per layer under layer) in forward, and one of the same size in backward."""
    for r in run_ranks(_aux_count_worker, 2, scope):
        assert r["accum"] == 2
        assert r["seen"] == [(values, "torch.float32")] * 2 * r["accum"], r["seen"]
        assert sorted(r["planned"]) == [
            ("aux_all_reduce", r["accum"], values * 4),
            ("aux_all_reduce_backward", r["accum"], values * 4),
        ]


def _bias_count_worker(rank: int, world: int, rate: float) -> dict:
    """One optimizer step (2 micro batches a rank, the load-balancing loss off, no clipping) of the
    sigmoid router at bias update rate ``rate``, its bias update hooked onto the optimizer as the
    runner hooks it (framework.train.runner), under ``_AllReduces``; and the plan's bias rows."""
    cfg = make_cfg(world, dp_shard=world)
    cfg.model.moe.router_aux_loss_coef = 0.0
    cfg.model.moe.router_score = RouterScore.sigmoid
    cfg.model.moe.bias_update_rate = rate
    cfg.train.grad_clip = 0.0
    cfg.train.micro_batch_size = GLOBAL_BATCH // world // 2
    model, mesh, plan = parallel_model(cfg)
    opt = build_optimizer(model, cfg.train, CPU)
    sched = build_scheduler(opt, cfg.train)
    if rate > 0:
        opt.register_step_post_hook(functools.partial(_update_biases, model))
    dp_rank, _ = dp_mesh_info(mesh, plan)
    n, micro = GLOBAL_BATCH // world, cfg.train.micro_batch_size
    mine = batches()[0][dp_rank * n : (dp_rank + 1) * n]
    mbs = [(mine[i : i + micro, :-1], mine[i : i + micro, 1:]) for i in range(0, n, micro)]
    with _AllReduces() as seen:
        train_step(model, opt, sched, mbs, cfg.train.grad_clip, CPU)
    biases = [m.expert_bias.tolist() for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    rows = [(c.collective, c.group_size, c.calls, c.bytes_per_call) for c in plan.comm if c.collective == "bias_all_reduce"]
    return {"seen": [(k, str(t)) for k, t in seen.c10d], "planned": rows, "biases": biases}


def test_planned_bias_all_reduce_is_what_the_runtime_sends() -> None:
    """Issue 25: the plan's comm table lists the sigmoid routers' bias update as the runtime runs it
    on dp_shard=2 (2 layers, 8 experts, 2 micro batches a rank): after the optimizer step one
    ``dist.all_reduce`` of E int64 counts per layer, once a step; the ranks' biases then agree. At
    bias_update_rate 0 neither the runtime nor the plan has any."""
    ranks = run_ranks(_bias_count_worker, 2, 0.001)
    for r in ranks:
        assert r["seen"] == [(NUM_EXPERTS, "torch.int64")] * 2, r["seen"]
        assert r["planned"] == [("bias_all_reduce", 2, 2, NUM_EXPERTS * 8)]
        assert len(r["biases"]) == 2 and any(b != 0.0 for bias in r["biases"] for b in bias)
    assert ranks[0]["biases"] == ranks[1]["biases"]
    for r in run_ranks(_bias_count_worker, 2, 0.0):
        assert r["seen"] == [] and r["planned"] == [] and not any(b for bias in r["biases"] for b in bias)
