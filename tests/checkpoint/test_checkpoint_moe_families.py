"""DCP checkpoints of the layer-kind MoE families (``deepseek_v3_tiny``, ``gpt_oss_tiny``) through the
trainer: a run on 2 gloo ranks saves every 2 steps; a second run resumes its step 2 at the same
layout and ends bitwise where the unbroken run ends (its losses, and every tensor of its step-4
checkpoint: weights, AdamW's moments and step counts, DeepSeek-V3's routers' selection biases);
a third resumes step 2 on one process (the experts resharded: from ep=2 for DeepSeek-V3, from
FSDP's dp_shard=2 for GPT-OSS, which has no expert parallelism) and trains steps 3-4 within rtol
1e-5 of the unbroken run (another reduction order, so not bitwise).

The runs are their config as ``train.py`` composes it, trained on ranks forked from this process
(tests/dist.py: what a launched rank runs, without interpreters importing torch); the claim is the
trainer's save and load, not the launch."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from framework.checkpoint.state import load_dcp, read_metadata
from framework.record.metrics import read_metrics
from tests.dist import train_on_forked_ranks

RTOL = 1e-5
FAST = [
    "train.seq_len=16", "train.global_batch_size=4", "train.eval_every=0", "train.warmup_steps=1",
    "train.steps=4", "train.log_every=1", "checkpoint=sync", "checkpoint.every_steps=2",
    "checkpoint.keep_last=0", "logger.plot=false",
]  # fmt: skip
# recipe -> the saving layout on 2 ranks (its experts sharded across them)
SAVED = {
    "deepseek_v3_tiny": ["parallel.ep=2"],
    "gpt_oss_tiny": ["parallel.dp_shard=2"],
}
# Half the recipe's depth (one layer of each kind): the same paths at half the CPU time.
SHALLOW = {
    "deepseek_v3_tiny": ["model.n_layers=2", "model.layer_pattern='dense x1, moe x1'"],
    "gpt_oss_tiny": [
        "model.n_layers=2",
        "model.layer_pattern='[sliding, full] x1'",
        "model.sliding_window=8",
    ],
}


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer), read whole in one process."""
    meta = read_metadata(step_dir).state_dict_metadata
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.items()
        if isinstance(v, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP says it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninit")
        load_dcp(state, step_dir, no_dist=True)
    return state


def train(run: Path, world: int, recipe: str, *overrides: str) -> list[float]:
    """The run's losses, one per step it trained."""
    train_on_forked_ranks(
        run,
        world,
        f"hydra.run.dir={run}",
        f"recipe={recipe}",
        f"mesh={world}",
        *FAST,
        *SHALLOW[recipe],
        *overrides,
    )
    return [r["loss"] for r in read_metrics(run) if "loss" in r]


@pytest.mark.parametrize("recipe", list(SAVED))
def test_resume_is_bitwise_and_one_process_continues_the_sharded_checkpoint(
    tmp_path: Path, recipe: str
) -> None:
    unbroken = train(tmp_path / "unbroken", 2, recipe, *SAVED[recipe])
    step2 = tmp_path / "unbroken" / "checkpoints" / "step_000002"
    assert len(unbroken) == 4 and step2.is_dir()
    resumed = train(tmp_path / "resumed", 2, recipe, *SAVED[recipe], f"checkpoint.resume={step2}")
    assert resumed == unbroken[2:], (resumed, unbroken)
    want = checkpoint_tensors(tmp_path / "unbroken" / "checkpoints" / "step_000004")
    got = checkpoint_tensors(tmp_path / "resumed" / "checkpoints" / "step_000004")
    assert sorted(got) == sorted(want) and any(k.startswith("optim.") for k in want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"resumed state differs from the unbroken run's: {differ[:5]}"
    biases = [k for k in want if k.endswith("expert_bias")]
    if recipe == "deepseek_v3_tiny":  # the bias update ran on the step's loads, and was restored
        assert len(biases) == 1 and all(want[k].abs().max() > 0 for k in biases)
    # One process without expert parallelism or FSDP: every expert whole on it, from the 2 ranks' shards.
    one = train(tmp_path / "one", 1, recipe, f"checkpoint.resume={step2}")
    print(f"{recipe}: unbroken {unbroken}, resumed on 1 process {one}")
    assert one == pytest.approx(unbroken[2:], rel=RTOL)
    resharded = checkpoint_tensors(tmp_path / "one" / "checkpoints" / "step_000004")
    for k in biases:  # each step moves an entry by -rate, 0 or +rate: the same moves
        torch.testing.assert_close(resharded[k], want[k], rtol=0, atol=1e-6)
