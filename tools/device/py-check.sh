#!/usr/bin/env bash
# tools/device/py-check.sh: the Python bindings on the GPU machine, in one device call.
#
#   bash tools/device/py-check.sh <source tree> [<deps.tar.xz>]
#
# 1. `pip install --target /tmp/epx-py <src>` with the venv's python (the in-tree backend; build isolation
#    on, nothing downloaded), CUDA on (sm_90a), NCCL from the nvidia-nccl wheel, pybind11 from the venv,
#    the Debian C++ dependencies the GPU image lacks from deps.tar.xz (tools/device/gpu-check.sh pack);
# 2. python -c "import epx; print(epx.__version__)" from another directory;
# 3. the module's C++ runtime (NEEDED libstdc++.so.6, no libstdc++ symbols of its own);
# 4. the GPU pytest (2 ranks, torch.multiprocessing; includes the vLLM-shaped example), results as
#    RESULTS.md JSON; python/tests/gpu_smoke.py (staged, markers + faulthandler) only when it fails
#    (or PY_CHECK_SMOKE=1);
# 5. the README quick start: torchrun --nproc-per-node 2 examples/quickstart_torch.py;
# 6. the CPU pytest (numpy 2 there).
# Time limits (s): PY_CHECK_PIP_TIMEOUT, PY_CHECK_GPU_TIMEOUT, PY_CHECK_SMOKE_TIMEOUT,
# PY_CHECK_QUICKSTART_TIMEOUT, PY_CHECK_CPU_TIMEOUT.
# Writes under $OUT: py-env.txt pip-install.log smoke.log pytest-cpu.log pytest-gpu.log python-gpu.json quickstart.log
set -uo pipefail
SRC="$(cd "${1:?source tree}" && pwd)"
DEPS_TAR="${2:-$SRC/.carry/deps.tar.xz}"
OUT="${OUT:-/tmp/epx-py-out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
PY="${PYTHON:-python3}"
deps=/tmp/epx-py-deps target=/tmp/epx-py
rm -rf "$deps" "$target" && mkdir -p "$deps"
tar -C "$deps" -xJf "$DEPS_TAR" || { echo "cannot unpack $DEPS_TAR"; exit 1; }
arch_lib="$deps/usr/lib/x86_64-linux-gnu"
nccl="$($PY -c 'import nvidia.nccl as m; print(list(m.__path__)[0])')"
export LD_LIBRARY_PATH="$nccl/lib:$arch_lib:$arch_lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  date -u; nvidia-smi -L; $PY --version; $PY -m pip --version; cmake --version | head -1; nvcc --version | tail -1
  $PY -c 'import torch, pybind11; print("torch", torch.__version__, "cuda", torch.version.cuda, "pybind11", pybind11.__version__)'
  echo "nccl wheel: $nccl"; ls /usr/include/python3*/Python.h; command -v cmake ninja; head -1 "$(command -v cmake)"
  $PY -c 'import numpy; print("numpy", numpy.__version__)'
  echo "CXX=${CXX:-} LDFLAGS=${LDFLAGS:-} g++: $(command -v g++) c++: $(command -v c++)"
  cxx="${CXX:-g++}"; echo "$cxx -print-file-name=libstdc++.so: $($cxx -print-file-name=libstdc++.so)"
} >"$OUT/py-env.txt" 2>&1

export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_PREFIX_PATH=$deps/usr -DBLA_VENDOR=OpenBLAS -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
-DCMAKE_LIBRARY_PATH=$arch_lib/openblas-pthread;$arch_lib -DEPX_CBLAS_INCLUDE=$deps/usr/include/x86_64-linux-gnu/openblas-pthread"
t0=$SECONDS
(cd "$SRC" && timeout "${PY_CHECK_PIP_TIMEOUT:-80}" $PY -m pip install -v --target "$target" .) >"$OUT/pip-install.log" 2>&1
rc=$?
echo "pip install rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/py-env.txt"
if [ $rc -ne 0 ]; then  # the documented fallback
  t0=$SECONDS
  (cd "$SRC" && $PY -m pip install -v --no-build-isolation --target "$target" .) >>"$OUT/pip-install.log" 2>&1
  echo "pip install --no-build-isolation rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/py-env.txt"
fi
(cd / && PYTHONPATH="$target" $PY -c "import epx; print(epx.__version__, 'cuda' if epx.built_with_cuda() else 'cpu', epx.nccl_version())") \
  2>&1 | tee -a "$OUT/py-env.txt"
# One C++ runtime per process (python/CMakeLists.txt): the module must need libstdc++.so.6 and export
# none of libstdc++'s own symbols (the device's g++ links libstdc++ statically otherwise).
so="$(ls "$target"/epx/_epx*.so 2>/dev/null | head -1)"
if [ -n "$so" ]; then
  echo "module NEEDED: $(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')" | tee -a "$OUT/py-env.txt"
  echo "module exports of libstdc++'s own symbols: $(nm -D --defined-only "$so" | awk '{print $NF}' | \
    grep -cxE '_Znwm|_ZdlPv|_ZNSt6locale7classicEv|_ZNSo9_M_insertIlEERSoT_|__cxa_throw') (must be 0)" | tee -a "$OUT/py-env.txt"
fi

export PYTHONPATH="$target" PYTHONDONTWRITEBYTECODE=1 PYTHONFAULTHANDLER=1
# Most telling first (a caller's time limit may cut the tail): GPU pytest, quick start, CPU pytest.
t0=$SECONDS
(cd "$SRC/python/tests" && PYTEST_EPX_JSON="$OUT/python-gpu.json" PYTEST_EPX_COMMIT="${PYTEST_EPX_COMMIT:-}" \
  timeout "${PY_CHECK_GPU_TIMEOUT:-70}" $PY -m pytest -v -rA -p no:cacheprovider -m gpu .) >"$OUT/pytest-gpu.log" 2>&1
rc_gpu=$?
echo "pytest gpu rc=$rc_gpu in $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest-gpu.log")" | tee -a "$OUT/py-env.txt"
if [ $rc_gpu -ne 0 ] || [ -n "${PY_CHECK_SMOKE:-}" ]; then
  # Staged steps with markers + faulthandler: says where a failing GPU run broke.
  t0=$SECONDS
  (cd "$SRC" && timeout "${PY_CHECK_SMOKE_TIMEOUT:-20}" $PY -X faulthandler python/tests/gpu_smoke.py) >"$OUT/smoke.log" 2>&1
  echo "smoke rc=$? in $((SECONDS - t0)) s (last step: $(grep -E '\.\.\.|ok$' "$OUT/smoke.log" | tail -1))" | tee -a "$OUT/py-env.txt"
fi
t0=$SECONDS
(cd "$SRC" && timeout "${PY_CHECK_QUICKSTART_TIMEOUT:-30}" $PY -m torch.distributed.run --nproc-per-node 2 examples/quickstart_torch.py) \
  >"$OUT/quickstart.log" 2>&1
echo "quickstart rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/quickstart.log")" | tee -a "$OUT/py-env.txt"
t0=$SECONDS
(cd "$SRC/python/tests" && timeout "${PY_CHECK_CPU_TIMEOUT:-30}" $PY -m pytest -q -rfE -p no:cacheprovider -m "not gpu" .) \
  >"$OUT/pytest-cpu.log" 2>&1
echo "pytest cpu rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest-cpu.log")" | tee -a "$OUT/py-env.txt"
