"""Checkpointer on real gloo ranks and real DCP files: resharding, async, failure, preemption."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from framework.checkpoint import Checkpointer, PreemptionHandler, resolve_resume, state
from framework.checkpoint.save_io import Writer, payload_bytes
from framework.checkpoint.store import tmp_dir
from framework.config.schema import AsyncMode, CheckpointConfig, Integrity, ModelConfig
from framework.models import build_model, materialize
from tests.checkpoint.test_checkpoint_store import logged_warnings
from tests.dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SEQ = 16
TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128)
EXTRA = {
    "step": 3,
    "tokens_seen": 3 * 8 * SEQ,
    "data": {"consumed_batches": 12},
    "wandb_id": None,
    "config_hash": "ab12",
}


def _lr(step: int) -> float:
    # A module-level function: LambdaLR stores None for it, so the scheduler state is plain JSON.
    return 1.0 / (1 + step)


def _build(seed: int, layout: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model: torch.nn.Module = build_model(TINY, SEQ)
    materialize(model, "cpu", seed)
    if layout == "ddp":
        model = DDP(model)
    elif layout == "fsdp":
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _lr)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sch: Any, steps: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randint(0, TINY.vocab_size, (2, SEQ), generator=g)
        F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten()).backward()
        opt.step()
        opt.zero_grad()
        sch.step()


def _h(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(
        t.view(-1).view(torch.uint8).numpy().tobytes() + str((t.dtype, t.shape)).encode()
    ).hexdigest()


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Hashes of the full model and optimizer state (on rank 0; collective for FSDP)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {f"model.{k}": _h(v) for k, v in msd.items()}
    out |= {f"optim.{fqn}.{k}": _h(v) for fqn, st in osd.get("state", {}).items() for k, v in st.items()}
    return out


def _save_worker(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:
    model, opt, sch = _build(0, "ddp")
    _train(model, opt, sch, 3, rank)
    ck = Checkpointer(CheckpointConfig(enabled=True, async_mode=AsyncMode(mode)), Path(root))
    digest = _digest(model, opt)
    rng = _h(torch.get_rng_state())
    sched = sch.state_dict()
    ck.save(3, model, opt, sch, EXTRA)
    blocked = ck.last_blocked_s
    # Train on while an async save is in flight: the staging copy must keep the checkpoint at step 3.
    _train(model, opt, sch, 1, rank)
    ck.close()
    return {
        "digest": digest if rank == 0 else None,
        "rng": rng,
        "sched": sched,
        "blocked_s": blocked,
        "error": ck.last_error,
    }


def _load_worker(rank: int, world: int, root: str, layout: str) -> dict[str, Any]:
    model, opt, sch = _build(1, layout)
    ck = Checkpointer(CheckpointConfig(enabled=True), Path(root))
    path = ck.latest()
    assert path is not None
    torch.manual_seed(999)
    with logged_warnings() as caught:
        extra = ck.load(path, model, opt, sch)
    rng = _h(torch.get_rng_state())
    digest = _digest(model, opt)
    ck.close()
    return {
        "path": path.name,
        "extra": extra,
        "rng": rng,
        "digest": digest if rank == 0 else None,
        "sched": sch.state_dict(),
        "warnings": caught,
    }


def test_save_4_ranks_ddp_load_2_fsdp_and_1_plain_bitwise(tmp_path: Path) -> None:
    saved = run_ranks(_save_worker, 4, str(tmp_path), "none")
    assert all(r["error"] is None for r in saved)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step_000003"], names
    assert len(list((tmp_path / "step_000003").glob("*.distcp"))) == 4
    ref = saved[0]["digest"]
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in ref)

    for world, layout in ((2, "fsdp"), (1, "plain")):
        loaded = run_ranks(_load_worker, world, str(tmp_path), layout)
        assert loaded[0]["digest"] == ref, f"{layout} x{world}: state differs after load"
        for r in range(world):
            assert loaded[r]["path"] == "step_000003"
            assert loaded[r]["extra"] == EXTRA
            assert loaded[r]["rng"] == saved[r]["rng"], f"rank {r} RNG not restored"
            sched = dict(loaded[r]["sched"])
            assert sched["last_epoch"] == saved[r]["sched"]["last_epoch"] == 3
            assert sched["_last_lr"] == saved[r]["sched"]["_last_lr"]
        assert any("saved by 4 ranks and is loaded by" in w for w in loaded[0]["warnings"])


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_save_blocks_less_and_keeps_the_saved_step(tmp_path: Path, mode: str) -> None:
    """process (``checkpoint=large``): DCP pickles the writer into its own saving process."""
    saved = run_ranks(_save_worker, 2, str(tmp_path), mode)
    assert all(r["error"] is None for r in saved)
    ckpt = tmp_path / "step_000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = {q.relative_to(ckpt).as_posix() for q in ckpt.rglob("*") if q.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files and "rng/rank_00001.json" in files
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())  # shards hashed in the background
    assert not tmp_dir(tmp_path, 3).exists()
    # The loop trained one step after save() returned; the checkpoint still holds step 3's state.
    loaded = run_ranks(_load_worker, 1, str(tmp_path), "plain")
    assert loaded[0]["digest"] == saved[0]["digest"]
    print(f"async {mode} save blocked {max(r['blocked_s'] for r in saved) * 1e3:.1f} ms")


def _async_commit_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save asynchronously at step 5, then train on without calling the checkpointer at all."""
    model, opt, sch = _build(0, "ddp")
    ck = Checkpointer(CheckpointConfig(enabled=True, async_mode=AsyncMode.thread), Path(root))
    _train(model, opt, sch, 5, rank)
    ck.save(5, model, opt, sch, EXTRA)
    step, deadline = 5, time.monotonic() + 60
    while time.monotonic() < deadline:
        _train(model, opt, sch, 1, rank)  # DDP all-reduces: both ranks step in lockstep
        step += 1
        seen = torch.tensor([int((Path(root) / "step_000005" / "manifest.json").is_file())])
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)
        if seen.item():
            break
        time.sleep(0.05)
    # No wait(), save() or close(): a rank killed now loses nothing that was written.
    return {"committed_at_step": step if seen.item() else None}


