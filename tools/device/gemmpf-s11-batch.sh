#!/usr/bin/env bash
# tools/device/gemmpf-s11-batch.sh: the prefill grouped-GEMM helper's device batches of the eleventh session (issue 6,
# FP8 prefill: batch 1 the Flat gate_up's token rows gathered by 1-row TMA boxes, Config::experts_fp8_prefill 28, removed
# after it; batch 2 the rows permuted into row-space order first, 29). Run from a copy of main
# that carries .carry/deps.tar.xz and .carry-gemmpf/{src,prebuilt}.tar.xz:
#   OUT=<dir> BUDGET=<s> timeout -k 5 <s> bash .carry-gemmpf/batch.sh
# prebuilt.tar.xz: experts_cuda_test and epx-gemm-bench built from src.tar.xz on the dev machine (CUDA 13.0, sm_90a);
# when they do not load here they are built with tools/device/gpu-check.sh instead.
# STEPS (space-separated, in order; default "bits ab small fp8", batch 2's; batch 1 ran "bits ab sass small racecheck
# memcheck" with MODES=28,27,17,10; batch 3 "ab ab2 ncuperm" with MODES=29,17 on batch 2's binaries):
#   bits      ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit (17, 10, 23, 27, 29 and the default against
#             mode 8, byte for byte, both layouts);
#   ab        epx-gemm-bench --prefill-only --prefill-modes $MODES (default 29,27,17) beside the default (1) on both
#             layouts, with the cuBLASLt loop and the dense ceiling (ITERS, default 10; p50); a hang in bits drops
#             $MODES; nvidia-smi samples the SM clock every 100 ms meanwhile (smi-ab.csv);
#   ab2       the same with $MODES2 (default 1,29,1: the default measured before and after 29, against order effects);
#   ncuperm   Nsight Compute (SpeedOfLight, MemoryWorkloadAnalysis) of permute_x_kernel, the TMA gate_up and down of one
#             Flat apply with EPX_EXPERTS_FP8_PREFILL=29;
#   sass      cuobjdump -sass of the TMA prefill kernels of the bench binary (the producer's per-row TMA issue);
#   small     ExpertsCuda.Fp8PrefillSmallShapes natively (1, 27 and 29 against the CPU, H 1024);
#   racecheck compute-sanitizer --tool racecheck of the same test;
#   memcheck  compute-sanitizer --tool memcheck of the same test;
#   ncu       Nsight Compute --set full (--clock-control none) of one Flat gate_up and down launch of mode $NCU_MODE
#             (default 29), with the per-instruction source page;
#   fp8       ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192 (against the CPU: the default, 17 and 29 among others);
#   rest      the other experts GPU tests but the MXFP4 ones (ExpertsCuda.*).
# Every step has its own timeout; budget BUDGET s (default 190). Writes $OUT/summary.txt first, small logs.
source tools/device/batch-lib.sh
batch_init /tmp/gemmpf-out 190
export CUDA_VISIBLE_DEVICES=0
STEPS="${STEPS:-bits ab small fp8}"
ITERS="${ITERS:-10}"
MODES="${MODES:-29,27,17}"
MODES2="${MODES2:-1,29,1}"
: >"$OUT/summary.txt"
say "gemmpf-s11-batch.sh: steps '$STEPS', modes '$MODES', iters $ITERS, budget $BUDGET s"
HERE="$(pwd)"
S=/tmp/s-gemmpf
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-gemmpf/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
B=""
if [ -f .carry-gemmpf/prebuilt.tar.xz ]; then
  batch_prebuilt .carry-gemmpf
  ldd "$P/epx-gemm-bench" "$P/experts_cuda_test" >"$OUT/prebuilt-ldd.txt" 2>&1
  grep -q "not found" "$OUT/prebuilt-ldd.txt" || B="$P"
  say "prebuilt: ${B:-unusable (see prebuilt-ldd.txt)} at $((SECONDS - T0)) s"
fi
if [ -z "$B" ]; then
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="experts_cuda_test epx_gemm_bench" \
    timeout -k 5 "$(cap 100)" bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
  say "build rc=$? at $((SECONDS - T0)) s"
  B=/tmp/epx-gpu-check/build
  P="$B"
  deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
  export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
