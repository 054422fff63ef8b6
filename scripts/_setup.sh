# scripts/_setup.sh: shared by run-main.sh and run-tests.sh (sourced, not run). Installs the
# Debian packages that are missing, then configures and builds epx. Reruns are fast: dpkg -s
# skips installed packages, and CMake/Ninja rebuild only what changed.
#
# Environment (all optional; none start with EPX_, which the epx binary reserves for its config):
#   BUILD_DIR   build directory (default: build, inside the repository)
#   CMAKE_ARGS  extra arguments for the configure step, e.g. "-DEPX_CUDA=OFF"
#   JOBS        parallel build jobs (default: nproc)
#   PYTHON      interpreter the Python module and its tests are built for (default: /usr/bin/python3,
#               Debian's, which has the python3-* packages below); PYTHON_BINDINGS=OFF skips them

set -euo pipefail

EPX_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-build}"
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$EPX_ROOT/$BUILD_DIR" ;; esac

# Debian 12 packages: the toolchain, gtest, nlohmann-json, CLI11, OpenBLAS (the CPU GEMMs), spdlog;
# the Python bindings (python/): headers, pybind11, numpy and pytest for their CPU tests.
EPX_PACKAGES=(cmake ninja-build g++ libgtest-dev nlohmann-json3-dev libcli11-dev libopenblas-dev libspdlog-dev
              python3-dev python3-pybind11 python3-numpy python3-pytest)

epx_install_packages() {
  local missing=()
  for p in "${EPX_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "epx setup: installing missing Debian packages: ${missing[*]}"
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "epx setup: need root or sudo to apt-get install ${missing[*]}" >&2; return 1; }
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# epx_build [target...]: configure, then build the targets given (default: everything).
epx_build() {
  # shellcheck disable=SC2086  # CMAKE_ARGS is a word list on purpose
  local py=(-DEPX_PYTHON="${PYTHON_BINDINGS:-ON}")
  local python="${PYTHON:-/usr/bin/python3}"
  [ -x "$python" ] && py+=(-DPython3_EXECUTABLE="$python")
  cmake -S "$EPX_ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "${py[@]}" ${CMAKE_ARGS:-} >/dev/null
  local targets=()
  [ $# -gt 0 ] && targets=(--target "$@")
  cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" "${targets[@]}"
}
