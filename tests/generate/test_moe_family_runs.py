"""The run dir of each layer-kind MoE family (``deepseek_v3_tiny`` trained at ep=2, ``gpt_oss_tiny``
under FSDP, each on 2 gloo ranks forked from this process) through the commands that read a run:
``generate`` (greedy, with the KV cache: DeepSeek-V3's holds the compressed latent and the rotated
RoPE key, GPT-OSS's the keys and values each layer's window leaves; against re-running the full
forward on the whole sequence), ``evaluate`` (the run dir against transformers on its export),
``export-hf`` (transformers' ``DeepseekV3ForCausalLM`` / ``GptOssForCausalLM`` load it and give our
logits) and ``model.init_from`` of the run dir (its own layer pattern, latent ranks, window and
router biases, not the new run's recipe's).

The runs train 2 steps at a small learning rate: the model stays near its random init, so greedy
decoding picks varied tokens (a model trained a few steps at the recipe's rate emits one byte)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip(
    "transformers", reason="transformers is in the dev extra: the parity tests compare with its models"
)

from framework.checkpoint.export_hf import checkpoint_model_state  # noqa: E402
from framework.config.schema import to_config  # noqa: E402
from framework.generate.decode import generate, load_model  # noqa: E402
from framework.launch.export_run import export_checkpoint  # noqa: E402
from framework.launch.generate import main as generate_main  # noqa: E402
from framework.models import KVCache, forward_cached  # noqa: E402

TOL = 1e-5
# recipe -> its 2-rank layout and shape; GPT-OSS's window of 8 is shorter than what is decoded
RUNS = {
    "deepseek_v3_tiny": ["parallel.ep=2"],
    "gpt_oss_tiny": ["parallel.dp_shard=2", "model.sliding_window=8"],
}
ARCHITECTURE = {"deepseek_v3_tiny": "DeepseekV3ForCausalLM", "gpt_oss_tiny": "GptOssForCausalLM"}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.dist import train_on_forked_ranks

    recipe = request.param
    out = tmp_path_factory.mktemp(recipe) / "run"
    train_on_forked_ranks(
        out, 2, f"hydra.run.dir={out}", f"recipe={recipe}", "mesh=2", *RUNS[recipe], "train.steps=2",
        "train.seq_len=32", "train.global_batch_size=4", "train.eval_every=0", "train.warmup_steps=1",
        "train.lr=1e-4", "checkpoint=sync", "logger.plot=false",
    )  # fmt: skip
    return out


def step_dir(run: Path) -> Path:
    return run / "checkpoints" / "step_000002"


def test_generate_with_the_cache_equals_the_full_forward(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = to_config(OmegaConf.load(run / "config.yaml"))
    model = load_model(step_dir(run), cfg, torch.device("cpu"))
    prompt = [100, 101, 102, 32, 40]
    ids = generate(model, prompt, max_new_tokens=14)  # 19 positions: past GPT-OSS's window of 8
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(14):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert ids == seq[len(prompt) :] and len(set(ids)) >= 3, ids  # varied tokens: a real check
    # The cached logits at every position (prefill 5, then one at a time) against the full forward.
    tokens = torch.tensor([seq])
    cache = KVCache.empty(model, 1, tokens.shape[1])
    cached = [forward_cached(model, tokens[:, :5], cache)]
    cached += [forward_cached(model, tokens[:, i : i + 1], cache) for i in range(5, tokens.shape[1])]
    with torch.no_grad():
        full = model(tokens)
    torch.testing.assert_close(torch.stack(cached, 1)[0], full[0, 4:], rtol=TOL, atol=TOL)
    # The command line on the run dir: the same greedy bytes.
    assert generate_main([str(run), "--prompt", bytes(prompt).decode(), "--max-new-tokens", "14"]) == 0
    out = capsys.readouterr()
    assert out.out.encode("utf-8", "surrogateescape")[: len(prompt)] == bytes(prompt)
    assert "step_000002" in out.err


def test_export_loads_in_transformers_with_our_logits_and_evaluate_equals_it(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    from framework.launch.evaluate import main as evaluate_main
    from tests.generate.test_evaluate import transformers_loss

    recipe = to_config(OmegaConf.load(run / "config.yaml")).model.name
    export = export_checkpoint(run, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCHITECTURE[recipe]
    cfg = to_config(OmegaConf.load(run / "config.yaml"))
    model = load_model(step_dir(run), cfg, torch.device("cpu"))
    x = torch.randint(32, 127, (2, 32), generator=torch.Generator().manual_seed(0))  # ASCII: one byte each
    with torch.no_grad():
        diff = (hf(x).logits - model(x)).abs().max().item()
    print(f"{recipe}: export max |logits diff| transformers vs ours {diff:.2e}")
    assert diff <= TOL
    # evaluate on the run dir: transformers' loss on its export over the same windows.
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": bytes(row.tolist()).decode()}) + "\n" for row in x))
    data = ["data=jsonl", f"data.path={docs}", "train.seq_len=16"]
    report = tmp_path / "report.json"
    assert evaluate_main([str(run), *data, "--report", str(report), "--device", "cpu"]) == 0
    figure = json.loads(capsys.readouterr().out.splitlines()[-1])
    theirs, tokens = transformers_loss(export, data)
    print(
        f"{recipe}: evaluate {figure['loss']:.7f}, transformers on the export {theirs:.7f}, {tokens} tokens"
    )
    assert figure["tokens"] == tokens > 0 and abs(figure["loss"] - theirs) <= TOL
    # and on the export itself (an HF folder; its import sets a load-balancing coefficient, which a
    # forward without gradients does not add: evaluate reports the cross-entropy, as transformers)
    report = tmp_path / "report_export.json"
    assert evaluate_main([str(export), *data, "--report", str(report), "--device", "cpu"]) == 0
    on_export = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert on_export["tokens"] == tokens and abs(on_export["loss"] - theirs) <= TOL, (on_export, theirs)


def test_init_from_the_run_dir_builds_its_model(run: Path) -> None:
    """``model.init_from=RUN_DIR`` under the default recipe: the saved model's family, layer pattern
    and family keys (a checkpoint records them), every tensor read as saved (the routers' biases
    too); before, the default's latent ranks were built and the load refused."""
    from framework.checkpoint import init_from
    from framework.config.schema import Config, ModelConfig
    from framework.models import build_model, materialize
    from tests.checkpoint.test_init_from import resolve

    cfg = resolve(Config(model=ModelConfig(init_from=str(run))), [])
    saved = to_config(OmegaConf.load(run / "config.yaml")).model
    assert cfg.model.family == saved.family and cfg.model.layer_pattern == saved.layer_pattern
    model = build_model(cfg.model, 32)
    materialize(model, "cpu", 0, init_from.load)
    state, want = model.state_dict(), checkpoint_model_state(step_dir(run))
    assert sorted(want) == sorted(k for k in state if k in want) and len(want) >= len(state) - 1
    assert all(torch.equal(state[k], want[k]) for k in want)
