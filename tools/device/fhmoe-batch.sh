#!/usr/bin/env bash
# tools/device/fhmoe-batch.sh: the fhmoe helper's device batch (issue 6: the fused decode regression,
# the separate shared expert on FP8 tensor cores, the FHMoE gate through the layer). Run from a copy
# of main that carries .carry/deps.tar.xz and .carry-fhmoe/{src,prebuilt}.tar.xz:
#   OUT=<dir> timeout -k 5 <allowance ~130 s> bash .carry-fhmoe/batch.sh
# prebuilt.tar.xz holds epx and moe_cuda_test built from src.tar.xz on the dev machine (CUDA 13.0,
# sm_90a); if they do not load here, they are built with tools/device/gpu-check.sh (GPU_CHECK_TARGETS).
# FHMOE_RUNS picks the measurements, most important first (each ~25-45 s: ~14 s of it the
# full-size weights, the rest the runs and the CPU reference of the validated tokens):
#   test      moe_cuda_test ModularMoECuda.SharedExpertFusedAndSeparate* and .WholeLayerGraph* (2 GPUs, fused vs
#             separate vs CPU, eager and graph replays)
#   old       V3 decode 128/rank ll fused, EPX_EXPERTS_FP8_PREFILL_MIN_TILES=1 (the fifth session's tiles)
#   new       V3 decode 128/rank ll --compare (fused and separate, defaults)
#   pf0       V3 decode 128/rank ll fused, EPX_EXPERTS_FP8_PREFILL=0
#   sweep3    V3 ll --compare over a trace of T = 1, 8, 32, 128, 512 tokens/rank (5 steps each; graph at T_max)
#   sweep4    the same for DeepSeek-V4-Pro
#   prefill3  V3 prefill 4096/rank ht --compare (eager, phases)
set -uo pipefail
OUT="${OUT:-/tmp/fhmoe-out}"
BUDGET="${BUDGET:-128}"
RUNS="${FHMOE_RUNS:-test sweep3 sweep4 prefill3}"
mkdir -p "$OUT"
HERE="$(pwd)"
S=/tmp/s-fhmoe
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-fhmoe/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
commit="$(cat "$HERE/.carry-fhmoe/commit.txt" 2>/dev/null || echo unknown)"
B=""
P=/tmp/fhmoe-prebuilt
D=/tmp/fhmoe-deps
if [ -f "$HERE/.carry-fhmoe/prebuilt.tar.xz" ]; then
  rm -rf "$P" "$D" && mkdir -p "$P" "$D"
  tar -C "$P" -xJf "$HERE/.carry-fhmoe/prebuilt.tar.xz" && tar -C "$D" -xJf "$HERE/.carry/deps.tar.xz"
  dl="$D/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  ldd "$P/epx" "$P/moe_cuda_test" >"$OUT/prebuilt-ldd.txt" 2>&1
  if ! grep -q "not found" "$OUT/prebuilt-ldd.txt" && timeout 20 "$P/moe_cuda_test" --gtest_list_tests >/dev/null 2>>"$OUT/prebuilt-ldd.txt"; then
    B="$P"
  fi
  echo "prebuilt: ${B:-unusable (see prebuilt-ldd.txt)} at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
if [ -z "$B" ]; then
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="epx_cli moe_cuda_test" \
    timeout -k 5 100 bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
  echo "build rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
  B=/tmp/epx-gpu-check/build
  deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export CUDA_VISIBLE_DEVICES=0,1
stamp() {  # the commit into a RESULTS.md JSON
  [ -f "$1" ] && python3 -c 'import json,sys; p=sys.argv[1]; d=json.load(open(p)); d["git_commit"]=sys.argv[2]; json.dump(d,open(p,"w"),indent=2)' "$1" "$commit"
}
moe() {  # <name> <limit_s> <env...> -- <epx moe args...>
  local name=$1 lim=$2; shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local l=$(( $(left) - 2 ))
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 15 ]; then echo "== skipped $name (no time left)" | tee -a "$OUT/summary.txt"; return; fi
  local t=$SECONDS
  echo "== $(date -u +%T) ${envs[*]} epx moe $* (limit $lim s)" >>"$OUT/commands.txt"
  env "${envs[@]}" timeout -k 3 "$lim" "$B/epx" moe "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? in $((SECONDS - t)) s (at $((SECONDS - T0)) s)" | tee -a "$OUT/summary.txt"
  stamp "$OUT/$name.json"
  grep -E "^ll |^ht |^  (ll|ht) " "$OUT/$name.log" | grep -v "eager, no graph" | head -8 | tee -a "$OUT/summary.txt"
}
V3=(--device cuda --ranks 2 --preset deepseek-v3 --dispatch-dtype fp8 --validate-tokens 1)
V4=(--device cuda --ranks 2 --preset deepseek-v4-pro --dispatch-dtype fp8 --validate-tokens 1)
for r in $RUNS; do
  case $r in
    test)
      (cd "$B" && timeout -k 2 35 ./moe_cuda_test --gtest_filter='ModularMoECuda.SharedExpertFusedAndSeparate*:ModularMoECuda.WholeLayerGraph*') >"$OUT/test-moe-cuda.log" 2>&1
      echo "test rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
      grep -E "rel L2|^\[ *(OK|FAILED|PASSED|SKIPPED) " "$OUT/test-moe-cuda.log" | tail -34 | tee -a "$OUT/summary.txt" ;;
    old) moe moe-v3-decode-ll-fused-mintiles1 38 EPX_EXPERTS_FP8_PREFILL_MIN_TILES=1 -- "${V3[@]}" --backend ll --mode decode --shared fused --steps 8 ;;
    new) moe moe-v3-decode-ll-compare 45 FHMOE=1 -- "${V3[@]}" --backend ll --mode decode --compare --steps 8 ;;
    pf0) moe moe-v3-decode-ll-fused-prefill0 40 EPX_EXPERTS_FP8_PREFILL=0 -- "${V3[@]}" --backend ll --mode decode --shared fused --steps 8 ;;
    sweep3|sweep4)
      if [ $r = sweep3 ]; then p=deepseek-v3; e=256; k=8; a=("${V3[@]}"); else p=deepseek-v4-pro; e=384; k=6; a=("${V4[@]}"); fi
      python3 "$S/bench/fhmoe_sweep_trace.py" --experts $e --top-k $k --ranks 2 --tokens 1,8,32,128,512 --steps 5 -o "$OUT/trace-$p.json"
      moe moe-$p-sweep-ll-compare 50 FHMOE=1 -- "${a[@]}" --backend ll --mode decode --compare --trace "$OUT/trace-$p.json"
      python3 "$S/bench/fhmoe_sweep_report.py" "$OUT/moe-$p-sweep-ll-compare.json" --tokens 1,8,32,128,512 --steps 5 2>&1 | tee "$OUT/sweep-$p.txt" | tee -a "$OUT/summary.txt"
      rm -f "$OUT/trace-$p.json" ;;
    prefill3) moe moe-v3-prefill-ht-compare 45 FHMOE=1 -- "${V3[@]}" --backend ht --mode prefill --compare --steps 3 ;;
    *) echo "unknown run $r" | tee -a "$OUT/summary.txt" ;;
  esac
done
echo "== fhmoe batch: $((SECONDS - T0)) s"
cat "$OUT/summary.txt"
