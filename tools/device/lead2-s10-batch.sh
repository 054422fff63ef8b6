#!/usr/bin/env bash
# lead's two-rank check (tenth session, x2): ht_cuda_test (all), ll_cuda_test two-rank refusal/eager cases, of main's ll/ht.
set -uo pipefail
OUT="${OUT:-/tmp/lead2-out}"; BUDGET="${BUDGET:-150}"
mkdir -p "$OUT"; T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
cap() { local l; l=$(($(left) - 3)); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
export NCCL_NVLS_ENABLE=0
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
P=/tmp/lead-prebuilt; D=/tmp/lead-deps
rm -rf "$P" "$D" && mkdir -p "$P" "$D"
tar -C "$P" -xJf .carry-lead/prebuilt.tar.xz && tar -C "$D" -xJf .carry/deps.tar.xz
dl="$D/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi -L | tee -a "$OUT/summary.txt"
say "commit $(cat .carry-lead/commit.txt)"
t() {  # t NAME LIMIT BIN FILTER
  local b; b=$(cap "$2"); [ "$b" -lt 8 ] && { say "$1 skipped"; return; }
  (cd "$P" && timeout -k 3 "$b" "./$3" --gtest_filter="$4") >"$OUT/$1.log" 2>&1
  say "$1 rc=$? (limit $b) at $((SECONDS - T0)) s: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$1.log" | tr '\n' ' ')"
}
t ht-all 90 ht_cuda_test '*'
t ll-two 60 ll_cuda_test 'LlCuda.CombineRefusedOnOneRankReachesEveryRankTwoRanks:LlCuda.MatchesCpuTwoRanks:LlCuda.*OneRank*'
grep -E "device num_tokens|DIFFER|Failure|rank 1 after|rank 0 after" "$OUT"/*.log | head -30 >>"$OUT/summary.txt"
