"""``model.init_from`` through ``python train.py``: fine-tune a Hugging Face model, export it, load
the export with transformers; a framework checkpoint as the initial weights; bad sources.

Parity figures (max |logits difference|, fp32, CPU) are printed with ``pytest -s``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers", reason="transformers is in the dev extra: the parity tests compare with its models")

from framework.checkpoint import init_from  # noqa: E402
from framework.config.schema import Config, ModelConfig, ModelFamily, Strategy  # noqa: E402
from framework.launch.export_cli import main as checkpoint_cli  # noqa: E402
from framework.launch.rules import check_model_shape  # noqa: E402
from framework.models import build_model, materialize  # noqa: E402
from framework.parallel import build_mesh, parallelize  # noqa: E402
from framework.planner.resolve import make_plan  # noqa: E402
from tests.checkpoint.test_checkpoint_import_hf import MODELS, hf_logits, make_hf_model, tokens  # noqa: E402
from tests.dist import run_ranks, train_on_forked_ranks  # noqa: E402
from tests.entry import train_forked  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
# Small and fast: bytes of the standard library, 16-token windows, no freeze, no evaluation, no plot.
FAST = [
    "train.seq_len=16",
    "train.global_batch_size=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.warmup_steps=1",
    "freeze=none",
    "logger.plot=false",
]


def resolve(cfg: Config, overrides: list[str]) -> Config:
    """``init_from.resolve`` with the launcher's model rules, as train.py calls it."""
    def check_shape(model: ModelConfig) -> None:
        check_model_shape(dataclasses.replace(cfg, model=model))

    return dataclasses.replace(cfg, model=init_from.resolve(cfg.model, overrides, check_shape=check_shape))


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python train.py``, forked from this process (tests/entry.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return train_forked(f"hydra.run.dir={run_dir}", *overrides, timeout=300, env=env)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    names = ("gqa_untied", "mha_tied", "qwen3_untied_3heads_hd24")
    for name in names:
        make_hf_model(root / name, *MODELS[name])
    # A generation config as an instruct model ships it (Llama 3 Instruct: two stop tokens, sampling
    # defaults), which the export carries through; the others keep save_pretrained's.
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=1, eos_token_id=[2, 7], do_sample=True, temperature=0.6, top_p=0.9, top_k=20,
        max_new_tokens=77, repetition_penalty=1.1,
    ).save_pretrained(root / "gqa_untied")  # fmt: skip
    return {name: root / name for name in names}


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def test_resolve_takes_the_shape_and_refuses_a_contradicting_override(hf_dirs: dict) -> None:
    src = str(hf_dirs["gqa_untied"])
    # The recipe's shape (llama_tiny's dim 128) is replaced; an agreeing override is fine.
    cfg = Config(model=ModelConfig(init_from=src, dim=64, name="ft"))
    resolved = resolve(cfg, ["model.name=ft", "model.dim=64"])
    assert (resolved.model.dim, resolved.model.n_kv_heads, resolved.model.tie_embeddings) == (64, 2, False)
    assert (resolved.model.rope_theta, resolved.model.name, resolved.model.init_from) == (500000.0, "ft", src)
    assert resolve(Config(model=ModelConfig(init_from=src)), []).model.dim == 64
    # The family and its shape come from config.json too (model_type qwen3, head_dim 24 != 48 / 3).
    qwen3 = resolve(
        Config(model=ModelConfig(init_from=str(hf_dirs["qwen3_untied_3heads_hd24"]))), []
    )
    assert (qwen3.model.family, qwen3.model.head_dim, qwen3.model.dim) == (ModelFamily.qwen3, 24, 48)
    with pytest.raises(
        ValueError, match=r"model\.family=llama on the command line contradicts .* model_type=qwen3"
    ):
        resolve(
            qwen3_cfg := Config(model=ModelConfig(init_from=qwen3.model.init_from)), ["model.family=llama"]
        )
    assert qwen3_cfg.model.family is ModelFamily.llama
    with pytest.raises(ValueError, match=r"model\.family=llama on the command line contradicts"):
        resolve(qwen3_cfg, ["model=llama"])  # the group's choice, which model.family=llama becomes
    contradicting = Config(model=ModelConfig(init_from=src, n_heads=8))
    with pytest.raises(
        ValueError,
        match=r"model\.n_heads=8 on the command line contradicts .* config.json has num_attention_heads=4",
    ):
        resolve(contradicting, ["model.n_heads=8"])


