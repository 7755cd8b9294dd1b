"""The Trainer wires the stages, in one direction: plan -> build -> freeze -> verify -> parallelize -> run.

It does none of their work: each stage is a module of ``framework`` that takes the previous stage's
plain result. ``run`` executes on every rank: it builds the parts once (``setup``), each owning its
state and timing, steps them (``train``, the loop) and writes the summary (``finish``):

- ``StepRunner`` (framework.train.runner): the executed model (built from the one meta model),
  its step function (picked once per build), the lag and the warm-up count;
- ``Verifier`` (framework.verify): judges the graph, each build and each step read (bad steps,
  the latency breaker), and only returns decisions;
- ``Ladder`` (framework.verify.fallback): the fallback ladder, driven here: the rung below for a
  verdict, rebuilt by the runner;
- ``RunCheckpoints`` (framework.checkpoint.session): when to save, preemption, resume, rollback;
- ``Metrics`` (framework.record.metrics): metrics.jsonl, the progress bar and its sinks (wandb);
- ``TrainState`` (framework.record.train_state): the counters they share, passed, never captured;
- ``Callbacks`` (framework.train.callbacks): the ``callbacks`` group (profiler, wandb, fault injection,
  the compile cache, and yours), called at the loop's moments.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from framework import data as data_mod
from framework.checkpoint import export_hf, full_model_state, init_from
from framework.checkpoint.session import RunCheckpoints
from framework.config.run_values import BatchShape, RunValues, data_run, run_values, write_run_values
from framework.config.schema import Config, ExecutorMode, FreezeMode, flatten
from framework.data.sft import split_rows
from framework.freeze import FrozenResult, freeze
from framework.models import balance_row, build_model, compute_dtype, flops_per_token, lora, num_params
from framework.parallel import build_mesh, dp_mesh_info
from framework.parallel.pipeline import pipeline_group
from framework.parallel.process import DistEnv, process_group, resolve_device, set_task_threads
from framework.planner.plan import Plan
from framework.planner.resolve import check_plan
from framework.record.metrics import Metrics, format_row, validation_row
from framework.record.train_state import TrainState
from framework.train.agreement import check_same_config
from framework.train.callbacks import Callbacks, RunContext, build_callbacks
from framework.train.loop import evaluate
from framework.train.run_dir_watch import RunDirWatch
from framework.train.runner import BuildGroups, Step, StepRunner
from framework.train.summary import Summary, write_summary
from framework.verify import StepAction, Verifier, next_mode, perf_figures
from framework.verify.baseline import device_name
from framework.verify.fallback import Ladder, Verdict

log = logging.getLogger("framework")


def peak_tflops(cfg: Config, device: torch.device) -> float | None:
    """Peak dense TFLOP/s per device for MFU: the declared hardware's figure, on CUDA only."""
    if device.type != "cuda":
        return None
    return cfg.mesh.hardware.peak_tflops if cfg.mesh.hardware.name != "cpu" else 989.0


Data = data_mod.Pipeline


@dataclass
class Parts:
    """What ``setup`` built once, for the loop and ``finish``."""

    cfg: Config
    values: RunValues  # the derived values (batch shape, checkpoint root, accumulation, ...), derived once
    env: DistEnv
    run_dir: Path
    digest: str
    plan: Plan
    runner: StepRunner
    data: Data
    metrics: Metrics
    verifier: Verifier
    ladder: Ladder
    ckpt: RunCheckpoints
    callbacks: Callbacks
    watch: RunDirWatch  # the run dir deleted mid-run: every rank stops with one line (DirGone)
    peak_flops: float | None  # of the whole job, for MFU (CUDA only)


