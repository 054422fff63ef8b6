#!/usr/bin/env bash
# tools/device/mxfp4-s11-batch.sh: the MXFP4 helper's device batches of the eleventh session (issue 6: the copies of
# the mma.sync decode path by the bulk-copy engine, decode_item_bulk in src/experts/experts_mxfp4_kernels.cuh).
# Run from the root of a copy of main that carries .carry/deps.tar.xz and .carry-mxfp4/{prebuilt.tar.xz,commit.txt}:
#   OUT=<dir> BUDGET=<s> timeout -k 5 <s> bash .carry-mxfp4/batch.sh
# prebuilt.tar.xz (built on the dev machine for sm_90a, CUDA 13.0, from the commit in commit.txt): experts_cuda_test,
# epx-gemm-mxfp4-bench. The A/Bs are settings of the same binary (EPX_EXPERTS_MXFP4_TC):
#   batch 1 (commit 5b208e3): G = unset (decode_item_bulk with 1-D bulk copies, e8m0 00 / FF decided per slot),
#     W = 8 (the same, decided per window), E = 7 (decode_item_ring2: the tenth session's default);
#   batch 2 (STEPS="bits ab2 stamps2 fhmoe2 pf san"): T = unset (decode_item_bulk filled by TMA boxes, each item starting
#     the next one's slots), N = 8 (T without that look-ahead), E = 7.
# STEPS (in order; default "bits ab2 stamps2 fhmoe2 san pf"; batch 1 ran "bits ab stamps fhmoe san"):
#   bits   experts_cuda_test: the decode-path tests (new default + the A/B settings), then the other MXFP4 / mixed tests;
#   ab     decode 192 experts x 8 rows (validated) and x 32, G W E E W G (ITERS calls each, default 20); ab2 T N E E N T;
#   abpf   prefill (4096 tokens top-6, Flat) E then G: must not move; pf the prefill case once on the default;
#   stamps G stamped (--stamps: mode 1 the phases per window, mode 2 the load path alone); stamps2 T likewise;
#   fhmoe  the FHMoE sweep (fused vs separate shared expert, T = 1..64) on the default (fhmoe2: the same, named for T);
#   san    compute-sanitizer memcheck and racecheck of Mxfp4DecodePathScaleSpread (decode_item_bulk on both GEMMs at I 512).
# Every step has its own timeout inside BUDGET seconds (default 195). Writes $OUT/summary.txt first, small logs.
source tools/device/batch-lib.sh
batch_init /tmp/mxfp4-out 195
export CUDA_VISIBLE_DEVICES=0
STEPS="${STEPS:-bits ab2 stamps2 fhmoe2 san pf}"
ITERS="${ITERS:-20}"
: >"$OUT/summary.txt"
batch_prebuilt .carry-mxfp4
B="$P"
ldd "$P/epx-gemm-mxfp4-bench" "$P/experts_cuda_test" >"$OUT/prebuilt-ldd.txt" 2>&1
if grep -q "not found" "$OUT/prebuilt-ldd.txt"; then  # fallback: build on the device
  S=/tmp/s-mxfp4
  rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf .carry-mxfp4/src.tar.xz && cp .carry/deps.tar.xz "$S/.carry/"
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="experts_cuda_test epx_gemm_mxfp4_bench" GPU_CHECK_FILTER='^no_test_matches_this$' \
    timeout -k 5 "$(cap 100)" bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
  say "prebuilt unusable; build rc=$? at $((SECONDS - T0)) s"
  P=/tmp/epx-gpu-check/build B=$P
  deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$deps:$deps/openblas-pthread:$LD_LIBRARY_PATH"
