#!/usr/bin/env bash
# Llama-3-8B at 8K context on one H200 (issue 28): `python train.py` on real packed text (jsonl, a
# 118K-token byte-level BPE, the 8B's 128,256-row head) beside the hand-written loop of
# benchmarks/llama8b_8k.py, bf16 and float8, document mask on and off, per memory variant.
#
#   bash benchmarks/llama8b_8k.sh PHASE...      (from the repo root on the GPU machine; tables in $OUT)
#
# Phases: setup (the wheels in .whl, the documents), fa4park + fa4 (flash-attn-4, carried in two calls:
# .whl_fa4/a then .whl_fa4/b, see those phases), attn (the attention kernels at the shape),
# fw:NAME (one train.py run, NAME from the list below), hand (the hand loop's variants, HAND_VARIANTS),
# lora (benchmarks/lora_gpu.sh, issue 27), table (the table of every run so far, into $OUT/results.md),
# pack (logs, profiles and JSON into $OUT/logs.tgz: a device call brings back at most 8 files).
# The BPE is trained on this machine first (it is carried in .whl/bpe128k.json):
#   python benchmarks/gpu_bench.py's write_documents, then
#   python -m framework.data tokenizer train .whl/bpe128k.json DOCS.jsonl --vocab-size 128000
# Environment: STEPS (12), ATTN (model.attention for the unmasked runs and the hand loop: auto), FW_EXTRA
# (more overrides: model.attention=fa4 runs the masked ones on FA4's variable-length kernel),
# TAG (appended to a fw run's directory name, so one variant can run twice with other FW_EXTRA),
# BATCH (rows a step, 1), LOG_EVERY (train.log_every: STEPS).
set -u
OUT=${OUT:-outputs/llama8b_8k}
mkdir -p "$OUT" /tmp/r /tmp/site
# /tmp/site: the carried wheels (pip --target skips the CuTe DSL's .pth, hence its dsl_packages).
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TORCHINDUCTOR_CACHE_DIR=/tmp/ind
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
# flash-attn-4 keeps its compiled kernels on disk: each run (its own process) reuses them.
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_kernels
export TVM_FFI_CACHE_DIR=/tmp/tvm_ffi
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # the hand loop; train.py sets it itself
STEPS=${STEPS:-12}
BATCH=${BATCH:-1}  # 8K rows a step (train.global_batch_size = micro_batch_size: one micro batch)
ATTN=${ATTN:-auto}
BUDGET=${BUDGET:-0.85}  # sharding.activation_memory_budget of the budget variants
DOCS=/tmp/docs/docs.jsonl
WHL=${WHL:-.whl}  # the carried wheels and BPE (a copy of the tree elsewhere: WHL=PATH)
BPE=$WHL/bpe128k.json
common=(recipe=llama3_8b run.device=cuda mesh/hardware=h200 executor=compile data=jsonl "data.path=$DOCS"
  tokenizer=hf "tokenizer.path=$BPE" model.vocab_size=128256 train.seq_len=8192 "train.global_batch_size=$BATCH"
  "train.micro_batch_size=$BATCH" train.optimizer_in_backward=true train.grad_clip=0 "train.steps=$STEPS"
  "train.log_every=${LOG_EVERY:-$STEPS}" train.eval_every=0 checkpoint=none logger.progress_bar=false freeze=none
  logger.plot=false)
f8=(model.float8=tensorwise model.float8_size_filter=false)

variant() {  # NAME -> its overrides
  case $1 in
    bf16_full_nomask) echo sharding.activation_checkpointing=full ;;
    bf16_none_nomask) echo sharding.activation_checkpointing=none model.attention=$ATTN ;;
    bf16_none_mask) echo sharding.activation_checkpointing=none data.document_mask=true ;;
    bf16_budget_mask) echo sharding.activation_checkpointing=budget sharding.activation_memory_budget=$BUDGET data.document_mask=true ;;
    bf16_budget_nomask) echo sharding.activation_checkpointing=budget sharding.activation_memory_budget=$BUDGET model.attention=$ATTN ;;
    fp8_full_mask) echo sharding.activation_checkpointing=full data.document_mask=true "${f8[@]}" ;;
    fp8_none_nomask) echo sharding.activation_checkpointing=none model.attention=$ATTN "${f8[@]}" ;;
    fp8_none_mask) echo sharding.activation_checkpointing=none data.document_mask=true "${f8[@]}" ;;
    fp8_budget_mask) echo sharding.activation_checkpointing=budget sharding.activation_memory_budget=0.5 data.document_mask=true "${f8[@]}" ;;
    bf16_none_nomask_liger) echo sharding.activation_checkpointing=none model.attention=$ATTN model.fused_cross_entropy=liger ;;
    bf16_none_mask_liger) echo sharding.activation_checkpointing=none data.document_mask=true model.fused_cross_entropy=liger ;;
    bf16_selective_nomask) echo sharding.activation_checkpointing=selective model.attention=$ATTN ;;
    bf16_selective_mask) echo sharding.activation_checkpointing=selective data.document_mask=true ;;
    fp8_none_mask_fa4) echo sharding.activation_checkpointing=none data.document_mask=true model.attention=fa4 "${f8[@]}" ;;
    bf16_budget_mask_fa4) echo sharding.activation_checkpointing=budget sharding.activation_memory_budget=$BUDGET data.document_mask=true model.attention=fa4 ;;
    fp8_none_mask_liger) echo sharding.activation_checkpointing=none data.document_mask=true model.fused_cross_entropy=liger "${f8[@]}" ;;
    *) echo "unknown variant $1" >&2; return 1 ;;
  esac
}

