import json
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.config.schema import DataConfig, DataSource
from framework.data import BatchSampler, load_corpus, open_tokens, validation_batches
from framework.launch.data_cli import main


def _sampler(tokens, dp_rank=0, dp_size=1, gbs=8, mbs=2, seed=0):
    return BatchSampler(tokens, 256, 16, gbs, mbs, dp_rank, dp_size, seed)


def test_stdlib_corpus_has_held_out_split() -> None:
    corpus = load_corpus(DataConfig(source=DataSource.stdlib), vocab_size=256, seq_len=128)
    assert corpus is not None and corpus.vocab_size == 256
    assert corpus.train.size > 1_000_000 and corpus.val.size > 10_000
    assert not np.array_equal(corpus.train[:1000], corpus.val[:1000])


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ranks_split_the_same_global_batch(dp_size: int) -> None:
    tokens = np.arange(10_000, dtype=np.uint16) % 256
    whole = _sampler(tokens).next_batch()
    parts = [_sampler(tokens, r, dp_size).next_batch() for r in range(dp_size)]
    x_whole = torch.cat([x for x, _ in whole])
    x_parts = torch.cat([x for p in parts for x, _ in p])
    assert torch.equal(x_whole, x_parts)
    x, y = whole[0]
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one


def test_resume_on_a_different_dp_degree_skips_and_repeats_nothing() -> None:
    tokens = np.arange(50_000, dtype=np.uint16) % 256
    reference = [torch.cat([x for x, _ in _sampler(tokens).next_batch()]) for _ in range(1)]
    run = _sampler(tokens)
    seen = [torch.cat([x for x, _ in run.next_batch()]) for _ in range(3)]
    state = run.state_dict()
    # Resume on 4 data-parallel ranks: the next global batch is batch 3 of the uninterrupted run.
    uninterrupted = _sampler(tokens)
    expected = [torch.cat([x for x, _ in uninterrupted.next_batch()]) for _ in range(4)][3]
    resumed = []
    for r in range(4):
        s = _sampler(tokens, r, 4)
        s.load_state_dict(state)
        resumed.extend(x for x, _ in s.next_batch())
    assert torch.equal(torch.cat(resumed), expected)
    assert torch.equal(seen[0], reference[0])


def test_seed_change_on_resume_is_refused() -> None:
    s = _sampler(None, seed=1)
    with pytest.raises(ValueError, match="train.seed"):
        s.load_state_dict({"consumed_batches": 3, "seed": 2})


def test_indivisible_batch_is_refused_with_the_values() -> None:
    with pytest.raises(ValueError, match="global_batch_size=10"):
        BatchSampler(None, 256, 16, 10, 2, 0, 4, 0)


def test_synthetic_batches_are_deterministic_and_in_vocab() -> None:
    a, b = _sampler(None).next_batch(), _sampler(None).next_batch()
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, b, strict=True))
    assert int(torch.cat([x for x, _ in a]).max()) < 256


def test_validation_set_is_fixed() -> None:
    corpus = load_corpus(DataConfig(source=DataSource.stdlib), 256, 32)
    v1 = validation_batches(corpus, 256, 32, 4, 4, 2, 0, 1)
    v2 = validation_batches(corpus, 256, 32, 4, 4, 2, 0, 1)
    assert len(v1) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2, strict=True))


@pytest.mark.parametrize(("micro", "dp"), [(8, 1), (2, 1), (4, 2), (1, 4), (2, 2)])
def test_validation_set_is_the_same_windows_on_every_layout(micro: int, dp: int) -> None:
    """Global batches of the same windows whatever the micro batch and the data-parallel degree:
    sized by the micro batch (as it was), one process and a pipeline evaluated other windows."""
    corpus = load_corpus(DataConfig(source=DataSource.stdlib), 256, 32)
    whole = torch.cat([x for x, _ in validation_batches(corpus, 256, 32, 8, 8, 3, 0, 1)])
    ranks = [validation_batches(corpus, 256, 32, 8, micro, 3, r, dp) for r in range(dp)]
    assert all(x.shape[0] == micro for rank in ranks for x, _ in rank)
    per_batch = 8 // dp // micro  # micro batches of one global batch on one rank
    rows = [
        torch.cat([x for x, _ in rank[b * per_batch : (b + 1) * per_batch]]) for b in range(3) for rank in ranks
    ]
    assert torch.equal(torch.cat(rows), whole)


