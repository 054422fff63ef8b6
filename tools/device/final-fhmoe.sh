#!/usr/bin/env bash
# tools/device/final-fhmoe.sh: the FHMoE gate measurement through the whole layer (issue 6) in the final
# integrated run (or a helper's batch): full-size DeepSeek-V3, 2 ranks, ll, FP8 dispatch, whole-layer graph,
# shared expert fused vs separate (--compare; both on the FP8 tensor cores since the sixth session) over a
# routing trace of T = 1, 8, 32, 128, 512 tokens/rank, 5 steps each (bench/fhmoe_sweep_trace.py; the first
# token of each rank and step validated against moe_reference_cpu). Receives OUT, the built tree's epx at
# /tmp/epx-gpu-check/build/epx (FHMOE_FINAL_EPX) and the source at $SRC; ~50 s (FHMOE_FINAL_BUDGET_S, default 60).
# Writes moe-deepseek-v3-sweep-ll-compare.json / .log (RESULTS.md JSON, step_latency_us per step) and
# fhmoe-sweep.txt (bench/fhmoe_sweep_report.py: fused / separate - 1 per T, with the path counters).
set -u
T0=$SECONDS
BUDGET=${FHMOE_FINAL_BUDGET_S:-60}
OUT=${OUT:-/tmp/final-fhmoe-out}
E=${FHMOE_FINAL_EPX:-/tmp/epx-gpu-check/build/epx}  # not EPX_*: epx rejects unknown EPX_* variables
SRC=${SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0
python3 "$SRC/bench/fhmoe_sweep_trace.py" --experts 256 --top-k 8 --ranks 2 --tokens 1,8,32,128,512 --steps 5 -o /tmp/fhmoe-trace-v3.json
lim=$(( BUDGET - (SECONDS - T0) - 3 ))
echo "== $(date -u +%T) epx moe --device cuda --ranks 2 --preset deepseek-v3 --dispatch-dtype fp8 --validate-tokens 1 --backend ll --mode decode --compare --trace <fhmoe_sweep_trace.py --experts 256 --top-k 8 --ranks 2 --tokens 1,8,32,128,512 --steps 5> (limit $lim s)" | tee "$OUT/final-fhmoe.log"
timeout -k 3 "$lim" "$E" moe --device cuda --ranks 2 --preset deepseek-v3 --dispatch-dtype fp8 --validate-tokens 1 --backend ll \
  --mode decode --compare --trace /tmp/fhmoe-trace-v3.json --json "$OUT/moe-deepseek-v3-sweep-ll-compare.json" \
  >"$OUT/moe-deepseek-v3-sweep-ll-compare.log" 2>&1
echo "== exit $? after $(( SECONDS - T0 )) s" | tee -a "$OUT/final-fhmoe.log"
if [ -n "${FINAL_COMMIT:-}" ] && [ -f "$OUT/moe-deepseek-v3-sweep-ll-compare.json" ]; then
  python3 -c 'import json,sys; p=sys.argv[1]; d=json.load(open(p)); d["git_commit"]=sys.argv[2]; json.dump(d,open(p,"w"),indent=2)' \
    "$OUT/moe-deepseek-v3-sweep-ll-compare.json" "$FINAL_COMMIT"
fi
python3 "$SRC/bench/fhmoe_sweep_report.py" "$OUT/moe-deepseek-v3-sweep-ll-compare.json" --tokens 1,8,32,128,512 --steps 5 \
  2>&1 | tee "$OUT/fhmoe-sweep.txt"
rm -f /tmp/fhmoe-trace-v3.json