@pytest.mark.parametrize("name", ["gqa_untied", "qwen3_untied_3heads_hd24"])
def test_round_trip_zero_steps_is_equal_tensor_for_tensor(tmp_path: Path, hf_dirs: dict, name: str) -> None:
    """HF -> train 0 steps -> export: the same tensors, bit for bit (q/k and Qwen3's q/k norms
    permuted there and back), and the same config.json shape."""
    src = hf_dirs[name]
    run = tmp_path / "run"
    ok(train(run, f"model.init_from={src}", "train.steps=0", "checkpoint.export_hf=true", *FAST))
    before, after = hf_tensors(src), hf_tensors(run / "hf")
    assert sorted(before) == sorted(after)
    for tensor, t in before.items():
        assert torch.equal(after[tensor], t), tensor
    # The source's generation config, field by field as transformers reads it; the tokenizer's ids
    # fill only the special tokens the source leaves unset.
    from transformers import GenerationConfig

    theirs = GenerationConfig.from_pretrained(src).to_dict()
    ours = GenerationConfig.from_pretrained(run / "hf").to_dict()
    filled = {k for k in ("bos_token_id", "eos_token_id", "pad_token_id") if theirs.get(k) is None}
    differ = {
        k: (theirs.get(k), ours.get(k))
        for k in (theirs.keys() | ours.keys()) - filled
        if theirs.get(k) != ours.get(k)
    }
    assert not differ, differ
    if name == "gqa_untied":
        assert (ours["eos_token_id"], ours["do_sample"], ours["temperature"]) == ([2, 7], True, 0.6)
    conf, back = (
        json.loads((src / "config.json").read_text()),
        json.loads((run / "hf" / "config.json").read_text()),
    )
    for k in (
        "model_type",
        "architectures",
        "head_dim",
        "hidden_size",
        "num_key_value_heads",
        "tie_word_embeddings",
    ):
        assert back[k] == conf[k], k


def test_fine_tune_export_and_reload(tmp_path: Path, hf_dirs: dict) -> None:
    """HF (tied MHA) -> 3 steps on 2 FSDP ranks -> export: transformers' logits on the export equal
    ours on the trained checkpoint. The export CLI writes the same folder from the checkpoint, and
    the checkpoint loaded through init_from on 2 TP ranks gives transformers' logits again."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    src = hf_dirs["mha_tied"]
    run = tmp_path / "ft"
    common = [*FAST, "checkpoint=sync", "checkpoint.export_hf=true"]
    out = ok(train(run, f"model.init_from={src}", "train.steps=3", "mesh=2", "sharding=fsdp", *common))
    assert "exported a Hugging Face checkpoint of step 3" in out
    exported = hf_tensors(run / "hf")
    assert "lm_head.weight" not in exported  # tied
    assert not torch.equal(exported["model.norm.weight"], hf_tensors(src)["model.norm.weight"])  # it trained

    # Framework (trained checkpoint, loaded through init_from) vs transformers on the export.
    cfg = resolve(Config(model=ModelConfig(init_from=str(run))), [])
    assert cfg.model.init_from == str(run / "checkpoints" / "step_000003")
    # A run started from this checkpoint logs the model it continues (the recipe's default name was logged).
    assert cfg.model.name == "mha_tied"
    model = build_model(cfg.model, 16)
    materialize(model, "cpu", seed=0, load_weights=init_from.load)
    with torch.no_grad():
        diff = (hf_logits(run / "hf") - model(tokens())).abs().max().item()
    print(f"framework (3 FSDP steps) -> HF, max |logits diff|: {diff:.3g}")
    assert diff <= TOL
    auto = AutoModelForCausalLM.from_pretrained(run / "hf")
    rope = getattr(auto.config, "rope_parameters", None) or {"rope_theta": auto.config.rope_theta}
    assert type(auto).__name__ == "LlamaForCausalLM" and rope["rope_theta"] == 500000.0
    assert GenerationConfig.from_pretrained(run / "hf") is not None

    # The CLI on the committed checkpoint writes the same tensors.
    assert checkpoint_cli(["export-hf", str(run / "checkpoints" / "step_000003"), str(tmp_path / "cli")]) == 0
    cli = hf_tensors(tmp_path / "cli")
    assert sorted(cli) == sorted(exported) and all(torch.equal(cli[k], exported[k]) for k in cli)
    conf = json.loads((tmp_path / "cli" / "config.json").read_text())
    # The source's context (64 positions), not the training seq_len (16), which the export used to write.
    assert conf["max_position_embeddings"] == 64 and conf["num_key_value_heads"] == 4

    # The framework checkpoint as init_from on another layout (2 TP ranks, DTensor shards read
    # from DCP): transformers' logits on the export again.
    expected = hf_logits(run / "hf")
    for d in run_ranks(_tp_logits_diff, 2, str(run), expected):
        assert d <= TOL, d


def _tp_logits_diff(rank: int, world: int, source: str, expected: torch.Tensor) -> float:
    cfg = resolve(Config(model=ModelConfig(init_from=source)), [])
    cfg.mesh.shape, cfg.sharding.strategy, cfg.sharding.tp = [2], Strategy.tp, 2
    cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = 16, 1, 1
    plan = make_plan(cfg)
    args = (cfg.sharding, cfg.bucketing, cfg.executor, torch.device("cpu"), 0)
    model = parallelize(build_model(cfg.model, 16), build_mesh(plan, "cpu"), plan, *args, load_weights=init_from.load)
    assert isinstance(model.layers["0"].attention.wq.weight, DTensor)
    with torch.no_grad():
        return (model(tokens()) - expected).abs().max().item()


def _first_loss(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in rows if "loss" in r)


def test_pipeline_stages_read_only_their_tensors(tmp_path: Path, hf_dirs: dict) -> None:
    """pp=2 on 2 gloo ranks from an HF folder (tied: the last stage's output projection is a copy
    of the embedding, read from ``model.embed_tokens.weight``): each stage reads only its blocks
    (the whole folder's names were "unknown tensor names" to a stage), and the first loss is the
    1-rank run's from the same weights. The stages are the pp run's config as train.py composes it,
    trained on 2 ranks forked from this process (tests/dist.py: a launched rank's load path, without
    2 interpreters importing torch)."""
    src = hf_dirs["mha_tied"]
    common = [f"model.init_from={src}", "train.steps=1", "checkpoint=none", *FAST]
    ok(train(tmp_path / "one", *common))
    train_on_forked_ranks(tmp_path / "pp", 2, "mesh=2", "parallel.pp=2", "parallel.dp_shard=1", *common)
    one, pp = _first_loss(tmp_path / "one"), _first_loss(tmp_path / "pp")
    print(f"first loss from {src.name}: 1 rank {one!r}, pp=2 {pp!r}")
    assert pp == pytest.approx(one, rel=1e-6, abs=0)


def test_bad_sources_exit_2_with_one_line_and_no_run_dir(tmp_path: Path, hf_dirs: dict) -> None:
    """A folder with no weights through train.py (one line, exit 2, no run dir); weights of
    another shape through the same check in process (it runs in the entry point, before launch)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    run = tmp_path / "run"
    proc = train(run, f"model.init_from={empty}", *FAST)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "holds no weights" in errors[0], proc.stderr[-2000:]
    assert not run.exists()

    wrong = tmp_path / "wrong"  # config.json of one model (GQA), weights of another (MHA)
    wrong.mkdir()
    (wrong / "config.json").write_text((hf_dirs["gqa_untied"] / "config.json").read_text())
    shutil.copy(hf_dirs["mha_tied"] / "model.safetensors", wrong / "model.safetensors")  # a link out is refused
    shape = r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \[64, 64\], the model expects \[32, 64\]"
    with pytest.raises(ValueError, match=shape):
        resolve(Config(model=ModelConfig(init_from=str(wrong))), [])
    not_there = tmp_path / "nothing"
    with pytest.raises(ValueError, match="does not exist"):
        resolve(Config(model=ModelConfig(init_from=str(not_there))), [])


def _edit_config(folder: Path, **fields: object) -> None:
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**conf, **fields}))


