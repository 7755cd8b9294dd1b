"""AdamW with its two moments stored in bf16 (``optimizer.state_dtype=bfloat16``).

Why: AdamW over fp32 weights holds two fp32 moments a parameter (8 bytes: 60 GiB for an 8B model)
and reads and writes them every step (16 of its 28 bytes of traffic a parameter). Stored in bf16 and
computed in fp32 (DeepSeek-V3's choice for its pretraining; Megatron-Core's precision-aware optimizer
``exp_avg_dtype``/``exp_avg_sq_dtype``), they take half the memory and 8 bytes less traffic a step,
while the weights and the update's arithmetic stay fp32. torch's fused AdamW needs the moments in
the parameter's dtype and torchao's low-bit optimizers quantize them further (8 bits, fp8), so this
is the framework's own: one elementwise function, compiled on CUDA into one kernel for all shapes.

The state keys (``step``, ``exp_avg``, ``exp_avg_sq``) are torch's, so DCP checkpoints, the trainer's
optimizer-in-backward (``found_inf``: a non-finite gradient skips its update, no host sync) and the
scheduler treat it as torch.optim.AdamW.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _update(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    lr: torch.Tensor,
    skip: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update in place, in fp32 whatever the moments' dtype (torch.optim.AdamW's formula).
    ``skip`` (0-d, 1.0 or 0.0): leave everything, the step count too, as it was."""
    keep = skip > 0
    count = step + (1.0 - skip)
    g32 = g.float()
    m32 = m.float() * beta1 + g32 * (1.0 - beta1)
    v32 = v.float() * beta2 + g32 * g32 * (1.0 - beta2)
    bias1 = 1.0 - beta1**count
    bias2 = 1.0 - beta2**count
    denom = v32.sqrt() / bias2.sqrt() + eps
    new = p * (1.0 - lr * weight_decay) - (lr / bias1) * m32 / denom
    p.copy_(torch.where(keep, p, new))
    m.copy_(torch.where(keep, m, m32.to(m.dtype)))
    v.copy_(torch.where(keep, v, v32.to(v.dtype)))
    step.copy_(count)


@functools.cache
def _compiled() -> Callable[..., None]:
    """``_update`` compiled once for every parameter: the tensors come flattened and of symbolic
    length, so one kernel serves all shapes (the float hyper-parameters are constants of a group)."""
    return torch.compile(_update, fullgraph=True, dynamic=True)


_WARM: set[tuple] = set()


def _warm(device: torch.device, dtype: torch.dtype, state: torch.dtype, hyper: tuple[float, ...]) -> None:
    """Compile the update here, on the thread that builds the optimizer: under optimizer-in-backward
    the first real update runs in autograd's device thread, mid-backward. 64 elements: not the sizes
    0 and 1 that the compiler specializes, so every later length reuses this graph."""
    key = (device, dtype, state, hyper)
    if device.type != "cuda" or key in _WARM:
        return
    _WARM.add(key)
    p, g = torch.zeros(64, device=device, dtype=dtype), torch.zeros(64, device=device, dtype=dtype)
    m, v = torch.zeros(64, device=device, dtype=state), torch.zeros(64, device=device, dtype=state)
    one = torch.ones((), device=device)  # skip: nothing changes but the dummies
    _compiled()(p, g, m, v, torch.zeros((), device=device), one, one, *hyper)


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """torch.optim's closure protocol: re-evaluate the loss, with autograd on, before the update."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The elements this rank holds (a DTensor's shard: the update is elementwise), flattened."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.view(-1) if local.is_contiguous() else local


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with the moments kept in ``state_dtype`` (see the module docstring).

    ``fused`` is accepted for the trainer's calls (it marks the CUDA path, where the update is
    compiled); on the CPU the same function runs eagerly. ``found_inf`` (set by the trainer's
    optimizer-in-backward before ``step``) skips the step on the device, as fused AdamW's does.
    """

    # Set by the config (optimizer.state_dtype) and the trainer, not through optimizer.kwargs.
    CONFIG_ONLY = ("state_dtype", "fused")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_dtype: str = "bfloat16",
        fused: bool | None = None,
    ) -> None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype={state_dtype!r} is not valid; valid: {', '.join(STATE_DTYPES)}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas!r} is not valid; valid: two numbers in [0, 1)")
        if not eps >= 0.0 or not lr >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay}: each must be >= 0")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "state_dtype": state_dtype,
            "fused": bool(fused),
        }
        super().__init__(params, defaults)
        self.found_inf: torch.Tensor | None = None
        for group in self.param_groups:
            for p in group["params"][:1]:
                hyper = (*map(float, group["betas"]), float(group["eps"]), float(group["weight_decay"]))
                _warm(_local(p).device, p.dtype, STATE_DTYPES[group["state_dtype"]], hyper)

    def _state(self, p: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            dtype = STATE_DTYPES[group["state_dtype"]]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW (optimizer.state_dtype) does not take sparse gradients")
                self._step_one(p, self._state(p, dtype), group, beta1, beta2)
        return loss

    def _step_one(self, p: torch.Tensor, state: dict, group: dict, beta1: float, beta2: float) -> None:
        device = _local(p).device
        lr = group["lr"]
        # Device scalars made by a fill kernel (no host copy, no sync: the update may run on the
        # side stream of optimizer-in-backward); a tensor lr (a scheduler's) as it is.
        lr_t = lr.to(device, torch.float32) if torch.is_tensor(lr) else torch.full((), lr, device=device)
        skip = self.found_inf if self.found_inf is not None else torch.zeros((), device=device)
        update = _compiled() if device.type == "cuda" else _update
        update(
            _local(p),
            _local(p.grad),
            _local(state["exp_avg"]),
            _local(state["exp_avg_sq"]),
            state["step"],
            lr_t,
            skip.to(device, torch.float32),
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The run's ``state_dtype`` wins over the checkpoint's (one saved by torch's AdamW has none):
        torch casts the loaded moments to the parameter's dtype, and they go back to ``state_dtype``."""
        own = [g["state_dtype"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, name in zip(self.param_groups, own, strict=True):
            group["state_dtype"] = name
            dtype = STATE_DTYPES[name]
            for p in group["params"]:
                state = self.state.get(p, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state and state[key].dtype != dtype:
                        state[key] = state[key].to(dtype)
                if "step" in state:
                    state["step"] = state["step"].to(_local(p).device, torch.float32)
