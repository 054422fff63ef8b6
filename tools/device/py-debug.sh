#!/usr/bin/env bash
# tools/device/py-debug.sh: locate the Python bindings' crash on the GPU machine (one device call).
#   OUT=... bash tools/device/py-debug.sh <source tree> [<deps.tar.xz>]
# Installs the package like py-check.sh (RelWithDebInfo), then runs small reproductions
# (python/tests/debug_repro.py) and the 2-rank smoke with tools/device/segv_bt.c preloaded, and
# resolves the native frames in _epx*.so with addr2line. Everything goes to $OUT/debug.log.
set -uo pipefail
SRC="$(cd "${1:?source tree}" && pwd)"
DEPS_TAR="${2:-$SRC/.carry/deps.tar.xz}"
OUT="${OUT:-/tmp/epx-py-debug}"
mkdir -p "$OUT"
LOG="$OUT/debug.log"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
PY="${PYTHON:-python3}"
deps=/tmp/epx-py-deps target=/tmp/epx-py
rm -rf "$deps" "$target" && mkdir -p "$deps"
tar -C "$deps" -xJf "$DEPS_TAR" || { echo "cannot unpack $DEPS_TAR"; exit 1; }
arch_lib="$deps/usr/lib/x86_64-linux-gnu"
nccl="$($PY -c 'import nvidia.nccl as m; print(list(m.__path__)[0])')"
export LD_LIBRARY_PATH="$nccl/lib:$arch_lib:$arch_lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  date -u; $PY -c 'import numpy, torch, pybind11; print("numpy", numpy.__version__, "torch", torch.__version__, "pybind11", pybind11.__version__)'
  gcc --version | head -1; command -v addr2line cuda-gdb gdb
} >"$LOG" 2>&1
cc -shared -fPIC -O1 -o /tmp/segv_bt.so "$SRC/tools/device/segv_bt.c" -ldl >>"$LOG" 2>&1 || echo "segv_bt build failed" >>"$LOG"

export CMAKE_ARGS="-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_PREFIX_PATH=$deps/usr -DBLA_VENDOR=OpenBLAS -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
-DCMAKE_LIBRARY_PATH=$arch_lib/openblas-pthread;$arch_lib -DEPX_CBLAS_INCLUDE=$deps/usr/include/x86_64-linux-gnu/openblas-pthread"
t0=$SECONDS
(cd "$SRC" && timeout 90 $PY -m pip install -v --target "$target" .) >"$OUT/pip-install.log" 2>&1
echo "pip install rc=$? in $((SECONDS - t0)) s" | tee -a "$LOG"
so="$(ls $target/epx/_epx*.so 2>/dev/null | head -1)"
{
  echo "== module: $so"; ldd "$so"
  echo "== exported defined dynamic symbols: $(nm -D --defined-only "$so" | wc -l)"
  nm -D --defined-only "$so" | grep -ciE ' (cuda|nccl|cblas|cublas)' | sed 's/^/   cuda|nccl|cblas|cublas exported: /'
  nm -D --defined-only "$so" | grep -iE 'pybind11|PyInit' | head -5
  readelf -d "$so" | grep -E 'NEEDED|RPATH|RUNPATH|FLAGS'
} >>"$LOG" 2>&1

export PYTHONPATH="$target" PYTHONDONTWRITEBYTECODE=1
resolve() {  # file+offset frames of _epx*.so -> source lines
  grep -E "segv_bt (pc|frame) .*_epx" "$1" | awk '{print $5}' | head -30 | while read -r off; do
    echo "  $off: $(addr2line -f -C -i -e "$so" "$off" | tr '\n' ' ')"
  done
}
run() {  # run <name> <seconds> <command...>
  local name=$1 secs=$2; shift 2
  echo "===== $name" >>"$LOG"
  local t0=$SECONDS
  (cd "$SRC/python/tests" && LD_PRELOAD=/tmp/segv_bt.so timeout "$secs" "$@") >"/tmp/dbg-$name.log" 2>&1
  local rc=$?
  cat "/tmp/dbg-$name.log" >>"$LOG"
  echo "----- $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  if grep -q "segv_bt ===" "/tmp/dbg-$name.log"; then echo "----- $name: _epx frames" >>"$LOG"; resolve "/tmp/dbg-$name.log" >>"$LOG" 2>&1; fi
}
run ff_epx_torch 20 $PY debug_repro.py from_float:epx,torch
run prep_torch_epx 30 $PY debug_repro.py prepare:torch,epx
run internals_te 20 $PY debug_repro.py internals:torch,epx
run internals_et 20 $PY debug_repro.py internals:epx,torch
run ff_numpy 15 $PY debug_repro.py from_float:numpy
run ff_torch_epx 20 $PY debug_repro.py from_float:torch,epx
run prep_noTorch 25 $PY debug_repro.py prepare:epx
run cpu_pytest 30 $PY -m pytest -x -q -p no:cacheprovider -m "not gpu" .
run smoke 40 $PY gpu_smoke.py
echo "== summary"; grep -E "^----- " "$LOG"
