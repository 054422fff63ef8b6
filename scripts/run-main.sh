#!/usr/bin/env bash
# scripts/run-main.sh: install what is missing, build, and run the main job `epx moe`.
#
#   bash scripts/run-main.sh                       # epx moe --backend all --preset deepseek-v3-mini --ranks 4 --device auto
#   bash scripts/run-main.sh --preset mixtral-8x7b-mini --ranks 2 --backend ll --json out.json
#
# Arguments, when given, replace the defaults and go to `epx moe` unchanged (see `epx moe --help`).
# Exit status is epx's: 0 all backends pass, 1 a validation failure, 2 a bad flag.
# It builds only the CLI. Where no GPU is visible and neither BUILD_DIR nor CMAKE_ARGS is set, the CLI
# is built without CUDA in build-cpu/ (the job runs on CPU ranks; the sm_90a kernels would take most of
# the build), so the first table comes in a few minutes on a fresh 2-core machine; the test command
# builds everything in build/.
if [ -z "${BUILD_DIR:-}" ] && [ -z "${CMAKE_ARGS:-}" ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  BUILD_DIR=build-cpu
  CMAKE_ARGS="-DEPX_CUDA=OFF"
  PYTHON_BINDINGS=OFF
fi
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"

epx_install_packages
epx_build epx_cli
if [ $# -eq 0 ]; then
  set -- --backend all --preset deepseek-v3-mini --ranks 4 --device auto
fi
exec "$BUILD_DIR/epx" moe "$@"
