#!/usr/bin/env bash
# tools/device/fhmoe-s13-batch.sh: the FHMoE gate's 512..4096-token region through the whole layer on one H200
# (issue 6: "a capability gate on M (tokens), at a measured threshold"). Config::fhmoe_max_tokens = 4096 rests on the
# seventh session's 2-GPU layer figures; the FP8 prefill default has since become ~25 % faster (twelfth session), which
# makes the separate shared expert cheaper at large M. Builds epx_cli from .carry/src.tar.xz (tools/device/gpu-check.sh,
# GPU_CHECK_TARGETS) and runs tools/device/final-fhmoe.sh with ht, eager prefill, fused vs separate (--compare) over a
# trace of T = 512, 1024, 2048, 4096 tokens (3 steps each), DeepSeek-V3 then DeepSeek-V4-Pro, one rank.
# S13_TOKENS / S13_STEPS / S13_PRESETS override the sweep (the second run: S13_PRESETS=deepseek-v4-pro:384:6
# S13_TOKENS=256,512,768,1024,2048,4096 S13_STEPS=5, the crossover of the mixed-format gate).
# Run as a helpers-run.sh batch (.carry-lead/batch.sh) or: mkdir -p $OUT && OUT=$OUT BUDGET=200 bash tools/device/fhmoe-s13-batch.sh
source tools/device/batch-lib.sh
batch_init /tmp/fhmoe-s13 200
export CUDA_VISIBLE_DEVICES=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
say "commit $(cat .carry/commit.txt 2>/dev/null)"
GPU_CHECK_TARGETS="epx_cli" GPU_CHECK_TESTS=0 GPU_CHECK_BENCH=0 GPU_CHECK_CPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_ONE_GPU=0 \
  OUT="$OUT/build" timeout -k 5 "$(cap 120)" bash tools/device/gpu-check.sh run >"$OUT/gpu-check.out" 2>&1
say "build rc=$? at $((SECONDS - T0)) s"
rm -rf "$OUT/build"
deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
b=$(cap 150)
FHMOE_RANKS=1 FHMOE_BACKEND=ht FHMOE_MODE=prefill FHMOE_TOKENS=${S13_TOKENS:-512,1024,2048,4096} FHMOE_STEPS=${S13_STEPS:-3} \
  FHMOE_PRESETS="${S13_PRESETS:-deepseek-v3:256:8 deepseek-v4-pro:384:6}" FHMOE_FINAL_BUDGET_S=$b \
  SRC=/tmp/epx-gpu-check/src OUT="$OUT" FINAL_COMMIT="$(cat .carry/commit.txt 2>/dev/null)" \
  timeout -k 5 "$b" bash tools/device/final-fhmoe.sh >"$OUT/fhmoe.out" 2>&1
say "fhmoe rc=$? at $((SECONDS - T0)) s"
cat "$OUT/fhmoe-sweep.txt" >>"$OUT/summary.txt" 2>/dev/null
