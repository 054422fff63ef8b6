#!/usr/bin/env bash
# lead's batch (tenth session): the ll refused-finalize retry and the ht kept-verdict fixes on one GPU, each test
# also against a mutant binary without its fix (must fail), plus memcheck of the ll test. Run as .carry-lead/batch.sh.
source tools/device/batch-lib.sh
batch_init /tmp/lead-out 150
export CUDA_VISIBLE_DEVICES=0
batch_prebuilt .carry-lead
ldd "$P/ll_cuda_test" | grep -i "nccl\|not found" >"$OUT/ldd.txt" 2>&1
batch_gtest ll-onerank 50 ./ll_cuda_test --gtest_filter='*OneRank*'
batch_gtest ht-onerank 40 ./ht_cuda_test --gtest_filter='*OneRank*'
batch_gtest ht-mutant 30 ./ht_cuda_test-mutant --gtest_filter='HtCuda.DeviceTokenCountOneRank'
batch_gtest ll-mutant 30 ./ll_cuda_test-mutant --gtest_filter='LlCuda.RefusedFinalizeIsNotRetriedOneRank'
grep -E "refused:|retried:|device num_tokens|mismatch|Failure|rank 0" "$OUT"/*.log | head -40 >>"$OUT/summary.txt"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
if [ -n "$SAN" ]; then
  batch_gtest memcheck-ll 45 "$SAN" --tool memcheck --target-processes all ./ll_cuda_test \
    --gtest_filter='LlCuda.RefusedFinalizeIsNotRetriedOneRank'
fi