def run(cfg: Config, plan: Plan, run_dir: Path, keep: list[object] | None = None) -> Summary:
    """Train on this rank. Rank 0 writes the run files; all ranks share ``run_dir``.

    ``cfg`` and ``plan`` are resolved once, before any rank starts (framework.planner.resolve.resolve:
    the launcher's, written to config.yaml and plan.json; a self-launched rank reads them back,
    framework.launch.worker.load_run): nothing here plans again. Raises ValueError when ``plan`` is
    another config's.

    Every part is closed on the way out, also when a step raises: an async save is finished, the
    sampler's thread, wandb, the metrics file and the callbacks are closed, the signal handlers are
    restored and the process group (when this call created it) is destroyed.

    ``keep``: a list that takes the run's parts, so that they are not freed when this returns. A
    rank that ends with ``os._exit`` (``framework.parallel.process.finish``) passes ``KEPT_PARTS``: freeing the
    DDP reducer after its process group was destroyed can deadlock on the GIL (see there)."""
    check_plan(cfg, plan)
    state = TrainState(0)
    with contextlib.ExitStack() as stack:
        callbacks = stack.enter_context(build_callbacks(cfg.callbacks, cfg.run.instantiate_allow))
        p = setup(cfg, plan, run_dir, state, stack, callbacks)
        if keep is not None:
            keep.append(p)
        train(p, state)
        return finish(p, state)


def train(p: Parts, state: TrainState) -> None:
    """The loop, to ``train.steps`` or a preemption. Each step: validate when due; queue the step;
    read the figures that are due (count, verify, log); roll back when the verifier asks; save
    when the checkpointer decides. The callbacks hear of each step before and after it is queued,
    when it is read and when it is saved.

    The lag (``StepRunner.defer``): the runner queues step k+1 before the host reads step k, so the
    device does not idle while the host logs. A bad step found one step late rolls back and undoes
    the step queued after it, so the run is the same as one read step by step.
    """
    cfg, runner, ckpt = p.cfg, p.runner, p.ckpt
    while state.step < cfg.train.steps:
        if cfg.train.eval_every > 0 and state.step % cfg.train.eval_every == 0:
            validate(p, state, state.step)
        p.callbacks.before_step(state.step + 1)  # the scheduler holds this step's rates
        queued = runner.step(p.data.sampler, state.step + 1)
        state.step, state.tokens_seen = queued.step, state.tokens_seen + state.tokens_per_step
        p.callbacks.after_step(state.step)
        late = runner.take_late()  # the previous step, read now that this one is queued
        if late is not None and read(p, state, late) is StepAction.rollback:
            if ckpt.rollback(late.step, rewind=True) is not None:
                runner.discard(queued)
                continue
        # Once per step and in the same order on every rank: it can be a collective.
        saving = ckpt.decide(state.step)
        if not saving and runner.defer(queued):
            continue
        if read(p, state, queued) is StepAction.rollback:
            ckpt.rollback(queued.step, rewind=False)
            continue
        if saving:  # a save into a deleted run dir would recreate part of it
            p.watch.check(state.step)
        with p.watch.blame(state.step):
            preempted = ckpt.save_if_due(state.step)  # preempted: saved (or the event says why not)
        if saving:
            p.callbacks.on_save(state.step)
        if preempted:
            break


def read(p: Parts, state: TrainState, s: Step) -> StepAction:
    """Read one step's figures: count them, let the verifier judge them (it may change the rung),
    log the row when one is due. Reading the loss is a collective: every rank reads the same steps."""
    r, train_cfg = s.result, p.cfg.train
    if state.time_to_first_step_s is None:
        state.first_step(r.seconds)
    if not r.finite:
        p.metrics.log({"step": s.step, "event": "skipped_step", "detail": "non-finite loss or gradient"})
    timed = r.seconds if s.warm and r.finite else None  # warm-up steps stay out of throughput
    state.count(timed, r.finite, s.wait_s)
    action, verdict = p.verifier.observe(r.finite, timed, p.runner.mode, p.ladder.lower() is not None)
    p.ladder.take(s.step, verdict)  # a lower rung when the verdict asks (the runner rebuilds)
    p.metrics.advance()
    if s.step % train_cfg.log_every == 0 or s.step == train_cfg.steps:
        window = state.take_log_window()
        tps = window.pop("tokens_per_s")
        row: dict[str, Any] = {
            "step": s.step,
            "loss": r.loss,
            "lr": r.lr,
            "tokens_per_s": tps,
            "step_ms": r.seconds * 1e3,
            **window,  # data_wait_ms and data_wait_share, when a timed step ran
        }
        if not (train_cfg.optimizer_in_backward and not train_cfg.in_backward_grad_checks):
            row["grad_norm"] = r.grad_norm  # not measured without the in-backward checks
        if p.peak_flops is not None and tps is not None:
            row["mfu"] = flops_per_token(p.cfg.model, p.values.batch.seq_len) * tps / p.peak_flops
        if p.env.device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(p.env.device) / 2**30
        if p.cfg.model.moe.num_experts:  # an MoE family's expert balance since the last row
            row |= balance_row(p.runner.model, pipeline_group(p.runner.model))  # every rank: a collective
        if r.aux is not None:  # the load-balancing term the step's loss added, before its coefficient
            row["moe_aux_loss"] = r.aux
        if r.mtp is not None:  # multi-token prediction's cross-entropy the loss added, before its weight
            row["mtp_loss"] = r.mtp
        p.watch.check(s.step)
        p.metrics.log(row)
        # row["loss"], not r.loss again: reading it is an all-reduce over ranks.
        state.final_loss, state.peak_mem_gib = row["loss"], row.get("peak_mem_gib")
    p.callbacks.on_step_read(s)
    return action


