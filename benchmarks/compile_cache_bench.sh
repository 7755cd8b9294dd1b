#!/usr/bin/env bash
# Time to first step on a "fresh node" (empty Inductor cache), cold vs warm from executor.cache_dir:
#   bash benchmarks/compile_cache_bench.sh [OVERRIDE ...]
# e.g. on a GPU: bash benchmarks/compile_cache_bench.sh recipe=llama1b executor=compile \
#        mesh/hardware=h200 run.device=cuda train.global_batch_size=8 train.micro_batch_size=8
# Runs train.py three times, each with its own empty TORCHINDUCTOR_CACHE_DIR: no cache dir, a cold
# cache dir (filled by this run), and the same cache dir again (warm). Prints time to first step,
# compile time and the cache counters of each.
set -u
OUT=${OUT:-outputs/compile_cache_bench}
rm -rf "$OUT"; mkdir -p "$OUT"
ARGS=("executor=compile" "train.steps=${STEPS:-8}" "train.eval_every=0" "train.log_every=4" "$@")
one() {
  name=$1; shift
  TORCHINDUCTOR_CACHE_DIR="$OUT/inductor-$name" python3 train.py hydra.run.dir="$OUT/$name" "${ARGS[@]}" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}
one none
one cold "executor.cache_dir=$OUT/cache"
one warm "executor.cache_dir=$OUT/cache"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| run | time to first step s | compile s | cache |\n|---|---|---|---|")
for name in ("none", "cold", "warm"):
    p = Path(sys.argv[1]) / name / "summary.json"
    if not p.is_file():
        print(f"| {name} | failed | | |"); continue
    s = json.loads(p.read_text())
    print(f"| {name} | {s['time_to_first_step_s']:.1f} | {s['compile_s'] or 0:.1f} | {s.get('compile_cache')} |")
PY
