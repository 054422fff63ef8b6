#!/usr/bin/env bash
# Optional check of branch mxfp4-s11-prune (f5ca748: the losing MXFP4 decode variants removed; not yet run on a GPU).
# OUT=<dir> BUDGET=<s> timeout -k 5 <s> bash .carry-mxfp4-prune/batch.sh   (about 60-70 s)
source tools/device/batch-lib.sh
batch_init /tmp/mxfp4-prune-out 90
export CUDA_VISIBLE_DEVICES=0
: >"$OUT/summary.txt"
batch_prebuilt .carry-mxfp4-prune
batch_gtest gpu-tests 50 ./experts_cuda_test --gtest_filter='*Mxfp4*:*DeepSeekV4Pro*:*MixedFormats*:*GraphCapture*:*SmallShapesEveryFormat*'
grep -hE "^\[  FAILED|rel_l2|Failure" "$OUT"/gpu-tests.log | tail -40 >>"$OUT/summary.txt"
b=$(cap 25); [ "$b" -ge 8 ] && { timeout -k 2 "$b" "$P/epx-gemm-mxfp4-bench" --json "$OUT/decode.json" --iters 20 --no-simt --cases decode >"$OUT/decode.log" 2>&1; say "decode rc=$?"; grep -E "^(ceiling|decode)" "$OUT/decode.log" | tee -a "$OUT/summary.txt"; }
