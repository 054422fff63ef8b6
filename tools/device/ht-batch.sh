#!/usr/bin/env bash
# tools/device/ht-batch.sh: the ht helper's part of a shared device batch (copied to
# .carry-ht/batch.sh). Run from a copy of the main checkout that holds .carry/deps.tar.xz and
# .carry-ht/src.tar.xz:   OUT=<dir> timeout -k 5 <allowance> bash .carry-ht/batch.sh
# Builds epx + ht_cuda_test through gpu-check.sh (GPU_CHECK_TARGETS), then, each step under its own
# time limit so that everything fits HT_BATCH_S seconds (default 235, batch 2; batch 1 ran HT_MODE=1 in 105):
#   1. HtCuda.LateRankIsNotOverrun + HtCuda.TakesTheCallersConfig (two-rank correctness, no sanitizer)
#   2. epx bench --case ht-v3 --backend ht,nccl_a2a_raw (every ht row validated against HtCpu in the same
#      run; nccl_a2a_raw beside it) at 64 SMs with the defaults, then the A/B runs (ht.pdl 0, ht.fp8_unroll 4),
#      the device timeline (DISABLED_Timeline, medians of 20) and the SM sweep 128 x 8 warps / 96 / 48 / 80
#      while time is left
#   HT_MODE=2 (batch 2): the defaults at 64 SMs and ht.pdl 1 (no L2 prefetch) beside them, the timeline of
#   both, then the ht steps of tools/device/sanitize-dispatch.sh (memcheck + racecheck, what is left up to
#   HT_SAN_S seconds), then 48 / 24 / 16 / 8 SMs while time is left.
set -uo pipefail
T0=$SECONDS
BUDGET=${HT_BATCH_S:-235}
OUT=${OUT:-/tmp/ht-out}
mkdir -p "$OUT"
ROOT=$(pwd)
S=/tmp/s-ht
rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf "$ROOT/.carry-ht/src.tar.xz" && cp "$ROOT/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN

left() { echo $((BUDGET - (SECONDS - T0))); }
step() {  # step <name> <limit_s> <command...>: logged to $OUT/<name>.log, cut to the time left
  local name=$1 lim=$2
  shift 2
  local l
  l=$(left)
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 6 ]; then echo "== skipped $name (no time left)" | tee -a "$OUT/batch.log"; return; fi
  echo "== $(date -u +%T) +$((SECONDS - T0)) s $name (limit $lim s)" | tee -a "$OUT/batch.log"
  local t=$SECONDS
  timeout -k 2 "$lim" "$@" >"$OUT/$name.log" 2>&1
  echo "   rc=$? in $((SECONDS - t)) s" | tee -a "$OUT/batch.log"
}

mkdir -p "$OUT/gpu-check"
step build 70 env OUT="$OUT/gpu-check" GPU_CHECK_SRC="$S" GPU_CHECK_TARGETS="epx ht_cuda_test" GPU_CHECK_TESTS=0 GPU_CHECK_ONE_GPU=0 \
  GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 bash "$S/tools/device/gpu-check.sh" run
grep -E "error|FAILED" "$OUT/gpu-check/build.log" | head -20
B=/tmp/epx-gpu-check/build
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
ARCH=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$NCCL/lib:$ARCH:$ARCH/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cd "$S" || exit 1

step late-rank 20 "$B/ht_cuda_test" --gtest_filter='HtCuda.LateRankIsNotOverrun:HtCuda.TakesTheCallersConfig:HtCuda.HierarchicalTakesTheCallersConfig'
A=(bench --case ht-v3 --backend ht,nccl_a2a_raw --ranks 2 --warmup 5 --iters 50)
bench() {  # bench <name> <env...>
  local name=$1
  shift
  step "$name" 12 env "$@" "$B/epx" "${A[@]}" --json "$OUT/$name.json"
}
if [ "${HT_MODE:-2}" = 2 ]; then
  # batch 2: the final code at the default budget, the sanitizers on it, then the issue's SM figures
  bench ht-v3-sms64 EPX_HT_NUM_SMS=64
  bench ht-v3-sms64-pdl1 EPX_HT_NUM_SMS=64 EPX_HT_PDL=1
  step ht-timeline 10 env EPX_HT_NUM_SMS=64 "$B/ht_cuda_test" --gtest_also_run_disabled_tests --gtest_filter='HtCuda.DISABLED_Timeline'
  step ht-timeline-pdl1 10 env EPX_HT_NUM_SMS=64 EPX_HT_PDL=1 "$B/ht_cuda_test" --gtest_also_run_disabled_tests --gtest_filter='HtCuda.DISABLED_Timeline'
  san=$(( $(left) - 2 ))
  [ "$san" -gt "${HT_SAN_S:-170}" ] && san=${HT_SAN_S:-170}
  step sanitize "$san" env OUT="$OUT" SAN_ONLY=ht SAN_BUILD=0 bash "$S/tools/device/sanitize-dispatch.sh" "$(( san - 3 ))"
  for n in 48 24 16 8; do bench "ht-v3-sms$n" EPX_HT_NUM_SMS=$n; done
else
  bench ht-v3-sms64 EPX_HT_NUM_SMS=64
  bench ht-v3-sms64-pdl0 EPX_HT_NUM_SMS=64 EPX_HT_PDL=0
  bench ht-v3-sms64-unroll4 EPX_HT_NUM_SMS=64 EPX_HT_FP8_UNROLL=4
  step ht-timeline 14 env EPX_HT_NUM_SMS=64 "$B/ht_cuda_test" --gtest_also_run_disabled_tests --gtest_filter='HtCuda.DISABLED_Timeline'
  bench ht-v3-sms128-warps8 EPX_HT_NUM_SMS=128 EPX_HT_WARPS_PER_BLOCK=8
  bench ht-v3-sms96 EPX_HT_NUM_SMS=96
  bench ht-v3-sms48 EPX_HT_NUM_SMS=48
  bench ht-v3-sms80 EPX_HT_NUM_SMS=80
fi

echo "== summary (+$((SECONDS - T0)) s)"
grep -E "OK \]|FAILED|PASSED|bit-exact|DIFFER|mismatch" "$OUT/late-rank.log" 2>/dev/null | cut -c1-200 | head -12
grep -E "^rank" "$OUT"/ht-timeline*.log 2>/dev/null | cut -c1-400 | head -8
[ -f "$OUT/sanitize-summary.txt" ] && cat "$OUT/sanitize-summary.txt"
for f in "$OUT"/ht-v3-*.json; do
  [ -f "$f" ] || continue
  python3 - "$f" <<'PY'
import json, os, sys
d = json.load(open(sys.argv[1]))
rows = [f"{r['backend']}/{r['op']}/{r['dispatch_dtype']}: {r['latency_us_p50']:.0f} us {r['gbps']:.0f} GB/s{' NOT VALIDATED' if r['backend'] == 'ht' and r.get('validated') is not True else ''}"
        for r in d["results"] if r.get("status") == "ran" and r.get("tokens_per_rank") != 1]
print(os.path.basename(sys.argv[1]) + ": " + "; ".join(rows))
PY
done
