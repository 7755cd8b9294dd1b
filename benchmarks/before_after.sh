#!/usr/bin/env bash
# A change that should not move the numbers (issue 17's refactor), measured on one GPU: the same
# gpu_bench variant lines from two source trees, interleaved line by line (before, after, before,
# after, ...) in one call, so that drift of the machine falls on both sides alike.
#   bash benchmarks/before_after.sh BEFORE_DIR AFTER_DIR VARIANTS_FILE [STEPS]
# Tables go to $OUT/before_after.md (one gpu_bench table per tree and line).
set -u
before=$1 after=$2 variants=$3 steps=${4:-20}
OUT=${OUT:-outputs/before_after}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
n=0
grep -v '^\s*#' "$variants" | grep -v '^\s*$' | while IFS= read -r line; do
  n=$((n + 1))
  printf '%s\n' "$line" > "/tmp/variant_$n.txt"
  for side in before after; do
    dir=$before; [[ $side == after ]] && dir=$after
    echo "=== line $n $side: $line ($(date +%T))"
    (cd "$dir" && python3 benchmarks/gpu_bench.py --variants "/tmp/variant_$n.txt" --steps "$steps" \
      --out "/tmp/ba_${side}_$n") > "/tmp/ba_${side}_$n.log" 2>&1
    echo "rc $?"
    { echo "### line $n, $side"; cat "/tmp/ba_${side}_$n/bench.md"; echo; } >> "$OUT/before_after.md"
    tail -4 "/tmp/ba_${side}_$n.log"
  done
done
cat "$OUT/before_after.md"
