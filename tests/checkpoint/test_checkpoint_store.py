"""Checkpoint layout, integrity, retention and resume resolution, in one process on real files."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from framework.checkpoint import Checkpointer, find_latest, resolve_resume, verify
from framework.checkpoint.state import SafeReader
from framework.checkpoint.store import retention_victims, step_dir, tmp_dir
from framework.config.schema import CheckpointConfig, Integrity, ModelConfig
from framework.models import build_model, materialize

TINY = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64)


def _state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    model = build_model(TINY, 8)
    materialize(model, "cpu", seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _one)


def _one(step: int) -> float:
    return 1.0


def _save_steps(root: Path, steps: list[int], **cfg: object) -> Checkpointer:
    model, opt, sch = _state()
    ck = Checkpointer(CheckpointConfig(enabled=True, keep_last=0, **cfg), root)
    for s in steps:
        ck.save(s, model, opt, sch, {"step": s})
    return ck


class _Kept(logging.Handler):
    """The framework logger's warning lines, kept (what the console and train.log show)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logged_warnings() -> Iterator[list[str]]:
    """The warning lines the framework logs within (a skipped checkpoint, a failed save)."""
    kept, logger = _Kept(), logging.getLogger("framework")
    logger.addHandler(kept)
    try:
        yield kept.lines
    finally:
        logger.removeHandler(kept)


def _latest_with_warnings(ck: Checkpointer) -> tuple[Path | None, list[str]]:
    with logged_warnings() as lines:
        # The read-only search (Checkpointer.latest() also moves rejected ones aside).
        latest = find_latest(ck.root, ck.channel, ck.cfg.integrity)
    return latest, lines


def _biggest_shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_retention_policy() -> None:
    assert retention_victims([1, 2, 3, 4, 5], keep_last=2, keep_every=0, protect=5) == [1, 2, 3]
    assert retention_victims([2, 4, 6, 8, 9], keep_last=1, keep_every=4, protect=9) == [2, 6]
    assert retention_victims([1, 2, 3], keep_last=0, keep_every=0, protect=3) == []
    # Resumed from 2 after a corrupt 7: the new 3 is protected even though 7 sorts after it.
    assert retention_victims([1, 2, 3, 7], keep_last=1, keep_every=0, protect=3) == [1, 2]


def test_retention_on_disk_keeps_last_and_milestones(tmp_path: Path) -> None:
    model, opt, sch = _state()
    ck = Checkpointer(CheckpointConfig(enabled=True, keep_last=2, keep_every=4), tmp_path)
    for s in range(1, 11):
        ck.save(s, model, opt, sch, {"step": s})
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        step_dir(tmp_path, s).name for s in (4, 8, 9, 10)
    ]


def test_corrupt_truncated_and_incomplete_are_skipped_with_warnings(tmp_path: Path) -> None:
    ck = _save_steps(tmp_path, [1, 2, 3, 4])
    # step 4: one flipped byte in the middle of a shard (same size: only sha256 can tell).
    shard = _biggest_shard(step_dir(tmp_path, 4))
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    # step 3: truncated shard; step 2: no manifest (a copy cut short); a newer .tmp: a crashed save.
    shard3 = _biggest_shard(step_dir(tmp_path, 3))
    os.truncate(shard3, shard3.stat().st_size // 2)
    (step_dir(tmp_path, 2) / "manifest.json").unlink()
    tmp_dir(tmp_path, 9).mkdir()
    (tmp_dir(tmp_path, 9) / "__0_0.distcp").write_bytes(b"partial")

    latest, msgs = _latest_with_warnings(ck)
    assert latest == step_dir(tmp_path, 1)
    assert len(msgs) == 3, msgs
    assert "step_000004" in msgs[0] and "sha256" in msgs[0] and shard.name in msgs[0]
    assert "step_000003" in msgs[1] and "size" in msgs[1]
    assert "step_000002" in msgs[2] and "manifest.json" in msgs[2]

    # size mode trades the flipped byte for speed: it only catches the truncation.
    fast = Checkpointer(CheckpointConfig(enabled=True, integrity=Integrity.size), tmp_path)
    assert not tmp_dir(tmp_path, 9).exists(), "a new Checkpointer removes stale .tmp directories"
    latest, _ = _latest_with_warnings(fast)
    assert latest == step_dir(tmp_path, 4)


def test_load_roundtrip_and_resume_resolution(tmp_path: Path) -> None:
    model, opt, sch = _state(0)
    x = torch.randint(0, TINY.vocab_size, (2, 8))
    model(x).sum().backward()
    opt.step()
    sch.step()
    ck = Checkpointer(CheckpointConfig(enabled=True), tmp_path)
    ck.save(7, model, opt, sch, {"step": 7, "data": {"consumed_batches": 70}, "wandb_id": "abc"})

    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume("auto", tmp_path) == step_dir(tmp_path, 7)
    assert ck.resolve_resume(str(step_dir(tmp_path, 7))) == step_dir(tmp_path, 7)
    assert resolve_resume("auto", tmp_path / "empty") is None
    with pytest.raises(ValueError, match="nowhere.*not a usable checkpoint"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path)
    with pytest.raises(ValueError, match="no manifest.json"):
        resolve_resume(str(tmp_path), tmp_path)

    model2, opt2, sch2 = _state(1)
    extra = ck.load(step_dir(tmp_path, 7), model2, opt2, sch2)
    assert extra == {"step": 7, "data": {"consumed_batches": 70}, "wandb_id": "abc"}
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]  # betas is a tuple again, lr and initial_lr back
    for pid, st in s1["state"].items():
        for k, v in st.items():
            assert torch.equal(v, s2["state"][pid][k]), (pid, k)
    assert sch2.state_dict() == sch.state_dict()


