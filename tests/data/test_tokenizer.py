"""Tokenizers against the real libraries: tokenizers, sentencepiece, and transformers' AutoTokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from framework.config.schema import TokenizerConfig, TokenizerKind
from framework.data.tokenizer import ByteTokenizer, check_vocab, load_tokenizer
from tests.corpus import Corpus, documents, write_corpus

TEXT = "def héllo(wörld):\n    return 'ünïcode' + \"\\t\"  # ✓ 🙂\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("sp")
    (root / "train.txt").write_text("\n".join(documents(40)))
    spm.SentencePieceTrainer.train(
        input=str(root / "train.txt"), model_prefix=str(root / "sp"), vocab_size=400,
        model_type="bpe", num_threads=1, minloglevel=2,
    )  # fmt: skip
    return root / "sp.model"


def hf(path: Path | str, **kw: str) -> object:
    return load_tokenizer(TokenizerConfig(kind=TokenizerKind.hf, path=str(path), **kw))


def test_bytes_save_loads_in_autotokenizer_with_ids_equal_to_byte_values(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    names = ByteTokenizer().save(tmp_path)
    assert set(names) <= {p.name for p in tmp_path.iterdir()} and "tokenizer.json" in names
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert auto.encode(TEXT, add_special_tokens=False) == list(TEXT.encode("utf-8"))
    assert auto.decode(list(TEXT.encode("utf-8"))) == TEXT


def test_trained_bpe_round_trips_and_saves_for_autotokenizer(corpus: Corpus, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = hf(corpus.bpe)
    assert tok.vocab_size == 512 and (tok.bos_id, tok.eos_id) == (0, 1)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and len(ids) < len(TEXT.encode())  # real merges
    assert tok.bos_id not in ids and tok.eos_id not in ids  # encode adds no special tokens
    tok.save(tmp_path / "out")
    auto = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert auto.encode(TEXT, add_special_tokens=False) == ids
    assert (auto.bos_token, auto.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    # ... and what transformers' save_pretrained writes loads back as the same vocabulary.
    auto.save_pretrained(tmp_path / "tf")
    again = hf(tmp_path / "tf")
    assert again.digest() == tok.digest() and again.encode(TEXT) == ids and again.eos_id == 1


def test_llama3_style_tokenizer_json_bos_eos_from_its_config(corpus: Corpus, tmp_path: Path) -> None:
    """Llama-3's layout: special tokens added past the base vocabulary, a post-processor that adds
    BOS, and tokenizer_config.json naming BOS/EOS (here the instruct model's <|eot_id|>)."""
    from tokenizers import Tokenizer, processors

    base = Tokenizer.from_file(str(corpus.bpe))
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|eot_id|>"]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(4)]
    base.add_special_tokens(specials)
    base.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", base.token_to_id("<|begin_of_text|>"))],
    )
    base.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}})
    )
    tok = hf(tmp_path)
    assert tok.eos_id == base.token_to_id("<|eot_id|>") and tok.bos_id == 0
    assert tok.vocab_size == base.get_vocab_size(with_added_tokens=True)
    assert tok.encode(TEXT)[0] != tok.bos_id  # the post-processor's BOS is not added implicitly
    # An explicit eos_token wins over the file's config.
    assert hf(tmp_path, eos_token="<|end_of_text|>").eos_id == 1


