#!/usr/bin/env bash
# tools/device/fhmoe-batch.sh: the fhmoe helper's device batch (issue 6: the FHMoE gate through the
# layer, fused vs separate shared expert). Run from a copy of main that carries .carry/deps.tar.xz and
# .carry-fhmoe/{src,prebuilt}.tar.xz:
#   OUT=<dir> timeout -k 5 <allowance> bash .carry-fhmoe/batch.sh   (BUDGET: seconds the script keeps to, default 48)
# prebuilt.tar.xz holds epx and moe_cuda_test built from src.tar.xz on the dev machine (CUDA 13.0,
# sm_90a, NCCL 2.28.9); if they do not load here, they are built with tools/device/gpu-check.sh.
# Full-size presets use --expert-pool 16 (MoEWeights::expert_pool: random expert e holds expert
# e mod 16's values, one device copy per expert; the host builds 16 experts instead of 128-192).
# FHMOE_RUNS picks the measurements, most important first:
#   sweep4    DeepSeek-V4-Pro, ll, whole-layer graph, --compare over a trace of T = 1, 8, 32, 128, 512
#             tokens/rank (5 steps each; bench/fhmoe_sweep_trace.py)
#   sweep3    the same for DeepSeek-V3
#   mid3      DeepSeek-V3, every backend, --mode prefill (eager, phases per step), --compare over
#             T = 4096, 3072, 2048, 1536, 1024, 768, 512 (4 steps each; largest first: the warm-ups
#             size every buffer)
#   mid4      the same for DeepSeek-V4-Pro over T = 3072 ... 512
#   mid3ll, mid4ll, mid3ht, mid4ht: mid3 / mid4 on one backend; mid3llq: ll, T = 4096, 2048, 1024, 768, 512, 3 steps
#   test      moe_cuda_test ModularMoECuda.SharedExpertFusedAndSeparate* and .WholeLayerGraph* (2 GPUs,
#             fused vs separate vs CPU on V3-mini and V4-Pro-mini, eager and graph replays)
set -uo pipefail
OUT="${OUT:-/tmp/fhmoe-out}"
BUDGET="${BUDGET:-48}"
RUNS="${FHMOE_RUNS:-test sweep3 mid3llq}"
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
  ldd "$P/epx" >"$OUT/prebuilt-ldd.txt" 2>&1
  if ! grep -q "not found" "$OUT/prebuilt-ldd.txt" && timeout 20 "$P/epx" info >"$OUT/epx-info.txt" 2>>"$OUT/prebuilt-ldd.txt"; then
    B="$P"
  fi
  echo "prebuilt: ${B:-unusable (see prebuilt-ldd.txt)} at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
fi
if [ -z "$B" ]; then
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="epx_cli moe_cuda_test" \
    timeout -k 5 70 bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
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
  if [ "$lim" -lt 12 ]; then echo "== skipped $name (no time left)" | tee -a "$OUT/summary.txt"; return; fi
  local t=$SECONDS
  echo "== $(date -u +%T) ${envs[*]} epx moe $* (limit $lim s)" >>"$OUT/commands.txt"
  env "${envs[@]}" timeout -k 3 "$lim" "$B/epx" moe "$@" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? in $((SECONDS - t)) s (at $((SECONDS - T0)) s)" | tee -a "$OUT/summary.txt"
  stamp "$OUT/$name.json"
}
# sweep <name> <preset> <E> <K> <tokens> <steps> <limit_s> <epx moe args...>
sweep() {
  local name=$1 p=$2 e=$3 k=$4 tok=$5 st=$6 lim=$7; shift 7
  python3 "$S/bench/fhmoe_sweep_trace.py" --experts "$e" --top-k "$k" --ranks 2 --tokens "$tok" --steps "$st" -o "/tmp/trace-$name.json"
  echo "== trace: fhmoe_sweep_trace.py --experts $e --top-k $k --ranks 2 --tokens $tok --steps $st" >>"$OUT/commands.txt"
  moe "$name" "$lim" FHMOE=1 -- --device cuda --ranks 2 --preset "$p" --dispatch-dtype fp8 --validate-tokens 1 --expert-pool 16 \
    --compare --trace "/tmp/trace-$name.json" "$@"
  [ -f "$OUT/$name.json" ] && python3 "$S/bench/fhmoe_sweep_report.py" "$OUT/$name.json" --tokens "$tok" --steps "$st" 2>&1 \
    | tee "$OUT/$name.txt" | tee -a "$OUT/summary.txt"
  grep -E "^(rank 0: workload|reference:)" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  rm -f "/tmp/trace-$name.json"
}
MID3=4096,3072,2048,1536,1024,768,512
MID4=3072,2048,1536,1024,768,512
for r in $RUNS; do
  case $r in
    sweep4) sweep sweep-v4pro-ll deepseek-v4-pro 384 6 1,8,32,128,512 5 40 --backend ll --mode decode ;;
    sweep3) sweep sweep-v3-ll deepseek-v3 256 8 1,8,32,128,512 5 35 --backend ll --mode decode ;;
    mid3) sweep mid-v3-all deepseek-v3 256 8 $MID3 4 45 --backend all --mode prefill --warmup 2 ;;
    mid4) sweep mid-v4pro-all deepseek-v4-pro 384 6 $MID4 4 45 --backend all --mode prefill --warmup 2 ;;
    mid3ll) sweep mid-v3-ll deepseek-v3 256 8 $MID3 4 30 --backend ll --mode prefill --warmup 2 ;;
    mid3llq) sweep mid-v3-ll-q deepseek-v3 256 8 4096,2048,1024,768,512 3 20 --backend ll --mode prefill --warmup 2 ;;
    mid4ll) sweep mid-v4pro-ll deepseek-v4-pro 384 6 $MID4 4 30 --backend ll --mode prefill --warmup 2 ;;
    mid3ht) sweep mid-v3-ht deepseek-v3 256 8 $MID3 4 30 --backend ht --mode prefill --warmup 2 ;;
    mid4ht) sweep mid-v4pro-ht deepseek-v4-pro 384 6 $MID4 4 30 --backend ht --mode prefill --warmup 2 ;;
    test)
      l=$(( $(left) - 2 ))
      if [ ! -x "$B/moe_cuda_test" ]; then echo "== skipped test (no moe_cuda_test in $B)" | tee -a "$OUT/summary.txt"; continue; fi
      if [ "$l" -lt 15 ]; then echo "== skipped test (no time left)" | tee -a "$OUT/summary.txt"; continue; fi
      [ "$l" -gt 25 ] && l=25
      (cd "$B" && timeout -k 2 "$l" ./moe_cuda_test --gtest_filter='ModularMoECuda.SharedExpertFusedAndSeparate*:ModularMoECuda.WholeLayerGraph*') >"$OUT/test-moe-cuda.log" 2>&1
      echo "test rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
      grep -E "rel L2|^\[ *(OK|FAILED|PASSED|SKIPPED) " "$OUT/test-moe-cuda.log" | tail -34 | tee -a "$OUT/summary.txt" ;;
    *) echo "unknown run $r" | tee -a "$OUT/summary.txt" ;;
  esac
done
echo "== fhmoe batch ($commit): $((SECONDS - T0)) s"
cat "$OUT/summary.txt"
