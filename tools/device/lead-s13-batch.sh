#!/usr/bin/env bash
# tools/device/lead-s13-batch.sh: the thirteenth session's first lead call on one H200 (issue 6). From the repository
# root of the device copy, after `bash tools/device/gpu-check.sh pack` here (carry [".carry"]):
#   mkdir -p $OUT && OUT=$OUT BUDGET=585 bash tools/device/lead-s13-batch.sh
# 1. builds epx_cli, epx_gemm_bench and the Python module (tools/device/gpu-check.sh, GPU_CHECK_TARGETS, EPX_PYTHON=ON;
#    no tests: the GPU tests run in the session's final call);
# 2. bench/gemm_vs_torch.py: epx's FP8 prefill experts and torch._scaled_grouped_mm in one process, interleaved rounds,
#    uniform and uneven (gemm-vs-torch.json), with nvidia-smi's SM clock / power / temperature every 200 ms (smi.csv);
# 3. examples/grouped_gemm_contiguous.py --device cuda:0 (its first GPU run);
# 4. the full-size DeepSeek-V3 layer on one rank, ht, prefill, FP8 dispatch: Flat experts against
#    --expert-contiguous (the layer option's first GPU run), order A B A (moe-ht-*.json); with LEAD_S13_CALL=2 (the
#    second call) both at EPX_HT_NUM_SMS=132 instead of the default 64, order B A B; with LEAD_S13_CALL=3 (the third
#    call) neither, nor the example: tools/device/final-fhmoe.sh on DeepSeek-V4-Pro instead (ht, eager prefill, one
#    rank, fused vs separate, T = 256 .. 4096, 5 steps each: the mixed-format gate's crossover).
# Everything but summary.txt comes back in $OUT/all.tar.gz (a device call returns at most 8 files).
source tools/device/batch-lib.sh
batch_init /tmp/lead-s13 585
export CUDA_VISIBLE_DEVICES=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
commit="$(cat .carry/commit.txt 2>/dev/null || echo unknown)"
say "commit $commit"
py="$(command -v python3)"
GPU_CHECK_TARGETS="_epx epx_cli epx_gemm_bench" GPU_CHECK_TESTS=0 GPU_CHECK_BENCH=0 GPU_CHECK_CPU=0 GPU_CHECK_SANITIZE=0 \
  GPU_CHECK_ONE_GPU=0 GPU_CHECK_CMAKE_ARGS="-DEPX_PYTHON=ON -DPython3_EXECUTABLE=$py" OUT="$OUT/build" \
  timeout -k 5 "$(cap 240)" bash tools/device/gpu-check.sh run >"$OUT/gpu-check.out" 2>&1
say "build rc=$? at $((SECONDS - T0)) s"
B=/tmp/epx-gpu-check/build
S=/tmp/epx-gpu-check/src
tail -3 "$OUT/build/build.log" | tee -a "$OUT/summary.txt"
deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$B/python" PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu --format=csv -lms 200 >"$OUT/smi.csv" 2>&1 &
smi=$!
t=$SECONDS
(cd "$S" && GEMM_BENCH_COMMIT="$commit" timeout -k 5 "$(cap 150)" python3 bench/gemm_vs_torch.py --rounds 9 --iters 10 --uneven \
  --cool 10 --json "$OUT/gemm-vs-torch.json") >"$OUT/gemm-vs-torch.log" 2>&1
say "gemm_vs_torch rc=$? in $((SECONDS - t)) s"
kill "$smi" 2>/dev/null
grep -E "check|speed-up|rounds p50|weights:|Error|error" "$OUT/gemm-vs-torch.log" | tee -a "$OUT/summary.txt"

if [ "${LEAD_S13_CALL:-1}" != 3 ]; then
  t=$SECONDS
  (cd "$S" && timeout -k 5 "$(cap 60)" python3 examples/grouped_gemm_contiguous.py --device cuda:0) >"$OUT/example-contiguous.log" 2>&1
  say "example grouped_gemm_contiguous --device cuda:0 rc=$? in $((SECONDS - t)) s"
  tail -5 "$OUT/example-contiguous.log" | tee -a "$OUT/summary.txt"
fi

moe() {  # name [extra args] (EPX_* settings from the caller's environment)
  local name=$1 t=$SECONDS lim
  shift
  lim=$(cap 100)
  [ "$lim" -lt 30 ] && { say "moe $name skipped"; return; }
  timeout -k 5 "$lim" "$B/epx" moe --device cuda --ranks 1 --preset deepseek-v3 --mode prefill --backend ht \
    --dispatch-dtype fp8 --steps 3 --validate-tokens 2 "$@" --json "$OUT/moe-ht-$name.json" >"$OUT/moe-ht-$name.log" 2>&1
  say "moe $name rc=$? in $((SECONDS - t)) s"
  grep -iE "ht |layer|valid|contig|error" "$OUT/moe-ht-$name.log" | tail -6 | tee -a "$OUT/summary.txt"
}
if [ "${LEAD_S13_CALL:-1}" = 3 ]; then  # third call: the mixed-format FHMoE gate's crossover (V4-Pro, 5 steps per T)
  b=$(cap 110)
  FHMOE_RANKS=1 FHMOE_BACKEND=ht FHMOE_MODE=prefill FHMOE_TOKENS=256,512,768,1024,2048,4096 FHMOE_STEPS=5 \
    FHMOE_PRESETS="deepseek-v4-pro:384:6" FHMOE_FINAL_BUDGET_S=$b FHMOE_FINAL_EPX="$B/epx" SRC="$S" OUT="$OUT/fhmoe" \
    FINAL_COMMIT="$commit" timeout -k 5 "$b" bash tools/device/final-fhmoe.sh >"$OUT/fhmoe.out" 2>&1
  say "fhmoe rc=$? at $((SECONDS - T0)) s"
  cat "$OUT/fhmoe/fhmoe-sweep.txt" >>"$OUT/summary.txt" 2>/dev/null
elif [ "${LEAD_S13_CALL:-1}" = 1 ]; then
  moe flat-1
  moe contiguous-1 --expert-contiguous
  moe flat-2
else  # second call: the HT kernels' SM budget at 132 (default 64) for both, order B A B
  EPX_HT_NUM_SMS=132 moe contiguous-sms132-1 --expert-contiguous
  EPX_HT_NUM_SMS=132 moe flat-sms132-1
  EPX_HT_NUM_SMS=132 moe contiguous-sms132-2 --expert-contiguous
fi
say "end at $((SECONDS - T0)) s"
# At most 8 files come back from a device call: everything but summary.txt goes into one archive.
(cd "$OUT" && tar czf /tmp/lead-s13-all.tar.gz --exclude=summary.txt . && find . -mindepth 1 ! -name summary.txt -delete && mv /tmp/lead-s13-all.tar.gz all.tar.gz)
