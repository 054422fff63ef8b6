# tools/device/batch-lib.sh: the prelude the device batch scripts share (sourced from the repository root, not run):
#   source tools/device/batch-lib.sh
#   batch_init <default OUT> <default BUDGET s>   OUT, BUDGET and T0; left (seconds left), cap N (min(N, left - 3)),
#                                                 say (echo + append to $OUT/summary.txt); NVLink multicast off
#   batch_prebuilt .carry-NAME                    unpacks .carry-NAME/prebuilt.tar.xz into P=/tmp/NAME-prebuilt and
#                                                 .carry/deps.tar.xz (gtest, spdlog, fmt, OpenBLAS: tools/device/gpu-check.sh
#                                                 pack) beside it; the venv's NCCL 2.28.9 and the deps go on LD_LIBRARY_PATH
#   batch_gtest NAME LIMIT CMD...                 runs CMD in $P within cap LIMIT (skipped under 8 s), output in
#                                                 $OUT/NAME.log, one summary line: rc, gtest PASSED / FAILED, sanitizer totals
batch_init() {
  set -uo pipefail
  OUT="${OUT:-$1}"; BUDGET="${BUDGET:-$2}"
  mkdir -p "$OUT"; T0=$SECONDS
  export NCCL_NVLS_ENABLE=0
}
left() { echo $((BUDGET - (SECONDS - T0))); }
cap() { local l; l=$(($(left) - 3)); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
batch_prebuilt() {
  local name=${1#.carry-} nccl dl
  P=/tmp/$name-prebuilt
  local D=/tmp/$name-deps
  rm -rf "$P" "$D" && mkdir -p "$P" "$D"
  tar -C "$P" -xJf "$1/prebuilt.tar.xz" && tar -C "$D" -xJf .carry/deps.tar.xz
  nccl="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
  dl="$D/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$nccl/lib:$dl:$dl/openblas-pthread:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "commit $(cat "$1/commit.txt" 2>/dev/null)"
}
batch_gtest() {
  local name=$1 b; b=$(cap "$2"); shift 2
  [ "$b" -lt 8 ] && { say "$name skipped"; return; }
  (cd "$P" && timeout -k 3 "$b" "$@") >"$OUT/$name.log" 2>&1
  say "$name rc=$? (limit $b) at $((SECONDS - T0)) s: $(grep -E '^\[  (PASSED|FAILED) |ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$name.log" | tr '\n' ' ')"
}
