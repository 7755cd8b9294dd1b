"""``python train.py recipe=qwen3_moe_tiny`` on the CPU (forked from this process, tests/entry.py):
the experts' balance in metrics.jsonl, the console line and metrics.png; the export after a few steps
loads in transformers with our logits; the sigmoid router's selection bias moves at each step."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from framework.checkpoint.export_hf import checkpoint_model_state
from framework.config.schema import to_config
from framework.models import build_model, materialize
from framework.record.metrics import read_metrics
from tests.entry import train_forked, train_main

TINY = ["recipe=qwen3_moe_tiny", "train.seq_len=32", "train.global_batch_size=4", "train.eval_every=0"]
TINY += ["train.warmup_steps=1"]


def train(run: Path, *overrides: str) -> None:
    proc = train_forked(
        f"hydra.run.dir={run}", *TINY, *overrides, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_balance_is_logged_and_the_export_after_training_equals_ours(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers is in the dev extra: the parity tests compare with its models")
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    train(
        run,
        "train.steps=6",
        "train.log_every=3",
        "model.moe.capacity_factor=1.0",
        "checkpoint.export_hf=true",
    )
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [3, 6]
    for r in rows:
        assert len(r["moe_load"]) == 4 and all(x >= 1.0 for x in r["moe_load"])  # 1.0: balanced
        assert r["moe_load_max"] == max(r["moe_load"]) and r["moe_aux_loss"] > 0
        assert 0 <= r["moe_dropped_frac"] < 1 and r["moe_dropped"] >= 0
    assert any(r["moe_dropped"] > 0 for r in rows)  # capacity 1.0 with an untrained router drops some
    log = (run / "train.log").read_text()
    assert "| experts max/mean " in log and "| aux " in log and "| dropped " in log
    assert (run / "metrics.png").is_file()
    # The export of step 6 in transformers, against our model from the step's checkpoint.
    # transformers drops no token: ours without the capacity (inference), the same weights.
    cfg = to_config(OmegaConf.load(run / "config.yaml")).model
    cfg = dataclasses.replace(cfg, init_from=None, moe=dataclasses.replace(cfg.moe, capacity_factor=0.0))
    model = build_model(cfg, 32)
    materialize(model, "cpu", seed=0)
    missing, unknown = model.load_state_dict(
        checkpoint_model_state(run / "checkpoints" / "step_000006"), strict=False
    )
    assert missing == ["output.weight"] and not unknown  # tied: the embedding's tensor, stored once
    hf = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(x).logits - model.eval()(x)).abs().max().item()
    print(f"export after 6 steps: max |logits diff| transformers vs ours {diff:.2e}")
    assert diff <= 1e-5


def test_freeze_export_traces_the_moe_model_and_it_trains(tmp_path: Path) -> None:
    """``freeze=export`` on an MoE family: the meta-device model is exported (its per-expert sizes
    as unbacked symbols), fingerprinted and saved, and the run trains as without it."""
    import json

    run = tmp_path / "run"
    train(run, "train.steps=2", "train.log_every=1", "freeze=export", "checkpoint=none")
    frozen = run / "frozen"
    assert {"fingerprint.json", "manifest.json", "model.pt2"} <= {p.name for p in frozen.iterdir()}
    fingerprint = json.loads((frozen / "fingerprint.json").read_text())
    assert fingerprint["namespace"] == "export-v1" and len(fingerprint["fingerprint"]) == 64
    assert "froze the model (export)" in (run / "train.log").read_text()
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["moe_aux_loss"] > 0 for r in rows)


def test_sigmoid_router_bias_moves_each_step_and_another_expert_count_cannot_resume(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    rate = 0.01
    train(run, "train.steps=3", "model.moe.router_score=sigmoid", f"model.moe.bias_update_rate={rate}")
    state = checkpoint_model_state(run / "checkpoints" / "step_000003")
    bias = state["layers.0.feed_forward.gate.expert_bias"]
    steps = bias / rate  # each step moves each entry by -rate, 0 or +rate (the sign of mean - load)
    assert bias.abs().max() > 0 and torch.allclose(steps, steps.round(), atol=1e-4), bias
    assert steps.abs().max() <= 3 and abs(bias.sum().item()) < 3 * rate * bias.numel()
    # Resuming that checkpoint with another expert count (and router): one line, exit 2, nothing written.
    again = tmp_path / "again"
    step = run / "checkpoints" / "step_000003"
    code = train_main(f"hydra.run.dir={again}", *TINY, f"checkpoint.resume={step}", "model.moe.num_experts=4")
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and not again.exists(), errors
    assert "model.moe.num_experts=8 there, 4 here" in errors[0] and "router_score=sigmoid there" in errors[0]


def test_ep2_under_compile_does_not_fall_back(tmp_path: Path) -> None:
    """``mesh=2 parallel.ep=2 executor=compile`` (aot_eager) through train.py: no fallback event in
    metrics.jsonl and no fallback line in train.log (it fell back to eager before: "Attempted to
    call function marked as skipped"). Its losses against eager's: tests/parallel/test_parallel_expert.py's
    ``test_ep2_compiles_each_moe_block_as_one_graph_with_eager_losses``."""
    run = tmp_path / "run"
    train(run, "mesh=2", "parallel.ep=2", "executor=compile", "executor.backend=aot_eager", "data=synthetic",
          "train.steps=2", "train.log_every=1", "checkpoint=none")  # fmt: skip
    rows = read_metrics(run)
    assert [r for r in rows if "event" in r] == [] and [r["step"] for r in rows] == [1, 2], rows
    log = (run / "train.log").read_text()
    assert "fallback" not in log and "executor compile" not in log, log[-2000:]


# Issue 25's bad inputs through the real entry point (in this process: a refusal trains nothing):
# (overrides, the error line's start). Each refused before launch: exit 2, one line, no run dir.
BAD = [
    (["mesh=4", "parallel.ep=3"], "parallel.ep=3 does not divide parallel.dp_shard=4: the ep ranks are borrowed"),
    (["mesh=4", "parallel.ep=4", "model.moe.num_experts=6"],
     "parallel.ep=4 does not divide model.moe.num_experts=6: valid ep here are [1, 2]"),
    (["model.moe.num_experts_per_tok=9"],
     "model.moe.num_experts_per_tok=9 is not valid; valid: an integer in 1..model.moe.num_experts=8"),
    (["model.moe.capacity_factor=-0.5"],
     "model.moe.capacity_factor=-0.5 is not valid; valid: 0 (no token dropped) or a finite number > 0"),
    (["model.moe.router_aux_loss_coef=-0.1"],
     "model.moe.router_aux_loss_coef=-0.1 is not valid; valid: a finite number >= 0"),
    (["recipe=llama_tiny", "mesh=2", "parallel.ep=2"],
     "parallel.ep=2 with model.family=llama, a dense model (model.moe.num_experts=0): it has no experts"),
]  # fmt: skip


def refused(run: Path, capfd: pytest.CaptureFixture[str], *overrides: str) -> str:
    """``train.py *overrides`` (qwen3_moe_tiny unless a recipe is given): exit 2, exactly one error
    line (returned), no traceback, nothing written."""
    capfd.readouterr()
    code = train_main(f"hydra.run.dir={run}", *TINY, "run.device=cpu", *overrides)
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, (code, err[-2000:])
    assert "Traceback" not in err and not run.exists(), err[-2000:]
    return errors[0].removeprefix("error: ")


@pytest.mark.parametrize(("overrides", "line"), BAD, ids=[b[1].split(" ")[0] for b in BAD])
def test_bad_moe_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], overrides: list[str], line: str
) -> None:
    assert refused(tmp_path / "run", capfd, *overrides).startswith(line)


def test_hf_moe_checkpoint_of_another_expert_count_or_router_is_one_line_exit_2(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``model.init_from=`` a Hugging Face Qwen3-MoE folder whose config.json and tensors disagree on
    the experts (a router of another shape; one expert's tensors missing, or one too many), or a
    command line that contradicts its config.json's expert count: exit 2, one line naming the tensor
    or the key, nothing written."""
    pytest.importorskip("transformers", reason="transformers is in the dev extra: the parity tests compare with its models")
    import json

    from safetensors.torch import load_file, save_file

    from tests.models.test_models_moe_families import hf_model

    good = tmp_path / "good"
    hf_model("qwen3_moe").save_pretrained(good)  # 4 experts, top 2, dim 64
    config = json.loads((good / "config.json").read_text())
    tensors = {k: v for f in sorted(good.glob("*.safetensors")) for k, v in load_file(f).items()}

    def variant(name: str, n_experts: int, drop: str | None = None, add: str | None = None) -> Path:
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps(config | {"num_experts": n_experts}))
        mine = {k: v for k, v in tensors.items() if drop is None or drop not in k}
        if add is not None:  # a 5th expert, a copy of expert 0
            mine |= {
                k.replace(".experts.0.", add): v.clone() for k, v in tensors.items() if ".experts.0." in k
            }
        save_file(mine, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    cases = [
        (variant("router", 6), [], "tensor model.layers.0.mlp.gate.weight has shape [4, 64], the model expects [6, 64]"),
        (variant("fewer", 4, drop=".experts.3."), [],
         "tensor names do not match the model: missing ['model.layers.0.mlp.experts.3.down_proj.weight'"),
        (variant("more", 4, add=".experts.4."), [],
         "tensor names do not match the model: missing [], unknown ['model.layers.0.mlp.experts.4.down_proj.weight'"),
        (good, ["model.moe.num_experts=6"], "model.moe.num_experts=6 on the command line contradicts model.init_from="),
    ]  # fmt: skip
    for i, (path, extra, line) in enumerate(cases):
        msg = refused(tmp_path / f"run{i}", capfd, f"model.init_from={path}", *extra)
        assert line in msg, (path.name, msg)
