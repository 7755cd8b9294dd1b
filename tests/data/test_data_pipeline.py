"""Every bad data or tokenizer input is refused before launch with one line naming the value
(framework.data.checks.check_data), and through train.py: exit 2, nothing written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from framework import data as data_mod
from framework.config.run_values import batch_shape, data_run
from framework.config.schema import (
    AttentionBackend,
    CompileScope,
    Config,
    DataConfig,
    DataSource,
    ExecutorConfig,
    ExecutorMode,
    MixEntry,
    ModelConfig,
    TokenizerConfig,
    TokenizerKind,
    TrainConfig,
)
from framework.data.tokens import write_tokens
from tests.corpus import ROOT, Corpus, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def check_data(c: Config) -> None:
    """``check_data`` on a whole config, as the launcher calls it (framework.launch.prelaunch)."""
    data_mod.check_data(data_run(c), batch_shape(c.train))


def check_document_kernel(c: Config, device_type: str) -> None:
    """``check_document_kernel`` on a whole config, as the launcher calls it."""
    data_mod.check_document_kernel(c.data, c.model.attention, c.executor, device_type)


def cfg(
    data: DataConfig, tokenizer: TokenizerConfig | None = None, vocab: int = 512, seq_len: int = 32
) -> Config:
    return Config(
        model=ModelConfig(vocab_size=vocab),
        tokenizer=tokenizer or TokenizerConfig(),
        data=data,
        train=TrainConfig(seq_len=seq_len, global_batch_size=4, micro_batch_size=2),
    )


def bpe(corpus: Corpus) -> TokenizerConfig:
    return TokenizerConfig(kind=TokenizerKind.hf, path=str(corpus.bpe))


def refused(config: Config, *fragments: str) -> str:
    with pytest.raises(ValueError) as e:
        check_data(config)
    message = str(e.value)
    assert "\n" not in message, message
    for f in fragments:
        assert f in message, message
    return message


def test_shipped_sources_pass(corpus: Corpus) -> None:
    for data in (
        DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl)),
        DataConfig(source=DataSource.text, path=str(corpus.text_dir / "*.txt")),
        DataConfig(source=DataSource.parquet, path=str(corpus.root)),
        DataConfig(source=DataSource.hf, path=str(corpus.parquet)),
    ):
        check_data(cfg(data, bpe(corpus)))
    check_data(cfg(DataConfig(), vocab=256))  # the embedded default


def test_missing_empty_and_non_utf8_files(corpus: Corpus, tmp_path: Path) -> None:
    refused(
        cfg(DataConfig(source=DataSource.jsonl, path=str(tmp_path / "nope.jsonl")), bpe(corpus)),
        "nope.jsonl",
        "does not exist",
    )
    (tmp_path / "empty.jsonl").write_text("")
    refused(
        cfg(DataConfig(source=DataSource.jsonl, path=str(tmp_path / "empty.jsonl")), bpe(corpus)),
        "empty.jsonl",
        "empty file",
    )
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    refused(
        cfg(DataConfig(source=DataSource.text, path=str(tmp_path / "latin1.txt")), bpe(corpus)),
        "latin1.txt",
        "not UTF-8",
        "byte 3",
    )
    refused(
        cfg(DataConfig(source=DataSource.text, path=str(tmp_path / "*.md")), bpe(corpus)), "matches no files"
    )
    refused(
        cfg(DataConfig(source=DataSource.parquet, path=str(corpus.text_dir)), bpe(corpus)),
        "no .parquet files",
    )
    refused(cfg(DataConfig(source=DataSource.jsonl), bpe(corpus)), "data.source=jsonl needs data.path")


def test_jsonl_line_without_the_field(corpus: Corpus, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine document"}\n{"body": "no text key"}\n')
    refused(
        cfg(DataConfig(source=DataSource.jsonl, path=str(bad)), bpe(corpus)),
        f"{bad}:2",
        "no field 'text'",
        "['body']",
        "data.field",
    )
    bad.write_text('{"text": "ok"}\n{"text": "unterminated\n')
    refused(
        cfg(DataConfig(source=DataSource.jsonl, path=str(bad)), bpe(corpus)), f"{bad}:2", "not a JSON object"
    )
    bad.write_text('{"text": 42}\n')
    refused(cfg(DataConfig(source=DataSource.jsonl, path=str(bad)), bpe(corpus)), "is int, not text")
    bad.write_text('["a list, not an object"]\n')
    refused(
        cfg(DataConfig(source=DataSource.jsonl, path=str(bad)), bpe(corpus)), "a JSON list, not an object"
    )


def test_corrupt_parquet_and_missing_column(corpus: Corpus, tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(corpus.parquet.read_bytes()[:200])
    refused(
        cfg(DataConfig(source=DataSource.parquet, path=str(bad)), bpe(corpus)),
        "bad.parquet",
        "not a readable parquet file",
    )
    refused(
        cfg(DataConfig(source=DataSource.parquet, path=str(corpus.parquet), column="body"), bpe(corpus)),
        "no column 'body'", "['text', 'id']", "data.column",
    )  # fmt: skip


def test_hf_dataset_that_does_not_load_or_lacks_the_column(corpus: Corpus, tmp_path: Path) -> None:
    refused(
        cfg(DataConfig(source=DataSource.hf, path=str(tmp_path / "no_such_dataset")), bpe(corpus)),
        "datasets.load_dataset failed",
    )
    refused(
        cfg(DataConfig(source=DataSource.hf, path=str(corpus.jsonl), column="body"), bpe(corpus)),
        "no column 'body'",
    )


def test_tokenizer_that_does_not_parse_and_vocab_larger_than_the_model(
    corpus: Corpus, tmp_path: Path
) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    tok = TokenizerConfig(kind=TokenizerKind.hf, path=str(tmp_path))
    refused(
        cfg(DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl)), tok),
        "tokenizer.json",
        "is not a valid tokenizer.json",
    )
    refused(
        cfg(DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl)), bpe(corpus), vocab=256),
        "512 tokens",
        "model.vocab_size=256",
    )


def test_mixture_weights_that_sum_to_zero_or_are_negative(corpus: Corpus) -> None:
    def mix(*weights: float) -> DataConfig:
        return DataConfig(
            mix=[MixEntry(source=DataSource.jsonl, path=str(corpus.jsonl), weight=w) for w in weights]
        )

    refused(cfg(mix(0.0, 0.0), bpe(corpus)), "data.mix weights sum to 0.0")
    refused(cfg(mix(1.0, -0.5), bpe(corpus)), "data.mix[1].weight=-0.5")
    refused(cfg(mix(1.0, float("nan")), bpe(corpus)), "data.mix[1].weight=nan")
    check_data(cfg(mix(1.0, 0.0), bpe(corpus)))
    bad_path = DataConfig(mix=[MixEntry(source=DataSource.jsonl, path="missing.jsonl")])
    refused(cfg(bad_path, bpe(corpus)), "data.mix[0].path='missing.jsonl' does not exist")


def test_out_of_range_data_numbers(corpus: Corpus) -> None:
    refused(cfg(DataConfig(val_fraction=1.5), vocab=256), "data.val_fraction=1.5 must be in [0, 1)")
    refused(cfg(DataConfig(prefetch=0), vocab=256), "data.prefetch=0")


def test_too_few_records_to_hold_out_validation(corpus: Corpus, tmp_path: Path) -> None:
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": corpus.docs[0]}) + "\n")
    refused(
        cfg(DataConfig(source=DataSource.jsonl, path=str(one)), bpe(corpus)), "has 1 records", "data.val_path"
    )


@pytest.fixture()
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tok.bin"
    write_tokens(path, np.arange(4000) % 256, vocab_size=256)
    return path


def tokens_cfg(path: Path | str, **kw: object) -> Config:
    return cfg(DataConfig(source=DataSource.tokens, path=str(path)), vocab=kw.pop("vocab", 256), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("missing", ["does not exist", "prepare"]),
        ("empty", ["is an empty token file"]),
        ("directory", ["dir.bin' is a folder with no .bin files"]),
        ("no_sidecar", ["has no sidecar tok.json"]),
        ("corrupt_sidecar", ["the sidecar is not valid JSON"]),
        ("unknown_dtype", ["dtype 'float8' is not one of ['uint16', 'uint32']"]),
        ("ids_above_vocab", ["holds token id 300 >= its sidecar's vocab_size=256"]),
        ("vocab_above_model", ["(1000 tokens", "model.vocab_size=256"]),
        ("shorter_than_a_sequence", ["fewer than one sequence", "train.seq_len+2=34"]),
        ("truncated", ["holds 4000 tokens, its sidecar says 5000"]),
        ("odd_size", ["not a whole number of uint16 tokens"]),
        # tok.jsonl's ".json sidecar" is tok.bin's: it read as "not a whole number of tokens".
        ("text_file", ["tok.jsonl' is a .jsonl file, not a token file", "data=jsonl"]),
    ],
)
def test_bad_token_files(token_file: Path, case: str, fragments: list[str]) -> None:
    side = token_file.with_suffix(".json")
    meta = json.loads(side.read_text())
    path: Path = token_file
    if case == "missing":
        path = token_file.with_name("other.bin")
    elif case == "empty":
        token_file.write_bytes(b"")
    elif case == "directory":
        path = token_file.parent / "dir.bin"
        path.mkdir()
    elif case == "no_sidecar":
        side.unlink()
    elif case == "corrupt_sidecar":
        side.write_text('{"dtype": "uint16", ')
    elif case == "unknown_dtype":
        side.write_text(json.dumps({**meta, "dtype": "float8"}))
    elif case == "ids_above_vocab":
        np.full(4000, 300, dtype=np.uint16).tofile(token_file)
    elif case == "vocab_above_model":
        side.write_text(json.dumps({**meta, "vocab_size": 1000}))
    elif case == "shorter_than_a_sequence":
        write_tokens(token_file, np.arange(30) % 256, vocab_size=256)
    elif case == "truncated":
        side.write_text(json.dumps({**meta, "num_tokens": 5000}))
    elif case == "odd_size":
        with token_file.open("ab") as f:
            f.write(b"\x01")
    elif case == "text_file":
        path = token_file.with_suffix(".jsonl")
        path.write_text('{"text": "a document"}\n')
    refused(tokens_cfg(path), *fragments)


def test_token_file_made_with_another_tokenizer(corpus: Corpus, tmp_path: Path) -> None:
    from framework.data import prepare
    from framework.data.tokenizer import ByteTokenizer, load_tokenizer

    out = tmp_path / "bpe.bin"
    prepare(out, [str(corpus.jsonl)], bpe(corpus), workers=1)
    ours, theirs = load_tokenizer(bpe(corpus)).digest(), ByteTokenizer().digest()
    # Trained with the BPE, read with the default bytes tokenizer (vocab 256 < the file's 512 too,
    # so give the model room: the digest is what must stop it).
    message = refused(tokens_cfg(out, vocab=512), "made with another tokenizer", ours[:16], theirs[:16])
    assert "tokenizer=bytes" in message
    check_data(cfg(DataConfig(source=DataSource.tokens, path=str(out)), bpe(corpus)))


def test_document_mask_needs_an_eos_and_a_masking_kernel(corpus: Corpus) -> None:
    message = refused(cfg(DataConfig(document_mask=True), vocab=256), "needs an EOS token", "tokenizer=bytes")
    assert "eos_token" not in message, message  # tokenizer=bytes refuses tokenizer.eos_token
    bos = refused(
        cfg(DataConfig(), TokenizerConfig(add_bos=True), vocab=256), "has no BOS token", "use tokenizer=hf"
    )
    assert "bos_token" not in bos, bos  # ... and tokenizer.bos_token
    masked = cfg(DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl), document_mask=True), bpe(corpus))
    check_data(masked)
    for attention in AttentionBackend:  # every kernel takes the mask (flash and fa4: on CUDA, below)
        masked.model.attention = attention
        check_data(masked)


@pytest.mark.parametrize("attention", [AttentionBackend.flash, AttentionBackend.fa4])
def test_flash_kernels_take_document_masks_on_cuda_in_blocks(corpus: Corpus, attention: AttentionBackend) -> None:
    """The flash kernels' variable-length form: CUDA only, and not in one whole-model graph (the
    spans are counted on the host); packed SFT rows are document masks too."""
    masked = cfg(DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl), document_mask=True), bpe(corpus))
    masked.model.attention = attention
    check_document_kernel(masked, "cuda")
    line = f"data.document_mask=true with model.attention={attention.value} on cpu: the flash kernel's"
    with pytest.raises(ValueError, match=rf"^{line} variable-length form runs on CUDA only; use model.attention=auto"):
        check_document_kernel(masked, "cpu")
    masked.executor = ExecutorConfig(mode=ExecutorMode.compile, scope=CompileScope.model)
    with pytest.raises(ValueError, match=r"and executor.scope=model: .* use executor.scope=block, or model.attention=auto"):
        check_document_kernel(masked, "cuda")
    masked.executor = ExecutorConfig(mode=ExecutorMode.compile)
    check_document_kernel(masked, "cuda")
    sft = cfg(DataConfig(source=DataSource.sft, path=str(corpus.jsonl), sft_pack=True))
    sft.model.attention = attention
    with pytest.raises(ValueError, match=r"^data=sft with data.sft_pack=true with model.attention=.* on cpu"):
        check_document_kernel(sft, "cpu")
    sft.data.sft_pack = False
    check_document_kernel(sft, "cpu")  # unpacked rows: no mask
    masked.model.attention = AttentionBackend.auto
    check_document_kernel(masked, "cpu")  # SDPA's dense mask


# -- through train.py, in this process: exit 2, one line, no run dir ------------------------------


def train_main(run_dir: Path, *overrides: str) -> None:
    # Named __main__ (not put in sys.modules): Hydra then finds conf/ next to the file, and the
    # module's own `if __name__ == "__main__": main()` runs it, as `python train.py` does.
    spec = importlib.util.spec_from_file_location("__main__", ROOT / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    argv = sys.argv
    sys.argv = ["train.py", f"hydra.run.dir={run_dir}", *overrides]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "data=jsonl",
                "data.path={bad_jsonl}",
                "tokenizer=hf",
                "tokenizer.path={bpe}",
                "model.vocab_size=512",
            ],
            ":2: no field 'text'",
        ),
        (
            ["data.source=tokens", "data.path={missing}"],
            "does not exist",
        ),  # the spelling from before the group
        (
            ["tokenizer=hf", "tokenizer.path={bpe}", "model.vocab_size=256"],
            "than model.vocab_size=256: set model.vocab_size>=512 (or leave it unset",
        ),
        (
            [
                "data=parquet",
                "data.path={bad_parquet}",
                "tokenizer=hf",
                "tokenizer.path={bpe}",
                "model.vocab_size=512",
            ],
            "not a readable parquet file",
        ),
        (
            [
                "data=jsonl",
                "data.path={jsonl}",
                "tokenizer=hf",
                "tokenizer.path={bpe}",
                "model.vocab_size=512",
                "data.document_mask=true",
                "model.attention=flash",
            ],
            "model.attention=flash on cpu: the flash kernel's variable-length form runs on CUDA only; use "
            "model.attention=auto",
        ),
    ],
)
def test_train_py_refuses_bad_data_with_exit_2_and_no_run_dir(
    corpus: Corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{"body": "y"}\n')
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    paths = {
        "bad_jsonl": tmp_path / "bad.jsonl",
        "bpe": corpus.bpe,
        "missing": tmp_path / "none.bin",
        "bad_parquet": tmp_path / "bad.parquet",
        "jsonl": corpus.jsonl,
    }
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_main(run, *(o.format(**paths) for o in overrides))
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not run.exists()


def _no_token_sources(tmp: Path) -> dict[str, DataConfig]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp / "empty_texts.jsonl").write_text('{"text": ""}\n' * 20)
    pq.write_table(pa.table({"text": pa.array([None] * 20, type=pa.string())}), tmp / "nulls.parquet")
    (tmp / "ok.jsonl").write_text('{"text": "hello"}\n' * 20)
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), tmp / "empty.parquet")
    (tmp / "one.jsonl").write_text('{"text": "hello"}\n')
    return {
        "empty stream": DataConfig(source=DataSource.hf, path=str(tmp / "empty.parquet"), streaming=True),
        "one-record stream": DataConfig(source=DataSource.hf, path=str(tmp / "one.jsonl"), streaming=True),
        "empty texts": DataConfig(source=DataSource.jsonl, path=str(tmp / "empty_texts.jsonl")),
        "null column": DataConfig(source=DataSource.parquet, path=str(tmp / "nulls.parquet")),
        "empty split": DataConfig(source=DataSource.hf, path=str(tmp / "ok.jsonl"), split="train[:0]"),
        "hf null column": DataConfig(source=DataSource.hf, path=str(tmp / "nulls.parquet")),
        "missing val_path": DataConfig(
            source=DataSource.jsonl, path=str(tmp / "ok.jsonl"), val_path=str(tmp / "nope.jsonl")
        ),
    }


NO_TOKENS = [
    ("empty stream", "data.path='{tmp}/empty.parquet': its first records cannot be read (BatchSize must be"),
    ("one-record stream", "data.path='{tmp}/one.jsonl' has 1 records: too few to hold out every 20-th"),
    ("empty texts", "data.path='{tmp}/empty_texts.jsonl': none of its 20 records has text (its data.field"),
    ("null column", "data.path='{tmp}/nulls.parquet': none of its 20 records has text (its data.column"),
    (
        "empty split",
        "ok.jsonl' with data.split='train[:0]': Instruction \"train[:0]\" corresponds to no data",
    ),
    ("hf null column", "none of its 20 records has text (its data.column is empty or null"),
    ("missing val_path", "data.val_path='{tmp}/nope.jsonl' does not exist"),
]


@pytest.mark.parametrize("case, message", NO_TOKENS, ids=[c for c, _ in NO_TOKENS])
def test_data_that_gives_no_tokens_is_refused_before_launch(
    corpus: Corpus, tmp_path: Path, capfd: pytest.CaptureFixture[str], case: str, message: str
) -> None:
    """All-empty texts, an all-null parquet column and an empty split crashed the rank with a
    traceback; a missing data.val_path was reported as data.path. A stream whose first record does
    not read was a bare pyarrow line, one whose records cannot fill a validation hold-out a traceback
    at the rank's first evaluation; datasets' progress bars and log lines came around the refusal."""
    data = _no_token_sources(tmp_path)[case]
    capfd.readouterr()
    refused(cfg(data, bpe(corpus)), message.format(tmp=tmp_path))
    assert capfd.readouterr().err == ""


def test_train_py_refuses_data_without_tokens_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_token_sources(tmp_path)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_main(run, "data=jsonl", f"data.path={tmp_path / 'empty_texts.jsonl'}")
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "none of its 20 records has text" in errors[0], errors
    assert not run.exists()


def test_a_symlink_loop_is_read_once_and_validation_may_not_share_training_files(
    corpus: Corpus, tmp_path: Path
) -> None:
    """A ``**`` glob through dir/loop -> dir listed each file 41 times (until ELOOP); the same file
    named as data.val_path through the loop was trained on and validated on."""
    import os

    from framework.data.records import SourceSpec, resolve_files

    d = tmp_path / "d"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.jsonl").write_text(json.dumps({"text": f"document {i} " * 20}) + "\n")
    (d / "loop").symlink_to(d)
    glob = str(d / "**" / "*.jsonl")
    assert resolve_files(SourceSpec(source=DataSource.jsonl, path=glob)) == sorted(d.glob("*.jsonl"))
    data = DataConfig(source=DataSource.jsonl, path=glob, val_path=str(d / "loop" / "1.jsonl"))
    refused(cfg(data, bpe(corpus)), "data.val_path=", "shares 1 file(s) with data.path=", "disjoint files")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    refused(
        cfg(DataConfig(source=DataSource.jsonl, path=str(fifo)), bpe(corpus)),
        f"data.path='{fifo}' is a FIFO, not a regular file",
    )


@pytest.mark.parametrize(("micro", "dp"), [(1, 1), (2, 2), (1, 4)])
def test_packed_validation_is_the_same_windows_on_every_layout(corpus: Corpus, micro: int, dp: int) -> None:
    """A packed source (jsonl, BPE): each rank's validation micro batches are its share of the same
    global batches of windows as one process with the whole batch (as for the flat sources)."""
    import dataclasses

    import torch

    from framework.data import build_data

    base = cfg(DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl)), bpe(corpus))
    base.train = dataclasses.replace(base.train, eval_batches=3)

    def rows(m: int, rank: int, size: int) -> list[torch.Tensor]:
        c = dataclasses.replace(base, train=dataclasses.replace(base.train, micro_batch_size=m))
        data = build_data(data_run(c), batch_shape(c.train), rank, size)
        data.sampler.close()
        assert all(x.shape[0] == m for x, _ in data.val_batches)
        return [x for x, _ in data.val_batches]

    whole = torch.cat(rows(4, 0, 1))
    ranks = [rows(micro, r, dp) for r in range(dp)]
    per = 4 // dp // micro  # micro batches per global batch and rank
    parts = [torch.cat(rank[b * per : (b + 1) * per]) for b in range(3) for rank in ranks]
    assert whole.shape[0] == 12 and torch.equal(torch.cat(parts), whole)


def _validated(*overrides: str) -> Config:
    """The launcher's typed config for a real Hydra composition of ``overrides`` (the command line)."""
    from hydra import compose, initialize_config_dir

    from framework.config import schema
    from framework.launch import recipes
    from framework.launch.prelaunch import validate
    from framework.launch.ranks import register_resolvers

    schema.register()
    recipes.register()
    register_resolvers()
    with initialize_config_dir(config_dir=str(recipes.CONF_DIR), version_base="1.3"):
        return validate(compose("config", overrides=list(overrides)), list(overrides))


def test_model_vocab_size_follows_the_tokenizer_unless_the_command_line_sets_it(corpus: Corpus) -> None:
    """The default recipe's 256 (the byte tokenizer's) grows to a 512-token BPE's vocabulary; a value
    set on the command line stays (a larger one as it is, a smaller one is refused); a recipe's
    value that already holds the tokenizer stays (sft_tiny rounds its 379 tokens up to 384)."""
    bpe_args = ["data=jsonl", f"data.path={corpus.jsonl}", "tokenizer=hf", f"tokenizer.path={corpus.bpe}"]
    assert _validated(*bpe_args).model.vocab_size == 512
    assert _validated(*bpe_args, "model.vocab_size=640").model.vocab_size == 640
    with pytest.raises(ValueError, match="larger than model.vocab_size=300: set model.vocab_size>=512"):
        _validated(*bpe_args, "model.vocab_size=300")
    assert _validated().model.vocab_size == 256  # the byte tokenizer: nothing to follow
    assert _validated("recipe=sft_tiny").model.vocab_size == 384
