#!/usr/bin/env bash
# tools/device/final-s10.sh: the tenth session's final call on the one-GPU kind (the 2-GPU kind was withdrawn again):
# final.sh part 1 (build, every GPU test, final-gemm.sh, final-mxfp4.sh), then compute-sanitizer on the session's new
# experts kernels (memcheck: the MXFP4 decode path and the FP8 prefill default; racecheck: the decode path), then the
# mxfp4 helper's optional third batch (.carry-mxfp4). Run: mkdir -p $OUT && OUT=$OUT bash tools/device/final-s10.sh
set -u
ROOT=$(pwd)
export GPU_CHECK_GPU_JOBS=3 FINAL_SPECS="gemm:50 mxfp4:45" FINAL_RESERVE_S=140 FINAL_MOE_AB=0 NCCL_NVLS_ENABLE=0
OUT=$OUT bash tools/device/final.sh 1 "${FINAL_END:-350}"
B=/tmp/epx-gpu-check/build
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
dl=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
if [ -x "$B/experts_cuda_test" ] && [ -n "$SAN" ]; then
  cd "$B"
  for spec in "memcheck:45:*Mxfp4DecodePath*:*Fp8TensorCoreRowCountsOneTo8192*" "racecheck:45:*Mxfp4DecodePathRowCounts*"; do
    tool=${spec%%:*}; rest=${spec#*:}; lim=${rest%%:*}; filt=${rest#*:}
    CUDA_VISIBLE_DEVICES=0 timeout -k 3 "$lim" "$SAN" --tool "$tool" ./experts_cuda_test --gtest_filter="$filt" > "/tmp/san-$tool.log" 2>&1
    echo "$tool rc=$? (limit $lim): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' /tmp/san-$tool.log | tr '\n' ' ')" | tee -a /tmp/san-summary.txt
  done
  { cat /tmp/san-summary.txt; tail -c 20000 /tmp/san-memcheck.log; } > "$OUT/san-logs.txt"; tail -c 10000 /tmp/san-racecheck.log >> "$OUT/san-logs.txt"
  cd "$ROOT"
fi
[ -f .carry-mxfp4/batch.sh ] && OUT=$OUT bash tools/device/helpers-run.sh "mxfp4:${MXFP4_S:-100}"
