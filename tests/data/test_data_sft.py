"""data=sft (framework.data.sft): the chat template rendered as transformers renders it, the loss
masked on every prompt token, a token-weighted loss over the global batch, the sampler's invariant
(resume on any number of data-parallel ranks), bad records refused before launch, and one
fine-tuning run through train.py from a Hugging Face folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from framework.config.run_values import batch_shape, data_run
from framework.config.schema import (
    AttentionBackend,
    Config,
    DataConfig,
    DataSource,
    MixEntry,
    ModelConfig,
    TokenizerConfig,
    TokenizerKind,
    TrainConfig,
)
from framework.data import build_data
from framework.data.sft import IGNORE_INDEX, ChatFormat, Fields, read_records
from framework.data.tokenizer import load_tokenizer
from framework.models import build_model, materialize
from tests.corpus import ROOT
from tests.data.test_data_pipeline import check_data, check_document_kernel

SHIPPED = ROOT / "recipes" / "data" / "sft_tiny"
GBS, MBS, SEQ = 8, 2, 64


def records(path: Path = SHIPPED / "train.jsonl") -> list[tuple[str, list[dict]]]:
    return list(read_records([path], Fields()))


def make_cfg(data_path: Path | str, tok_path: Path | str = SHIPPED, **kw: object) -> Config:
    data = DataConfig(source=DataSource.sft, path=str(data_path), val_fraction=0.125)
    for k, v in kw.items():
        setattr(data, k, v)
    return Config(
        model=ModelConfig(vocab_size=384, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64),
        tokenizer=TokenizerConfig(kind=TokenizerKind.hf, path=str(tok_path)),
        data=data,
        train=TrainConfig(seq_len=SEQ, global_batch_size=GBS, micro_batch_size=MBS, eval_every=0),
    )


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped BPE without its tokenizer_config.json: no chat template (the plain format)."""
    out = tmp_path_factory.mktemp("plain") / "tokenizer.json"
    shutil.copy(SHIPPED / "tokenizer.json", out)
    return out


def test_chat_template_gives_transformers_ids_and_trains_only_the_assistant_turns() -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(SHIPPED)
    tok = load_tokenizer(TokenizerConfig(kind=TokenizerKind.hf, path=str(SHIPPED)))
    fmt = ChatFormat(tok, add_bos=False)
    examples = records()
    for (_, msgs), (ids, trained) in zip(examples, fmt.encode_many(examples), strict=True):
        assert ids.tolist() == list(hf.apply_chat_template(msgs, tokenize=True)["input_ids"])
        answers = [m["content"] + "<|end_of_text|>" for m in msgs if m["role"] == "assistant"]
        assert tok.decode(ids[trained]) == "".join(answers)  # every assistant turn, nothing else


def test_plain_format_masks_prompts_and_trains_response_and_eos(plain_tok: Path, tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    rows = [{"question": f"Say {i}.", "answer": f"I say {i}."} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(
        path, plain_tok, prompt_field="question", response_field="answer", val_fraction=0.0, sft_pack=False
    )
    cfg.tokenizer.add_bos = True
    check_data(cfg)
    tok = load_tokenizer(cfg.tokenizer)
    sampler = build_data(data_run(cfg), batch_shape(cfg.train), 0, 1).sampler
    (x, y), *rest = sampler.next_batch()
    sampler.close()
    assert x[0, 0] == tok.bos_id
    trained = y[0] != IGNORE_INDEX
    assert tok.decode(y[0][trained]) == "I say 0.<|end_of_text|>"
    assert tok.decode(x[0][: int(trained.nonzero()[0]) + 1]) == "<|begin_of_text|>Say 0.\n"  # the prompt
    # the padding after the example: EOS inputs whose targets are masked
    last = int(trained.nonzero()[-1])
    assert (y[0, last + 1 :] == IGNORE_INDEX).all() and (x[0, last + 2 :] == tok.eos_id).all()


def test_masked_targets_give_no_gradient_and_the_loss_is_token_weighted() -> None:
    """The loss over a step is the mean over every trained target of the global batch, whatever the
    micro-batch split or the number of ranks; a masked target's logits get exactly zero gradient."""
    cfg = make_cfg(SHIPPED / "train.jsonl", sft_pack=False)
    model = build_model(cfg.model, SEQ)
    materialize(model, "cpu", seed=0)
    whole = build_data(data_run(cfg), batch_shape(cfg.train), 0, 1).sampler
    batch = whole.next_batch()
    x, y = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])
    logits = model(x).detach().requires_grad_(True)
    per_token = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    trained = y.flatten() != IGNORE_INDEX
    assert 0 < int(trained.sum()) < trained.numel()
    manual = per_token[trained].sum() / trained.sum()  # by hand: only the trained targets
    manual.backward()
    grad = logits.grad.flatten(0, 1)
    assert torch.all(grad[~trained] == 0) and torch.all(grad[trained].abs().sum(-1) > 0)
    with torch.no_grad():
        for dp in (1, 2):  # the step's loss: sum of scale * micro-batch loss, averaged over ranks
            total = 0.0
            for r in range(dp):
                s = build_data(data_run(cfg), batch_shape(cfg.train), r, dp).sampler
                mbs = s.next_batch()
                total += sum(k * float(model(a, b)) for k, (a, b) in zip(s.loss_scales(), mbs, strict=True))
                s.close()
            assert abs(total / dp - float(manual)) < 1e-5, dp
    whole.close()


