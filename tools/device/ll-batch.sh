#!/usr/bin/env bash
# tools/device/ll-batch.sh: helper "ll"'s device batch (run from a copy of /work/main carrying
# .carry/deps.tar.xz and .carry-ll/): build epx + ll_cuda_test (gpu-check.sh, GPU_CHECK_TARGETS), then
# the LL benchmark (validated against the CPU reference, beside nccl_a2a_raw, with the per-phase stamps
# and SM kilocycles) and the two-rank GPU tests, each under its own time limit inside the caller's
# allowance (LL_BUDGET_S, default 128 s). Sixth session: the dispatch front (lane-parallel masks, the
# counter/T loads together), the FP8 quotients by reciprocal + Markstein corrections, combine stamps,
# the expansion's one round trip after the wait; batch 2: the parameter block touched at the start.
set -u
T0=$SECONDS
BUDGET=${LL_BUDGET_S:-128}
OUT=${OUT:-/tmp/ll-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
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
S=/tmp/s-ll
rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf .carry-ll/src.tar.xz && cp .carry/deps.tar.xz "$S/.carry/"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/build"
OUT="$OUT/build" GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
  GPU_CHECK_TARGETS="epx ll_cuda_test" timeout -k 2 $(( BUDGET - 25 )) bash "$S/tools/device/gpu-check.sh" run >"$OUT/build/gpu-check.out" 2>&1
echo "build: $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
B=/tmp/epx-gpu-check/build
E="$B/epx"
[ -x "$E" ] || { echo "build failed"; grep -E "error|Error" "$OUT/build/build.log" | head -30; exit 1; }
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
AL=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cd "$S" || exit 1
BENCH=(bench --backend ll,nccl_a2a_raw --ranks 2 --graph --iters 200 --warmup 20)
bench() {  # <name> <case> [VAR=value ...]: one epx bench with those config variables
  local name=$1 case=$2; shift 2
  step "$name" 9 env EPX_TIMEOUT_S=5 "$@" "$E" "${BENCH[@]}" --case "$case" --json "$OUT/$name.json"
}
bench ll-v3 ll-v3
bench ll-v4 ll-v4
gt() {  # <name> <limit_s> <gtest filter>
  step "$1" "$2" env EPX_TIMEOUT_S=10 "$B/ll_cuda_test" --gtest_filter="$3"
}
gt test-errors 10 'LlCuda.ErrorsTwoRanks'
gt test-graphs 25 'LlCuda.PartialCombineGraphsTwoRanks'
gt test-eager 40 'LlCuda.MatchesCpuTwoRanks'
gt test-other 30 'LlCuda.OtherProtocolMatchesCpuTwoRanks'
gt test-partial 30 'LlCuda.PartialCombineMatchesCpuTwoRanks'
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/ll-*.log; do echo "-- $f"; grep -E "^ll-v. .* (ll|nccl_a2a_raw)|launch floor|ll stamps" "$f" | head -24; done
for f in "$OUT"/test*.log; do echo "-- $f"; grep -E "OK \]|FAILED|PASSED|DIFFERS|Failure|mismatch" "$f" | head -20; done
