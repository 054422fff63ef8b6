#!/usr/bin/env bash
# tools/device/last-s11-batch.sh (copy): the whole experts_cuda_test and moe_cuda_test on one H200 at the eleventh
# session's last kernels (after the final run: 1ffa5e5 lean_load_if, 8d71349 per-thread empty arrivals), binaries built
# on the dev machine (sm_90a).
source tools/device/batch-lib.sh
batch_init /tmp/last-out 200
export CUDA_VISIBLE_DEVICES=0
: >"$OUT/summary.txt"
batch_prebuilt .carry-last
batch_gtest experts 150 ./experts_cuda_test
grep -hE '^\[  FAILED|Failure' "$OUT/experts.log" | head -20 >>"$OUT/summary.txt"
batch_gtest moe 40 ./moe_cuda_test