def test_prepare_and_memmap_round_trip(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("hello token files " * 200)
    out = tmp_path / "tok" / "train.bin"
    assert main(["prepare", str(out), str(text)]) == 0
    tokens, vocab = open_tokens(out)
    assert vocab == 256 and bytes(np.asarray(tokens[:5], dtype=np.uint8)) == b"hello"
    corpus = load_corpus(DataConfig(source=DataSource.tokens, path=str(out)), 256, 16)
    assert corpus is not None and corpus.train.size + corpus.val.size == tokens.size


def test_bad_token_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        open_tokens(tmp_path / "missing.bin")
    bad = tmp_path / "bad.bin"
    np.arange(10, dtype=np.uint16).tofile(bad)
    bad.with_suffix(".json").write_text(json.dumps({"dtype": "float8", "vocab_size": 256}))
    with pytest.raises(ValueError, match="float8"):
        open_tokens(bad)
    bad.with_suffix(".json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256, "num_tokens": 99}))
    with pytest.raises(ValueError, match="truncated"):
        open_tokens(bad)
    assert main(["prepare", str(tmp_path / "o.bin"), str(tmp_path / "nope.txt")]) == 2


def test_model_vocab_too_small_for_data() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        load_corpus(DataConfig(source=DataSource.stdlib), vocab_size=128, seq_len=16)


def test_default_batches_are_pinned() -> None:
    """`python train.py` (llama_tiny: stdlib bytes, seq 128, batch 16, seed 0) reads exactly the
    batches it read before the data group existed (hashes taken on main at 060fffd), through the
    same path the trainer takes (build_data)."""
    import hashlib

    from framework.config.run_values import batch_shape, data_run
    from framework.config.schema import Config
    from framework.data import build_data

    cfg = Config()
    cfg.train.global_batch_size = cfg.train.micro_batch_size = 16
    data = build_data(data_run(cfg), batch_shape(cfg.train), 0, 1)
    assert isinstance(data.sampler, BatchSampler)
    h = hashlib.sha256()
    for _ in range(3):
        for x, y in data.sampler.next_batch():
            h.update(x.numpy().tobytes())
            h.update(y.numpy().tobytes())
    assert h.hexdigest() == "fae262471b3ce2fa91db796823923bf9bee6f1b4a34ef6f63948cadfd0bb4ec6"
    v = hashlib.sha256()
    for x, y in data.val_batches:
        v.update(x.numpy().tobytes())
        v.update(y.numpy().tobytes())
    assert len(data.val_batches) == cfg.train.eval_batches == 4
    assert v.hexdigest() == "a71d93074bb080cc7bdedb06165a85b6c66db856357cfea09ae11b75e98c7ead"


SMALL = ("train.seq_len=16", "train.global_batch_size=4")


def run_and_change(tmp_path: Path, data: Path, change, *extra: str) -> None:
    """A real ``train.py`` run (``extra`` overrides) on ``data`` that saves every 2 steps; ``change(data)`` once two
    checkpoints are committed. Asserts the run stops non-zero (not by a signal) with one line
    naming the file, its sizes and the checkpoints kept, intact and with no LOCK left behind."""
    import os
    import signal
    import time

    from framework.checkpoint import store
    from tests.entry import start_forked

    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    overrides = [f"hydra.run.dir={run}", *extra, f"data.path={data}", "train.steps=100000"]
    overrides += ["train.eval_every=0", "freeze=none"]
    overrides += ["checkpoint=sync", "checkpoint.every_steps=2", "checkpoint.keep_last=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = start_forked(*overrides, env=env)  # python train.py, forked (tests/entry.py)
    try:
        deadline = time.monotonic() + 180
        while len(store.committed(ckpts)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or never saved"
            time.sleep(0.05)
        before = data.stat().st_size
        change(data)
        after = data.stat().st_size
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, -signal.SIGBUS), err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert f"data file {data} changed during the run (size {before} -> {after} bytes)" in errors[0]
    saved = store.committed(ckpts)
    assert f"the checkpoints up to step {saved[-1][0]} are kept" in errors[0]
    assert not (ckpts / "LOCK").exists()
    assert all((p / "manifest.json").is_file() for _, p in saved)


def test_a_token_file_truncated_mid_run_stops_it_in_one_line_keeping_the_checkpoints(tmp_path: Path) -> None:
    """Truncating a ``data=tokens`` file during a run was a SIGBUS (reading the memory map past its
    new end) that killed the process and left the checkpoint LOCK: now the sampler sees the change
    before its next read."""
    import os

    from framework.data.tokens import write_tokens

    data = tmp_path / "d.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 400_000), 256)
    run_and_change(tmp_path, data, lambda f: os.truncate(f, 1000), "data=tokens", *SMALL)


def test_a_token_file_truncated_under_two_ranks_is_the_same_one_line(tmp_path: Path) -> None:
    """Self-launched ranks: the rank that sees the change hands its line to the launcher (the
    elastic agent's error file), which said only "ranks failed ... To enable traceback see"."""
    import os

    from framework.data.tokens import write_tokens

    data = tmp_path / "d.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 400_000), 256)
    change = lambda f: os.truncate(f, 1000)  # noqa: E731
    run_and_change(tmp_path, data, change, "data=tokens", *SMALL, "mesh=2", "run.oversubscribe=true")


def test_a_jsonl_edited_mid_run_stops_it_in_one_line_keeping_the_checkpoints(tmp_path: Path) -> None:
    """A jsonl rewritten during the run (here: cut in the middle of a line, as a half-saved edit)
    was a 100-line traceback from the packer thread on its broken line; now one line naming it."""
    data = tmp_path / "d.jsonl"
    docs = [json.dumps({"text": f"document {i}: " + "words " * (i % 13)}) for i in range(3000)]
    data.write_text("\n".join(docs) + "\n")

    def cut(f: Path) -> None:
        f.write_bytes(f.read_bytes()[:5000] + b'{"text": "half')

    # 32 sequences a step (~10 documents): the reader, which checks its file every 256 records
    # (framework.data.records.CHECK_EVERY), gets there in ~25 steps after the edit, not ~200.
    run_and_change(tmp_path, data, cut, "data=jsonl", *SMALL, "train.global_batch_size=32")
