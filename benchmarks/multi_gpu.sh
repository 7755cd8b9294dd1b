#!/usr/bin/env bash
# Multi-GPU validation (issue 9), one call on a machine with >= 2 GPUs:
#   bash benchmarks/multi_gpu.sh [NGPU] [STEPS]
# Trains llama1b (compiled, bf16 autocast) on 1 GPU and on NGPU GPUs with fsdp and ddp at the same
# global batch, and prints each run's loss trace, tokens/s and peak memory next to the plan's
# prediction. NVLink multicast stays off (the machine's NCCL_NVLS_ENABLE=0 is never overridden).
set -u
N=${1:-2}; STEPS=${2:-20}; OUT=${OUT:-outputs/multi_gpu}
COMMON="recipe=llama1b executor=compile mesh/hardware=h200 train.steps=$STEPS train.log_every=5 train.global_batch_size=8 train.micro_batch_size=4 run.device=cuda"
run() { name=$1; shift; timeout 240 python3 train.py hydra.run.dir=$OUT/$name $COMMON "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?"; }
mkdir -p $OUT
run one mesh=1
run fsdp mesh=$N sharding=fsdp
run ddp mesh=$N sharding=ddp nccl=debug
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("one", "fsdp", "ddp"):
    d = out / name
    if not (d / "summary.json").is_file():
        print(f"{name}: no summary (see {d}.log)"); continue
    s = json.loads((d / "summary.json").read_text())
    plan = json.loads((d / "plan.json").read_text())
    rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    losses = [round(r["loss"], 4) for r in rows if "loss" in r]
    pred = plan.get("memory", {}).get("total", 0) / 2**30
    print(f"{name}: world {s['world_size']} tok/s {s['tokens_per_s']:,.0f} peak {s['peak_mem_gib']:.1f} GiB "
          f"(plan {pred:.1f}) losses {losses}")
print("topology dump:", sorted(p.name for p in (out / "ddp").glob("*topo*")))
PY