commit="$(cat "$HERE/.carry-gemmpf/commit.txt" 2>/dev/null || echo unknown)"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
for step in $STEPS; do
  case $step in
    ab|ab2)  # ab2: a second A/B with $MODES2 (another order), into gemm-bench2.*
      b=$(cap 70)
      if [ "$b" -lt 15 ]; then say "$step skipped (no time)"; continue; fi
      n=gemm-bench; m="$MODES"
      [ $step = ab2 ] && n=gemm-bench2 && m="$MODES2"
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 100 >"$OUT/smi-$step.csv" 2>&1 &
      smi=$!
      GEMM_BENCH_COMMIT="$commit" timeout -k 2 "$b" "$B/epx-gemm-bench" --json "$OUT/$n.json" --iters "$ITERS" --no-simt \
        --prefill-only ${m:+--prefill-modes $m} >"$OUT/$n.log" 2>&1
      say "$n (modes '$m') rc=$? (limit $b s) at $((SECONDS - T0)) s"
      kill "$smi" 2>/dev/null
      grep -E "^(prefill|ceiling)" "$OUT/$n.log" | tee -a "$OUT/summary.txt"
      say "smi during $step: $(awk -F', ' 'NR > 1 && $2 + 0 > 0 {n++; c += $2} END {if (n) printf "%d samples, SM clock mean %.0f MHz", n, c / n}' "$OUT/smi-$step.csv")" ;;
    ncuperm)  # Nsight Compute (SpeedOfLight + memory sections) of one Flat apply of mode 29: permute_x_kernel, TMA gate_up, down
      b=$(cap 45)
      NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
      if [ "$b" -gt 15 ] && [ -n "$NCU" ]; then
        EPX_EXPERTS_FP8_PREFILL=29 timeout -k 3 "$b" "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
          -k regex:"permute_x|fp8_prefill_tma" --launch-skip 3 --launch-count 3 --csv --page details \
          "$B/epx-gemm-bench" --iters 1 --no-simt --no-cublas --prefill-only >"$OUT/ncuperm.csv" 2>"$OUT/ncuperm.err"
        say "ncuperm rc=$? (limit $b s) at $((SECONDS - T0)) s"
        grep -E "\"(Duration|DRAM Throughput|Memory Throughput|SM Frequency|Compute \(SM\) Throughput)\"" "$OUT/ncuperm.csv" |
          awk -F'","' '{print $5, "|", $13, $14, $15}' | cut -c1-170 | tee -a "$OUT/summary.txt"
      else
        say "ncuperm skipped (limit $b s, ncu '${NCU}')"
      fi ;;
    sass)
      CUOBJ="$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null | head -1)"
      if [ -n "$CUOBJ" ] && [ "$(cap 20)" -gt 8 ]; then
        timeout "$(cap 20)" "$CUOBJ" -sass "$B/epx-gemm-bench" 2>/dev/null |
          awk '/Function :/{keep = ($0 ~ /fp8_prefill_tma_kernel/)} keep' | gzip -1 >"$OUT/sass.txt.gz"
        say "sass: $(zcat "$OUT/sass.txt.gz" | wc -l) lines, $(zcat "$OUT/sass.txt.gz" | grep -c UTMALDG) UTMALDG at $((SECONDS - T0)) s"
      fi ;;
    bits)
      batch_gtest test-bits 35 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit'
      rc=$(grep -o "test-bits rc=[0-9]*" "$OUT/summary.txt" | tail -1 | cut -d= -f2)
      [ "${rc:-0}" -ge 124 ] && MODES=""  # a variant hung: the A/B measures the default only
      grep -E "^\[ bits \]|Failure" "$OUT/test-bits.log" | tee -a "$OUT/summary.txt" ;;
    small)
      batch_gtest test-small 25 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
      grep -E "^\[ rel_l2 \]|Failure" "$OUT/test-small.log" | tee -a "$OUT/summary.txt" ;;
    racecheck|memcheck)
      if [ -z "$SAN" ]; then say "$step skipped (no compute-sanitizer)"; continue; fi
      lim=45; [ $step = memcheck ] && lim=35
      batch_gtest "san-$step" $lim "$SAN" --tool $step ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
      grep -v "Host Frame" "$OUT/san-$step.log" | head -400 >"$OUT/san-$step.t" && mv "$OUT/san-$step.t" "$OUT/san-$step.log"
      grep -E "^\[ rel_l2 \]|ERROR SUMMARY|RACECHECK SUMMARY|Failure" "$OUT/san-$step.log" | tee -a "$OUT/summary.txt" ;;
    ncu)  # Nsight Compute --set full on one Flat gate_up and down launch of mode $NCU_MODE (default 29)
      b=$(cap 45)
      NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
      if [ "$b" -gt 20 ] && [ -n "$NCU" ]; then
        EPX_EXPERTS_FP8_PREFILL=${NCU_MODE:-29} timeout -k 3 "$b" "$NCU" --clock-control none --set full --import-source no \
          -k regex:fp8_prefill --launch-skip 2 --launch-count 2 -o "$OUT/ncu" -f \
          "$B/epx-gemm-bench" --iters 1 --no-simt --no-cublas --prefill-only >"$OUT/ncu.out" 2>"$OUT/ncu.err"
        say "ncu (mode ${NCU_MODE:-29}, Flat) rc=$? (limit $b s) at $((SECONDS - T0)) s"
        if [ -f "$OUT/ncu.ncu-rep" ]; then
          timeout 20 "$NCU" -i "$OUT/ncu.ncu-rep" --csv --page details >"$OUT/ncu-details.csv" 2>>"$OUT/ncu.err"
          timeout 20 "$NCU" -i "$OUT/ncu.ncu-rep" --csv --page raw >"$OUT/ncu-raw.csv" 2>>"$OUT/ncu.err"
          timeout 30 "$NCU" -i "$OUT/ncu.ncu-rep" --csv --page source --print-source sass >"$OUT/ncu-source.csv" 2>>"$OUT/ncu.err"
          grep -E "\"(Duration|SM Frequency|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Issue Slots Busy)\"" \
            "$OUT/ncu-details.csv" | awk -F'","' '{print $5, "|", $13, $15}' | cut -c1-160 | tee -a "$OUT/summary.txt"
          gzip -1 "$OUT"/ncu-*.csv
          rm -f "$OUT/ncu.ncu-rep"
        fi
      else
        say "ncu skipped (limit $b s, ncu '${NCU}')"
      fi ;;
    fp8)
      batch_gtest test-fp8 85 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192'
      grep -E "Failure|8192 rows|mode 29" "$OUT/test-fp8.log" | tee -a "$OUT/summary.txt" ;;
    rest)
      batch_gtest test-rest 45 ./experts_cuda_test \
        --gtest_filter='ExpertsCuda.*-ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192:ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit:ExpertsCuda.Mxfp4*'
      grep -E "^\[  FAILED|Failure" "$OUT/test-rest.log" | head -20 | tee -a "$OUT/summary.txt" ;;
  esac
done
echo "== summary"; cat "$OUT/summary.txt"
