#!/usr/bin/env bash
# tools/device/final-ll.sh: the LL benchmarks of the final integrated run (issue 4), <= 30 s.
# Called with OUT (results folder), the built tree at /tmp/epx-gpu-check/build and the source at $SRC:
# ll-v3 / ll-v4 FP8, graph replay, p50 of 200 replays beside nccl_a2a_raw in the same run (plus
# 1 token per rank and the SM count, in every JSON), for the defaults (ll.combine partial_fp32,
# ll.signal chunk, ll.expand message, ll.items run, ll.combine_wait flag, 16 warps per block), the A/B of the
# dispatch protocol (ll.signal = block, the default until the eighth session), partial_bf16, the A/B of the seventh session's combine
# option (ll.combine_wait = data), ll-v4, then column and the fifth session's ll.items = chunk if time is left.
# The logs carry the launch floor and the per-phase stamps, the JSONs the CUPTI kernel time. Each bench takes
# ~4-6 s; each is bounded, and none starts after 26 s.
set -u
OUT=${OUT:?OUT must name the results folder}
SRC=${SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
E=${EPX_BIN:-/tmp/epx-gpu-check/build/epx}
export NCCL_NVLS_ENABLE=0
# The libraries gpu-check.sh run() puts on the path (NCCL wheel, carried deps), if the caller did not.
case "${LD_LIBRARY_PATH:-}" in
  *nccl*) ;;
  *) NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
     AL=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
     export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$SRC" || exit 1
T0=$SECONDS
BENCH=(bench --backend ll,nccl_a2a_raw --ranks 2 --graph --iters 200 --warmup 20)
run() {  # <name> <combine> <case> [VAR=value ...]
  if [ $(( SECONDS - T0 )) -gt 26 ]; then echo "$1: skipped (time)"; return; fi
  local name=$1 combine=$2 case=$3; shift 3
  env EPX_LL_COMBINE="$combine" "$@" timeout -k 1 8 "$E" "${BENCH[@]}" --case "$case" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "$name: rc=$? ($(( SECONDS - T0 )) s)"
  grep -E "^ll-v. .* (ll|nccl_a2a_raw) " "$OUT/$name.log"
}
run ll-v3-final partial_fp32 ll-v3
run ll-v3-final-signal_block partial_fp32 ll-v3 EPX_LL_SIGNAL=block  # the A/B of the default ll.signal = chunk (eighth session)
run ll-v3-final-partial_bf16 partial_bf16 ll-v3
run ll-v3-final-flag_lane partial_fp32 ll-v3 EPX_LL_COMBINE_WAIT=flag_lane  # A/B: the combine's per-lane stores before the eighth session
run ll-v3-final-wait_data partial_fp32 ll-v3 EPX_LL_COMBINE_WAIT=data
run ll-v4-final partial_fp32 ll-v4
run ll-v3-final-column column ll-v3
run ll-v3-final-items_chunk partial_fp32 ll-v3 EPX_LL_ITEMS=chunk
# LL_SANITIZE_S=<seconds> (opt-in; not part of the ~30 s above): compute-sanitizer memcheck + racecheck of
# the ll-v3 bench (and memcheck of one two-rank graph test if time is left) on the built tree, the ll steps
# of sanitize-dispatch.sh without its build; summary in $OUT/sanitizer/sanitize-summary.txt.
if [ -n "${LL_SANITIZE_S:-}" ]; then
  mkdir -p "$OUT/sanitizer"
  SAN_ONLY=ll SAN_BUILD=0 SAN_STEP_S=$(( LL_SANITIZE_S / 2 )) SAN_LL_TEST_FILTER='LlCuda.PartialCombineGraphsTwoRanks' OUT="$OUT/sanitizer" \
    timeout -k 2 "$LL_SANITIZE_S" bash "$SRC/tools/device/sanitize-dispatch.sh" "$LL_SANITIZE_S" >"$OUT/sanitizer/sanitize.log" 2>&1
  echo "sanitizer: rc=$? ($(( SECONDS - T0 )) s)"; cat "$OUT/sanitizer/sanitize-summary.txt" 2>/dev/null
fi
