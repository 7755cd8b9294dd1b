"""framework.model: the residual stream's dtype under autocast, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from framework.config import ModelConfig, ResidualDtype
from framework.model import build_model, compute_dtype, materialize


def test_compute_dtype_follows_the_device() -> None:
    assert compute_dtype("cuda") == torch.bfloat16
    assert compute_dtype(torch.device("cpu")) is None
    model = build_model(ModelConfig(), 16)
    materialize(model, "cpu", 0)
    assert model.stream_dtype is None  # the CPU loop trains in fp32: nothing to cast


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_residual_dtype_under_autocast(compiled: bool) -> None:
    """With the stream dtype set as ``materialize`` sets it on CUDA (here under CPU bf16 autocast),
    ``autocast`` feeds the blocks bf16 and ``float32`` keeps an fp32 stream; compiled (fullgraph)
    gives the same losses as eager."""
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    seen: dict[str, tuple[float, torch.dtype]] = {}
    for rd in ResidualDtype:
        model = build_model(ModelConfig(residual_dtype=rd), 16)
        materialize(model, "cpu", 0)
        if rd == ResidualDtype.autocast:
            model.stream_dtype = torch.bfloat16  # what materialize(model, "cuda", ...) sets
        if compiled:
            model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        dtypes: list[torch.dtype] = []
        model.layers["0"].register_forward_pre_hook(lambda _m, a, d=dtypes: d.append(a[0].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        seen[rd.value] = (loss.item(), dtypes[0])
    assert seen["autocast"][1] == torch.bfloat16
    assert seen["float32"][1] == torch.float32
    # bf16 rounding of the stream moves the loss a little, not a lot.
    assert seen["autocast"][0] != seen["float32"][0]
    assert abs(seen["autocast"][0] - seen["float32"][0]) < 1e-2