def test_packed_rows_give_the_unpacked_loss_with_each_example_kept_to_itself() -> None:
    """data.sft_pack: whole examples back to back in a row, each one's first token flagged as a
    document start. The model (document masking, RoPE restarting per example) gives the same
    token-weighted loss as one example per row, over the same examples, and trains the same targets."""
    from framework.data.sft import SFTWindows, split_rows
    from framework.models.parts.masks import DOC_START, NO_EOS, document_ids

    cfg = make_cfg(SHIPPED / "train.jsonl")
    tok = load_tokenizer(cfg.tokenizer)
    fmt, window = ChatFormat(tok, add_bos=False), SEQ + 1
    packed_src = SFTWindows([SHIPPED / "train.jsonl"], Fields(), fmt, window, lambda i: True, pack=True)
    rows = torch.from_numpy(packed_src.take(4))
    n = packed_src.state()["record"]  # the examples placed in these 4 rows
    single = SFTWindows([SHIPPED / "train.jsonl"], Fields(), fmt, window, lambda i: True, pack=False)
    singles = torch.from_numpy(single.take(n))
    assert n > rows.shape[0]  # several examples per row
    px, py = split_rows(rows)
    sx, sy = split_rows(singles)
    # The same trained targets in the same order, none of them carrying the flag.
    assert torch.equal(py[py != IGNORE_INDEX], sy[sy != IGNORE_INDEX])
    # One start flag per example, plus one per row whose tail is padding.
    flags = int((torch.where(rows < 0, ~rows, rows) >= DOC_START).sum())
    assert n <= flags <= n + rows.shape[0]
    assert all(int(d.max() - d.min()) >= 1 for d in document_ids(px, NO_EOS))  # >= 2 documents a row
    cfg.model.init_std = 0.2  # weights large enough that a token's logits depend on its context
    packed_model, plain_model = build_model(cfg.model, SEQ, NO_EOS), build_model(cfg.model, SEQ)
    materialize(packed_model, "cpu", seed=0)
    materialize(plain_model, "cpu", seed=0)
    count = int((sy != IGNORE_INDEX).sum())
    with torch.no_grad():
        packed = F.cross_entropy(packed_model(px).flatten(0, 1), py.flatten(), reduction="sum") / count
        alone = F.cross_entropy(plain_model(sx).flatten(0, 1), sy.flatten(), reduction="sum") / count
        unmasked = plain_model(torch.bitwise_and(px, DOC_START - 1))  # attention crossing examples
        crossing = F.cross_entropy(unmasked.flatten(0, 1), py.flatten(), reduction="sum") / count
    assert abs(float(packed) - float(alone)) < 1e-5
    assert abs(float(crossing) - float(alone)) > 1e-3  # so the check above can fail


@pytest.mark.parametrize("pack", [False, True], ids=["one_per_row", "packed"])
def test_resume_on_another_dp_degree_skips_and_repeats_nothing(pack: bool) -> None:
    from tests.data.test_data_stream import global_rows

    cfg = make_cfg(SHIPPED / "train.jsonl", sft_pack=pack)
    whole, _ = global_rows(cfg, 1, None, 8)  # 42 train examples: 8 batches of 8 wrap into a 2nd epoch
    first, state = global_rows(cfg, 1, None, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, whole[:3], strict=True))
    for dp in (2, 4):
        resumed, _ = global_rows(cfg, dp, state, 5)
        assert all(torch.equal(a, b) for a, b in zip(resumed, whole[3:], strict=True)), dp
    if not pack:
        rows = torch.cat(whole[:5])  # the first pass: 40 distinct examples
        assert len({tuple(r.tolist()) for r in rows}) == rows.shape[0]
    # the validation conversations (every 8th) never reach training
    ev = dataclass_replace_eval(cfg)
    val = build_data(data_run(ev), batch_shape(ev.train), 0, 1).val_batches
    train_rows = {tuple(r.tolist()) for r in torch.cat(whole)}
    for vx, vy in val:
        for r in torch.cat([vx, vy[:, -1:]], 1):
            assert tuple(r.tolist()) not in train_rows


