"""framework.model: the residual stream's dtype under autocast, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from framework.config import ModelConfig, ResidualDtype
from framework.model import build_model, materialize


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_residual_dtype_under_autocast(compiled: bool) -> None:
    """``autocast`` feeds the blocks the autocast dtype (bf16); ``float32`` keeps an fp32 stream;
    without autocast both are fp32 and identical. Compiled (fullgraph) matches eager bitwise."""
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    seen: dict[tuple[str, bool], tuple[float, torch.dtype]] = {}
    for rd in ResidualDtype:
        for autocast in (False, True):
            model = build_model(ModelConfig(residual_dtype=rd), 16)
            materialize(model, "cpu", 0)
            if compiled:
                model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
            dtypes: list[torch.dtype] = []
            model.layers["0"].register_forward_pre_hook(lambda _m, a, d=dtypes: d.append(a[0].dtype))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            seen[(rd.value, autocast)] = (loss.item(), dtypes[0])
    assert seen[("autocast", True)][1] == torch.bfloat16
    assert seen[("float32", True)][1] == torch.float32
    assert seen[("autocast", False)] == seen[("float32", False)]
    assert seen[("autocast", False)][1] == torch.float32
    # bf16 rounding of the stream moves the loss a little, not a lot.
    assert seen[("autocast", True)][0] != seen[("float32", True)][0]
    assert abs(seen[("autocast", True)][0] - seen[("float32", True)][0]) < 1e-2
