#!/bin/bash
# compute-sanitizer (memcheck, racecheck) on the ll and ht kernels with 2 ranks (one process per GPU,
# --target-processes all), at the real ll-v3 / ht-v3 shapes through `epx bench`, then the two-rank
# ll and ht correctness tests under memcheck. Builds only what it needs via gpu-check.sh.
# usage (device, repo root): OUT=<dir> bash tools/device/sanitize-dispatch.sh [deadline_s]
# SAN_ONLY=ht: only the ht steps (memcheck-ht-bench, racecheck-ht-bench, memcheck-ht-test); SAN_ONLY=ll:
# only the ll steps (and builds only epx + ll_cuda_test);
# SAN_BUILD=0: no build, use the tree gpu-check.sh already built in /tmp/epx-gpu-check/build;
# SAN_LL_TEST_FILTER replaces the gtest filter of memcheck-ll-test and racecheck-ll-test; SAN_STEP_S caps every
# step's time limit; SAN_STEPS (space-separated step names, e.g. "memcheck-ll-bench racecheck-ll-test") runs only
# those. The benches run with --kernel-time off (CUPTI stays out of the sanitizer's way).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEADLINE=${1:-420}
export NCCL_NVLS_ENABLE=0 EPX_TIMEOUT_S=900
ONLY=${SAN_ONLY:-all}
if [ "${SAN_BUILD:-1}" != 0 ]; then
  GPU_CHECK_SRC="$ROOT" GPU_CHECK_TARGETS="epx ll_cuda_test$([ "$ONLY" = ll ] || echo ' ht_cuda_test')" GPU_CHECK_TESTS=0 GPU_CHECK_ONE_GPU=0 \
    GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 bash "$ROOT/tools/device/gpu-check.sh" run
fi
B=/tmp/epx-gpu-check/build
nccl=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])')
export LD_LIBRARY_PATH="$nccl/lib:/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu:/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
CS=(compute-sanitizer --target-processes all --report-api-errors no --error-exitcode 9)
step() {  # <name> <limit_s> <cmd...>
  local name=$1 lim=$2; shift 2
  if [ "$ONLY" != all ] && [ "${name#*-$ONLY-}" = "$name" ]; then return; fi
  if [ -n "${SAN_STEPS:-}" ] && [[ " $SAN_STEPS " != *" $name "* ]]; then return; fi
  local left=$(( DEADLINE - SECONDS ))
  [ "$left" -lt "$lim" ] && lim=$left
  [ -n "${SAN_STEP_S:-}" ] && [ "$SAN_STEP_S" -lt "$lim" ] && lim=$SAN_STEP_S
  if [ "$lim" -lt 20 ]; then echo "== $name: skipped (deadline)" | tee -a "$OUT/sanitize-summary.txt"; return; fi
  local t0=$SECONDS
  (cd "$ROOT" && timeout -k 5 "$lim" "$@") >"$OUT/san-$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS-t0)) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san-$name.log" | sort | uniq -c | tr '\n' ';')" | tee -a "$OUT/sanitize-summary.txt"
}
BENCH_LL=("$B/epx" bench --case ll-v3 --backend ll --ranks 2 --iters 3 --warmup 1 --kernel-time off --json /tmp/san-ll.json)
BENCH_HT=("$B/epx" bench --case ht-v3 --backend ht --ranks 2 --iters 2 --warmup 1 --kernel-time off --json /tmp/san-ht.json)
step memcheck-ll-bench 90 "${CS[@]}" --tool memcheck "${BENCH_LL[@]}"
step memcheck-ht-bench 120 "${CS[@]}" --tool memcheck "${BENCH_HT[@]}"
step racecheck-ll-bench 90 "${CS[@]}" --tool racecheck "${BENCH_LL[@]}"
step racecheck-ht-bench 120 "${CS[@]}" --tool racecheck "${BENCH_HT[@]}"
step memcheck-ll-test 150 "${CS[@]}" --tool memcheck "$B/ll_cuda_test" --gtest_filter="${SAN_LL_TEST_FILTER:-LlCuda.PartialCombineMatchesCpuTwoRanks:LlCuda.GraphsWithDeviceTokenCountTwoRanks}"
step racecheck-ll-test 150 "${CS[@]}" --tool racecheck "$B/ll_cuda_test" --gtest_filter="${SAN_LL_TEST_FILTER:-LlCuda.PartialCombineMatchesCpuTwoRanks:LlCuda.GraphsWithDeviceTokenCountTwoRanks}"
step memcheck-ht-test 150 "${CS[@]}" --tool memcheck "$B/ht_cuda_test" --gtest_filter='HtCuda.MatchesHtCpuTwoRanks'
cat "$OUT/sanitize-summary.txt"
