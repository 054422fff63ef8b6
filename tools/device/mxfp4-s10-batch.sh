#!/usr/bin/env bash
# NOTE (after 1936949): this script records how results were made with binaries from before that commit, where
# EPX_EXPERTS_MXFP4_TC=1 (default) was decode_item_ring and =6 decode_item_ring2; at main since then the two are swapped.
# tools/device/mxfp4-s10-batch.sh: the MXFP4 helper's device batch of the tenth session (issue 6: the
# mma.sync decode path of the mixed MXFP4 kernels, decode_item in src/experts/experts_mxfp4_kernels.cuh).
# Run from a copy of main that carries .carry/deps.tar.xz and .carry-mxfp4/{src,prebuilt}.tar.xz:
#   OUT=<dir> BUDGET=<s> timeout -k 5 <allowance> bash .carry-mxfp4/batch.sh
# prebuilt.tar.xz (built on the dev machine for sm_90a, CUDA 13.0): experts_cuda_test, epx-gemm-mxfp4-bench
# of this branch. A = the same binary with EPX_EXPERTS_MXFP4_TC=3 (the decode path off: <= 16-row tiles on
# the BN 16 wgmma kernel, i.e. main's kernel code for them), B = the default (the decode path with its
# per-warp cp.async ring), C = EPX_EXPERTS_MXFP4_TC=4 (B without the L2 prefetch), D = 5 (B with a ring of
# 3 windows per warp). (Batch 1 ran commit 77ed82f with A = 3 and B = its register-buffered variant.)
# From commit 4d21429 on, the default (1) is batch 2's C (no L2 prefetch) and 4 turns the prefetch on; 6 = E, the
# warp-shared slot layout for <= 8 rows (decode_item_ring2: fewer copies, no quad transpose).
# STEPS (in order; default "bits ab3 stamps3"; batch 2 ran "bits ab abx ab2 abpf stamps fhmoe"):
#   bits   experts_cuda_test: the MXFP4 / mixed tests against the CPU (the new decode-path tests first);
#   ab     decode (192 experts x 8 and x 32 rows, validated at x 8), A then B, ITERS calls each; abx C, D;
#          ab2 a second round (B, A); abpf prefill (4096 tokens top-6, Flat) A then B;
#   stamps B's decode path stamped (--stamps: mode 1 phases per window, mode 2 the load path alone, mode 3 the
#          old BN 16 kernel stamped with the L2 hint);
#   ab3    decode A (3), C (the default), E (6), E, C, A; stamps3 E stamped (--stamps);
#   fhmoe  the bench's FHMoE sweep (fused vs separate shared expert, T = 1..64: <= 2 rows per routed expert), B then A.
# Every step has its own timeout inside BUDGET seconds (default 200).
set -uo pipefail
OUT="${OUT:-/tmp/mxfp4-out}"
BUDGET="${BUDGET:-200}"
STEPS="${STEPS:-bits ab3 stamps3}"
ITERS="${ITERS:-20}"
mkdir -p "$OUT"
HERE="$(pwd)"
S=/tmp/s-mxfp4
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
cap() { local l; l=$(($(left) - 2)); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-mxfp4/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0
export CUDA_VISIBLE_DEVICES=0
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
P=/tmp/mxfp4-prebuilt
D=/tmp/mxfp4-deps
rm -rf "$P" "$D" && mkdir -p "$P" "$D"
B=""
if [ -f "$HERE/.carry-mxfp4/prebuilt.tar.xz" ]; then
  tar -C "$P" -xJf "$HERE/.carry-mxfp4/prebuilt.tar.xz" && tar -C "$D" -xJf "$HERE/.carry/deps.tar.xz"
  dl="$D/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/extras/CUPTI/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  ldd "$P/epx-gemm-mxfp4-bench" "$P/experts_cuda_test" >"$OUT/prebuilt-ldd.txt" 2>&1
  grep -q "not found" "$OUT/prebuilt-ldd.txt" || B="$P"
fi
if [ -z "$B" ]; then
  say "no usable prebuilt; building with gpu-check.sh (targets: ${BUILD_TARGETS:=experts_cuda_test epx_gemm_mxfp4_bench})"
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="$BUILD_TARGETS" GPU_CHECK_FILTER='^no_test_matches_this$' \
    timeout -k 5 "$(cap 100)" bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
  say "build rc=$? at $((SECONDS - T0)) s"
  B=/tmp/epx-gpu-check/build
  deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
say "binaries: $B at $((SECONDS - T0)) s"
commit="$(cat "$HERE/.carry-mxfp4/commit.txt" 2>/dev/null || echo unknown)"
hung=0
bench() {  # bench TC NAME LIMIT ARGS...: EPX_EXPERTS_MXFP4_TC=TC, into $OUT/NAME.{json,log}
  local tc=$1 name=$2 lim=$3
  shift 3
  [ -x "$B/epx-gemm-mxfp4-bench" ] || { say "$name: no binary"; return; }
  local b; b=$(cap "$lim")
  if [ "$b" -lt 8 ] || [ "$hung" = 1 ]; then say "$name skipped"; return; fi
  EPX_EXPERTS_MXFP4_TC=$tc GEMM_BENCH_COMMIT="$commit" timeout -k 2 "$b" "$B/epx-gemm-mxfp4-bench" --json "$OUT/$name.json" "$@" \
    >"$OUT/$name.log" 2>&1
  local rc=$?
  say "$name (EPX_EXPERTS_MXFP4_TC=$tc) rc=$rc (limit $b s) at $((SECONDS - T0)) s"
  [ "$rc" -ge 124 ] && hung=1
  grep -E "^(ceiling|decode|prefill|FHMoE|stamps)" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
for step in $STEPS; do
  case $step in
    bits)
      t1=$SECONDS
      (cd "$B" && timeout -k 3 "$(cap 25)" ./experts_cuda_test \
         --gtest_filter='*Mxfp4DecodePath*:*SmallShapesEveryFormat*:*Mxfp4TensorCoreWideScaleSpread*') >"$OUT/gpu-tests-decode.log" 2>&1
      rc=$?; say "experts_cuda_test (decode path, small) rc=$rc in $((SECONDS - t1)) s"
      [ "$rc" -ge 124 ] && hung=1
      if [ "$hung" = 0 ]; then
        t1=$SECONDS
        (cd "$B" && timeout -k 3 "$(cap 40)" ./experts_cuda_test \
           --gtest_filter='*Mxfp4*:*DeepSeekV4Pro*:*MixedFormats*:*GraphCapture*-*Mxfp4DecodePath*:*WideScaleSpread*') >"$OUT/gpu-tests.log" 2>&1
        rc=$?; say "experts_cuda_test (mxfp4 filter) rc=$rc in $((SECONDS - t1)) s"
        [ "$rc" -ge 124 ] && hung=1
      fi
      grep -hE "^\[  (FAILED|PASSED) |^\[       OK|^\[  FAILED|rel_l2|Failure" "$OUT"/gpu-tests*.log | tail -50 >>"$OUT/summary.txt" ;;
    ab)  # decode A, B
      bench 3 ab-A1 25 --iters "$ITERS" --no-simt --cases decode
      bench 1 ab-B1 25 --iters "$ITERS" --no-simt --cases decode ;;
    abx)  # decode C (no L2 prefetch), D (a ring of 3)
      bench 4 ab-C1 25 --iters "$ITERS" --no-simt --cases decode
      bench 5 ab-D1 25 --iters "$ITERS" --no-simt --cases decode ;;
    ab2)  # decode B, A (a second round, the other order)
      bench 1 ab-B2 25 --iters "$ITERS" --no-simt --cases decode
      bench 3 ab-A2 25 --iters "$ITERS" --no-simt --cases decode ;;
    abpf)  # prefill (4096 tokens top-6, Flat) A then B: the decode path must not touch it
      bench 3 ab-A-prefill 25 --iters 10 --no-simt --cases prefill
      bench 1 ab-B-prefill 25 --iters 10 --no-simt --cases prefill ;;
    stamps)
      bench 1 stamps-B 40 --iters 10 --no-simt --cases decode --stamps ;;
    ab3)  # decode A, C (default), E, E, C, A
      bench 3 ab-A1 25 --iters "$ITERS" --no-simt --cases decode
      bench 1 ab-C1 25 --iters "$ITERS" --no-simt --cases decode
      bench 6 ab-E1 25 --iters "$ITERS" --no-simt --cases decode
      bench 6 ab-E2 25 --iters "$ITERS" --no-simt --cases decode
      bench 1 ab-C2 25 --iters "$ITERS" --no-simt --cases decode
      bench 3 ab-A2 25 --iters "$ITERS" --no-simt --cases decode ;;
    stamps3)
      bench 6 stamps-E 40 --iters 10 --no-simt --cases decode --stamps ;;
    fhmoe)  # the FHMoE sweep (fused vs separate), B then A
      bench 1 fhmoe-B 30 --iters 10 --no-simt --cases fhmoe --max-tokens 64
      bench 3 fhmoe-A 30 --iters 10 --no-simt --cases fhmoe --max-tokens 64 ;;
  esac
done
echo "== summary"; cat "$OUT/summary.txt"
echo "total $((SECONDS - T0)) s"