for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl || exit 1
      python3 benchmarks/llama8b_8k.py docs /tmp/docs --mb 64
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
      free -g | head -2
      ;;
    fa4park)  # call 1: carry .whl_fa4/a (the first 60 MB of the CuTe DSL's 92 MB libs wheel) and park it
      mkdir -p /tmp/fa4_parts && cp .whl_fa4/a/part.00 /tmp/fa4_parts/ && ls -la /tmp/fa4_parts
      ;;
    fa4)  # call 2, at once on the same warm machine: carry .whl_fa4/b (the rest and the other wheels)
      whl=/tmp/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
      cat /tmp/fa4_parts/part.00 .whl_fa4/b/part.01 > $whl
      echo "50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90  $whl" | sha256sum -c || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_fa4/b/*.whl $whl || exit 1
      python3 -c "import torch, flash_attn.cute.interface, cutlass; print(torch.__version__, 'cutlass', cutlass.__version__)"
      ;;
    attn)
      timeout "${ATTN_TIMEOUT:-240}" python3 benchmarks/llama8b_8k.py attn --docs $DOCS --bpe $BPE \
        --out /tmp/r/attn.json > /tmp/r/attn.log 2>&1
      echo "rc $?"; grep '^{\|documents' /tmp/r/attn.log
      ;;
    fw:*)
      name=${phase#fw:}
      ov=$(variant "$name") || continue
      # PROFILE=1: one step under torch.profiler (the 8th: the median of 12 steps stays a plain one);
      # the top kernels go to the run's profile/top_ops_rank0.json and its log.
      [[ ${PROFILE:-0} == 1 ]] && ov="$ov run.profile=true run.profile_wait=6 run.profile_warmup=1 run.profile_active=1"
      name=$name${TAG:-}
      # shellcheck disable=SC2086  # the overrides are words
      timeout "${FW_TIMEOUT:-150}" python3 train.py "${common[@]}" $ov ${FW_EXTRA:-} \
        "hydra.run.dir=/tmp/r/$name" > "/tmp/r/$name.log" 2>&1
      echo "rc $?"; grep -E "tokens/s|tok/s|error|Error|refused" "/tmp/r/$name.log" | tail -3
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('tokens_per_s','step_p50_s','mfu','peak_mem_gib','time_to_first_step_s','final_loss','data_wait_share')})" \
        "/tmp/r/$name/summary.json" 2>/dev/null
      ;;
    hand)
      timeout "${HAND_TIMEOUT:-300}" python3 benchmarks/llama8b_8k.py hand --docs $DOCS \
        --bpe $BPE --out /tmp/r/hand.json --attention "$ATTN" --steps "$STEPS" --budget "$BUDGET" \
        --variants "${HAND_VARIANTS:-bf16:nomask,bf16:mask,float8:nomask,float8:mask}" \
        --profile-dir /tmp/r/profile --profile "${HAND_PROFILE:-bf16:nomask,float8:mask}" > /tmp/r/hand.log 2>&1
      echo "rc $?"; grep '^{' /tmp/r/hand.log; tail -3 /tmp/r/hand.log
      ;;
    lora)
      OUT=/tmp/r/lora STEPS=${LORA_STEPS:-10} timeout 330 bash benchmarks/lora_gpu.sh
      cp /tmp/r/lora/table.txt "$OUT/lora_table.txt"
      ;;
    table)
      runs=$(ls -d /tmp/r/*/ 2>/dev/null | grep -v "/profile/\|/lora/")
      # shellcheck disable=SC2086
      python3 benchmarks/llama8b_8k.py table --hand /tmp/r/hand.json --runs $runs > "$OUT/results.md"
      { echo; echo '```'; cat /tmp/r/attn.json 2>/dev/null; echo '```'; } >> "$OUT/results.md"
      cat "$OUT/results.md"
      ;;
    pack)
      tar czf "$OUT/logs.tgz" -C /tmp/r --exclude='*/.hydra' $(cd /tmp/r && ls -d *.log *.json profile lora */summary.json */metrics.jsonl */train.log */profile/top_ops_rank0.json */profile/trace_rank0.json 2>/dev/null)
      ls -la "$OUT"
      ;;
  esac
done
