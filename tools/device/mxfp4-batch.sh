#!/usr/bin/env bash
# tools/device/mxfp4-batch.sh: the MXFP4 / FHMoE helper's device batch (issue 6). Run from a copy of
# main that carries .carry/deps.tar.xz and .carry-mxfp4/src.tar.xz, as
#   OUT=<dir> timeout -k 5 <allowance> bash .carry-mxfp4/batch.sh
# Builds only epx, experts_cuda_test and epx-gemm-mxfp4-bench with tools/device/gpu-check.sh (no
# ctest run there), runs the MXFP4 / V4-Pro experts GPU tests directly (gtest filter), then the
# MXFP4 GEMM bench + FHMoE sweep on GPU 0, then (if time is left) the V4-Pro layer. Every step has
# its own timeout; logs go to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/mxfp4-out}"
mkdir -p "$OUT"
HERE="$(pwd)"
S=/tmp/s-mxfp4
T0=$SECONDS
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-mxfp4/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0
export CUDA_VISIBLE_DEVICES=0
GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 \
  GPU_CHECK_TARGETS="epx experts_cuda_test epx_gemm_mxfp4_bench epx_cli" GPU_CHECK_FILTER='^no_test_matches_this$' \
  timeout -k 5 75 bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
echo "build rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
B=/tmp/epx-gpu-check/build
deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
grep -E "error|FAILED" "$OUT/build.log" 2>/dev/null | head -20 >"$OUT/build-errors.txt"
commit="$(cat "$HERE/.carry-mxfp4/commit.txt" 2>/dev/null || echo unknown)"
hung=0
if [ -x "$B/experts_cuda_test" ]; then
  # Small shapes first: a hang here (rc 124) skips everything after it (device time is shared).
  t1=$SECONDS
  (cd "$B" && timeout -k 3 20 ./experts_cuda_test --gtest_filter='*SmallShapesEveryFormat*:*Mxfp4TensorCoreWideScaleSpread*') \
    >"$OUT/gpu-tests-small.log" 2>&1
  rc=$?; echo "experts_cuda_test (small) rc=$rc in $((SECONDS - t1)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -ge 124 ] && hung=1
  if [ "$hung" = 0 ]; then
    t1=$SECONDS
    (cd "$B" && timeout -k 5 40 ./experts_cuda_test \
       --gtest_filter='*Mxfp4TensorCoreRowCounts*:*DeepSeekV4Pro*:*MixedFormats*:*GraphCapture*') >"$OUT/gpu-tests.log" 2>&1
    rc=$?; echo "experts_cuda_test (mxfp4 filter) rc=$rc in $((SECONDS - t1)) s" | tee -a "$OUT/summary.txt"
  fi
fi
if [ -x "$B/epx-gemm-mxfp4-bench" ] && [ "$hung" = 0 ]; then
  t2=$SECONDS
  left=$(( 140 - (SECONDS - T0) )); [ "$left" -gt 60 ] && left=60; [ "$left" -lt 10 ] && left=10
  GEMM_BENCH_COMMIT="$commit" timeout -k 5 "$left" "$B/epx-gemm-mxfp4-bench" --iters 10 --fhmoe-experts 192,48 \
    --json "$OUT/gemm-mxfp4.json" >"$OUT/gemm-mxfp4.log" 2>&1
  echo "gemm-mxfp4-bench rc=$? in $((SECONDS - t2)) s" | tee -a "$OUT/summary.txt"
fi
left=$(( 145 - (SECONDS - T0) ))
if [ -x "$B/epx" ] && [ "$left" -gt 15 ] && [ "$hung" = 0 ]; then
  t3=$SECONDS
  timeout -k 3 "$left" "$B/epx" moe --device cuda --ranks 1 --preset deepseek-v4-pro --backend ll --dispatch-dtype fp8 --tokens-per-rank 128 \
    --steps 2 --validate-tokens 4 --json "$OUT/moe-v4pro.json" >"$OUT/moe-v4pro.log" 2>&1
  echo "epx moe v4-pro rc=$? in $((SECONDS - t3)) s" | tee -a "$OUT/summary.txt"
fi
echo "== tests"; cat "$OUT/gpu-tests-small.log" "$OUT/gpu-tests.log" 2>/dev/null | grep -E "^\[  (FAILED|PASSED) |^\[       OK|FAILED|rel_l2|Failure|Expected|Which is|got/want" | tail -40
echo "== bench"; grep -vE "^wrote" "$OUT/gemm-mxfp4.log" 2>/dev/null | tail -50
echo "== moe"; tail -15 "$OUT/moe-v4pro.log" 2>/dev/null
echo "total $((SECONDS - T0)) s"
