#!/usr/bin/env bash
# tools/device/final-ht.sh: the ht benchmark figures of issue 5 in the final integrated device run
# (after tools/device/gpu-check.sh built the tree). Environment: OUT (results folder), SRC (source
# root; default: this checkout), EPX (the epx binary; default /tmp/epx-gpu-check/build/epx),
# HT_FINAL_S (seconds for all of it, default 39). Writes $OUT/ht-v3-sms{64,24,16,8,48}.json in that
# order while time is left (RESULTS.md format; for bench/results/h200x2/) and ht-final.log. One run
# takes ~6-8 s on 2 x H200 (start-up, 2 x 55 iterations, the CPU validation).
# Each run: `epx bench --case ht-v3 --backend ht,nccl_a2a_raw --ranks 2 --warmup 5 --iters 50` (fp8 and
# bf16 dispatch, combine; nccl_a2a_raw in the same run), with EPX_HT_NUM_SMS set (64 is the default since
# the fourth session, confirmed against 96 and 128 x 8 warps in the fifth; 8 / 16 / 24 are the issue's
# figures, 48 the earlier reference budget); every ht row validated vs HtCpu.
set -uo pipefail
T0=$SECONDS
BUDGET=${HT_FINAL_S:-39}
OUT=${OUT:-/tmp/ht-final-out}
SRC=${SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
EPX=${EPX:-/tmp/epx-gpu-check/build/epx}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
cd "$SRC" || exit 1
run() {  # run <name> <limit_s> <sms> [extra epx args]
  local name=$1 lim=$2 sms=$3
  shift 3
  local l=$((BUDGET - (SECONDS - T0)))
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 5 ]; then echo "== skipped $name (no time left)"; return; fi
  echo "== $(date -u +%T) $name: EPX_HT_NUM_SMS=$sms (limit $lim s)"
  EPX_HT_NUM_SMS=$sms timeout -k 2 "$lim" "$EPX" bench --case ht-v3 --backend ht,nccl_a2a_raw --ranks 2 --warmup 5 --iters 50 "$@" \
    --json "$OUT/$name.json"
  echo "   rc=$?"
}
{
  run ht-v3-sms64 11 64
  run ht-v3-sms24 10 24
  run ht-v3-sms16 10 16
  run ht-v3-sms8 10 8
  run ht-v3-sms48 10 48
} >"$OUT/ht-final.log" 2>&1
grep -E "^==|rc=|^ht|nccl_a2a_raw" "$OUT/ht-final.log" | head -80
