"""Packed document sources and mixtures keep the sampler's invariant: resume on any number of
data-parallel ranks with no sample skipped or repeated (framework.data.stream / pipeline)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.config.run_values import batch_shape, data_run
from framework.config.schema import (
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
from framework.data.stream import StreamSampler, compose
from framework.data.tokenizer import load_tokenizer
from tests.corpus import Corpus, write_corpus

GBS, MBS, SEQ = 8, 2, 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def make_cfg(corpus: Corpus, data: DataConfig, **train: int) -> Config:
    return Config(
        model=ModelConfig(vocab_size=512),
        tokenizer=TokenizerConfig(kind=TokenizerKind.hf, path=str(corpus.bpe)),
        data=data,
        train=TrainConfig(
            seq_len=SEQ, global_batch_size=GBS, micro_batch_size=MBS, eval_every=train.get("eval_every", 0)
        ),
    )


def global_rows(cfg: Config, dp: int, state: dict | None, n: int) -> tuple[list[torch.Tensor], dict]:
    """n global batches assembled from dp ranks (each resumed from ``state``), and the final state."""
    per_rank = []
    final = None
    for r in range(dp):
        sampler = build_data(data_run(cfg), batch_shape(cfg.train), r, dp).sampler
        if state is not None:
            sampler.load_state_dict(json.loads(json.dumps(state)))  # as the checkpoint stores it (JSON)
        per_rank.append(
            [torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in sampler.next_batch()]) for _ in range(n)]
        )
        final = sampler.state_dict()
        sampler.close()
    return [torch.cat([per_rank[r][i] for r in range(dp)]) for i in range(n)], final


def sources(corpus: Corpus) -> dict[str, DataConfig]:
    return {
        "jsonl": DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl)),
        "text": DataConfig(source=DataSource.text, path=str(corpus.text_dir)),
        "text_epochs": DataConfig(
            source=DataSource.text, path=str(corpus.root / "small.txt"), val_fraction=0
        ),
        "parquet": DataConfig(source=DataSource.parquet, path=str(corpus.parquet)),
        "hf": DataConfig(source=DataSource.hf, path=str(corpus.jsonl)),
        "hf_streaming": DataConfig(source=DataSource.hf, path=str(corpus.parquet), streaming=True),
        "mix": DataConfig(
            mix=[
                MixEntry(source=DataSource.jsonl, path=str(corpus.jsonl), weight=3.0),
                MixEntry(source=DataSource.parquet, path=str(corpus.parquet), weight=1.0),
                MixEntry(source=DataSource.synthetic, weight=1.0),
            ]
        ),
    }


@pytest.mark.parametrize("name", ["jsonl", "text", "text_epochs", "parquet", "hf", "hf_streaming", "mix"])
def test_resume_on_another_dp_degree_skips_and_repeats_nothing(corpus: Corpus, name: str) -> None:
    cfg = make_cfg(corpus, sources(corpus)[name])
    whole, _ = global_rows(cfg, 1, None, 6)
    first, state = global_rows(cfg, 1, None, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, whole[:3], strict=True))  # deterministic
    for dp in (2, 4):
        resumed, _ = global_rows(cfg, dp, state, 3)
        assert all(torch.equal(a, b) for a, b in zip(resumed, whole[3:], strict=True)), (name, dp)
    rows = torch.cat(whole)
    assert rows.shape == (6 * GBS, SEQ + 1) and int(rows.max()) < 512
    if name == "text_epochs":  # 600 characters: the state resumed in a later pass over the file
        assert state["sources"][0]["epoch"] >= 1
    else:
        assert len({tuple(r.tolist()) for r in rows}) == rows.shape[0]  # no window twice


def test_packing_joins_documents_with_eos_in_order(corpus: Corpus) -> None:
    cfg = make_cfg(corpus, DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl), val_fraction=0.0))
    tok = load_tokenizer(cfg.tokenizer)
    sampler = build_data(data_run(cfg), batch_shape(cfg.train), 0, 1).sampler
    batches = [sampler.next_batch() for _ in range(8)]
    stream = np.concatenate([torch.cat([x, y[:, -1:]], 1).reshape(-1).numpy() for b in batches for x, y in b])
    sampler.close()
    expected = np.concatenate([np.array(tok.encode(d) + [tok.eos_id]) for d in corpus.docs[:20]])
    assert np.array_equal(stream, expected[: stream.size])
    assert (stream == tok.eos_id).sum() >= 2


def test_bos_is_added_before_every_document_when_asked(corpus: Corpus) -> None:
    cfg = make_cfg(corpus, DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl), val_fraction=0.0))
    cfg = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, add_bos=True))
    sampler = build_data(data_run(cfg), batch_shape(cfg.train), 0, 1).sampler
    flat = [
        t
        for _ in range(8)
        for x, y in sampler.next_batch()
        for t in torch.cat([x, y[:, -1:]], 1).reshape(-1).tolist()
    ]
    sampler.close()
    assert flat[0] == 0  # <|begin_of_text|>
    after_eos = [flat[i + 1] for i, t in enumerate(flat[:-1]) if t == 1]
    assert after_eos and all(t == 0 for t in after_eos)


def test_validation_records_never_reach_training(corpus: Corpus) -> None:
    cfg = make_cfg(
        corpus, DataConfig(source=DataSource.jsonl, path=str(corpus.jsonl), val_fraction=0.25), eval_every=1
    )
    data = build_data(data_run(cfg), batch_shape(cfg.train), 0, 1)
    train = torch.cat([torch.cat([x, y[:, -1:]], 1) for _ in range(3) for x, y in data.sampler.next_batch()])
    data.sampler.close()
    val = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in data.val_batches])
    assert len(data.val_batches) == cfg.train.eval_batches * GBS // MBS  # global batches, in micro batches
    train_windows = {tuple(r.tolist()) for r in train}
    assert not any(tuple(r.tolist()) in train_windows for r in val)
    again = build_data(data_run(cfg), batch_shape(cfg.train), 0, 1)
    again.sampler.close()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(data.val_batches, again.val_batches, strict=True))


def test_peek_and_undo_give_the_same_batch_again(corpus: Corpus) -> None:
    cfg = make_cfg(corpus, sources(corpus)["mix"])
    sampler = build_data(data_run(cfg), batch_shape(cfg.train), 0, 1).sampler
    peeked = sampler.peek()
    first = sampler.next_batch()
    assert torch.equal(peeked[:MBS, :-1], first[0][0])
    state = sampler.state_dict()
    sampler.rewind()
    assert sampler.consumed_batches == 0
    again = sampler.next_batch()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    assert sampler.state_dict() == state
    sampler.close()


class Constant:
    """A window source whose rows are its id: shows which source filled each row."""

    def __init__(self, i: int) -> None:
        self.i, self.drawn = i, 0

    def take(self, n: int) -> np.ndarray:
        self.drawn += n
        return np.full((n, 4), self.i)

    def state(self) -> dict[str, int]:
        return {"drawn": self.drawn}

    def seek(self, state: dict[str, int]) -> None:
        self.drawn = state["drawn"]


class Slow(Constant):
    """A source that takes ``delay`` seconds per call: the packer falls behind the loop."""

    def __init__(self, i: int, delay: float) -> None:
        super().__init__(i)
        self.delay = delay

    def take(self, n: int) -> np.ndarray:
        time.sleep(self.delay)
        return super().take(n)


def test_the_sampler_times_how_long_the_loop_waits_for_each_batch() -> None:
    """``last_wait_s`` (reported per step as data_wait_ms / data_wait_share) is the time next_batch
    blocked: about the packer's time per batch while it is behind, near 0 once it is ahead."""
    sampler = StreamSampler([Slow(0, 0.2)], [1.0], 3, 4, 2, 0, 1, seed=0, prefetch=2)
    sampler.next_batch()
    assert sampler.last_wait_s >= 0.15  # the first batch: nothing was ready
    time.sleep(0.5)  # the packer fills its queue while the "step" runs
    sampler.next_batch()
    assert sampler.last_wait_s < 0.1
    sampler.close()


