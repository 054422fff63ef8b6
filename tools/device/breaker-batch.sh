#!/usr/bin/env bash
# tools/device/breaker-batch.sh: the correctness helper's device batch (eighth and ninth sessions). Run from a copy of
# main that carries .carry/deps.tar.xz and .carry-breaker/{src,prebuilt}.tar.xz:
#   OUT=<dir> timeout -k 5 <allowance ~70 s> bash .carry-breaker/batch.sh
# prebuilt.tar.xz holds the GPU test binaries built from src.tar.xz on the dev machine (CUDA 13.0, sm_90a,
# stripped): the device build of the library alone takes longer than the allowance. When they do not load
# (ldd / --gtest_list_tests), they are built with tools/device/gpu-check.sh instead (only if time allows).
# PLAN=1 (batch 1) or 2 (default, batch 2). Order (most important first, each step with its own timeout inside BUDGET s).
# Ninth session (source and prebuilt binaries of the breaker branch):
# batch 1:
#   ll-refused          ll_cuda_test CombineRefusedOnOneRankReachesEveryRankTwoRanks (the abort marker, kLlFlagRejected)
#   moe-badid           moe_cuda_test *BadIdOnOneRank* (ll, ht worst-case, hierarchical ll over virtual nodes)
#   ll-refused-prefix   the same ll test with launch_rejected_combine a no-op (the library without the marker):
#                       must FAIL (rank 1 gets Timeout after timeout_s = 4 s)
#   ll-regress          ll_cuda_test ErrorsTwoRanks, PartialCombineMatchesCpuTwoRanks (the combine's flag compare changed)
# batch 2: the same ll / moe tests after "device-found errors are thrown after the call's launch" (ll prepare never
#   throws them; ht worst-case from finalize after its launch; hier always defers its node backend), the ll
#   test against the library whose prepare throws them (must FAIL its 'rank 1 without check' case), the moe
#   tests against the layer without the fold for ht / hier (must FAIL), hierarchical bad args, and
#   runtime_cuda_test's ok() mutants (a failing setup call stops the test).
set -uo pipefail
OUT="${OUT:-/tmp/breaker-out}"
BUDGET="${BUDGET:-64}"
mkdir -p "$OUT"
HERE="$(pwd)"
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
P=/tmp/breaker-prebuilt
D=/tmp/breaker-deps
B=""
if [ -f "$HERE/.carry-breaker/prebuilt.tar.xz" ]; then
  rm -rf "$P" "$D" && mkdir -p "$P" "$D"
  tar -C "$P" -xJf "$HERE/.carry-breaker/prebuilt.tar.xz" && tar -C "$D" -xJf "$HERE/.carry/deps.tar.xz"
  dl="$D/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  check="$P/ll_cuda_test"
  ldd "$check" >"$OUT/prebuilt-ldd.txt" 2>&1
  if ! grep -q "not found" "$OUT/prebuilt-ldd.txt" && timeout 10 "$check" --gtest_list_tests >/dev/null 2>>"$OUT/prebuilt-ldd.txt"; then
    B="$P"
  fi
  echo "prebuilt: ${B:-unusable (see prebuilt-ldd.txt)} at $((SECONDS - T0)) s ($(cat "$P/commit.txt" 2>/dev/null))" | tee -a "$OUT/summary.txt"
fi
if [ -z "$B" ]; then
  S=/tmp/s-breaker
  rm -rf "$S" && mkdir -p "$S/.carry"
  tar -C "$S" -xJf "$HERE/.carry-breaker/src.tar.xz"
  cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="ll_cuda_test moe_cuda_test" \
    timeout -k 3 $(( $(left) - 15 )) bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
  echo "build rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
  B=/tmp/epx-gpu-check/build
  deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export CUDA_VISIBLE_DEVICES=0,1
one() {  # <name> <limit s> <binary> [gtest args]: one test run, its log under $OUT, one summary line
  local name=$1 limit=$2 bin=$3
  shift 3
  local l; l=$(left)
  [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt 4 ] || [ ! -x "$B/$bin" ]; then echo "$name: skipped (time or binary)" | tee -a "$OUT/summary.txt"; return; fi
  (cd "$B" && timeout -k 2 "$limit" "./$bin" "$@") >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc (limit $limit s) at $((SECONDS - T0)) s: $(grep -E '^\[  (PASSED|FAILED)  \] [0-9]+ test' "$OUT/$name.log" | tr '\n' ' ')skipped $(grep -cE '^\[  SKIPPED \] .*\(' "$OUT/$name.log")" | tee -a "$OUT/summary.txt"
  grep -E '^\[  FAILED  \] [A-Z]|Failure|rank [01]:|rel L2|, call [12]:|timeout_s 4\)|call 2 \(' "$OUT/$name.log" | cut -c1-400 | head -24 >>"$OUT/summary.txt"
}
if [ "${PLAN:-2}" = 1 ]; then  # batch 1 (ninth session)
  one ll-refused 24 ll_cuda_test --gtest_filter='LlCuda.CombineRefusedOnOneRankReachesEveryRankTwoRanks'
  one moe-badid 30 moe_cuda_test --gtest_filter='*BadIdOnOneRank*'
  one ll-refused-prefix 28 ll_cuda_test-prefix --gtest_filter='LlCuda.CombineRefusedOnOneRankReachesEveryRankTwoRanks'
  one ll-regress 30 ll_cuda_test --gtest_filter='LlCuda.ErrorsTwoRanks:LlCuda.PartialCombineMatchesCpuTwoRanks'
else  # batch 2 (ninth session)
  one ll-refused 20 ll_cuda_test --gtest_filter='LlCuda.CombineRefusedOnOneRankReachesEveryRankTwoRanks'
  one ll-errors 10 ll_cuda_test --gtest_filter='LlCuda.ErrorsTwoRanks'
  one moe-badid 15 moe_cuda_test --gtest_filter='*BadIdOnOneRank*'
  one hier-badargs 12 dispatch_cuda_test --gtest_filter='DispatchCuda.HierarchicalBadArgsThrowOnEveryRankTwoVirtualNodes'
  # runtime_cuda_test's ok(): a failing setup call (cudaMallocHost made to fail) stops the test (new) vs
  # going on with a null buffer (old lambda)
  one runtime 6 runtime_cuda_test
  one runtime-mutant-new 4 runtime_cuda_test-mutant-new
  one runtime-mutant-old 4 runtime_cuda_test-mutant-old
  # the ll test against the library whose prepare still throws a device-found error before its launch
  # (9ea6a27's): its 'rank 1 without check' case must FAIL (rank 1's prepare throws, rank 0 times out)
  one ll-refused-prefix2 16 ll_cuda_test-prefix2 --gtest_filter='LlCuda.CombineRefusedOnOneRankReachesEveryRankTwoRanks'
  # the moe tests against the layer without the fold for ht / hier (no defer, no take_device_error): must FAIL
  one moe-badid-prefix 16 moe_cuda_test-prefix --gtest_filter='*HtWorstCase*:*Hierarchical*'
fi
echo "== summary ($((SECONDS - T0)) s)"
cat "$OUT/summary.txt"
