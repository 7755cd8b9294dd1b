"""The Trainer wires the stages, in one direction: plan -> build -> freeze -> verify -> parallelize -> run.

It does none of their work: each stage is a module of ``framework`` that takes the previous stage's
plain result. ``run`` executes on every rank, after the process group exists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only
from omegaconf import OmegaConf
from torch.distributed.device_mesh import DeviceMesh

from framework import data as data_mod
from framework.checkpoint import Checkpointer, PreemptionHandler, export_hf, full_model_state
from framework.compile_cache import CacheStats, cache_counters, load_cache, save_cache
from framework.config import (
    Config,
    ExecutorConfig,
    ExecutorMode,
    Float8Recipe,
    FreezeMode,
    Policy,
    flatten,
    to_yaml,
)
from framework.data.sft import split_rows
from framework.freeze import FrozenResult, freeze
from framework.init_from import shape_of
from framework.launch import DistEnv, init_distributed, resolve_device
from framework.loop import (
    HostIO,
    InBackward,
    StepResult,
    attach_in_backward,
    autocast,
    build_optimizer,
    build_scheduler,
    evaluate,
    train_step,
)
from framework.metrics import Metrics, format_row, make_sinks, perplexity, read_metrics, validation_row
from framework.model import build_model, flops_per_token, num_params
from framework.parallel import build_mesh, dp_mesh_info, parallelize
from framework.parallel.context import SequenceShard, sequence_shard
from framework.parallel.float8 import attach_scale_precompute
from framework.plan import Plan, make_plan, resolve_batch
from framework.profiling import format_top_operators, make_profiler
from framework.verify import (
    StepAction,
    Verifier,
    carry_state,
    inject_nan,
    next_float8,
    next_mode,
    perf_figures,
)
from framework.verify.numerics import batch_logits

log = logging.getLogger("framework")


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
        return digest
    flat = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    flats: list[dict[str, Any]] = [{}] * env.world_size
    dist.all_gather_object(flats, flat)
    bad = sorted({k for f in flats for k in set(f) | set(flats[0]) if f.get(k) != flats[0].get(k)})
    ranks = [r for r, h in enumerate(hashes) if h != hashes[0]]
    raise ValueError(f"ranks {ranks} resolved a different config than rank 0; differing keys: {bad}")


def peak_tflops(cfg: Config, device: torch.device) -> float | None:
    """Peak dense TFLOP/s per device for MFU: the declared hardware's figure, on CUDA only."""
    if device.type != "cuda":
        return None
    return cfg.mesh.hardware.peak_tflops if cfg.mesh.hardware.name != "cpu" else 989.0


@dataclass
class Summary:
    steps: int = 0
    final_loss: float | None = None
    final_val_loss: float | None = None
    first_val_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mem_gib: float | None = None
    time_to_first_step_s: float | None = None
    # The first step's own time less the median step: torch.compile (and CUDA graph capture) time.
    compile_s: float | None = None
    train_time_s: float = 0.0
    skipped_steps: int = 0
    step_p50_s: float | None = None
    step_p99_s: float | None = None
    # The time the loop waited for its batches (framework.data's ``last_wait_s``) over the warm steps:
    # per step, and as a share of the step time (an upper bound of the device's idle time: on CUDA
    # the host waits while the previous step still runs).
    data_wait_ms: float | None = None
    data_wait_share: float | None = None
    executor: str | None = None  # the executor the run ended on (after any fallback)
    # Every event row of this launch's metrics.jsonl ("step N: event: detail"): fallbacks, resumes,
    # rejected checkpoints, failed saves, preemption.
    events: list[str] = field(default_factory=list)
    # checkpoint=...: saves committed and failed, and the last failure (None without checkpointing).
    checkpoint: dict[str, Any] | None = None
    # executor.cache_dir: artifacts loaded / saved, Inductor FX-graph cache hits / misses (rank 0).
    compile_cache: dict[str, int] | None = None


@dataclass
class Built:
    """Everything the loop needs, from the build stages (plan -> freeze -> parallelize)."""

    plan: Plan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    frozen: FrozenResult
    dp_rank: int
    dp_size: int
    mesh: DeviceMesh | None = None
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    in_backward: InBackward | None = None  # train.optimizer_in_backward
    # model.float8 of the executed model: the configured recipe until a non-finite fallback to bf16.
    float8: Float8Recipe = Float8Recipe.none
    # parallel.cp > 1: cuts each micro-batch to this rank's sequence shard (framework.parallel.context).
    seq_shard: SequenceShard | None = None