def _edit_weights(folder: Path, change: str) -> None:
    """Rewrite the first shard with its first tensor changed (the folder may be sharded)."""
    from safetensors.torch import save_file

    shard = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    first = sorted(tensors)[0]
    t = tensors[first]
    tensors[first] = {"int8": t.to(torch.int8), "bool": t.bool(), "nan": t.clone().fill_(math.nan)}[change]
    shard.unlink()  # a copied shard may be read-only or a link: write a new file
    save_file(tensors, str(shard), metadata={"format": "pt"})


# One per class (issue 24, part 4): the source is untrusted input, read before launch.
BAD_HF = [
    (lambda f: _edit_config(f, num_hidden_layers=50_000_000), "model.n_layers=50000000 is not valid"),
    (lambda f: _edit_config(f, num_hidden_layers=2.5), "num_hidden_layers=2.5; valid: an integer"),
    (
        lambda f: _edit_config(f, tie_word_embeddings="false"),
        "tie_word_embeddings='false'; valid: true or false",
    ),
    (lambda f: _edit_weights(f, "int8"), "is I8; valid: floating-point weights"),
    (lambda f: _edit_weights(f, "bool"), "is BOOL; valid: floating-point weights"),
    (lambda f: _edit_weights(f, "nan"), "holds NaN or inf; valid: finite weights"),
    (
        lambda f: (f / "generation_config.json").write_text("{not json"),
        "generation_config.json does not parse",
    ),
]


@pytest.mark.parametrize("edit, message", BAD_HF, ids=[m.split(";")[0] for _e, m in BAD_HF])
def test_a_bad_hf_folder_is_one_line_before_launch(tmp_path: Path, hf_dirs: dict, edit, message: str) -> None:
    """A 50M-layer config.json hung the launcher; a fractional layer count, a string boolean, int8,
    bool and NaN weights trained silently. Each is one line naming the file's value."""
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_dirs["gqa_untied"], folder)
    edit(folder)
    with pytest.raises(ValueError) as info:
        resolve(Config(model=ModelConfig(init_from=str(folder))), [])
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"model.init_from='{folder}'") and message in msg, msg


def test_a_50m_layer_config_exits_2_through_train_py(tmp_path: Path, hf_dirs: dict) -> None:
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_dirs["gqa_untied"], folder)
    _edit_config(folder, num_hidden_layers=50_000_000)
    run = tmp_path / "run"
    proc = train(run, f"model.init_from={folder}", *FAST)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "model.n_layers=50000000" in errors[0], proc.stderr[
        -2000:
    ]
    assert not run.exists()
