#!/usr/bin/env bash
# tools/device/mxfp4-batch.sh: the MXFP4 / FHMoE helper's device batch (issue 6). Run from a copy of
# main that carries .carry/deps.tar.xz and .carry-mxfp4/src.tar.xz, as
#   OUT=<dir> timeout -k 5 <allowance> bash .carry-mxfp4/batch.sh
# Builds epx, experts_cuda_test, epx-gemm-mxfp4-bench and the epx CLI with tools/device/gpu-check.sh
# (no ctest run there), runs the MXFP4 / mixed experts GPU tests directly (gtest filter), then on
# GPU 0: the MXFP4 decode bench with the per-phase stamps (--stamps), the FHMoE fused-vs-separate
# sweep at decode sizes on the faster decode kernel, the V4-Pro layer at EP2 with the shared expert
# fused and separate (--compare) if time is left, then the other kernel's sweep. Every step has its own timeout inside
# BUDGET seconds (default 155, for a 160 s allowance); logs go to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/mxfp4-out}"
BUDGET="${BUDGET:-155}"
mkdir -p "$OUT"
HERE="$(pwd)"
S=/tmp/s-mxfp4
T0=$SECONDS
left() { echo $(( BUDGET - (SECONDS - T0) )); }
# cap N: the seconds a step may take, at most N and what is left of the budget (minus 2).
cap() { local l; l=$(( $(left) - 2 )); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-mxfp4/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0
export CUDA_VISIBLE_DEVICES=0
GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
  GPU_CHECK_TARGETS="experts_cuda_test epx_gemm_mxfp4_bench epx_cli" GPU_CHECK_FILTER='^no_test_matches_this$' \
  timeout -k 5 "$(cap 115)" bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
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
  (cd "$B" && timeout -k 3 "$(cap 10)" ./experts_cuda_test --gtest_filter='*SmallShapesEveryFormat*:*Mxfp4TensorCoreWideScaleSpread*') \
    >"$OUT/gpu-tests-small.log" 2>&1
  rc=$?; echo "experts_cuda_test (small) rc=$rc in $((SECONDS - t1)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -ge 124 ] && hung=1
  if [ "$hung" = 0 ]; then
    t1=$SECONDS
    (cd "$B" && timeout -k 3 "$(cap 25)" ./experts_cuda_test \
       --gtest_filter='*Mxfp4TensorCoreRowCounts*:*DeepSeekV4Pro*:*MixedFormats*:*GraphCapture*') >"$OUT/gpu-tests.log" 2>&1
    rc=$?; echo "experts_cuda_test (mxfp4 filter) rc=$rc in $((SECONDS - t1)) s" | tee -a "$OUT/summary.txt"
    [ "$rc" -ge 124 ] && hung=1
  fi
fi
if [ -x "$B/epx-gemm-mxfp4-bench" ] && [ "$hung" = 0 ] && [ "$(left)" -gt 12 ]; then
  t2=$SECONDS
  GEMM_BENCH_COMMIT="$commit" timeout -k 3 "$(cap 25)" "$B/epx-gemm-mxfp4-bench" --iters 10 --no-simt --cases decode --stamps --wide \
    --json "$OUT/gemm-mxfp4-decode.json" >"$OUT/gemm-mxfp4-decode.log" 2>&1
  rc=$?; echo "gemm-mxfp4-bench decode+stamps+wide rc=$rc in $((SECONDS - t2)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -ge 124 ] && hung=1
fi
if [ -x "$B/experts_cuda_test" ] && [ "$hung" = 0 ] && [ "$(left)" -gt 12 ]; then
  # The wide (512-thread) variant through the same GPU tests (EPX_EXPERTS_MXFP4_TC=3).
  t1=$SECONDS
  (cd "$B" && EPX_EXPERTS_MXFP4_TC=2 timeout -k 3 "$(cap 20)" ./experts_cuda_test \
     --gtest_filter='*Mxfp4TensorCoreWideScaleSpread*:*DeepSeekV4ProExpertShapes*:*Mxfp4TensorCoreRowCounts*') >"$OUT/gpu-tests-wide.log" 2>&1
  rc=$?; wide_rc=$rc; echo "experts_cuda_test (wide, EPX_EXPERTS_MXFP4_TC=2) rc=$rc in $((SECONDS - t1)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -ge 124 ] && hung=1
fi
# The faster decode kernel (the wide variant only if its GPU tests passed): the FHMoE sweep and the
# layer run on it; the other kernel's sweep last, if time is left.
best=1
if [ "${wide_rc:-1}" = 0 ] && [ -f "$OUT/gemm-mxfp4-decode.json" ]; then
  best="$(python3 - "$OUT/gemm-mxfp4-decode.json" <<'PY' 2>/dev/null || echo 1
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
p = {r["backend"]: r["latency_us_p50"] for r in rows if r.get("case") == "decode-v4pro"}
print(2 if p.get("epx-mxfp4-wgmma-wide", 1e30) < p.get("epx-mxfp4-wgmma", 0) else 1)
PY
)"
fi
echo "faster decode kernel: EPX_EXPERTS_MXFP4_TC=$best" | tee -a "$OUT/summary.txt"
sweep() {  # $1 = EPX_EXPERTS_MXFP4_TC
  if [ -x "$B/epx-gemm-mxfp4-bench" ] && [ "$hung" = 0 ] && [ "$(left)" -gt 12 ]; then
    t2=$SECONDS
    EPX_EXPERTS_MXFP4_TC=$1 GEMM_BENCH_COMMIT="$commit" timeout -k 3 "$(cap 25)" "$B/epx-gemm-mxfp4-bench" --iters 10 --no-simt \
      --cases fhmoe --max-tokens "${FHMOE_MAX_T:-2048}" --fhmoe-experts 192 --json "$OUT/gemm-mxfp4-fhmoe-tc$1.json" \
      >"$OUT/gemm-mxfp4-fhmoe-tc$1.log" 2>&1
    echo "gemm-mxfp4-bench fhmoe (EPX_EXPERTS_MXFP4_TC=$1) rc=$? in $((SECONDS - t2)) s" | tee -a "$OUT/summary.txt"
  fi
}
sweep "$best"
if [ -x "$B/epx" ] && [ "$hung" = 0 ] && [ "$(left)" -gt "${MOE_MIN_S:-30}" ]; then
  # The layer at EP2 (192 local experts per GPU), the shared expert fused and separate in one run (--compare).
  t3=$SECONDS
  EPX_EXPERTS_MXFP4_TC=$best CUDA_VISIBLE_DEVICES=0,1 timeout -k 3 "$(cap 60)" "$B/epx" moe --device cuda --ranks 2 \
    --preset deepseek-v4-pro --backend ll --dispatch-dtype fp8 --mode decode --compare --tokens-per-rank "${MOE_TOKENS:-128}" \
    --steps 3 --validate-tokens 2 --json "$OUT/moe-v4pro-compare.json" >"$OUT/moe-v4pro-compare.log" 2>&1
  echo "epx moe v4-pro --compare (EPX_EXPERTS_MXFP4_TC=$best) rc=$? in $((SECONDS - t3)) s" | tee -a "$OUT/summary.txt"
fi
sweep $((3 - best))
echo "== tests"; cat "$OUT/gpu-tests-small.log" "$OUT/gpu-tests.log" "$OUT/gpu-tests-wide.log" 2>/dev/null | grep -E "^\[  (FAILED|PASSED) |^\[       OK|FAILED|rel_l2|Failure|Expected|Which is|got/want" | tail -40
echo "== build errors"; head -5 "$OUT/build-errors.txt" 2>/dev/null
echo "== bench"; grep -vhE "^wrote" "$OUT/gemm-mxfp4-decode.log" 2>/dev/null | tail -30
for tc in 1 2; do echo "== fhmoe tc=$tc"; grep -vhE "^wrote" "$OUT/gemm-mxfp4-fhmoe-tc$tc.log" 2>/dev/null | grep -E "separate|FHMoE" | tail -20; done
echo "== moe"; tail -25 "$OUT/moe-v4pro-compare.log" 2>/dev/null
echo "total $((SECONDS - T0)) s"
