"""A LoRA run's dir is a run dir like any other: ``generate`` and ``evaluate`` load its base (the run's
``model.init_from``) with the adapters of its checkpoint (which holds the adapters only).

One real run: ``train.py recipe=sft_tiny peft=lora`` over a tiny random Llama made with transformers
(the size of the shipped chat tokenizer's 384 tokens), forked from this process (tests/entry.py). Its figures are
checked against the run's own validation loss and against peft's ``PeftModel`` over transformers'
model with the adapter folder ``export-hf --adapter`` writes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="peft is in the dev extra: the LoRA run is compared with it")

from framework.checkpoint.state import read_metadata  # noqa: E402
from framework.models import lora  # noqa: E402
from tests.checkpoint.test_init_from import ok, train  # noqa: E402

STEPS = 6
LORA = ["peft=lora", "peft.targets=[wq,wk,wv,wo]"]
FAST = ["freeze=none", "logger.plot=false", "checkpoint=sync", "train.log_every=1", "train.warmup_steps=1"]
FAST += [f"train.steps={STEPS}", f"train.eval_every={STEPS}", "train.eval_batches=2"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(the run dir, its base HF folder, the run's console output)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("lora_run")
    base, run = tmp / "hf_chat", tmp / "run"
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(base)  # the recipe's tokenizer: recipes/data/sft_tiny
    out = ok(train(run, "recipe=sft_tiny", f"model.init_from={base}", *LORA, *FAST))
    return run, base, out


def _cli(capfd: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """``python -m framework *args`` (its main in this process): exit status and output."""
    from framework import __main__ as cli

    capfd.readouterr()
    code = cli.main(list(args))
    out = capfd.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def test_the_log_says_lora_is_on_with_the_trainable_count(lora_run: tuple[Path, Path, str]) -> None:
    """As peft's print_trainable_parameters words it; the trainable count is the checkpoint's adapters."""
    run, _, out = lora_run
    step = run / "checkpoints" / f"step_{STEPS:06d}"
    meta = read_metadata(step).state_dict_metadata
    adapters = {k: v for k, v in meta.items() if k.startswith("model.")}
    assert adapters and all(lora.is_lora_name(k) for k in adapters)
    trainable = sum(torch.Size(v.size).numel() for v in adapters.values())
    line = next(ln for ln in out.splitlines() if "LoRA (peft=lora)" in ln)
    found = re.search(
        r"rank 8, alpha 16, dropout 0, adapters on 8 layers \(wk, wo, wq, wv\), base frozen in float32; "
        r"trainable params: ([\d,]+) \|\| all params: ([\d,]+) \|\| trainable%: ([\d.]+)$",
        line,
    )
    assert found, line
    n, total = (int(g.replace(",", "")) for g in found.groups()[:2])
    assert n == trainable and float(found.group(3)) == pytest.approx(100 * n / total, abs=1e-4)
    assert total - n == sum(p.numel() for p in _base_model(lora_run[1]).parameters())


def _base_model(base: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base).eval()


def test_evaluate_scores_the_base_with_the_trained_adapters(
    lora_run: tuple[Path, Path, str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``evaluate RUN`` (the run's validation batches, one rank): the run's final val_loss, not its
    step-0 one (the base's: the adapters start at zero); the report names the checkpoint and the base."""
    run, base, _ = lora_run
    proc = _cli(capfd, "evaluate", str(run), "--report", str(tmp_path / "report.json"), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["checkpoint"] == str(run / "checkpoints" / f"step_{STEPS:06d}")
    assert report["base"] == str(base)
    summary = json.loads((run / "summary.json").read_text())
    assert report["val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-6, abs=0)
    assert abs(summary["first_val_loss"] - summary["final_val_loss"]) > 1e-3  # the adapters trained


def test_generate_continues_as_peft_over_transformers_does(
    lora_run: tuple[Path, Path, str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``generate RUN`` greedy: the text of PeftModel.from_pretrained(base, export-hf --adapter)'s
    argmax, token by token (stopping at the tokenizer's EOS, which is not printed)."""
    from peft import PeftModel

    from framework.config.run_file import read_run_config
    from framework.data.tokenizer import load_tokenizer

    run, base, _ = lora_run
    prompt, new = "Count from 2 to 5.", 8
    proc = _cli(
        capfd, "generate", str(run), "--prompt", prompt, "--max-new-tokens", str(new), "--device", "cpu"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"step_{STEPS:06d}" in proc.stderr

    exported = _cli(capfd, "export-hf", str(run), str(tmp_path / "adapter"), "--adapter")
    assert exported.returncode == 0, exported.stderr[-3000:]
    tokenizer = load_tokenizer(read_run_config(run / "config.yaml", "config").tokenizer)
    model = PeftModel.from_pretrained(_base_model(base), tmp_path / "adapter").eval()
    ids = tokenizer.encode(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
            if out[-1] == tokenizer.eos_id:
                out.pop()
                break
    assert proc.stdout.rstrip("\n") == prompt + tokenizer.decode(out)


def test_a_moved_base_is_one_line_exit_2(
    lora_run: tuple[Path, Path, str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint holds the adapters only: without the base there is nothing to sample from."""
    run, base, _ = lora_run
    moved = base.with_name("moved")
    base.rename(moved)
    try:
        report = str(tmp_path / "report.json")
        for args in (("generate", str(run), "--prompt", "hi"), ("evaluate", str(run), "--report", report)):
            proc = _cli(capfd, *args, "--device", "cpu")
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
            assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
            assert f"model.init_from={str(base)!r} does not exist; valid: " in errors[0], errors
    finally:
        moved.rename(base)
