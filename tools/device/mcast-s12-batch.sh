#!/usr/bin/env bash
# tools/device/mcast-s12-batch.sh: the weight-multicast helper's device batches of the twelfth session (issue 6, FP8
# prefill: Config::experts_fp8_prefill 30 = 29's kernels as 2-CTA clusters sharing the weight tile by TMA multicast,
# 31 = the same clusters without the multicast, 32 = 30's clusters for the gate_up only). Run from a copy of main that carries .carry/deps.tar.xz and
# .carry-mcast/{src,prebuilt}.tar.xz:
#   OUT=<dir> BUDGET=<s> timeout -k 5 <s> bash .carry-mcast/batch.sh
# prebuilt.tar.xz: experts_cuda_test and epx-gemm-bench built from src.tar.xz on the dev machine (CUDA 13.0, sm_90a);
# when they do not load here they are built with tools/device/gpu-check.sh instead.
# STEPS (space-separated, in order; default "bits small racecheck memcheck ab fp8 ncu"):
#   bits      ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit (17, 10, 23, 27, 29, the default, 30, 31, 32 against
#             mode 8, byte for byte, both layouts); a hang (rc >= 124) ends the batch (every later step runs 30 too);
#   small     ExpertsCuda.Fp8PrefillSmallShapes natively (1, 27, 29, 30, 31 against the CPU, H 1024);
#   racecheck compute-sanitizer --tool racecheck of the same test;
#   memcheck  compute-sanitizer --tool memcheck of the same test;
#   ab        epx-gemm-bench --prefill-only --prefill-modes $MODES (default 30,31,32,30,1: with the default's own row
#             first, the order A B C D B A) on both layouts, with the cuBLASLt loop and the dense ceiling (ITERS, default 10; p50);
#             nvidia-smi samples the SM clock every 100 ms meanwhile (smi-ab.csv);
#   fp8       ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192 (against the CPU: the default, 29, 30 among others);
#   ncu       Nsight Compute (--clock-control none; duration, SM clock, tensor pipe active, lts__throughput, L2 -> SM
#             bytes, DRAM bytes) of one ExpertMajor gate_up and down launch of mode 30, then of the default.
# Every step has its own timeout; budget BUDGET s (default 195). Writes $OUT/summary.txt first, small logs.
source tools/device/batch-lib.sh
batch_init /tmp/mcast-out 195
export CUDA_VISIBLE_DEVICES=0
STEPS="${STEPS:-bits small racecheck memcheck ab fp8 ncu}"
ITERS="${ITERS:-10}"
MODES="${MODES:-30,31,32,30,1}"
: >"$OUT/summary.txt"
say "mcast-s12-batch.sh: steps '$STEPS', modes '$MODES', iters $ITERS, budget $BUDGET s"
HERE="$(pwd)"
S=/tmp/s-mcast
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-mcast/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
B=""
if [ -f .carry-mcast/prebuilt.tar.xz ]; then
  batch_prebuilt .carry-mcast
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
commit="$(cat "$HERE/.carry-mcast/commit.txt" 2>/dev/null || echo unknown)"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
NCU_METRICS="gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed"
NCU_METRICS+=",sm__pipe_tensor_type_hmma_hgmma_qgmma_imma_igmma_bmma_bgmma_cycles_active.avg.pct_of_peak_sustained_elapsed"
NCU_METRICS+=",lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum,dram__bytes_read.sum"
for step in $STEPS; do
  case $step in
    bits)
      batch_gtest test-bits 35 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit'
      rc=$(grep -o "test-bits rc=[0-9]*" "$OUT/summary.txt" | tail -1 | cut -d= -f2)
      grep -E "^\[ bits \]|Failure" "$OUT/test-bits.log" | tee -a "$OUT/summary.txt"
      if [ "${rc:-0}" -ge 124 ]; then say "a variant hung: the batch ends here"; break; fi ;;
    small)
      batch_gtest test-small 25 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
      grep -E "^\[ rel_l2 \]|Failure" "$OUT/test-small.log" | tee -a "$OUT/summary.txt" ;;
    racecheck|memcheck)
      if [ -z "$SAN" ]; then say "$step skipped (no compute-sanitizer)"; continue; fi
      lim=40; [ $step = memcheck ] && lim=30
      batch_gtest "san-$step" $lim "$SAN" --tool $step ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
      grep -v "Host Frame" "$OUT/san-$step.log" | head -400 >"$OUT/san-$step.t" && mv "$OUT/san-$step.t" "$OUT/san-$step.log"
      grep -E "^\[ rel_l2 \]|ERROR SUMMARY|RACECHECK SUMMARY|Failure" "$OUT/san-$step.log" | tee -a "$OUT/summary.txt" ;;
    ab)
      b=$(cap 85)
      if [ "$b" -lt 15 ]; then say "$step skipped (no time)"; continue; fi
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 100 >"$OUT/smi-ab.csv" 2>&1 &
      smi=$!
      GEMM_BENCH_COMMIT="$commit" timeout -k 2 "$b" "$B/epx-gemm-bench" --json "$OUT/gemm-bench.json" --iters "$ITERS" --no-simt \
        --prefill-only ${MODES:+--prefill-modes $MODES} >"$OUT/gemm-bench.log" 2>&1
      say "gemm-bench (modes '$MODES') rc=$? (limit $b s) at $((SECONDS - T0)) s"
      kill "$smi" 2>/dev/null
      grep -E "^(prefill|ceiling|mode)" "$OUT/gemm-bench.log" | tee -a "$OUT/summary.txt"
      say "smi during ab: $(awk -F', ' 'NR > 1 && $2 + 0 > 0 {n++; c += $2} END {if (n) printf "%d samples, SM clock mean %.0f MHz", n, c / n}' "$OUT/smi-ab.csv")" ;;
    fp8)
      batch_gtest test-fp8 85 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192'
      grep -E "Failure|8192 rows|mode 30" "$OUT/test-fp8.log" | tee -a "$OUT/summary.txt" ;;
    ncu)  # the default's and mode 30's ExpertMajor gate_up + down (the bench's first apply after the warm-up ones)
      for m in 30 1; do  # mode 30 first: the default has the tenth session's figures if this one is cut
        b=$(cap 40)
        if [ "$b" -lt 20 ] || [ -z "$NCU" ]; then say "ncu $m skipped (limit $b s, ncu '${NCU}')"; continue; fi
        EPX_EXPERTS_FP8_PREFILL=$m timeout -k 3 "$b" "$NCU" --clock-control none --metrics "$NCU_METRICS" \
          -k regex:fp8_prefill_tma --launch-skip 2 --launch-count 2 --csv --page raw \
          "$B/epx-gemm-bench" --iters 1 --no-simt --no-cublas --prefill-only --no-flat >"$OUT/ncu-$m.csv" 2>"$OUT/ncu-$m.err"
        say "ncu mode $m rc=$? (limit $b s) at $((SECONDS - T0)) s"
        python3 - "$OUT/ncu-$m.csv" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
hdr = next((r for r in rows if "Kernel Name" in r and "ID" in r), None)
if hdr is None:
    print("  (no ncu rows)"); sys.exit(0)
kn, idc = hdr.index("Kernel Name"), hdr.index("ID")
keys = ("gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second", "qgmma_imma_igmma_bmma_bgmma_cycles_active.avg",
        "lts__throughput.avg", "l1tex__m_xbar2l1tex_read_bytes.sum", "dram__bytes_read.sum", "launch__cluster_size")
want = [c for c in hdr if any(c.startswith(k) or (k in c and c.endswith("elapsed")) for k in keys)]
for r in rows[rows.index(hdr) + 1:]:
    if len(r) != len(hdr) or not r[idc].strip().isdigit():
        continue
    k = r[kn]
    k = k[k.find("fp8_prefill_tma_kernel"):][:46]
    print("  " + k + " | " + "; ".join(c + "=" + r[hdr.index(c)] for c in want))
PY
      done ;;
  esac
done
echo "== summary"; cat "$OUT/summary.txt"
