#!/usr/bin/env bash
# tools/device/gemmpf-batch.sh: the prefill grouped-GEMM helper's device batch (issue 6, FP8 prefill
# kernels). Run from a copy of main that carries .carry/deps.tar.xz and .carry-gemmpf/{src,prebuilt}.tar.xz:
#   OUT=<dir> timeout -k 5 <allowance ~110 s> bash .carry-gemmpf/batch.sh
# prebuilt.tar.xz holds experts_cuda_test and epx-gemm-bench built from src.tar.xz on the dev machine
# (CUDA 13.0, sm_90a); when they do not load here (ldd / --gtest_list_tests), they are built with
# tools/device/gpu-check.sh instead.
# STEPS (space-separated, in order; default "bits ab fp8 rest"; a hang in bits drops $MODES from ab):
#   stamps  epx-gemm-bench --stamps $STAMP_FLAGS on ExpertMajor (mode 17 stamped, and its ablations);
#   stages  the same (flags 0) with EPX_EXPERTS_FP8_PREFILL_STAGES=3 and =2 (ring depth);
#   ab      the A/B bench of $MODES (default none: the default alone) against the default (17) on both layouts, with the cuBLASLt
#           loop unless AB_EXTRA=--no-cublas (ITERS, default 10);
#   old     the default rows of epx-gemm-bench-old (prebuilt.tar.xz: the previous batch's binary, its commit
#           in old-commit.txt) in the same run;
#   torch   bench/gemm_torch.py (torch._scaled_grouped_mm, the same shapes);
#   bits    ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit (17, 10 against mode 8);
#   fp8     ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192 (against the CPU); rest: the other experts GPU tests;
#   ncu     Nsight Compute (--clock-control none) on one gate_up and one down launch of the default kernels.
# Every step has its own timeout; budget BUDGET s (default 96).
set -uo pipefail
OUT="${OUT:-/tmp/gemmpf-out}"
BUDGET="${BUDGET:-96}"
STEPS="${STEPS:-bits ab fp8 rest}"
STAMP_FLAGS="${STAMP_FLAGS:-0,1,8,4}"
ITERS="${ITERS:-10}"
mkdir -p "$OUT"
HERE="$(pwd)"
S=/tmp/s-gemmpf
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-gemmpf/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
B=""
P=/tmp/gemmpf-prebuilt
D=/tmp/gemmpf-deps
if [ -f "$HERE/.carry-gemmpf/prebuilt.tar.xz" ]; then
  rm -rf "$P" "$D" && mkdir -p "$P" "$D"
  tar -C "$P" -xJf "$HERE/.carry-gemmpf/prebuilt.tar.xz" && tar -C "$D" -xJf "$HERE/.carry/deps.tar.xz"
  dl="$D/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  ldd "$P/epx-gemm-bench" >"$OUT/prebuilt-ldd.txt" 2>&1
  [ -x "$P/experts_cuda_test" ] && ldd "$P/experts_cuda_test" >>"$OUT/prebuilt-ldd.txt" 2>&1
  if ! grep -q "not found" "$OUT/prebuilt-ldd.txt"; then B="$P"; fi
  say "prebuilt: ${B:-unusable (see prebuilt-ldd.txt)} at $((SECONDS - T0)) s"
fi
if [ -z "$B" ]; then
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="experts_cuda_test epx_gemm_bench" \
    timeout -k 5 80 bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
  say "build rc=$? at $((SECONDS - T0)) s"
  B=/tmp/epx-gpu-check/build
  deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export CUDA_VISIBLE_DEVICES=0
