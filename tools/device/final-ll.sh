#!/usr/bin/env bash
# tools/device/final-ll.sh: the LL benchmarks of the final integrated run (issue 4), ~50 s.
# Called with OUT (results folder), the built tree at /tmp/epx-gpu-check/build and the source at $SRC:
# ll-v3 / ll-v4 FP8, graph replay, p50 of 200 replays beside nccl_a2a_raw in the same run (and
# 1 token per rank, the SM count), for the column-order combine and the expert-side partial modes.
set -u
OUT=${OUT:?OUT must name the results folder}
SRC=${SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
E=${EPX_BIN:-/tmp/epx-gpu-check/build/epx}
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
cd "$SRC" || exit 1
BENCH=(bench --backend ll,nccl_a2a_raw --ranks 2 --graph --iters 200 --warmup 20)
run() {  # <name> <env assignment or -> : one bench, logged, at most 12 s
  local name=$1 envv=$2; shift 2
  if [ "$envv" = - ]; then timeout -k 2 12 "$E" "${BENCH[@]}" "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  else env "$envv" timeout -k 2 12 "$E" "${BENCH[@]}" "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1; fi
  echo "$name: rc=$?"
  grep -E "^ll-v. .* (ll|nccl_a2a_raw) " "$OUT/$name.log"
}
run ll-v3 - --case ll-v3
run ll-v3-partial_fp32 EPX_LL_COMBINE=partial_fp32 --case ll-v3
run ll-v3-partial_bf16 EPX_LL_COMBINE=partial_bf16 --case ll-v3
run ll-v4 - --case ll-v4
run ll-v4-partial_fp32 EPX_LL_COMBINE=partial_fp32 --case ll-v4