def test_async_save_commits_as_soon_as_every_rank_wrote(tmp_path: Path) -> None:
    res = run_ranks(_async_commit_worker, 2, str(tmp_path))
    at = res[0]["committed_at_step"]
    assert at is not None, "the step-5 save was never committed while training went on"
    assert resolve_resume(str(tmp_path / "step_000005"), tmp_path) == tmp_path / "step_000005"
    print(f"async save at step 5 committed by step {at} (no checkpointer call in between)")


def _failing_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt, sch = _build(0, "ddp")
    ck = Checkpointer(CheckpointConfig(enabled=True, keep_last=5), Path(root))
    ck.save(1, model, opt, sch, {"step": 1})
    _train(model, opt, sch, 1, rank)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # a full disk on one rank only: every rank must learn of it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, hard))
    with logged_warnings() as caught:
        ck.save(2, model, opt, sch, {"step": 2})
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    error = ck.last_error
    latest = ck.latest()
    tmp_left = tmp_dir(Path(root), 2).exists()
    _train(model, opt, sch, 1, rank)  # training goes on, and the next save works
    ck.save(3, model, opt, sch, {"step": 3})
    after = ck.latest()  # collective: every rank calls it
    ck.close()
    return {
        "error": error,
        "latest": latest.name if latest else None,
        "tmp_left": tmp_left,
        "warnings": caught,
        "after": after.name if after else None,
    }


def test_failed_save_keeps_previous_and_reports_on_all_ranks(tmp_path: Path) -> None:
    res = run_ranks(_failing_worker, 2, str(tmp_path))
    for r in res:
        assert r["error"] is not None and "rank 1" in r["error"], r["error"]
        assert r["latest"] == "step_000001"
        assert not r["tmp_left"]
    assert any("step 2 failed" in w and "rank 1" in w for w in res[0]["warnings"]), res[0]["warnings"]
    assert "File too large" in res[0]["error"] or "Errno 27" in res[0]["error"], res[0]["error"]
    assert res[0]["after"] == "step_000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000003"]


def test_a_write_into_a_deleted_run_dir_fails_and_brings_no_folder_back(tmp_path: Path) -> None:
    """The run dir deleted between rank 0 making the save's ``.tmp`` and DCP's write (CI saw it with
    2 ranks): torch's writer makes the folder with its parents, so the run dir came back and a user's
    folder made at its path collided with it. The run's writer fails and makes nothing."""
    tmp = tmp_dir(tmp_path / "run" / "checkpoints", 2)
    payload = {"w": torch.ones(3)}
    with pytest.raises((OSError, CheckpointException)):
        dcp.save(payload, storage_writer=Writer(tmp, sync_files=True), no_dist=True)
    assert list(tmp_path.iterdir()) == []
    dcp.save(payload, storage_writer=FileSystemWriter(tmp), no_dist=True)  # torch's own: it comes back
    assert (tmp_path / "run" / "checkpoints").is_dir()


