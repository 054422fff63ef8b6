#!/usr/bin/env bash
# scripts/run-main.sh: install what is missing, build, and run the main job `epx moe`.
#
#   bash scripts/run-main.sh                       # epx moe --backend all --preset deepseek-v3-mini --ranks 4 --device auto
#   bash scripts/run-main.sh --preset mixtral-8x7b-mini --ranks 2 --backend ll --json out.json
#
# Arguments, when given, replace the defaults and go to `epx moe` unchanged (see `epx moe --help`).
# Exit status is epx's: 0 all backends pass, 1 a validation failure, 2 a bad flag.
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"

epx_install_packages
epx_build
if [ $# -eq 0 ]; then
  set -- --backend all --preset deepseek-v3-mini --ranks 4 --device auto
fi
exec "$BUILD_DIR/epx" moe "$@"
