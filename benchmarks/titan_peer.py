"""torchtitan's own model code for one of our MoE recipes' shapes, in the strongest minimal loop, for
the table beside ``python train.py`` and our hand loop (benchmarks/moe_gpu.sh's ``titan`` phase).

    python benchmarks/titan_peer.py --recipe moonlight_16b_a3b --layers 4 --seq 4096 --batch 2 --out t.json

The peer is torchtitan 0.2.2's model classes (installed from its wheel on the GPU machine:
benchmarks/moe_gpu.sh ``setup``): ``qwen3`` for qwen3_moe recipes, ``deepseek_v3`` for deepseek_v3
recipes, ``gpt_oss`` for gpt_oss recipes, each built with the recipe's shape (read through our own
config, so the two sides cannot drift), cut to ``--layers`` as the recipe would be with
``model.n_layers``. The loop is the hand loop's (benchmarks/moe_gpu.py): fp32 master weights under
bf16 autocast, fused AdamW stepped per parameter from its post-accumulate-grad hook on a side stream,
random tokens; compiled as torchtitan compiles it (``apply_compile``: each block fullgraph, a MoE
block's parts around the experts, the grouped GEMM function) plus the loss, as its trainer does.
GPT-OSS's trainer does not compile the model (its parallelize applies no ``apply_compile``); the loop
tries torchtitan's compile and falls back to its eager blocks, and the row says which ran.

MFU uses our ``flops_per_token`` of the recipe's shape (the same count for every row of the table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PEAK_TFLOPS = 989.0


def _stub_datasets() -> None:
    """torchtitan's model packages import its dataset module, which imports ``datasets`` (absent on
    the GPU machine): names only, nothing is loaded."""
    if "datasets" in sys.modules:
        return
    try:
        import datasets  # noqa: F401

        return
    except ImportError:
        pass
    ds = types.ModuleType("datasets")
    dist = types.ModuleType("datasets.distributed")
    for name in ("Dataset", "IterableDataset", "load_dataset", "interleave_datasets"):
        setattr(ds, name, object)
    dist.split_dataset_by_node = lambda *a, **k: None
    ds.distributed = dist
    sys.modules["datasets"], sys.modules["datasets.distributed"] = ds, dist


def _layer_kinds(m: object, layers: int) -> list[str]:
    """The recipe's layer kinds, first ``layers`` of them (our ``layer_pattern``: 'dense x1, moe x26')."""
    from framework.models.registry import model_spec

    return [k.mlp.value for k in model_spec(m).layers][:layers]  # type: ignore[arg-type]


def titan_model(m: object, family: str, layers: int, seq: int) -> tuple[torch.nn.Module, object]:
    """(torchtitan's model on meta, its args) for our model config ``m`` cut to ``layers``."""
    _stub_datasets()
    from torchtitan.models.moe import MoEArgs

    moe = m.moe  # type: ignore[attr-defined]
    if family == "qwen3_moe":
        from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

        args = dataclasses.replace(qwen3_args["30B-A3B"], n_layers=layers)
        return Qwen3Model(args), args
    if family == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs

        dense = sum(1 for k in _layer_kinds(m, layers) if k == "dense")
        args = DeepSeekV3ModelArgs(
            max_seq_len=seq, vocab_size=m.vocab_size, dim=m.dim, inter_dim=m.ffn_dim,  # type: ignore[attr-defined]
            moe_inter_dim=moe.moe_intermediate_size, n_layers=layers, n_dense_layers=dense,
            n_heads=m.n_heads, norm_eps=m.norm_eps,  # type: ignore[attr-defined]
            moe_args=MoEArgs(
                num_experts=moe.num_experts, num_shared_experts=moe.num_shared_experts,
                top_k=moe.num_experts_per_tok, score_func=moe.router_score.value
                if hasattr(moe.router_score, "value") else str(moe.router_score),
                route_norm=bool(moe.norm_topk_prob), route_scale=moe.routed_scaling_factor,
                score_before_experts=False, load_balance_coeff=moe.bias_update_rate or None,
                num_expert_groups=moe.n_group if moe.n_group > 1 else None,
                num_limited_groups=moe.topk_group if moe.n_group > 1 else None,
            ),
            q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,  # type: ignore[attr-defined]
            qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,  # type: ignore[attr-defined]
            v_head_dim=m.v_head_dim, attn_type="sdpa", attn_mask_type="causal",  # type: ignore[attr-defined]
            original_seq_len=seq, rope_theta=m.rope_theta,  # type: ignore[attr-defined]
        )  # fmt: skip
        args.moe_impl = "standard"  # its trainer sets this from the job config
        return DeepSeekV3Model(args), args
    if family == "gpt_oss":
        from torchtitan.models.gpt_oss import GptOssModel, GptOssModelArgs

        args = GptOssModelArgs(
            max_seq_len=seq, vocab_size=m.vocab_size, dim=m.dim,  # type: ignore[attr-defined]
            moe_inter_dim=moe.moe_intermediate_size, n_layers=layers, norm_eps=m.norm_eps,  # type: ignore[attr-defined]
            moe_args=MoEArgs(
                num_experts=moe.num_experts, num_shared_experts=0, score_func="softmax",
                route_norm=True, route_scale=1.0, gate_bias=True, score_before_experts=False,
                top_k=moe.num_experts_per_tok, use_grouped_mm=True, load_balance_coeff=1e-3,
            ),
            head_dim=m.head_dim, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,  # type: ignore[attr-defined]
            sliding_window_size=m.sliding_window, attn_mask_type="causal",  # type: ignore[attr-defined]
            rope_theta=m.rope_theta,  # type: ignore[attr-defined]
        )  # fmt: skip
        return GptOssModel(args), args
    raise SystemExit(f"error: no torchtitan peer for family {family!r}: qwen3_moe, deepseek_v3, gpt_oss")


