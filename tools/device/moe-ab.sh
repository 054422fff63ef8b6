#!/usr/bin/env bash
# tools/device/moe-ab.sh: the decode and prefill A/B of the full-size DeepSeek-V3 layer on the
# 2-GPU device machine (issue 7), run after `gpu-check.sh run` has built epx in the same call:
#
#   decode : epx moe --device cuda --ranks 2 --preset deepseek-v3 --mode decode  --compare --backend all --dispatch-dtype fp8
#            (128 tokens/rank; whole-layer CUDA graph replay where the backend is graph-safe)
#   prefill: epx moe --device cuda --ranks 2 --preset deepseek-v3 --mode prefill --compare --backend all --dispatch-dtype fp8
#            (4096 tokens/rank, eager)
#   v4-pro : epx moe --device cuda --ranks 2 --preset deepseek-v4-pro --mode decode --backend all
#            (every backend on the full-size V4-Pro layer: 384 experts, top-6, MXFP4 routed, FP8 shared)
# Eager steps also report each phase's device time (prepare / experts / finalize / separate shared:
# `phase_us_p50` in the JSON), which says where a backend's layer time goes.
#
# Both validate the first V tokens of every rank and step against moe_reference_cpu on rank 0 (a
# full-size reference over every token would take tens of GB: each selected expert is dequantized to
# fp32 on the CPU). Writes $OUT/moe-ab.tar.gz: moe-decode-deepseek-v3.json, moe-prefill-deepseek-v3.json
# (RESULTS.md JSON, for bench/results/h200x2/), their logs and `epx info`. The tree was built from a
# git archive (no .git), so the JSON's git_commit is stamped from MOE_AB_COMMIT when given.
# Environment: EPX_BIN (default /tmp/epx-gpu-check/build/epx), MOE_AB_COMMIT, MOE_AB_DECODE_STEPS (10),
# MOE_AB_PREFILL_STEPS (3), MOE_AB_V4_STEPS (3; 0 skips it), MOE_AB_VALIDATE (2 tokens per rank and step),
# MOE_AB_TIMEOUT_S (per run, 120).
set -uo pipefail
# The commit to stamp: MOE_AB_COMMIT (EPX_COMMIT is still read, then unset: epx's Config rejects
# unknown EPX_* environment variables, so it must not reach the epx processes).
EPX_COMMIT="${MOE_AB_COMMIT:-${EPX_COMMIT:-}}"
unset MOE_AB_COMMIT
export -n EPX_COMMIT 2>/dev/null

B="${EPX_BIN:-/tmp/epx-gpu-check/build/epx}"
export -n EPX_BIN 2>/dev/null
out="${OUT:-/tmp/moe-ab-out}"
work="$(mktemp -d)"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
decode_steps="${MOE_AB_DECODE_STEPS:-10}"
prefill_steps="${MOE_AB_PREFILL_STEPS:-3}"
validate="${MOE_AB_VALIDATE:-2}"
limit="${MOE_AB_TIMEOUT_S:-120}"

"$B" info >"$work/info.txt" 2>&1

run() {  # name mode steps preset [extra args]
  local t0=$SECONDS name=$1 mode=$2 steps=$3 preset=$4
  shift 4
  timeout "$limit" "$B" moe --device cuda --ranks 2 --preset "$preset" --mode "$mode" --backend all "$@" \
    --steps "$steps" --validate-tokens "$validate" --json "$work/moe-$name-$preset.json" >"$work/moe-$name-$preset.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s" >>"$work/moe-$name-$preset.log"
  tail -40 "$work/moe-$name-$preset.log"
}
# DeepSeek-V3 with FP8 dispatch (the serving configuration, DeepEP's LL FP8): the experts then take
# the sm_90a tensor-core GEMMs (bf16 x keeps the SIMT reference GEMMs, which would hide the backends).
run decode decode "$decode_steps" deepseek-v3 --compare --dispatch-dtype fp8
run prefill prefill "$prefill_steps" deepseek-v3 --compare --dispatch-dtype fp8
v4_steps="${MOE_AB_V4_STEPS:-3}"
[ "$v4_steps" -gt 0 ] && run decode decode "$v4_steps" deepseek-v4-pro

if [ -n "${EPX_COMMIT:-}" ]; then
  for f in "$work"/moe-*.json; do
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
