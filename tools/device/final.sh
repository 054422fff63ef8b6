#!/usr/bin/env bash
# tools/device/final.sh: the session's integrated device run of main, in at most two calls.
#
#   part 1: OUT=... bash tools/device/final.sh 1 <seconds>   build + every GPU test + each
#                                                           tools/device/final-*.sh (FINAL_SPECS
#                                                           name:seconds ...; each gets OUT, SRC,
#                                                           FINAL_COMMIT, FINAL_BUDGET_S) + the MoE A/B
#                                                           (moe-ab.sh) if time is left and final-moe.sh did not
#                                                           run (FINAL_MOE_AB=0: never);
#                                                           FINAL_RESERVE_S: seconds kept after the tests
#   part 2: OUT=... bash tools/device/final.sh 2 <seconds>   (same warm machine) the Python check
#                                                           (py-check.sh), then final-*.sh not run yet
# Run from a copy of main whose .carry/ holds deps.tar.xz and src.tar.xz + commit.txt
# (`bash tools/device/gpu-check.sh pack`). Everything is cut to <seconds>; what ran is under $OUT
# (at most 8 files: logs are tarred).
set -u
PART=${1:-1}
END=${2:-580}
T0=$SECONDS
left() { echo $(( END - (SECONDS - T0) )); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(pwd)
C=$(cat .carry/commit.txt 2>/dev/null || echo unknown)
S=/tmp/s-final
W=/tmp/final-work; mkdir -p $W
B=/tmp/epx-gpu-check/build
log() { echo "== $(date -u +%T) +$((SECONDS - T0)) s: $*" | tee -a $OUT/times.txt; }
finals() {  # runs tools/device/final-<name>.sh not run yet, each with its allowance, while time is left
  for spec in ${FINAL_SPECS:-mxfp4:50 gemm:50 ll:30 ht:40 mn:60 moe:100}; do
    local n=${spec%%:*} a=${spec##*:}
    [ -f "$S/tools/device/final-$n.sh" ] || continue
    [ -f "$W/done-$n" ] && continue
    local l=$(( $(left) - 10 )); [ $l -lt $a ] && a=$l
    if [ $a -lt 15 ]; then log "final-$n skipped (time)"; continue; fi
    mkdir -p $W/final-$n
    (cd $S && OUT=$W/final-$n SRC=$S FINAL_COMMIT=$C FINAL_BUDGET_S=$a timeout -k 3 $a bash tools/device/final-$n.sh) > $W/final-$n/stdout.txt 2>&1
    log "final-$n rc=$? (limit $a)"; touch $W/done-$n
    tail -15 $W/final-$n/stdout.txt
    tar -C $W -czf $OUT/final-part$PART.tar.gz . 2>/dev/null  # after every step: a cut call keeps what ran
  done
}
if [ "$PART" = 1 ]; then
  rm -rf $S $W && mkdir -p $S $W && tar -C $S -xJf .carry/src.tar.xz && mkdir -p $S/.carry && cp .carry/deps.tar.xz $S/.carry/
  log "commit $C"
  GPU_CHECK_SRC=$S GPU_CHECK_ONE_GPU=0 GPU_CHECK_SANITIZE=0 GPU_CHECK_CPU=0 GPU_CHECK_BENCH=0 \
    timeout -k 5 $(( $(left) - ${FINAL_RESERVE_S:-200} )) bash $S/tools/device/gpu-check.sh run > $W/gpu-check.out 2>&1
  log "gpu-check rc=$?"
  cat $OUT/configure.log >> $OUT/build.log 2>/dev/null; rm -f $OUT/configure.log $OUT/env.txt
  grep -E "tests passed|Passed|Failed|\*\*\*|Timeout" $OUT/gpu.log | tail -30
  tar -C $W -czf $OUT/final-part$PART.tar.gz . 2>/dev/null
  finals
  L=$(( $(left) - 10 )); [ $L -gt 300 ] && L=300
  # final-moe.sh (FINAL_SPECS "moe") reruns the decode / prefill table; the A/B here only when it did not run.
  if [ $L -ge 60 ] && [ "${FINAL_MOE_AB:-1}" != 0 ] && [ ! -f $W/done-moe ]; then
    (cd $S && OUT=$W MOE_AB_COMMIT=$C MOE_AB_TIMEOUT_S=$(( L / 3 )) timeout -k 5 $L bash tools/device/moe-ab.sh) > $W/moe-ab.out 2>&1
    log "moe-ab rc=$? (limit $L)"
    grep -E "runs pass|^(naive|allgather|all2allv|ll|ht)|prepare|exit" $W/moe-ab.out | head -60
  else log "moe-ab skipped (time or FINAL_MOE_AB=0)"; fi
else
  [ -d $S ] || { log "no $S: the machine of part 1 is gone"; exit 1; }
  L=$(( $(left) - 5 )); [ $L -gt 130 ] && L=130
  if [ $L -ge 60 ]; then
    mkdir -p $W/py && (cd $S && OUT=$W/py PYTEST_EPX_COMMIT=$C timeout -k 5 $L bash tools/device/py-check.sh $S $S/.carry/deps.tar.xz) > $W/py/stdout.txt 2>&1
    log "py-check rc=$? (limit $L)"; tail -12 $W/py/stdout.txt
  else log "py-check skipped (time)"; fi
  finals
fi
tar -C $W -czf $OUT/final-part$PART.tar.gz . 2>/dev/null
log "end part $PART"
