#!/usr/bin/env bash
# tools/device/pair-s13-batch.sh: helper pair's device batch of the thirteenth session (issue 6, FP8 prefill on uneven
# experts: the default's 2-CTA clusters on the prefill section ordered for pairs, ScheduleParams::pair_big, against
# Config::experts_fp8_prefill 33 = the same kernels on the section in plain expert order). Run from a copy of main that
# carries .carry/deps.tar.xz and .carry-pair/{src,prebuilt}.tar.xz:
#   OUT=<dir> BUDGET=<s> timeout -k 5 <s> bash .carry-pair/batch.sh
# prebuilt.tar.xz: experts_cuda_test and epx-gemm-bench built from src.tar.xz on the dev machine (CUDA 13.0, sm_90a);
# when they do not load here they are built with tools/device/gpu-check.sh instead.
# Batch 1 (~09:15 UTC, a4ed39b): STEPS="bits small racecheck memcheck ab fp8" MODES=33,1 ROUNDS=12 FLAT=1, fp8 limit 90.
# Batch 2 (the defaults now): STEPS="ab fp8" MODES=33 ROUNDS=30 FLAT=0 (no Flat case: uniform there as well), fp8 limit 115;
# the paired analysis prints, round by round, the new order's time over mode 33's for each layout.
# STEPS (space-separated, in order):
#   bits      ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit (17, 10, 23, 27, 29, the default, 30, 31, 33 against
#             mode 8, byte for byte, ExpertMajor / Contiguous / Flat with odd tile counts); a hang (rc >= 124) ends the batch;
#   small     ExpertsCuda.Fp8PrefillSmallShapes natively (1, 27, 29, 30, 31, 33 against the CPU, H 1024);
#   racecheck compute-sanitizer --tool racecheck of the same test (the schedule kernels' shared memory included);
#   memcheck  compute-sanitizer --tool memcheck of the same test;
#   ab        epx-gemm-bench --prefill-only --no-simt --no-cublas --prefill-modes $MODES --rounds $ROUNDS (ITERS 10; FLAT=0
#             adds --no-flat): every row once, then the default's and each mode's Flat / ExpertMajor / Contiguous / uneven
#             Contiguous applies in interleaved rotated rounds (rows prefill-v3-rounds: median / min / max of the rounds'
#             p50); nvidia-smi samples the SM clock every 100 ms meanwhile (smi-ab.csv);
#   fp8       ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192 (against the CPU: the default among others).
# Every step has its own timeout; budget BUDGET s (default 170). Writes $OUT/summary.txt first, small logs.
source tools/device/batch-lib.sh
batch_init /tmp/pair-out 170
export CUDA_VISIBLE_DEVICES=0
STEPS="${STEPS:-ab fp8}"
ITERS="${ITERS:-10}"
ROUNDS="${ROUNDS:-30}"
MODES="${MODES:-33}"
FLAT="${FLAT:-0}"
FP8_LIMIT="${FP8_LIMIT:-115}"
: >"$OUT/summary.txt"
say "pair-s13-batch.sh: steps '$STEPS', modes '$MODES', rounds $ROUNDS, iters $ITERS, flat $FLAT, budget $BUDGET s"
HERE="$(pwd)"
S=/tmp/s-pair
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-pair/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
B=""
if [ -f .carry-pair/prebuilt.tar.xz ]; then
  batch_prebuilt .carry-pair
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
commit="$(cat "$HERE/.carry-pair/commit.txt" 2>/dev/null || echo unknown)"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
for step in $STEPS; do
  case $step in
    bits)
      batch_gtest test-bits 40 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit'
      rc=$(grep -o "test-bits rc=[0-9]*" "$OUT/summary.txt" | tail -1 | cut -d= -f2)
      say "bits: $(grep -c 'identical$' "$OUT/test-bits.log") identical, $(grep -c 'DIFFER$' "$OUT/test-bits.log") differ"
      grep -E "DIFFER|Failure" "$OUT/test-bits.log" | head -20 | tee -a "$OUT/summary.txt"
      if [ "${rc:-0}" -ge 124 ]; then say "a variant hung: the batch ends here"; break; fi ;;
    small)
      batch_gtest test-small 25 ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
      grep -E "^\[ rel_l2 \]|Failure" "$OUT/test-small.log" | tee -a "$OUT/summary.txt" ;;
    racecheck|memcheck)
      if [ -z "$SAN" ]; then say "$step skipped (no compute-sanitizer)"; continue; fi
      lim=40; [ $step = memcheck ] && lim=30
      batch_gtest "san-$step" $lim "$SAN" --tool $step ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
      grep -v "Host Frame" "$OUT/san-$step.log" | head -400 >"$OUT/san-$step.t" && mv "$OUT/san-$step.t" "$OUT/san-$step.log"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Failure" "$OUT/san-$step.log" | tee -a "$OUT/summary.txt" ;;
    ab)
      b=$(cap 100)
      if [ "$b" -lt 20 ]; then say "$step skipped (no time)"; continue; fi
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 100 >"$OUT/smi-ab.csv" 2>&1 &
      smi=$!
      GEMM_BENCH_COMMIT="$commit" timeout -k 2 "$b" "$B/epx-gemm-bench" --json "$OUT/gemm-bench.json" --iters "$ITERS" --no-simt \
        --no-cublas --prefill-only --prefill-modes "$MODES" --rounds "$ROUNDS" $([ "$FLAT" = 0 ] && echo --no-flat) \
        >"$OUT/gemm-bench.log" 2>&1
      say "gemm-bench (modes '$MODES', rounds $ROUNDS) rc=$? (limit $b s) at $((SECONDS - T0)) s"
      kill "$smi" 2>/dev/null
      grep -E "^(prefill|ceiling|mode)" "$OUT/gemm-bench.log" | tee -a "$OUT/summary.txt"
      python3 - "$OUT/gemm-bench.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics, sys
rows = {r["layout"]: r["round_p50_us"] for r in json.load(open(sys.argv[1]))["results"] if r.get("case") == "prefill-v3-rounds"}
for a in sorted(rows):
    if "-mode" in a:
        continue
    for b in sorted(rows):
        if b.startswith(a + "-mode"):
            q = [x / y for x, y in zip(rows[a], rows[b])]
            print("paired %s / %s over %d rounds: median %.4f, min %.4f, max %.4f, below 1 in %d" % (
                a, b, len(q), statistics.median(q), min(q), max(q), sum(v < 1 for v in q)))
PY
      say "smi during ab: $(awk -F', ' 'NR > 1 && $2 + 0 > 0 {n++; c += $2} END {if (n) printf "%d samples, SM clock mean %.0f MHz", n, c / n}' "$OUT/smi-ab.csv")" ;;
    fp8)
      batch_gtest test-fp8 "$FP8_LIMIT" ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192'
      grep -E "Failure|8192 rows" "$OUT/test-fp8.log" | head -30 | tee -a "$OUT/summary.txt" ;;
  esac
done
echo "== summary"; cat "$OUT/summary.txt"
