#!/usr/bin/env bash
# tools/device/llcomb-batch.sh: helper "llcomb"'s device batch (seventh session, issue 4: the LL
# combine). Run from a copy of /work/main carrying .carry/deps.tar.xz and .carry-llcomb/:
#   OUT=<dir> timeout -k 5 <allowance ~95 s> bash .carry-llcomb/batch.sh
# Builds epx + ll_cuda_test (gpu-check.sh, GPU_CHECK_TARGETS; ~35 s there) unless
# .carry-llcomb/prebuilt.tar.xz holds them and they load; then, most important first, each step
# bounded inside LLC_BUDGET_S (default 92 s):
#   ll-v3 partial_fp32 with ll.combine_wait = data, data_nofence, flag (the A/B in one run), partial_bf16
#   data
#   (every row validated against the CPU reference; stamps and CUPTI kernel time in the logs / JSON),
#   the new two-rank tests (OtherCombineWaitTwoRanks: the non-default wait, eager fp32 + bf16, graphs;
#   the data protocol's combine timeout) with LLC_SAN=0, else (default) compute-sanitizer memcheck +
#   racecheck of the two-rank data-protocol graph test; ll-v4 data.
set -u
T0=$SECONDS
BUDGET=${LLC_BUDGET_S:-58}
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
if [ "${LLC_BATCH:-3}" = 3 ]; then
  # Batch 3 (60 s): the receive side's loads / the senders' stores, weak (L2) vs volatile (.sys), A/B in one run.
  bench ll-v3-fp32-cg ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=data_cg
  bench ll-v3-fp32-weak ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=data_weak
  bench ll-v3-fp32-nofence ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=data_nofence
  bench ll-v3-fp32-flag ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag
  CSAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  step san-memcheck-bench 30 env EPX_TIMEOUT_S=20 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=data_weak "$CSAN" --target-processes all \
    --report-api-errors no --error-exitcode 9 --tool memcheck "$E" bench --backend ll --ranks 2 --graph --iters 2 --warmup 1 \
    --kernel-time off --case ll-v3
  bench ll-v3-bf16-weak ll ll-v3 EPX_LL_COMBINE=partial_bf16 EPX_LL_COMBINE_WAIT=data_weak
else
bench ll-v3-fp32-data ll,nccl_a2a_raw ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=data
bench ll-v3-fp32-nofence ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=data_nofence
bench ll-v3-fp32-flag ll ll-v3 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=flag
bench ll-v3-bf16-data ll ll-v3 EPX_LL_COMBINE=partial_bf16 EPX_LL_COMBINE_WAIT=data
CSAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ "${LLC_SAN:-1}" = 1 ]; then
  # OtherCombineWaitGraphsTwoRanks runs the protocol the binary's Config does not default to (data in these
  # binaries): 7 graph replays of prepare + finalize on 2 ranks, checked against LlCpu.
  for tool in memcheck racecheck; do
    step "san-$tool" 40 env EPX_TIMEOUT_S=20 "$CSAN" --target-processes all --report-api-errors no --error-exitcode 9 \
      --tool "$tool" "$B/ll_cuda_test" --gtest_filter="${LLC_SAN_FILTER:-LlCuda.OtherCombineWaitGraphsTwoRanks}"
  done
else
  gt test-combine-wait 40 'LlCuda.OtherCombineWaitTwoRanks:LlCuda.OtherCombineWaitGraphsTwoRanks'
  gt test-combine-timeout 12 'LlCuda.CombineWaitDataTimeoutNamesThePeer'
fi
bench ll-v4-fp32-data ll ll-v4 EPX_LL_COMBINE=partial_fp32 EPX_LL_COMBINE_WAIT=data
fi
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/ll-*.log; do echo "-- $f"; grep -E "^ll-v. .* (ll|nccl_a2a_raw)|kernel|ll stamps|combine" "$f" | head -16; done
for f in "$OUT"/test*.log "$OUT"/san*.log; do [ -f "$f" ] || continue; echo "-- $f"; grep -E "OK \]|FAILED|PASSED|DIFFERS|Failure|timeout after|ERROR SUMMARY|RACECHECK SUMMARY|Timeout" "$f" | head -20; done
