#!/usr/bin/env bash
# tools/device/tidy-s13-batch.sh: helper tidy's device batch (thirteenth session), run from the repository root as
#   OUT=<dir> BUDGET=<s> timeout -k 5 <s> bash .carry-tidy/batch.sh          (this file, copied)
# .carry-tidy/prebuilt.tar.xz, built on the dev machine for sm_90a from .carry-tidy/src.tar.xz (branch tidy-s13):
#   experts_cuda_test        the branch: every case's CPU reference built once and checked against every variant;
#                            the prefill TMA launchers' shared cluster config; the cluster count cached per device
#   experts_cuda_test-mut17  the same tests linked with a mutated experts_fp8_prefill_cuda.cu (mutation-mut17.patch
#                            in the results: mode 17 drops each item's last K block): the mutation check, must FAIL
#                            in mode 17's variant only
# Steps, in priority order, each within its limit and the budget:
#   whole   the whole experts_cuda_test (--gtest_brief=1; per-test times from --gtest_output=json, times.txt)
#   race    compute-sanitizer racecheck of ExpertsCuda.Fp8PrefillSmallShapes (the TMA kernels: the launcher change)
#   mem     compute-sanitizer memcheck of the same
#   mut     the mutant on Fp8TensorCoreRowCountsOneTo8192 and Fp8PrefillSmallShapesCpAsync (expected: FAILED, the
#           failures traced to "variant (prefill mode 17..." / "EPX_EXPERTS_FP8_PREFILL=17" only)
# Without a loadable prebuilt: experts_cuda_test built by tools/device/gpu-check.sh (no mutant then).
source tools/device/batch-lib.sh
batch_init /tmp/tidy-out 195
export CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0
: >"$OUT/summary.txt"
batch_prebuilt .carry-tidy
cp "$P/mutation-mut17.patch" "$OUT/" 2>/dev/null
ldd "$P/experts_cuda_test" >"$OUT/prebuilt-ldd.txt" 2>&1
if grep -q "not found" "$OUT/prebuilt-ldd.txt" || [ ! -x "$P/experts_cuda_test" ]; then
  say "prebuilt unusable (prebuilt-ldd.txt): building experts_cuda_test with gpu-check.sh"
  S=/tmp/s-tidy
  rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf .carry-tidy/src.tar.xz && cp .carry/deps.tar.xz "$S/.carry/"
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="experts_cuda_test" timeout -k 5 "$(cap 110)" bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
  say "build rc=$? at $((SECONDS - T0)) s"
  mkdir -p "$P" && cp /tmp/epx-gpu-check/build/experts_cuda_test "$P/" && rm -f "$P/experts_cuda_test-mut17"
  deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$deps:$deps/openblas-pthread:$LD_LIBRARY_PATH"
fi
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >"$OUT/smi.txt" 2>&1
say "cpus $(nproc), OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-unset}"

batch_gtest whole 120 ./experts_cuda_test --gtest_brief=1 --gtest_output=json:"$OUT/whole.json"
python3 - "$OUT/whole.json" >"$OUT/times.txt" 2>&1 <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for s in d["testsuites"]:
    for t in s["testsuite"]:
        print(f'{t["time"]:>9} {t.get("result", "")} {"FAILED " if t.get("failures") else ""}{s["name"]}.{t["name"]}')
print(f'{d["time"]:>9} total, {d["tests"]} tests, {d["failures"]} failures')
EOF
cat "$OUT/times.txt" >>"$OUT/summary.txt"
grep -hE '^\[  FAILED|Failure' "$OUT/whole.log" | head -20 >>"$OUT/summary.txt"
grep -hE '\[ clusters \]' "$OUT/whole.log" >>"$OUT/summary.txt"

SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
for tool in racecheck memcheck; do
  batch_gtest ${tool:0:4} 45 "$SAN" --tool $tool ./experts_cuda_test --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapes'
  grep -v 'Host Frame' "$OUT/${tool:0:4}.log" | head -200 >"$OUT/${tool:0:4}.t" && mv "$OUT/${tool:0:4}.t" "$OUT/${tool:0:4}.log"
done

if [ -x "$P/experts_cuda_test-mut17" ]; then
  batch_gtest mut 60 ./experts_cuda_test-mut17 --gtest_brief=1 \
    --gtest_filter='ExpertsCuda.Fp8PrefillSmallShapesCpAsync:ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192'
  say "mut: failure traces by variant: $(grep -oE 'variant \(prefill mode [0-9]+|variant \([a-z][^:]*|EPX_EXPERTS_FP8_PREFILL=[0-9]+' "$OUT/mut.log" | sort | uniq -c | tr '\n' ';')"
  grep -hE '^\[ rel_l2 \].*(mode 17|mode 8 )' "$OUT/mut.log" | head -12 >>"$OUT/summary.txt"
fi
say "done at $((SECONDS - T0)) s"
