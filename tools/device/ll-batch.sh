#!/usr/bin/env bash
# tools/device/ll-batch.sh: helper "ll"'s device batch (run from a copy of /work/main carrying
# .carry/deps.tar.xz and .carry-ll/): build epx + ll_cuda_test, the LL benchmarks (graph replay,
# column / partial_fp32 / partial_bf16 combine, launch shapes) and the partial-mode GPU tests, each
# under its own time limit inside the caller's allowance (LL_BUDGET_S, default 125 s).
set -u
T0=$SECONDS
BUDGET=${LL_BUDGET_S:-125}
OUT=${OUT:-/tmp/ll-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
left() { echo $(( BUDGET - (SECONDS - T0) )); }
step() {  # <name> <limit_s> <cmd...>: run with min(limit, time left - 2); log to $OUT/<name>.log
  local name=$1 lim=$2; shift 2
  local l; l=$(( $(left) - 2 ))
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 5 ]; then echo "skip $name (no time left)" | tee -a "$OUT/summary.txt"; return 1; fi
  local t=$SECONDS
  timeout -k 2 "$lim" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(( SECONDS - t )) s (limit $lim)" | tee -a "$OUT/summary.txt"
  return $rc
}
S=/tmp/s-ll
rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf .carry-ll/src.tar.xz && cp .carry/deps.tar.xz "$S/.carry/"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEPS=/tmp/ll-deps; rm -rf "$DEPS" && mkdir -p "$DEPS" && tar -C "$DEPS" -xJf .carry/deps.tar.xz
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
AL="$DEPS/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=/tmp/ll-build
{ nvidia-smi -L; nvcc --version | tail -1; command -v nsys compute-sanitizer; } >"$OUT/env.txt" 2>&1
cmake -S "$S" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DEPX_NCCL_ROOT="$NCCL" -DCMAKE_PREFIX_PATH="$DEPS/usr" -DBLA_VENDOR=OpenBLAS -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
  -DCMAKE_LIBRARY_PATH="$AL/openblas-pthread;$AL" -DEPX_CBLAS_INCLUDE="$DEPS/usr/include/x86_64-linux-gnu/openblas-pthread" \
  >"$OUT/configure.log" 2>&1
step build 70 ninja -C "$B" epx ll_cuda_test || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
E="$B/epx"
cd "$S"
BENCH=(bench --backend ll,nccl_a2a_raw --ranks 2 --graph --iters 200 --warmup 20)
step v3-column 14 "$E" "${BENCH[@]}" --case ll-v3 --json "$OUT/ll-v3.json"
EPX_LL_COMBINE=partial_fp32 step v3-partial_fp32 14 "$E" "${BENCH[@]}" --case ll-v3 --json "$OUT/ll-v3-partial_fp32.json"
step test-partial 35 "$B/ll_cuda_test" --gtest_filter='LlCuda.PartialCombineMatchesCpuTwoRanks:LlCuda.PartialCombineGraphsTwoRanks'
EPX_LL_COMBINE=partial_bf16 step v3-partial_bf16 14 "$E" "${BENCH[@]}" --case ll-v3 --json "$OUT/ll-v3-partial_bf16.json"
step v4-column 14 "$E" "${BENCH[@]}" --case ll-v4 --json "$OUT/ll-v4.json"
EPX_LL_WARPS_PER_BLOCK=16 step v3-column-w16 14 "$E" "${BENCH[@]}" --case ll-v3 --json "$OUT/ll-v3-w16.json"
EPX_LL_COMBINE=partial_fp32 step v4-partial_fp32 14 "$E" "${BENCH[@]}" --case ll-v4 --json "$OUT/ll-v4-partial_fp32.json"
step test-column 60 "$B/ll_cuda_test" --gtest_filter='LlCuda.MatchesCpuTwoRanks:LlCuda.GraphsWithDeviceTokenCountTwoRanks:LlCuda.ErrorsTwoRanks:LlCuda.TimeoutNamesThePeer'
if command -v compute-sanitizer >/dev/null; then
  step memcheck 25 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 "$B/ll_cuda_test" --gtest_filter='LlCuda.ErrorsTwoRanks'
fi
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/v*.log; do echo "-- $f"; grep -E "^ll-v. .* (ll|nccl_a2a_raw)|timeline" "$f" | head -12; done
for f in "$OUT"/test-*.log; do echo "-- $f"; grep -E "OK \]|FAILED|PASSED|DIFFERS" "$f" | head -10; done
