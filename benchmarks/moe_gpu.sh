#!/usr/bin/env bash
# An MoE recipe's shape on one GPU (Qwen3-30B-A3B by default; RECIPE= any MoE recipe): `python train.py`
# beside the hand loop of benchmarks/moe_gpu.py and torchtitan's own model code for the same shape
# (benchmarks/titan_peer.py) in the same call, grouped GEMM and per-expert loop, and grouped_mm_probe.py.
#
#   bash benchmarks/moe_gpu.sh PHASE...      (from the repo root on the GPU machine; tables in $OUT)
#
# Phases: setup (the wheels in .whl), probe (benchmarks/grouped_mm_probe.py), hand:KERNEL:EXEC[:FLAG...]
# (the hand loop, e.g. hand:grouped:compile; flags: guard, float8), titan[:eager] (torchtitan 0.2.2's
# model classes in the same loop, compiled as torchtitan compiles them), fw:KERNEL:EXEC[:float8] (one
# train.py run; PROFILE=1 adds a profiled step), table (every run so far into $OUT/results.md).
# float8: the experts' grouped GEMMs in torchao's float8 rowwise (model.float8=$FLOAT8, rowwise by
# default: at this shape its size filter keeps every Linear layer bf16, so only the experts change,
# as in the hand loop's --float8), e.g. bf16 against float8 in one call:
#   bash benchmarks/moe_gpu.sh setup hand:grouped:compile hand:grouped:compile:float8 \
#     fw:grouped:compile fw:grouped:compile:float8 table
# Environment: RECIPE (qwen3_30b_a3b), LAYERS (8: fits with room, the planner predicts 75 GiB), PATTERN
# (model.layer_pattern for LAYERS where the recipe has one), SEQ (4096), BATCH (2), STEPS (12), FLOAT8
# (rowwise), HW (the mesh/hardware profile: h200 or h100_sxm, from nvidia-smi). E.g. DeepSeek-V3's
# Moonlight shape cut to 4 layers:
#   RECIPE=moonlight_16b_a3b LAYERS=4 PATTERN='dense x1, moe x3' bash benchmarks/moe_gpu.sh setup \
#     titan hand:grouped:compile fw:grouped:compile table
set -u
OUT=${OUT:-outputs/moe_gpu}
mkdir -p "$OUT" /tmp/r /tmp/site
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TORCHINDUCTOR_CACHE_DIR=/tmp/ind PYTHONPATH=/tmp/site:$PWD
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # the hand loop; train.py sets it itself
LAYERS=${LAYERS:-8}
SEQ=${SEQ:-4096}
BATCH=${BATCH:-2}
STEPS=${STEPS:-12}
RECIPE=${RECIPE:-qwen3_30b_a3b}
PATTERN=${PATTERN:-}  # model.layer_pattern for LAYERS where the recipe has one ('dense x1, moe x3')
HW=${HW:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && echo h200 || echo h100_sxm)}
TAG="${RECIPE}_L$LAYERS"
common=("recipe=$RECIPE" "model.n_layers=$LAYERS" run.device=cuda "mesh/hardware=$HW" data=synthetic
  "train.seq_len=$SEQ" "train.global_batch_size=$BATCH" "train.micro_batch_size=$BATCH"
  train.optimizer_in_backward=true train.grad_clip=0 "train.steps=$STEPS" "train.log_every=$STEPS"
  train.eval_every=0 checkpoint=none logger.progress_bar=false logger.plot=false
  sharding.activation_checkpointing=none)
[[ -n $PATTERN ]] && common+=("model.layer_pattern='$PATTERN'")
pattern_arg=(); [[ -n $PATTERN ]] && pattern_arg=(--pattern "$PATTERN")

