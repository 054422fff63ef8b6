#!/usr/bin/env bash
# tools/device/final-s12.sh: the twelfth session's final call on the one-GPU kind (the 2-GPU kind was not lent):
# tools/device/final-s11.sh (build, every GPU test, final-gemm.sh, final-mxfp4.sh with the FHMoE sweep, then
# compute-sanitizer) with final-gemm.sh's allowance raised for the Contiguous rows, --rounds and torch --uneven, and
# the sanitizer runs: memcheck / racecheck of the FP8 prefill small shapes (the TMA and cluster kernels, and since the
# twelfth session the cp.async kernel's own test) and memcheck of ExpertsCuda.SmallShapesEveryFormatEveryLayout (the
# Contiguous layout on every format); the MXFP4 decode ones ran clean in the eleventh session. Run: mkdir -p $OUT && OUT=$OUT bash tools/device/final-s12.sh
FINAL_SPECS="gemm:62 mxfp4:45" \
FINAL_SAN_SPECS="memcheck:35:*Fp8PrefillSmallShapes* racecheck:50:*Fp8PrefillSmallShapes* memcheck:40:*SmallShapesEveryFormatEveryLayout*" \
  exec bash tools/device/final-s11.sh
