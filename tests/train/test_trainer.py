"""``framework.train.trainer.run`` when a step raises: nothing is left behind, the last checkpoint holds.

Two forked gloo ranks run the trainer in-process, as launched ranks do (the trainer makes and ends
its own process group). The forward of step 5 raises on both (``run.fault_raise_at_step``) while the
async save of step 4 may still be writing. Each rank then compares its threads (Python and native),
open files and child processes with those it had before the run.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import threading
from pathlib import Path

import torch.distributed as dist

from framework.checkpoint import store, verify
from framework.checkpoint.group import Channel
from framework.config.schema import (
    AsyncMode,
    CheckpointConfig,
    Config,
    DataConfig,
    DataSource,
    Device,
    FreezeConfig,
    FreezeMode,
    Integrity,
    LoggerConfig,
    MeshConfig,
    RunConfig,
    ShardingConfig,
    Strategy,
    TrainConfig,
)
from framework.record.metrics import read_metrics
from framework.train.faults import InjectedFault
from tests.corpus import documents
from tests.dist import run_ranks


def _resources() -> dict[str, object]:
    """This process's Python threads, native threads, open files and child processes."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            children.append(pid)
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "tasks": len(os.listdir("/proc/self/task")),
        "fds": fds,
        "children": children,
    }


def _raise_in_a_step(rank: int, world: int, cfg: Config, run_dir: Path) -> dict[str, object]:
    from framework.planner.resolve import resolve
    from framework.train import trainer

    resolved = resolve(cfg)
    # The first TCPStore of a process opens a pipe that lives as long as the process (torch's, once):
    # open it before counting, with a store of no use.
    dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    gc.collect()
    before = _resources()
    try:
        trainer.run(resolved.cfg, resolved.plan, run_dir)
        raised = None
    except InjectedFault as e:
        raised = str(e)
    gc.collect()  # the traceback's frames held the run's objects until the except block ended
    return {"before": before, "after": _resources(), "group": dist.is_initialized(), "raised": raised}


def test_a_step_that_raises_leaves_nothing_behind(tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"  # a document source: its sampler packs on a background thread
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(12, chars=600)))
    cfg = Config(
        data=DataConfig(source=DataSource.jsonl, path=str(corpus), prefetch=2),
        train=TrainConfig(
            steps=8, global_batch_size=4, micro_batch_size=2, seq_len=32, log_every=2, eval_every=0
        ),
        checkpoint=CheckpointConfig(enabled=True, every_steps=2, async_mode=AsyncMode.thread),
        run=RunConfig(device=Device.cpu, fault_raise_at_step=5, fault_rank=-1),
        mesh=MeshConfig(shape=[2]),
        sharding=ShardingConfig(strategy=Strategy.ddp),  # auto may pick a pipeline for this shape
        freeze=FreezeConfig(mode=FreezeMode.none),
        logger=LoggerConfig(progress_bar=False, plot=False),
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for rank, out in enumerate(run_ranks(_raise_in_a_step, 2, cfg, run_dir, init=False, timeout_s=180)):
        before, after = out["before"], out["after"]
        assert out["raised"] == f"run.fault_raise_at_step=5: injected fault on rank {rank}"
        assert not out["group"], f"rank {rank}: the process group is still up"
        assert after["threads"] == before["threads"], rank
        assert after["tasks"] == before["tasks"], (rank, before["tasks"], after["tasks"])
        assert after["fds"] == before["fds"], rank
        assert after["children"] == before["children"] == [], rank
    root = run_dir / "checkpoints"
    committed = store.committed(root)
    assert [step for step, _ in committed] == [2, 4]  # step 4's async save finished and committed
    assert verify(committed[-1][1], Channel(None), Integrity.sha256) is None
    assert not list(root.glob("*.tmp")) and not (root / "LOCK").exists()
    rows = read_metrics(run_dir)  # every line whole: the file was flushed and closed
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]
