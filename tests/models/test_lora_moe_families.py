"""LoRA (``peft=lora``) on the layer-kind MoE families against the ``peft`` library over transformers'
``DeepseekV3ForCausalLM`` and ``GptOssForCausalLM`` (tiny random models, fp32, CPU).

Which Linears an adapter can sit on: DeepSeek-V3's multi-head latent attention ``wq_a``/``wq_b`` (the
low-rank query; ``wq`` without it), ``wkv_a`` (to the latent and the shared RoPE key), ``wkv_b``
(latent to per-head keys and values), ``wo``, its dense layers' ``w1``/``w2``/``w3`` and its shared
experts' ``gate_proj``/``up_proj``/``down_proj``; GPT-OSS's biased ``wq``/``wk``/``wv``/``wo`` and its
router. The routed experts of both are stacked 3-D parameters, not Linears: no adapter there.

Two claims per family: with non-zero adapters our logits equal peft's on the HF model; and a LoRA
run on 2 gloo ranks (DeepSeek-V3 at ep=2, GPT-OSS under FSDP) trains only the adapters, keeps the
routers' selection biases at the base's (they are part of the frozen base), and both exports (the
merged HF folder, the PEFT adapter folder over the base) give the run's model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="peft is in the dev extra: the LoRA tests compare with it")

from framework.checkpoint import init_from  # noqa: E402
from framework.checkpoint.export_lora import to_peft_state  # noqa: E402
from framework.config.schema import PeftConfig, PeftMethod  # noqa: E402
from framework.models import build_model, lora, materialize  # noqa: E402
from tests.models import test_models_deepseek_v3 as deepseek  # noqa: E402
from tests.models import test_models_gpt_oss as gpt_oss  # noqa: E402
from tests.models.test_lora import randomize_adapters  # noqa: E402

TOL = 1e-5
# family -> (our targets, peft's target_modules for the same Linears, the 2-rank layout of the run)
CASES = {
    "deepseek_v3": (
        ["wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "down_proj"],
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_experts.down_proj"],
        ["parallel.ep=2", "model.moe.bias_update_rate=0.01"],  # the bias would move 0.01 a step
    ),
    "gpt_oss": (["wq", "wk", "wv", "wo"], ["q_proj", "k_proj", "v_proj", "o_proj"], ["sharding=fsdp"]),
}
MODULES = {"deepseek_v3": deepseek, "gpt_oss": gpt_oss}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny HF model, saved (the parity tests' own: every part decides the logits)."""
    root = tmp_path_factory.mktemp("hf")
    return {family: MODULES[family].save(root / family)[0] for family in CASES}


def peft_logits(
    base: Path, state: dict[str, torch.Tensor], targets: list[str], model_cfg: object
) -> torch.Tensor:
    """peft's LoRA over the HF model of ``base`` with the adapters of our ``state``, on the tokens."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8.0, target_modules=targets)).eval()
    result = set_peft_model_state_dict(model, to_peft_state(state, model_cfg))
    assert not result.unexpected_keys, result.unexpected_keys
    with torch.no_grad():
        return model(deepseek.tokens()).logits


@pytest.mark.parametrize("family", list(CASES))
def test_adapters_on_the_attention_train_alone_and_equal_peft(
    tmp_path: Path, bases: dict[str, Path], family: str
) -> None:
    ours_targets, hf_targets, _ = CASES[family]
    base = bases[family]
    cfg = deepseek.imported_cfg(base)
    model = build_model(cfg, deepseek.SEQ)
    peft = PeftConfig(method=PeftMethod.lora, rank=4, alpha=8.0, targets=ours_targets)
    lora.check(model, peft)
    chosen = lora.attach(model, peft)
    assert {n.rsplit(".", 1)[-1] for n in chosen} == set(ours_targets)
    materialize(model, "cpu", seed=0, load_weights=init_from.load)
    lora.init_adapters(model, 0)  # B = 0: the base model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(chosen) and all(lora.is_lora_name(n) for n in trainable)
    with torch.no_grad():
        plain = model.eval()(deepseek.tokens())
    randomize_adapters(model)
    with torch.no_grad():
        ours = model(deepseek.tokens())
    theirs = peft_logits(base, model.state_dict(), hf_targets, cfg)
    diff = (ours - theirs).abs().max().item()
    print(f"{family}: LoRA on {len(chosen)} Linears, max |logits diff| ours vs peft {diff:.2e}")
    assert diff <= TOL and (ours - plain).abs().max() > 100 * TOL  # the adapters change the logits


@pytest.mark.parametrize("family", list(CASES))
def test_a_two_rank_lora_run_exports_merged_and_adapter_with_its_logits(
    tmp_path: Path, bases: dict[str, Path], family: str
) -> None:
    from omegaconf import OmegaConf
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from framework.checkpoint.export_hf import checkpoint_model_state
    from framework.config.schema import to_config
    from framework.generate.decode import load_model
    from framework.launch.export_run import export_adapter_checkpoint, export_checkpoint
    from tests.dist import train_on_forked_ranks

    ours_targets, _, layout = CASES[family]
    base, run = bases[family], tmp_path / "run"
    train_on_forked_ranks(
        run, 2, f"hydra.run.dir={run}", f"model.init_from={base}", "data=synthetic", "mesh=2", *layout,
        "peft=lora", "peft.rank=4", f"peft.targets=[{','.join(ours_targets)}]", "train.steps=2",
        "train.seq_len=16", "train.global_batch_size=4", "train.eval_every=0", "train.warmup_steps=1",
        "train.lr=1e-2", "checkpoint=sync", "freeze=none", "logger.plot=false",
    )  # fmt: skip
    step = run / "checkpoints" / "step_000002"
    saved = checkpoint_model_state(step)
    adapters = [k for k in saved if lora.is_lora_name(k)]
    assert adapters and all(saved[k].abs().max() > 0 for k in adapters if k.endswith("lora_B.weight"))
    # Beside the adapters only the routers' selection biases (buffers), still the base's.
    from safetensors.torch import load_file

    hf_base = {k: v for f in base.glob("*.safetensors") for k, v in load_file(f).items()}
    for k in (k for k in saved if not lora.is_lora_name(k)):
        assert k.endswith("expert_bias"), k
        layer = k.split(".")[1]
        torch.testing.assert_close(
            saved[k], hf_base[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        )
    cfg = to_config(OmegaConf.load(run / "config.yaml"))
    model = load_model(step, cfg, torch.device("cpu"))  # what generate and evaluate run
    with torch.no_grad():
        ours = model(deepseek.tokens())
    merged = export_checkpoint(run, tmp_path / "merged")
    adapter = export_adapter_checkpoint(step, tmp_path / "adapter")
    hf_merged = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
    hf_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager"), adapter
    ).eval()
    with torch.no_grad():
        diffs = [(m(deepseek.tokens()).logits - ours).abs().max().item() for m in (hf_merged, hf_adapter)]
        untrained = (AutoModelForCausalLM.from_pretrained(base)(deepseek.tokens()).logits - ours).abs().max()
    print(f"{family} LoRA run: max |logits diff| merged {diffs[0]:.2e}, adapter {diffs[1]:.2e}")
    assert max(diffs) <= TOL and untrained > 100 * TOL  # it trained
