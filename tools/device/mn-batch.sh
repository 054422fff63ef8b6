#!/usr/bin/env bash
# tools/device/mn-batch.sh: helper "mn"'s device batch (issue 11, multi-node over NCCL), run from a
# copy of /work/main carrying .carry/deps.tar.xz and .carry-mn/: builds epx and the dispatch / group
# GPU tests, then
#   - the flat backends across 2 virtual nodes (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: one GPU per
#     NCCL node, socket transport) and on one node (the fast path), against the CPU backends;
#   - epx bench across the virtual nodes (ranks meeting over tcp://127.0.0.1) and on one node, JSON
#     with the node layout;
# each step under its own limit inside the caller's allowance (MN_BUDGET_S, default 100 s).
set -u
T0=$SECONDS
BUDGET=${MN_BUDGET_S:-100}
OUT=${OUT:-/tmp/mn-out}
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
S=/tmp/s-mn
rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf .carry-mn/src.tar.xz && cp .carry/deps.tar.xz "$S/.carry/"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEPS=/tmp/mn-deps; rm -rf "$DEPS" && mkdir -p "$DEPS" && tar -C "$DEPS" -xJf .carry/deps.tar.xz
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
AL="$DEPS/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$NCCL/lib:$AL:$AL/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=/tmp/mn-build
{ nvidia-smi -L; nvcc --version | tail -1; ip -brief addr 2>/dev/null || true; } >"$OUT/env.txt" 2>&1
cmake -S "$S" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DEPX_NCCL_ROOT="$NCCL" -DCMAKE_PREFIX_PATH="$DEPS/usr" -DBLA_VENDOR=OpenBLAS -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
  -DCMAKE_LIBRARY_PATH="$AL/openblas-pthread;$AL" -DEPX_CBLAS_INCLUDE="$DEPS/usr/include/x86_64-linux-gnu/openblas-pthread" \
  >"$OUT/configure.log" 2>&1
step build 62 ninja -C "$B" epx dispatch_cuda_test group_nccl_cuda_test || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
E="$B/epx"
cd "$S"
VN=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
step test-virtual-nodes 30 "$B/dispatch_cuda_test" --gtest_filter='DispatchCuda.FlatBackendsMatchCpuTwoVirtualNodes'
step test-group-virtual-nodes 20 "$B/group_nccl_cuda_test" --gtest_filter='NcclGroupCuda.VirtualNodesOverTcp:NcclGroupCuda.SymmetricMemoryLsaWriteToNextRank'
BENCH=(bench --case ll-v3 --backend naive,allgather_reducescatter,all2allv,ll,ht,nccl_a2a_raw --ranks 2 --iters 30 --warmup 5)
step bench-virtual-nodes 20 "${VN[@]}" NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET EPX_RENDEZVOUS=tcp://127.0.0.1:29517 "$E" "${BENCH[@]}" --json "$OUT/multinode-ll-v3-2x1.json"
step test-one-node 20 "$B/dispatch_cuda_test" --gtest_filter='DispatchCuda.FlatBackendsMatchCpuTwoRanks'
step bench-one-node 15 "$E" "${BENCH[@]}" --json "$OUT/multinode-ll-v3-1x2.json"
step moe-virtual-nodes 20 "${VN[@]}" "$E" moe --device cuda --ranks 2 --preset deepseek-v3-mini --backend all \
  --steps 2 --tokens-per-rank 24 --json "$OUT/multinode-moe-deepseek-v3-mini-2x1.json"
step info-virtual-nodes 10 "${VN[@]}" "$E" info
echo "== summary ($(( SECONDS - T0 )) s)"
cat "$OUT/summary.txt"
for f in "$OUT"/test-*.log; do echo "-- $f"; grep -E "node layout|across nodes|OK \]|FAILED|PASSED|DIFFER|WRONG" "$f" | head -12; done
for f in "$OUT"/bench-*.log "$OUT"/moe-*.log; do echo "-- $f"; grep -E "node layout|^ll-v3|error|pass|FAIL|nNodes|Using network|NET/" "$f" | head -16; done
grep -A3 "node layout" "$OUT/info-virtual-nodes.log"
