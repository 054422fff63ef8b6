#!/usr/bin/env bash
# tools/device/final-mn.sh: the multi-node step of the final integrated run (issue 11). Receives OUT,
# the built tree at /tmp/epx-gpu-check/build and the source at $SRC; stays within MN_FINAL_BUDGET_S
# (default 60 s; each step took 2-10 s in the batches). Writes under $OUT:
#   multinode-ll-v3-2x1.json   epx bench, 2 virtual nodes of 1 GPU (NCCL_P2P_DISABLE=1
#                              NCCL_SHM_DISABLE=1: NCCL's socket transport), ranks meeting over TCP;
#                              ll and ht take the hierarchical path there (src/dispatch/hier.h)
#   multinode-ll-v3-2x1-graph.json  hierarchical ll across the virtual nodes, CUDA-graph replays
#   multinode-ht-v3-2x1.json   prefill shape (4096 tokens per rank, fp8) across the virtual nodes:
#                              hierarchical ht (inter-node blocks of ~59 MB per direction) and all2allv
#   multinode-ll-v3-1x2.json   the same on one node (the single-node fast path), for comparison
#   multinode-moe-deepseek-v3-mini-2x1.json   epx moe across the virtual nodes, every backend
#   final-mn.log               their output
set -u
T0=$SECONDS
BUDGET=${MN_FINAL_BUDGET_S:-60}
OUT=${OUT:-/tmp/final-mn-out}
E=${EPX:-/tmp/epx-gpu-check/build/epx}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0
run() {  # <limit_s> <cmd...>: cut to the time left
  local lim=$1; shift
  local l=$(( BUDGET - (SECONDS - T0) - 2 ))
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 5 ]; then echo "== skipped (no time left): $*"; return 1; fi
  echo "== $(date -u +%T) $* (limit $lim s)"
  timeout -k 2 "$lim" "$@"
  echo "== exit status $?"
}
cd "${SRC:-.}" || exit 1
BENCH=(bench --case ll-v3 --backend naive,allgather_reducescatter,all2allv,ll,ht,nccl_a2a_raw --ranks 2 --iters 50 --warmup 5)
{
  run 12 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 EPX_RENDEZVOUS=tcp://127.0.0.1:29531 "$E" "${BENCH[@]}" --json "$OUT/multinode-ll-v3-2x1.json"
  run 8 "$E" "${BENCH[@]}" --json "$OUT/multinode-ll-v3-1x2.json"
  run 12 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 EPX_RENDEZVOUS=tcp://127.0.0.1:29532 "$E" bench --case ll-v3 --backend ll \
    --ranks 2 --iters 50 --warmup 5 --graph --json "$OUT/multinode-ll-v3-2x1-graph.json"
  run 15 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "$E" moe --device cuda --ranks 2 --preset deepseek-v3-mini --backend all \
    --steps 2 --tokens-per-rank 24 --json "$OUT/multinode-moe-deepseek-v3-mini-2x1.json"
  run 20 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 EPX_RENDEZVOUS=tcp://127.0.0.1:29533 "$E" bench --case ht-v3 --backend ht,all2allv \
    --dtype fp8 --ranks 2 --iters 10 --warmup 2 --json "$OUT/multinode-ht-v3-2x1.json"
} >"$OUT/final-mn.log" 2>&1
grep -E "^== |node layout|^ll-v3|^ht-v3|pass|FAIL|error" "$OUT/final-mn.log" | head -40
