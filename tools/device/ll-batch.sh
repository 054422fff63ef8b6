#!/usr/bin/env bash
# tools/device/ll-batch.sh: helper "ll"'s device batch (run from a copy of /work/main carrying
# .carry/deps.tar.xz and .carry-ll/): build epx + ll_cuda_test (gpu-check.sh, GPU_CHECK_TARGETS), then
# the LL benchmarks (each validated against the CPU reference and run beside nccl_a2a_raw) and the
# two-rank GPU tests of the new mode, each under its own time limit inside the caller's allowance
# (LL_BUDGET_S, default 145 s). Fifth session, batch 2: ll.items run vs chunk with the slimmer kernels
# (expansion mode as a template, 32-bit item indices), the cold/warm stamps, then compute-sanitizer
# memcheck + racecheck of the ll bench (SAN_ONLY=ll) and the bit-exact tests in run mode.
set -u
T0=$SECONDS
BUDGET=${LL_BUDGET_S:-145}
OUT=${OUT:-/tmp/ll-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
left() { echo $(( BUDGET - (SECONDS - T0) )); }
step() {  # <name> <limit_s> <cmd...>: run with min(limit, time left - 2); log to $OUT/<name>.log
  local name=$1 lim=$2; shift 2
  local l; l=$(( $(left) - 2 ))
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 4 ]; then echo "skip $name (no time left)" | tee -a "$OUT/summary.txt"; return 1; fi
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
  GPU_CHECK_TARGETS="epx ll_cuda_test" timeout -k 2 $(( BUDGET - 30 )) bash "$S/tools/device/gpu-check.sh" run >"$OUT/build/gpu-check.out" 2>&1
echo "build: $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
B=/tmp/epx-gpu-check/build
E="$B/epx"
[ -x "$E" ] || { echo "build failed"; tail -40 "$OUT/build/build.log"; exit 1; }
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
AL=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cd "$S" || exit 1
BENCH=(bench --backend ll,nccl_a2a_raw --ranks 2 --graph --iters 200 --warmup 20)
bench() {  # <name> <case> [VAR=value ...]: one epx bench with those config variables
  local name=$1 case=$2; shift 2
  step "$name" 9 env EPX_TIMEOUT_S=5 "$@" "$E" "${BENCH[@]}" --case "$case" --json "$OUT/$name.json"
}
bench ll-v3-run ll-v3 EPX_LL_ITEMS=run
# compute-sanitizer: the ll steps of sanitize-dispatch.sh (memcheck + racecheck of the ll-v3 bench, then
# memcheck of one two-rank graph test if time is left) on the run mode, inside what is left minus 24 s
# (kept for the bit-exact test below).
SAN_S=$(( $(left) - 24 ))
step sanitize $(( SAN_S + 1 )) env EPX_LL_ITEMS=run SAN_ONLY=ll SAN_STEP_S=$(( SAN_S / 2 )) OUT="$OUT" \
  SAN_LL_TEST_FILTER='LlCuda.PartialCombineGraphsTwoRanks' bash "$S/tools/device/sanitize-dispatch.sh" "$SAN_S"
step test-run 20 env EPX_LL_ITEMS=run "$B/ll_cuda_test" --gtest_filter='LlCuda.PartialCombineMatchesCpuTwoRanks'
bench ll-v3-chunk ll-v3 EPX_LL_ITEMS=chunk
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
cat "$OUT"/sanitize-summary.txt 2>/dev/null
for f in "$OUT"/ll-*.log; do echo "-- $f"; grep -E "^ll-v. .* (ll|nccl_a2a_raw)|launch floor" "$f" | head -16; done
for f in "$OUT"/test-*.log; do echo "-- $f"; grep -E "OK \]|FAILED|PASSED|DIFFERS|Failure" "$f" | head -10; done