def test_sentencepiece_model_and_its_export(sp_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = load_tokenizer(TokenizerConfig(kind=TokenizerKind.sentencepiece, path=str(sp_model)))
    assert tok.vocab_size == 400 and (tok.bos_id, tok.eos_id) == (1, 2)
    text = "def hello(world): return 42"
    assert tok.decode(tok.encode(text)) == text
    assert "tokenizer.model" in tok.save(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert auto.encode(text, add_special_tokens=False) == tok.encode(text)
    assert auto.eos_token_id == tok.eos_id


@pytest.mark.parametrize(
    "kind, content, message",
    [
        ("hf", b'{"version": "1.0", "model": ', "is not a valid tokenizer.json"),
        ("hf", b"", "is an empty file"),
        ("sentencepiece", b"not a model at all", "is not a SentencePiece model"),
        ("hf", None, "does not exist"),
    ],
)
def test_a_tokenizer_file_that_does_not_parse_is_named(
    tmp_path: Path, kind: str, content: bytes | None, message: str
) -> None:
    path = tmp_path / ("tokenizer.json" if kind == "hf" else "tokenizer.model")
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as e:
        load_tokenizer(TokenizerConfig(kind=TokenizerKind(kind), path=str(path)))
    assert str(path) in str(e.value)


def test_folder_without_tokenizer_and_unknown_special_token(corpus: Corpus, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(ValueError, match="use tokenizer=sentencepiece"):
        hf(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_bytes(b"{}")
    with pytest.raises(ValueError, match="a tokenizer.json: use tokenizer=hf"):
        load_tokenizer(TokenizerConfig(kind=TokenizerKind.sentencepiece, path=str(tmp_path / "hf")))
    with pytest.raises(ValueError, match="eos_token='<nope>' is not in the vocabulary"):
        hf(corpus.bpe, eos_token="<nope>")
    with pytest.raises(ValueError, match="tokenizer=bytes has no file"):
        load_tokenizer(TokenizerConfig(kind=TokenizerKind.bytes, path="x.json"))


def test_vocab_larger_than_the_model_is_refused_smaller_warns(
    corpus: Corpus, sp_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = hf(corpus.bpe)
    with pytest.raises(ValueError, match=r"\(512 tokens.*model.vocab_size=256"):
        check_vocab(tok, 256)
    # Under model.init_from the size is the checkpoint's (an override is refused): name the real fix.
    with pytest.raises(ValueError, match=r"size of model.init_from='hf/'; use that model's own tokenizer"):
        check_vocab(tok, 256, "hf/")
    sp = load_tokenizer(TokenizerConfig(kind=TokenizerKind.sentencepiece, path=str(sp_model)))
    assert sp.vocab_size == 400
    with caplog.at_level(logging.WARNING, logger="framework"):
        check_vocab(sp, 512)  # padded to a multiple of 128: a recipe's choice, no warning
        check_vocab(tok, 1024, reads_text=False)  # data=synthetic draws ids over every row
        assert caplog.text == ""
        check_vocab(sp, 640)
        assert "240 embedding rows are never used" in caplog.text
        check_vocab(tok, 1024)
    assert "512 embedding rows are never used" in caplog.text


def test_tokenizer_train_cli_refuses_a_tiny_vocab(corpus: Corpus, tmp_path: Path) -> None:
    from framework.launch.data_cli import main

    assert (
        main(["tokenizer", "train", str(tmp_path / "t.json"), str(corpus.jsonl), "--vocab-size", "100"]) == 2
    )
    assert (
        main(
            [
                "tokenizer",
                "train",
                str(tmp_path / "t.json"),
                str(tmp_path / "missing.txt"),
                "--vocab-size",
                "300",
            ]
        )
        == 2
    )


@pytest.mark.parametrize(
    "value, message",
    [
        ("1e22", "1e22 is out of range; valid: 1..4294967296"),
        ("10000000000000000000000", "10000000000000000000000 is out of range"),
        ("300.5", "300.5 is not an integer"),
        ("many", "'many' is not a number"),
    ],
)
def test_tokenizer_train_refuses_a_vocab_size_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    """--vocab-size 1e22 overflowed inside the tokenizers trainer (a traceback): argparse's one error
    line and exit 2, nothing written."""
    from framework.launch.data_cli import main

    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    with pytest.raises(SystemExit) as e:
        main(["tokenizer", "train", str(tmp_path / "t.json"), str(text), "--vocab-size", value])
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument --vocab-size: {message}" in errors[0], errors
    assert not (tmp_path / "t.json").exists()


def _saved_by_transformers(out: Path) -> Path:
    """The shipped SFT tokenizer as transformers 5 writes it: ``save_pretrained`` puts the chat
    template in chat_template.jinja (not tokenizer_config.json), with pad and unk tokens added."""
    from transformers import AutoTokenizer

    from tests.corpus import ROOT

    hf = AutoTokenizer.from_pretrained(ROOT / "recipes" / "data" / "sft_tiny")
    hf.add_special_tokens({"pad_token": "<|pad|>", "unk_token": "<|unk|>"})
    hf.save_pretrained(out)
    assert (out / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    return out


def test_chat_template_and_special_tokens_of_a_save_pretrained_folder_survive_save(tmp_path: Path) -> None:
    """Read from chat_template.jinja (it was silently ignored: only tokenizer_config.json's was read)
    and written back there, with bos/eos/pad/unk: AutoTokenizer of the copy equals the source's."""
    from transformers import AutoTokenizer

    src = _saved_by_transformers(tmp_path / "src")
    tok = load_tokenizer(TokenizerConfig(kind=TokenizerKind.hf, path=str(src)))
    assert tok.chat_template == (src / "chat_template.jinja").read_text()
    assert tok.special_tokens == {
        "bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": "<|pad|>", "unk": "<|unk|>",
    }  # fmt: skip
    assert "chat_template.jinja" in tok.save(tmp_path / "copy")
    theirs, ours = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(tmp_path / "copy")
    for field in ("chat_template", "bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for field in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, field) == getattr(theirs, field) is not None, field
    msgs = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(msgs)


def test_chat_template_precedence_and_a_list_without_default(tmp_path: Path) -> None:
    """transformers 5's order: chat_template.jinja, additional_chat_templates/default.jinja, then
    tokenizer_config.json; named templates without a default are refused (they fell back silently)."""
    src = _saved_by_transformers(tmp_path / "src")
    conf = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": "config"}))
    cfg = TokenizerConfig(kind=TokenizerKind.hf, path=str(src))
    assert load_tokenizer(cfg).chat_template not in (None, "config")  # the .jinja file wins
    (src / "chat_template.jinja").unlink()
    assert load_tokenizer(cfg).chat_template == "config"
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("tools")
    named = [{"name": "rag", "template": "rag"}]
    (src / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": named}))
    with pytest.raises(ValueError) as info:
        load_tokenizer(cfg)
    msg = str(info.value)
    assert "\n" not in msg and "chat templates ['rag', 'tool_use'] but no non-empty default" in msg, msg
    (src / "additional_chat_templates" / "default.jinja").write_text("default")
    assert load_tokenizer(cfg).chat_template == "default"


def test_a_tokenizer_folder_may_link_into_its_hub_cache_repo_only(tmp_path: Path) -> None:
    """tokenizer.path at a hub cache snapshot (files linked to ../../blobs/HASH) loads; a
    tokenizer.json or tokenizer_config.json linked anywhere else is one line naming it."""
    import hashlib
    import os
    import shutil

    src = tmp_path / "src"
    ByteTokenizer().save(src)
    repo = tmp_path / "models--team--tok"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (repo / "blobs" / digest).write_bytes(f.read_bytes())
        os.symlink(f"../../blobs/{digest}", snap / f.name)
    tok = load_tokenizer(TokenizerConfig(kind=TokenizerKind.hf, path=str(snap)))
    assert tok.decode(tok.encode("def é")) == "def é"
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        bad = repo / "snapshots" / f"bad_{name}"
        shutil.copytree(snap, bad, symlinks=True)
        shutil.copy(src / name, outside / name)
        (bad / name).unlink()
        os.symlink(outside / name, bad / name)
        with pytest.raises(ValueError) as e:
            load_tokenizer(TokenizerConfig(kind=TokenizerKind.hf, path=str(bad)))
        assert str(e.value) == (
            f"tokenizer.path={str(bad)!r}: {name} is a symlink to {str(outside / name)!r}, outside the folder; "
            f"valid: files in the folder, or links into {str(repo / 'blobs')!r} (the same Hugging Face cache repo)"
        )
