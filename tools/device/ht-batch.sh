#!/usr/bin/env bash
# tools/device/ht-batch.sh: the ht helper's part of a shared device batch (copied to
# .carry-ht/batch.sh). Run from a copy of the main checkout that holds .carry/deps.tar.xz and
# .carry-ht/src.tar.xz:   OUT=<dir> timeout -k 5 <allowance> bash .carry-ht/batch.sh
# Builds epx + ht_cuda_test against the NCCL wheel (the configure line of gpu-check.sh), then
# runs, each under its own time limit so that everything fits HT_BATCH_S seconds (default 125):
# one ht-v3 benchmark, ht_cuda_test (bit-exact vs HtCpu, incl. the expert-contiguous layout),
# then the combine variants (EPX_HT_COMBINE_MODE / EPX_HT_CHUNK_ROWS) and SM budgets.
set -uo pipefail
T0=$SECONDS
BUDGET=${HT_BATCH_S:-125}
OUT=${OUT:-/tmp/ht-out}
mkdir -p "$OUT"
ROOT=$(pwd)
S=/tmp/s-ht
rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf "$ROOT/.carry-ht/src.tar.xz" && cp "$ROOT/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN
DEPS=/tmp/ht-deps
rm -rf "$DEPS" && mkdir -p "$DEPS" && tar -C "$DEPS" -xJf "$S/.carry/deps.tar.xz"
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
ARCH=$DEPS/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$NCCL/lib:$ARCH:$ARCH/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=/tmp/ht-build

left() { echo $((BUDGET - (SECONDS - T0))); }
step() {  # step <name> <limit_s> <command...>: logged to $OUT/<name>.log, cut to the time left
  local name=$1 lim=$2
  shift 2
  local l
  l=$(left)
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 4 ]; then echo "== skipped $name (no time left)"; return; fi
  echo "== $(date -u +%T) +$((SECONDS - T0)) s $name (limit $lim s)"
  timeout -k 2 "$lim" "$@" >"$OUT/$name.log" 2>&1
  echo "   rc=$?"
}

step configure 30 cmake -S "$S" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DEPX_NCCL_ROOT="$NCCL" -DCMAKE_PREFIX_PATH="$DEPS/usr" -DBLA_VENDOR=OpenBLAS -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
  -DCMAKE_LIBRARY_PATH="$ARCH/openblas-pthread;$ARCH" -DEPX_CBLAS_INCLUDE="$DEPS/usr/include/x86_64-linux-gnu/openblas-pthread"
step build 70 cmake --build "$B" -j "$(nproc)" --target epx ht_cuda_test
grep -E "error|FAILED" "$OUT/build.log" | head -20

cd "$S" || exit 1
bench() {  # bench <name> <limit> [ENV=...] -- epx bench args
  local name=$1 lim=$2
  shift 2
  step "$name" "$lim" env "$@"
}
A=(bench --case ht-v3 --backend ht,nccl_a2a_raw --ranks 2 --warmup 5)
bench ht-v3-sms48 20 EPX_HT_NUM_SMS=48 "$B/epx" "${A[@]}" --iters 20 --json "$OUT/ht-v3-sms48.json"
bench ht-v3-sms48-mode0 15 EPX_HT_NUM_SMS=48 EPX_HT_COMBINE_MODE=0 "$B/epx" "${A[@]}" --iters 20 --json "$OUT/ht-v3-sms48-mode0.json"
step ht_cuda_test 75 "$B/ht_cuda_test" --gtest_filter='HtCuda.MatchesHtCpuTwoRanks'
bench ht-v3-sms48-chunk1 15 EPX_HT_NUM_SMS=48 EPX_HT_CHUNK_ROWS=1 "$B/epx" "${A[@]}" --iters 20 --json "$OUT/ht-v3-sms48-chunk1.json"
bench ht-v3-sms24 15 EPX_HT_NUM_SMS=24 "$B/epx" "${A[@]}" --iters 20 --json "$OUT/ht-v3-sms24.json"
bench ht-v3-sms48-chunk16 15 EPX_HT_NUM_SMS=48 EPX_HT_CHUNK_ROWS=16 "$B/epx" "${A[@]}" --iters 20 --json "$OUT/ht-v3-sms48-chunk16.json"
step ht-timeline 15 env EPX_HT_NUM_SMS=48 "$B/ht_cuda_test" --gtest_also_run_disabled_tests --gtest_filter='*Timeline*'

echo "== summary (+$((SECONDS - T0)) s)"
grep -E "OK \]|FAILED|PASSED|bit-exact|DIFFER|mismatch" "$OUT/ht_cuda_test.log" 2>/dev/null | head -20
grep -E "^rank" "$OUT/ht-timeline.log" 2>/dev/null | head -8
for f in "$OUT"/ht-v3-*.json; do
  [ -f "$f" ] || continue
  python3 - "$f" <<'PY'
import json, os, sys
d = json.load(open(sys.argv[1]))
rows = [f"{r['backend']}/{r['op']}/{r['dispatch_dtype']}: {r['latency_us_p50']:.0f} us {r['gbps']:.0f} GB/s{' NOT VALIDATED' if r['backend'] == 'ht' and r.get('validated') is not True else ''}"
        for r in d["results"] if r.get("status") == "ran"]
print(os.path.basename(sys.argv[1]) + ": " + "; ".join(rows))
PY
done
