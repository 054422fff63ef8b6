#!/usr/bin/env bash
# tools/device/gpufix-s12-batch2.sh: helper gpufix's second device batch (twelfth session), run from the repository root as
#   OUT=<dir> BUDGET=<s> bash .carry-gpufix/batch.sh          (this file, copied)
# .carry-gpufix/prebuilt.tar.xz: experts_cuda_test, ll_cuda_test, epx-gemm-bench of branch gpufix-s12 (the cp.async
# prefill kernel's per-thread arrive behind the opaque branch, 95fa4e4), epx-gemm-bench-old (main 5ec228b's kernels) and
# experts_cuda_test-oldarr (this branch's tests linked with main's experts_fp8_prefill_cuda.cu object: the "before" of the
# racecheck), built on the dev machine for sm_90a. Steps, in priority order, each within its limit and the budget:
#   bits       the prefill bit test and the cp.async small shapes natively
#   race-cpa   racecheck of the cp.async prefill kernels alone (modes 8 / 17), this branch
#   race-old   the same with main's cp.async kernel (the lane-0 release): the count before
#   ll         ll on one GPU: made without a caller Config (loaded in the verdict gather), finalize twice, MatchesCpuOneRank
#   ab-*       epx-gemm-bench --prefill-only --prefill-modes 8,17, old new new old
#   mem-cpa    memcheck of the cp.async small shapes
source tools/device/batch-lib.sh
batch_init /tmp/gpufix-out 175
export CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0
: >"$OUT/summary.txt"
batch_prebuilt .carry-gpufix
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
batch_gtest bits 35 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit:ExpertsCuda.Fp8PrefillSmallShapesCpAsync'
grep -hE '^\[  FAILED|Failure|\[ bits \]|\[ rel_l2 \]' "$OUT/bits.log" | head -40 >>"$OUT/summary.txt"
for v in cpa old; do
  bin=./experts_cuda_test; [ $v = old ] && bin=./experts_cuda_test-oldarr
  batch_gtest race-$v 40 "$SAN" --tool racecheck $bin --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapesCpAsync'
  grep -v 'Host Frame' "$OUT/race-$v.log" | head -200 >"$OUT/race-$v.t" && mv "$OUT/race-$v.t" "$OUT/race-$v.log"
done
batch_gtest ll 35 env EPX_TIMEOUT_S=20 ./ll_cuda_test --gtest_filter='LlCuda.CreateWithoutACallerConfigLoadsItInTheVerdictGatherOneRank:LlCuda.FinalizeTwicePerPrepareOneRank:LlCuda.MatchesCpuOneRank'
grep -hE '^\[  FAILED|Failure|failures|threw|differs|refusal' "$OUT/ll.log" | head -20 >>"$OUT/summary.txt"
for r in old new new old; do
  b=$(cap 30); [ "$b" -lt 12 ] && { say "ab-$r skipped"; continue; }
  bin=epx-gemm-bench; [ $r = old ] && bin=epx-gemm-bench-old
  (cd "$P" && timeout -k 2 "$b" ./$bin --iters 10 --no-simt --no-cublas --prefill-only --prefill-modes 8,17 \
     --json "$OUT/ab-$r-$((SECONDS-T0)).json" >"$OUT/ab-$r.log" 2>&1)
  say "ab-$r rc=$? at $((SECONDS - T0)) s"; grep -E '^prefill' "$OUT/ab-$r.log" | tee -a "$OUT/summary.txt"
done
batch_gtest mem-cpa 35 "$SAN" --tool memcheck ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapesCpAsync'
say "done at $((SECONDS - T0)) s"
