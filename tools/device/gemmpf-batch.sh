#!/usr/bin/env bash
# tools/device/gemmpf-batch.sh: the prefill grouped-GEMM helper's device batch (issue 6, FP8 prefill
# kernels). Run from a copy of main that carries .carry/deps.tar.xz and .carry-gemmpf/src.tar.xz, as
#   OUT=<dir> timeout -k 5 <allowance ~150 s> bash .carry-gemmpf/batch.sh
# Builds epx, experts_cuda_test and epx-gemm-bench with tools/device/gpu-check.sh (no ctest), runs the
# FP8 tensor-core GPU tests (a short filter first: a hang shows early), the GEMM bench (JSON,
# --no-simt: the prefill kernels are validated against the 64-row kernels in the same run), the rest
# of the experts GPU tests, then torch if time is left. Every step has its own timeout.
set -uo pipefail
OUT="${OUT:-/tmp/gemmpf-out}"
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
  timeout -k 5 75 bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
echo "build rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
B=/tmp/epx-gpu-check/build
deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_VISIBLE_DEVICES=0
left() { echo $((140 - (SECONDS - T0))); }
(cd "$B" && timeout -k 3 35 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192') >"$OUT/test-fp8.log" 2>&1
echo "test Fp8TensorCoreRowCountsOneTo8192 rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
b=$(( $(left) - 22 )); [ $b -gt 60 ] && b=60
if [ -x "$B/epx-gemm-bench" ] && [ $b -gt 10 ]; then
  GEMM_BENCH_COMMIT="$(cat "$HERE/.carry-gemmpf/commit.txt" 2>/dev/null || echo unknown)" timeout -k 3 $b "$B/epx-gemm-bench" \
    --iters 10 --no-simt --prefill-variants --json "$OUT/gemm-bench.json" >"$OUT/gemm-bench.log" 2>&1
  echo "gemm-bench rc=$? (limit $b s) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
b=$(( $(left) - 2 )); [ $b -gt 40 ] && b=40
if [ $b -gt 5 ]; then
  (cd "$B" && timeout -k 3 $b ./experts_cuda_test --gtest_filter='-ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192:ExpertsCuda.FullLayerDeepSeekV4Pro') >"$OUT/test-rest.log" 2>&1
  echo "test rest rc=$? (limit $b s) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
echo "== test fp8"; grep -E "^\[ *(OK|FAILED|PASSED) |rel_l2|Failure" "$OUT/test-fp8.log" | head -30
echo "== test rest"; grep -E "^\[ *(OK|FAILED|PASSED) " "$OUT/test-rest.log" 2>/dev/null | tail -16
echo "== bench"; grep -vE "^wrote" "$OUT/gemm-bench.log" 2>/dev/null | tail -16
cat "$OUT/summary.txt"
