#!/usr/bin/env bash
# Round 13 on one H200 (benchmarks/PERF.md). Usage: bash benchmarks/gpu_round13.sh PHASE...
#   env     versions of torch, triton, torchao, liger-kernel, cut-cross-entropy
#   speed   the 1B speed table (rounds/r13_speed.txt): fused cross-entropy, float8, hand loops, CUDA graphs
#   parity  the 125M float8 parity diagnosis (rounds/r13_parity.txt), tables and plots
# Run dirs go to /tmp; tables, the plots and a tarball of logs go to $OUT (a device call brings back
# at most 8 files).
set -u
OUT=${OUT:-outputs/r13}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    env)
      python3 -c "import torch, triton, torchao, liger_kernel, cut_cross_entropy as c; print(torch.__version__, 'triton', triton.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())"
      ;;
    speed)
      python3 benchmarks/gpu_bench.py --variants benchmarks/rounds/r13_speed.txt --steps ${BENCH_STEPS:-20} --out /tmp/b13_speed
      cp /tmp/b13_speed/bench.md "$OUT/bench_speed.md"
      tar czf "$OUT/logs_speed.tgz" -C /tmp/b13_speed $(cd /tmp/b13_speed && ls *.log *.json)
      ;;
    parity)
      python3 benchmarks/gpu_bench.py --variants benchmarks/rounds/r13_parity.txt --steps 500 --out /tmp/b13_par
      cp /tmp/b13_par/bench.md "$OUT/bench_parity.md"
      d=/tmp/b13_par
      python3 benchmarks/float8_parity.py --out "$OUT/parity_diag.png" \
        --title "llama_125m, stdlib bytes, b16x2048, lr 6e-4 / warmup 10: what closes the float8 gap" \
        bf16=$d/v00-llama_125m-compile tensorwise=$d/v01-llama_125m-compile \
        tensorwise_grad_e4m3=$d/v02-llama_125m-compile tensorwise_no_fast_accum=$d/v03-llama_125m-compile | tee "$OUT/parity.md"
      tar czf "$OUT/logs_parity.tgz" -C $d $(cd $d && ls *.log *.json) $(cd $d && ls -d v0*/metrics.jsonl)
      ;;
  esac
done
