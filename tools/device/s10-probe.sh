#!/usr/bin/env bash
# NOTE: its ncu regex fp8_prefill_kernel matched mode 17, the default of that time (2a4546a); the default since a23ad0d also runs
# fp8_prefill_tma_kernel (use -k regex:fp8_prefill for both).
# tools/device/s10-probe.sh: the tenth session's first device call: hardware counters (Nsight Compute) and SASS of
# the FP8 prefill kernels (mode 17, gate_up and down) and of the MXFP4 decode kernels, from binaries of main built on
# the dev machine (.carry-probe/prebuilt.tar.xz: epx-gemm-bench, epx-gemm-mxfp4-bench, libepx if shared) with the
# deps of .carry/deps.tar.xz. Run: OUT=<dir> BUDGET=<s> bash tools/device/s10-probe.sh
set -uo pipefail
OUT="${OUT:-/tmp/probe-out}"; BUDGET="${BUDGET:-200}"
mkdir -p "$OUT/probe"; O="$OUT/probe"
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
cap() { local l; l=$(($(left) - 3)); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
say() { echo "$*" | tee -a "$O/summary.txt"; }
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=0
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
P=/tmp/probe-prebuilt; D=/tmp/probe-deps
rm -rf "$P" "$D" && mkdir -p "$P" "$D"
tar -C "$P" -xJf .carry-probe/prebuilt.tar.xz && tar -C "$D" -xJf .carry/deps.tar.xz
dl="$D/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$P:$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd "$P/epx-gemm-bench" "$P/epx-gemm-mxfp4-bench" >"$O/ldd.txt" 2>&1
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
CUOBJ="$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null | head -1)"
say "ncu=$NCU cuobjdump=$CUOBJ commit=$(cat .carry-probe/commit.txt 2>/dev/null)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,power.draw --format=csv >"$O/smi.txt" 2>&1
# 1. plain timing of the default prefill (sanity, same binary)
timeout -k 2 "$(cap 40)" "$P/epx-gemm-bench" --iters 10 --no-simt --prefill-only >"$O/bench-prefill.log" 2>&1
say "bench rc=$? at $((SECONDS - T0)) s"; grep -E "^(prefill|ceiling)" "$O/bench-prefill.log" | tee -a "$O/summary.txt"
# 2. ncu --set full on one gate_up and one down launch of mode 17 (ExpertMajor)
ncu_run() {  # ncu_run NAME LIMIT KERNEL-REGEX SKIP COUNT BIN ARGS...
  local name=$1 lim=$2 re=$3 skip=$4 cnt=$5; shift 5
  local b; b=$(cap "$lim"); [ "$b" -lt 15 ] && { say "$name skipped"; return; }
  timeout -k 3 "$b" "$NCU" --clock-control none --set full --import-source no -k "regex:$re" --launch-skip "$skip" \
    --launch-count "$cnt" -o "$O/$name" -f "$@" >"$O/$name.out" 2>"$O/$name.err"
  say "$name ncu rc=$? (limit $b) at $((SECONDS - T0)) s"
  [ -f "$O/$name.ncu-rep" ] || return
  timeout 30 "$NCU" -i "$O/$name.ncu-rep" --csv --page details >"$O/$name-details.csv" 2>>"$O/$name.err"
  timeout 30 "$NCU" -i "$O/$name.ncu-rep" --csv --page raw >"$O/$name-raw.csv" 2>>"$O/$name.err"
  timeout 40 "$NCU" -i "$O/$name.ncu-rep" --csv --page source --print-source sass >"$O/$name-source.csv" 2>>"$O/$name.err" \
    || say "$name: --page source failed"
  grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|Executed Ipc|Registers Per|Shared Memory" \
    "$O/$name-details.csv" | cut -c1-200 | tee -a "$O/summary.txt"
}
ncu_run prefill 110 fp8_prefill_kernel 2 2 "$P/epx-gemm-bench" --iters 1 --no-simt --no-cublas --prefill-only --no-flat
ncu_run mxfp4 50 mixed 2 2 "$P/epx-gemm-mxfp4-bench" --iters 1 --no-simt --cases decode
# 3. SASS of the prefill and mixed kernels
for f in "$P/epx-gemm-bench" "$P/epx-gemm-mxfp4-bench"; do
  [ -f "$f" ] || continue
  timeout 30 "$CUOBJ" -sass "$f" 2>/dev/null | awk '/Function :/{keep = ($0 ~ /fp8_prefill|mixed_gemm/)} keep' >>"$O/sass.txt"
done
say "sass lines: $(wc -l <"$O/sass.txt" 2>/dev/null) at $((SECONDS - T0)) s"
gzip -1 "$O"/*.csv "$O/sass.txt" 2>/dev/null
rm -f "$O"/*.ncu-rep.tmp
cd "$OUT" && tar -czf probe.tar.gz probe && rm -rf probe
