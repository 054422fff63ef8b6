#!/usr/bin/env bash
# lead's two-rank check (tenth session, x2): ht_cuda_test (all), ll_cuda_test two-rank refusal/eager cases, of main's
# ll/ht (the binaries of .carry-lead). Run as .carry-lead2/batch.sh.
source tools/device/batch-lib.sh
batch_init /tmp/lead2-out 150
nvidia-smi -L | tee -a "$OUT/summary.txt"
batch_prebuilt .carry-lead
batch_gtest ht-all 90 ./ht_cuda_test --gtest_filter='*'
batch_gtest ll-two 60 ./ll_cuda_test \
  --gtest_filter='LlCuda.CombineRefusedOnOneRankReachesEveryRankTwoRanks:LlCuda.MatchesCpuTwoRanks:LlCuda.*OneRank*'
grep -E "device num_tokens|DIFFER|Failure|rank 1 after|rank 0 after" "$OUT"/*.log | head -30 >>"$OUT/summary.txt"