for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
      ;;
    probe)
      timeout 120 python3 benchmarks/grouped_mm_probe.py --device cuda > "$OUT/probe.txt" 2>&1
      echo "rc $?"; tail -8 "$OUT/probe.txt"
      ;;
    hand:*)
      IFS=: read -r _ kernel exec flags <<< "$phase"  # hand:grouped:compile[:guard][:float8]
      flag=--compile; [[ $exec == eager ]] && flag=--no-compile
      suffix=
      for f in ${flags//:/ }; do flag="$flag --$f"; suffix="${suffix}_$f"; done
      name="hand_${kernel}_${exec}${suffix}_$TAG"
      # shellcheck disable=SC2086  # the flags are words
      timeout "${HAND_TIMEOUT:-240}" python3 benchmarks/moe_gpu.py hand --recipe "$RECIPE" "${pattern_arg[@]}" --layers "$LAYERS" --seq "$SEQ" \
        --batch "$BATCH" --steps "$STEPS" --kernel "$kernel" $flag --out "/tmp/r/$name.json" \
        > "/tmp/r/$name.log" 2>&1
      echo "rc $?"; grep -E '^\{|Error|error' "/tmp/r/$name.log" | tail -3
      ;;
    fw:*)
      IFS=: read -r _ kernel exec f8 <<< "$phase"  # fw:grouped:compile[:float8]
      name="fw_${kernel}_${exec}${f8:+_$f8}_$TAG"
      ov="model.moe.expert_kernel=$kernel executor=$exec"
      # float8 on the experts alone (the attention's Linear layers and the head kept bf16; the size
      # filter, which keeps this shape's experts bf16, off)
      [[ ${f8:-} == float8 ]] && ov="$ov model.float8=${FLOAT8:-rowwise} model.float8_size_filter=false model.float8_skip=[output,attention]"
      [[ ${PROFILE:-0} == 1 ]] && ov="$ov run.profile=true run.profile_wait=8 run.profile_warmup=1 run.profile_active=1"
      # shellcheck disable=SC2086  # the overrides are words
      timeout "${FW_TIMEOUT:-240}" python3 train.py "${common[@]}" $ov ${FW_EXTRA:-} \
        "hydra.run.dir=/tmp/r/$name" > "/tmp/r/$name.log" 2>&1
      echo "rc $?"; grep -E "tokens/s|tok/s|error|Error|refused|fallback|fell back" "/tmp/r/$name.log" | tail -4
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('tokens_per_s','step_p50_s','mfu','peak_mem_gib','time_to_first_step_s','final_loss','executor')})" \
        "/tmp/r/$name/summary.json" 2>/dev/null
      [[ -f /tmp/r/$name/profile/top_ops_rank0.json ]] && cp "/tmp/r/$name/profile/top_ops_rank0.json" "$OUT/top_ops_$name.json"
      ;;
    titan*)
      IFS=: read -r _ exec <<< "$phase"  # titan[:eager]: torchtitan's model code (benchmarks/titan_peer.py)
      flag=--compile; [[ ${exec:-} == eager ]] && flag=--no-compile
      name="titan_${exec:-compile}_$TAG"
      timeout "${HAND_TIMEOUT:-240}" python3 benchmarks/titan_peer.py --recipe "$RECIPE" "${pattern_arg[@]}" \
        --layers "$LAYERS" --seq "$SEQ" --batch "$BATCH" --steps "$STEPS" $flag --out "/tmp/r/$name.json" \
        > "/tmp/r/$name.log" 2>&1
      echo "rc $?"; grep -E '^\{|Error|error|failed' "/tmp/r/$name.log" | tail -3
      ;;
    table)
      # shellcheck disable=SC2046
      python3 benchmarks/moe_gpu.py table --hand /tmp/r/hand_*.json /tmp/r/titan_*.json --runs $(ls -d /tmp/r/fw_*/ 2>/dev/null) \
        | tee "$OUT/results.md"
      python3 -c "import json,sys; print(json.dumps([r for f in sys.argv[1:] for r in json.load(open(f))], indent=1))" \
        /tmp/r/hand_*.json /tmp/r/titan_*.json > "$OUT/loops.json" 2>/dev/null
      tar czf "$OUT/logs.tgz" -C /tmp/r $(cd /tmp/r && ls ./*.log) 2>/dev/null
      ;;
    *) echo "unknown phase $phase" >&2 ;;
  esac
done