def test_mixture_follows_its_weights_and_depends_only_on_seed_and_index() -> None:
    weights = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    srcs = [Constant(i) for i in range(3)]
    rows = np.concatenate([compose(srcs, weights, 0, i, 64)[:, 0] for i in range(200)])
    share = np.bincount(rows, minlength=3) / rows.size
    assert np.allclose(share, [0.6, 0.3, 0.1], atol=0.02), share
    a = compose([Constant(i) for i in range(3)], weights, 0, 17, 64)
    b = compose([Constant(i) for i in range(3)], weights, 0, 17, 64)
    c = compose([Constant(i) for i in range(3)], weights, 1, 17, 64)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_training_on_packed_jsonl_with_document_mask_resumes_exactly(corpus: Corpus, tmp_path: Path) -> None:
    """Through train.py (in this process): a run stopped at step 3 and resumed to step 6 from its
    checkpoint (the packer's cursor in extra state, as JSON) ends on the uninterrupted run's loss."""
    from framework.record.metrics import read_metrics
    from tests.data.test_data_pipeline import train_main

    common = [
        "data=jsonl", f"data.path={corpus.jsonl}", "data.document_mask=true",
        "tokenizer=hf", f"tokenizer.path={corpus.bpe}", "model.vocab_size=512", "model.dim=32",
        "model.n_layers=1", "model.ffn_dim=64", "train.seq_len=32", "train.global_batch_size=4",
        "train.log_every=1", "train.eval_every=3", "train.eval_batches=1", "freeze=none",
        "logger.plot=false", "logger.progress_bar=false", "checkpoint=sync",
    ]  # fmt: skip
    train_main(tmp_path / "whole", *common, "train.steps=6")
    train_main(tmp_path / "split", *common, "train.steps=3")
    train_main(tmp_path / "split", *common, "train.steps=6")
    whole, split = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    assert any(r.get("event") == "resumed" for r in split)
    last = [r["loss"] for r in whole if r.get("step") == 6 and "loss" in r]
    resumed = [r["loss"] for r in split if r.get("step") == 6 and "loss" in r]
    assert last and last == resumed
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_val_loss"] is not None


