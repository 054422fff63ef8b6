#!/usr/bin/env bash
# tools/device/hier-batch.sh: helper "hier"'s device batch (issue 11: hierarchical ll / ht across
# nodes), run from a copy of /work/main carrying .carry/deps.tar.xz and .carry-hier/:
#   OUT=<dir> timeout -k 5 <allowance> bash .carry-hier/batch.sh
# Builds epx + dispatch_cuda_test + dispatch_hier_test (gpu-check.sh, GPU_CHECK_TARGETS), then, each step
# cut to the time left (HIER_BUDGET_S, default 195 s):
#   - hierarchical ll / ht across 2 virtual nodes (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: one GPU per
#     NCCL node, socket transport) against the CPU twin and the flat CPU backends;
#   - epx bench ll-v3 across the virtual nodes (ranks meeting over tcp://127.0.0.1) and on one node, and
#     the graph-replayed ll across the virtual nodes: multinode-hier-*.json with the node layout;
#   - the flat backends' virtual-node and one-node tests (which also prove which path ll / ht take);
#   - epx moe across the virtual nodes, every backend; the CPU hierarchical tests.
set -u
T0=$SECONDS
BUDGET=${HIER_BUDGET_S:-195}
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
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/gpucheck"
step build 110 env OUT="$OUT/gpucheck" GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 \
  GPU_CHECK_TESTS=0 GPU_CHECK_TARGETS="epx dispatch_cuda_test dispatch_hier_test" bash "$S/tools/device/gpu-check.sh" run
B=/tmp/epx-gpu-check/build
[ -x "$B/epx" ] && [ -x "$B/dispatch_cuda_test" ] || { echo "build failed"; tail -40 "$OUT/gpucheck/build.log"; exit 1; }
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
AL=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
E="$B/epx"
cd "$S"
VN=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
step test-hier-virtual-nodes 60 "$B/dispatch_cuda_test" --gtest_filter='DispatchCuda.HierarchicalLlHtMatchCpuTwoVirtualNodes'
BENCH=(bench --case ll-v3 --backend ll,ht,all2allv,nccl_a2a_raw --ranks 2 --iters 30 --warmup 5)
step bench-hier-2x1 25 "${VN[@]}" EPX_RENDEZVOUS=tcp://127.0.0.1:29541 "$E" "${BENCH[@]}" --json "$OUT/multinode-hier-ll-v3-2x1.json"
step bench-hier-1x2 15 "$E" "${BENCH[@]}" --json "$OUT/multinode-hier-ll-v3-1x2.json"
step bench-hier-graph-2x1 20 "${VN[@]}" EPX_RENDEZVOUS=tcp://127.0.0.1:29542 "$E" bench --case ll-v3 --backend ll --ranks 2 --iters 30 \
  --warmup 5 --graph --json "$OUT/multinode-hier-ll-v3-2x1-graph.json"
step test-path-proof 45 "$B/dispatch_cuda_test" --gtest_filter='DispatchCuda.FlatBackendsMatchCpuTwoVirtualNodes:DispatchCuda.FlatBackendsMatchCpuTwoRanks'
step moe-hier-2x1 20 "${VN[@]}" "$E" moe --device cuda --ranks 2 --preset deepseek-v3-mini --backend all \
  --steps 2 --tokens-per-rank 24 --json "$OUT/multinode-hier-moe-deepseek-v3-mini-2x1.json"
step test-hier-cpu 15 "$B/dispatch_hier_test"
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/test-*.log; do echo "-- $f"; grep -E "node layout|path|Unsupported|bit-exact|DIFFER|OK \]|FAILED|PASSED|mismatch|hierarchical" "$f" | head -30; done
for f in "$OUT"/bench-*.log "$OUT"/moe-*.log; do echo "-- $f"; grep -E "node layout|^ll-v3|error|pass|FAIL|unsupported" "$f" | head -16; done
