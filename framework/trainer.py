"""The Trainer wires the stages, in one direction: plan -> build -> freeze -> parallelize -> run.

It does none of their work: each stage is a module of ``framework`` that takes the previous stage's
plain result. ``run`` executes on every rank, after the process group exists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from framework import data as data_mod
from framework.checkpoint import Checkpointer, PreemptionHandler, export_hf, full_model_state
from framework.config import Config, FreezeMode, to_yaml
from framework.freeze import FrozenResult, freeze
from framework.launch import DistEnv, init_distributed, resolve_device
from framework.loop import build_optimizer, build_scheduler, evaluate, train_step
from framework.metrics import Metrics
from framework.model import build_model, flops_per_token, num_params
from framework.parallel import build_mesh, dp_mesh_info, parallelize
from framework.plan import Plan, make_plan

log = logging.getLogger("framework")


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


def check_same_config(cfg: Config, env: DistEnv) -> str:
    """All ranks must run the same resolved config; stop naming the differing keys otherwise."""
    digest = config_hash(cfg)
    if env.world_size == 1:
        return digest
    hashes: list[str] = [""] * env.world_size
    dist.all_gather_object(hashes, digest)
    if len(set(hashes)) == 1:
        return digest
    flat = _flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    flats: list[dict[str, Any]] = [{}] * env.world_size
    dist.all_gather_object(flats, flat)
    bad = sorted({k for f in flats for k in set(f) | set(flats[0]) if f.get(k) != flats[0].get(k)})
    ranks = [r for r, h in enumerate(hashes) if h != hashes[0]]
    raise ValueError(f"ranks {ranks} resolved a different config than rank 0; differing keys: {bad}")


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


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
    train_time_s: float = 0.0
    skipped_steps: int = 0
    events: list[str] = field(default_factory=list)


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


def build(cfg: Config, env: DistEnv, run_dir: Path) -> Built:
    """Plan, build on meta, freeze, parallelize (which places and initialises), optimiser."""
    plan: Plan = make_plan(cfg)
    mesh = build_mesh(plan, env.device.type)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    model = build_model(cfg.model, cfg.train.seq_len)
    if env.is_main:
        log.info(
            "model %s: %.2fM parameters, %.3g flops/token (6N + 12LHQT) at seq_len %d",
            cfg.model.name, num_params(cfg.model) / 1e6, flops_per_token(cfg.model, cfg.train.seq_len),
            cfg.train.seq_len,
        )
    frozen = freeze_stage(model, cfg, run_dir, env)
    model = parallelize(
        model, mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, env.device, cfg.train.seed
    )
    optimizer = build_optimizer(model, cfg.train, env.device)
    scheduler = build_scheduler(optimizer, cfg.train)
    return Built(plan, model, optimizer, scheduler, frozen, dp_rank, dp_size)


@dataclass
class Data:
    sampler: data_mod.BatchSampler
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]


def make_data(cfg: Config, env: DistEnv, dp_rank: int, dp_size: int) -> Data:
    corpus = data_mod.load_corpus(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)
    sampler = data_mod.BatchSampler(
        None if corpus is None else corpus.train, cfg.model.vocab_size, cfg.train.seq_len,
        cfg.train.global_batch_size, cfg.train.micro_batch_size, dp_rank, dp_size, cfg.train.seed,
    )
    val = []
    if cfg.train.eval_every > 0:
        val = data_mod.validation_batches(
            corpus, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.micro_batch_size,
            cfg.train.eval_batches, dp_rank, dp_size,
        )
    if env.is_main and corpus is not None:
        log.info("data: %s, %d train / %d val tokens", corpus.description, corpus.train.size, corpus.val.size)
    return Data(sampler, val)


def checkpoint_root(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


def resume(
    ckpt: Checkpointer | None, cfg: Config, built: Built, data: Data, digest: str, env: DistEnv, metrics: Metrics
) -> tuple[int, int]:
    """Load the checkpoint that ``checkpoint.resume`` names; returns (start step, tokens seen)."""
    if ckpt is None:
        return 0, 0
    path = ckpt.resolve_resume(cfg.checkpoint.resume)
    if path is None:
        return 0, 0
    t0 = time.perf_counter()
    extra = ckpt.load(path, built.model, built.optimizer, built.scheduler)
    if extra.get("config_hash") not in (None, digest) and env.is_main:
        log.warning("resuming %s, saved with a different config (hash %s, now %s)", path, extra["config_hash"][:12], digest[:12])
    data.sampler.load_state_dict(extra["data"])
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    detail = f"from {path} at step {extra['step']} in {time.perf_counter() - t0:.1f}s"
    if restarts:
        detail += f" (restart {restarts} of the launcher)"
    metrics.log({"step": extra["step"], "event": "resumed", "detail": detail, "restarts": restarts})
    return int(extra["step"]), int(extra.get("tokens_seen", 0))


def run(cfg: Config, run_dir: Path) -> Summary:
    """Train on this rank. Rank 0 writes the run files; all ranks share ``run_dir``."""
    t_start = time.perf_counter()
    device = resolve_device(cfg.run.device)
    env = init_distributed(device, cfg.nccl.timeout_s)
    device = env.device
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    digest = check_same_config(cfg, env)
    built = build(cfg, env, run_dir)
    data = make_data(cfg, env, built.dp_rank, built.dp_size)
    metrics = Metrics(run_dir, env.is_main, cfg.train.steps, 0, cfg.logger.progress_bar)
    ckpt = Checkpointer(cfg.checkpoint, checkpoint_root(cfg, run_dir)) if cfg.checkpoint.enabled else None
    preempt = PreemptionHandler(ckpt.control_group) if ckpt is not None else None
    start_step, tokens_seen = resume(ckpt, cfg, built, data, digest, env, metrics)

    def save(step: int) -> None:
        assert ckpt is not None
        extra = {"step": step, "tokens_seen": tokens_seen, "data": data.sampler.state_dict(), "config_hash": digest}
        ckpt.save(step, built.model, built.optimizer, built.scheduler, extra)
        if ckpt.last_error is not None:
            metrics.log({"step": step, "event": "checkpoint_failed", "detail": ckpt.last_error})

    summary = Summary()
    model, device_peak = built.model, peak_tflops(cfg, device)
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    window_tokens, window_time = 0, 0.0
    train_t0 = time.perf_counter()
    last_val: float | None = None
    stopped = False
    for step in range(start_step, cfg.train.steps):
        if cfg.train.eval_every > 0 and step % cfg.train.eval_every == 0:
            last_val = evaluate(model, data.val_batches, device)
            summary.first_val_loss = summary.first_val_loss if summary.first_val_loss is not None else last_val
            metrics.log({"step": step, "val_loss": last_val})
        result = train_step(
            model, built.optimizer, built.scheduler, data.sampler.next_batch(), cfg.train.grad_clip, device
        )
        tokens_seen += tokens_per_step
        if summary.time_to_first_step_s is None:
            summary.time_to_first_step_s = time.perf_counter() - t_start
        if not result.finite:
            summary.skipped_steps += 1
            metrics.log({"step": step + 1, "event": "skipped_step", "detail": "non-finite loss or gradient"})
        # The first steps pay for compilation and allocator warm-up: keep them out of throughput.
        if step - start_step >= cfg.executor.warmup_steps:
            window_tokens += tokens_per_step
            window_time += result.seconds
        metrics.advance()
        done = step + 1
        if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            tps = window_tokens / window_time if window_time > 0 else None
            row: dict[str, Any] = {
                "step": done, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                "tokens_per_s": tps, "step_ms": result.seconds * 1e3,
            }
            if device_peak is not None and tps is not None:
                row["mfu"] = fpt * tps / (device_peak * 1e12 * env.world_size)
            if device.type == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            metrics.log(row)
            summary.final_loss, summary.tokens_per_s = result.loss, tps
            summary.mfu, summary.peak_mem_gib = row.get("mfu"), row.get("peak_mem_gib")
        summary.steps = done
        if ckpt is not None:
            stopped = preempt is not None and preempt.requested()
            last = done == cfg.train.steps and cfg.checkpoint.at_end
            if stopped or last or ckpt.should_save(done, time.monotonic()):
                save(done)
            if stopped:
                metrics.log({"step": done, "event": "preempted", "detail": "signal received: saved, exiting"})
                break
    if cfg.train.eval_every > 0 and not stopped:
        last_val = evaluate(model, data.val_batches, device)
        metrics.log({"step": cfg.train.steps, "val_loss": last_val})
    summary.final_val_loss = last_val
    summary.train_time_s = time.perf_counter() - train_t0
    if ckpt is not None:
        ckpt.close()
    if preempt is not None:
        preempt.close()
    if cfg.checkpoint.export_hf and not stopped:
        state = full_model_state(model)  # a collective under FSDP / TP: every rank calls it
        if env.is_main:
            out = export_hf(state, cfg.model, run_dir / "hf", max_position_embeddings=cfg.train.seq_len)
            log.info("exported a Hugging Face checkpoint to %s", out)
    metrics.close()
    if env.is_main:
        write_summary(run_dir, cfg, built.plan, summary, digest, env)
    return summary


def freeze_stage(model: torch.nn.Module, cfg: Config, run_dir: Path, env: DistEnv) -> FrozenResult:
    """Freeze the unsharded meta-device model at the run's static shapes (fake tensors: no weights).

    Tracing on meta costs no memory, so a 70B shape freezes on any host, and the fingerprint is the
    same on every device type. The artifact (graph and signature; weights live in checkpoints) and
    its manifest go to ``run_dir/frozen`` on rank 0.
    """
    example = torch.zeros(cfg.train.micro_batch_size, cfg.train.seq_len, dtype=torch.long, device="meta")
    result = freeze(
        model, (example,), cfg.freeze, run_dir, write=env.is_main,
        manifest_extra={"model": cfg.model.name, "seq_len": cfg.train.seq_len},
    )
    if env.is_main and cfg.freeze.mode is not FreezeMode.none:
        log.info(
            "froze the model (%s) in %.1fs: graph fingerprint %s",
            cfg.freeze.mode.value, result.seconds, (result.fingerprint or "")[:16],
        )
    return result


def write_summary(run_dir: Path, cfg: Config, plan: Plan, summary: Summary, digest: str, env: DistEnv) -> None:
    info = {
        **summary.__dict__,
        "config_hash": digest,
        "world_size": env.world_size,
        "device": str(env.device),
        "device_name": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    (run_dir / "summary.json").write_text(json.dumps(info, indent=2) + "\n")
    lines = [f"run dir: {run_dir}", f"steps: {summary.steps} in {summary.train_time_s:.1f}s"]
    if summary.first_val_loss is not None and summary.final_val_loss is not None:
        lines.append(f"val loss: {summary.first_val_loss:.4f} -> {summary.final_val_loss:.4f}")
    if summary.final_loss is not None:
        lines.append(f"final train loss: {summary.final_loss:.4f}")
    if summary.tokens_per_s:
        lines.append(f"throughput: {summary.tokens_per_s:,.0f} tokens/s")
    if summary.mfu is not None:
        lines.append(f"MFU: {summary.mfu:.1%}")
    if summary.time_to_first_step_s is not None:
        lines.append(f"time to first step: {summary.time_to_first_step_s:.1f}s")
    log.info("summary:\n  %s", "\n  ".join(lines))
