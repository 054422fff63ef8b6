#!/usr/bin/env bash
# tools/device/gemmpf-batch.sh: the prefill grouped-GEMM helper's device batch (issue 6, FP8 prefill
# kernels). Run from a copy of main that carries .carry/deps.tar.xz and .carry-gemmpf/{src,prebuilt}.tar.xz:
#   OUT=<dir> timeout -k 5 <allowance ~160 s> bash .carry-gemmpf/batch.sh
# prebuilt.tar.xz holds experts_cuda_test and epx-gemm-bench built from src.tar.xz on the dev machine
# (CUDA 13.0, sm_90a; a device build of them takes ~100 s of the allowance); when they do not load
# here (ldd / --gtest_list_tests), they are built with tools/device/gpu-check.sh instead.
# Then: the bit-identity test of the prefill variants (TMA / cluster / consumer turn order 5-7 vs the
# cp.async kernels; short: a hang shows early, and then the bench runs without --prefill-variants),
# the GEMM bench (JSON, --no-simt --prefill-variants), the torch grouped-GEMM rows, then the FP8
# tensor-core GPU tests against the CPU (FP8_TESTS, default Fp8TensorCoreRowCountsOneTo8192) in what is left. Every step has its own timeout; budget BUDGET s
# (default 125).
set -uo pipefail
OUT="${OUT:-/tmp/gemmpf-out}"
BUDGET="${BUDGET:-125}"
mkdir -p "$OUT"
HERE="$(pwd)"
S=/tmp/s-gemmpf
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-gemmpf/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
B=""
P=/tmp/gemmpf-prebuilt
D=/tmp/gemmpf-deps
if [ -f "$HERE/.carry-gemmpf/prebuilt.tar.xz" ]; then
  rm -rf "$P" "$D" && mkdir -p "$P" "$D"
  tar -C "$P" -xJf "$HERE/.carry-gemmpf/prebuilt.tar.xz" && tar -C "$D" -xJf "$HERE/.carry/deps.tar.xz"
  dl="$D/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  ldd "$P/experts_cuda_test" "$P/epx-gemm-bench" >"$OUT/prebuilt-ldd.txt" 2>&1
  if ! grep -q "not found" "$OUT/prebuilt-ldd.txt" && timeout 20 "$P/experts_cuda_test" --gtest_list_tests >/dev/null 2>>"$OUT/prebuilt-ldd.txt"; then
    B="$P"
  fi
  echo "prebuilt: ${B:-unusable (see prebuilt-ldd.txt)} at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
if [ -z "$B" ]; then
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="experts_cuda_test epx_gemm_bench" \
    timeout -k 5 115 bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
  echo "build rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
  B=/tmp/epx-gpu-check/build
  deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export CUDA_VISIBLE_DEVICES=0
(cd "$B" && timeout -k 3 40 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit') >"$OUT/test-tma.log" 2>&1
trc=$?
echo "test Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit rc=$trc at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
variants=--prefill-variants
[ $trc -ge 124 ] && variants=""  # a variant hung: measure the default kernels only
b=$(( $(left) - 20 )); [ $b -gt 70 ] && b=70
if [ -x "$B/epx-gemm-bench" ] && [ $b -gt 10 ]; then
  GEMM_BENCH_COMMIT="$(cat "$HERE/.carry-gemmpf/commit.txt" 2>/dev/null || echo unknown)" timeout -k 3 $b "$B/epx-gemm-bench" \
    --iters 10 --no-simt $variants --json "$OUT/gemm-bench.json" >"$OUT/gemm-bench.log" 2>&1
  echo "gemm-bench rc=$? (limit $b s) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
b=$(( $(left) - 3 )); [ $b -gt 15 ] && b=15
if [ $b -gt 8 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout -k 2 $b python3 "$S/bench/gemm_torch.py" --iters 10 --json "$OUT/gemm-torch.json" >"$OUT/gemm-torch.log" 2>&1
  echo "gemm-torch rc=$? (limit $b s) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
b=$(( $(left) - 1 )); [ $b -gt 50 ] && b=50
if [ $b -gt 5 ]; then
  (cd "$B" && timeout -k 2 $b ./experts_cuda_test --gtest_filter="${FP8_TESTS:-ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192}") >"$OUT/test-fp8.log" 2>&1
  echo "test fp8 rc=$? (limit $b s) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
echo "== test tma"; grep -E "^\[ *(OK|FAILED|PASSED|bits) |Failure|differ" "$OUT/test-tma.log" | head -24
echo "== test fp8"; grep -E "^\[ *(OK|FAILED|PASSED|rel_l2) |Failure" "$OUT/test-fp8.log" 2>/dev/null | tail -24
echo "== bench"; grep -vE "^wrote" "$OUT/gemm-bench.log" 2>/dev/null | tail -30
echo "== torch"; tail -4 "$OUT/gemm-torch.log" 2>/dev/null
cat "$OUT/summary.txt"
