"""Predicted (framework.planner.cost) against measured step time for the GPU runs of benchmarks/PERF.md.

Every row is a run already measured on the lent H200s (tokens/s from PERF.md, the round named);
the planner predicts it from the recipe and overrides alone. Rows marked ``calibration`` are the
ones a constant was fitted to (framework/planner/cost.py and conf/mesh/hardware/h200.yaml say which); the
others are predictions. Runs on the CPU machine in a second: ``python benchmarks/cost_check.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from framework.launch.recipes import compose_recipe  # noqa: E402
from framework.planner.resolve import make_plan  # noqa: E402

H200 = ["mesh/hardware=h200", "run.device=cuda", *sys.argv[1:]]  # extra overrides: e.g. mesh.hardware.kernel_table=h100_sxm
IN_BACKWARD = ["train.optimizer_in_backward=true", "train.grad_clip=0"]
ISSUE_28 = ["executor=compile", "train.seq_len=8192", "train.global_batch_size=1", "train.micro_batch_size=1",
            "sharding=fsdp", "sharding.activation_checkpointing=none", *IN_BACKWARD]  # fmt: skip
MASKED = ["data.document_mask=true", "model.attention=fa4"]
FLOAT8 = ["model.float8=tensorwise", "model.float8_size_filter=false"]
BF16_MOMENTS = ["optimizer.state_dtype=bfloat16"]
TWO_ROWS = ["train.global_batch_size=2", "train.micro_batch_size=2"]
# (label, recipe, overrides, measured tokens/s, source in PERF.md, used for calibration). None: the
# declared topology is not the machine's (mesh.shape=[2,1] declares 2 nodes, so the planner costs
# the replicas' all-reduce on the inter-node link; the run had both GPUs on one host's NVLink).
# The tp=2 run predates loss parallelism: it gathered the logits to both ranks, as it is planned here.
ROWS: list[tuple[str, str, list[str], float, str, bool | None]] = [
    ("125M b32 compile", "llama_125m", ["executor=compile", "train.global_batch_size=32", "train.micro_batch_size=32"], 560_486, "r10 GPU1", False),
    ("125M b32 compile", "llama_125m", ["executor=compile", "train.global_batch_size=32", "train.micro_batch_size=32"], 543_728, "r10 GPU0", False),
    ("1B b16 compile", "llama1b", ["executor=compile", "train.global_batch_size=16", "train.micro_batch_size=16"], 68_818, "r5 profile", True),
    ("1B b16 compile", "llama1b", ["executor=compile", "train.global_batch_size=16", "train.micro_batch_size=16"], 69_942, "r8", False),
    ("7B b4 compile, in-backward, no AC", "llama7b", ["executor=compile", "train.global_batch_size=4", "train.micro_batch_size=4", *IN_BACKWARD], 13_213, "r11", False),
    ("7B b3 compile, in-backward, no AC", "llama7b", ["executor=compile", "train.global_batch_size=3", "train.micro_batch_size=3", *IN_BACKWARD], 12_605, "r8", False),
    ("7B b4 compile, full AC", "llama7b", ["executor=compile", "train.global_batch_size=4", "train.micro_batch_size=4", "sharding.activation_checkpointing=full"], 10_325, "r5", False),
    ("7B b8 compile, full AC", "llama7b", ["executor=compile", "train.global_batch_size=8", "train.micro_batch_size=8", "sharding.activation_checkpointing=full"], 10_963, "r5", False),
    ("7B micro 1 x 8 compile, no AC", "llama7b", ["executor=compile", "train.global_batch_size=8", "train.micro_batch_size=1"], 11_030, "r5", False),
    ("7B b4 compile, AC budget 0.5", "llama7b", ["executor=compile", "train.global_batch_size=4", "train.micro_batch_size=4", "sharding.activation_checkpointing=budget"], 11_171, "r8", False),
    ("1B 1 GPU, global 8 micro 4", "llama1b", ["executor=compile", "train.global_batch_size=8", "train.micro_batch_size=4"], 64_663, "multi-GPU s2", False),
    ("1B ddp 2 GPUs, micro 4", "llama1b", ["executor=compile", "mesh=2", "sharding=ddp", "train.global_batch_size=8", "train.micro_batch_size=4"], 109_165, "multi-GPU s2", True),
    ("1B fsdp 2 GPUs, micro 4", "llama1b", ["executor=compile", "mesh=2", "sharding=fsdp", "train.global_batch_size=8", "train.micro_batch_size=4"], 104_070, "multi-GPU s2", False),
    ("1B hsdp 2x1 (= ddp by degrees)", "llama1b", ["executor=compile", "mesh.shape=[2,1]", "sharding=hsdp", "train.global_batch_size=8", "train.micro_batch_size=4"], 104_927, "multi-GPU s2", None),
    ("1B tp=2, micro 4, gathered logits", "llama1b", ["executor=compile", "mesh=2", "sharding=tp", "sharding.tp=2", "train.global_batch_size=8", "train.micro_batch_size=4", "parallel.loss_parallel=false"], 73_001, "multi-GPU s2", True),
    ("7B fsdp 2 GPUs, micro 4", "llama7b", ["executor=compile", "mesh=2", "sharding=fsdp", "train.global_batch_size=8", "train.micro_batch_size=4"], 22_462, "multi-GPU s2", False),
    # Llama-3-8B at 8K on one H200 (issue 28): the runs as filed (synthetic data, full AC), then the
    # masked rows of sessions 14-15 (real packed text, FA4's varlen kernel, no recompute unless named).
    ("8B 8K bf16, full AC", "llama3_8b", [*ISSUE_28, "data=synthetic", "sharding.activation_checkpointing=full"], 8_670, "issue 28", False),
    ("8B 8K float8, full AC", "llama3_8b", [*ISSUE_28, "data=synthetic", "sharding.activation_checkpointing=full", *FLOAT8], 10_814, "issue 28", False),
    ("8B 8K float8 masked", "llama3_8b", [*ISSUE_28, *MASKED, *FLOAT8], 14_146, "s15 m1", False),
    ("8B 8K float8 masked", "llama3_8b", [*ISSUE_28, *MASKED, *FLOAT8], 13_939, "s15 m3", False),
    ("8B 8K float8 masked, moments bf16", "llama3_8b", [*ISSUE_28, *MASKED, *FLOAT8, *BF16_MOMENTS], 14_244, "s15 m1", False),
    ("8B 8K float8 masked, moments bf16, 2 rows", "llama3_8b", [*ISSUE_28, *MASKED, *FLOAT8, *BF16_MOMENTS, *TWO_ROWS], 16_200, "s15 m3", False),
    ("8B 8K float8 masked, moments bf16, 2 rows", "llama3_8b", [*ISSUE_28, *MASKED, *FLOAT8, *BF16_MOMENTS, *TWO_ROWS], 15_802, "s15 m1", False),
    ("8B 8K bf16 masked, moments bf16", "llama3_8b", [*ISSUE_28, *MASKED, *BF16_MOMENTS], 10_809, "s15 m3", False),
    ("8B 8K bf16 masked, AC budget 0.98", "llama3_8b", [*ISSUE_28, *MASKED, "sharding.activation_checkpointing=budget", "sharding.activation_memory_budget=0.98"], 10_464, "s14 Z", False),
    ("8B 8K bf16, activation offload", "llama3_8b", [*ISSUE_28, "sharding.activation_offload=true"], 3_331, "s15 m4", False),
]  # fmt: skip


def main() -> int:
    print("| run | PERF.md | measured ms | predicted ms | error | predicted MFU | note |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for label, recipe, overrides, measured_tps, source, calibration in ROWS:
        # Named presets and AC as the runs had them (the default then was sharding=ddp, AC none).
        extra = [] if any(o.startswith("sharding=") for o in overrides) else ["sharding=ddp"]
        if not any(o.startswith("sharding.activation_checkpointing") for o in overrides):
            extra.append("sharding.activation_checkpointing=none")
        cfg = compose_recipe(recipe, [*H200, *extra, *overrides])
        plan = make_plan(cfg)
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        measured = tokens / measured_tps
        predicted = plan.prediction.step_time_s
        err = predicted / measured - 1
        if calibration is False:
            errors.append(abs(err))
        note = {True: "calibration", None: "declared 2 nodes, ran on 1 host", False: ""}[calibration]
        print(
            f"| {label} | {source} | {measured * 1e3:.1f} | {predicted * 1e3:.1f} | {err:+.1%} | "
            f"{plan.prediction.mfu:.1%} | {note} |"
        )
    within = sum(e <= 0.15 for e in errors)
    print(f"\n{within} of {len(errors)} predicted rows within 15%; worst {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