def validate(p: Parts, state: TrainState, step: int) -> None:
    """The validation loss (and each ``train.eval_sets`` set's) at ``step``, logged as a row.

    Through the ladder's guard: the first validation (step 0 by default) is where torch.compile
    compiles the eval graph, before any training step; a compile error there steps down one rung
    and evaluates again, as one in the first step does (no rung below: it is raised)."""
    state.last_val_loss, sets = p.ladder.guard(lambda: evaluate_all(p), step)
    if state.first_val_loss is None:
        state.first_val_loss = state.last_val_loss
    p.watch.check(step)
    p.metrics.log(validation_row(step, state.last_val_loss, sets))


def evaluate_all(p: Parts) -> tuple[float, dict[str, float]]:
    """The validation loss and the loss of each ``train.eval_sets`` set, by name (every rank
    evaluates each one), on the runner's current model (a fallback rebuilds it)."""
    model, device = p.runner.model, p.env.device
    loss = evaluate(model, p.data.val_batches, device)
    return loss, {name: evaluate(model, batches, device) for name, batches in p.data.eval_sets.items()}


def setup(
    cfg: Config,
    plan: Plan,
    run_dir: Path,
    state: TrainState,
    stack: contextlib.ExitStack,
    callbacks: Callbacks,
) -> Parts:
    """Build every part once, in the order the ranks' collectives need; ``stack`` closes each. The
    callbacks are set up before the model is built and hear ``on_resume`` once everything is."""
    env = stack.enter_context(process_group(resolve_device(cfg.run.device), cfg.nccl.timeout_s))
    run = RunContext(cfg, run_dir, env.rank, env.is_main, state)
    callbacks.setup(run)
    values = derive_values(cfg, plan, run_dir, env)
    if env.device.type == "cpu":  # threads that do not collapse when another process takes a core
        threads = set_task_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if env.is_main:
            log.info("intra-op threads: %d (OMP_NUM_THREADS, when set, wins)", threads)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    # The global RNG (dropout: peft.dropout) from train.seed, a stream per rank: torch seeds it at
    # random in each process, so two runs of one config drew different masks. A resume restores it.
    torch.manual_seed(cfg.train.seed * 1_000_003 + env.rank)
    digest = check_same_config(cfg, env, run_dir)
    verifier = Verifier(
        cfg.verify,
        cfg.model,
        run_dir,
        env.is_main,
        world_size=env.world_size,
        device_name=device_name(env.device),
        layout=plan.layout,
        batch=values.batch,
        mesh_shape=cfg.mesh.shape,
    )
    runner, graph = build(cfg, values.batch, plan, env, run_dir, verifier, digest)
    data = make_data(cfg, values.batch, env, *dp_mesh_info(runner.mesh, plan))
    stack.callback(data.sampler.close)
    metrics = stack.enter_context(Metrics(run_dir, env.is_main, cfg.train.steps, 0, cfg.logger.progress_bar))
    watch = RunDirWatch(run_dir, env.is_main)
    verifier.attach(metrics.log)
    ladder = Ladder(runner, verifier.fallback, cfg.verify.ladder)

    def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return split_rows(data.sampler.peek()[: values.batch.micro_batch_size])

    ladder.start(lambda can_fall: verifier.judge_build(runner, first_batch, can_fall), graph)
    if ladder.lower() is not None:  # by default the first step is where torch.compile compiles
        runner.first_step_guard = ladder.guard
    state.tokens_per_step = values.batch.tokens_per_step
    ckpt = RunCheckpoints(
        cfg.checkpoint,
        cfg.train,
        values.checkpoint_root,
        run_dir,
        runner,
        data.sampler,
        state,
        metrics,
        {"config_hash": digest, "model": init_from.shape_of(cfg.model)},
        verifier.fallback,
        cfg.verify.max_bad_steps,
    )
    stack.enter_context(ckpt)
    resumed = ckpt.resume(cfg.checkpoint.resume, digest, env.is_main)
    run.metrics, run.runner = metrics, runner
    # The checkpoint's extra state: the wandb callback continues the same wandb run after a restart.
    callbacks.on_resume(state.step, resumed)
    peak = peak_tflops(cfg, env.device)
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    state.train_started = time.perf_counter()
    metrics.begin(state.step)  # step/total, elapsed and ETA on every log line count from here
    peak_flops = None if peak is None else peak * 1e12 * env.world_size
    return Parts(
        cfg,
        values,
        env,
        run_dir,
        digest,
        plan,
        runner,
        data,
        metrics,
        verifier,
        ladder,
        ckpt,
        callbacks,
        watch,
        peak_flops,
    )


