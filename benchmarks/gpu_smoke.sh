#!/usr/bin/env bash
# A GPU smoke test of main on one device call (CI has no GPU): the suite's CUDA-only tests, then the
# 125M recipe through train.py (default: compile; EXECUTORS="compile cudagraphs" for both), a few steps.
# Usage, from the source tree on the GPU machine: OUT=... bash benchmarks/gpu_smoke.sh
# Needs the wheels in .whl (hydra-core, omegaconf, antlr4, torchao, liger-kernel, cut-cross-entropy).
set -u
OUT=${OUT:-outputs/smoke}
mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=offline TORCHINDUCTOR_CACHE_DIR=/tmp/ind
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "=== cuda tests $(date +%T)"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  "tests/kernels/test_fused_ce.py::test_fused_loss_and_gradients_match_the_unfused_head" \
  "tests/train/test_loop.py::test_host_io_ring_copies_in_and_out" \
  "tests/train/test_loop.py::test_optimizer_in_backward_side_stream_matches_the_plain_step" \
  "tests/models/test_model.py::test_flex_attention_trains_like_the_sdpa_mask_on_cuda" 2>&1 | tail -15 | tee "$OUT/tests.txt"
for ex in ${EXECUTORS:-compile}; do
  ex=executor=$ex
  echo "=== train.py recipe=llama_125m $ex $(date +%T)"
  timeout "${TRAIN_TIMEOUT:-90}" python3 train.py recipe=llama_125m "$ex" train.steps=20 train.log_every=5 mesh/hardware=h200 \
    train.eval_every=0 "hydra.run.dir=/tmp/smoke/${ex#executor=}" > "$OUT/train_${ex#executor=}.log" 2>&1
  echo "rc $?"; grep -E "step +[0-9]+|tok/s|error" "$OUT/train_${ex#executor=}.log" | tail -4
done
