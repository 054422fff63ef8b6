#!/usr/bin/env bash
# tools/device/llbench-batch.sh: the llbench helper's part of a shared device batch (sixth session; copied to
# .carry-llbench/batch.sh). Run from a copy of the main checkout that holds .carry/deps.tar.xz and
# .carry-llbench/src.tar.xz:   OUT=<dir> timeout -k 5 110 bash .carry-llbench/batch.sh
# Each step under its own time limit so that everything fits LLB_BUDGET_S seconds (default 105):
#   1. build epx + ll_cuda_test through gpu-check.sh (GPU_CHECK_TARGETS; no tests there)
#   2. where CUPTI is on this machine (printed; the build takes FindCUDAToolkit's CUDA::cupti)
#   3. epx bench --kernel-time on: ll-v3 ll + nccl_a2a_raw as graph replays (200 iterations), then (LLB_MODE=1,
#      batch 1) ht-v3 ht + nccl_a2a_raw eager, or (LLB_MODE=2, default, batch 2) ll-v3 ht + nccl_a2a_raw eager
#      (the eager NCCL kernels, launched by NCCL's thread); every row carries the CUPTI kernel time beside the
#      CUDA-event figure
#   4. tools/device/sanitize-dispatch.sh SAN_ONLY=ll SAN_BUILD=0 with what is left (LLB_SAN_STEPS: its steps;
#      default in mode 2: the two-rank ll test under memcheck, then racecheck)
set -uo pipefail
T0=$SECONDS
BUDGET=${LLB_BUDGET_S:-105}
OUT=${OUT:-/tmp/llbench-out}
mkdir -p "$OUT"
ROOT=$(pwd)
S=/tmp/s-llbench
rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf "$ROOT/.carry-llbench/src.tar.xz" && cp "$ROOT/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN
COMMIT=$(cat "$ROOT/.carry-llbench/commit.txt" 2>/dev/null || echo unknown)

left() { echo $((BUDGET - (SECONDS - T0))); }
step() {  # step <name> <limit_s> <command...>: logged to $OUT/<name>.log, cut to the time left
  local name=$1 lim=$2
  shift 2
  local l
  l=$(left)
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 6 ]; then echo "== skipped $name (no time left)" | tee -a "$OUT/batch.log"; return; fi
  local t=$SECONDS
  timeout -k 2 "$lim" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t)) s (limit $lim, at +$((SECONDS - T0)) s)" | tee -a "$OUT/batch.log"
}

{
  echo "== CUPTI on this machine"
  ls -l /usr/local/cuda/lib64/libcupti* /usr/local/cuda/extras/CUPTI/lib64/libcupti* /usr/local/cuda/include/cupti.h \
    /usr/local/cuda/extras/CUPTI/include/cupti.h 2>&1
  py=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null)
  echo "python nvidia dir: $py"
  ls -d "$py"/cuda_cupti* "$py"/cu13/lib/libcupti* "$py"/cu13/include/cupti.h 2>&1 | head
  readlink -f /usr/local/cuda
} >"$OUT/cupti-where.log" 2>&1

mkdir -p "$OUT/gpu-check"
step build 70 env OUT="$OUT/gpu-check" GPU_CHECK_SRC="$S" GPU_CHECK_TARGETS="epx ll_cuda_test" GPU_CHECK_TESTS=0 GPU_CHECK_ONE_GPU=0 \
  GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 bash "$S/tools/device/gpu-check.sh" run
grep -E "epx: (CUPTI|no CUPTI)" "$OUT/gpu-check/configure.log" "$OUT/gpu-check/build.log" 2>/dev/null | head -3 | tee -a "$OUT/batch.log"
grep -E "error|FAILED" "$OUT/gpu-check/build.log" | head -20
B=/tmp/epx-gpu-check/build
NCCL=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
ARCH=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$NCCL/lib:$ARCH:$ARCH/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd "$B/epx" 2>/dev/null | grep -i cupti | tee -a "$OUT/batch.log"
cd "$S" || exit 1

step ll-v3-graph 16 "$B/epx" bench --case ll-v3 --backend ll,nccl_a2a_raw --ranks 2 --graph --iters 200 --warmup 20 --kernel-time on \
  --json "$OUT/ll-v3-graph-kt.json"
if [ "${LLB_MODE:-2}" = 1 ]; then
  step ht-v3 16 "$B/epx" bench --case ht-v3 --backend ht,nccl_a2a_raw --ranks 2 --iters 30 --warmup 5 --kernel-time on \
    --json "$OUT/ht-v3-kt.json"
  steps=${LLB_SAN_STEPS:-}
else
  step ll-v3-eager 10 "$B/epx" bench --case ll-v3 --backend ht,nccl_a2a_raw --ranks 2 --iters 50 --warmup 5 --kernel-time on \
    --json "$OUT/ll-v3-eager-kt.json"
  steps=${LLB_SAN_STEPS:-memcheck-ll-test racecheck-ll-test}
fi
san=$(( $(left) - 2 ))
step sanitize "$san" env OUT="$OUT" SAN_ONLY=ll SAN_BUILD=0 SAN_STEPS="$steps" SAN_LL_TEST_FILTER="${LLB_SAN_TEST_FILTER:-LlCuda.GraphsWithDeviceTokenCountTwoRanks}" \
  bash "$S/tools/device/sanitize-dispatch.sh" "$(( san - 2 ))"

echo "== summary (+$((SECONDS - T0)) s, tree $COMMIT)"
cat "$OUT/cupti-where.log" | head -12
[ -f "$OUT/sanitize-summary.txt" ] && cat "$OUT/sanitize-summary.txt"
for f in "$OUT"/*-kt.json; do
  [ -f "$f" ] || continue
  python3 - "$f" <<'PY'
import json, os, sys
d = json.load(open(sys.argv[1]))
def f(v, n=1):
    return "-" if v is None else f"{v:.{n}f}"
for r in d["results"]:
    if r.get("status") not in ("ran", "FAIL"):
        print(f"{os.path.basename(sys.argv[1])}: {r['backend']} {r['op']}: {r.get('status')} {r.get('message', '')[:120]}")
        continue
    t1 = " T=1" if r.get("tokens_per_rank") == 1 and r["case"].startswith("ll") else ""
    print(f"{os.path.basename(sys.argv[1])}: {r['backend']}{t1} {r['op']} {r['dispatch_dtype']}: events p50 {f(r['latency_us_p50'])} us | "
          f"kernel p50 {f(r.get('kernel_us_p50'))} p90 {f(r.get('kernel_us_p90'))} mean {f(r.get('kernel_us_mean'))} span {f(r.get('kernel_span_us_p50'))} "
          f"| events in CUPTI rounds {f(r.get('latency_us_p50_cupti_rounds'))} | {r.get('kernel_time')} | {r.get('kernels')}")
PY
done
