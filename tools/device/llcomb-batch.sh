#!/usr/bin/env bash
# tools/device/llcomb-batch.sh: helper "llcomb"'s device batch (eighth session, issue 4: the LL
# combine). Run from a copy of /work/main carrying .carry/deps.tar.xz and .carry-llcomb/:
#   OUT=<dir> timeout -k 5 <allowance ~95 s> bash .carry-llcomb/batch.sh
# Builds epx + ll_cuda_test (gpu-check.sh, GPU_CHECK_TARGETS; ~35-50 s there) unless
# .carry-llcomb/prebuilt.tar.xz holds them and they load; then, most important first, each step
# bounded inside LLC_BUDGET_S (default 90 s):
#   ll-v3 partial_fp32 with ll.combine_wait = flag (whole-line stores, + nccl_a2a_raw beside) and flag_lane
#   (main's per-lane stores), the A/B in one run (every row validated against the CPU reference; stamps and
#   CUPTI kernel time in the logs / JSON); ll_cuda_test's partial-combine cases (eager fp32 + bf16, graphs),
#   the flag_lane case, flag again (the spread), data's graph test and bench after the clean-up, ll-v4,
#   partial_bf16.
set -u
T0=$SECONDS
BUDGET=${LLC_BUDGET_S:-90}
OUT=${OUT:-/tmp/llcomb-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
HERE=$(pwd)
left() { echo $(( BUDGET - (SECONDS - T0) )); }
step() {  # <name> <limit_s> <cmd...>: run with min(limit, time left - 1); log to $OUT/<name>.log
  local name=$1 lim=$2; shift 2
  local l; l=$(( $(left) - 1 ))
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 3 ]; then echo "skip $name (no time left)" | tee -a "$OUT/summary.txt"; return 1; fi
  local t=$SECONDS
  timeout -k 1 "$lim" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(( SECONDS - t )) s (limit $lim, at $(( SECONDS - T0 )) s)" | tee -a "$OUT/summary.txt"
  return $rc
}
S=/tmp/s-llcomb
rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf "$HERE/.carry-llcomb/src.tar.xz" && cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
B=""
if [ -f "$HERE/.carry-llcomb/prebuilt.tar.xz" ]; then
  P=/tmp/llcomb-prebuilt D=/tmp/llcomb-deps
  rm -rf "$P" "$D" && mkdir -p "$P" "$D"
  tar -C "$P" -xJf "$HERE/.carry-llcomb/prebuilt.tar.xz" && tar -C "$D" -xJf "$HERE/.carry/deps.tar.xz"
  dl="$D/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$NCCL/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  ldd "$P/epx" "$P/ll_cuda_test" >"$OUT/prebuilt-ldd.txt" 2>&1
  if ! grep -q "not found" "$OUT/prebuilt-ldd.txt" && timeout 15 "$P/ll_cuda_test" --gtest_list_tests >/dev/null 2>>"$OUT/prebuilt-ldd.txt"; then B="$P"; fi
  echo "prebuilt: ${B:-unusable (prebuilt-ldd.txt)} at $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
fi
if [ -z "$B" ]; then
  mkdir -p "$OUT/build"
  OUT="$OUT/build" GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="epx ll_cuda_test" timeout -k 2 $(( BUDGET - 14 )) bash "$S/tools/device/gpu-check.sh" run >"$OUT/build/gpu-check.out" 2>&1
  echo "build: $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
  B=/tmp/epx-gpu-check/build
  AL=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
E="$B/epx"
[ -x "$E" ] || { echo "build failed"; grep -E "error|Error" "$OUT/build/build.log" 2>/dev/null | head -30; exit 1; }
cd "$S" || exit 1
bench() {  # <name> <backends> <case> [VAR=value ...]: one epx bench with those config variables
  local name=$1 be=$2 case=$3; shift 3
  step "$name" 10 env EPX_TIMEOUT_S=5 "$@" "$E" bench --backend "$be" --ranks 2 --graph --iters 200 --warmup 20 --case "$case" \
    --json "$OUT/$name.json"
}
gt() {  # <name> <limit_s> <gtest filter>
  step "$1" "$2" env EPX_TIMEOUT_S=10 "$B/ll_cuda_test" --gtest_filter="$3"
}
# Batch 2 of the eighth session: the tree to land (flag = whole-line stores) against flag_lane (main's
# per-lane stores) in one run, its combine tests, data after the clean-up.
bench ll-v3-fp32-flag ll,nccl_a2a_raw ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag
bench ll-v3-fp32-flag_lane ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag_lane
gt test-partial 40 'LlCuda.PartialCombineMatchesCpuTwoRanks:LlCuda.PartialCombineGraphsTwoRanks'
gt test-lane 15 'LlCuda.CombineFlagLaneStoresTwoRanks'
bench ll-v3-fp32-flag-2 ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag
gt test-data-graphs 16 'LlCuda.OtherCombineWaitGraphsTwoRanks'
bench ll-v3-fp32-data ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=data
bench ll-v4-fp32-flag ll ll-v4 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag
bench ll-v3-bf16-flag ll ll-v3 EPX_LL_COMBINE=partial_bf16 EPX_LL_COMBINE_WAIT=flag
bench ll-v3-fp32-flag-66blocks ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag EPX_LL_NUM_BLOCKS=66  # SM-issue or link bound?
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/ll-*.log; do echo "-- $f"; grep -E "^ll-v. .* (ll|nccl_a2a_raw)" "$f" | grep -E "combine|nccl" | head -6
  grep -E "ll stamps, rank ., T per rank \(" "$f" | grep -oE "combine (send items done|warp 0 rows loaded|warp 0 stores issued|flags stored|waited|done|reduce done)[^;]*;" | tr '\n' ' '; echo; done
for f in "$OUT"/test*.log "$OUT"/san*.log; do [ -f "$f" ] || continue; echo "-- $f"; grep -E "OK \]|FAILED|PASSED|DIFFERS|Failure|timeout after|ERROR SUMMARY|RACECHECK SUMMARY|Timeout" "$f" | head -20; done