def derive_values(cfg: Config, plan: Plan, run_dir: Path, env: DistEnv) -> RunValues:
    """The run's derived values, once per rank (from the config, its plan and this rank's device);
    rank 0 writes them beside plan.json (``run_values.json``), the record of what the ranks ran with."""
    dtype = compute_dtype(env.device) or torch.float32
    values = run_values(cfg, run_dir, plan.grad_accum_steps, plan.dp_degree, str(dtype).removeprefix("torch."))
    if env.is_main:
        write_run_values(run_dir, values)
    return values


def build(
    cfg: Config, batch: BatchShape, plan: Plan, env: DistEnv, run_dir: Path, verifier: Verifier, digest: str
) -> tuple[StepRunner, Verdict | None]:
    """Build the mesh of ``plan`` and the model once on meta, freeze it, check the graph across ranks
    (before any training collective) and hand the meta model to the runner, which parallelizes
    (places and initialises) a copy of it for each rung the ladder builds (``Ladder.start``).
    Returns the graph check's verdict too: the reference graph differs under
    ``verify.policy=fallback``."""
    mesh = build_mesh(plan, env.device.type)
    meta = build_model(cfg.model, batch.seq_len, data_mod.document_eos(cfg.data, cfg.tokenizer))
    if env.is_main:
        log.info(
            "model %s: %.2fM parameters, %.3g flops/token (6N + 12LHQT) at seq_len %d",
            cfg.model.name,
            num_params(cfg.model) / 1e6,
            flops_per_token(cfg.model, batch.seq_len),
            batch.seq_len,
        )
        adapters = lora.describe(cfg.model, cfg.peft, batch.seq_len)
        if adapters is not None:
            log.info("%s", adapters)
    frozen = freeze_stage(meta, cfg, batch, run_dir, env)
    flat = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    can_fall = cfg.verify.ladder and next_mode(cfg.executor.mode) is not None
    graph = verifier.check_graph(meta, frozen, digest, flat, can_fall)
    # Lag only without verify=on: with it, every step is read at once (its checks and report read
    # each step before the next is queued). The ladder's breaker reads lagged steps as they come.
    lag = not verifier.enabled
    groups = BuildGroups(cfg.train, cfg.optimizer, cfg.lr_scheduler, cfg.sharding, cfg.bucketing, cfg.peft, cfg.run)
    runner = StepRunner(
        groups, plan, mesh, meta, cfg.executor, env.device, lag=lag, rank=env.rank, load_weights=init_from.load
    )
    return runner, graph


