"""``StepRunner``: the executed model and how its steps are queued and read.

It owns the executor (the parallelized model, its optimizer, scheduler, optimizer-in-backward
hooks and step function, rebuilt for each rung of the fallback ladder from a copy of the one meta
model the trainer built), the lag (a step's figures are read once the
next step is queued, through pinned host buffers: ``loop.HostIO``) and the warm-up count (each
build's first ``executor.warmup_steps`` steps pay for compilation and stay out of throughput). The
verifier judges, the ladder picks the rung (``framework.verify.fallback.Ladder``), the runner builds it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from framework import data as data_mod
from framework.checkpoint.state import capture_rng, restore_rng
from framework.config.schema import (
    BucketingConfig,
    ExecutorConfig,
    ExecutorMode,
    Float8Recipe,
    LRSchedulerConfig,
    OptimizerConfig,
    PeftConfig,
    PeftMethod,
    RunConfig,
    ShardingConfig,
    TrainConfig,
)
from framework.models import (
    Decoder,
    WeightLoader,
    routing_state,
    set_routing_state,
    token_group_of,
    update_expert_biases,
)
from framework.parallel import parallelize
from framework.parallel.context import SequenceShard, sequence_shard
from framework.parallel.float8 import attach_scale_precompute
from framework.parallel.step import HostIO, StepResult, autocast
from framework.planner.plan import Plan
from framework.train.loop import (
    InBackward,
    StepFn,
    attach_in_backward,
    mark_graph_recorded,
    pick_step,
)
from framework.train.optimizers import build_optimizer, build_scheduler
from framework.verify import carry_state
from framework.verify.numerics import reference_model

log = logging.getLogger("framework")


@dataclass
class Step:
    """One queued optimizer step: its figures (read lazily), its number, and whether it came after
    its build's warm-up."""

    result: StepResult
    step: int
    warm: bool
    build: int  # which build of the runner ran it (a rebuild starts a new warm-up)
    wait_s: float = 0.0  # how long the sampler kept the loop waiting for this step's batch


@dataclass(frozen=True)
class BuildGroups:
    """The config groups a build and its steps read, each the run's own (the trainer picks them off
    the run config): the runner takes these, not the whole config."""

    train: TrainConfig  # seed, grad clip, optimizer in backward, when a step is due to be read
    optimizer: OptimizerConfig
    lr_scheduler: LRSchedulerConfig
    sharding: ShardingConfig
    bucketing: BucketingConfig
    peft: PeftConfig
    run: RunConfig  # instantiate_allow (a custom optimizer), fault_kill_at_step (read at once)


