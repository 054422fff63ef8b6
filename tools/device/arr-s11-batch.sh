#!/usr/bin/env bash
# tools/device/arr-s11-batch.sh (copy as .carry-arr/batch.sh): the lead's check of the per-thread empty arrivals
# (kEmptyArrivals: every consumer thread arrives on a stage's empty barrier; 1ffa5e5: lane 0 after __syncwarp);
# epx-gemm-bench-old of 1ffa5e5. The steps: tools/device/prefill-check-s11.sh.
NAME=arr LAST=memcheck exec bash tools/device/prefill-check-s11.sh
