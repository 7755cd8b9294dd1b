#!/usr/bin/env bash
# Float8 loss parity over seeds, on one GPU. For each seed, the 125M on
# bytes of the stdlib corpus, 500 steps at the recipe's lr 6e-4 / warmup 10, in
# three numerics with the same seed and batches: bf16, float8 tensorwise with e5m2 output gradients
# (torchao's default), and with e4m3 ones (model.float8_grad_dtype). The three runs of a seed share
# the GPU at once (their speeds mean nothing here; the loss does), seed after seed, so a timeout
# still leaves whole seeds. Usage: OUT=DIR DEADLINE_S=N bash benchmarks/float8_seeds.sh
# Run dirs go to /tmp/float8_seeds; $OUT gets runs.tgz (metrics, summaries, logs; refreshed after each seed),
# then the table and plot of benchmarks/float8_seeds.py.
set -u
OUT=${OUT:-outputs/float8_seeds}
mkdir -p "$OUT"
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-500}
DEADLINE=$((SECONDS + ${DEADLINE_S:-430}))
RUNS=/tmp/float8_seeds
mkdir -p $RUNS
export PYTHONUNBUFFERED=1
python3 -c "import torch, torchao; print(torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())"
common="recipe=llama_125m model.vocab_size=256 data.source=stdlib run.device=cuda mesh/hardware=h200 executor=compile
  train.steps=$STEPS train.log_every=10 train.eval_every=100 train.eval_batches=4 logger.progress_bar=false"
tw="model.float8=tensorwise model.float8_size_filter=false"
numerics() {  # NAME -> its overrides
  case $1 in
    bf16) echo "model.float8=none" ;;
    e5m2) echo "$tw model.float8_grad_dtype=e5m2" ;;
    e4m3) echo "$tw model.float8_grad_dtype=e4m3" ;;
  esac
}
need=100 # seconds a seed needs, a first guess; then the last seed's own time
for seed in $SEEDS; do
  left=$((DEADLINE - SECONDS))
  if ((left < need)); then
    echo "seed $seed skipped: $left s left before the deadline, a seed took $need"
    continue
  fi
  start=$SECONDS
  echo "=== seed $seed $(date +%T), $left s left"
  for n in bf16 e5m2 e4m3; do
    # shellcheck disable=SC2046
    timeout "$left" python3 train.py $common $(numerics $n) train.seed=$seed \
      hydra.run.dir=$RUNS/${n}_s$seed >$RUNS/${n}_s$seed.log 2>&1 &
  done
  wait
  need=$((SECONDS - start))
  for n in bf16 e5m2 e4m3; do
    echo "$n seed $seed: $(tail -n 2 $RUNS/${n}_s$seed.log | tr '\n' ' ')"
  done
  (cd $RUNS && tar czf "$OUT/runs.tgz" $(ls -d */metrics.jsonl */summary.json *.log 2>/dev/null))
done
echo "=== done $(date +%T)"
python3 benchmarks/float8_seeds.py $RUNS --out "$OUT/parity_seeds.png" >"$OUT/parity_seeds.md" 2>&1
cat "$OUT/parity_seeds.md"
