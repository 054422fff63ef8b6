"""pytest setup: the `gpu` marker (ctest's python_test runs -m "not gpu"; the device runs -m gpu), and eager
CUDA kernel loading, which virtual ranks need (set before torch or epx starts CUDA)."""

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs torch with CUDA and 2 GPUs (run on the device machine)")
