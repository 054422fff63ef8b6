#!/usr/bin/env bash
# tools/device/final-gemm.sh: the grouped-GEMM benchmark of issue 6 in the final integrated run, after
# tools/device/gpu-check.sh built the tree. Environment: OUT (results folder), SRC (source tree;
# default: this script's repository), B (build folder; default /tmp/epx-gpu-check/build).
# Writes $OUT/gemm-bench.json (epx-gemm-bench: epx wgmma (prefill rows: the FP8 prefill kernels;
# epx-wgmma-64: the 64-row kernels alone, with the prefill kernels' rel. error against them), the
# pairs mainloop, cuBLASLt loop, ceilings) and $OUT/gemm-torch.json (torch._scaled_grouped_mm /
# torch._grouped_mm), with logs; within 50-60 s (the bench ~35 s: no SIMT rows, no --prefill-variants;
# the GPU tests check correctness; the JSON is rewritten after every row, so a timeout keeps what ran).
set -uo pipefail
OUT="${OUT:-/tmp/gemm-final-out}"
SRC="${SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
B="${B:-/tmp/epx-gpu-check/build}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
commit="$(git -C "$SRC" rev-parse --short=12 HEAD 2>/dev/null || cat "$SRC/.carry/commit.txt" 2>/dev/null || echo unknown)"
t0=$SECONDS
GEMM_BENCH_COMMIT="$commit" timeout -k 5 50 "$B/epx-gemm-bench" --iters 10 --rounds 5 --no-simt --json "$OUT/gemm-bench.json" >"$OUT/gemm-bench.log" 2>&1
echo "gemm-bench rc=$? in $((SECONDS - t0)) s"
t1=$SECONDS
timeout -k 5 18 python3 "$SRC/bench/gemm_torch.py" --iters 10 --uneven --json "$OUT/gemm-torch.json" >"$OUT/gemm-torch.log" 2>&1
echo "gemm-torch rc=$? in $((SECONDS - t1)) s"
grep -vE "^wrote" "$OUT/gemm-bench.log" | tail -12
tail -4 "$OUT/gemm-torch.log"
