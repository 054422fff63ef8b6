#!/usr/bin/env bash
# tools/device/last-s12-batch.sh (run as .carry-last/batch.sh: mkdir -p $OUT && OUT=$OUT bash tools/device/helpers-run.sh last:150,
# carry [".carry", ".carry-last"]; .carry-last/prebuilt.tar.xz = experts_cuda_test built on the dev machine at 538b115).
# The experts_cuda_test cases the final run of d932039 did not reach (its gpu-check step hit its time limit after
# Fp8TensorCoreV4ProSharedExpertWidth), on the same code (prebuilt here at 538b115).
source tools/device/batch-lib.sh
batch_init /tmp/last-out 150
export CUDA_VISIBLE_DEVICES=0
: >"$OUT/summary.txt"
batch_prebuilt .carry-last
batch_gtest rest 140 ./experts_cuda_test --gtest_filter='-ExpertsCuda.SmallShapesEveryFormatEveryLayout:ExpertsCuda.RowCountsFromOneToAFewHundred:ExpertsCuda.OddShapesBf16:ExpertsCuda.MixedFormatsAndWidths:ExpertsCuda.DeepSeekV3ExpertShapes:ExpertsCuda.DeepSeekV4ProExpertShapes:ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192:ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit:ExpertsCuda.Fp8PrefillSmallShapes:ExpertsCuda.Fp8PrefillSmallShapesCpAsync:ExpertsCuda.Fp8TensorCoreV4ProSharedExpertWidth'
grep -E '^\[ +(OK|FAILED|SKIPPED) +\]' "$OUT/rest.log" >>"$OUT/summary.txt"
