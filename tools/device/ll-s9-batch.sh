#!/usr/bin/env bash
# tools/device/ll-s9-batch.sh: helper "ll"'s device batch, ninth session (issue 4: ll.signal = chunk's bases
# warp: the slot bases computed during the send part; not on main: measured slower, the kernels are
# bench/results/h200x2/ll-s9-batch*/bases-warp.patch). Run from a copy of /work/main that carries
# .carry/deps.tar.xz and .carry-ll/{src,prebuilt}.tar.xz:
#   OUT=<dir> timeout -k 5 <allowance ~110 s> bash .carry-ll/batch.sh
# prebuilt.tar.xz holds epx and ll_cuda_test built from src.tar.xz on the dev machine (CUDA 13.0, sm_90a)
# and epx-main (main's tree, the A of the A/B); if they do not load here, epx and ll_cuda_test are built
# with tools/device/gpu-check.sh (then there is no A).
# LL_RUNS picks the steps in order (most important first); every step is bounded by the time left:
#   ab     ll-v3 FP8 (T = 128 and T = 1 rows), main's epx then the new one, each beside nccl_a2a_raw (graph
#          replay, p50 of 200, validated, per-phase stamps, CUPTI kernel time)
#   tests  ll_cuda_test: ManyCalls* (stale words), MatchesCpuTwoRanks, Graphs*, ErrorsTwoRanks +
#          TimeoutNamesThePeer (the default protocol, chunk, through the Config)
#          and epx-spread (the new kernels with the tagged count / slot-token stores spread over all blocks,
#          spread.patch in the results folder) and epx-pref (the first receive item's slot-token word loaded
#          before the send items barrier, pref.patch in the results folder), if shipped
#   ab2    the A/B again, in the reverse order (second data point)
#   v4     ll-v4 FP8, main then new
set -u
T0=$SECONDS
BUDGET=${LL_BUDGET_S:-104}
RUNS=${LL_RUNS:-ab tests ab2 v4}
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
    GPU_CHECK_TARGETS="epx_cli ll_cuda_test" timeout -k 2 $(( BUDGET - 40 )) bash "$S/tools/device/gpu-check.sh" run >"$OUT/build/gpu-check.out" 2>&1
  echo "build: $(( SECONDS - T0 )) s" | tee -a "$OUT/summary.txt"
  B=/tmp/epx-gpu-check/build
  AL=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -x "$B/ll_cuda_test" ] || { echo "build failed"; grep -E "error|Error" "$OUT/build/build.log" 2>/dev/null | head -30; exit 1; }
fi
E="$B/epx"
cd "$S" || exit 1
COMMIT=$(cat "$HERE/.carry-ll/commit.txt" 2>/dev/null || echo unknown)
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
    ab)
      [ -x "$B/epx-main" ] && EB="$B/epx-main" bench ll-v3-main ll-v3
      bench ll-v3-new ll-v3
      [ -x "$B/epx-spread" ] && EB="$B/epx-spread" bench ll-v3-spread ll-v3
      [ -x "$B/epx-pref" ] && EB="$B/epx-pref" bench ll-v3-pref ll-v3 ;;
    tests)
      gt test-many 24 'LlCuda.ManyCalls*'
      gt test-eager 28 'LlCuda.MatchesCpuTwoRanks'
      gt test-graphs 22 'LlCuda.Graphs*'
      gt test-errors 12 'LlCuda.ErrorsTwoRanks:LlCuda.TimeoutNamesThePeer' ;;
    ab2)
      [ -x "$B/epx-spread" ] && EB="$B/epx-spread" bench ll-v3-spread-2 ll-v3
      bench ll-v3-new-2 ll-v3
      [ -x "$B/epx-main" ] && EB="$B/epx-main" bench ll-v3-main-2 ll-v3 ;;
    v4)
      [ -x "$B/epx-main" ] && EB="$B/epx-main" bench ll-v4-main ll-v4
      bench ll-v4-new ll-v4 ;;
  esac
done
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/ll-*.log; do echo "-- $f"; grep -E "^ll-v. .* (ll|nccl_a2a_raw)|dispatch (T known|slots|send items|flags|waited|slot bases|done|counts seen)" "$f" | head -16; done
