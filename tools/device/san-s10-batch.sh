#!/usr/bin/env bash
# NOTE (after 1936949): this script records how results were made with binaries from before that commit, where
# EPX_EXPERTS_MXFP4_TC=1 (default) was decode_item_ring and =6 decode_item_ring2; at main since then the two are swapped.
# lead's sanitizer / ring2 check (tenth session, one GPU): experts_cuda_test of 5f4ac10 (= main's experts sources)
# with EPX_EXPERTS_MXFP4_TC=6 (decode_item_ring2) as the object's setting, then compute-sanitizer on the decode path.
# Run as .carry-san/batch.sh.
source tools/device/batch-lib.sh
batch_init /tmp/san-out 180
export CUDA_VISIBLE_DEVICES=0
batch_prebuilt .carry-san
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
run() {  # run NAME LIMIT TC TOOL FILTER  (TOOL '-' = no sanitizer)
  local pre=(); [ "$4" != - ] && pre=("$SAN" --tool "$4")
  batch_gtest "$1" "$2" env EPX_EXPERTS_MXFP4_TC="$3" "${pre[@]}" ./experts_cuda_test --gtest_filter="$5"
}
run tc6-tests 45 6 - '*Mxfp4*:*DeepSeekV4Pro*:*MixedFormats*'
run tc6-memcheck 60 6 memcheck '*Mxfp4DecodePathScaleSpread*:*Mxfp4DecodePathRowCounts*'
run tc6-racecheck 40 6 racecheck '*Mxfp4DecodePathScaleSpread*'
run tc1-racecheck 30 1 racecheck '*Mxfp4DecodePathScaleSpread*'
grep -h "rel_l2" "$OUT/tc6-tests.log" | head -40 >>"$OUT/summary.txt"
for f in "$OUT"/*check.log; do grep -v "Host Frame" "$f" > "$f.t" && mv "$f.t" "$f"; done