def executed_model(cfg: Config, built: Built, executor: ExecutorConfig, device: torch.device) -> None:
    """(Re)build the executed model for ``executor`` from a fresh meta model, with a new optimiser and
    scheduler; the fallback ladder calls this again with the next rung."""
    model = build_model(
        dataclasses.replace(cfg.model, float8=built.float8), cfg.train.seq_len, data_mod.document_eos(cfg)
    )
    built.model = parallelize(
        model, built.mesh, built.plan, cfg.sharding, cfg.bucketing, executor, device, cfg.train.seed
    )
    built.seq_shard = sequence_shard(built.model, built.mesh, built.plan) if built.mesh is not None else None
    built.optimizer = build_optimizer(
        built.model, cfg.train, device, cfg.optimizer, cfg.run.instantiate_allow
    )
    if built.float8 is not Float8Recipe.none:
        attach_scale_precompute(built.model, built.optimizer)  # FSDP2's float8 all-gather only
    built.scheduler = build_scheduler(built.optimizer, cfg.train, cfg.lr_scheduler)
    if built.in_backward is not None:
        built.in_backward.remove()  # hooks of the model being replaced
    built.in_backward = attach_in_backward(built.optimizer) if cfg.train.optimizer_in_backward else None
    built.executor = executor
    settle_ddp_buckets(built.model, cfg.train.micro_batch_size, cfg.train.seq_len, device)


