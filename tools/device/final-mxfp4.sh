#!/usr/bin/env bash
# tools/device/final-mxfp4.sh: the MXFP4 grouped-GEMM + FHMoE benchmark of issue 6 in the final
# integrated run, after tools/device/gpu-check.sh built the tree (target epx_gemm_mxfp4_bench).
# Environment: OUT (results folder), SRC (source tree; default: this script's repository), B (build
# folder; default /tmp/epx-gpu-check/build). Writes $OUT/gemm-mxfp4.json (DeepSeek-V4-Pro MXFP4
# experts: decode validated against the CPU experts with the per-phase stamps of its K loop
# (--stamps), prefill, and the FHMoE fused-vs-separate sweep with the measured gate threshold) and
# its log, on GPU 0, within 60 s (no SIMT rows; the JSON is rewritten after every row, so a timeout
# keeps what ran).
set -uo pipefail
OUT="${OUT:-/tmp/mxfp4-final-out}"
SRC="${SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
B="${B:-/tmp/epx-gpu-check/build}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
commit="$(git -C "$SRC" rev-parse --short=12 HEAD 2>/dev/null || cat "$SRC/.carry/commit.txt" 2>/dev/null || echo unknown)"
if [ ! -x "$B/epx-gemm-mxfp4-bench" ]; then
  (cd "$B" && timeout -k 5 40 cmake --build . -j "$(nproc)" --target epx_gemm_mxfp4_bench) >"$OUT/gemm-mxfp4-build.log" 2>&1
fi
t0=$SECONDS
CUDA_VISIBLE_DEVICES=0 GEMM_BENCH_COMMIT="$commit" timeout -k 5 55 "$B/epx-gemm-mxfp4-bench" --iters 10 --no-simt --stamps --fhmoe-experts 192,48 \
  --json "$OUT/gemm-mxfp4.json" >"$OUT/gemm-mxfp4.log" 2>&1
echo "gemm-mxfp4-bench rc=$? in $((SECONDS - t0)) s"
grep -vE "^wrote" "$OUT/gemm-mxfp4.log" | tail -40
