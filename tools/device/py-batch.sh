#!/usr/bin/env bash
# tools/device/py-batch.sh: helper py's step of a batched device call (copied to .carry-py/batch.sh).
# Run from the root of a /work/main copy that carries .carry/deps.tar.xz and .carry-py/{src.tar.xz,commit.txt}:
#   OUT=<dir> timeout -k 5 150 bash .carry-py/batch.sh
# Unpacks the branch to /tmp/s-py and runs tools/device/py-check.sh (pip install ., import, GPU pytest on
# 2 ranks, the README quick start, CPU pytest) with time limits that fit 150 s; plus the toolchain facts
# behind the C++-runtime fix (python/CMakeLists.txt).
set -uo pipefail
: "${OUT:?}"
S=/tmp/s-py
rm -rf "$S" && mkdir -p "$S/.carry" && tar -C "$S" -xJf .carry-py/src.tar.xz && cp .carry/deps.tar.xz "$S/.carry/" || { echo "py: cannot unpack"; exit 1; }
export NCCL_NVLS_ENABLE=0
commit="$(cat .carry-py/commit.txt 2>/dev/null)"
{
  echo "commit $commit"; echo "CXX=${CXX:-} CC=${CC:-} CUDAHOSTCXX=${CUDAHOSTCXX:-} LDFLAGS=${LDFLAGS:-} PATH=$PATH"
  ls -la /opt/gcc /opt/gcc/bin 2>&1 | head -30; file -L /opt/gcc/bin/g++ 2>&1
  head -c 2000 /opt/gcc/bin/g++ 2>/dev/null | strings | head -40
  /opt/gcc/bin/g++ -print-file-name=libstdc++.so; /opt/gcc/bin/g++ -print-file-name=libstdc++.a
  /opt/gcc/bin/g++ -dumpspecs 2>&1 | grep -n -i "static-libstdc\|lstdc\|static" | head -20
} >"$OUT/toolchain.txt" 2>&1
PYTEST_EPX_COMMIT="$commit" PY_CHECK_PIP_TIMEOUT=80 PY_CHECK_GPU_TIMEOUT=85 PY_CHECK_SMOKE_TIMEOUT=20 \
  PY_CHECK_QUICKSTART_TIMEOUT=30 PY_CHECK_CPU_TIMEOUT=30 bash "$S/tools/device/py-check.sh" "$S" "$S/.carry/deps.tar.xz"
echo "== py ($commit) summary"
grep -E "rc=|module|^0\.|numpy" "$OUT/py-env.txt"
