"""framework.models: the residual stream's dtype under autocast, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from framework.config.schema import ModelConfig, ResidualDtype
from framework.models import build_model, compute_dtype, materialize


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
    from framework.models import decoder
    from framework.models.parts.masks import document_mask

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    eos = 1
    a = torch.tensor([[5, 6, 7, eos, 9, 10, 11, 12]])
    b = torch.tensor([[20, 21, 22, eos, 9, 10, 11, 12]])  # another first document, same second one
    mask = document_mask(a, eos)
    assert mask.shape == (1, 1, 8, 8) and bool(mask[0, 0, 3, 0]) and not bool(mask[0, 0, 4, 3])
    masked, plain = decoder(cfg, 8, document_eos=eos), decoder(cfg, 8)
    torch.manual_seed(0)
    for m in (masked, plain):
        m.init_weights(0)
    with torch.no_grad():
        assert torch.allclose(masked(a)[:, 4:], masked(b)[:, 4:], atol=1e-6)
        assert not torch.allclose(plain(a)[:, 4:], plain(b)[:, 4:], atol=1e-3)
        # The first document sees what a plain causal model sees.
        assert torch.allclose(masked(a)[:, :4], plain(a)[:, :4], atol=1e-6)


def test_document_positions_restart_after_each_eos() -> None:
    from framework.models.parts.masks import document_ids, document_positions

    eos = 1
    tokens = torch.tensor([[5, 6, eos, 7, 8, 9, eos, 4], [eos, 3, 3, 3, 3, 3, 3, 3]])
    doc = document_ids(tokens, eos)
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]


def _tiny_llama(document_eos: int | None, seq: int = 24) -> torch.nn.Module:
    from framework.models import decoder

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    model = decoder(cfg, seq, document_eos=document_eos)
    model.init_weights(0)
    return model


FLEX_UNFUSED = "ignore:flex_attention called without torch.compile"  # eager flex on CPU: the reference


@pytest.mark.filterwarnings(FLEX_UNFUSED)
@pytest.mark.parametrize("flex", [False, True], ids=["sdpa_dense_mask", "flex_attention"])
def test_each_packed_document_gets_the_logits_it_gets_alone(flex: bool) -> None:
    """Document masking with RoPE positions restarted at each document: a row packing two documents
    gives each of them the logits of running it alone (FlexAttention: forward only on CPU)."""
    eos = 1
    first = torch.tensor([[5, 6, 7, 8, 9, 10, 11, eos]])
    second = torch.tensor([[20, 21, 22, 23, 24, 25, eos, 30, 31]])  # ends in a third, cut document
    model = _tiny_llama(eos)
    model.document_flex = flex
    seen: list[torch.Tensor] = []
    model.layers["0"].register_forward_pre_hook(lambda _m, args: seen.append(args[1]))
    with torch.no_grad():
        packed = model(torch.cat([first, second], 1))
        alone = [model(first), model(second[:, :7]), model(second[:, 7:])]
    n = first.shape[1]
    # RoPE restarts at each document: the layers get position 0's rotation at each start. (RoPE is
    # relative, so the logits alone would agree within rounding without the restart.)
    for start in (0, n, n + 7):
        assert torch.equal(seen[0][0, start], model.rope[0])
    assert (packed[:, :n] - alone[0]).abs().max() < 1e-5
    assert (packed[:, n : n + 7] - alone[1]).abs().max() < 1e-5
    assert (packed[:, n + 7 :] - alone[2]).abs().max() < 1e-5
    # Without the mask the second document sees the first: the check above can fail.
    with torch.no_grad():
        plain = _tiny_llama(None)(torch.cat([first, second], 1))
    assert (plain[:, n : n + 7] - alone[1]).abs().max() > 1e-3


@pytest.mark.filterwarnings(FLEX_UNFUSED)
def test_flex_attention_equals_the_sdpa_mask_path() -> None:
    """The block mask (FlexAttention) and the dense boolean mask (SDPA) give the same logits, on
    rows with several documents, a leading EOS and a length that is not a multiple of the block."""
    eos = 1
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 64, (3, 21), generator=g)
    tokens[0, [4, 9, 10]] = eos
    tokens[1, 0] = eos
    model = _tiny_llama(eos)
    with torch.no_grad():
        model.document_flex = False
        dense = model(tokens)
        model.document_flex = True
        flex = model(tokens)
    assert (dense - flex).abs().max() < 1e-5


def test_document_mask_kernel_follows_the_device() -> None:
    """CPU trains through SDPA's dense mask (FlexAttention has no CPU backward in torch 2.13)."""
    from torch.nn.attention.flex_attention import BlockMask

    from framework.models.parts.masks import flex_trains_on

    eos = 1
    model = _tiny_llama(eos)
    tokens = torch.tensor([[5, 6, eos, 7]])
    doc = torch.tensor([[0, 0, 0, 1]])
    assert not flex_trains_on(torch.device("cpu")) and flex_trains_on(torch.device("cuda"))
    assert isinstance(model.document_attention_mask(tokens, doc), torch.Tensor)
    model.document_flex = True
    assert isinstance(model.document_attention_mask(tokens, doc), BlockMask)
    loss = _tiny_llama(eos)(tokens, tokens)  # default on CPU: trains (backward works)
    loss.backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention's backward)")
