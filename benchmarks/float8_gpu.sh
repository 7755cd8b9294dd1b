#!/usr/bin/env bash
# Float8 training on one GPU: speed beside bf16 and the hand loop, loss parity with bf16, and what
# closes the parity gap. Usage: bash benchmarks/float8_gpu.sh PHASE...
#   smoke         train.py on llama_tiny with float8, verify=on (numerics figures) and injected NaNs (the fallback)
#   speed         the 1B speed table (benchmarks/rounds/r12_speed.txt)
#   rowwise       the 1B rowwise rows (r12_rowwise.txt)
#   7b            the 7B rows (r12_7b.txt)
#   fused_ce      the 1B's loss head as a fused linear cross-entropy (liger, cce) beside bf16 and float8,
#                 framework and hand loop, float8 with CUDA graphs (r13_speed.txt); prints the versions of
#                 triton, liger-kernel and cut-cross-entropy first
#   parity        the 125M for STEPS (default 500) steps on the stdlib corpus: bf16 vs tensorwise vs rowwise, plot
#   diag          which layers / which learning rate make tensorwise miss parity on the 125M (after parity)
#   parity_levers the 125M's float8 parity gap against the gradients' float8 format and fast accumulation
#                 (r13_parity.txt, 500 steps), tables and plot
# Float8 parity over seeds: benchmarks/float8_seeds.sh. Run dirs go to /tmp (a run dir holds more files
# than a device call brings back); tables, logs and the plots go to $OUT.
set -u
OUT=${OUT:-outputs/float8}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-500}
python3 -c "import torch, torchao; print(torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    smoke)
      python3 train.py recipe=llama_tiny run.device=cuda executor=compile verify=on model.float8=tensorwise \
        model.float8_size_filter=false train.steps=12 train.log_every=2 'verify.inject_nan_steps=[4,5,6]' \
        logger.progress_bar=false hydra.run.dir=/tmp/smoke > /tmp/smoke.log 2>&1
      echo "rc $?"; tail -5 /tmp/smoke.log; grep -h "numerics\|bad_steps" /tmp/smoke/verification.md
      python3 -c "import json; d=json.load(open('/tmp/smoke/verification.json')); print([c['figures'] for c in d['checks'] if c['name']=='numerics'])"
      ;;
    diag)
      run125() {  # NAME OVERRIDES...
        local name=$1; shift
        python3 train.py recipe=llama_125m model.vocab_size=256 data.source=stdlib run.device=cuda executor=compile \
          train.steps=$STEPS train.log_every=10 train.eval_every=100 train.eval_batches=4 logger.progress_bar=false \
          hydra.run.dir=/tmp/par/$name "$@" > /tmp/par_$name.log 2>&1
        echo "$name rc $?"; grep "val loss\|throughput" /tmp/par_$name.log
      }
      run125 tw_default model.float8=tensorwise
      run125 tw_ffn_only model.float8=tensorwise model.float8_size_filter=false 'model.float8_skip=[output,attention]'
      run125 bf16_lr3e-4 model.float8=none train.lr=3e-4 train.warmup_steps=50
      run125 tw_lr3e-4 model.float8=tensorwise model.float8_size_filter=false train.lr=3e-4 train.warmup_steps=50
      python3 benchmarks/float8_parity.py --out "$OUT/diag_layers.png" bf16=/tmp/par/none tensorwise_all=/tmp/par/tensorwise \
        tensorwise_default_filter=/tmp/par/tw_default tensorwise_ffn_only=/tmp/par/tw_ffn_only | tee "$OUT/diag.md"
      python3 benchmarks/float8_parity.py --out "$OUT/diag_lr.png" bf16_lr3e-4=/tmp/par/bf16_lr3e-4 \
        tensorwise_lr3e-4=/tmp/par/tw_lr3e-4 | tee -a "$OUT/diag.md"
      tar czf "$OUT/diag_metrics.tgz" -C /tmp par
      ;;
    speed|rowwise|7b)
      python3 benchmarks/gpu_bench.py --variants benchmarks/rounds/r12_$phase.txt --steps ${BENCH_STEPS:-20} --out /tmp/bench_$phase
      cp /tmp/bench_$phase/bench.md "$OUT/bench_$phase.md"
      tar czf "$OUT/logs_$phase.tgz" -C /tmp/bench_$phase $(cd /tmp/bench_$phase && ls *.log *.json)
      ;;
    parity)
      for f in none tensorwise rowwise; do
        python3 train.py recipe=llama_125m model.vocab_size=256 data.source=stdlib run.device=cuda executor=compile \
          model.float8=$f model.float8_size_filter=false train.steps=$STEPS train.log_every=10 train.eval_every=100 \
          train.eval_batches=4 logger.progress_bar=false hydra.run.dir=/tmp/par/$f > /tmp/par_$f.log 2>&1
        echo "$f rc $?"; grep -A12 "summary:" /tmp/par_$f.log | tail -11
      done
      python3 benchmarks/float8_parity.py --out "$OUT/parity_125m.png" --title "llama_125m (bytes, stdlib corpus, b16 x 2048): float8 vs bf16" \
        bf16=/tmp/par/none tensorwise=/tmp/par/tensorwise rowwise=/tmp/par/rowwise | tee "$OUT/parity_125m.md"
      tar czf "$OUT/parity_metrics.tgz" -C /tmp par
      ;;
    fused_ce)
      python3 -c "import torch, triton, torchao, liger_kernel, cut_cross_entropy as c; print(torch.__version__, 'triton', triton.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())"
      python3 benchmarks/gpu_bench.py --variants benchmarks/rounds/r13_speed.txt --steps ${BENCH_STEPS:-20} --out /tmp/bench_fused_ce
      cp /tmp/bench_fused_ce/bench.md "$OUT/bench_fused_ce.md"
      tar czf "$OUT/logs_fused_ce.tgz" -C /tmp/bench_fused_ce $(cd /tmp/bench_fused_ce && ls *.log *.json)
      ;;
    parity_levers)
      d=/tmp/bench_levers
      python3 benchmarks/gpu_bench.py --variants benchmarks/rounds/r13_parity.txt --steps 500 --out $d
      cp $d/bench.md "$OUT/bench_parity_levers.md"
      python3 benchmarks/float8_parity.py --out "$OUT/parity_levers.png" \
        --title "llama_125m, stdlib bytes, b16x2048, lr 6e-4 / warmup 10: what closes the float8 gap" \
        bf16=$d/v00-llama_125m-compile tensorwise=$d/v01-llama_125m-compile \
        tensorwise_grad_e4m3=$d/v02-llama_125m-compile tensorwise_no_fast_accum=$d/v03-llama_125m-compile | tee "$OUT/parity_levers.md"
      tar czf "$OUT/logs_parity_levers.tgz" -C $d $(cd $d && ls *.log *.json) $(cd $d && ls -d v0*/metrics.jsonl)
      ;;
    *)
      echo "unknown phase $phase (smoke speed rowwise 7b fused_ce parity diag parity_levers)"; exit 2
      ;;
  esac
done