def dataclass_replace_eval(cfg: Config) -> Config:
    cfg.train.eval_every, cfg.train.eval_batches = 10, 1
    return cfg


@pytest.mark.parametrize(
    "line, fragment",
    [
        ({"text": "x"}, "no 'messages' and no 'prompt'/'response'"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'; valid roles"),
        ({"messages": [{"role": "user", "content": 3}]}, "content of type int, not a string"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"prompt": "word " * 200, "response": "ok"}, "no response token fits in train.seq_len=64"),
    ],
)
def test_bad_records_are_refused_before_launch(tmp_path: Path, line: dict, fragment: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: ") as e:
        check_data(make_cfg(path, val_fraction=0.0))
    assert fragment in str(e.value)


def test_sft_needs_an_eos_no_document_mask_and_no_mix(tmp_path: Path) -> None:
    cfg = make_cfg(SHIPPED / "train.jsonl")
    cfg.tokenizer, cfg.model.vocab_size = TokenizerConfig(), 256
    with pytest.raises(ValueError, match="data=sft needs an EOS token"):
        check_data(cfg)
    cfg = make_cfg(SHIPPED / "train.jsonl", document_mask=True)
    with pytest.raises(ValueError, match="data.document_mask=true with data=sft"):
        check_data(cfg)
    # Packed rows mask each example: the flash kernels take that through their variable-length
    # form, on CUDA (tests/data/test_data_pipeline.py: check_document_kernel).
    for backend in (AttentionBackend.flash, AttentionBackend.fa4):
        cfg = make_cfg(SHIPPED / "train.jsonl")
        cfg.model.attention = backend
        check_data(cfg)
        with pytest.raises(ValueError, match=f"data.sft_pack=true with model.attention={backend.value} on cpu"):
            check_document_kernel(cfg, "cpu")
    cfg = make_cfg(SHIPPED / "train.jsonl")
    cfg.data.path, cfg.data.mix = None, [MixEntry(source=DataSource.sft, path=str(SHIPPED / "train.jsonl"))]
    with pytest.raises(ValueError, match=r"data.mix\[0\].source=sft"):
        check_data(cfg)


def test_train_py_refuses_a_bad_record_with_exit_2_and_no_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.data.test_data_pipeline import train_main

    monkeypatch.chdir(ROOT)  # bad.jsonl is absolute; the recipe's own paths are relative to its folder
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(SystemExit) as e:
        train_main(tmp_path / "run", "recipe=sft_tiny", f"data.path={bad}", "train.eval_every=0")
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bad.jsonl:1: message 0 has role 'bot'" in errors[0], errors
    assert not (tmp_path / "run").exists()


def test_fine_tune_a_hugging_face_llama_with_the_tiny_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """recipe=sft_tiny from a random HF Llama (transformers) with a BPE tokenizer trained by
    `framework.data tokenizer train` and a chat template: the loss falls, and the run's batches
    train only on the assistant turns."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from framework.launch.data_cli import main as data_main
    from framework.record.metrics import read_metrics
    from tests.data.test_data_pipeline import train_main

    hf = tmp_path / "hf"
    torch.manual_seed(0)
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    LlamaForCausalLM(
        LlamaConfig(**shape, num_key_value_heads=2, vocab_size=320, max_position_embeddings=128)
    ).save_pretrained(hf)
    text = tmp_path / "text.txt"  # the tokenizer's training text: the conversations' contents
    text.write_text("\n".join(f"<|{m['role']}|>\n{m['content']}" for _, msgs in records() for m in msgs))
    assert (
        data_main(["tokenizer", "train", str(hf / "tokenizer.json"), str(text), "--vocab-size", "320"]) == 0
    )
    shutil.copy(SHIPPED / "tokenizer_config.json", hf / "tokenizer_config.json")  # the chat template

    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    overrides = [
        "recipe=sft_tiny", f"model.init_from={hf}", f"tokenizer.path={hf}", "train.steps=12",
        "train.warmup_steps=2", "train.log_every=1", "train.eval_every=12", "train.eval_batches=1",
        "freeze=none", "logger.plot=false", "logger.progress_bar=false",
    ]  # fmt: skip
    train_main(run, *overrides)
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r and "step" in r]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses

    # The same data's first batch, in process, one example per row (the first row is the first
    # conversation): its targets are the assistant turns and their EOS.
    cfg = make_cfg(SHIPPED / "train.jsonl", hf, sft_pack=False)
    cfg.model.vocab_size = 320
    tok = load_tokenizer(cfg.tokenizer)
    (x, y), *_ = build_data(data_run(cfg), batch_shape(cfg.train), 0, 1).sampler.next_batch()
    trained = y[0] != IGNORE_INDEX
    _, msgs = records()[0]
    answers = "".join(m["content"] + "<|end_of_text|>" for m in msgs if m["role"] == "assistant")
    assert tok.decode(y[0][trained]) == answers
    assert tok.decode(x[0][: int(trained.nonzero()[0]) + 1]).endswith("<|assistant|>\n")


ECHO = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
UNBOUNDED_TEMPLATES = [
    ("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}", "template lines"),
    ("{{ (10 ** 100000) ** 100000 }}", "10 ** 100000 is above 4096 bits"),
    ("{{ 'x' * 100000 * 100000 }}", "is above 1048576 items"),
    ("{% for a in range(9999) %}{{ 'y' * 99999 }}{% endfor %}", "more than 4194304 characters"),
]


@pytest.mark.parametrize("template, fragment", UNBOUNDED_TEMPLATES, ids=[t[1] for t in UNBOUNDED_TEMPLATES])
def test_an_unbounded_chat_template_is_refused_before_launch(
    tmp_path: Path, template: str, fragment: str
) -> None:
    """Nested loops and huge arithmetic in a shared tokenizer folder's template hung the launcher:
    rendering has a line, time and output budget, and * / ** / + are bounded before they compute."""
    tok = tmp_path / "tok"
    shutil.copytree(SHIPPED, tok)
    conf = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": template + ECHO}))
    with pytest.raises(ValueError) as info:
        check_data(make_cfg(SHIPPED / "train.jsonl", tok))
    msg = str(info.value)
    assert "\n" not in msg and "train.jsonl:1: the chat template is refused" in msg and fragment in msg, msg
    # The same template without the unbounded part renders (the budget does not refuse real work).
    (tok / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": ECHO}))
    check_data(make_cfg(SHIPPED / "train.jsonl", tok, sft_pack=False))


def test_an_sft_file_edited_mid_run_stops_it_in_one_line_keeping_the_checkpoints(tmp_path: Path) -> None:
    """recipe=sft_tiny on a copy of its conversations, cut mid-line during the run: one line naming
    the file (not the parser's traceback on the broken line), checkpoints kept, no LOCK."""
    from tests.data.test_data import run_and_change

    data = tmp_path / "train.jsonl"
    shutil.copy(SHIPPED / "train.jsonl", data)

    def cut(f: Path) -> None:
        f.write_bytes(f.read_bytes()[:3000] + b'{"messages": [')

    run_and_change(tmp_path, data, cut, "recipe=sft_tiny", "logger.plot=false")


def _save_pretrained_tokenizer(out: Path, template: str | None = None) -> Path:
    """The shipped tokenizer as transformers 5's save_pretrained writes it: its chat template in
    chat_template.jinja, none in tokenizer_config.json."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(SHIPPED)
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(out)
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    return out


# transformers' {% generation %} marks the assistant's text (return_assistant_tokens_mask); it renders its body.
GENERATION_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}{% else %}{{ m['content'] + '\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", [None, GENERATION_TEMPLATE], ids=["shipped", "generation_block"])
def test_a_save_pretrained_folder_uses_its_chat_template_jinja(tmp_path: Path, template: str | None) -> None:
    """The template in chat_template.jinja was ignored (the plain format, announced by one INFO
    line): now every example's ids are apply_chat_template's, and only assistant turns are trained."""
    from transformers import AutoTokenizer

    folder = _save_pretrained_tokenizer(tmp_path / "tok", template)
    hf = AutoTokenizer.from_pretrained(folder)
    fmt = ChatFormat(load_tokenizer(TokenizerConfig(kind=TokenizerKind.hf, path=str(folder))), add_bos=False)
    assert fmt.description == "the tokenizer's chat template"
    examples = records()
    for (_, msgs), (ids, trained) in zip(examples, fmt.encode_many(examples), strict=True):
        assert ids.tolist() == list(hf.apply_chat_template(msgs, tokenize=True)["input_ids"])
        answers = [m["content"] + "<|end_of_text|>" for m in msgs if m["role"] == "assistant"]
        assert fmt.tok.decode(ids[trained]) == "".join(answers)


def test_train_py_refuses_a_chat_template_it_cannot_render_with_exit_2_and_no_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template the framework cannot parse (here: a tag transformers does not know either) is one
    line naming the folder, before launch, instead of training on the plain format."""
    from tests.data.test_data_pipeline import train_main

    folder = _save_pretrained_tokenizer(tmp_path / "tok", "{% tool_call %}{{ messages }}")
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        train_main(tmp_path / "run", "recipe=sft_tiny", f"tokenizer.path={folder}", "train.eval_every=0")
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1 and f"the chat template of {folder / 'tokenizer.json'} does not parse" in errors[0]
    )
    assert not (tmp_path / "run").exists()
