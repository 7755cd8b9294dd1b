"""Llama-3-8B at 8K context on one GPU (issue 28): the attention kernels at the shape, a hand-written
loop, and the table that puts them beside the framework's ``train.py`` runs.

    python benchmarks/llama8b_8k.py docs OUT_DIR --mb 64          # real text as jsonl documents
    python benchmarks/llama8b_8k.py attn --docs D.jsonl --bpe B.json --out attn.json
    python benchmarks/llama8b_8k.py hand --docs D.jsonl --bpe B.json --out hand.json \
        --variants bf16:nomask,bf16:mask,float8b:nomask,float8:nomask [--profile-dir DIR]
                 # float8b: float8 with the norm outputs saved, as train.py's float8 runs do; float8: without;
                 # float8f: float8b with fast accumulation in backward; float8n: float8b, no optimizer step;
                 # float8m: float8b with AdamW's moments in bf16; a third field: rows a step (float8m:mask:2)
    python benchmarks/llama8b_8k.py table --hand hand.json --runs RUN_DIR... > table.md

The hand loop is the strongest simple loop for the same memory budget written without the
framework's training code (it builds the same Llama module, ``framework.models``): bf16 autocast over
fp32 master weights, each block and the loss head compiled (``torch.compile``, fullgraph), AdamW
(fused) stepped per parameter from its post-accumulate-grad hook on a side stream (the gradients
never all live at once: that is what lets the 8B train without activation checkpointing on one
141 GB GPU), torchao float8 on every Linear but the output head, and for the document mask
FlexAttention's block mask built from the packed rows' EOS positions each step. Batches are real
packed text: the documents tokenized by a trained BPE, EOS after each, cut into rows of seq+1.

MFU: flops/token = 6N + 12·L·H·Q·T (N without the input embedding; attention counted as full, not
causal-halved: PaLM's convention, the same as the framework's ``flops_per_token``), over 989 TFLOP/s
dense bf16 for bf16 and float8 alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PEAK_TFLOPS = 989.0
# Cleared by the float8n variant (a diagnostic, not a training loop): gradients dropped unapplied, to
# measure what the optimizer's side-stream work costs the step.
OPTIMIZER: dict = {"step": True, "bf16_moments": False}


def _adamw_bf16(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
    lr: float, b1: float, b2: float, eps: float, wd: float,
) -> None:  # fmt: skip
    """AdamW in fp32 over bf16 moments, in place (the float8m variant; compiled: one kernel)."""
    count = step + 1
    g32 = g.float()
    m32 = m.float() * b1 + g32 * (1 - b1)
    v32 = v.float() * b2 + g32 * g32 * (1 - b2)
    denom = v32.sqrt() / (1 - b2**count).sqrt() + eps
    p.copy_(p * (1 - lr * wd) - lr / (1 - b1**count) * m32 / denom)
    m.copy_(m32.to(torch.bfloat16))
    v.copy_(v32.to(torch.bfloat16))
    step.copy_(count)


_ADAMW_BF16 = torch.compile(_adamw_bf16, fullgraph=True, dynamic=True)


def packed_rows(docs: Path, bpe: Path, rows: int, seq: int) -> tuple[torch.Tensor, int]:
    """``rows`` rows of ``seq + 1`` tokens of the documents, EOS after each; and the EOS id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe))
    eos = tok.token_to_id("<|end_of_text|>")
    assert eos is not None, f"{bpe}: no <|end_of_text|>"
    need = rows * (seq + 1)
    flat: list[int] = []
    with docs.open() as f:
        batch: list[str] = []
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 64:
                for enc in tok.encode_batch(batch, add_special_tokens=False):
                    flat.extend(enc.ids)
                    flat.append(eos)
                batch = []
                if len(flat) >= need:
                    break
    for enc in tok.encode_batch(batch if len(flat) < need else [], add_special_tokens=False):
        flat.extend(enc.ids)
        flat.append(eos)
    if len(flat) < need:
        raise SystemExit(f"{docs}: {len(flat)} tokens, {need} needed for {rows} rows of {seq + 1}")
    return torch.tensor(flat[:need], dtype=torch.int64).view(rows, seq + 1), eos