MODES="${MODES:-}"
AB_EXTRA="${AB_EXTRA:-}"
commit="$(cat "$HERE/.carry-gemmpf/commit.txt" 2>/dev/null || echo unknown)"
bench() {  # bench NAME LIMIT ARGS...: epx-gemm-bench into $OUT/NAME.{json,log}
  local name=$1 lim=$2
  shift 2
  local b=$(( $(left) - 2 )); [ $b -gt $lim ] && b=$lim
  if [ $b -lt 8 ]; then say "$name skipped (no time)"; return; fi
  GEMM_BENCH_COMMIT="$commit" timeout -k 2 $b "$B/epx-gemm-bench" --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  say "$name rc=$? (limit $b s) at $((SECONDS - T0)) s"
  grep -E "^(prefill|ceiling|stamps)" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
for step in $STEPS; do
  case $step in
    stamps)
      mkdir -p "$OUT/raw"
      GEMM_BENCH_STAMPS_RAW="$OUT/raw" bench stamps 40 --iters "$ITERS" --no-simt --no-cublas --prefill-only --no-flat --stamps "$STAMP_FLAGS"
      gzip -1 "$OUT"/raw/*.u32 2>/dev/null ;;
    stages)
      for st in 3 2; do
        mkdir -p "$OUT/raw-stages$st"
        GEMM_BENCH_STAMPS_RAW="$OUT/raw-stages$st" EPX_EXPERTS_FP8_PREFILL_STAGES=$st \
          bench "stamps-stages$st" 15 --iters "$ITERS" --no-simt --no-cublas --prefill-only --no-flat --stamps 0
        gzip -1 "$OUT/raw-stages$st"/*.u32 2>/dev/null
      done ;;
    ab) bench gemm-bench 45 --iters "$ITERS" --no-simt --prefill-only $AB_EXTRA ${MODES:+--prefill-modes $MODES} ;;
    old)
      b=$(( $(left) - 2 )); [ $b -gt 20 ] && b=20
      if [ -x "$B/epx-gemm-bench-old" ] && [ $b -gt 8 ]; then
        GEMM_BENCH_COMMIT="$(cat "$B/old-commit.txt" 2>/dev/null || echo unknown)" timeout -k 2 $b "$B/epx-gemm-bench-old" \
          --iters "$ITERS" --no-simt --no-cublas --prefill-only --json "$OUT/gemm-bench-old.json" >"$OUT/gemm-bench-old.log" 2>&1
        say "gemm-bench-old rc=$? (limit $b s) at $((SECONDS - T0)) s"
        grep -E "^(prefill|ceiling)" "$OUT/gemm-bench-old.log" | tee -a "$OUT/summary.txt"
      fi ;;
    torch)
      b=$(( $(left) - 2 )); [ $b -gt 15 ] && b=15
      if [ $b -gt 8 ]; then
        timeout -k 2 $b python3 "$S/bench/gemm_torch.py" --iters "$ITERS" --json "$OUT/gemm-torch.json" >"$OUT/gemm-torch.log" 2>&1
        say "gemm-torch rc=$? (limit $b s) at $((SECONDS - T0)) s"
        tail -3 "$OUT/gemm-torch.log" | tee -a "$OUT/summary.txt"
      fi ;;
    bits|fp8|rest)
      case $step in
        bits) f='ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit'; lim=20 ;;
        fp8) f='ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192'; lim=55 ;;
        rest) f='-ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192:ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit'; lim=40 ;;
      esac
      b=$(( $(left) - 1 )); [ $b -gt $lim ] && b=$lim
      if [ $b -gt 4 ] && [ -x "$B/experts_cuda_test" ]; then
        (cd "$B" && timeout -k 1 $b ./experts_cuda_test --gtest_filter="$f") >"$OUT/test-$step.log" 2>&1
        trc=$?
        say "test $step rc=$trc (limit $b s) at $((SECONDS - T0)) s"
        [ "$step" = bits ] && [ $trc -ge 124 ] && MODES=""  # a variant hung: the A/B measures the default only
        grep -E "^\[ bits \]|^\[  FAILED|^\[  PASSED|Failure|own epilogues" "$OUT/test-$step.log" | tee -a "$OUT/summary.txt"
      fi ;;
    ncu)
      b=$(( $(left) - 2 )); [ $b -gt 40 ] && b=40
      NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
      if [ $b -gt 10 ] && [ -n "$NCU" ]; then
        timeout -k 2 $b "$NCU" --clock-control none -k regex:fp8_prefill_kernel --launch-skip 4 --launch-count 2 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
          --section LaunchStats --section Occupancy --section WarpStateStats -o "$OUT/prefill" -f \
          "$B/epx-gemm-bench" --iters 1 --no-simt --no-cublas --prefill-only --no-flat >"$OUT/ncu.out" 2>"$OUT/ncu.err"
        say "ncu rc=$? (limit $b s, $NCU) at $((SECONDS - T0)) s"
        timeout 10 "$NCU" -i "$OUT/prefill.ncu-rep" --csv --page details >"$OUT/ncu.csv" 2>>"$OUT/ncu.err"
        timeout 10 "$NCU" -i "$OUT/prefill.ncu-rep" --csv --page raw >"$OUT/ncu-raw.csv" 2>>"$OUT/ncu.err"
        grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Issue Slots Busy|Executed Ipc" "$OUT/ncu.csv" | cut -c1-220 | tee -a "$OUT/summary.txt"
        tail -3 "$OUT/ncu.err" >>"$OUT/summary.txt"
      else
        say "ncu skipped (limit $b s, ncu '${NCU}')"
      fi ;;
  esac
done
echo "== summary"; cat "$OUT/summary.txt"
