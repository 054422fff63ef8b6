#!/usr/bin/env bash
# tools/device/llcomb-batch.sh: helper "llcomb"'s device batch (ninth session, issue 4: the LL
# combine). Run from a copy of /work/main carrying .carry/deps.tar.xz and .carry-llcomb/:
#   OUT=<dir> timeout -k 5 <allowance ~95 s> bash .carry-llcomb/batch.sh
# Uses .carry-llcomb/prebuilt.tar.xz (epx and ll_cuda_test of this branch, epx-main = main's epx, the A;
# built here for sm_90a, stripped); if they do not load, builds epx + ll_cuda_test with gpu-check.sh
# (GPU_CHECK_TARGETS; ~35-50 s there) and runs without the A. Then, most important first, each step
# bounded inside LLC_BUDGET_S (default 90 s): the ll-v3 FP8 partial_fp32 combine A/B (main's flag, with
# nccl_a2a_raw beside; this branch's variants), then the combine tests on the GPU.
# (As run in batch 2 of the ninth session; the flag_split / flag_split_wait values it benchmarks were removed
# afterwards: bench/NOTES.md, ninth session.)
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
  ldd "$P/epx" "$P/ll_cuda_test" "$P/epx-main" >"$OUT/prebuilt-ldd.txt" 2>&1
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
bench() {  # <name> <binary> <backends> <case> [VAR=value ...]: one epx bench with those config variables
  local name=$1 bin=$2 be=$3 case=$4; shift 4
  [ -x "$bin" ] || { echo "skip $name (no $bin)" | tee -a "$OUT/summary.txt"; return 1; }
  step "$name" 10 env EPX_TIMEOUT_S=5 "$@" "$bin" bench --backend "$be" --ranks 2 --graph --iters 200 --warmup 20 --case "$case" \
    --json "$OUT/$name.json"
}
gt() {  # <name> <limit_s> <gtest filter> [VAR=value ...]
  local name=$1 lim=$2 filt=$3; shift 3
  step "$name" "$lim" env EPX_TIMEOUT_S=10 "$@" "$B/ll_cuda_test" --gtest_filter="$filt"
}
# Batch 2 of the ninth session: main's flag (A) against the half split and the half split whose
# self-bound warps wait for the peer-bound rows (B), then their tests, then the default's.
bench ll-v3-fp32-main-flag "$B/epx-main" ll,nccl_a2a_raw ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag
bench ll-v3-fp32-flag_split_wait "$E" ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag_split_wait
bench ll-v3-fp32-flag_split "$E" ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag_split
bench ll-v3-fp32-flag "$E" ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag  # this branch's flag (receive stamps)
gt test-split 32 'LlCuda.CombineFlagSplitTwoRanks'
gt test-graphs-split_wait 14 'LlCuda.PartialCombineGraphsTwoRanks' EPX_LL_COMBINE_WAIT=flag_split_wait
gt test-partial 16 'LlCuda.PartialCombineMatchesCpuTwoRanks'
bench ll-v3-fp32-flag_split_wait-2 "$E" ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag_split_wait  # the spread
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/ll-*.log; do echo "-- $f"; grep -E "^ll-v. .* (ll|nccl_a2a_raw)" "$f" | grep -E "combine|nccl" | head -6
  grep -E "ll stamps, rank ., T per rank, second" "$f" | grep -oE "combine (send items done|warp 0 rows loaded|warp 0 stores issued|flags stored|waited|done|reduce done|warp 0 receive)[^;]*;" | tr '\n' ' '; echo; done
for f in "$OUT"/test*.log; do [ -f "$f" ] || continue; echo "-- $f"; grep -E "OK \]|FAILED|PASSED|DIFFERS|Failure|timeout after|Timeout" "$f" | head -20; done