# ---------------------------------------------------------------------------------------------
# attn: the attention kernels at the model's shape, forward + backward
# ---------------------------------------------------------------------------------------------


def attn(args: argparse.Namespace) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    from framework.models.parts.masks import document_block_mask, document_ids

    dev = torch.device("cuda")
    s, h, kv, d = args.seq, 32, 8, 128
    rows, eos = packed_rows(args.docs, args.bpe, 1, s)
    doc = document_ids(rows[:, :-1].to(dev), eos)
    lengths = torch.bincount(doc[0]).tolist()
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, h, s, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, kv, s, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, kv, s, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(1, h, s, d, device=dev, dtype=torch.bfloat16, generator=g)
    causal_fwd = 2 * s * s * d * h  # 4·S²·D·H halved by the causal mask
    # The work under the document mask: the sum of each document's causal square.
    masked_fwd = sum(4 * n * n * d * h // 2 for n in lengths)
    results: list[dict] = []
    flex = torch.compile(flex_attention, dynamic=False)

    def bench(name: str, fn, fwd_flops: int) -> None:  # noqa: ANN001
        try:
            out = fn()
            ms_f = do_bench(fn, warmup=25, rep=100, return_mode="median")

            def fb() -> None:
                o = fn()
                o.backward(do)

            fb()
            ms_fb = do_bench(fb, warmup=25, rep=100, return_mode="median", grad_to_none=[q, k, v])
            del out
            row = {"kernel": name, "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb,
                   "tflops_fwd_bwd": 3.5 * fwd_flops / (ms_fb * 1e-3) / 1e12}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is a row, not a stop
            row = {"kernel": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        print(json.dumps(row), flush=True)
        results.append(row)

    def sdpa(backend: SDPBackend, expand: bool = False):  # noqa: ANN202
        def fn() -> torch.Tensor:
            kk, vv = (
                (k, v) if not expand else (k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1))
            )
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)

        return fn

    bench("sdpa flash (FA2), causal", sdpa(SDPBackend.FLASH_ATTENTION), causal_fwd)
    bench("sdpa cudnn, causal, gqa", sdpa(SDPBackend.CUDNN_ATTENTION), causal_fwd)
    bench("sdpa cudnn, causal, kv expanded", sdpa(SDPBackend.CUDNN_ATTENTION, True), causal_fwd)
    bench("sdpa efficient, causal, kv expanded", sdpa(SDPBackend.EFFICIENT_ATTENTION, True), causal_fwd)
    causal_mask = create_block_mask(lambda b, hh, qi, ki: qi >= ki, 1, None, s, s, device=dev)
    bench("flex, causal", lambda: flex(q, k, v, block_mask=causal_mask, enable_gqa=True), causal_fwd)
    bm = document_block_mask(doc)
    bench("flex, document mask", lambda: flex(q, k, v, block_mask=bm, enable_gqa=True), masked_fwd)
    # Block sizes: a few fixed tiles (Inductor's max-autotune over flex's configs ran past 100 s here).
    for ko in (
        {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "bwd_num_warps": 8},
        {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "bwd_num_warps": 4, "bwd_num_stages": 3},
        {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 3},
    ):
        bench(f"flex, document mask, {ko}",
              lambda ko=ko: flex(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=ko), masked_fwd)  # fmt: skip
    try:
        from torch.nn.attention.varlen import varlen_attn

        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        qv, kv_, vv = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
        dov = do[0].transpose(0, 1).contiguous()

        def var() -> torch.Tensor:
            return varlen_attn(qv, kv_, vv, cu, cu, max(lengths), max(lengths), window_size=(-1, 0),
                               enable_gqa=True)  # fmt: skip

        def var_fb() -> None:
            var().backward(dov)

        var_fb()
        ms_f = do_bench(var, warmup=25, rep=100, return_mode="median")
        ms_fb = do_bench(var_fb, warmup=25, rep=100, return_mode="median", grad_to_none=[qv, kv_, vv])
        row = {"kernel": "varlen_attn (FA2 varlen), document mask", "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb,
               "tflops_fwd_bwd": 3.5 * masked_fwd / (ms_fb * 1e-3) / 1e12}  # fmt: skip
    except Exception as e:  # noqa: BLE001
        row = {"kernel": "varlen_attn", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    print(json.dumps(row), flush=True)
    results.append(row)
    # The model's own variable-length path (framework.models.parts.attention._varlen over
    # document_spans): aten's flash op, FlashAttention-2's kernel; then flash-attn-4's, swapped in
    # behind the same ops by framework.kernels.fa4 (process-wide: these rows come last).
    from framework.kernels import fa4
    from framework.models.parts.attention import _varlen
    from framework.models.parts.masks import document_spans

    spans = document_spans(doc)
    bench("model varlen (aten flash: FA2), document mask", lambda: _varlen(q, k, v, spans), masked_fwd)
    if fa4.installed() and fa4.registry_has_fa4():
        fa4.activate()
        bench("FA4 (SDPA flash backend), causal", sdpa(SDPBackend.FLASH_ATTENTION), causal_fwd)
        bench("model varlen (FA4), document mask", lambda: _varlen(q, k, v, spans), masked_fwd)
        one = document_spans(torch.zeros_like(doc))  # the whole row as one span: causal
        bench("model varlen (FA4), one span (causal)", lambda: _varlen(q, k, v, one), causal_fwd)
    else:
        print(json.dumps({"kernel": "FA4", "error": f"not installed: {fa4.missing()}"}), flush=True)
    # The block mask's own cost: built once per step from the tokens' document ids.
    torch.cuda.synchronize()
    for name, kw in (("eager", {}), ("_compile=True", {"_compile": True})):
        try:

            def build(kw: dict = kw) -> None:
                def mm(b, hh, qi, ki):  # noqa: ANN001, ANN202
                    return (doc[b, qi] == doc[b, ki]) & (qi >= ki)

                create_block_mask(mm, 1, None, s, s, device=dev, **kw)

            build()
            ms = do_bench(build, warmup=5, rep=50, return_mode="median")
            row = {"kernel": f"create_block_mask {name}", "ms": ms}
        except Exception as e:  # noqa: BLE001
            row = {"kernel": f"create_block_mask {name}", "error": f"{type(e).__name__}: {e}"[:200]}
        print(json.dumps(row), flush=True)
        results.append(row)
    summary = {"seq": s, "documents": len(lengths), "mean_doc_tokens": s / len(lengths),
               "masked_share_of_causal": masked_fwd / causal_fwd, "rows": results}  # fmt: skip
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"documents in the row: {len(lengths)}, masked work {masked_fwd / causal_fwd:.1%} of causal")


