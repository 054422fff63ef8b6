#!/usr/bin/env bash
# tools/device/arr-s11-batch.sh (copy): the lead's check of the per-thread empty arrivals (kEmptyArrivals)
# (every consumer thread arrives on a stage's empty barrier; 1ffa5e5: lane 0 after __syncwarp).
# Binaries built on the dev machine (sm_90a): experts_cuda_test, epx-gemm-bench of the fix; epx-gemm-bench-old of 1ffa5e5.
source tools/device/batch-lib.sh
batch_init /tmp/arr-out 170
export CUDA_VISIBLE_DEVICES=0
: >"$OUT/summary.txt"
batch_prebuilt .carry-arr
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
batch_gtest memcheck 30 "$SAN" --tool memcheck ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
