#!/usr/bin/env bash
# tools/device/helpers-run.sh: one device call for several helpers' batches (tenth session's way of sharing the
# GPU): for each NAME:SECONDS, runs .carry-NAME/batch.sh from the repository root with OUT=$OUT/NAME-out and
# BUDGET=SECONDS-5 under `timeout SECONDS`, then packs $OUT/NAME-out into $OUT/NAME.tar.gz (the device tool
# returns at most 8 files). Usage (device `run`, carry [".carry", ".carry-NAME", ...]):
#   mkdir -p $OUT && OUT=$OUT bash tools/device/helpers-run.sh gemmpf:150 mxfp4:150
set -uo pipefail
: "${OUT:?OUT must be set}"
export NCCL_NVLS_ENABLE=0
T0=$SECONDS
nvidia-smi --query-gpu=index,name,clocks.sm,power.draw,temperature.gpu --format=csv >"$OUT/smi.txt" 2>&1
for spec in "$@"; do
  name=${spec%%:*}; secs=${spec##*:}
  o="$OUT/$name-out"; mkdir -p "$o"
  if [ ! -f ".carry-$name/batch.sh" ]; then echo "$name: no .carry-$name/batch.sh" | tee "$o/stdout.txt"; continue; fi
  echo "== $name ($secs s) at $((SECONDS - T0)) s"
  OUT="$o" BUDGET=$((secs - 5)) timeout -k 5 "$secs" bash ".carry-$name/batch.sh" >"$o/stdout.txt" 2>&1
  echo "$name rc=$? at $((SECONDS - T0)) s"
  tail -25 "$o/summary.txt" 2>/dev/null
  (cd "$OUT" && tar -czf "$name.tar.gz" "$name-out" && rm -rf "$name-out")
done
echo "all done at $((SECONDS - T0)) s"