def test_flex_attention_trains_like_the_sdpa_mask_on_cuda() -> None:
    """On CUDA the default document kernel is compiled FlexAttention; its loss and gradients match
    SDPA with the dense mask (fp32)."""
    from framework.models import decoder

    eos = 1
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 64, (2, 257), generator=g)
    tokens[:, [30, 100, 101, 200]] = eos
    x, y = tokens[:, :-1].cuda(), tokens[:, 1:].cuda()
    grads, losses = [], []
    for flex in (True, False):
        model = decoder(cfg, 256, document_eos=eos).cuda()
        model.init_weights(0)
        model.document_flex = None if flex else False
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        grads.append(model.layers["0"].attention.wq.weight.grad)
    assert abs(losses[0] - losses[1]) < 1e-5
    assert (grads[0] - grads[1]).abs().max() < 1e-5


def test_materialize_loads_init_from_through_the_callers_loader() -> None:
    """``model.init_from``: the weights come from the loader the caller hands in (models/ never imports
    checkpoint/); without one, materialize refuses in one line rather than keep the seeded init."""
    source = build_model(ModelConfig(), 16)
    materialize(source, "cpu", 7)
    cfg = ModelConfig(init_from="/somewhere/step_000003")
    with pytest.raises(ValueError, match=r"^model.init_from='/somewhere/step_000003' and no weight loader") as e:
        materialize(build_model(cfg, 16), "cpu", 0)
    assert "\n" not in str(e.value)
    read: list[str] = []

    def load(model: torch.nn.Module, path: str) -> None:
        read.append(path)
        model.load_state_dict(source.state_dict())

    model = build_model(cfg, 16)
    materialize(model, "cpu", 0, load)
    assert read == ["/somewhere/step_000003"]
    mine, theirs = model.state_dict(), source.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(model.rope, source.rope)  # the non-persistent RoPE tables, filled again after the load


def _spans_rows() -> tuple[torch.Tensor, int]:
    """Rows of packed documents: several per row, a leading EOS, a row with one document."""
    eos = 1
    tokens = torch.randint(2, 64, (3, 21), generator=torch.Generator().manual_seed(0))
    tokens[0, [4, 9, 10]] = eos
    tokens[1, 0] = eos
    return tokens, eos


