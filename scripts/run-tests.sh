#!/usr/bin/env bash
# scripts/run-tests.sh: install what is missing, build, and run the CPU test suite (what CI runs).
#
#   bash scripts/run-tests.sh
#
# Runs `ctest -L cpu --output-on-failure -j2`; GPU tests (label gpu) need a GPU machine:
#   ctest --test-dir build -L gpu
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"

epx_install_packages
epx_build
cd "$BUILD_DIR"
exec ctest -L cpu --output-on-failure -j2
