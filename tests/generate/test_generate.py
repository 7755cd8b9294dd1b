"""Decoding with a KV cache against re-running the full forward; the CLI on a real checkpoint."""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from framework.config.schema import ModelFamily, to_config
from framework.generate.decode import generate, load_model
from framework.launch.generate import main
from framework.models import FAMILIES, KVCache, build_model, forward_cached
from tests.entry import train_forked


def tiny_model(n_kv_heads: int = 2, family: ModelFamily = ModelFamily.llama) -> torch.nn.Module:
    """The family's tiny shape (its record's), at a vocabulary of 97 and ``n_kv_heads``."""
    cfg = dataclasses.replace(FAMILIES[family].tiny_config(), n_kv_heads=n_kv_heads, vocab_size=97)
    model = build_model(cfg, max_seq_len=32)
    model.to_empty(device="cpu")
    model.output.weight = model.tok_embeddings.weight
    model.init_weights(seed=3)
    return model.eval()


def test_cached_logits_equal_the_full_forward_at_every_step() -> None:
    # GQA for every family of the registry (its tiny shape: Qwen3's q/k norms and heads wider than
    # dim / n_heads, Mistral's window of 8 < 20 tokens, the sparse families' experts); MHA once.
    for n_kv, family in ((4, ModelFamily.llama), *((2, f) for f in FAMILIES)):
        model = tiny_model(n_kv, family)
        tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
        cache = KVCache.empty(model, 1, 20)
        cached = [forward_cached(model, tokens[:, :8], cache)]  # prefill 8, then one at a time
        cached += [forward_cached(model, tokens[:, i : i + 1], cache) for i in range(8, 20)]
        with torch.no_grad():
            full = model(tokens)
        for step, logits in zip(range(7, 20), cached, strict=True):
            torch.testing.assert_close(logits, full[:, step], rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_argmax_of_the_full_forward() -> None:
    model = tiny_model()
    prompt = [5, 17, 42, 8]
    ids = generate(model, prompt, max_new_tokens=12)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert ids == seq[len(prompt) :]


def test_sampling_is_seeded_and_stays_in_the_top_k() -> None:
    model = tiny_model()
    a = generate(model, [1, 2, 3], 10, temperature=1.0, top_k=5, seed=7)
    assert a == generate(model, [1, 2, 3], 10, temperature=1.0, top_k=5, seed=7)
    assert generate(model, [1, 2, 3], 10, temperature=1.0, top_k=1) == generate(model, [1, 2, 3], 10)
    seq = [1, 2, 3]
    with torch.no_grad():
        for tok in a:
            top = model(torch.tensor([seq]))[0, -1].topk(5).indices.tolist()
            assert tok in top
            seq.append(tok)
    assert generate(model, [1], 10, eos_id=generate(model, [1], 1)[0]) == generate(model, [1], 1)


def test_cli_samples_from_a_trained_run(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = train_forked(
        f"hydra.run.dir={run}",
        "checkpoint=sync",
        "train.steps=8",
        "train.eval_every=0",
        "train.log_every=4",
        "train.seq_len=64",
        "freeze=none",
        "logger.plot=false",
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main([str(run), "--prompt", "def ", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def ") and len(out.out.encode()) > len("def ") + 10
    assert "step_000008" in out.err
    step_dir = next((run / "checkpoints").glob("step_*"))
    assert main([str(step_dir), "--prompt", "def ", "--max-new-tokens", "24"]) == 0
    assert capsys.readouterr().out == out.out  # the same checkpoint, greedy: the same text
    # No --prompt: one prompt per line of stdin, the model loaded once, until an empty line.
    monkeypatch.setattr("sys.stdin", io.StringIO("def \nclass \n\nnever read\n"))
    assert main([str(run), "--max-new-tokens", "24"]) == 0
    loop = capsys.readouterr()
    assert loop.out.startswith(out.out) and loop.out[len(out.out) :].startswith("class ")
    assert "never read" not in loop.out
    assert loop.err.count("step_000008") == 1
    # load_model's full forward (its RoPE tables refilled after to_empty) equals the cached decoder.
    cfg = to_config(OmegaConf.load(run / "config.yaml"))
    model = load_model(step_dir, cfg, torch.device("cpu"))
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
    cached = forward_cached(model, tokens, KVCache.empty(model, 1, 12))
    torch.testing.assert_close(cached, full[:, -1], rtol=1e-5, atol=1e-5)
    assert main([str(tmp_path), "--prompt", "x"]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert main([str(run), "--prompt", "x", "--top-k", "-1"]) == 2
    capsys.readouterr()
    # above the vocabulary: was every token silently (as 0 is)
    assert main([str(run), "--prompt", "x", "--top-k", "1000"]) == 2
    assert (
        capsys.readouterr().err
        == "error: --top-k=1000 is more than the model's 256 tokens; valid: 0..256 (0 = all tokens)\n"
    )


BAD_FLAGS = [
    (["--temperature", "nan"], "--temperature=nan is not valid"),
    (["--temperature", "inf"], "--temperature=inf is not valid"),
    (["--max-new-tokens", "1000000000"], "--max-new-tokens=1000000000 is not valid; valid: 1..131072"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0 is not valid"),
    (["--top-k", "-1"], "--top-k=-1 is not valid"),
    (["--device", "cuda:99"], "--device=cuda:99 but this"),
    (["--device", "bogus"], "--device='bogus' is not a torch device"),
    (["--config", "pyproject.toml"], "--config=pyproject.toml is not a run's config.yaml"),
    (["--config", "{tmp}/other.yaml"], "other.yaml is not a run's config.yaml (the schema refuses its key 'a'"),
    (["--config", "{tmp}/passwd"], "passwd is not a run's config.yaml (the schema refuses its key 'root:x:0:0"),
    (["--config", "{tmp}/list.yaml"], "list.yaml is not a run's config.yaml (a YAML list, not a mapping)"),
    (["--config", "{tmp}/broken.yaml"], "broken.yaml is not a run's config.yaml (not YAML (line 2))"),
    (["--config", "{tmp}"], "is a folder; valid: a run's config.yaml"),
    (["--config", "{tmp}/fifo"], "fifo is not a regular file (a FIFO, a socket or a device); valid: a run's"),
    (["--config", "{tmp}/none.yaml"], "none.yaml does not exist; valid: a run's config.yaml"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[" ".join(f[0]) for f in BAD_FLAGS])
def test_bad_flags_are_one_line_and_exit_2(tmp_path: Path, capsys, flags: list[str], message: str) -> None:
    """Checked before any checkpoint is read: a nan temperature sampled garbage, 1e9 new tokens
    allocated a billion-position KV cache, --device cuda on CPU torch and a non-config --config were
    tracebacks."""
    (tmp_path / "other.yaml").write_text("a: 1\n")
    # /etc/passwd's shape: YAML reads it as one key, which the error quoted whole (1300 characters).
    (tmp_path / "passwd").write_text("".join(f"root:x:0:0:user{i}:/home/u{i}:/bin/sh\n" for i in range(40)))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "broken.yaml").write_text("a: [1\n")
    os.mkfifo(tmp_path / "fifo")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    if flags == ["--device", "cuda:99"] and torch.cuda.device_count() > 99:
        pytest.skip("a host with 100 GPUs")
    assert main([str(tmp_path), "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert len(err[0]) < 300 and "user39" not in err[0], err  # never the file's content


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.checkpoint.test_checkpoint_export_hf import make_hf_folder

    return make_hf_folder(tmp_path_factory.mktemp("hf") / "tiny_llama", seed=1)


def transformers_greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (its generation_config's EOS stops it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[str]]:
    from framework.launch.generate import main as generate_main

    code = generate_main([*argv, "--device", "cpu"])
    out = capsys.readouterr()
    return code, out.out, [line for line in out.err.splitlines() if line.startswith("error:")]


def test_an_hf_folder_generates_transformers_greedy_tokens_plain_and_chat(
    hf_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate HF_DIR` (it said "no config.yaml"): greedy text equals transformers' generate token
    for token; with --chat the prompt is apply_chat_template's (add_generation_prompt) and the reply
    alone is printed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    code, out, err = cli([str(hf_dir), "--prompt", "Say hello", "--max-new-tokens", "12"], capsys)
    assert code == 0, err
    theirs = transformers_greedy(hf_dir, tok.encode("Say hello", add_special_tokens=False), 12)
    assert out == "Say hello" + tok.decode(theirs) + "\n"
    code, out, err = cli([str(hf_dir), "--prompt", "Say hello", "--chat", "--max-new-tokens", "12"], capsys)
    assert code == 0, err
    msgs = [{"role": "user", "content": "Say hello"}]
    chat_ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert chat_ids[0] == tok.bos_token_id and tok.decode(chat_ids).endswith("<|assistant|>\n")
    assert out == tok.decode(transformers_greedy(hf_dir, chat_ids, 12)) + "\n"


def test_generation_stops_at_eos_without_printing_it(
    tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """generation_config.json's eos_token_id (a list, as Llama 3's) is where a reply ends; the EOS
    text was printed. The folder's EOS here is the token greedy decoding emits third."""
    import json
    import shutil

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    free = transformers_greedy(hf_dir, tok.encode("Say hello", add_special_tokens=False), 12)
    stop = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 2)  # its first occurrence
    folder = tmp_path / "eos"
    shutil.copytree(hf_dir, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(
        json.dumps({**gen, "eos_token_id": [tok.eos_token_id, free[stop]]})
    )
    code, out, err = cli([str(folder), "--prompt", "Say hello", "--max-new-tokens", "12"], capsys)
    assert code == 0, err
    assert out == "Say hello" + tok.decode(free[:stop]) + "\n"
    assert (
        transformers_greedy(folder, tok.encode("Say hello", add_special_tokens=False), 12) == free[: stop + 1]
    )


def test_bad_hf_folders_are_one_line_and_exit_2(
    tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tokenizer with ids past the model's embedding; --chat with a tokenizer that has no template."""
    import shutil

    from tests.checkpoint.test_checkpoint_export_hf import make_hf_folder

    small = make_hf_folder(tmp_path / "small_vocab", vocab_size=300)
    code, out, err = cli([str(small), "--prompt", "x"], capsys)
    assert code == 2 and out == "" and len(err) == 1, err
    assert "its tokenizer has 374 tokens but its config.json has vocab_size=300" in err[0]
    plain = tmp_path / "plain"
    shutil.copytree(hf_dir, plain)
    (plain / "chat_template.jinja").unlink()
    code, out, err = cli([str(plain), "--prompt", "x", "--chat"], capsys)
    assert code == 2 and out == "" and len(err) == 1 and "has no chat template" in err[0], err


VALID_PATHS = "a run dir (its newest checkpoint), a checkpoint dir or a Hugging Face folder"


@pytest.mark.parametrize("command", ["generate", "evaluate"])
def test_a_path_that_is_missing_or_a_file_says_so(tmp_path: Path, capsys, command: str) -> None:
    """Both were "no config.yaml in PATH or the three folders above it", which sent the user
    looking for a config."""
    from framework.launch.evaluate import main as evaluate

    run = main if command == "generate" else evaluate
    extra = ["--prompt", "x"] if command == "generate" else []
    (tmp_path / "notes.txt").write_text("x")
    for path, what in ((tmp_path / "none", "does not exist"), (tmp_path / "notes.txt", "is not a folder")):
        assert run([str(path), *extra]) == 2
        err = capsys.readouterr().err
        assert (
            err
            == f"error: PATH={str(path)!r} {what}; valid: {VALID_PATHS}\n"
        )


EVALUATE_FLAGS = [
    (["--device", "bogus"], "--device='bogus' is not a torch device; valid: cpu or cuda[:N]"),
    (["--batches", "0"], "--batches=0 is not valid; valid: 1 or more"),
]


@pytest.mark.parametrize("flags, message", EVALUATE_FLAGS, ids=[" ".join(f[0]) for f in EVALUATE_FLAGS])
def test_evaluate_bad_flags_are_one_line_and_exit_2(
    tmp_path: Path, capsys, flags: list[str], message: str
) -> None:
    """``python -m framework evaluate``: each was a traceback (``--device cuda`` on CPU torch too),
    a hang, or 1e8 batches built in memory; checked before any checkpoint is read."""
    from framework.config.schema import Config, to_yaml
    from framework.launch.evaluate import main as evaluate

    (tmp_path / "config.yaml").write_text(to_yaml(Config()))  # seq_len 128 x batch 32: 4128 tokens a batch
    (tmp_path / "other.yaml").write_text("a: 1\n")
    # /etc/passwd's shape: YAML reads it as one key, which the error quoted whole (1300 characters).
    (tmp_path / "passwd").write_text("".join(f"root:x:0:0:user{i}:/home/u{i}:/bin/sh\n" for i in range(40)))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "broken.yaml").write_text("a: [1\n")
    os.mkfifo(tmp_path / "fifo")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    assert evaluate([str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