# ---------------------------------------------------------------------------------------------
# hand: the hand-written loop
# ---------------------------------------------------------------------------------------------


class _Timer:
    """CUDA events on CUDA; a synchronous host clock elsewhere (the CPU smoke run)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        if cuda:
            self.a, self.b = (torch.cuda.Event(enable_timing=True) for _ in range(2))

    def start(self) -> None:
        if self.cuda:
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.b.record()
        else:
            self.s = time.perf_counter() - self.t

    def seconds(self) -> float:
        return self.a.elapsed_time(self.b) / 1e3 if self.cuda else self.s


def _sync(side: torch.cuda.Stream | None) -> None:
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)


def attach_optimizer_in_backward(
    model: torch.nn.Module, lr: float, guard: bool = False
) -> tuple[list, torch.cuda.Stream | None]:
    """Fused AdamW per parameter, stepped from its post-accumulate-grad hook on a side stream.
    ``guard`` (CUDA): also what the framework's ``InBackward`` does for safety, each gradient's norm
    (summed) and a skip of a non-finite one's update (fused AdamW's ``found_inf``), to measure its cost."""
    cuda = next(model.parameters()).is_cuda
    side = torch.cuda.Stream() if cuda else None
    norm_sq = torch.zeros((), device=next(model.parameters()).device)
    opts = {}
    moments: dict[torch.Tensor, tuple[torch.Tensor, ...]] = {}

    def bf16_step(p: torch.Tensor) -> None:
        if p not in moments:
            zeros = torch.zeros(p.numel(), device=p.device, dtype=torch.bfloat16)
            moments[p] = (zeros, zeros.clone(), torch.zeros((), device=p.device))
        m, v, count = moments[p]
        wd = 0.1 if p.ndim >= 2 else 0.0
        _ADAMW_BF16(p.detach().view(-1), p.grad.view(-1), m, v, count, lr, 0.9, 0.95, 1e-8, wd)

    def hook(p: torch.Tensor) -> None:
        if not OPTIMIZER["step"]:  # the float8n diagnostic: the step without the optimizer's work
            p.grad = None
            return
        update = bf16_step if OPTIMIZER["bf16_moments"] else lambda p: opts[p].step()
        if side is None:
            update(p)
            p.grad = None
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            if guard:
                g = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
                norm_sq.add_(g.square())
                opts[p].found_inf = (~torch.isfinite(g)).float()
            update(p)
        p.grad.record_stream(side)
        p.grad = None

    OPTIMIZER["opts"] = opts  # float8m frees their fp32 moments before its first step
    handles = []
    for p in model.parameters():
        opts[p] = torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
        handles.append(p.register_post_accumulate_grad_hook(hook))
    return handles, side


def set_fast_accum(model: torch.nn.Module, fast: bool) -> None:
    """Fast accumulation in every float8 Linear's backward GEMMs (``fast``) or torchao's default
    (forward only): what ``model.float8_fast_accum`` gives train.py, switched in place between variants."""
    from torchao.float8.float8_linear import Float8Linear

    for mod in model.modules():
        if isinstance(mod, Float8Linear):
            mm = mod.linear_mm_config
            mod.linear_mm_config = type(mm)(
                mm.output,
                mm.grad_input._replace(use_fast_accum=fast),
                mm.grad_weight._replace(use_fast_accum=fast),
            )


def compile_model(model: torch.nn.Module) -> None:
    for block in model.layers.values():
        block.__dict__.pop("forward", None)
        block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)
    model.__dict__.pop("head_loss", None)
    model.head_loss = torch.compile(model.head_loss, fullgraph=True, dynamic=False)


def hand(args: argparse.Namespace) -> None:
    from gpu_bench import compose_cfg

    from framework.config import schema as config_mod
    from framework.config.schema import Float8Recipe
    from framework.launch import recipes
    from framework.launch.ranks import register_resolvers
    from framework.models import build_model, flops_per_token, materialize

    config_mod.register()
    recipes.register()
    register_resolvers()

    t_start = time.perf_counter()
    dev = torch.device(args.device)
    cfg = compose_cfg(
        [f"recipe={args.recipe}", f"train.seq_len={args.seq}", f"model.attention={args.attention}"]
    )
    m = cfg.model
    most = max(int((v.split(":") + ["1"])[2]) for v in args.variants.split(","))  # rows a step
    rows, eos = packed_rows(args.docs, args.bpe, (args.steps + 2) * most, args.seq)
    rows = rows.to(dev)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(args.bpe)).get_vocab_size()
    if vocab > m.vocab_size:  # the smoke test's tiny recipe; the 8B's 128256 holds the BPE
        m = dataclasses.replace(m, vocab_size=vocab)
    model = build_model(dataclasses.replace(m, float8=Float8Recipe.none), args.seq, document_eos=eos)
    materialize(model, dev, seed=0)
    handles, side = attach_optimizer_in_backward(model, 3e-4)
    results = []
    converted = False
    for variant in args.variants.split(","):
        numerics, mask, *rest = variant.split(":")
        batch = int(rest[0]) if rest else 1
        # float8b: float8 with the norms' outputs saved (framework.kernels.saved_copy), as
        # train.py's float8 runs have them; float8: without it (the A/B in one process).
        # float8f: float8b with fast accumulation in the backward GEMMs (model.float8_fast_accum);
        # float8n: float8b with no optimizer step (a diagnostic bound).
        barrier = numerics in ("float8b", "float8f", "float8n", "float8m")
        fast, OPTIMIZER["step"] = numerics == "float8f", numerics != "float8n"
        # bf16 moments from the first float8m on (their fp32 ones are freed: list float8m last)
        if numerics == "float8m" and not OPTIMIZER["bf16_moments"]:
            for opt in OPTIMIZER["opts"].values():
                opt.state.clear()  # the fp32 moments of the variants before: their memory is needed
            OPTIMIZER["bf16_moments"] = True
        assert OPTIMIZER["bf16_moments"] <= (numerics == "float8m"), "float8m variants go last"
        label = numerics
        numerics = "float8" if barrier else numerics
        if numerics == "float8" and not converted:
            from torchao.float8 import convert_to_float8_training

            from framework.parallel.float8 import float8_config

            m8 = dataclasses.replace(m, float8=Float8Recipe.tensorwise, float8_size_filter=False)
            convert_to_float8_training(model, config=float8_config(m8, False),
                                       module_filter_fn=lambda mod, fqn: fqn != "output")  # fmt: skip
            converted = True
        if converted:
            set_fast_accum(model, fast)
        assert numerics == "float8" or not converted, "bf16 variants go before float8 ones"
        for block in model.layers.values():
            block.save_norms = barrier
        # The mask is the model's: document ids from the EOS positions, then FlexAttention's block
        # mask, or under --attention flash|fa4 the flash kernel's variable-length form over the
        # documents' spans (as train.py picks them).
        model.document_eos = eos if mask == "mask" else None
        if mask == "mask":
            # CPU: the dense mask, as the framework (flex has no backward there).
            varlen = dev.type == "cuda" and args.attention in ("flash", "fa4")
            model.document_flex = None if varlen else dev.type == "cuda"
        # bf16 keeps the compiler's activation budget (--budget: the partitioner recomputes the cheapest
        # ops until the saved activations fit that fraction); float8 saves its inputs in float8, fits
        # without (the default 1.0).
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = args.budget if numerics == "bf16" else 1.0
        torch._dynamo.reset()
        compile_model(model)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        first = None
        events = []
        losses = []
        for i in range(args.steps):
            start = (i * batch) % (rows.shape[0] - batch + 1)
            b = rows[start : start + batch]
            timer = _Timer(dev.type == "cuda")
            timer.start()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(b[:, :-1], b[:, 1:])
            loss.backward()
            _sync(side)
            timer.stop()
            losses.append(loss.detach())
            if first is None:
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                first = time.perf_counter() - (t_start if not results else t0)
            events.append(timer)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times = [t.seconds() for t in events[args.warmup :]]
        step = statistics.median(times)
        tps = args.seq * batch / step
        row = {
            "what": f"hand {label}{' saved norms' if barrier else ''} {'masked' if mask == 'mask' else 'unmasked'} attention={args.attention}"
            + (f" budget={args.budget}" if numerics == "bf16" and args.budget < 1 else "")
            + (f" batch={batch}" if batch > 1 else ""),
            "numerics": numerics, "mask": mask == "mask",
            "ac": f"budget {args.budget}" if numerics == "bf16" and args.budget < 1 else "none",
            "tokens_per_s": tps, "step_ms": step * 1e3,
            "mfu": flops_per_token(m, args.seq) * tps / (PEAK_TFLOPS * 1e12),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
            "first_step_s": first, "first_step_from": "process start" if not results else "variant start",
            "loss_first_last": [float(losses[0]), float(losses[-1])],
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        results.append(row)
        args.out.write_text(json.dumps(results, indent=1))  # each variant's row as soon as it is done
        if args.profile_dir and variant in args.profile.split(","):
            profile(model, rows, side, args, "hand_" + variant.replace(":", "_"))
    args.out.write_text(json.dumps(results, indent=1))


def profile(model, rows, side, args, name) -> None:  # noqa: ANN001
    """Two steps under torch.profiler: the top CUDA kernels by time, as text."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for i in range(2):
            b = rows[i]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(b[None, :-1], b[None, 1:])
            loss.backward()
            _sync(side)
        torch.cuda.synchronize()
    args.profile_dir.mkdir(parents=True, exist_ok=True)
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90)
    (args.profile_dir / f"{name}.txt").write_text(table)
    print(f"profile: {args.profile_dir / name}.txt", flush=True)


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------


