#!/usr/bin/env bash
# tools/device/gemmpf-batch.sh: the prefill grouped-GEMM helper's device batch (issue 6, FP8 prefill
# kernels). Run from a copy of main that carries .carry/deps.tar.xz and .carry-gemmpf/src.tar.xz, as
#   OUT=<dir> timeout -k 5 <allowance ~100 s> bash .carry-gemmpf/batch.sh
# Builds epx, experts_cuda_test and epx-gemm-bench with tools/device/gpu-check.sh (no ctest), runs the
# TMA-vs-cp.async bit-identity test first (short: a hang or a wrong TMA box shows early), the GEMM
# bench (JSON, --no-simt --prefill-variants: the prefill kernels against the 64-row kernels and their
# own cp.async loads in the same run), then the FP8 tensor-core GPU tests against the CPU with what
# is left. Every step has its own timeout; the budget is BUDGET seconds (default 95).
set -uo pipefail
OUT="${OUT:-/tmp/gemmpf-out}"
BUDGET="${BUDGET:-95}"
mkdir -p "$OUT"
HERE="$(pwd)"
S=/tmp/s-gemmpf
T0=$SECONDS
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-gemmpf/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0
GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
  GPU_CHECK_TARGETS="epx experts_cuda_test epx_gemm_bench" \
  timeout -k 5 55 bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
echo "build rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
B=/tmp/epx-gpu-check/build
deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_VISIBLE_DEVICES=0
left() { echo $((BUDGET - (SECONDS - T0))); }
(cd "$B" && timeout -k 3 15 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit') >"$OUT/test-tma.log" 2>&1
echo "test Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
b=$(( $(left) - 3 )); [ $b -gt 48 ] && b=48
if [ -x "$B/epx-gemm-bench" ] && [ $b -gt 10 ]; then
  GEMM_BENCH_COMMIT="$(cat "$HERE/.carry-gemmpf/commit.txt" 2>/dev/null || echo unknown)" timeout -k 3 $b "$B/epx-gemm-bench" \
    --iters 10 --no-simt --prefill-variants --json "$OUT/gemm-bench.json" >"$OUT/gemm-bench.log" 2>&1
  echo "gemm-bench rc=$? (limit $b s) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
b=$(( $(left) - 1 ))
if [ $b -gt 5 ]; then
  (cd "$B" && timeout -k 2 $b ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8TensorCoreV4ProSharedExpertWidth:ExpertsCuda.GraphCaptureAfterWarmUp:ExpertsCuda.RowCountsFromOneToAFewHundred:ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192') >"$OUT/test-fp8.log" 2>&1
  echo "test fp8 rc=$? (limit $b s) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
echo "== test tma"; grep -E "^\[ *(OK|FAILED|PASSED|bits) |Failure|differ" "$OUT/test-tma.log" | head -10
echo "== test fp8"; grep -E "^\[ *(OK|FAILED|PASSED) |rel_l2|Failure" "$OUT/test-fp8.log" 2>/dev/null | head -30
echo "== bench"; grep -vE "^wrote" "$OUT/gemm-bench.log" 2>/dev/null | tail -16
cat "$OUT/summary.txt"
