#!/usr/bin/env bash
# Multi-GPU validation (issue 9), one device call on a machine with >= 2 GPUs:
#   bash benchmarks/multi_gpu.sh NGPU STEPS [CASE ...]
# Cases (default: one fsdp ddp): see `case` below. Every case trains through `python train.py` (the
# real launcher, one process per GPU, NCCL) at the same global batch, and the summary prints each
# run's loss trace, tokens/s and peak memory next to the plan's prediction, the verification result,
# the restart/resume events of the fault case and the topology dump of the nccl=debug case.
# NVLink multicast stays off: the machine's NCCL_NVLS_ENABLE=0 is never overridden.
set -u
N=${1:-2}; STEPS=${2:-20}; shift 2 2>/dev/null || shift $#
CASES=${*:-one fsdp ddp}
OUT=${OUT:-outputs/multi_gpu}
RECIPE=${RECIPE:-llama1b}
GBS=${GBS:-8}; MBS=${MBS:-4}
COMMON="recipe=$RECIPE executor=compile mesh/hardware=h200 train.steps=$STEPS train.log_every=5 train.eval_every=0 train.global_batch_size=$GBS train.micro_batch_size=$MBS run.device=cuda"
run() {
  name=$1; shift
  start=$(date +%s)
  timeout ${CASE_TIMEOUT:-300} python3 train.py hydra.run.dir=$OUT/$name $COMMON "$@" > $OUT/$name.log 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s: $*"
  # FAIL_FAST=1: stop at the first failing case (saves device time when something is broken).
  if [ $rc != 0 ] && [ "${FAIL_FAST:-0}" = 1 ]; then tail -20 $OUT/$name.log; exit 1; fi
}
case_() {
  case $1 in
    one) run one mesh=1 ;;
    fsdp) run fsdp mesh=$N sharding=fsdp ;;
    # DDP with the cross-rank checks (graph fingerprint, config hash, numerics vs eager) and the
    # debug preset (NCCL_TOPO_DUMP_FILE into the run dir).
    ddp) run ddp mesh=$N sharding=ddp nccl=debug verify=on ;;
    hsdp) run hsdp "mesh.shape=[2,$((N / 2))]" sharding=hsdp nccl=gdr3 ;;  # 2 "nodes" x N/2
    tp) run tp mesh=$N sharding=tp ;;  # compiled TP blocks (sequence parallel) on NCCL
    # The same with async TP (parallel.async_tp: Inductor's fused all-gather/matmul over symmetric
    # memory): its losses beside tp's, its tokens/s beside the planner's (issue 43).
    tp_async) run tp_async mesh=$N sharding=tp parallel.async_tp=true ;;
    fsdp_tp) run fsdp_tp mesh=$N sharding=fsdp_tp ;;
    # SIGKILL rank 1 at step 12: the launcher restarts every rank, they resume from step 10.
    fault) run fault mesh=$N sharding=fsdp checkpoint=sync checkpoint.every_steps=10 run.max_restarts=1 \
      run.fault_kill_at_step=12 run.fault_rank=1 ;;
    # The 7B on N GPUs with FSDP (its static state, 16 bytes/param, split N ways), no AC.
    fsdp7b) run fsdp7b mesh=$N sharding=fsdp recipe=llama7b train.global_batch_size=$((4 * N)) \
      train.micro_batch_size=4 ;;
    *) echo "unknown case $1"; exit 2 ;;
  esac
}
mkdir -p $OUT
# SUMMARY_ONLY=1: print the summary of runs already in $OUT (e.g. after a time limit cut the list).
[ "${SUMMARY_ONLY:-0}" = 1 ] || for c in $CASES; do case_ $c; done
python3 - "$OUT" $CASES <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in sys.argv[2:]:
    d = out / name
    if not (d / "summary.json").is_file():
        print(f"{name}: no summary; log tail:")
        log = Path(f"{d}.log")
        print("\n".join(log.read_text().splitlines()[-15:]) if log.is_file() else "(no log)")
        continue
    s = json.loads((d / "summary.json").read_text())
    plan = json.loads((d / "plan.json").read_text())
    rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    losses = [round(r["loss"], 4) for r in rows if "loss" in r and "event" not in r]
    pred = plan.get("memory", {}).get("total", 0) / 2**30
    peak = f"{s['peak_mem_gib']:.1f}" if s["peak_mem_gib"] is not None else "-"
    print(f"{name}: world {s['world_size']} tok/s {s['tokens_per_s']:,.0f} peak {peak} GiB "
          f"(plan {pred:.1f}) p50 {s['step_p50_s'] * 1e3:.0f} ms losses {losses}")
    for r in rows:
        if "event" in r:
            print(f"  event {r}")
    if name == "fault":
        times = [r["time"] for r in rows if r.get("step") == 15 and "loss" in r]
        kill = [r["time"] for r in rows if r.get("step") == 10 and "loss" in r]
        print(f"  loss rows at step 10: {len(kill)}, at step 15: {len(times)}")
    v = d / "verification.md"
    if v.is_file():
        print("  " + "\n  ".join(v.read_text().splitlines()[:9]))
    topo = sorted(p.name for p in d.glob("*topo*"))
    if topo:
        print(f"  topology dump: {topo}")
PY