def run_row(run_dir: Path) -> dict | None:
    """A ``train.py`` run's row from its summary.json and the overrides it was given."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        return {"what": f"framework {run_dir.name}", "error": "no summary.json (see its log)"}
    d = json.loads(summary.read_text())
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text() if (run_dir / ".hydra").exists() else ""
    seq = 8192
    step = d.get("step_p50_s")
    tps = seq / step if step else d.get("tokens_per_s")
    return {
        "what": f"framework {run_dir.name}",
        "tokens_per_s": tps,
        "tokens_per_s_mean": d.get("tokens_per_s"),
        "step_ms": step * 1e3 if step else None,
        "mfu": d.get("mfu") * tps / d["tokens_per_s"] if d.get("mfu") and d.get("tokens_per_s") else None,
        "peak_gib": d.get("peak_mem_gib"),
        "first_step_s": d.get("time_to_first_step_s"),
        "final_loss": d.get("final_loss"),
        "data_wait_share": d.get("data_wait_share"),
        "overrides": overrides.count("\n"),
    }


def table(args: argparse.Namespace) -> None:
    rows = [r for r in (run_row(p) for p in args.runs) if r]
    if args.hand and args.hand.exists():
        rows += json.loads(args.hand.read_text())
    print("| what | tok/s (p50 step) | step ms | MFU | peak GiB | first step s | data wait |")
    print("|---|---|---|---|---|---|---|")

    def f(r: dict, k: str, spec: str) -> str:
        v = r.get(k)
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    for r in rows:
        if "error" in r:
            print(f"| {r['what']} | {r['error']} | | | | | |")
            continue
        print(f"| {r['what']} | {f(r, 'tokens_per_s', ',.0f')} | {f(r, 'step_ms', '.1f')} | {f(r, 'mfu', '.1%')} "
              f"| {f(r, 'peak_gib', '.1f')} | {f(r, 'first_step_s', '.1f')} | {f(r, 'data_wait_share', '.2%')} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("docs")
    d.add_argument("out", type=Path)
    d.add_argument("--mb", type=float, default=64.0)
    for name in ("attn", "hand"):
        a = sub.add_parser(name)
        a.add_argument("--docs", type=Path, required=True)
        a.add_argument("--bpe", type=Path, required=True)
        a.add_argument("--out", type=Path, required=True)
        a.add_argument("--seq", type=int, default=8192)
    h = sub.choices["hand"]
    h.add_argument("--recipe", default="llama3_8b")
    h.add_argument("--device", default="cuda")
    h.add_argument("--attention", default="auto", help="model.attention for the unmasked variants")
    h.add_argument("--variants", default="bf16:nomask,bf16:mask,float8:nomask,float8:mask")
    h.add_argument("--steps", type=int, default=10)
    h.add_argument("--budget", type=float, default=1.0, help="bf16: the compiler's activation memory budget")
    h.add_argument("--warmup", type=int, default=3)
    h.add_argument("--profile-dir", type=Path, default=None)
    h.add_argument("--profile", default="float8:mask", help="variants to profile (with --profile-dir)")
    t = sub.add_parser("table")
    t.add_argument("--hand", type=Path, default=None)
    t.add_argument("--runs", type=Path, nargs="*", default=[])
    args = p.parse_args()
    if args.cmd == "docs":
        from gpu_bench import write_documents

        print(write_documents(args.out, "jsonl", args.mb))
    else:
        {"attn": attn, "hand": hand, "table": table}[args.cmd](args)


if __name__ == "__main__":
    main()
