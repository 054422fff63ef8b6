#!/usr/bin/env bash
# tools/device/prefill-check-s11.sh: the lead's device check of an FP8 prefill kernel change (eleventh session), run from
# the repository root through a .carry-NAME/batch.sh wrapper (pfix-s11-batch.sh, arr-s11-batch.sh):
#   NAME=<name> LAST=<rows|memcheck> bash tools/device/prefill-check-s11.sh
# .carry-NAME/prebuilt.tar.xz holds experts_cuda_test and epx-gemm-bench of the change and epx-gemm-bench-old of the
# commit before it (built on the dev machine, sm_90a). Steps: the prefill bit test (every mode against mode 8), racecheck
# of the small shapes, the prefill A/B old new new old (p50 of 10), then LAST: rows = the 1..8192-row test with the small
# shapes, memcheck = memcheck of the small shapes.
: "${NAME:?NAME must be set}" "${LAST:?LAST must be rows or memcheck}"
source tools/device/batch-lib.sh
batch_init "/tmp/$NAME-out" 170
export CUDA_VISIBLE_DEVICES=0
: >"$OUT/summary.txt"
batch_prebuilt ".carry-$NAME"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
batch_gtest bits 35 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit'
grep -h '\[ bits \]' "$OUT/bits.log" >>"$OUT/summary.txt"
batch_gtest racecheck 45 "$SAN" --tool racecheck ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
grep -v 'Host Frame' "$OUT/racecheck.log" | head -150 >"$OUT/racecheck.t" && mv "$OUT/racecheck.t" "$OUT/racecheck.log"
for r in old new new old; do
  b=$(cap 22); [ "$b" -lt 12 ] && { say "ab-$r skipped"; continue; }
  bin=epx-gemm-bench; [ $r = old ] && bin=epx-gemm-bench-old
  (cd "$P" && timeout -k 2 "$b" ./$bin --iters 10 --no-simt --no-cublas --prefill-only --json "$OUT/ab-$r-$((SECONDS-T0)).json" >"$OUT/ab-$r.log" 2>&1)
  say "ab-$r rc=$?"; grep -E '^prefill' "$OUT/ab-$r.log" | tee -a "$OUT/summary.txt"
done
case "$LAST" in
  rows) batch_gtest rows 60 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192:ExpertsCuda.Fp8PrefillSmallShapes' ;;
  memcheck) batch_gtest memcheck 30 "$SAN" --tool memcheck ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes' ;;
esac
