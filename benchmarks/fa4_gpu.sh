#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4) through torch's flash-attention registry on one GPU: its install from
# wheels carried in two device calls, the kernels at the 1B's attention shape, the speed rows.
# Usage, from the source tree: bash benchmarks/fa4_gpu.sh PHASE...
#   install  join the nvidia-cutlass-dsl-libs-cu13 wheel (92 MB, over what one device call carries)
#            from its parts: part.00 copied to /tmp/fa4_parts by an earlier call on the same warm
#            machine, the rest in $WHEELS with the other wheels; pip install --target /tmp/site
#   check    benchmarks/fa4_check.py: kernel times at the 1B's attention shape, parity with SDPA
#   speed    gpu_bench.py --variants $VARIANTS (default benchmarks/rounds/r15_fa4.txt)
# Tables and logs go to $OUT (a device call brings back at most 8 files).
set -u
OUT=${OUT:-outputs/fa4_gpu}
WHEELS=${WHEELS:-../.whl_fa4/b}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# --target skips the package's .pth file, which puts the CuTe DSL's own packages on the path.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
# flash-attn-4 keeps its compiled kernels on disk, so each gpu_bench row (its own process) reuses them.
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_kernels
export TVM_FFI_CACHE_DIR=/tmp/tvm_ffi
for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    install)
      whl=/tmp/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
      cat /tmp/fa4_parts/part.00 "$WHEELS"/part.01 > $whl
      echo "50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90  $whl" | sha256sum -c || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        "$WHEELS"/*.whl $whl || exit 1
      python3 -c "import torch, flash_attn.cute.interface, cutlass; print(torch.__version__, 'cutlass', cutlass.__version__, torch.nn.attention.list_flash_attention_impls())"
      ;;
    check)
      timeout "${CHECK_TIMEOUT:-150}" python3 benchmarks/fa4_check.py --out "$OUT/fa4_check.md" > "$OUT/fa4_check.log" 2>&1
      echo "check rc $?"; tail -30 "$OUT/fa4_check.log"
      ;;
    speed)
      timeout "${SPEED_TIMEOUT:-300}" python3 benchmarks/gpu_bench.py --variants "${VARIANTS:-benchmarks/rounds/r15_fa4.txt}" \
        --steps "${BENCH_STEPS:-20}" --out /tmp/fa4_speed | tee "$OUT/speed_rows.md"
      cp /tmp/fa4_speed/bench.md "$OUT/bench_speed.md" 2>/dev/null
      tar czf "$OUT/logs_speed.tgz" -C /tmp/fa4_speed $(cd /tmp/fa4_speed && ls *.log *.json 2>/dev/null)
      ;;
  esac
done
