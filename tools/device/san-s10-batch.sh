#!/usr/bin/env bash
# NOTE (after 1936949): this script records how results were made with binaries from before that commit, where
# EPX_EXPERTS_MXFP4_TC=1 (default) was decode_item_ring and =6 decode_item_ring2; at main since then the two are swapped.
# lead's sanitizer / ring2 check (tenth session, one GPU): experts_cuda_test of 5f4ac10 (= main's experts sources)
# with EPX_EXPERTS_MXFP4_TC=6 (decode_item_ring2) as the object's setting, then compute-sanitizer on the decode path.
set -uo pipefail
OUT="${OUT:-/tmp/san-out}"; BUDGET="${BUDGET:-180}"
mkdir -p "$OUT"; T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
cap() { local l; l=$(($(left) - 3)); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=0
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
P=/tmp/san-prebuilt; D=/tmp/san-deps
rm -rf "$P" "$D" && mkdir -p "$P" "$D"
tar -C "$P" -xJf .carry-san/prebuilt.tar.xz && tar -C "$D" -xJf .carry/deps.tar.xz
dl="$D/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
say "commit $(cat .carry-san/commit.txt)"
run() {  # run NAME LIMIT TC TOOL FILTER  (TOOL '-' = no sanitizer)
  local b; b=$(cap "$2"); [ "$b" -lt 10 ] && { say "$1 skipped"; return; }
  local pre=(); [ "$4" != - ] && pre=("$SAN" --tool "$4")
  (cd "$P" && EPX_EXPERTS_MXFP4_TC=$3 timeout -k 3 "$b" "${pre[@]}" ./experts_cuda_test --gtest_filter="$5") >"$OUT/$1.log" 2>&1
  say "$1 rc=$? (limit $b) at $((SECONDS - T0)) s: $(grep -E '^\[  (PASSED|FAILED) |ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$1.log" | tr '\n' ' ')"
}
run tc6-tests 45 6 - '*Mxfp4*:*DeepSeekV4Pro*:*MixedFormats*'
run tc6-memcheck 60 6 memcheck '*Mxfp4DecodePathScaleSpread*:*Mxfp4DecodePathRowCounts*'
run tc6-racecheck 40 6 racecheck '*Mxfp4DecodePathScaleSpread*'
run tc1-racecheck 30 1 racecheck '*Mxfp4DecodePathScaleSpread*'
grep -h "rel_l2" "$OUT/tc6-tests.log" | head -40 >>"$OUT/summary.txt"
for f in "$OUT"/*check.log; do grep -v "Host Frame" "$f" > "$f.t" && mv "$f.t" "$f"; done