class StepRunner:
    """Builds the executed model for a ladder rung and runs its steps; see the module docstring.

    ``model``, ``optimizer`` and ``scheduler`` are what a checkpoint saves and loads; they are
    replaced by ``build``, so the other parts read them here each time, never keep them.
    """

    def __init__(
        self,
        groups: BuildGroups,
        plan: Plan,
        mesh: DeviceMesh | None,
        meta: Decoder,
        executor: ExecutorConfig,
        device: torch.device,
        lag: bool,
        rank: int = 0,
        load_weights: WeightLoader | None = None,
    ) -> None:
        self.groups = groups
        self.plan = plan
        self.mesh = mesh
        self.meta = meta  # built once on meta by the trainer; each build parallelizes a copy of it
        self.executor = executor
        self.float8 = meta.cfg.float8  # the configured recipe until a fallback to bf16
        self.device = device
        self.lag = lag
        self.rank = rank
        self.load_weights = (
            load_weights  # model.init_from's loader (the trainer's: checkpoint.init_from.load)
        )
        self.model: nn.Module = None  # type: ignore[assignment]  # made by build()
        self.optimizer: torch.optim.Optimizer = None  # type: ignore[assignment]
        self.scheduler: torch.optim.lr_scheduler.LambdaLR = None  # type: ignore[assignment]
        self.in_backward: InBackward | None = None
        self.seq_shard: SequenceShard | None = None
        self._step: StepFn | None = None  # picked once per build (loop.pick_step)
        # Runs the next step, once (the trainer sets the ladder's: a compile error there falls back).
        self.first_step_guard: Callable[[Callable[[], StepResult]], StepResult] | None = None
        self.io = HostIO(device)
        self._builds = 0
        self._since_build = 0  # steps queued since the last build: each build pays its own warm-up
        self._late: Step | None = None  # queued, not read yet
        self._read_any = False
        # The sampler's index of the batch a step is running on, while it runs (None between steps):
        # what fault injection's NaN hook keys on (framework.train.faults), so it fires once per batch.
        self.running_batch: int | None = None

    @property
    def mode(self) -> ExecutorMode:
        return self.executor.mode

    # -- the rungs ---------------------------------------------------------------------------------

    def build(
        self, mode: ExecutorMode | None = None, float8: Float8Recipe | None = None, carry: bool = False
    ) -> None:
        """(Re)build the executed model from a copy of the meta model for ``mode`` and ``float8``
        (None: the current one), with a new optimizer and scheduler and the step function that fits
        them (``loop.pick_step``: plain, pipelined or optimizer-in-backward). ``carry``: copy the
        trained weights, optimizer state, LR schedule and MoE routing sums (what the next metrics
        row counts) over from the model being replaced (a fallback once the run has started).

        The state dicts have the same keys and fp32 values with float8 on or off (Float8Linear keeps
        the high-precision weights), so the float8 rung carries over as the executor rungs do.
        """
        old = (self.model, self.optimizer, self.scheduler)
        if mode is not None:
            self.executor = dataclasses.replace(self.executor, mode=mode)
        if float8 is not None:
            self.float8 = float8
        g = self.groups
        self.model = parallelize(
            self._meta_copy(),
            self.mesh,
            self.plan,
            g.sharding,
            g.bucketing,
            self.executor,
            self.device,
            g.train.seed,
            peft=g.peft,
            load_weights=self.load_weights,
        )
        # parallel.cp > 1: cuts each micro-batch to this rank's sequence shard (framework.parallel.context).
        self.seq_shard = sequence_shard(self.model, self.mesh, self.plan) if self.mesh is not None else None
        self.optimizer = build_optimizer(
            self.model, g.train, self.device, g.optimizer, g.run.instantiate_allow
        )
        if self.float8 is not Float8Recipe.none:
            attach_scale_precompute(self.model, self.optimizer)  # FSDP2's float8 all-gather only
        self.scheduler = build_scheduler(self.optimizer, g.train, g.lr_scheduler)
        # DeepSeek-V3's aux-loss-free balancing, per optimizer step; under peft=lora the selection
        # biases are part of the frozen base: a LoRA checkpoint, its exports and generate rebuild
        # the base from model.init_from or the seed, so a bias moved in training would be lost there.
        if self.meta.cfg.moe.bias_update_rate > 0 and g.peft.method is PeftMethod.none:
            self.optimizer.register_step_post_hook(functools.partial(_update_biases, self.model))
        if self.in_backward is not None:
            self.in_backward.remove()  # hooks of the model being replaced
        self.in_backward = (
            attach_in_backward(self.optimizer, g.train.in_backward_grad_checks)
            if g.train.optimizer_in_backward
            else None
        )
        settle_ddp_buckets(self.model, self.plan.micro_batch_size, self.plan.seq_len, self.device)
        if carry:
            carry_state(old[0], old[1], self.model, self.optimizer)
            self.scheduler.load_state_dict(old[2].state_dict())
            # After the optimizer state: loading it may run a zero-lr step, whose hook (the bias
            # update) would read and reset the step's routing sums.
            set_routing_state(self.model, routing_state(old[0]))
        self._step = pick_step(
            self.model,
            self.optimizer,
            self.scheduler,
            g.train.grad_clip,
            self.device,
            self.in_backward,
            self.seq_shard,
        )
        self._builds += 1
        self._since_build = 0

    def snapshot(self) -> Callable[[], None]:
        """Take what a step can change before it fails that a rebuild would carry over, and return
        its undo (``Ladder.guard``: before the run's first step, which may fail to compile).

        The weights, optimizer state and schedule are not copied: the step changes them only in the
        optimizer step, and the ladder does not fall back from a step that got that far. What the
        forward already changed is: the global RNG (dropout, Inductor's seeds; the RNG a checkpoint
        restores) and the MoE layers' routing sums. Gradients it left on the model are dropped
        with it."""
        model, rng, routing = self.model, capture_rng(), routing_state(self.model)

        def undo() -> None:
            restore_rng(rng)
            set_routing_state(model, routing)

        return undo

    def _meta_copy(self) -> Decoder:
        """A copy of the meta model on this build's float8 rung: ``parallelize`` changes the model
        it is given in place, and a fallback builds again. Copying on meta costs no memory."""
        model = copy.deepcopy(self.meta)
        if model.cfg.float8 is not self.float8:
            model.cfg = dataclasses.replace(model.cfg, float8=self.float8)
        return model

    def reference(self) -> nn.Module:
        """The unsharded eager model with the run's initial weights, on this build's float8 rung and
        in FSDP's param_dtype: what the verifier's numerics check compares the built model with."""
        from framework.parallel.data_parallel import TORCH_DTYPES

        dtype = TORCH_DTYPES[self.groups.sharding.param_dtype]
        return reference_model(self._meta_copy(), self.groups.train.seed, self.device, dtype, self.load_weights)

    # -- the steps ---------------------------------------------------------------------------------

    def step(self, sampler: data_mod.BatchSampler | data_mod.StreamSampler, number: int) -> Step:
        """Queue optimizer step ``number`` on the sampler's next batch (``running_batch`` names it
        while the step runs); its figures are read later, see ``defer``."""
        index = sampler.consumed_batches  # a batch index, not a step: a rollback does not revisit it
        batch = sampler.next_batch()
        wait_s = sampler.last_wait_s  # the sampler times its own wait
        scales = sampler.loss_scales()

        def attempt() -> StepResult:
            assert self._step is not None, "build() first"
            self.running_batch = index
            try:
                return self._step(batch, self.io, scales)
            finally:
                self.running_batch = None

        guard, self.first_step_guard = self.first_step_guard, None
        result = attempt() if guard is None else guard(attempt)
        warm = self._since_build >= self.executor.warmup_steps
        self._since_build += 1
        return Step(result, number, warm, self._builds, wait_s)

    def defer(self, s: Step) -> bool:
        """Leave ``s`` unread until the next step is queued (True), so the device does not idle while
        the host logs, counts and prepares the next batch; or say it must be read now (False): the
        lag is off (verify on: the breaker may swap the executor before the next step), it is this
        launch's first step, or it ends at a log row, an evaluation, the end of the run or a fault
        injection. Checkpoints and preemption are decided by the caller (they are collectives)."""
        t = self.groups.train
        due = (
            not self.lag
            or not self._read_any
            or s.step % t.log_every == 0
            or s.step >= t.steps
            or (t.eval_every > 0 and s.step % t.eval_every == 0)
            or s.step == self.groups.run.fault_kill_at_step
        )
        if due:
            self._read_any = True
            return False
        self._late = s
        return True

    def take_late(self) -> Step | None:
        """The step left unread by ``defer`` (read it now that the next one is queued), or None."""
        late, self._late = self._late, None
        return late

    def discard(self, s: Step) -> None:
        """Forget queued step ``s`` (a rollback replaced the weights it ran on; the checkpointer gives
        its batch back): it no longer counts toward its build's warm-up."""
        if s.build == self._builds:
            self._since_build -= 1


def _update_biases(
    model: nn.Module, _optimizer: torch.optim.Optimizer, _args: object, _kwargs: object
) -> None:
    """The sigmoid routers' selection biases after each optimizer step, from the step's loads summed
    over the ranks that hold the step's other tokens (``Decoder.token_group``: the data-parallel
    ranks, so every replica keeps the same bias; under a pipeline each stage's own layers, summed
    over that stage's data-parallel ranks)."""
    update_expert_biases(model, token_group_of(model))


def settle_ddp_buckets(model: nn.Module, micro_batch_size: int, seq_len: int, device: torch.device) -> None:
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
    mark_graph_recorded(model)