def _preempt_worker(rank: int, world: int) -> tuple[bool, bool, int | None, bool]:
    group = dist.new_group(backend="gloo")
    previous = signal.getsignal(signal.SIGUSR1)
    handler = PreemptionHandler(group)
    before = handler.requested()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # the handler runs at the main thread's next bytecode boundary
    after = handler.requested()
    handler.close()
    return before, after, handler.signal, signal.getsignal(signal.SIGUSR1) is previous


def test_preemption_flag_is_agreed_across_ranks() -> None:
    res = run_ranks(_preempt_worker, 2)
    assert [r[0] for r in res] == [False, False]
    assert [r[1] for r in res] == [True, True]  # rank 0 got no signal, yet agrees
    assert res[0][2] is None and res[1][2] == signal.SIGUSR1
    assert all(r[3] for r in res), "previous handler not restored"


def _tmpfs(mount: Path, size: int, *command: str) -> subprocess.CompletedProcess:
    """Run ``command`` with a ``size``-byte tmpfs at ``mount``: a real full disk without root, in an
    unprivileged user + mount namespace (``unshare -rm``); skips where user namespaces are off."""
    mount.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mount}"], capture_output=True
    )
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip(f"no unprivileged tmpfs here (unshare -rm): {probe.stderr.decode()[:200]}")
    script = f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount))} && exec {shlex.join(command)}"
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


FULL_DISK = """
import sys, warnings
from pathlib import Path
from framework.checkpoint import Checkpointer
from framework.config.schema import CheckpointConfig
from tests.checkpoint.test_checkpoint import _build
model, opt, sch = _build(0, "plain")
ck = Checkpointer(CheckpointConfig(enabled=True), Path(sys.argv[1]))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ck.save(1, model, opt, sch, {"step": 1})
print(ck.last_error)
"""


