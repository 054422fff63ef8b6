#!/usr/bin/env bash
# tools/device/final-moe.sh: the whole-layer decode / prefill table of README.md ("Measured on 2 x H200")
# in the final integrated run (tools/device/final.sh, FINAL_SPECS "moe:<s>") or in a helper's batch.
# Receives OUT, the built tree's epx at /tmp/epx-gpu-check/build/epx (MOE_FINAL_EPX) and the source at $SRC;
# stays within MOE_FINAL_BUDGET_S (else final.sh's FINAL_BUDGET_S, else 100 s: each run took ~40 s at 5c4d7a8, of which ~14 s built
# the full-size weights and ~11 s the CPU reference of the validated tokens; ~25 s with --expert-pool 16, seventh session). Every backend (naive,
# allgather_reducescatter, all2allv, ll, ht), 2 ranks, full-size DeepSeek-V3 layer, FP8 dispatch,
# shared expert fused vs separate (--compare), each step's first MOE_FINAL_VALIDATE (2) tokens per rank validated against
# moe_reference_cpu:
#   moe-decode-deepseek-v3.json   --mode decode, 128 tokens/rank, 10 steps (ll: whole-layer CUDA graph)
#   moe-prefill-deepseek-v3.json  --mode prefill, 4096 tokens/rank, 3 steps (eager)
#   moe-*.log                     their tables, final-moe.log the commands and exit statuses
# RESULTS.md JSON; git_commit is stamped from FINAL_COMMIT when given (the tree is a git archive).
set -u
T0=$SECONDS
BUDGET=${MOE_FINAL_BUDGET_S:-${FINAL_BUDGET_S:-100}}
OUT=${OUT:-/tmp/final-moe-out}
E=${MOE_FINAL_EPX:-/tmp/epx-gpu-check/build/epx}  # not EPX_*: epx rejects unknown EPX_* variables
COMMIT=${FINAL_COMMIT:-}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0
cd "${SRC:-.}" || exit 1
run() {  # <name> <limit_s> <epx moe args...>: cut to the time left; log + JSON under $OUT
  local name=$1 lim=$2; shift 2
  local l=$(( BUDGET - (SECONDS - T0) - 2 ))
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 20 ]; then echo "== skipped $name (no time left)" | tee -a "$OUT/final-moe.log"; return 1; fi
  local t=$SECONDS
  echo "== $(date -u +%T) epx moe $* (limit $lim s)" >>"$OUT/final-moe.log"
  timeout -k 3 "$lim" "$E" moe "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $(( SECONDS - t )) s" | tee -a "$OUT/final-moe.log"
  if [ -n "$COMMIT" ] && [ -f "$OUT/$name.json" ]; then
    python3 -c 'import json,sys; p=sys.argv[1]; d=json.load(open(p)); d["git_commit"]=sys.argv[2]; json.dump(d,open(p,"w"),indent=2)' \
      "$OUT/$name.json" "$COMMIT"
  fi
  grep -E "^(naive|allgather|all2allv|ll|ht) " "$OUT/$name.log" | head -12
}
# --expert-pool 16 (MoEWeights::expert_pool): the host builds 16 experts per rank (~4 s instead of ~14-18 s); the
# device still holds one copy of every expert, and the reference uses the same values.
COMMON=(--device cuda --ranks 2 --preset deepseek-v3 --backend all --compare --dispatch-dtype fp8 --validate-tokens "${MOE_FINAL_VALIDATE:-2}"
        --expert-pool 16)
# Each run needs ~40 s (most of it the weights and the reference), at most 55 s each, in the order of
# MOE_FINAL_MODES (default "decode prefill"; a run that no longer fits is skipped).
for mode in ${MOE_FINAL_MODES:-decode prefill}; do
  case $mode in
    decode) run moe-decode-deepseek-v3 55 "${COMMON[@]}" --mode decode --steps 10 ;;
    prefill) run moe-prefill-deepseek-v3 55 "${COMMON[@]}" --mode prefill --steps 3 ;;
    *) echo "== unknown mode $mode (decode | prefill)" ;;
  esac
done
echo "== final-moe: $(( SECONDS - T0 )) s"
