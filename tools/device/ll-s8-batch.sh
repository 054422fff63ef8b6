#!/usr/bin/env bash
# tools/device/ll-s8-batch.sh: helper "ll"'s device batch, eighth session (issue 4: ll.signal = chunk's
# stale slot-token fix, its regression test under GPU contention, the chunk / block A/B). Run from a copy of
# /work/main that carries .carry/deps.tar.xz and .carry-ll/{src,prebuilt}.tar.xz:
#   OUT=<dir> timeout -k 5 <allowance ~110 s> bash .carry-ll/batch.sh
# prebuilt.tar.xz holds epx, ll_cuda_test and epx-gemm-bench built from src.tar.xz on the dev machine
# (CUDA 13.0, sm_90a); if they do not load here, they are built with tools/device/gpu-check.sh.
# LL_RUNS picks the steps in order (most important first); every step is bounded by the time left:
#   many        ll_cuda_test LlCuda.ManyCalls* (one buffer, 20 calls, T varying; block, chunk, chunk with
#               rank 0's block 0 delayed, and the self-check with a 2-bit tag) with a GEMM on both GPUs
#   ab          ll-v3 FP8, ll.signal = block and chunk, each beside nccl_a2a_raw (graph replay, p50 of 200,
#               validated, per-phase stamps, CUPTI kernel time), no GEMM
#   tests-chunk ll_cuda_test groups with EPX_LL_SIGNAL=chunk (the ones that failed in the seventh session's
#               final run, with 6b97dd0's harness synchronisation) with a GEMM on both GPUs
#   tests-block the same with block
#   next-tests  ll_cuda_test-next (the receive-side latency change, if shipped) LlCuda.ManyCalls* with a GEMM
#   ab2 / diag / tests2  (batch 2) the landed default (chunk) and block; epx-diag's stamps; tests with a GEMM beside
#   lat         the latency variants' A/B: see LL_LAT
set -u
T0=$SECONDS
BUDGET=${LL_BUDGET_S:-104}
RUNS=${LL_RUNS:-ab2 diag tests2}
OUT=${OUT:-/tmp/ll-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
HERE=$(pwd)
left() { echo $(( BUDGET - (SECONDS - T0) )); }
step() {  # <name> <limit_s> <cmd...>: run with min(limit, time left - 1); log to $OUT/<name>.log
  local name=$1 lim=$2; shift 2
  local l; l=$(( $(left) - 1 ))
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 3 ]; then echo "skip $name (no time left)" | tee -a "$OUT/summary.txt"; return 1; fi
  local t=$SECONDS
  echo "== $(date -u +%T) $* (limit $lim s)" >>"$OUT/commands.txt"
  timeout -k 1 "$lim" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(( SECONDS - t )) s (limit $lim, at $(( SECONDS - T0 )) s)" | tee -a "$OUT/summary.txt"
  return $rc
}
S=/tmp/s-ll P=/tmp/ll-prebuilt D=/tmp/ll-deps
rm -rf "$S" "$P" "$D" && mkdir -p "$S/.carry" "$P" "$D"
tar -C "$S" -xJf "$HERE/.carry-ll/src.tar.xz" && cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
B=""
if [ -f "$HERE/.carry-ll/prebuilt.tar.xz" ]; then
  tar -C "$P" -xJf "$HERE/.carry-ll/prebuilt.tar.xz" && tar -C "$D" -xJf "$HERE/.carry/deps.tar.xz"
  dl="$D/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$NCCL/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/extras/CUPTI/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ldd "$P/epx" | grep -q "libcupti.*not found"; then  # CUPTI from the pip wheel when the toolkit has none
    cu=$(find "$(dirname "$NCCL")" -name 'libcupti.so.13*' 2>/dev/null | head -1)
    [ -n "$cu" ] && export LD_LIBRARY_PATH="$(dirname "$cu"):$LD_LIBRARY_PATH"
  fi
  ldd "$P"/* >"$OUT/prebuilt-ldd.txt" 2>&1
  if ! grep -q "not found" "$OUT/prebuilt-ldd.txt" && timeout 20 "$P/ll_cuda_test" --gtest_list_tests >/dev/null 2>>"$OUT/prebuilt-ldd.txt"; then
    B="$P"
  fi
  echo "prebuilt: ${B:-unusable (see prebuilt-ldd.txt)} at $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
fi
if [ -z "$B" ]; then
  mkdir -p "$OUT/build"
  OUT="$OUT/build" GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="epx_cli ll_cuda_test epx_gemm_bench" timeout -k 2 $(( BUDGET - 40 )) bash "$S/tools/device/gpu-check.sh" run >"$OUT/build/gpu-check.out" 2>&1
  echo "build: $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
  B=/tmp/epx-gpu-check/build
  AL=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -x "$B/ll_cuda_test" ] || { echo "build failed"; grep -E "error|Error" "$OUT/build/build.log" 2>/dev/null | head -30; exit 1; }
fi
E="$B/epx"
cd "$S" || exit 1
COMMIT=$(cat "$HERE/.carry-ll/commit.txt" 2>/dev/null || echo unknown)
# A GEMM on both GPUs beside the tests (the seventh session's final run failed only under such contention):
# epx-gemm-bench's prefill rows in a loop, one process per GPU, in its own process group (ended by its id).
GEMM_PIDS=""
gemm_start() {
  local g
  for g in 0 1; do
    setsid bash -c "while :; do CUDA_VISIBLE_DEVICES=$g '$B/epx-gemm-bench' --prefill-only --no-simt --no-cublas --iters 400 || sleep 1; done" >>"$OUT/gemm-gpu$g.log" 2>&1 &
    GEMM_PIDS="$GEMM_PIDS $!"
  done
  sleep 2  # past the bench's allocations
  echo "gemm started:$GEMM_PIDS at $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
}
gemm_stop() {
  local p
  for p in $GEMM_PIDS; do kill -- -"$p" 2>/dev/null; done
  sleep 1
  for p in $GEMM_PIDS; do kill -9 -- -"$p" 2>/dev/null; done
  GEMM_PIDS=""
  echo "gemm stopped at $(( SECONDS - T0 )) s; kernels seen: $(grep -c "TFLOP\|GB/s" "$OUT"/gemm-gpu*.log 2>/dev/null | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
}
trap gemm_stop EXIT
BENCH=(bench --backend ll,nccl_a2a_raw --ranks 2 --graph --iters 200 --warmup 20)
bench() {  # <name> <case> [VAR=value ...]: one epx bench with those config variables ($EB: another epx binary)
  local name=$1 case=$2; shift 2
  step "$name" 10 env EPX_TIMEOUT_S=5 "$@" "${EB:-$E}" "${BENCH[@]}" --case "$case" --json "$OUT/$name.json"
  [ -f "$OUT/$name.json" ] && python3 -c 'import json,sys; p=sys.argv[1]; d=json.load(open(p)); d["git_commit"]=sys.argv[2]; json.dump(d,open(p,"w"),indent=2)' "$OUT/$name.json" "$COMMIT"
  grep -E "^ll-v. .* (ll|nccl_a2a_raw) " "$OUT/$name.log" | head -4
}
gt() {  # <name> <limit_s> <gtest filter> [VAR=value ...]
  local name=$1 lim=$2 filt=$3; shift 3
  step "$name" "$lim" env EPX_TIMEOUT_S=10 "$@" "$B/ll_cuda_test" --gtest_filter="$filt"
  grep -E "OK \]|FAILED|DIFFERS|Failure" "$OUT/$name.log" | sort | uniq -c | head -12 | tee -a "$OUT/summary.txt"
}
for r in $RUNS; do
  case $r in
    many)
      gemm_start
      gt test-many 50 'LlCuda.ManyCalls*'
      gemm_stop ;;
    ab)  # block, chunk (the fix), chunk with the receive-side change (epx-next, if shipped)
      bench ll-v3-signal_block ll-v3 EPX_LL_SIGNAL=block
      bench ll-v3-signal_chunk ll-v3 EPX_LL_SIGNAL=chunk
      [ -x "$B/epx-next" ] && EB="$B/epx-next" bench ll-v3-signal_chunk-next ll-v3 EPX_LL_SIGNAL=chunk ;;
    next-tests)  # ll_cuda_test-next (the receive-side change) with a GEMM beside it
      if [ -x "$B/ll_cuda_test-next" ]; then
        gemm_start
        step test-next-many 44 env EPX_TIMEOUT_S=10 "$B/ll_cuda_test-next" --gtest_filter='LlCuda.ManyCalls*'
        grep -E "OK \]|FAILED|DIFFERS|Failure" "$OUT/test-next-many.log" | sort | uniq -c | head -12 | tee -a "$OUT/summary.txt"
        gemm_stop
      fi ;;
    tests-chunk)
      gemm_start
      gt test-chunk-partial 24 'LlCuda.PartialCombineMatchesCpuTwoRanks' EPX_LL_SIGNAL=chunk
      gt test-chunk-onerank 20 'LlCuda.MatchesCpuOneRank' EPX_LL_SIGNAL=chunk
      gt test-chunk-graphs 16 'LlCuda.PartialCombineGraphsTwoRanks' EPX_LL_SIGNAL=chunk
      gt test-many-2 44 'LlCuda.ManyCalls*'
      gemm_stop ;;
    tests-block)
      gemm_start
      gt test-block-onerank 20 'LlCuda.MatchesCpuOneRank' EPX_LL_SIGNAL=block
      gt test-block-partial 24 'LlCuda.PartialCombineMatchesCpuTwoRanks' EPX_LL_SIGNAL=block
      gemm_stop ;;
    ab2)  # batch 2: chunk (the default on main now) and block, each beside nccl_a2a_raw
      bench ll-v3-signal_chunk ll-v3 EPX_LL_SIGNAL=chunk
      bench ll-v3-signal_block ll-v3 EPX_LL_SIGNAL=block ;;
    diag)  # batch 2: epx-diag (the default's kernels plus two stamps: counts seen, first items ready), if shipped
      [ -x "$B/epx-diag" ] && EB="$B/epx-diag" bench ll-v3-diag ll-v3 ;;
    tests2)  # batch 2: the landed default (chunk) through the Config, with a GEMM beside
      gemm_start
      gt test2-many 22 'LlCuda.ManyCalls*'
      gt test2-eager 28 'LlCuda.MatchesCpuTwoRanks' EPX_LL_SIGNAL=chunk
      gt test2-graphs 20 'LlCuda.GraphsWithDeviceTokenCountTwoRanks' EPX_LL_SIGNAL=chunk
      gt test2-errors 12 'LlCuda.ErrorsTwoRanks:LlCuda.TimeoutNamesThePeer' EPX_LL_SIGNAL=chunk
      gemm_stop ;;
    lat)  # LL_LAT="name:VAR=value,VAR=value name2:..." extra ll-v3 rows (batch 2's latency variants)
      for v in ${LL_LAT:-}; do
        n=${v%%:*}; vars=${v#*:}
        # shellcheck disable=SC2046
        bench "ll-v3-$n" ll-v3 $(echo "$vars" | tr ',' ' ')
      done ;;
  esac
done
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/ll-*.log; do echo "-- $f"; grep -E "^ll-v. .* (ll|nccl_a2a_raw)|dispatch (T known|slots|send items|flags|waited|slot bases|done)" "$f" | head -16; done