def test_document_spans_cut_the_flattened_rows_at_every_document() -> None:
    """The offsets a variable-length kernel takes: every document of every row is one span, in
    order, none crosses a row; zero-length spans pad the count to a power of two (at least 16); and
    attending causally within each span is the dense document mask's attention."""
    import torch.nn.functional as F

    from framework.models.parts.masks import MIN_SPANS, dense_document_mask, document_ids, document_spans

    tokens, eos = _spans_rows()
    doc = document_ids(tokens, eos)
    cu = document_spans(doc).cu_seqlens
    b, s = doc.shape
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == b * s
    spans = [(int(a), int(z)) for a, z in zip(cu[:-1], cu[1:], strict=True) if z > a]
    flat = doc.flatten()
    expected = sum(int(r.max() - r.min()) + 1 for r in doc)  # documents per row, summed
    assert len(spans) == expected == 7  # 4 + 2 + 1
    for a, z in spans:
        assert a // s == (z - 1) // s, (a, z)  # within one row
        assert (flat[a:z] == flat[a]).all()  # one document
    assert spans[0][0] == 0 and spans[-1][1] == b * s  # back to back over every token
    assert all(z1 == a2 for (_, z1), (a2, _) in zip(spans, spans[1:], strict=False))
    assert len(cu) - 1 == MIN_SPANS and (cu[len(spans) :] == b * s).all()
    many = torch.arange(40).repeat_interleave(2)[None]  # 40 documents: the next power of two
    assert len(document_spans(many).cu_seqlens) - 1 == 64

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, s, 4, 8, generator=g) for _ in range(3))
    dense = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=dense_document_mask(doc)
    ).transpose(1, 2)
    qf, kf, vf = (t.reshape(b * s, 4, 8) for t in (q, k, v))
    per_span = torch.cat(
        [
            F.scaled_dot_product_attention(
                *(t[a:z].transpose(0, 1)[None] for t in (qf, kf, vf)), is_causal=True
            )[0].transpose(0, 1)
            for a, z in spans
        ]
    )
    assert (per_span - dense.reshape(b * s, 4, 8)).abs().max() < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the flash kernels)")
@pytest.mark.parametrize("attention", ["flash", "fa4"])
def test_varlen_flash_trains_like_the_dense_mask_on_cuda(attention: str) -> None:
    """Under model.attention=flash|fa4 the document mask runs the flash kernel's variable-length
    form: its loss and gradients match SDPA with the dense mask (bf16 autocast, eager and with
    compiled blocks), and compiled blocks do not recompile when the document count changes."""
    from framework.config.schema import AttentionBackend
    from framework.kernels import fa4
    from framework.models import decoder
    from framework.models.parts.masks import DocumentSpans

    if attention == "fa4":
        major = torch.cuda.get_device_capability()[0]
        if major not in fa4.CAPABILITY_MAJORS or not fa4.installed() or not fa4.registry_has_fa4():
            pytest.skip("model.attention=fa4 needs flash-attn-4 on a Hopper or Blackwell GPU")
        fa4.activate()
    eos = 1
    cfg = ModelConfig(
        dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=64,
        attention=AttentionBackend(attention),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 64, (2, 513), generator=g)
    tokens[0, [30, 100, 101, 300]] = eos
    tokens[1, [7, 400]] = eos
    x, y = tokens[:, :-1].cuda(), tokens[:, 1:].cuda()
    results = {}
    for kind in ("varlen", "dense", "compiled"):
        model = decoder(cfg, 512, document_eos=eos).cuda()
        model.init_weights(0)
        model.document_flex = False if kind == "dense" else None
        if kind == "compiled":
            for block in model.layers.values():
                block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        results[kind] = (loss.item(), model.layers["0"].attention.wq.weight.grad.float())
    for kind in ("varlen", "compiled"):
        assert abs(results[kind][0] - results["dense"][0]) < 2e-3 * abs(results["dense"][0])
        diff = (results[kind][1] - results["dense"][1]).norm() / results["dense"][1].norm()
        assert diff < 2e-2, (kind, diff)
    # The mask is the spans (not a dense mask that another SDPA kernel ran without a word) ...
    doc = torch.zeros_like(x)
    assert isinstance(model.document_attention_mask(x, doc), DocumentSpans)
    # ... and 40 documents (64 spans, not 16) reuse the compiled blocks' graphs.
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    many = x.clone()
    many[:, ::25] = eos
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(many, y).backward()
    assert len(model.document_attention_mask(many, model_ids(many, eos)).cu_seqlens) - 1 == 64
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def model_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    from framework.models.parts.masks import document_ids

    return document_ids(tokens, eos)
