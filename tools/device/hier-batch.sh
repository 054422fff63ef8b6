#!/usr/bin/env bash
# tools/device/hier-batch.sh: helper "hier"'s device batch, run from a copy of /work/main carrying
# .carry/deps.tar.xz and .carry-hier/ (src.tar.xz = git archive of the hier branch, commit.txt):
#   OUT=<dir> timeout -k 5 <allowance> bash .carry-hier/batch.sh        (batch.sh = a copy of this file)
# Every step is cut to the time left (HIER_BUDGET_S) and logs to $OUT/<step>.log; $OUT/summary.txt.
#   HIER_BATCH=1 (fifth session, batch 1; 80 s): build dispatch_cuda_test only, then
#     - DispatchCuda.Hierarchical*: hierarchical ll / ht across 2 virtual nodes (NCCL_P2P_DISABLE=1
#       NCCL_SHM_DISABLE=1, one GPU per NCCL node) against the CPU twin, and bad arguments on one rank of
#       an eager call (T > capacity in prepare, a wrong out shape in finalize) throwing on both ranks
#       within 5 s (c23d5c2: the verdict is shared before the inter-node ncclSend/ncclRecv);
#     - DispatchCuda.FlatBackendsMatchCpuTwoVirtualNodes (the path proof of the flat backends there).
#   HIER_BATCH=2 (batch 2; 100 s): build epx (~50 s), then tools/device/final-moe.sh: the README's whole-layer
#     table (full-size DeepSeek-V3, FP8 dispatch, every backend, fused vs separate), prefill first (the
#     FP8 prefill GEMMs changed most since 5c4d7a8), decode if time is left (~40 s per run); then epx moe
#     (deepseek-v3-mini, every backend) across 2 virtual nodes if time is left.
set -u
T0=$SECONDS
WHICH=${HIER_BATCH:-2}
BUDGET=${HIER_BUDGET_S:-$([ "$WHICH" = 2 ] && echo 97 || echo 76)}
OUT=${OUT:-/tmp/hier-out}
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
S=/tmp/s-hier
rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf .carry-hier/src.tar.xz && cp .carry/deps.tar.xz "$S/.carry/"
COMMIT=$(cat .carry-hier/commit.txt 2>/dev/null || echo unknown)
echo "hier batch $WHICH, commit $COMMIT, budget $BUDGET s" | tee "$OUT/summary.txt"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/gpucheck"
TARGETS="dispatch_cuda_test"
[ "$WHICH" = 2 ] && TARGETS="epx"
step build 70 env OUT="$OUT/gpucheck" GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 \
  GPU_CHECK_TESTS=0 GPU_CHECK_TARGETS="$TARGETS" bash "$S/tools/device/gpu-check.sh" run
B=/tmp/epx-gpu-check/build
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
AL=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cd "$S"
if [ "$WHICH" = 1 ]; then
  [ -x "$B/dispatch_cuda_test" ] || { echo "build failed"; tail -5 "$OUT/build.log"; grep -E "error|FAILED" "$OUT/gpucheck/build.log" 2>/dev/null | head -30; exit 1; }
  step test-hier 30 "$B/dispatch_cuda_test" --gtest_filter='DispatchCuda.Hierarchical*'
  step test-flat-virtual-nodes 20 "$B/dispatch_cuda_test" --gtest_filter='DispatchCuda.FlatBackendsMatchCpuTwoVirtualNodes'
else
  [ -x "$B/epx" ] || { echo "build failed"; tail -5 "$OUT/build.log"; grep -E "error|FAILED" "$OUT/gpucheck/build.log" 2>/dev/null | head -30; exit 1; }
  step run-final-moe $(( $(left) - 3 )) env OUT="$OUT" SRC="$S" FINAL_COMMIT="$COMMIT" MOE_FINAL_BUDGET_S=$(( $(left) - 6 )) MOE_FINAL_MODES="prefill decode" MOE_FINAL_VALIDATE=1 \
    bash "$S/tools/device/final-moe.sh"
  # ModularMoE across 2 virtual nodes: the hierarchical ll / ht now build their node backend with the
  # layer's Config (bf0540d); every backend checked against the reference.
  step moe-hier-2x1 12 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "$B/epx" moe --device cuda --ranks 2 --preset deepseek-v3-mini \
    --backend all --steps 2 --tokens-per-rank 24 --json "$OUT/multinode-moe-deepseek-v3-mini-2x1.json"
fi
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/test-*.log; do
  [ -f "$f" ] || continue
  echo "-- $f"
  grep -E "node layout|InvalidArgument after|bit-exact|DIFFER|OK \]|FAILED|PASSED|want|did not|throw on every rank" "$f" | head -30
done
[ -f "$OUT/final-moe.log" ] && cat "$OUT/final-moe.log" && grep -hE "^(naive|allgather|all2allv|ll|ht) |node layout|pass|FAIL" "$OUT"/moe-*.log
exit 0
