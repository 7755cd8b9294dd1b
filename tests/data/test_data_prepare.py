"""``python -m framework.data prepare``: streamed, multiprocess, any tokenizer, EOS between documents."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from framework.config.schema import TokenizerConfig, TokenizerKind
from framework.data import open_tokens, prepare
from framework.data.tokenizer import ByteTokenizer, load_tokenizer
from framework.data.tokens import tokenizer_digest
from framework.launch.data_cli import main
from tests.corpus import Corpus, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_two_workers_write_what_one_does_with_eos_after_every_document(
    corpus: Corpus, tmp_path: Path
) -> None:
    tok_cfg = TokenizerConfig(kind=TokenizerKind.hf, path=str(corpus.bpe))
    tok = load_tokenizer(tok_cfg)
    args = ["--tokenizer", "hf", "--tokenizer-path", str(corpus.bpe)]
    assert main(["prepare", str(tmp_path / "one.bin"), str(corpus.jsonl), *args, "--workers", "1"]) == 0
    assert main(["prepare", str(tmp_path / "two.bin"), str(corpus.jsonl), *args, "--workers", "2"]) == 0
    one, vocab = open_tokens(tmp_path / "one.bin", scan=True)
    two, _ = open_tokens(tmp_path / "two.bin")
    assert vocab == 512 and np.array_equal(one, two)
    expected = np.concatenate([np.array(tok.encode(d) + [tok.eos_id]) for d in corpus.docs])
    assert np.array_equal(np.asarray(one), expected)
    meta = json.loads((tmp_path / "two.json").read_text())
    assert meta["num_documents"] == len(corpus.docs) and meta["eos_id"] == tok.eos_id
    assert tokenizer_digest(tmp_path / "two.bin") == tok.digest()
    assert not list(tmp_path.glob("*.tmp"))


def test_folders_mix_kinds_and_bytes_output_is_unchanged(corpus: Corpus, tmp_path: Path) -> None:
    # Byte-level, as before the tokenizer option: text files concatenated exactly (no EOS in bytes).
    files = sorted(corpus.text_dir.glob("*.txt"))[:3]
    n = prepare(tmp_path / "b.bin", [str(f) for f in files], workers=1)
    tokens, _ = open_tokens(tmp_path / "b.bin")
    assert bytes(np.asarray(tokens, dtype=np.uint8)) == b"".join(f.read_bytes() for f in files)
    assert n == tokens.size and tokenizer_digest(tmp_path / "b.bin") == ByteTokenizer().digest()
    # A folder holding text, jsonl and parquet: each file read by its kind.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in (files[0], corpus.jsonl, corpus.parquet):
        (mixed / f.name).write_bytes(f.read_bytes())
    tok_cfg = TokenizerConfig(kind=TokenizerKind.hf, path=str(corpus.bpe))
    prepare(tmp_path / "m.bin", [str(mixed)], tok_cfg, workers=2)
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["num_documents"] == 1 + 2 * len(corpus.docs)


def test_bad_inputs_exit_2_and_leave_no_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["prepare", str(tmp_path / "o.bin"), str(tmp_path / "nope.txt")]) == 2
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    assert main(["prepare", str(tmp_path / "o.bin"), str(tmp_path / "latin1.txt"), "--workers", "1"]) == 2
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    assert main(["prepare", str(tmp_path / "o.bin"), str(tmp_path / "bad.jsonl"), "--workers", "2"]) == 2
    assert "set --field" in capsys.readouterr().err  # the flag, not a config key
    assert not list(tmp_path.glob("o.*"))


def test_an_output_that_would_overwrite_an_input_is_refused(tmp_path: Path) -> None:
    """``prepare d.bin d.json`` wrote the sidecar over the jsonl ``d.json``, ``prepare d.jsonl d.jsonl``
    the tokens over it, ``prepare t.json ...`` the sidecar over the tokens: each exits 2, input intact."""
    doc = '{"text": "hello"}\n'
    (tmp_path / "d.json").write_text(doc)
    (tmp_path / "e.jsonl").write_text(doc)
    for out, inp in [("d.bin", "d.json"), ("e.jsonl", "e.jsonl"), ("t.json", "e.jsonl")]:
        assert main(["prepare", str(tmp_path / out), str(tmp_path / inp), "--workers", "1"]) == 2
    assert (tmp_path / "d.json").read_text() == doc and (tmp_path / "e.jsonl").read_text() == doc
    assert (
        main(
            ["tokenizer", "train", str(tmp_path / "d.json"), str(tmp_path / "d.json"), "--vocab-size", "300"]
        )
        == 2
    )
    assert (tmp_path / "d.json").read_text() == doc
    assert sorted(f.name for f in tmp_path.iterdir()) == ["d.json", "e.jsonl"]


def test_a_folder_of_jsonl_skips_the_sidecar_of_a_token_file_prepared_into_it(tmp_path: Path) -> None:
    """``data=jsonl data.path=FOLDER`` read ``a.json`` (the sidecar of ``a.bin``) as a document file."""
    from framework.config.schema import DataSource
    from framework.data.records import SourceSpec, resolve_files

    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    assert main(["prepare", str(tmp_path / "a.bin"), str(tmp_path / "a.jsonl"), "--workers", "1"]) == 0
    (tmp_path / "b.json").write_text('{"text": "a jsonl file named .json"}\n')
    found = resolve_files(SourceSpec(DataSource.jsonl, str(tmp_path)))
    assert [f.name for f in found] == ["a.jsonl", "b.json"]
    assert main(["prepare", str(tmp_path / "c.bin"), str(tmp_path), "--workers", "1"]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["num_documents"] == 2


def _unwritable_folder(tmp: Path) -> Path | None:
    import os

    locked = tmp / "ro"
    locked.mkdir(mode=0o555)
    for folder in (locked, Path("/proc/sys")):  # root ignores permission bits; /proc/sys it cannot fill
        if not os.access(folder, os.W_OK):
            return folder
    return None


@pytest.mark.parametrize("command", ["prepare", "tokenizer train"])
@pytest.mark.parametrize("case", ["a folder", "under a file", "read-only folder"])
def test_an_output_that_cannot_be_written_is_one_line_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str
) -> None:
    """OUT as a folder was an IsADirectoryError, OUT under a file a FileExistsError, both after the
    whole input was tokenized."""
    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    (tmp_path / "f").write_text("x")
    (tmp_path / "dir").mkdir()
    if case == "read-only folder":
        folder = _unwritable_folder(tmp_path)
        if folder is None:
            pytest.skip("no unwritable folder on this machine")
        out, message = folder / "o.bin", "is not writable"
    else:
        out, message = {
            "a folder": (tmp_path / "dir", "is a folder; valid: a file path"),
            "under a file": (tmp_path / "f" / "o.bin", f"cannot be created: '{tmp_path / 'f'}' is a file"),
        }[case]
    extra = ["--vocab-size", "300"] if command == "tokenizer train" else []
    assert main([*command.split(), str(out), str(text), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: OUT '{out}'") and message in err[0], err
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == []


def test_prepare_and_tokenizer_train_refuse_to_overwrite_a_file_they_did_not_write(
    corpus: Corpus, tmp_path: Path
) -> None:
    """``prepare tokenizer.bin`` wrote its sidecar over ``tokenizer.json``; ``tokenizer train d.json``
    its tokenizer over the sidecar of ``d.bin``: each exits 2 with one line, the file byte for byte
    intact; ``--force`` replaces it; a file the command wrote itself is replaced without it."""
    tok_json = tmp_path / "tokenizer.json"
    tok_json.write_bytes(corpus.bpe.read_bytes())
    before = tok_json.read_bytes()
    prep = ["prepare", str(tmp_path / "tokenizer.bin"), str(corpus.jsonl), "--workers", "1"]
    assert main(prep) == 2
    assert tok_json.read_bytes() == before and not (tmp_path / "tokenizer.bin").exists()
    (tmp_path / "plain.bin").write_bytes(b"not tokens")  # no sidecar: not ours either
    assert main(["prepare", str(tmp_path / "plain.bin"), str(corpus.jsonl), "--workers", "1"]) == 2
    assert (tmp_path / "plain.bin").read_bytes() == b"not tokens"
    assert main([*prep, "--force"]) == 0
    assert json.loads(tok_json.read_text())["dtype"] == "uint16"
    assert main(prep) == 0  # its own sidecar now: replaced as before

    assert main(["prepare", str(tmp_path / "d.bin"), str(corpus.jsonl), "--workers", "1"]) == 0
    side = tmp_path / "d.json"
    sidecar = side.read_bytes()
    train = ["tokenizer", "train", str(side), str(corpus.jsonl), "--vocab-size", "300"]
    assert main(train) == 2
    assert side.read_bytes() == sidecar
    assert main([*train, "--force"]) == 0
    assert load_tokenizer(TokenizerConfig(kind=TokenizerKind.hf, path=str(side))).vocab_size == 300
    assert main(train) == 0  # a tokenizer it trained: replaced as before
    (tmp_path / "notes.txt").write_text("mine\n")
    assert (
        main(["tokenizer", "train", str(tmp_path / "notes.txt"), str(corpus.jsonl), "--vocab-size", "300"])
        == 2
    )
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_the_refusal_is_one_line_naming_the_file(corpus: Corpus, tmp_path: Path, capsys) -> None:
    (tmp_path / "t.json").write_bytes(corpus.bpe.read_bytes())
    assert main(["prepare", str(tmp_path / "t.bin"), str(corpus.jsonl), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "t.json" in err and "--force" in err


@pytest.mark.parametrize("workers", ["-1", "1000000000"])
def test_workers_are_bounded_by_the_cores(tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: str) -> None:
    """--workers forked without bound (923 processes in 100 s): now one line, exit 2, nothing written."""
    (tmp_path / "a.txt").write_text("hello")
    assert main(["prepare", str(tmp_path / "o.bin"), str(tmp_path / "a.txt"), "--workers", workers]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--workers {workers}: valid: 0 (one per core" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