def test_two_rank_run_on_packed_jsonl_resumes_on_one_rank_with_the_same_samples(
    corpus: Corpus, tmp_path: Path
) -> None:
    """2 data-parallel ranks (DDP over gloo; train.py's config, trained on ranks forked from this
    process, tests/dist.py) pack jsonl on the fly with the BPE and checkpoint at steps 3 and 6; a
    new run of train.py resumes step 3's checkpoint on 1 rank. It trains steps 4-6 on the same
    samples (same losses: another sample gives another loss) and ends at the same data position
    (batches consumed, record and offset in the stream), so none was skipped or repeated across the
    change of degree."""
    from framework.record.metrics import read_metrics
    from tests.data.test_data_pipeline import train_main
    from tests.dist import train_on_forked_ranks

    common = [
        "data=jsonl", f"data.path={corpus.jsonl}", "tokenizer=hf", f"tokenizer.path={corpus.bpe}",
        "model.vocab_size=512", "model.dim=32", "model.n_layers=1", "model.ffn_dim=64",
        "train.seq_len=32", "train.global_batch_size=8", "train.steps=6", "train.log_every=1",
        "train.eval_every=0", "freeze=none", "logger.plot=false", "logger.progress_bar=false",
        "checkpoint=sync", "checkpoint.every_steps=3", "checkpoint.keep_last=0",
    ]  # fmt: skip
    two, one = tmp_path / "two", tmp_path / "one"
    train_on_forked_ranks(two, 2, *common, "mesh=2")
    step3 = two / "checkpoints" / "step_000003"
    train_main(one, *common, f"checkpoint.resume={step3}")

    def trained(run: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}

    def data_state(run: Path) -> dict:
        return json.loads((run / "checkpoints" / "step_000006" / "extra.json").read_text())["extra"]["data"]

    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    assert json.loads((one / "summary.json").read_text())["world_size"] == 1
    assert any(r.get("event") == "resumed" for r in read_metrics(one))
    a, b = trained(two), trained(one)
    assert sorted(b) == [4, 5, 6]
    assert [b[s] for s in (4, 5, 6)] == pytest.approx([a[s] for s in (4, 5, 6)], rel=1e-5)
    end = data_state(two)
    assert end["consumed_batches"] == 6 and end["sources"][0]["record"] > 0
    assert data_state(one) == end
