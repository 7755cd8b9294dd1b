#!/usr/bin/env bash
# LoRA vs full fine-tuning of the Llama-3-8B shape on one H200 (issue 27, point 5): peak memory and
# tokens/s from each run's summary.json (figures: benchmarks/PERF.md, python -m benchmarks).
# Usage: bash benchmarks/lora_gpu.sh   (STEPS=20, SEQ=2048 by default; run dirs in /tmp, table in $OUT)
# Random weights are enough for memory and speed (model.init_from=HF_DIR for a real 8B); the base
# of the bf16 rows is held in bf16 (peft.base_dtype=bfloat16), the rest autocasts to bf16 on CUDA.
# Full fine-tuning of 8B with AdamW needs ~16 bytes/parameter (weights, grads, two moments: ~128 GB)
# before activations: it is expected not to fit one H200 without activation checkpointing and may
# be refused by the planner: run.allow_over_memory=true runs every row anyway.
set -u
OUT=${OUT:-outputs/lora_gpu}
mkdir -p "$OUT"
STEPS=${STEPS:-20}
SEQ=${SEQ:-2048}
common=(recipe=llama3_8b run.device=cuda mesh=1 mesh/hardware=h200 data=synthetic train.steps=$STEPS train.seq_len=$SEQ
  train.global_batch_size=1 train.micro_batch_size=1 train.eval_every=0 freeze=none logger.plot=false
  sharding.activation_checkpointing=full checkpoint=none logger.progress_bar=false
  run.allow_over_memory=true)  # the planner's memory estimate does not count LoRA's savings yet
run() {  # NAME OVERRIDES...
  local name=$1; shift
  python3 train.py "${common[@]}" "$@" hydra.run.dir=/tmp/lora_$name > "$OUT/$name.log" 2>&1
  echo "$name rc $?"
  python3 -c "import json,sys; d=json.load(open('/tmp/lora_$name/summary.json')); print(sys.argv[1], d['peak_mem_gib'], d['tokens_per_s'])" "$name" >> "$OUT/table.txt" 2>/dev/null || echo "$name: no summary" >> "$OUT/table.txt"
}
echo "name peak_mem_gib tokens_per_s" > "$OUT/table.txt"
run full
run lora_r16_fp32base peft=lora peft.rank=16 peft.alpha=32 'peft.targets=[wq,wk,wv,wo,w1,w2,w3]'
run lora_r16_bf16base peft=lora peft.rank=16 peft.alpha=32 'peft.targets=[wq,wk,wv,wo,w1,w2,w3]' peft.base_dtype=bfloat16
cat "$OUT/table.txt"
