"""Quantized Hub folders read by ``model.init_from`` (framework.checkpoint.quantized): GPT-OSS's MXFP4
experts and DeepSeek-V3's block-scaled FP8 weights, against transformers' own dequantization of the
same tensors (``integrations.mxfp4.convert_moe_packed_tensors``, ``integrations.finegrained_fp8``), and
the logits of transformers' model holding those weights. Tiny random models (fp32, CPU); the folders
are quantized here as the Hub's are laid out, since the published ones are tens of GB."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in the dev extra: the reference dequantization")

from framework.checkpoint import import_hf  # noqa: E402
from framework.checkpoint.quantized import FP4_VALUES, DequantSlice, Quantized  # noqa: E402

TOL = 1e-5


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    """``src``'s folder as one safetensors file of ``tensors`` and its config.json with ``quantization``."""
    from safetensors.torch import save_file

    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _stored(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, C, R) -> the Hub's ``_blocks`` (E, R, C / 32, 16) and ``_scales`` (E, R, C / 32): each 32
    values of a row scaled by a power of two so that the largest fits 6, rounded to the nearest FP4."""
    e, c, r = w.shape
    rows = w.transpose(1, 2).reshape(e, r, c // 32, 32)
    amax = rows.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scaled = rows / torch.pow(2.0, exponent.float()).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # ties: the lower code
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) -> float8 e4m3 values and ``_scale_inv`` (ceil(out / b0), ceil(in / b1)) fp32."""
    b0, b1 = block
    r, c = w.shape
    nr, nc = math.ceil(r / b0), math.ceil(c / b1)
    padded = torch.zeros(nr * b0, nc * b1)
    padded[:r, :c] = w
    amax = padded.reshape(nr, b0, nc, b1).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:r, :c]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_gpt_oss_mxfp4_experts_read_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.models.test_models_gpt_oss import ours, save, tokens

    path, _ = save(tmp_path)
    tensors, reference = _stored(path), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        reference[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    quantized = _rewrite(path, tmp_path / "mxfp4", tensors, {"quant_method": "mxfp4"})
    assert len(reference) == 4

    _, model = ours(quantized)
    ours_state = model.state_dict()
    for name, want in reference.items():
        layer = name.split(".")[2]
        got = ours_state[f"layers.{layer}.feed_forward.experts.{name.split('.')[-1]}"]
        assert torch.equal(got, want), name
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, want in reference.items():
            hf.get_parameter(name).copy_(want)
        diff = (model(tokens()) - hf(tokens()).logits).abs().max().item()
    assert diff <= TOL, diff


def test_deepseek_v3_fp8_block_weights_read_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from tests.models.test_models_deepseek_v3 import ours, save, tokens

    block = (16, 16)  # the Hub's are 128 x 128; the tiny model's weights need several blocks
    path, _ = save(tmp_path)
    tensors, reference = _stored(path), {}
    for name in [n for n in tensors if n.endswith("proj.weight") and ".layers." in n]:
        w8, scale = quantize_fp8(tensors[name], block)
        tensors[name], tensors[f"{name}_scale_inv"] = w8, scale
        reference[name] = _dequantize_fp8_weight(w8, scale, list(block), torch.float32)
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    quantized = _rewrite(path, tmp_path / "fp8", tensors, quantization)
    assert len(reference) > 10
    # transformers' model holding its own dequantization of the same tensors (an unquantized folder)
    plain = {k: v for k, v in tensors.items() if not k.endswith("_scale_inv")} | reference
    dequantized = _rewrite(path, tmp_path / "dequantized", plain, None)

    _, model = ours(quantized)
    hf = AutoModelForCausalLM.from_pretrained(dequantized, attn_implementation="eager").eval()
    with torch.no_grad():
        diff = (model(tokens()) - hf(tokens()).logits).abs().max().item()
    assert diff <= TOL, diff


class _Stored:
    """``safe_open(...).get_slice`` over an in-memory tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.t[index]


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_a_ranks_chunk_equals_the_same_chunk_of_the_whole_tensor(method: str) -> None:
    """Each rank reads its chunk (framework.checkpoint.import_hf reads ``DTensor`` chunks): rows,
    columns and experts cut across quantization blocks give the whole tensor's values there."""
    g = torch.Generator().manual_seed(0)
    if method == "mxfp4":
        blocks, scales = quantize_mxfp4(torch.randn(4, 96, 10, generator=g))
        q, stored = Quantized("mxfp4", "b", "s"), {"b": blocks, "s": scales}
    else:
        w8, scale = quantize_fp8(torch.randn(37, 50, generator=g), (8, 16))
        q, stored = Quantized("fp8", "w", "s", (8, 16)), {"w": w8, "s": scale}
    sl = DequantSlice(q, lambda name: _Stored(stored[name]))
    shape = sl.get_shape()
    whole = sl[tuple(slice(0, n) for n in shape)]
    assert list(whole.shape) == shape
    for _ in range(20):
        lo = [int(torch.randint(0, n, (), generator=g)) for n in shape]
        hi = [int(torch.randint(a + 1, n + 1, (), generator=g)) for a, n in zip(lo, shape, strict=True)]
        index = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
        assert torch.equal(sl[index], whole[index]), index


def _folder(tmp: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    from safetensors.torch import save_file

    tmp.mkdir()
    config = {"model_type": "gpt_oss"} | ({"quantization_config": quantization} if quantization else {})
    (tmp / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp / "model.safetensors"))
    return tmp


@pytest.mark.parametrize(
    ("quantization", "tensors", "says"),
    [
        ({"quant_method": "gptq"}, {"w": torch.zeros(2)}, "quant_method='gptq' is not read here; valid: mxfp4"),
        (None, {"x_blocks": torch.zeros(1, 2, 1, 16, dtype=torch.uint8)}, "has no quantization_config"),
        (
            {"quant_method": "mxfp4"},
            {"x_blocks": torch.zeros(1, 2, 1, 16, dtype=torch.uint8), "x_scales": torch.zeros(1, 3, 1)},
            "MXFP4 tensor x_blocks [1, 2, 1, 16] needs x_scales of shape [1, 2, 1]",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            {"w": torch.zeros(256, 128), "w_scale_inv": torch.zeros(1, 1)},
            "FP8 scales w_scale_inv [1, 1] do not fit w [256, 128] in blocks of [128, 128]",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, {}, "fmt='e5m2'"),
    ],
)
def test_a_quantized_folder_that_cannot_be_read_is_one_line(
    tmp_path: Path, quantization: dict | None, tensors: dict, says: str
) -> None:
    path = _folder(tmp_path / "hf", tensors or {"w": torch.zeros(2)}, quantization)
    with pytest.raises(ValueError, match="model.init_from=") as e:
        import_hf.read_hf_checkpoint(path)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