def settle_ddp_buckets(
    model: torch.nn.Module, micro_batch_size: int, seq_len: int, device: torch.device
) -> None:
    """Bring a fresh DDP to the bucket layout it keeps for the whole run, on zero losses, before step 1.

    DDP builds its gradient buckets in parameter order, records the order in which gradients become
    ready on one synced iteration, and rebuilds the buckets in that order at the next forward, once.
    Under ``static_graph=True`` the first iteration only records the graph (its gradient hooks return
    before the ready order is noted), so the ready order comes from the second iteration and the
    rebuild happens at the third forward; without a static graph, from the first and at the second.
    The layout decides where each parameter sits in the bucket, so which chunk of the ring all-reduce
    it falls in and in which order the ranks' values are summed: with more than 2 ranks another order
    changes the last bits (at 2, a + b == b + a). Each process start (a fresh run, a restart, a
    resume, a fallback rebuild) must therefore reach the rebuilt layout before its first real step,
    or that step is summed differently from the unbroken run (issue 19: not bitwise at 8 ranks).

    The static graph's recording iteration must also sync every micro-batch (``loop._no_grad_sync``),
    which sums accumulated gradients in another order than later steps (avg(g1) + avg(g2) instead of
    avg(g1 + g2)): one more reason it must not be a real step.

    The zero loss gives zero gradients, which are dropped; weights, optimiser and RNG state are
    untouched. Cost: one or two forward + backward + all-reduce of one micro-batch per process
    start, nothing per step (every step after the first already ran on the rebuilt layout).
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    tokens = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device=device)
    for _ in range(2 if model.static_graph else 1):
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(device):
            loss = model(tokens, tokens) * 0.0
        loss.backward()
        for p in model.parameters():
            p.grad = None
    model._framework_graph_recorded = True  # read by loop._no_grad_sync


def build(cfg: Config, env: DistEnv, run_dir: Path, verifier: Verifier, digest: str) -> Built:
    """Plan, build on meta, freeze, check the graph across ranks (before any training collective),
    parallelize (which places and initialises), optimiser."""
    plan: Plan = make_plan(cfg)
    mesh = build_mesh(plan, env.device.type)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    model = build_model(cfg.model, cfg.train.seq_len, data_mod.document_eos(cfg))
    if env.is_main:
        log.info(
            "model %s: %.2fM parameters, %.3g flops/token (6N + 12LHQT) at seq_len %d",
            cfg.model.name,
            num_params(cfg.model) / 1e6,
            flops_per_token(cfg.model, cfg.train.seq_len),
            cfg.train.seq_len,
        )
    frozen = freeze_stage(model, cfg, run_dir, env)
    flat = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    executor = cfg.executor
    can_fall = next_mode(executor.mode) is not None
    if verifier.check_graph(model, frozen, digest, flat, can_fall) is Policy.fallback:
        executor = dataclasses.replace(executor, mode=ExecutorMode.eager)
        verifier.fallback(
            0, "graph", f"executor {cfg.executor.mode.value} -> eager", "reference graph differs"
        )
    # The model, optimiser and scheduler are made by ``start_executor`` (the fallback ladder).
    return Built(plan, model, None, None, frozen, dp_rank, dp_size, mesh, executor, float8=cfg.model.float8)  # type: ignore[arg-type]


def start_executor(cfg: Config, built: Built, data: Data, verifier: Verifier, device: torch.device) -> None:
    """Parallelize for the configured executor; with verify on, the start of the fallback ladder.

    The first forward (where torch.compile compiles) and the numerics check run before step 1. A
    compile/capture error, or a numerics failure under ``policy=fallback``, rebuilds from a fresh
    meta model with the next rung (cudagraphs -> compile -> eager); nothing has trained yet, so the
    run restarts cleanly at step 0. The ranks agree on the outcome (one all_gather_object); a
    compile error that hits only some ranks inside a collective is not covered (it would hang).
    """
    executor = built.executor
    while True:
        lower = next_mode(executor.mode)
        error, action = None, None
        try:
            executed_model(cfg, built, executor, device)
            if not verifier.enabled:
                return
            rows = data.sampler.peek()[: cfg.train.micro_batch_size]
            x, y = split_rows(rows)
            if verifier.vcfg.numerics:
                compiled = executor.mode is not ExecutorMode.eager
                action = verifier.check_numerics(built.model, (x, y), device, compiled, lower is not None)
            else:
                batch_logits(built.model, x, device)
        except Exception as e:  # noqa: BLE001 - any compile/capture error moves down the ladder
            if lower is None or not verifier.enabled:
                raise
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        errors: list[str | None] = [error]
        if dist.is_initialized() and dist.get_world_size() > 1:
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if not failed and action is not Policy.fallback:
            return
        assert lower is not None
        trigger, detail = ("compile_error", failed[0]) if failed else ("numerics", "executed != eager")
        verifier.fallback(0, trigger, f"executor {executor.mode.value} -> {lower.value}", detail)
        executor = dataclasses.replace(executor, mode=lower)


def fall_back_mid_run(cfg: Config, built: Built, device: torch.device) -> ExecutorMode | None:
    """Rebuild with the next rung and carry the trained weights, optimiser and LR schedule over."""
    lower = next_mode(built.executor.mode)
    if lower is None:
        return None
    old_model, old_opt, old_sched = built.model, built.optimizer, built.scheduler
    executed_model(cfg, built, dataclasses.replace(built.executor, mode=lower), device)
    carry_state(old_model, old_opt, built.model, built.optimizer)
    built.scheduler.load_state_dict(old_sched.state_dict())
    return lower


def fall_back_to_bf16(cfg: Config, built: Built, device: torch.device) -> Float8Recipe:
    """The float8 rung of the ladder: rebuild the same executor without float8 (bf16 autocast) and
    carry the trained weights, optimiser and LR schedule over; returns the recipe left behind.

    The state dicts have the same keys and fp32 values with float8 on or off (Float8Linear keeps the
    high-precision weights), so the carry-over is the executor rung's.
    """
    left = built.float8
    old_model, old_opt, old_sched = built.model, built.optimizer, built.scheduler
    built.float8 = Float8Recipe.none
    executed_model(cfg, built, built.executor, device)
    carry_state(old_model, old_opt, built.model, built.optimizer)
    built.scheduler.load_state_dict(old_sched.state_dict())
    return left


Data = data_mod.Pipeline


def make_data(cfg: Config, env: DistEnv, dp_rank: int, dp_size: int) -> Data:
    data = data_mod.build_data(cfg, dp_rank, dp_size)
    if env.is_main:
        log.info("data: %s", data.description)
    return data


def checkpoint_root(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


def trained_before(run_dir: Path) -> int | None:
    """The last step an earlier launch in this run dir logged a loss for (None: none did). Read before
    this launch logs its first step."""
    steps = [int(r["step"]) for r in read_metrics(run_dir) if "loss" in r]
    return max(steps) if steps else None


def resume(
    ckpt: Checkpointer | None,
    cfg: Config,
    built: Built,
    data: Data,
    digest: str,
    env: DistEnv,
    metrics: Metrics,
    run_dir: Path,
) -> dict[str, Any]:
    """Load the checkpoint that ``checkpoint.resume`` names; returns its extra state ({} if none).

    ``auto`` takes the newest checkpoint that verifies and loads; each newer one is moved to
    ``corrupt/`` (kept) with a ``checkpoint_rejected`` event. When none is usable but there were
    checkpoints, or an earlier launch in this run dir trained, the run starts from step 0 *loudly*:
    an error in the log, a ``no_usable_checkpoint`` event in metrics.jsonl and in summary.json.
    """
    if ckpt is None:
        return {}
    t0 = time.perf_counter()
    if cfg.checkpoint.resume != "auto":
        path = ckpt.resolve_resume(cfg.checkpoint.resume)
        if path is None:
            return {}
        extra = ckpt.load(path, built.model, built.optimizer, built.scheduler)
    else:
        before = trained_before(run_dir) if env.is_main else None
        found = ckpt.load_latest(built.model, built.optimizer, built.scheduler)
        for name, reason in found.rejected:
            metrics.log({"step": 0, "event": "checkpoint_rejected", "detail": f"{name}: {reason}"})
        if found.path is None:
            if found.load_failed:  # a load stopped part-way: start from freshly initialised weights
                executed_model(cfg, built, built.executor, env.device)
            if found.rejected or before is not None:
                report_no_checkpoint(ckpt, found.rejected, before, metrics)
            return {}
        path, extra = found.path, found.extra
    if extra.get("config_hash") not in (None, digest) and env.is_main:
        log.warning(
            "resuming %s, saved with a different config (hash %s, now %s)",
            path,
            extra["config_hash"][:12],
            digest[:12],
        )
    data.sampler.load_state_dict(extra["data"])
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    detail = f"from {path} at step {extra['step']} in {time.perf_counter() - t0:.1f}s"
    if restarts:
        detail += f" (restart {restarts} of the launcher)"
    metrics.log({"step": extra["step"], "event": "resumed", "detail": detail, "restarts": restarts})
    return extra


def log_failed_saves(ckpt: Checkpointer, metrics: Metrics) -> None:
    """A ``checkpoint_failed`` event for each save that failed since the last call (at its own step)."""
    for step, error in ckpt.take_failures():
        metrics.log({"step": step, "event": "checkpoint_failed", "detail": error})


def report_no_checkpoint(
    ckpt: Checkpointer, rejected: list[tuple[str, str]], before: int | None, metrics: Metrics
) -> None:
    """Say loudly (log error, metrics event, summary) that this run starts over from step 0."""
    if rejected:
        names = ", ".join(Path(n).name for n, _ in rejected)
        what = (
            f"none of the {len(rejected)} checkpoints under {ckpt.root} is usable ({names}); they were "
            f"moved to {ckpt.root / 'corrupt'} (kept, with the reason in <name>.why)"
        )
    else:
        what = f"an earlier launch in this run dir trained to step {before}, but no checkpoint is left under {ckpt.root}"
    detail = f"{what}: training starts from step 0"
    log.error("RESUME FAILED: %s", detail)
    metrics.log({"step": 0, "event": "no_usable_checkpoint", "detail": detail})


def run(cfg: Config, run_dir: Path) -> Summary:
    """Train on this rank. Rank 0 writes the run files; all ranks share ``run_dir``."""
    t_start = time.perf_counter()
    cfg = resolve_batch(cfg)  # a no-op for the config entry.py wrote (already resolved)
    device = resolve_device(cfg.run.device)
    env = init_distributed(device, cfg.nccl.timeout_s)
    device = env.device
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    digest = check_same_config(cfg, env, run_dir)
    verifier = Verifier(cfg, run_dir, env.is_main)
    built = build(cfg, env, run_dir, verifier, digest)
    data = make_data(cfg, env, built.dp_rank, built.dp_size)
    metrics = Metrics(run_dir, env.is_main, cfg.train.steps, 0, cfg.logger.progress_bar)
    verifier.attach(metrics.log)
    cache = CacheStats()
    use_cache = cfg.executor.cache_dir is not None and cfg.executor.mode is not ExecutorMode.eager
    if use_cache:
        cache.loaded = load_cache(cfg.executor.cache_dir)
    start_executor(cfg, built, data, verifier, device)
    ckpt = None
    if cfg.checkpoint.enabled:
        ckpt = Checkpointer(cfg.checkpoint, checkpoint_root(cfg, run_dir), run_id=str(run_dir))
    preempt = PreemptionHandler(ckpt.control_group) if ckpt is not None else None
    resumed = resume(ckpt, cfg, built, data, digest, env, metrics, run_dir)
    start_step, tokens_seen = int(resumed.get("step", 0)), int(resumed.get("tokens_seen", 0))
    if env.is_main:
        plain = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
        # The wandb run id saved in the checkpoint: the same wandb run continues after a restart.
        metrics.sinks = make_sinks(cfg.logger, run_dir, plain, run_id=resumed.get("wandb_run_id"))
    profiler = make_profiler(cfg.run, run_dir, env.rank)

    def save(step: int) -> None:
        assert ckpt is not None
        extra = {
            "step": step,
            "tokens_seen": tokens_seen,
            "data": data.sampler.state_dict(),
            "config_hash": digest,
            "wandb_run_id": metrics.wandb_run_id if env.is_main else None,
            # The shape, so that model.init_from and export-hf can read this checkpoint on its own.
            "model": shape_of(cfg.model),
        }
        ckpt.save(step, built.model, built.optimizer, built.scheduler, extra)
        log_failed_saves(ckpt, metrics)

    def rollback(step: int) -> int:
        """Back to the latest checkpoint, keeping the data position (past the bad batches).

        A float8 run first steps down to bf16 (``fall_back_to_bf16``): float8's 3 mantissa bits
        and per-tensor scales are the likeliest cause of a run that goes non-finite and stays so.
        """
        nonlocal tokens_seen, since_build
        if next_float8(built.float8) is not None:
            left = fall_back_to_bf16(cfg, built, device)
            since_build = 0
            verifier.fallback(
                step,
                "bad_steps",
                f"model.float8 {left.value} -> none (bf16)",
                f"{cfg.verify.max_bad_steps} non-finite steps in a row under float8 {left.value}",
            )
        path = ckpt.latest() if ckpt is not None else None
        if path is None:
            verifier.fallback(
                step,
                "bad_steps",
                "no checkpoint to roll back to: skipping on",
                f"{cfg.verify.max_bad_steps} non-finite steps in a row",
            )
            return step
        position = data.sampler.state_dict()
        extra = ckpt.load(path, built.model, built.optimizer, built.scheduler)  # type: ignore[union-attr]
        data.sampler.load_state_dict(position)
        tokens_seen = int(extra.get("tokens_seen", 0))
        verifier.fallback(
            step,
            "bad_steps",
            f"rollback to step {extra['step']} ({path.name})",
            f"{cfg.verify.max_bad_steps} non-finite steps in a row; data stays at batch "
            f"{position['consumed_batches']}",
        )
        return int(extra["step"])

    summary = Summary()
    device_peak = peak_tflops(cfg, device)
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    window_tokens, window_time = 0, 0.0  # since warm-up: the run's throughput (summary)
    log_tokens, log_time = 0, 0.0  # since the last log row: that row's throughput
    window_wait, log_wait, log_steps = 0.0, 0.0, 0  # the loader's wait for its batches (warm steps)
    step_seconds: list[float] = []  # post-warm-up step times, for p50/p99 and the baseline
    nan_batches = set(cfg.verify.inject_nan_steps)
    since_build = 0  # steps since the executor was (re)built: each build pays its own warm-up
    train_t0 = time.perf_counter()
    last_val: float | None = None
    stopped = False
    step = start_step
    first_step_s: float | None = None
    io = HostIO(device)
    # Lag: the host queues step k+1 before it reads step k's figures (HostIO), so the GPU does not
    # idle between steps while the host logs, counts and prepares the next batch. Only plain steps
    # lag: a step that ends at a log row, an evaluation, a checkpoint, a fault injection or the end
    # of the run is read at once. With verify on, every step is read at once (the circuit breaker
    # may swap the executor before the next step).
    lag = not verifier.enabled
    pending: tuple[StepResult, int, bool, float] | None = None  # (result, its step, warm, data wait)

    def account(result: StepResult, done: int, warm: bool, wait_s: float) -> StepAction:
        """Everything that reads a step's figures: counters, throughput, data wait, verify, the log row."""
        nonlocal window_tokens, window_time, log_tokens, log_time, first_step_s, since_build
        nonlocal window_wait, log_wait, log_steps
        if summary.time_to_first_step_s is None:
            summary.time_to_first_step_s = time.perf_counter() - t_start
            first_step_s = result.seconds
        if not result.finite:
            summary.skipped_steps += 1
            metrics.log({"step": done, "event": "skipped_step", "detail": "non-finite loss or gradient"})
        # The first steps pay for compilation and allocator warm-up: keep them out of throughput.
        if warm and result.finite:
            window_tokens += tokens_per_step
            window_time += result.seconds
            log_tokens += tokens_per_step
            log_time += result.seconds
            window_wait += wait_s
            log_wait += wait_s
            log_steps += 1
            step_seconds.append(result.seconds)
            if verifier.enabled and verifier.breaker is None:
                verifier.start_timing(
                    verifier.baseline_p99(env.world_size, device_name(env), built.executor.mode)
                )
        action, tripped = verifier.after_step(
            result.finite, result.seconds if warm and result.finite else None
        )
        metrics.advance()
        if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            tps = log_tokens / log_time if log_time > 0 else None
            row: dict[str, Any] = {
                "step": done,
                "loss": result.loss,
                "lr": result.lr,
                "grad_norm": result.grad_norm,
                "tokens_per_s": tps,
                "step_ms": result.seconds * 1e3,
            }
            if log_steps:
                row["data_wait_ms"] = log_wait / log_steps * 1e3
                row["data_wait_share"] = log_wait / log_time
            log_tokens, log_time, log_wait, log_steps = 0, 0.0, 0.0, 0
            if device_peak is not None and tps is not None:
                row["mfu"] = fpt * tps / (device_peak * 1e12 * env.world_size)
            if device.type == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            metrics.log(row)
            # row["loss"], not result.loss again: reading it is an all-reduce over ranks.
            summary.final_loss, summary.peak_mem_gib = row["loss"], row.get("peak_mem_gib")
        if window_time > 0:
            summary.tokens_per_s = window_tokens / window_time
            summary.data_wait_ms = window_wait / len(step_seconds) * 1e3
            summary.data_wait_share = window_wait / window_time
            if device_peak is not None:
                summary.mfu = fpt * summary.tokens_per_s / (device_peak * 1e12 * env.world_size)
        if tripped:
            p99 = verifier.breaker.last_p99_s if verifier.breaker is not None else None
            lower = fall_back_mid_run(cfg, built, device)
            what = f"executor {lower and built.executor.mode.value}" if lower else "none (already eager)"
            verifier.fallback(done, "circuit_breaker", f"fallback: {what}", f"window p99 {p99}")
            if verifier.breaker is not None:
                verifier.breaker.reset()
            since_build = 0
        return action

    def boundary(done: int) -> bool:
        """Does anything at the end of step ``done`` need its figures first? (Checkpoints and
        preemption are decided by the caller, once per step: they are collectives.)"""
        return (
            not lag
            or summary.time_to_first_step_s is None
            or done % cfg.train.log_every == 0
            or done >= cfg.train.steps
            or (cfg.train.eval_every > 0 and done % cfg.train.eval_every == 0)
            or done == cfg.run.fault_kill_at_step
        )

    profiler.__enter__()
    while step < cfg.train.steps:
        if cfg.train.eval_every > 0 and step % cfg.train.eval_every == 0:
            last_val = evaluate(built.model, data.val_batches, device)
            summary.first_val_loss = (
                summary.first_val_loss if summary.first_val_loss is not None else last_val
            )
            metrics.log(validation_row(step, last_val))
        poison = (
            data.sampler.consumed_batches in nan_batches
        )  # a batch index: fires once, even after a rollback
        batch = data.sampler.next_batch()
        wait_s = data.sampler.last_wait_s  # the sampler times its own wait
        with inject_nan(built.model, poison):
            result = train_step(
                built.model,
                built.optimizer,
                built.scheduler,
                batch,
                cfg.train.grad_clip,
                device,
                built.in_backward,
                io,
                data.sampler.loss_scales(),
                built.seq_shard,
            )
        tokens_seen += tokens_per_step
        warm = since_build >= built.executor.warmup_steps
        since_build += 1
        profiler.step()
        done = step + 1
        summary.steps = done
        if pending is not None:  # the previous step, read now that this one is queued
            previous, pending = pending, None
            if account(*previous) is StepAction.rollback:
                if ckpt is not None and ckpt.latest() is not None:
                    # This step ran on the weights the rollback replaces: undo its batch and count,
                    # so the run goes on exactly as if the rollback had come before it.
                    data.sampler.undo_last()
                    since_build -= 1
                    summary.steps = previous[1]
                    step = rollback(previous[1])
                    continue
                rollback(previous[1])  # no checkpoint: records that, and the run skips on
        # Once per step and in the same order on every rank: both can be collectives.
        stop_now = preempt is not None and preempt.requested()
        save_now = ckpt is not None and (
            stop_now
            or (done == cfg.train.steps and cfg.checkpoint.at_end)
            or ckpt.should_save(done, time.monotonic())
        )
        if not (save_now or stop_now or boundary(done)):
            pending = (result, done, warm, wait_s)
            step = done
            continue
        if account(result, done, warm, wait_s) is StepAction.rollback:
            step = rollback(done)
            continue
        maybe_inject_fault(cfg, env, done)
        if save_now:
            save(done)
        if stop_now:
            stopped = True
            assert ckpt is not None and preempt is not None
            ckpt.wait()  # an async save commits now: the event below says whether it did
            log_failed_saves(ckpt, metrics)
            sig = preempt.signal_name()
            saved = ckpt.last_error is None
            detail = (
                f"{sig}: saved step {done}, exiting"
                if saved
                else f"{sig}: the save at step {done} failed ({ckpt.last_error}), exiting"
            )
            metrics.log({"step": done, "event": "preempted", "detail": detail, "saved": saved})
            break
        step = done
    profiler.__exit__(None, None, None)
    if env.is_main and profiler.top_operators():
        log.info("top operators (profiled steps):\n%s", format_top_operators(profiler.top_operators(10)))
    model = built.model
    if cfg.train.eval_every > 0 and not stopped:
        last_val = evaluate(model, data.val_batches, device)
        metrics.log(validation_row(cfg.train.steps, last_val))
    summary.final_val_loss = last_val
    summary.train_time_s = time.perf_counter() - train_t0
    if use_cache:
        cache.hits, cache.misses = cache_counters()
        if env.is_main and cache.misses:  # something new was compiled: keep it for the next run
            cache.saved = save_cache(cfg.executor.cache_dir)
        summary.compile_cache = dataclasses.asdict(cache)
    summary.executor = built.executor.mode.value
    figures = perf_figures(step_seconds, tokens_per_step, summary.mfu, summary.peak_mem_gib)
    if figures is not None:
        summary.step_p50_s, summary.step_p99_s = figures.step_p50_s, figures.step_p99_s
        if built.executor.mode is not ExecutorMode.eager and first_step_s is not None:
            summary.compile_s = max(0.0, first_step_s - figures.step_p50_s)
    meta = {"run_dir": str(run_dir), "config_hash": digest}
    verifier.finish(figures, env.world_size, device_name(env), meta, built.executor.mode, can_fall_back=False)
    if ckpt is not None:
        ckpt.close()
        log_failed_saves(ckpt, metrics)
        summary.checkpoint = {
            "saved": ckpt.saves_ok,
            "failed": ckpt.saves_failed,
            "last_error": ckpt.last_error,
        }
        if ckpt.saves_failed and not ckpt.saves_ok and env.is_main:
            log.error(
                "every checkpoint save of this run failed (%d of %d): %s",
                ckpt.saves_failed,
                ckpt.saves_failed,
                ckpt.last_error,
            )
    # Events, read last: they include the checkpoint failures of the commit ``close`` just waited for.
    summary.events = [format_row(r) for r in metrics.rows if "event" in r]
    if preempt is not None:
        preempt.close()
    if cfg.checkpoint.export_hf:  # also when preempted: the job may not come back
        state = full_model_state(model)  # a collective under FSDP / TP: every rank calls it
        if env.is_main:
            from framework.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(cfg.tokenizer)
            out = export_hf(state, cfg.model, run_dir / "hf", cfg.train.seq_len, tokenizer)
            log.info("exported a Hugging Face checkpoint of step %d to %s", summary.steps, out)
    metrics.close()
    write_summary(run_dir, cfg, built.plan, summary, digest, env)
    return summary