def test_a_full_disk_mid_write_is_named_with_the_bytes_needed(tmp_path: Path) -> None:
    """The disk has room for the JSON files and passes the free-space check before the write, then
    fills up inside DCP's tensor write (torch's C++ writer, which drops the errno)."""
    model, opt, _ = _build(0, "plain")
    needed = payload_bytes(state.tensor_state(model, opt)[0])
    size = (needed + 64 * 1024 + 4095) // 4096 * 4096
    mount = tmp_path / "disk"
    proc = _tmpfs(mount, size, sys.executable, "-c", FULL_DISK, str(mount / "ck"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = proc.stdout.strip().splitlines()[-1]
    assert (
        error
        == f"rank 0: no space left on device, {needed} bytes needed at {mount / 'ck' / 'step_000001.tmp'} (0 bytes free)"
    )


# --- crafted checkpoints: every read path refuses them before unpickling anything -----------------

_FAST = ["checkpoint=sync", "train.steps=2", "train.eval_every=0", "train.log_every=1", "train.seq_len=16"]
_FAST += ["train.global_batch_size=4", "freeze=none", "logger.plot=false"]


class _Payload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _train_run(run: Path, *overrides: str) -> subprocess.CompletedProcess:
    from tests.entry import train_forked

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return train_forked(f"hydra.run.dir={run}", *_FAST, *overrides, timeout=300, env=env)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("victim") / "run"
    proc = _train_run(run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _rehash(step: Path) -> None:
    """Rewrite the manifest to agree with the (tampered) files, as an attacker would."""
    from framework.checkpoint import store

    path = step / store.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"] = {
        name: store.file_digest(step / name, Integrity.sha256) for name in store.list_files(step)
    }
    path.write_text(json.dumps(manifest))


def _craft(step: Path, marker: Path, how: str) -> None:
    """``bytes``: one tensor declared as bytes, its data a pickle that runs a command (what DCP
    reads with ``torch.load(weights_only=False)``); ``global``: the metadata pickle itself does."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta = pickle.loads((step / ".metadata").read_bytes())  # the framework's own, trusted here
    key = next(k for k in meta.state_dict_metadata if k.startswith("model."))
    if how == "bytes":
        evil = pickle.dumps(_Payload(marker))
        (step / "evil.distcp").write_bytes(evil)
        meta.state_dict_metadata[key] = BytesStorageMetadata()
        for idx in [i for i in meta.storage_data if i.fqn == key]:
            del meta.storage_data[idx]
        meta.storage_data[MetadataIndex(key)] = _StorageInfo("evil.distcp", 0, len(evil))
    else:
        meta.planner_data = _Payload(marker)
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    _rehash(step)


def _read_generate(step: Path, tmp: Path) -> tuple[int, str]:
    import contextlib
    import io

    from framework.launch.generate import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([str(step), "--prompt", "x", "--max-new-tokens", "2"])
    return code, err.getvalue()


def _read_export(step: Path, tmp: Path) -> tuple[int, str]:
    import contextlib
    import io

    from framework.launch.export_cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["export-hf", str(step), str(tmp / "hf")])
    return code, err.getvalue()


def _read_init_from(step: Path, tmp: Path) -> tuple[int, str]:
    proc = _train_run(tmp / "fresh", f"model.init_from={step}")
    return proc.returncode, proc.stderr


def _read_resume(step: Path, tmp: Path) -> tuple[int, str]:
    proc = _train_run(step.parent.parent, "train.steps=3", f"checkpoint.resume={step}")
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("how", ["bytes", "global"])
@pytest.mark.parametrize("read", [_read_generate, _read_init_from, _read_resume, _read_export])
def test_a_crafted_checkpoint_is_refused_by_every_read_path(
    trained_run: Path, tmp_path: Path, read: Any, how: str
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, symlinks=True)
    step = max((run / "checkpoints").glob("step_*"))
    marker = tmp_path / "pwned"
    _craft(step, marker, how)
    code, err = read(step, tmp_path)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert ".metadata" in errors[0] and "Traceback" not in err, err[-3000:]
    assert not marker.exists()
    assert step.is_dir()  # refused, not deleted


@pytest.mark.parametrize("read", [_read_generate, _read_init_from, _read_resume, _read_export])
def test_a_damaged_step_dir_named_by_path_is_refused(trained_run: Path, tmp_path: Path, read: Any) -> None:
    """The manifest is checked when a step dir is named, not only when a run dir or root is."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, symlinks=True)
    step = max((run / "checkpoints").glob("step_*"))
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight: the load would succeed
    shard.write_bytes(bytes(data))
    code, err = read(step, tmp_path)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert "not a usable checkpoint" in errors[0] and shard.name in errors[0], errors[0]
    assert shard.read_bytes() == bytes(data)  # refused, nothing moved or repaired


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run that saved step_000001 and step_000002."""
    run = tmp_path_factory.mktemp("two") / "run"
    proc = _train_run(run, "checkpoint.every_steps=1", "checkpoint.keep_last=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_a_tampered_manifest_is_one_log_line_not_a_python_warning(
    two_checkpoints: Path, tmp_path: Path
) -> None:
    """A manifest whose digest disagrees with its file: the checkpoint is moved aside and step 1
    resumed, said in one log line. It was a raw Python warning on stderr whose second line, the
    caller's source ``resumed = ckpt.resume(...)``, was the last line of the run's stderr."""
    from framework.checkpoint import store

    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run, symlinks=True)
    path = run / "checkpoints" / "step_000002" / store.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"]["extra.json"]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    proc = _train_run(run, "train.steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning:" not in proc.stderr and "resumed = " not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "skipping checkpoint" in line]
    assert len(said) == 1 and "[WARNING]" in said[0], proc.stdout[-3000:]
    assert "step_000002" in said[0] and "extra.json: sha256" in said[0] and "moved to" in said[0], said


_BAD_EXTRA = ["[]", '{"extra": 5}', "{}", "not json"]


@pytest.mark.parametrize("bad", _BAD_EXTRA)
def test_a_malformed_extra_json_falls_back_to_the_older_checkpoint(
    two_checkpoints: Path, tmp_path: Path, bad: str
) -> None:
    """``resume=auto``: a newest checkpoint whose extra.json is malformed (and its manifest agrees)
    is reported in one warning naming it and why, kept (moved aside), and step 1 is resumed; an
    explicit PATH to it is one error line, exit 2, nothing moved."""
    from framework.record.metrics import read_metrics

    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run, symlinks=True)
    step = run / "checkpoints" / "step_000002"
    (step / "extra.json").write_text(bad)
    _rehash(step)
    proc = _train_run(run, "train.steps=3", f"checkpoint.resume={step}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "extra.json" in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (step / "extra.json").read_text() == bad

    proc = _train_run(run, "train.steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    said = [
        line for line in out.splitlines() if "checkpoint_rejected" in line or "skipping checkpoint" in line
    ]
    assert said and all("step_000002" in line and "extra.json" in line for line in said), out[-3000:]
    [rejected] = [r for r in read_metrics(run) if r.get("event") == "checkpoint_rejected"]
    assert "step_000002" in rejected["detail"] and "extra.json" in rejected["detail"]
    [resumed] = [r for r in read_metrics(run) if r.get("event") == "resumed"]
    assert resumed["step"] == 1
    [kept] = [p for p in (run / "checkpoints" / "corrupt").glob("step_000002*") if p.is_dir()]
    assert (kept / "extra.json").read_text() == bad
