#!/usr/bin/env bash
# tools/device/ll-s7-batch.sh: helper "ll"'s device batch, seventh session (issue 4: the LL dispatch's
# protocol, ll.signal = chunk). Run from a copy of /work/main that carries .carry/deps.tar.xz and
# .carry-ll/{src,prebuilt}.tar.xz:  OUT=<dir> timeout -k 5 <allowance ~95 s> bash .carry-ll/batch.sh
# prebuilt.tar.xz holds epx and ll_cuda_test built from src.tar.xz on the dev machine (CUDA 13.0,
# sm_90a); if they do not load here, they are built with tools/device/gpu-check.sh (GPU_CHECK_TARGETS).
# LL_RUNS picks the steps in order (most important first); every step is bounded by the time left:
#   bench     ll-v3 FP8 (defaults: ll.signal = chunk) and the A/B ll.signal = block, beside nccl_a2a_raw
#             (graph replay, p50 of 200, validated, per-phase stamps, CUPTI kernel time); v4: ll-v4
#   tests     ll_cuda_test two-rank groups (bit-exact against LlCpu)
#   san       compute-sanitizer memcheck + racecheck of two-rank ll tests never sanitized before (they
#             also check the results bit-exact)
set -u
T0=$SECONDS
BUDGET=${LL_BUDGET_S:-58}
RUNS=${LL_RUNS:-ab tests-chunk}
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
  ldd "$P/epx" "$P/ll_cuda_test" >"$OUT/prebuilt-ldd.txt" 2>&1
  if ! grep -q "not found" "$OUT/prebuilt-ldd.txt" && timeout 20 "$P/ll_cuda_test" --gtest_list_tests >/dev/null 2>>"$OUT/prebuilt-ldd.txt"; then
    B="$P"
  fi
  echo "prebuilt: ${B:-unusable (see prebuilt-ldd.txt)} at $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
fi
if [ -z "$B" ]; then
  mkdir -p "$OUT/build"
  OUT="$OUT/build" GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="epx ll_cuda_test" timeout -k 2 $(( BUDGET - 30 )) bash "$S/tools/device/gpu-check.sh" run >"$OUT/build/gpu-check.out" 2>&1
  echo "build: $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
  B=/tmp/epx-gpu-check/build
  AL=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -x "$B/epx" ] || { echo "build failed"; grep -E "error|Error" "$OUT/build/build.log" 2>/dev/null | head -30; exit 1; }
fi
E="$B/epx"
cd "$S" || exit 1
BENCH=(bench --backend ll,nccl_a2a_raw --ranks 2 --graph --iters 200 --warmup 20)
COMMIT=$(cat "$HERE/.carry-ll/commit.txt" 2>/dev/null || echo unknown)
bench() {  # <name> <case> [VAR=value ...]: one epx bench with those config variables
  local name=$1 case=$2; shift 2
  step "$name" 10 env EPX_TIMEOUT_S=5 "$@" "$E" "${BENCH[@]}" --case "$case" --json "$OUT/$name.json"
  [ -f "$OUT/$name.json" ] && python3 -c 'import json,sys; p=sys.argv[1]; d=json.load(open(p)); d["git_commit"]=sys.argv[2]; json.dump(d,open(p,"w"),indent=2)' "$OUT/$name.json" "$COMMIT"
  grep -E "^ll-v. .* (ll|nccl_a2a_raw) " "$OUT/$name.log" | head -4
}
gt() {  # <name> <limit_s> <gtest filter>
  step "$1" "$2" env EPX_TIMEOUT_S=10 "$B/ll_cuda_test" --gtest_filter="$3"
  grep -E "FAILED|DIFFERS|Failure" "$OUT/$1.log" | head -5
}
CS=(compute-sanitizer --target-processes all --report-api-errors no --error-exitcode 9)
san() {  # <name> <limit_s> <tool> <gtest filter>
  step "$1" "$2" env EPX_TIMEOUT_S=900 "${CS[@]}" --tool "$3" "$B/ll_cuda_test" --gtest_filter="$4"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAILED" "$OUT/$1.log" | sort | uniq -c | head -5 | tee -a "$OUT/summary.txt"
}
for r in $RUNS; do
  case $r in
    bench)
      bench ll-v3 ll-v3
      bench ll-v3-signal_block ll-v3 EPX_LL_SIGNAL=block ;;
    v4)
      bench ll-v4 ll-v4 ;;
    ab)  # batch 3: the default (block) and ll.signal = chunk, each with its own kernel instantiation
      bench ll-v3 ll-v3
      bench ll-v3-signal_chunk ll-v3 EPX_LL_SIGNAL=chunk ;;
    tests-chunk)  # ll.signal = chunk through the Config (EPX_LL_SIGNAL): the groups that take the Config
      step test-eager-chunk 24 env EPX_TIMEOUT_S=10 EPX_LL_SIGNAL=chunk "$B/ll_cuda_test" --gtest_filter='LlCuda.MatchesCpuTwoRanks'
      grep -E "FAILED|DIFFERS|Failure" "$OUT/test-eager-chunk.log" | head -5
      step test-partial-chunk 18 env EPX_TIMEOUT_S=10 EPX_LL_SIGNAL=chunk "$B/ll_cuda_test" --gtest_filter='LlCuda.PartialCombineMatchesCpuTwoRanks'
      grep -E "FAILED|DIFFERS|Failure" "$OUT/test-partial-chunk.log" | head -5 ;;
    tests)
      gt test-eager 26 'LlCuda.MatchesCpuTwoRanks'
      gt test-partial 18 'LlCuda.PartialCombineMatchesCpuTwoRanks'
      gt test-graphs 18 'LlCuda.GraphsWithDeviceTokenCountTwoRanks'
      gt test-errors 8 'LlCuda.ErrorsTwoRanks'
      gt test-timeout 8 'LlCuda.TimeoutNamesThePeer'
      gt test-other 30 'LlCuda.OtherProtocolMatchesCpuTwoRanks' ;;
    san)  # two-rank ll tests never run under the sanitizer before (the sixth session: the bench, GraphsWithDeviceTokenCountTwoRanks)
      san san-memcheck 34 memcheck 'LlCuda.ErrorsTwoRanks:LlCuda.PartialCombineGraphsTwoRanks'
      san san-racecheck 28 racecheck 'LlCuda.PartialCombineGraphsTwoRanks' ;;
  esac
done
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/ll-*.log; do echo "-- $f"; grep -E "^ll-v. .* (ll|nccl_a2a_raw)|ll stamps|dispatch (T known|slots|send items|flags|waited|slot bases|done)" "$f" | head -24; done
