"""Hugging Face export: names, shapes, config, and the RoPE row permutation checked numerically."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from framework.checkpoint import export_hf, to_hf_state_dict
from framework.checkpoint.export_hf import permute_rope_rows
from framework.config.schema import ModelConfig
from framework.models import build_model, materialize
from framework.models.parts.rope import apply_rope, rope_tables

GQA = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100, tie_embeddings=False
)


def _model(cfg: ModelConfig, seq: int = 16) -> torch.nn.Module:
    model = build_model(cfg, seq)
    materialize(model, "cpu", 0)
    # Non-trivial norms, so a swapped input/post-attention norm would show up.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_names_shapes_and_config(tmp_path: Path) -> None:
    for cfg in (GQA, ModelConfig()):  # untied GQA, and the tied tiny default
        model = _model(cfg)
        out = export_hf(model.state_dict(), cfg, tmp_path / cfg.name, max_position_embeddings=16)
        tensors = load_file(str(out / "model.safetensors"))
        head = cfg.dim // cfg.n_heads
        assert tensors["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.dim)
        assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (cfg.n_heads * head, cfg.dim)
        assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (cfg.n_kv_heads * head, cfg.dim)
        assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (cfg.dim, cfg.ffn_dim)
        assert ("lm_head.weight" in tensors) is not cfg.tie_embeddings
        assert len(tensors) == 2 + 9 * cfg.n_layers + (0 if cfg.tie_embeddings else 1)
        sd = model.state_dict()
        assert torch.equal(
            tensors["model.layers.0.mlp.gate_proj.weight"], sd["layers.0.feed_forward.w1.weight"]
        )
        assert torch.equal(
            tensors["model.layers.0.mlp.up_proj.weight"], sd["layers.0.feed_forward.w3.weight"]
        )
        assert torch.equal(
            tensors["model.layers.0.post_attention_layernorm.weight"], sd["layers.0.ffn_norm.weight"]
        )
        conf = json.loads((out / "config.json").read_text())
        assert conf["model_type"] == "llama" and conf["architectures"] == ["LlamaForCausalLM"]
        assert (conf["num_key_value_heads"], conf["tie_word_embeddings"]) == (
            cfg.n_kv_heads,
            cfg.tie_embeddings,
        )
        assert conf["torch_dtype"] == "float32" and conf["max_position_embeddings"] == 16
        # Every file of the folder has one mode (the umask's): the weights were written 0600.
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
        assert len(set(modes.values())) == 1 and modes["model.safetensors"] == oct(0o666 & ~_umask()), modes


def test_export_out_must_be_a_folder_outside_the_checkpoint_root(tmp_path: Path) -> None:
    """A file OUT was a FileExistsError traceback; OUT inside the checkpoint root put files beside
    a checkpoint, which then fails its manifest check."""
    from framework.checkpoint.export_hf import check_out_dir

    step = tmp_path / "run" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("x")
    for out, fragment in [
        (tmp_path / "notes.txt", "is a file"),
        (step, "inside the checkpoint root"),
        (step.parent / "hf", "inside the checkpoint root"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            check_out_dir(out, step)
    check_out_dir(tmp_path / "run" / "hf", step)  # beside the checkpoints: fine
    other = tmp_path / "other_model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="export-hf did not write"):
        check_out_dir(other, step)
    check_out_dir(other, step, force=True)


def test_unknown_keys_are_refused() -> None:
    sd = _model(GQA).state_dict()
    sd["layers.0.attention.bias"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unknown \['layers.0.attention.bias'\]"):
        to_hf_state_dict(sd, GQA)


def _rotate_half_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's RoPE (modeling_llama.apply_rotary_pos_emb), pure torch: x is (seq, heads, head_dim)."""
    s, _, d = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def test_permutation_gives_hf_rotate_half_the_same_attention_scores() -> None:
    torch.manual_seed(0)
    cfg, seq = GQA, 12
    head = cfg.dim // cfg.n_heads
    x = torch.randn(seq, cfg.dim)
    wq, wk = torch.randn(cfg.n_heads * head, cfg.dim), torch.randn(cfg.n_kv_heads * head, cfg.dim)
    tables = rope_tables(head, seq, cfg.rope_theta)

    def ours(w: torch.Tensor) -> torch.Tensor:
        return apply_rope((x @ w.T).view(1, seq, -1, head), tables)[0]

    def hf(w: torch.Tensor, n: int) -> torch.Tensor:
        return _rotate_half_rope((x @ permute_rope_rows(w, n).T).view(seq, -1, head), cfg.rope_theta)

    q, k = ours(wq), ours(wk)
    q_hf, k_hf = hf(wq, cfg.n_heads), hf(wk, cfg.n_kv_heads)
    rep = cfg.n_heads // cfg.n_kv_heads
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, dim=1))
    scores_hf = torch.einsum("qhd,khd->hqk", q_hf, k_hf.repeat_interleave(rep, dim=1))
    torch.testing.assert_close(scores_hf, scores, rtol=1e-5, atol=1e-4)
    # Without the permutation the scores differ: the test can fail.
    unpermuted = _rotate_half_rope((x @ wq.T).view(seq, -1, head), cfg.rope_theta)
    assert not torch.allclose(unpermuted, q_hf, atol=1e-3)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