def finish(p: Parts, state: TrainState) -> Summary:
    """After the loop: the final evaluation, the callbacks' finish (the compile cache, the profiler),
    the performance verdict, the last commit, the Hugging Face export and the summary."""
    cfg, env = p.cfg, p.env
    p.watch.check(state.step)  # before the final evaluation, the export and the summary write into it
    if cfg.train.eval_every > 0 and not p.ckpt.preempted:
        state.last_val_loss, sets = p.ladder.guard(lambda: evaluate_all(p), cfg.train.steps)
        p.metrics.log(validation_row(cfg.train.steps, state.last_val_loss, sets))
    s = Summary(
        steps=state.step,
        final_loss=state.final_loss,
        final_val_loss=state.last_val_loss,
        first_val_loss=state.first_val_loss,
        tokens_per_s=state.tokens_per_s,
        peak_mem_gib=state.peak_mem_gib,
        time_to_first_step_s=state.time_to_first_step_s,
        train_time_s=time.perf_counter() - state.train_started,
        skipped_steps=state.skipped_steps,
        executor=p.runner.mode.value,
    )
    s.data_wait_ms, s.data_wait_share = state.data_wait
    if p.peak_flops is not None and s.tokens_per_s is not None:
        s.mfu = flops_per_token(cfg.model, p.values.batch.seq_len) * s.tokens_per_s / p.peak_flops
    p.callbacks.on_finish(s)
    figures = perf_figures(state.step_seconds, state.tokens_per_step, s.mfu, s.peak_mem_gib)
    if figures is not None:
        s.step_p50_s, s.step_p99_s = figures.step_p50_s, figures.step_p99_s
        if p.runner.mode is not ExecutorMode.eager and state.first_step_s is not None:
            s.compile_s = max(0.0, state.first_step_s - figures.step_p50_s)
    meta = {"run_dir": str(p.run_dir), "config_hash": p.digest}
    p.verifier.finish(
        figures, env.world_size, device_name(env.device), meta, p.runner.mode, can_fall_back=False
    )
    p.ckpt.close()  # the last async commit: its failure is an event below
    s.checkpoint = p.ckpt.summary(env.is_main)
    s.events = [format_row(r) for r in p.metrics.rows if "event" in r]
    if cfg.checkpoint.export_hf:  # also when preempted: the job may not come back
        export_model(cfg, p.values.batch, p.runner.model, p.run_dir, env, s.steps)
    p.metrics.close()
    write_summary(p.run_dir, s, p.digest, env)
    return s


def export_model(
    cfg: Config, batch: BatchShape, model: torch.nn.Module, run_dir: Path, env: DistEnv, step: int
) -> None:
    """``checkpoint.export_hf``: the trained model as a Hugging Face folder in ``run_dir/hf``."""
    state = lora.merge(full_model_state(model), cfg.peft)  # a collective under FSDP / TP: every rank calls it
    if env.is_main:
        from framework.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer)
        context = cfg.model.max_position_embeddings or batch.seq_len
        out = export_hf(state, cfg.model, run_dir / "hf", context, tokenizer, cfg.model.init_from)
        log.info("exported a Hugging Face checkpoint of step %d to %s", step, out)


def make_data(cfg: Config, batch: BatchShape, env: DistEnv, dp_rank: int, dp_size: int) -> Data:
    data = data_mod.build_data(data_run(cfg), batch, dp_rank, dp_size)
    if env.is_main:
        log.info("data: %s", data.description)
    return data


def freeze_stage(
    model: torch.nn.Module, cfg: Config, batch: BatchShape, run_dir: Path, env: DistEnv
) -> FrozenResult:
    """Freeze the unsharded meta-device model at the run's static shapes (fake tensors: no weights).

    Tracing on meta costs no memory, so a 70B shape freezes on any host, and the fingerprint is the
    same on every device type. The artifact (graph and signature; weights live in checkpoints) and
    its manifest go to ``run_dir/frozen`` on rank 0.
    """
    example = torch.zeros(batch.micro_batch_size, batch.seq_len, dtype=torch.long, device="meta")
    result = freeze(
        model,
        (example,),
        cfg.freeze,
        run_dir,
        write=env.is_main,
        manifest_extra={"model": cfg.model.name, "seq_len": batch.seq_len},
    )
    if env.is_main and cfg.freeze.mode is not FreezeMode.none:
        log.info(
            "froze the model (%s) in %.1fs: graph fingerprint %s",
            cfg.freeze.mode.value,
            result.seconds,
            (result.fingerprint or "")[:16],
        )
    return result


