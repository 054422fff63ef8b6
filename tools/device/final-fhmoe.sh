#!/usr/bin/env bash
# tools/device/final-fhmoe.sh: the FHMoE gate measurement through the whole layer (issue 6) in the final
# integrated run (or a helper's batch): 2 ranks (FHMOE_RANKS), ll, FP8 dispatch, whole-layer graph, shared expert fused vs
# separate (--compare; both on the tensor cores) over a routing trace of T = 1, 8, 32, 128, 512 tokens/rank, 5
# steps each (bench/fhmoe_sweep_trace.py; the first token of each rank and step validated against
# moe_reference_cpu), for full-size DeepSeek-V3 and then DeepSeek-V4-Pro (MXFP4 routed + FP8 shared), both with
# --expert-pool 16 (MoEWeights::expert_pool: the host builds 16 experts, the device still holds one copy per
# expert; ~4 s instead of 13-41 s per rank). Receives OUT, the built tree's epx at /tmp/epx-gpu-check/build/epx
# (FHMOE_FINAL_EPX) and the source at $SRC; ~30 s (FHMOE_FINAL_BUDGET_S, default 60; V4-Pro is skipped when
# fewer than 20 s are left). Writes moe-<preset>-sweep-<backend>-<mode>-compare.json / .log (RESULTS.md JSON,
# step_latency_us per step) and fhmoe-sweep.txt (bench/fhmoe_sweep_report.py: fused / separate - 1 per T,
# with the path counters).
set -u
T0=$SECONDS
BUDGET=${FHMOE_FINAL_BUDGET_S:-60}
RANKS=${FHMOE_RANKS:-2}  # 1: the whole layer on one GPU (ll loopback), where only the one-GPU kind is lent
TOKENS=${FHMOE_TOKENS:-1,8,32,128,512} STEPS=${FHMOE_STEPS:-5}  # tokens/rank of the sweep, steps per size
# backend and mode (thirteenth session: ht / prefill, eager, for the gate's 512..4096 region on one GPU); PRESETS: which
BACKEND=${FHMOE_BACKEND:-ll} MODE=${FHMOE_MODE:-decode} PRESETS=${FHMOE_PRESETS:-deepseek-v3:256:8 deepseek-v4-pro:384:6}
OUT=${OUT:-/tmp/final-fhmoe-out}
E=${FHMOE_FINAL_EPX:-/tmp/epx-gpu-check/build/epx}  # not EPX_*: epx rejects unknown EPX_* variables
SRC=${SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0
: >"$OUT/fhmoe-sweep.txt"
for spec in $PRESETS; do
  IFS=: read -r preset experts topk <<<"$spec"
  lim=$(( BUDGET - (SECONDS - T0) - 3 ))
  if [ "$lim" -lt 20 ]; then echo "== skipped $preset (no time left)" | tee -a "$OUT/final-fhmoe.log"; continue; fi
  python3 "$SRC/bench/fhmoe_sweep_trace.py" --experts "$experts" --top-k "$topk" --ranks $RANKS --tokens $TOKENS --steps $STEPS \
    -o "/tmp/fhmoe-trace-$preset.json"
  name="moe-$preset-sweep-$BACKEND-$MODE-compare"
  echo "== $(date -u +%T) epx moe --device cuda --ranks $RANKS --preset $preset --dispatch-dtype fp8 --validate-tokens 1 --expert-pool 16 --backend $BACKEND --mode $MODE --compare --trace <fhmoe_sweep_trace.py --experts $experts --top-k $topk --ranks $RANKS --tokens $TOKENS --steps $STEPS> (limit $lim s)" | tee -a "$OUT/final-fhmoe.log"
  timeout -k 3 "$lim" "$E" moe --device cuda --ranks $RANKS --preset "$preset" --dispatch-dtype fp8 --validate-tokens 1 --expert-pool 16 \
    --backend "$BACKEND" --mode "$MODE" --compare --trace "/tmp/fhmoe-trace-$preset.json" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "== exit $? after $(( SECONDS - T0 )) s" | tee -a "$OUT/final-fhmoe.log"
  if [ -n "${FINAL_COMMIT:-}" ] && [ -f "$OUT/$name.json" ]; then
    python3 -c 'import json,sys; p=sys.argv[1]; d=json.load(open(p)); d["git_commit"]=sys.argv[2]; json.dump(d,open(p,"w"),indent=2)' \
      "$OUT/$name.json" "$FINAL_COMMIT"
  fi
  [ -f "$OUT/$name.json" ] && python3 "$SRC/bench/fhmoe_sweep_report.py" "$OUT/$name.json" --tokens $TOKENS --steps $STEPS \
    2>&1 | tee -a "$OUT/fhmoe-sweep.txt"
  rm -f "/tmp/fhmoe-trace-$preset.json"
done
