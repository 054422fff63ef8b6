#!/usr/bin/env bash
# lead's experts_cuda_test run at the review mends (tenth session, one GPU): every test with the default settings,
# then the decode-path tests under an outer EPX_EXPERTS_MXFP4_TC=6 (test::ScopedEnv keeps it). Run as .carry-san2/batch.sh.
source tools/device/batch-lib.sh
batch_init /tmp/san2-out 180
export CUDA_VISIBLE_DEVICES=0
batch_prebuilt .carry-san2
batch_gtest all 110 env EPX_EXPERTS_MXFP4_TC=1 ./experts_cuda_test --gtest_filter='*'
batch_gtest outer-tc 30 env EPX_EXPERTS_MXFP4_TC=6 ./experts_cuda_test \
  --gtest_filter='*Mxfp4DecodePathRowCounts*:*Mxfp4DecodePathScaleSpread*'
grep -h "rel_l2 \]\|timing" "$OUT/all.log" | head -80 >>"$OUT/summary.txt"
