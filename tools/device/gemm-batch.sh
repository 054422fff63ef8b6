#!/usr/bin/env bash
# tools/device/gemm-batch.sh: the grouped-GEMM helper's device batch (issue 6). Run from a copy of
# main that carries .carry/deps.tar.xz and a carry folder <C> with src.tar.xz (+ commit.txt), as
#   OUT=<dir> timeout -k 5 <allowance> bash <C>/batch.sh          (batch.sh = a copy of this file)
# The carry folder is the one this script sits in, or GEMM_CARRY (e.g. GEMM_CARRY=.carry-gemmpf bash
# tools/device/gemm-batch.sh). The fifth session's GEMM helpers use gemmpf-batch.sh / mxfp4-batch.sh.
# Builds the packed tree with tools/device/gpu-check.sh (experts GPU tests only), then runs
# epx-gemm-bench (JSON) and bench/gemm_torch.py. Every step has its own timeout; logs go to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/gemm-out}"
mkdir -p "$OUT"
HERE="$(pwd)"
CARRY="$(cd "${GEMM_CARRY:-$(dirname "${BASH_SOURCE[0]}")}" && pwd)"
[ -f "$CARRY/src.tar.xz" ] || { echo "no $CARRY/src.tar.xz: run as <carry folder>/batch.sh or set GEMM_CARRY"; exit 2; }
S=/tmp/s-gemm
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$CARRY/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0
t0=$SECONDS
GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 \
  GPU_CHECK_FILTER='experts_cuda_test' timeout -k 5 95 bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
echo "gpu-check rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
B=/tmp/epx-gpu-check/build
deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
grep -E "^\[ *(OK|FAILED|RUN) *\]|timing|rel_l2|Failure|Expected|Which is|actual" "$OUT/gpu.log" 2>/dev/null | head -80 >"$OUT/tests-brief.txt"
# The same GPU tests with the paired-K-block mainloop (EPX_EXPERTS_FP8_PAIRS=1).
t3=$SECONDS
(cd "$B" && EPX_EXPERTS_FP8_PAIRS=1 timeout -k 5 40 ./experts_cuda_test) >"$OUT/gpu-pairs.log" 2>&1
echo "experts_cuda_test (pairs) rc=$? in $((SECONDS - t3)) s" | tee -a "$OUT/summary.txt"
if [ -x "$B/epx-gemm-bench" ]; then
  t1=$SECONDS
  GEMM_BENCH_COMMIT="$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)" timeout -k 5 70 "$B/epx-gemm-bench" --iters 20 \
    --json "$OUT/gemm-bench.json" >"$OUT/gemm-bench.log" 2>&1
  echo "gemm-bench rc=$? in $((SECONDS - t1)) s" | tee -a "$OUT/summary.txt"
  cuobjdump -sass "$B/epx-gemm-bench" 2>/dev/null | grep -c QGMMA >"$OUT/sass-qgmma-count.txt" 2>&1
fi
t2=$SECONDS
timeout -k 5 30 python3 "$S/bench/gemm_torch.py" --iters 20 --json "$OUT/gemm-torch.json" >"$OUT/gemm-torch.log" 2>&1
echo "torch rc=$? in $((SECONDS - t2)) s" | tee -a "$OUT/summary.txt"
echo "== tests"; grep -E "^\[  (FAILED|PASSED) |tests passed|timing" "$OUT/gpu.log" 2>/dev/null | tail -12
echo "== tests (pairs)"; grep -E "^\[  (FAILED|PASSED) |timing" "$OUT/gpu-pairs.log" 2>/dev/null | tail -8
echo "== bench"; grep -vE "^wrote" "$OUT/gemm-bench.log" 2>/dev/null | tail -14
echo "== torch"; tail -5 "$OUT/gemm-torch.log" 2>/dev/null
