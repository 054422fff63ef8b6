#!/usr/bin/env bash
# tools/device/final-s13.sh: the thirteenth session's final call on one H200: tools/device/final-s11.sh (build, every
# GPU test, final-gemm.sh, final-mxfp4.sh, then compute-sanitizer) with the session's allowances: FINAL_END 420 (the
# experts GPU test now takes ~63 s instead of ~180: its CPU references computed once per case), FINAL_RESERVE_S 125
# for final-gemm (62 s) and final-mxfp4 (45 s), and the sanitizers of the FP8 prefill small shapes (memcheck +
# racecheck: the cluster kernels' pairing changed or not, the launcher was refactored) and memcheck of every format x
# layout. The Python module is built too (GPU_CHECK_CMAKE_ARGS) and examples/grouped_gemm_contiguous.py --device
# cuda:0 runs after the sanitizers (its log joins san-logs.txt).
# Run: mkdir -p $OUT && OUT=$OUT bash tools/device/final-s13.sh
export GPU_CHECK_CMAKE_ARGS="-DEPX_PYTHON=ON -DPython3_EXECUTABLE=$(command -v python3)"
export FINAL_END=${FINAL_END:-420} FINAL_RESERVE_S=${FINAL_RESERVE_S:-125}
FINAL_SPECS="gemm:62 mxfp4:45" \
FINAL_SAN_SPECS="memcheck:30:*Fp8PrefillSmallShapes* racecheck:45:*Fp8PrefillSmallShapes* memcheck:35:*SmallShapesEveryFormatEveryLayout*" \
  bash tools/device/final-s11.sh
B=/tmp/epx-gpu-check/build
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
dl=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{ echo "== examples/grouped_gemm_contiguous.py --device cuda:0"
  (cd /tmp/s-final && PYTHONPATH=$B/python CUDA_VISIBLE_DEVICES=0 timeout -k 3 30 python3 examples/grouped_gemm_contiguous.py --device cuda:0 2>&1 | tail -5)
  echo "rc=$?"; } >>"$OUT/san-logs.txt" 2>&1
tail -7 "$OUT/san-logs.txt"
