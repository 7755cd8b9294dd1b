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


def test_document_mask_stops_attention_at_eos() -> None:
    """With a document mask, the second document's logits do not depend on the first's tokens;
    without one they do. EOS (id 1) ends a document and belongs to it."""
    from framework.model import Llama, document_mask

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    eos = 1
    a = torch.tensor([[5, 6, 7, eos, 9, 10, 11, 12]])
    b = torch.tensor([[20, 21, 22, eos, 9, 10, 11, 12]])  # another first document, same second one
    mask = document_mask(a, eos)
    assert mask.shape == (1, 1, 8, 8) and bool(mask[0, 0, 3, 0]) and not bool(mask[0, 0, 4, 3])
    masked, plain = Llama(cfg, 8, document_eos=eos), Llama(cfg, 8)
    torch.manual_seed(0)
    for m in (masked, plain):
        m.init_weights(0)
    with torch.no_grad():
        assert torch.allclose(masked(a)[:, 4:], masked(b)[:, 4:], atol=1e-6)
        assert not torch.allclose(plain(a)[:, 4:], plain(b)[:, 4:], atol=1e-3)
        # The first document sees what a plain causal model sees.
        assert torch.allclose(masked(a)[:, :4], plain(a)[:, :4], atol=1e-6)