def test_extra_must_be_plain_json_and_nothing_is_written(tmp_path: Path) -> None:
    model, opt, sch = _state()
    ck = Checkpointer(CheckpointConfig(enabled=True), tmp_path)
    with pytest.raises(ValueError, match="extra must hold plain JSON"):
        ck.save(1, model, opt, sch, {"position": torch.tensor(3)})
    assert [p.name for p in tmp_path.iterdir()] == ["LOCK"]  # this writer's lock, nothing else


def test_should_save_every_steps_and_minutes(tmp_path: Path) -> None:
    ck = Checkpointer(CheckpointConfig(enabled=True, every_steps=5), tmp_path)
    assert [s for s in range(1, 12) if ck.should_save(s, 0.0)] == [5, 10]
    ck = Checkpointer(CheckpointConfig(enabled=True, every_minutes=1.0), tmp_path)
    times = [0.0, 30.0, 61.0, 100.0, 125.0]
    assert [ck.should_save(i + 1, t) for i, t in enumerate(times)] == [False, False, True, False, True]
    with pytest.raises(ValueError, match="checkpoint.keep_last=-1"):
        Checkpointer(CheckpointConfig(keep_last=-1), tmp_path)


class _Evil:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo pwned",))


def test_metadata_unpickler_refuses_foreign_globals(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1])
    good = step_dir(tmp_path, 1)
    assert SafeReader(good).read_metadata().state_dict_metadata  # the real metadata passes
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        SafeReader(tmp_path / "evil").read_metadata()


def test_the_manifest_must_cover_every_file_of_a_checkpoint(tmp_path: Path) -> None:
    ck = _save_steps(tmp_path, [1, 2])
    assert {"extra.json", ".metadata", "rng/rank_00000.json"} <= set(
        json.loads((step_dir(tmp_path, 2) / "manifest.json").read_text())["files"]
    )
    # step 2 as an interleaving writer committed it: extra.json gone, and the manifest, listing what
    # was there, does not have it either. Sizes and hashes of what it lists all agree.
    d2 = step_dir(tmp_path, 2)
    (d2 / "extra.json").unlink()
    manifest = json.loads((d2 / "manifest.json").read_text())
    del manifest["files"]["extra.json"]
    (d2 / "manifest.json").write_text(json.dumps(manifest))
    assert "does not list extra.json" in verify(d2, ck.channel, Integrity.sha256)
    # step 1 with a file the manifest does not list (written into it after the commit).
    (step_dir(tmp_path, 1) / "__7_0.distcp").write_bytes(b"another run's shard")
    assert "files not in the manifest: __7_0.distcp" in verify(
        step_dir(tmp_path, 1), ck.channel, Integrity.sha256
    )