def compile_titan(model: torch.nn.Module) -> None:
    from torchtitan.models.llama4.infra.parallelize import apply_compile

    apply_compile(model, SimpleNamespace(backend="inductor"), ep_enabled=False)


def run(args: argparse.Namespace) -> dict:
    from gpu_bench import compose_cfg
    from llama8b_8k import _sync, _Timer, attach_optimizer_in_backward

    from framework.config import schema as config_mod
    from framework.launch import recipes
    from framework.launch.ranks import register_resolvers
    from framework.models import active_params, flops_per_token, num_params

    config_mod.register()
    recipes.register()
    register_resolvers()
    t_start = time.perf_counter()
    over = [f"recipe={args.recipe}", f"model.n_layers={args.layers}", f"train.seq_len={args.seq}"]
    cfg = compose_cfg(over + ([f"model.layer_pattern='{args.pattern}'"] if args.pattern else []))
    m = cfg.model
    family = m.family.value
    dev = torch.device("cuda")
    with torch.device("meta"):
        model, targs = titan_model(m, family, args.layers, args.seq)
    model.to_empty(device=dev)
    with torch.no_grad():
        model.init_weights(buffer_device=dev)
    handles, side = attach_optimizer_in_backward(model, 3e-4)
    compiled = "eager"
    if args.compile:
        compile_titan(model)
        compiled = "torchtitan apply_compile"

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    if args.compile:
        loss_fn = torch.compile(loss_fn)  # as torchtitan's trainer compiles its loss
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = torch.randint(0, m.vocab_size, (args.steps + 2, args.batch, args.seq + 1), device=dev, generator=gen)
    masks = None
    if family in ("gpt_oss",):
        masks = model.get_attention_masks(rows[0][:, :-1], tokenizer=None)
    torch.cuda.reset_peak_memory_stats()

    def step(i: int) -> torch.Tensor:
        b = rows[i % rows.shape[0]]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(b[:, :-1], masks) if masks is not None else model(b[:, :-1])
            loss = loss_fn(logits, b[:, 1:])
        loss.backward()
        _sync(side)
        return loss.detach()

    events, losses, first = [], [], None
    try:
        losses.append(step(0))
    except Exception as e:  # noqa: BLE001  # a compile failure: the row says so and runs eager
        if not args.compile:
            raise
        print(f"compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); eager", flush=True)
        with torch.device("meta"):
            model, targs = titan_model(m, family, args.layers, args.seq)
        model.to_empty(device=dev)
        with torch.no_grad():
            model.init_weights(buffer_device=dev)
        handles, side = attach_optimizer_in_backward(model, 3e-4)
        compiled = "eager (compile failed)"
        losses.append(step(0))
    torch.cuda.synchronize()
    first = time.perf_counter() - t_start
    for i in range(1, args.steps):
        timer = _Timer(True)
        timer.start()
        losses.append(step(i))
        timer.stop()
        events.append(timer)
    torch.cuda.synchronize()
    step_s = statistics.median(t.seconds() for t in events[args.warmup :])
    tps = args.batch * args.seq / step_s
    return {
        "what": f"torchtitan 0.2.2 {family} model code, {compiled}",
        "layers": args.layers, "seq": args.seq, "batch": args.batch,
        "params_b": num_params(m) / 1e9, "active_b": active_params(m) / 1e9,
        "titan_params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "tokens_per_s": tps, "step_ms": step_s * 1e3,
        "mfu": flops_per_token(m, args.seq) * tps / (PEAK_TFLOPS * 1e12),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_step_s": first, "loss_first_last": [float(losses[0]), float(losses[-1])],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="moonlight_16b_a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pattern", default="", help="model.layer_pattern for --layers (e.g. 'dense x1, moe x3')")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    row = run(args)
    print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps([row], indent=1))


if __name__ == "__main__":
    main()
