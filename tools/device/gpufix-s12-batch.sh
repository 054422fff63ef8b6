#!/usr/bin/env bash
# tools/device/gpufix-s12-batch.sh: helper gpufix's device batch (twelfth session), run from the repository root as
#   OUT=<dir> BUDGET=<s> bash .carry-gpufix/batch.sh          (this file, copied)
# .carry-gpufix/prebuilt.tar.xz: experts_cuda_test, ll_cuda_test, epx-gemm-bench of branch gpufix-s12 and
# epx-gemm-bench-old (main 5ec228b's kernels), built on the dev machine for sm_90a. Steps, in priority order, each
# within its own limit and the budget:
#   experts    the new / changed experts tests natively: e8m0 extremes on every MXFP4 path, the TMA launch without
#              weight maps, the prefill small shapes (TMA modes and cp.async modes 8 / 17), the prefill bit test
#   ll         ll loopback on one GPU: finalize twice per prepare, the refused-finalize test, MatchesCpuOneRank
#   race-cpa   compute-sanitizer racecheck of the cp.async prefill kernels alone (modes 8 / 17, per-thread arrivals)
#   ab-*       epx-gemm-bench --prefill-only --prefill-modes 8,17, old new new old (default rows + modes 8 / 17)
#   mem-cpa    memcheck of the same small shapes (modes 8 / 17)
#   race-tma   racecheck of the TMA small shapes (the cp.async weight path removed)
source tools/device/batch-lib.sh
batch_init /tmp/gpufix-out 195
export CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0
: >"$OUT/summary.txt"
batch_prebuilt .carry-gpufix
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
batch_gtest experts 50 ./experts_cuda_test --gtest_filter='ExpertsCuda.Mxfp4E8m0ExtremesAndNaNEveryPath:ExpertsCuda.TmaPrefillLaunchWithoutWeightMapsThrows:ExpertsCuda.Fp8PrefillSmallShapes:ExpertsCuda.Fp8PrefillSmallShapesCpAsync:ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit'
grep -hE '^\[  FAILED|Failure|\[ bits \]|\[ rel_l2 \]' "$OUT/experts.log" | head -80 >>"$OUT/summary.txt"
batch_gtest ll 40 env EPX_TIMEOUT_S=20 ./ll_cuda_test --gtest_filter='LlCuda.FinalizeTwicePerPrepareOneRank:LlCuda.RefusedFinalizeIsNotRetriedOneRank:LlCuda.MatchesCpuOneRank'
grep -hE '^\[  FAILED|Failure|failures|threw|differs' "$OUT/ll.log" | head -20 >>"$OUT/summary.txt"
batch_gtest race-cpa 40 "$SAN" --tool racecheck ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapesCpAsync'
grep -v 'Host Frame' "$OUT/race-cpa.log" | head -150 >"$OUT/race-cpa.t" && mv "$OUT/race-cpa.t" "$OUT/race-cpa.log"
for r in old new new old; do
  b=$(cap 30); [ "$b" -lt 12 ] && { say "ab-$r skipped"; continue; }
  bin=epx-gemm-bench; [ $r = old ] && bin=epx-gemm-bench-old
  (cd "$P" && timeout -k 2 "$b" ./$bin --iters 10 --no-simt --no-cublas --prefill-only --prefill-modes 8,17 \
     --json "$OUT/ab-$r-$((SECONDS-T0)).json" >"$OUT/ab-$r.log" 2>&1)
  say "ab-$r rc=$? at $((SECONDS - T0)) s"; grep -E '^prefill' "$OUT/ab-$r.log" | tee -a "$OUT/summary.txt"
done
batch_gtest mem-cpa 35 "$SAN" --tool memcheck ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapesCpAsync'
batch_gtest race-tma 40 "$SAN" --tool racecheck ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
grep -v 'Host Frame' "$OUT/race-tma.log" | head -150 >"$OUT/race-tma.t" && mv "$OUT/race-tma.t" "$OUT/race-tma.log"
say "done at $((SECONDS - T0)) s"