def maybe_inject_fault(cfg: Config, env: DistEnv, step: int) -> None:
    """``run.fault_kill_at_step``: SIGKILL this rank (no cleanup, like a node failure) on the first attempt."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if step == cfg.run.fault_kill_at_step and env.rank == cfg.run.fault_rank and first_attempt:
        log.warning("run.fault_kill_at_step=%d: rank %d kills itself", step, env.rank)
        os.kill(os.getpid(), signal.SIGKILL)


def freeze_stage(model: torch.nn.Module, cfg: Config, run_dir: Path, env: DistEnv) -> FrozenResult:
    """Freeze the unsharded meta-device model at the run's static shapes (fake tensors: no weights).

    Tracing on meta costs no memory, so a 70B shape freezes on any host, and the fingerprint is the
    same on every device type. The artifact (graph and signature; weights live in checkpoints) and
    its manifest go to ``run_dir/frozen`` on rank 0.
    """
    example = torch.zeros(cfg.train.micro_batch_size, cfg.train.seq_len, dtype=torch.long, device="meta")
    result = freeze(
        model,
        (example,),
        cfg.freeze,
        run_dir,
        write=env.is_main,
        manifest_extra={"model": cfg.model.name, "seq_len": cfg.train.seq_len},
    )
    if env.is_main and cfg.freeze.mode is not FreezeMode.none:
        log.info(
            "froze the model (%s) in %.1fs: graph fingerprint %s",
            cfg.freeze.mode.value,
            result.seconds,
            (result.fingerprint or "")[:16],
        )
    return result


def device_name(env: DistEnv) -> str:
    """The device model, part of a performance baseline's key."""
    if env.device.type == "cuda":
        return torch.cuda.get_device_name(env.device)
    return platform.processor() or platform.machine()


