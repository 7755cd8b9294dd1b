"""Context parallelism: each step's sequences are split over the ``cp`` mesh axis and attention runs
as torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``).

CP acts per step, not on the model: inside ``context_parallel`` the tokens, the targets and the
RoPE tables are cut along the sequence (in place), and SDPA is dispatched to the ring, which passes
K and V between the CP ranks. For causal attention the cut is load-balanced (torch's head-tail
balancer: 2 x cp chunks, rank i keeps chunks i and 2cp-1-i, so every rank does the same share of
the causal work; framework.planner.layout.check_cp refuses a ``train.seq_len`` that 2 x cp does not
divide). The parameters are FSDP2-sharded over dp_shard x cp (framework.parallel.mesh.fsdp_mesh),
which also averages the CP ranks' gradients; each rank's loss is the mean over its equal share of
the tokens, so the average is the whole sequence's mean.

Runs on CUDA only: torch's ring dispatches SDPA's flash / memory-efficient / cuDNN kernels; the CPU
kernel has no DTensor sharding strategy (framework.planner.layout.CP_CPU_ERROR), and the planner refuses CP
on a CPU launch. Evaluation runs outside the context: every CP rank then computes whole sequences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from framework.models import Decoder
from framework.parallel.mesh import sub_mesh
from framework.planner.layout import MeshAxis
from framework.planner.plan import Plan

SequenceShard = Callable[[torch.Tensor, torch.Tensor], contextlib.AbstractContextManager]


def _decoder(model: nn.Module) -> Decoder:
    inner = getattr(model, "module", model)  # DDP; FSDP2 and per-block compile keep the class
    inner = getattr(inner, "_orig_mod", inner)  # whole-model torch.compile
    assert isinstance(inner, Decoder), type(inner)
    return inner


def sequence_shard(model: nn.Module, mesh: DeviceMesh, plan: Plan) -> SequenceShard | None:
    """The per-micro-batch context for ``loop.train_step`` under CP, or None when ``cp == 1``.

    ``shard(tokens, targets)`` is a context manager: inside it, ``tokens`` and ``targets`` (which it
    cuts in place: pass tensors the caller owns) and the model's RoPE tables hold this rank's
    sequence shard, and SDPA is ring attention. The RoPE tables are restored on exit.
    """
    if plan.layout.cp <= 1:
        return None
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    cp_mesh = sub_mesh(mesh, plan, (MeshAxis.cp,))
    assert cp_mesh is not None
    decoder = _decoder(model)
    # All-gather K/V once per attention (torch's default; the planner costs it as blocking).
    set_rotate_method("allgather")

    @contextlib.contextmanager
    def shard(tokens: torch.Tensor, targets: torch.Tensor) -> Iterator[None]:
        with context_parallel(
            cp_mesh,
            buffers=[tokens, targets, decoder.rope],
            buffer_seq_dims=[1, 1, 0],
            no_restore_buffers={tokens, targets},
        ):
            yield

    return shard
