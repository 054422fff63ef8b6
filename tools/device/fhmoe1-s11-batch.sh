#!/usr/bin/env bash
# tools/device/fhmoe1-s11-batch.sh (copy): FHMoE through the whole layer on ONE H200 (the 2-GPU kind was not lent):
# tools/device/final-fhmoe.sh with FHMOE_RANKS=1 (ll loopback, whole-layer graph, fused vs separate, DeepSeek-V3 then
# V4-Pro at T = FH_TOKENS (default 1, 8, 32, 128, 512) tokens, FH_STEPS steps each), epx built on the dev machine from main (prebuilt, sm_90a).
source tools/device/batch-lib.sh
batch_init /tmp/fh1-out 150
export CUDA_VISIBLE_DEVICES=0
: >"$OUT/summary.txt"
batch_prebuilt .carry-fh1
cu=$(ls -d /usr/local/cuda/extras/CUPTI/lib64 2>/dev/null); [ -n "$cu" ] && export LD_LIBRARY_PATH="$cu:$LD_LIBRARY_PATH"
if ldd "$P/epx" | grep -q "libcupti.*not found"; then
  w=$(find / -name 'libcupti.so.13*' 2>/dev/null | head -1); [ -n "$w" ] && export LD_LIBRARY_PATH="$(dirname "$w"):$LD_LIBRARY_PATH"
fi
ldd "$P/epx" | grep 'not found' >>"$OUT/summary.txt"
OUT="$OUT" SRC="$(pwd)" FHMOE_FINAL_EPX="$P/epx" FHMOE_RANKS=1 FHMOE_TOKENS=${FH_TOKENS:-1,8,32,128,512} FHMOE_STEPS=${FH_STEPS:-5} FHMOE_FINAL_BUDGET_S=$(cap 140) FINAL_COMMIT="$(cat .carry-fh1/commit.txt)" \
  bash tools/device/final-fhmoe.sh >>"$OUT/summary.txt" 2>&1
say "final-fhmoe rc=$? at $((SECONDS - T0)) s"