@rank_zero_only
def write_summary(
    run_dir: Path, cfg: Config, plan: Plan, summary: Summary, digest: str, env: DistEnv
) -> None:
    info = {
        **summary.__dict__,
        "config_hash": digest,
        "world_size": env.world_size,
        "device": str(env.device),
        "device_name": device_name(env),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    (run_dir / "summary.json").write_text(json.dumps(info, indent=2) + "\n")
    lines = [f"run dir: {run_dir}", f"steps: {summary.steps} in {summary.train_time_s:.1f}s"]
    if summary.first_val_loss is not None and summary.final_val_loss is not None:
        lines.append(
            f"val loss: {summary.first_val_loss:.4f} -> {summary.final_val_loss:.4f}"
            f" (perplexity {perplexity(summary.final_val_loss):.2f})"
        )
    if summary.final_loss is not None:
        lines.append(f"final train loss: {summary.final_loss:.4f}")
    if summary.tokens_per_s:
        lines.append(f"throughput: {summary.tokens_per_s:,.0f} tokens/s")
    if summary.data_wait_share is not None:
        lines.append(
            f"data wait: {summary.data_wait_ms:.2f} ms/step ({summary.data_wait_share:.2%} of the step time)"
        )
    if summary.mfu is not None:
        lines.append(f"MFU: {summary.mfu:.1%}")
    if summary.time_to_first_step_s is not None:
        lines.append(f"time to first step: {summary.time_to_first_step_s:.1f}s")
    if summary.compile_s is not None:
        lines.append(f"compile (first step less a median step): {summary.compile_s:.1f}s")
    if summary.compile_cache is not None:
        c = summary.compile_cache
        lines.append(
            f"compile cache: {c['loaded']} artifacts loaded, {c['hits']} graph hits, {c['misses']} misses, "
            f"{c['saved']} saved"
        )
    log.info("summary:\n  %s", "\n  ".join(lines))
