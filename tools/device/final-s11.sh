#!/usr/bin/env bash
# tools/device/final-s11.sh: the eleventh session's final call on the one-GPU kind (the 2-GPU kind was not lent):
# final.sh part 1 (build, every GPU test, final-gemm.sh, final-mxfp4.sh with the FHMoE sweep), then compute-sanitizer
# on the session's new / never-sanitized experts kernels: memcheck and racecheck of ExpertsCuda.Fp8PrefillSmallShapes
# (the FP8 prefill default's TMA kernels and mode 17's cp.async kernel, small shapes) and of
# ExpertsCuda.Mxfp4DecodePathScaleSpread (decode_item_bulk on both GEMMs). Each sanitizer log keeps its summary and
# the first reports. Run: mkdir -p $OUT && OUT=$OUT bash tools/device/final-s11.sh
set -u
ROOT=$(pwd)
# (FINAL_SPECS and FINAL_SAN_SPECS "tool:limit:gtest-filter ..." override the final-*.sh allowances and the sanitizer
# runs: tools/device/final-s12.sh sets both.)
export GPU_CHECK_GPU_JOBS=3 FINAL_SPECS="${FINAL_SPECS:-gemm:50 mxfp4:45}" FINAL_RESERVE_S=${FINAL_RESERVE_S:-150} FINAL_MOE_AB=0 NCCL_NVLS_ENABLE=0
OUT=$OUT bash tools/device/final.sh 1 "${FINAL_END:-360}"
B=/tmp/epx-gpu-check/build
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
dl=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
if [ -x "$B/experts_cuda_test" ] && [ -n "$SAN" ]; then
  cd "$B"
  : >/tmp/san-summary.txt
  set -f  # the filters' '*' stay words
  for spec in ${FINAL_SAN_SPECS:-memcheck:35:*Fp8PrefillSmallShapes* racecheck:45:*Fp8PrefillSmallShapes* \
              memcheck:30:*Mxfp4DecodePathScaleSpread* racecheck:30:*Mxfp4DecodePathScaleSpread*}; do
    tool=${spec%%:*}; rest=${spec#*:}; lim=${rest%%:*}; filt=${rest#*:}
    log=/tmp/san-$tool-${filt//\*/}.log
    CUDA_VISIBLE_DEVICES=0 timeout -k 3 "$lim" "$SAN" --tool "$tool" ./experts_cuda_test --gtest_filter="$filt" >"$log" 2>&1
    echo "$tool $filt rc=$? (limit $lim): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$log" | tr '\n' ' ')" | tee -a /tmp/san-summary.txt
  done
  set +f
  { cat /tmp/san-summary.txt; for f in /tmp/san-*-*.log; do echo "== $f"; grep -v 'Host Frame' "$f" | head -120; done; } >"$OUT/san-logs.txt"
  cd "$ROOT"
fi