def test_a_checkpoint_that_does_not_load_falls_back_and_rejected_ones_are_kept(tmp_path: Path) -> None:
    model, opt, sch = _state(0)
    ck = Checkpointer(CheckpointConfig(enabled=True, keep_last=1), tmp_path)
    ck.save(2, model, opt, sch, {"step": 2})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    # step 4: complete and intact, but of another model (another run's save in the same dir).
    other = build_model(
        ModelConfig(dim=48, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64), 8
    )
    materialize(other, "cpu", 1)
    other_opt = torch.optim.AdamW(other.parameters())
    Checkpointer(CheckpointConfig(enabled=True, keep_last=0), tmp_path).save(
        4, other, other_opt, torch.optim.lr_scheduler.LambdaLR(other_opt, _one), {"step": 4}
    )
    # step 6: a flipped byte.
    ck2 = Checkpointer(CheckpointConfig(enabled=True, keep_last=0), tmp_path)
    ck2.save(6, model, opt, sch, {"step": 6})
    shard = _biggest_shard(step_dir(tmp_path, 6))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    fresh, fresh_opt, fresh_sch = _state(5)
    with logged_warnings() as caught:
        found = ck.load_latest(fresh, fresh_opt, fresh_sch)
    assert found.path == step_dir(tmp_path, 2) and found.extra == {"step": 2}
    assert found.load_failed
    assert [Path(n).name for n, _ in found.rejected] == ["step_000006", "step_000004"]
    assert "sha256" in found.rejected[0][1] and "does not load" in found.rejected[1][1], found.rejected
    skipped = [line for line in caught if line.startswith("skipping checkpoint")]
    assert len(skipped) == 2 and all("moved to" in line for line in skipped), caught
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    # Moved aside with the reason, never deleted: neither retention nor a new save of step 4 or 6 touches them.
    aside = sorted(p.name for p in (tmp_path / "corrupt").iterdir())
    assert [n.split("-")[0] for n in aside] == ["step_000004", "step_000004", "step_000006", "step_000006"]
    assert sum(n.endswith(".why") for n in aside) == 2
    ck.save(4, model, opt, sch, {"step": 4})
    ck.save(6, model, opt, sch, {"step": 6})
    assert len(list((tmp_path / "corrupt").iterdir())) == 4
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["corrupt", "step_000006"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"step": 1000}, "'extra.step' is 1000, not the checkpoint's step 2"),
        ({"step": -3}, "'extra.step' is -3, not the checkpoint's step 2"),
        ({"step": "2"}, "'extra.step' is '2', not the checkpoint's step 2"),
        ({"tokens_seen": "lots"}, "'extra.tokens_seen' is 'lots', expected an integer >= 0"),
        ({"data": {"consumed_batches": -7}}, "'extra.data' is {'consumed_batches': -7}, expected the sampler"),
        ({"data": {"consumed_batches": 2, "seed": "x"}}, "'extra.data.seed' is 'x', expected an integer"),
        ({"config_hash": 5}, "'extra.config_hash' is 5, expected a str or null"),
        ({"data": None}, "'extra' lacks ['data'], which the trainer writes and a resume reads"),
    ],
)
def test_the_trainers_part_of_extra_json_is_checked(tmp_path: Path, change: dict, words: str) -> None:
    """extra.json's ``extra`` was taken as it was: ``step: 1000`` in step_000002 resumed at step 1000
    and trained nothing (exit 0), -3 ran until the kernel killed it, the others were tracebacks. Now
    the checkpoint fails its check like any malformed one (set aside on resume=auto)."""
    from framework.checkpoint.state import EXTRA_FILE, read_extra

    ck = _save_steps(tmp_path, [2])
    ck.close()
    path = step_dir(tmp_path, 2) / EXTRA_FILE
    doc = json.loads(path.read_text())
    assert read_extra(path.parent)["extra"] == {"step": 2}
    trainers = {"tokens_seen": 4, "data": {"consumed_batches": 2, "seed": 0}, "config_hash": "ab"}
    doc["extra"] |= trainers | {"wandb_run_id": None, "model": None}
    path.write_text(json.dumps(doc))
    assert read_extra(path.parent)["extra"]["tokens_seen"] == 4
    doc["extra"] |= change
    doc["extra"] = {k: v for k, v in doc["extra"].items() if v is not None or k != "data"}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: {words}")):
        read_extra(path.parent)
