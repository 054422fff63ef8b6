#!/usr/bin/env bash
# tools/device/moe-ab.sh: the decode and prefill A/B of the full-size DeepSeek-V3 layer on the
# 2-GPU device machine (issue 7), run after `gpu-check.sh run` has built epx in the same call:
#
#   decode : epx moe --device cuda --ranks 2 --preset deepseek-v3 --mode decode  --compare --backend all
#            (128 tokens/rank; whole-layer CUDA graph replay where the backend is graph-safe)
#   prefill: epx moe --device cuda --ranks 2 --preset deepseek-v3 --mode prefill --compare --backend all
#            (4096 tokens/rank, eager)
#
# Both validate the first V tokens of every rank and step against moe_reference_cpu on rank 0 (a
# full-size reference over every token would take tens of GB: each selected expert is dequantized to
# fp32 on the CPU). Writes $OUT/moe-ab.tar.gz: moe-decode-deepseek-v3.json, moe-prefill-deepseek-v3.json
# (RESULTS.md JSON, for bench/results/h200x2/), their logs and `epx info`. The tree was built from a
# git archive (no .git), so the JSON's git_commit is stamped from EPX_COMMIT when given.
# Environment: EPX_BIN (default /tmp/epx-gpu-check/build/epx), EPX_COMMIT, MOE_AB_DECODE_STEPS (10),
# MOE_AB_PREFILL_STEPS (3), MOE_AB_VALIDATE (2 tokens per rank and step), MOE_AB_TIMEOUT_S (per run, 120).
set -uo pipefail

B="${EPX_BIN:-/tmp/epx-gpu-check/build/epx}"
out="${OUT:-/tmp/moe-ab-out}"
work="$(mktemp -d)"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
decode_steps="${MOE_AB_DECODE_STEPS:-10}"
prefill_steps="${MOE_AB_PREFILL_STEPS:-3}"
validate="${MOE_AB_VALIDATE:-2}"
limit="${MOE_AB_TIMEOUT_S:-120}"

"$B" info >"$work/info.txt" 2>&1

run() {  # name mode steps
  local t0=$SECONDS
  timeout "$limit" "$B" moe --device cuda --ranks 2 --preset deepseek-v3 --mode "$2" --compare --backend all \
    --steps "$3" --validate-tokens "$validate" --json "$work/moe-$1-deepseek-v3.json" >"$work/moe-$1.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s" >>"$work/moe-$1.log"
  tail -40 "$work/moe-$1.log"
}
run decode decode "$decode_steps"
run prefill prefill "$prefill_steps"

if [ -n "${EPX_COMMIT:-}" ]; then
  for f in "$work"/moe-*-deepseek-v3.json; do
    [ -f "$f" ] || continue
    python3 - "$f" "$EPX_COMMIT" <<'EOF'
import json, sys
p, commit = sys.argv[1], sys.argv[2]
d = json.load(open(p))
d["git_commit"] = commit
json.dump(d, open(p, "w"), indent=2)
EOF
  done
fi
tar -C "$work" -czf "$out/moe-ab.tar.gz" .
ls -la "$work"
