"""pytest setup: the `gpu` marker (ctest's python_test runs -m "not gpu"; the device runs -m gpu)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs torch with CUDA and 2 GPUs (run on the device machine)")
