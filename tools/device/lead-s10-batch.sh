#!/usr/bin/env bash
# lead's batch (tenth session): the ll refused-finalize retry and the ht kept-verdict fixes on one GPU, each test
# also against a mutant binary without its fix (must fail), plus memcheck of the ll test.
set -uo pipefail
OUT="${OUT:-/tmp/lead-out}"; BUDGET="${BUDGET:-150}"
mkdir -p "$OUT"; T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
cap() { local l; l=$(($(left) - 3)); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=0
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
P=/tmp/lead-prebuilt; D=/tmp/lead-deps
rm -rf "$P" "$D" && mkdir -p "$P" "$D"
tar -C "$P" -xJf .carry-lead/prebuilt.tar.xz && tar -C "$D" -xJf .carry/deps.tar.xz
dl="$D/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd "$P/ll_cuda_test" | grep -i "nccl\|not found" >"$OUT/ldd.txt" 2>&1
say "commit $(cat .carry-lead/commit.txt) nccl $nccl"
t() {  # t NAME LIMIT BIN FILTER
  local b; b=$(cap "$2"); [ "$b" -lt 8 ] && { say "$1 skipped"; return; }
  (cd "$P" && timeout -k 3 "$b" "./$3" --gtest_filter="$4") >"$OUT/$1.log" 2>&1
  say "$1 rc=$? (limit $b) at $((SECONDS - T0)) s: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$1.log" | tr '\n' ' ')"
}
t ll-onerank 50 ll_cuda_test '*OneRank*'
t ht-onerank 40 ht_cuda_test '*OneRank*'
t ht-mutant 30 ht_cuda_test-mutant 'HtCuda.DeviceTokenCountOneRank'
t ll-mutant 30 ll_cuda_test-mutant 'LlCuda.RefusedFinalizeIsNotRetriedOneRank'
grep -E "refused:|retried:|device num_tokens|mismatch|Failure|rank 0" "$OUT"/*.log | head -40 >>"$OUT/summary.txt"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
b=$(cap 45)
if [ -n "$SAN" ] && [ "$b" -gt 15 ]; then
  (cd "$P" && timeout -k 3 "$b" "$SAN" --tool memcheck --target-processes all ./ll_cuda_test \
     --gtest_filter='LlCuda.RefusedFinalizeIsNotRetriedOneRank') >"$OUT/memcheck-ll.log" 2>&1
  say "memcheck ll rc=$? at $((SECONDS - T0)) s: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck-ll.log" | tr '\n' ' ')"
fi
