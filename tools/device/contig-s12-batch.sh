#!/usr/bin/env bash
# tools/device/contig-s12-batch.sh: the lead's device check of the Contiguous activation layout (twelfth session), run
# from the repository root as .carry-contig/batch.sh (tools/device/helpers-run.sh contig:SECS).
# .carry-contig/prebuilt.tar.xz: experts_cuda_test and epx-gemm-bench of the change (sm_90a, built on the dev machine).
# Steps: the experts GPU tests that carry Contiguous cases (CPU reference, byte-for-byte against ExpertMajor, tail rows
# never written, bad offsets reported), memcheck of the small shapes (every format and layout: TMA boxes and row loads that
# run past the last expert's rows and past N), then the prefill bench (--prefill-only: ExpertMajor, Flat, Contiguous
# uniform and uneven rows, the cuBLASLt loop) and torch._scaled_grouped_mm on the same contiguous shapes.
source tools/device/batch-lib.sh
batch_init /tmp/contig-out 200
export CUDA_VISIBLE_DEVICES=0
: >"$OUT/summary.txt"
batch_prebuilt .carry-contig
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)"
batch_gtest tests 150 ./experts_cuda_test --gtest_filter='ExpertsCuda.SmallShapesEveryFormatEveryLayout:ExpertsCuda.MixedFormatsAndWidths:ExpertsCuda.DeepSeekV4ProExpertShapes:ExpertsCuda.BadDeviceIndicesAreSkippedAndReportedByTheNextApply:ExpertsCuda.Fp8TensorCoreRowCountsOneTo8192'
grep -h 'rel_l2 \]' "$OUT/tests.log" | grep -i contiguous | head -20 >>"$OUT/summary.txt"
batch_gtest memcheck 45 "$SAN" --tool memcheck ./experts_cuda_test --gtest_filter='ExpertsCuda.SmallShapesEveryFormatEveryLayout'
b=$(cap 30)
(cd "$P" && timeout -k 2 "$b" ./epx-gemm-bench --iters 10 --no-simt --prefill-only --json "$OUT/gemm-bench.json" >"$OUT/gemm-bench.log" 2>&1)
say "gemm-bench rc=$?"; grep -E '^(prefill|ceiling)' "$OUT/gemm-bench.log" | tee -a "$OUT/summary.txt"
b=$(cap 20)
timeout -k 2 "$b" python3 bench/gemm_torch.py --iters 10 --uneven --json "$OUT/gemm-torch.json" >"$OUT/gemm-torch.log" 2>&1
say "gemm-torch rc=$?"; tail -4 "$OUT/gemm-torch.log" | tee -a "$OUT/summary.txt"
