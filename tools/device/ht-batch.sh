#!/usr/bin/env bash
# tools/device/ht-batch.sh: the ht helper's part of a shared device batch (copied to
# .carry-ht/batch.sh). Run from a copy of the main checkout that holds .carry/deps.tar.xz and
# .carry-ht/src.tar.xz:   OUT=<dir> timeout -k 5 <allowance> bash .carry-ht/batch.sh
# Builds epx + ht_cuda_test through gpu-check.sh (GPU_CHECK_TARGETS), then, each step under its own
# time limit so that everything fits HT_BATCH_S seconds (default 145):
#   1. HtCuda.LateRankIsNotOverrun (the ordering bug's test, no sanitizer), HtCuda.TakesTheCallersConfig
#   2. HtCuda.MatchesHtCpuTwoRanks under compute-sanitizer memcheck (where the bug showed)
#   3. epx bench --case ht-v3 --backend ht,nccl_a2a_raw at 48 SMs, then (while time is left) mode 1 with
#      1-row chunks, the device timeline (DISABLED_Timeline) and 64 SMs
set -uo pipefail
T0=$SECONDS
BUDGET=${HT_BATCH_S:-145}
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
  if [ "$lim" -lt 6 ]; then echo "== skipped $name (no time left)"; return; fi
  echo "== $(date -u +%T) +$((SECONDS - T0)) s $name (limit $lim s)"
  local t=$SECONDS
  timeout -k 2 "$lim" "$@" >"$OUT/$name.log" 2>&1
  echo "   rc=$? in $((SECONDS - t)) s"
}

mkdir -p "$OUT/gpu-check"
step build 75 env OUT="$OUT/gpu-check" GPU_CHECK_SRC="$S" GPU_CHECK_TARGETS="epx ht_cuda_test" GPU_CHECK_TESTS=0 GPU_CHECK_ONE_GPU=0 \
  GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 bash "$S/tools/device/gpu-check.sh" run
grep -E "error|FAILED" "$OUT/gpu-check/build.log" | head -20
B=/tmp/epx-gpu-check/build
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
ARCH=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$NCCL/lib:$ARCH:$ARCH/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cd "$S" || exit 1

step late-rank 25 "$B/ht_cuda_test" --gtest_filter='HtCuda.LateRankIsNotOverrun:HtCuda.TakesTheCallersConfig'
step memcheck-ht-test 85 env EPX_TIMEOUT_S=900 compute-sanitizer --target-processes all --report-api-errors no --error-exitcode 9 \
  --tool memcheck "$B/ht_cuda_test" --gtest_filter='HtCuda.MatchesHtCpuTwoRanks'
A=(bench --case ht-v3 --backend ht,nccl_a2a_raw --ranks 2 --warmup 5 --iters 20)
step ht-v3-sms48 14 env EPX_HT_NUM_SMS=48 "$B/epx" "${A[@]}" --json "$OUT/ht-v3-sms48.json"
step ht-v3-sms48-mode1-chunk1 12 env EPX_HT_NUM_SMS=48 EPX_HT_COMBINE_MODE=1 EPX_HT_CHUNK_ROWS=1 "$B/epx" "${A[@]}" --json "$OUT/ht-v3-sms48-mode1-chunk1.json"
step ht-timeline 12 env EPX_HT_NUM_SMS=48 "$B/ht_cuda_test" --gtest_also_run_disabled_tests --gtest_filter='HtCuda.DISABLED_Timeline'
step ht-v3-sms64 12 env EPX_HT_NUM_SMS=64 "$B/epx" "${A[@]}" --json "$OUT/ht-v3-sms64.json"

echo "== summary (+$((SECONDS - T0)) s)"
grep -E "OK \]|FAILED|PASSED|bit-exact|DIFFER|mismatch|ERROR SUMMARY" "$OUT/late-rank.log" "$OUT/memcheck-ht-test.log" 2>/dev/null | cut -c1-220 | head -30
grep -E "^rank" "$OUT/ht-timeline.log" 2>/dev/null | head -4
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
