#!/usr/bin/env bash
# Context parallelism through the real launcher (issue 15), one device call on a machine with >= 4
# GPUs (2 for the first two cases):
#   bash benchmarks/cp_gpu.sh [STEPS] [CASE ...]
# Cases (default: one cp2 cp2_dp2): `python train.py` with the smallest recipe (llama_tiny, seq 128,
# global batch 16), same seed and data, as one process and with cp=2 (and cp=2 x dp_shard=2), one
# rank per GPU on NCCL. The summary prints each step's loss and gradient norm next to the
# one-process run's, with the largest relative difference. The launcher's loop runs bf16 autocast
# on CUDA, so the differences here are bf16 rounding; the fp32 equivalence (rtol 1e-5) is
# tests/parallel/test_context_parallel.py's CUDA tests. Each run's log is $OUT/NAME.log.
set -u
STEPS=${1:-20}; shift 2>/dev/null || true
CASES=${*:-one cp2 cp2_dp2}
OUT=${OUT:-outputs/cp_gpu}
COMMON="recipe=llama_tiny mesh/hardware=h200 run.device=cuda train.steps=$STEPS train.log_every=1 train.eval_every=0 checkpoint=none"
run() {
  name=$1; shift
  start=$(date +%s)
  timeout ${CASE_TIMEOUT:-240} python3 train.py hydra.run.dir=$OUT/$name $COMMON "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - start ))s: $*"
}
mkdir -p $OUT
for c in $CASES; do
  case $c in
    one) run one mesh=1 ;;
    cp2) run cp2 mesh=2 parallel.cp=2 ;;
    cp2_dp2) run cp2_dp2 mesh=4 parallel.cp=2 parallel.dp_shard=2 ;;
    *) echo "unknown case $c"; exit 2 ;;
  esac
done
python3 - "$OUT" $CASES <<'PY'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
runs = {}
for name in names:
    path = out / name / "metrics.jsonl"
    if not path.is_file():
        log = out / f"{name}.log"
        print(f"{name}: no metrics; log tail:\n" + "\n".join(log.read_text().splitlines()[-12:]))
        continue
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    runs[name] = {r["step"]: r for r in rows if "loss" in r and "step" in r}
if "one" not in runs:
    sys.exit(0)
ref = runs["one"]
others = [n for n in names if n in runs and n != "one"]
print("step  " + "  ".join(f"{n + ' loss':>14s} {n + ' gnorm':>14s}" for n in ["one"] + others))
for step in sorted(ref):
    cells = [f"{runs[n][step]['loss']:14.6f} {runs[n][step].get('grad_norm', float('nan')):14.6f}"
             for n in ["one"] + others if step in runs[n]]
    print(f"{step:4d}  " + "  ".join(cells))
for n in others:
    common = [s for s in ref if s in runs[n]]
    if not common:
        print(f"{n}: no step rows; see {out}/{n}.log")
        continue
    dl = max(abs(runs[n][s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in common)
    dg = max(abs(runs[n][s]["grad_norm"] - ref[s]["grad_norm"]) / abs(ref[s]["grad_norm"]) for s in common)
    ms = sorted(runs[n][s].get("step_ms", 0) for s in common)[len(common) // 2]
    print(f"{n}: {len(common)} steps, max rel diff vs one process: loss {dl:.2e}, grad norm {dg:.2e}; "
          f"median step {ms:.0f} ms (one: {sorted(ref[s].get('step_ms', 0) for s in common)[len(common) // 2]:.0f} ms)")
PY