fi
say "binaries: $B at $((SECONDS - T0)) s"
commit="$(cat .carry-mxfp4/commit.txt 2>/dev/null || echo unknown)"
hung=0
bench() {  # bench TC NAME LIMIT ARGS...: EPX_EXPERTS_MXFP4_TC=TC ('-' = unset), into $OUT/NAME.{json,log}
  local tc=$1 name=$2 lim=$3 b
  shift 3
  b=$(cap "$lim")
  if [ "$b" -lt 8 ] || [ "$hung" = 1 ]; then say "$name skipped"; return; fi
  if [ "$tc" = - ]; then
    (unset EPX_EXPERTS_MXFP4_TC; GEMM_BENCH_COMMIT="$commit" timeout -k 2 "$b" "$B/epx-gemm-mxfp4-bench" --json "$OUT/$name.json" "$@") \
      >"$OUT/$name.log" 2>&1
  else
    EPX_EXPERTS_MXFP4_TC=$tc GEMM_BENCH_COMMIT="$commit" timeout -k 2 "$b" "$B/epx-gemm-mxfp4-bench" --json "$OUT/$name.json" "$@" \
      >"$OUT/$name.log" 2>&1
  fi
  local rc=$?
  say "$name (EPX_EXPERTS_MXFP4_TC=$tc) rc=$rc (limit $b s) at $((SECONDS - T0)) s"
  [ "$rc" -ge 124 ] && hung=1
  grep -E "^(ceiling|decode|prefill|FHMoE|fhmoe|stamps)" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
for step in $STEPS; do
  case $step in
    bits)
      batch_gtest gpu-tests-decode 30 ./experts_cuda_test --gtest_filter='*Mxfp4DecodePath*:*SmallShapesEveryFormat*:*Mxfp4TensorCoreWideScaleSpread*'
      grep -q "rc=12[4-9]\|rc=137" "$OUT/summary.txt" && hung=1
      [ "$hung" = 0 ] && batch_gtest gpu-tests 40 ./experts_cuda_test \
        --gtest_filter='*Mxfp4*:*DeepSeekV4Pro*:*MixedFormats*:*GraphCapture*-*Mxfp4DecodePath*:*WideScaleSpread*'
      grep -hE "^\[  FAILED|rel_l2|Failure" "$OUT"/gpu-tests*.log | tail -40 >>"$OUT/summary.txt" ;;
    ab)
      bench - ab-G1 25 --iters "$ITERS" --no-simt --cases decode
      bench 8 ab-W1 25 --iters "$ITERS" --no-simt --cases decode
      bench 7 ab-E1 25 --iters "$ITERS" --no-simt --cases decode
      bench 7 ab-E2 25 --iters "$ITERS" --no-simt --cases decode
      bench 8 ab-W2 25 --iters "$ITERS" --no-simt --cases decode
      bench - ab-G2 25 --iters "$ITERS" --no-simt --cases decode ;;
    ab2)
      bench - ab-T1 25 --iters "$ITERS" --no-simt --cases decode
      bench 8 ab-N1 25 --iters "$ITERS" --no-simt --cases decode
      bench 7 ab-E1 25 --iters "$ITERS" --no-simt --cases decode
      bench 7 ab-E2 25 --iters "$ITERS" --no-simt --cases decode
      bench 8 ab-N2 25 --iters "$ITERS" --no-simt --cases decode
      bench - ab-T2 25 --iters "$ITERS" --no-simt --cases decode ;;
    pf)
      bench - pf-T 25 --iters 10 --no-simt --cases prefill ;;
    stamps2)
      bench - stamps-T 40 --iters 10 --no-simt --cases decode --stamps ;;
    fhmoe2)
      bench - fhmoe-T 35 --iters 10 --no-simt --cases fhmoe --max-tokens 64 ;;
    abpf)
      bench 7 ab-E-prefill 25 --iters 10 --no-simt --cases prefill
      bench - ab-G-prefill 25 --iters 10 --no-simt --cases prefill ;;
    stamps)
      bench - stamps-G 40 --iters 10 --no-simt --cases decode --stamps ;;
    fhmoe)
      bench - fhmoe-G 35 --iters 10 --no-simt --cases fhmoe --max-tokens 64 ;;
    san)
      [ -n "$SAN" ] || { say "no compute-sanitizer"; continue; }
      batch_gtest san-memcheck 30 "$SAN" --tool memcheck ./experts_cuda_test --gtest_filter='*Mxfp4DecodePathScaleSpread*'
      batch_gtest san-racecheck 30 "$SAN" --tool racecheck ./experts_cuda_test --gtest_filter='*Mxfp4DecodePathScaleSpread*'
      for f in "$OUT"/san-*.log; do [ -f "$f" ] && { grep -v "Host Frame" "$f" | head -300 >"$f.t" && mv "$f.t" "$f"; }; done ;;
  esac
done
echo "== summary"; cat "$OUT/summary.txt"
echo "total $((SECONDS - T0)) s"