@pytest.mark.parametrize("cfg", [GQA, ModelConfig()], ids=["gqa_untied", "tiny_tied"])
def test_logits_match_transformers_llama(tmp_path: Path, cfg: ModelConfig) -> None:
    from transformers import LlamaForCausalLM

    model = _model(cfg).eval()
    export_hf(model.state_dict(), cfg, tmp_path, max_position_embeddings=16)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


def test_preempted_run_exports_the_step_it_saved(tmp_path: Path) -> None:
    """SIGTERM mid-run with ``checkpoint.export_hf=true``: the run saves, exports that same step
    (the job may not come back) and exits 0; ``export-hf`` on the checkpoint gives the same tensors."""
    from framework.launch.export_cli import main as checkpoint_cli
    from framework.record.metrics import read_metrics
    from tests.entry import start_forked

    run = tmp_path / "run"
    overrides = ["train.steps=100000", "train.log_every=1", "train.eval_every=0", "train.seq_len=16"]
    overrides += ["train.global_batch_size=4", "freeze=none", "checkpoint=sync", "checkpoint.export_hf=true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "out.txt"  # stdout and stderr: python train.py, forked (tests/entry.py)
    proc = start_forked(f"hydra.run.dir={run}", *overrides, env=env, log=log)
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").is_file() and sum("loss" in r for r in read_metrics(run)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    [stop] = [r["step"] for r in read_metrics(run) if r.get("event") == "preempted"]
    assert f"exported a Hugging Face checkpoint of step {stop}" in out
    step = run / "checkpoints" / f"step_{stop:06d}"
    assert checkpoint_cli(["export-hf", str(step), str(tmp_path / "cli")]) == 0
    exported, cli = (
        load_file(str(run / "hf" / "model.safetensors")),
        load_file(str(tmp_path / "cli" / "model.safetensors")),
    )
    assert sorted(exported) == sorted(cli) and all(torch.equal(exported[k], cli[k]) for k in cli)
    assert checkpoint_cli(["export-hf", str(step), str(tmp_path / "cli")]) == 0  # its own export again
    # Another model's folder (a real safetensors and config) survives byte for byte; --force replaces it.
    other = tmp_path / "other"
    other.mkdir()
    save_file({"w": torch.arange(6.0)}, str(other / "model.safetensors"))
    (other / "config.json").write_text('{"model_type": "gpt2"}\n')
    before = {f.name: f.read_bytes() for f in other.iterdir()}
    assert checkpoint_cli(["export-hf", str(step), str(other)]) == 2
    assert {f.name: f.read_bytes() for f in other.iterdir()} == before
    assert checkpoint_cli(["export-hf", str(step), str(other), "--force"]) == 0
    assert sorted(load_file(str(other / "model.safetensors"))) == sorted(cli)
    # The exported folders load with AutoTokenizer as they are (the byte tokenizer: ids = bytes).
    from transformers import AutoTokenizer

    for folder in (run / "hf", tmp_path / "cli"):
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok("def é", add_special_tokens=False)["input_ids"] == list("def é".encode())


SFT_TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "data" / "sft_tiny"
# Llama 3.1's RoPE scaling; the source says 4096 positions, far beyond the runs' seq_len.
SOURCE_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
SOURCE_ROPE |= {"original_max_position_embeddings": 1024, "rope_theta": 500000.0}


def make_hf_folder(out: Path, vocab_size: int = 384, seed: int = 0) -> Path:
    """A tiny random Llama and its tokenizer, both written by transformers' save_pretrained into one
    folder, as a model downloaded from the Hub is: the chat template in chat_template.jinja, pad and
    unk tokens, a context of 4096 positions and Llama 3.1's RoPE scaling."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(SFT_TOKENIZER)
    tok.add_special_tokens({"pad_token": "<|pad|>", "unk_token": "<|unk|>"})
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=4096,
        rope_parameters=SOURCE_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id < vocab_size else None,  # a bad folder's: none
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


CONFIG_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
    "max_position_embeddings", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip
TOKENIZER_FIELDS = (
    "bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id",
    "unk_token_id", "chat_template", "vocab_size",
)  # fmt: skip


def test_export_of_a_fine_tuned_hf_model_carries_its_context_rope_and_special_tokens(tmp_path: Path) -> None:
    """A run started from an HF folder (model.init_from, its tokenizer), exported: config.json and the
    tokenizer equal the source's field by field under AutoConfig / AutoTokenizer. The export wrote the
    training seq_len as max_position_embeddings (32 here, where the source says 4096), dropped pad and
    unk, and had no chat template."""
    from transformers import AutoConfig, AutoTokenizer

    from framework.launch.export_run import export_checkpoint
    from tests.entry import train_forked

    src = make_hf_folder(tmp_path / "src")
    run = tmp_path / "run"
    proc = train_forked(
        f"hydra.run.dir={run}", f"model.init_from={src}", "tokenizer=hf", f"tokenizer.path={src}",
        "data=synthetic", "train.steps=2", "train.seq_len=32", "train.global_batch_size=2",
        "train.eval_every=0", "checkpoint=sync", "freeze=none", "logger.plot=false",
        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = export_checkpoint(run, tmp_path / "hf")
    theirs, ours = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(out)
    for field in CONFIG_FIELDS:
        assert getattr(ours, field) == getattr(theirs, field), (field, getattr(ours, field))
    assert ours.max_position_embeddings == 4096 and ours.rope_parameters["rope_type"] == "llama3"
    theirs, ours = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(out)
    for field in TOKENIZER_FIELDS:
        assert getattr(ours, field) == getattr(theirs, field) is not None, (field, getattr(ours, field))
    msgs = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(msgs)
    # The run logs and plans the model it loaded, by its folder's name, not the recipe's default.
    assert "name: src" in (run / "config.yaml").read_text()


@pytest.fixture(scope="module")
def saved_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real two-step ``train.py`` run that saved a checkpoint: its step dir."""
    from framework.checkpoint import store
    from tests.entry import train_forked

    run = tmp_path_factory.mktemp("exported") / "run"
    overrides = ["checkpoint=sync", "train.steps=2", "train.eval_every=0", "train.seq_len=16"]
    overrides += ["train.global_batch_size=4", "freeze=none", "logger.plot=false"]
    proc = train_forked(
        f"hydra.run.dir={run}", *overrides, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return store.committed(run / "checkpoints")[-1][1]


def _unwritable_folder(tmp: Path) -> Path | None:
    locked = tmp / "ro"
    locked.mkdir(mode=0o555)
    for folder in (locked, Path("/proc/sys")):  # root ignores permission bits; /proc/sys it cannot fill
        if not os.access(folder, os.W_OK):
            return folder
    return None


@pytest.mark.parametrize(
    "case", ["a file", "under a file", "a read-only folder", "in a read-only folder", "in /proc"]
)
def test_export_cli_refuses_an_out_it_cannot_write_in_one_line(
    saved_step: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """OUT an existing file, under a file, or a folder this user cannot write: exit 2, one line
    naming OUT and what is valid, the file untouched and nothing written (a read-only folder was a
    PermissionError traceback after the checkpoint was read)."""
    from framework.launch.export_cli import main

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    if case in ("a read-only folder", "in a read-only folder"):
        folder = _unwritable_folder(tmp_path)
        if folder is None:
            pytest.skip("no unwritable folder on this machine")
        out = folder if case == "a read-only folder" else folder / "hf"
        message = "is not writable by this user; valid: a folder you can create and write"
        args = ["--force"] if case == "a read-only folder" else []  # past the "did not write" refusal
    else:
        out, message = {
            "a file": (notes, "is a file; valid: a folder to write"),
            "under a file": (notes / "hf", f"cannot be created: '{notes}' is a file"),
            "in /proc": (Path("/proc/x"), "cannot be written: nothing can be created in '/proc' ("),
        }[case]
        args = []
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["export-hf", str(saved_step), str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: OUT='{out}'") and message in err[0], err
    assert notes.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == before
    assert not (out / "model.safetensors").exists()


def test_an_export_removes_what_an_earlier_export_wrote_and_it_does_not(tmp_path: Path) -> None:
    """A merged export over an earlier ``--adapter`` export left adapter_config.json beside the
    merged weights (transformers then applies the adapter twice), and the other way round. Only the
    files an export wrote go: the user's own file, and a file named with a path by a tampered marker, stay."""
    from framework.checkpoint.export_hf import EXPORT_MARKER
    from framework.checkpoint.export_lora import export_adapter
    from framework.config.schema import PeftConfig, PeftMethod

    state = _model(GQA).state_dict()
    wq = state["layers.0.attention.wq.weight"]
    state["layers.0.attention.wq.lora_A.weight"] = torch.ones(4, wq.shape[1])
    state["layers.0.attention.wq.lora_B.weight"] = torch.ones(wq.shape[0], 4)
    peft = PeftConfig(method=PeftMethod.lora, rank=4, alpha=8.0, targets=["wq"])
    out = tmp_path / "hf"
    export_adapter(state, GQA, peft, out, None)
    (out / "README.md").write_text("mine")
    adapter = {"adapter_config.json", "adapter_model.safetensors"}
    merged = {"model.safetensors", "config.json", "generation_config.json"}
    assert adapter <= {p.name for p in out.iterdir()}
    base = {k: v for k, v in state.items() if "lora_" not in k}
    export_hf(base, GQA, out, max_position_embeddings=16)
    assert {p.name for p in out.iterdir()} == merged | {EXPORT_MARKER, "README.md"}
    assert json.loads((out / EXPORT_MARKER).read_text())["files"] == sorted(merged)
    export_adapter(state, GQA, peft, out, None)
    assert {p.name for p in out.iterdir()} == adapter | {EXPORT_MARKER, "README.md"}
    (tmp_path / "outside.txt").write_text("mine")
    tampered = {"written_by": "x", "files": ["../outside.txt", str(tmp_path / "outside.txt"), "sub/x"]}
    (out / EXPORT_MARKER).write_text(json.dumps(tampered))
    export_hf(base, GQA, out, max_position_embeddings=16)
    assert (tmp_path / "outside.txt").read_text() == "mine" and (out / "README.md").read_text() == "mine"


def test_a_marker_without_a_file_list_names_the_files_its_kind_writes(tmp_path: Path) -> None:
    """Exports made before the marker listed its files: the adapter files of an ``--adapter`` one."""
    from framework.checkpoint.export_hf import EXPORT_MARKER, earlier_export_files

    marker = {"written_by": "framework.checkpoint export-hf --adapter", "architecture": ["PEFT LoRA"]}
    (tmp_path / EXPORT_MARKER).write_text(json.dumps(marker))
    assert earlier_export_files(tmp_path) == {"adapter_config.json", "adapter_model.safetensors"}
    for broken in ("[1, 2]", "not json", json.dumps({"files": "model.safetensors"})):
        (tmp_path / EXPORT_MARKER).write_text(broken)
        assert earlier_export_files(tmp_path) == set()
