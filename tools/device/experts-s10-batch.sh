#!/usr/bin/env bash
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
P=/tmp/san2-prebuilt; D=/tmp/san2-deps
rm -rf "$P" "$D" && mkdir -p "$P" "$D"
tar -C "$P" -xJf .carry-san2/prebuilt.tar.xz && tar -C "$D" -xJf .carry/deps.tar.xz
dl="$D/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
say "commit $(cat .carry-san2/commit.txt)"
run() {  # run NAME LIMIT TC TOOL FILTER  (TOOL '-' = no sanitizer)
  local b; b=$(cap "$2"); [ "$b" -lt 10 ] && { say "$1 skipped"; return; }
  local pre=(); [ "$4" != - ] && pre=("$SAN" --tool "$4")
  (cd "$P" && EPX_EXPERTS_MXFP4_TC=$3 timeout -k 3 "$b" "${pre[@]}" ./experts_cuda_test --gtest_filter="$5") >"$OUT/$1.log" 2>&1
  say "$1 rc=$? (limit $b) at $((SECONDS - T0)) s: $(grep -E '^\[  (PASSED|FAILED) |ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$1.log" | tr '\n' ' ')"
}
run all 110 1 - '*'
EPX_EXPERTS_MXFP4_TC=6 run outer-tc 30 6 - '*Mxfp4DecodePathRowCounts*:*Mxfp4DecodePathScaleSpread*'
grep -h "rel_l2 \]\|timing" "$OUT/all.log" | head -80 >>"$OUT/summary.txt"
