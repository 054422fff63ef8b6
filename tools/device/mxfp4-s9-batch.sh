#!/usr/bin/env bash
# tools/device/mxfp4-s9-batch.sh: the MXFP4 helper's device batch of the ninth session (issue 6: the
# fragment-layout / register-A MXFP4 kernels; the sharded FHMoE gate sweep). Run from a copy of main that
# carries .carry/deps.tar.xz and .carry-mxfp4/{src,prebuilt}.tar.xz:
#   OUT=<dir> timeout -k 5 <allowance> bash .carry-mxfp4/batch.sh
# prebuilt.tar.xz (built on the dev machine for sm_90a, CUDA 13.0): experts_cuda_test, epx-gemm-mxfp4-bench
# and epx (this branch, B), epx-gemm-mxfp4-bench-old (main, A; its commit in old-commit.txt).
# STEPS (in order; default "bits ab stamps abpf ab2 layer"):
#   bits   experts_cuda_test: the MXFP4 / mixed tests against the CPU (small shapes first);
#   ab     decode (192 experts x 8 and x 32 rows), A then B, ITERS calls each (p50 per run; the file name says
#          A or B); ab2 a second round; abpf prefill (4096 tokens top-6, Flat) A then B;
#   layer  FHMoE on DeepSeek-V4-Pro through the layer (epx moe --compare, 2 GPUs, ll), if >= LAYER_MIN_S left;
#   stamps the B kernels' per-phase cycles (--stamps: modes 1, 2);
#   gate   the sharded FHMoE gate sweep on 2 GPUs (bench/results/h200x2/README.md "FHMoE on the sharded
#          backends", --steps GATE_STEPS, default 50) with B's epx, naive then allgather_reducescatter.
# Every step has its own timeout inside BUDGET seconds (default 95).
set -uo pipefail
OUT="${OUT:-/tmp/mxfp4-out}"
BUDGET="${BUDGET:-105}"
STEPS="${STEPS:-bits ab stamps abpf ab2 layer}"
ITERS="${ITERS:-20}"
GATE_STEPS="${GATE_STEPS:-50}"
GATE_BACKENDS="${GATE_BACKENDS:-naive allgather_reducescatter}"
mkdir -p "$OUT"
HERE="$(pwd)"
S=/tmp/s-mxfp4
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
cap() { local l; l=$(($(left) - 2)); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
rm -rf "$S" && mkdir -p "$S/.carry"
tar -C "$S" -xJf "$HERE/.carry-mxfp4/src.tar.xz"
cp "$HERE/.carry/deps.tar.xz" "$S/.carry/"
export NCCL_NVLS_ENABLE=0
nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
P=/tmp/mxfp4-prebuilt
D=/tmp/mxfp4-deps
rm -rf "$P" "$D" && mkdir -p "$P" "$D"
B=""
if [ -f "$HERE/.carry-mxfp4/prebuilt.tar.xz" ]; then
  tar -C "$P" -xJf "$HERE/.carry-mxfp4/prebuilt.tar.xz" && tar -C "$D" -xJf "$HERE/.carry/deps.tar.xz"
  dl="$D/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/extras/CUPTI/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  ldd "$P/epx-gemm-mxfp4-bench" "$P/experts_cuda_test" >"$OUT/prebuilt-ldd.txt" 2>&1
  grep -q "not found" "$OUT/prebuilt-ldd.txt" || B="$P"
  ldd "$P/epx" >"$OUT/prebuilt-ldd-epx.txt" 2>&1
fi
if [ -z "$B" ]; then
  say "no usable prebuilt B; building it with gpu-check.sh (targets: ${BUILD_TARGETS:=experts_cuda_test epx_gemm_mxfp4_bench})"
  GPU_CHECK_SRC="$S" GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 GPU_CHECK_TESTS=0 \
    GPU_CHECK_TARGETS="$BUILD_TARGETS" GPU_CHECK_FILTER='^no_test_matches_this$' \
    timeout -k 5 "$(cap 70)" bash "$S/tools/device/gpu-check.sh" run >"$OUT/gpu-check.out" 2>&1
  say "build rc=$? at $((SECONDS - T0)) s"
  grep -E "error|FAILED" "$OUT/build.log" 2>/dev/null | head -20 >"$OUT/build-errors.txt"
  B=/tmp/epx-gpu-check/build
  deps=/tmp/epx-gpu-check/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH="$nccl/lib:$deps:$deps/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
say "binaries: $B at $((SECONDS - T0)) s"
commit="$(cat "$HERE/.carry-mxfp4/commit.txt" 2>/dev/null || echo unknown)"
old_commit="$(cat "$P/old-commit.txt" 2>/dev/null || echo main)"
hung=0
bench() {  # bench BIN NAME LIMIT COMMIT ARGS...: one GPU, into $OUT/NAME.{json,log}
  local bin=$1 name=$2 lim=$3 c=$4
  shift 4
  [ -x "$bin" ] || { say "$name: no binary $bin"; return; }
  local b; b=$(cap "$lim")
  if [ "$b" -lt 8 ] || [ "$hung" = 1 ]; then say "$name skipped"; return; fi
  CUDA_VISIBLE_DEVICES=0 GEMM_BENCH_COMMIT="$c" timeout -k 2 "$b" "$bin" --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  say "$name rc=$rc (limit $b s) at $((SECONDS - T0)) s"
  [ "$rc" -ge 124 ] && hung=1
  grep -E "^(decode|prefill|stamps)" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
for step in $STEPS; do
  case $step in
    bits)
      t1=$SECONDS
      (cd "$B" && CUDA_VISIBLE_DEVICES=0 timeout -k 3 "$(cap 12)" ./experts_cuda_test \
         --gtest_filter='*Mxfp4FragmentLayout*:*SmallShapesEveryFormat*:*Mxfp4TensorCoreWideScaleSpread*') >"$OUT/gpu-tests-small.log" 2>&1
      rc=$?; say "experts_cuda_test (small) rc=$rc in $((SECONDS - t1)) s"
      [ "$rc" -ge 124 ] && hung=1
      if [ "$hung" = 0 ]; then
        t1=$SECONDS
        (cd "$B" && CUDA_VISIBLE_DEVICES=0 timeout -k 3 "$(cap 35)" ./experts_cuda_test \
           --gtest_filter='*Mxfp4*:*DeepSeekV4Pro*:*MixedFormats*:*GraphCapture*-*Mxfp4FragmentLayout*:*WideScaleSpread*') >"$OUT/gpu-tests.log" 2>&1
        rc=$?; say "experts_cuda_test (mxfp4 filter) rc=$rc in $((SECONDS - t1)) s"
        [ "$rc" -ge 124 ] && hung=1
      fi
      grep -hE "^\[  (FAILED|PASSED) |^\[       OK|^\[  FAILED|rel_l2|Failure" "$OUT"/gpu-tests*.log | tail -40 >>"$OUT/summary.txt" ;;
    ab | ab2)  # decode A then B (ab2: a second round in the same run)
      r=1; [ "$step" = ab2 ] && r=2
      bench "$P/epx-gemm-mxfp4-bench-old" "ab-A$r" 20 "$old_commit" --iters "$ITERS" --no-simt --cases decode
      bench "$B/epx-gemm-mxfp4-bench" "ab-B$r" 20 "$commit" --iters "$ITERS" --no-simt --cases decode ;;
    abpf)  # prefill (4096 tokens top-6, Flat) A then B
      bench "$P/epx-gemm-mxfp4-bench-old" "ab-A-prefill" 20 "$old_commit" --iters 10 --no-simt --cases prefill
      bench "$B/epx-gemm-mxfp4-bench" "ab-B-prefill" 20 "$commit" --iters 10 --no-simt --cases prefill ;;
    layer)  # FHMoE on DeepSeek-V4-Pro through the layer (EP2, ll FP8 dispatch, 128 tokens/rank), fused and separate
      if [ -x "$B/epx" ] && [ "$hung" = 0 ] && [ "$(left)" -gt "${LAYER_MIN_S:-35}" ]; then
        t1=$SECONDS
        CUDA_VISIBLE_DEVICES=0,1 timeout -k 3 "$(cap 60)" "$B/epx" moe --device cuda --ranks 2 --preset deepseek-v4-pro \
          --backend ll --dispatch-dtype fp8 --mode decode --compare --tokens-per-rank "${LAYER_TOKENS:-128}" --steps 3 \
          --validate-tokens 2 --expert-pool 16 --json "$OUT/moe-v4pro-compare.json" >"$OUT/moe-v4pro-compare.log" 2>&1
        say "epx moe v4-pro --compare rc=$? in $((SECONDS - t1)) s"
        tail -6 "$OUT/moe-v4pro-compare.log" >>"$OUT/summary.txt"
      else
        say "layer skipped (left $(left) s)"
      fi ;;
    stamps)
      bench "$B/epx-gemm-mxfp4-bench" "stamps-B" 20 "$commit" --iters 10 --no-simt --cases decode --stamps ;;
    gate)
      if [ -x "$B/epx" ] && [ "$(left)" -gt 25 ]; then
        python3 "$S/bench/fhmoe_sweep_trace.py" --experts 256 --top-k 8 --ranks 2 --tokens 1,8,32,128 --steps "$GATE_STEPS" \
          -o /tmp/mxfp4-gate-trace.json >"$OUT/gate-trace.log" 2>&1
        for be in $GATE_BACKENDS; do
          t1=$SECONDS
          CUDA_VISIBLE_DEVICES=0,1 timeout -k 3 "$(cap 40)" "$B/epx" moe --device cuda --ranks 2 --preset deepseek-v3 \
            --dispatch-dtype fp8 --validate-tokens 1 --expert-pool 16 --backend "$be" --mode decode --compare \
            --trace /tmp/mxfp4-gate-trace.json --json "$OUT/gate-$be.json" >"$OUT/gate-$be.log" 2>&1
          rc=$?; say "gate sweep $be rc=$rc in $((SECONDS - t1)) s"
          python3 "$S/bench/fhmoe_sweep_report.py" "$OUT/gate-$be.json" --tokens 1,8,32,128 --steps "$GATE_STEPS" \
            >"$OUT/gate-$be-report.txt" 2>&1 && tail -8 "$OUT/gate-$be-report.txt" | tee -a "$OUT/summary.txt"
        done
      else
        say "gate skipped (left $(left) s)"
      fi ;;
  esac
done
echo "== summary"; cat "$OUT/summary.txt"
echo "total $((SECONDS - T0)) s"
