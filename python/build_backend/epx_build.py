"""In-tree PEP 517 build backend for epx: drives the project's CMake and writes the wheel itself.

Why not setuptools or scikit-build-core: neither machine this project builds on can reach PyPI, and
pip's build isolation would try to download them. A backend with `requires = []` (pyproject.toml) is
used by pip as is, isolated or not (pip >= 21.3 builds in the source tree).

What it does (build_wheel):
  1. cmake -S <root> -B build-python/<interpreter tag> -DEPX_PYTHON=ON -DEPX_BUILD_TESTS=OFF
     -DPython3_EXECUTABLE=<this interpreter> [-Dpybind11_DIR=...] [-DEPX_NCCL_ROOT=<nvidia.nccl wheel>] $CMAKE_ARGS
  2. cmake --build ... --target _epx (the static library + the module, Release)
  3. zips build-python/<tag>/python/epx (the package files + _epx*.so) with a .dist-info into the wheel.
build_editable does 1-2, copies the module next to python/epx/*.py and installs a .pth naming python/.
The module keeps its build RPATH (e.g. the NCCL wheel's lib/), so it loads where it was built.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "epx"


def _version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"project\(epx\s+VERSION\s+([0-9.]+)", text)
    return m.group(1) if m else "0.0.0"


def _tag() -> str:
    impl = "cp" if sys.implementation.name == "cpython" else sys.implementation.name[:2]
    py = f"{impl}{sys.version_info[0]}{sys.version_info[1]}"
    abi = py + (getattr(sys, "abiflags", "") or "")
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{py}-{abi}-{plat}"


def _outer_env() -> dict:
    """The environment without pip's build isolation (its PYTHONPATH hides the installing environment's
    site-packages). Tools run with it: cmake and ninja may be pip-installed wrapper scripts of that
    environment (as in a torch venv), which cannot import themselves inside the isolation."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}


def _outer_python_query(code: str):
    """Runs `code` in this interpreter outside pip's isolated build environment, to find packages
    installed next to the interpreter (pybind11, nvidia.nccl)."""
    try:
        out = subprocess.run([sys.executable, "-c", code], env=_outer_env(), capture_output=True, text=True, timeout=60, cwd="/")
    except Exception:  # noqa: BLE001
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _cmake_args() -> list:
    args = ["-DEPX_PYTHON=ON", "-DEPX_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release", f"-DPython3_EXECUTABLE={sys.executable}"]
    user = shlex.split(os.environ.get("CMAKE_ARGS", ""))
    if not any(a.startswith("-Dpybind11_DIR") for a in user):
        d = _outer_python_query("import pybind11; print(pybind11.get_cmake_dir())")
        if d:
            args.append(f"-Dpybind11_DIR={d}")
    if shutil.which("nvcc") and not any(a.startswith("-DEPX_NCCL_ROOT") for a in user):
        # The device API needs NCCL >= 2.28.9: the nvidia-nccl wheel next to torch, not the system's.
        d = _outer_python_query("import nvidia.nccl as m; print(list(m.__path__)[0])")
        if d and (Path(d) / "include" / "nccl.h").exists():
            args.append(f"-DEPX_NCCL_ROOT={d}")
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    return args + user


def _build() -> Path:
    bdir = ROOT / "build-python" / _tag()
    cmd = ["cmake", "-S", str(ROOT), "-B", str(bdir)] + _cmake_args()
    print("epx build:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=_outer_env())
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    subprocess.run(["cmake", "--build", str(bdir), "--target", "_epx", "-j", jobs], check=True, env=_outer_env())
    pkg = bdir / "python" / NAME
    if not list(pkg.glob("_epx*.so")) and not list(pkg.glob("_epx*.pyd")):
        raise RuntimeError(f"epx build: no _epx module under {pkg}")
    return pkg


def _metadata() -> str:
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {_version()}\n"
            "Summary: Expert-parallel MoE dispatch/combine and the modular MoE layer (C++/CUDA, DLPack bindings)\n"
            "Requires-Python: >=3.9\n")


def _wheel_text() -> str:
    return f"Wheel-Version: 1.0\nGenerator: epx_build\nRoot-Is-Purelib: false\nTag: {_tag()}\n"


def _dist_info() -> str:
    return f"{NAME}-{_version()}.dist-info"


def _write_wheel(wheel_directory: str, files: dict) -> str:
    """files: archive name -> bytes. Adds RECORD; returns the wheel's basename."""
    name = f"{NAME}-{_version()}-{_tag()}.whl"
    record = []
    path = Path(wheel_directory) / name
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for arc, data in files.items():
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(data)}")
        rec_name = f"{_dist_info()}/RECORD"
        record.append(f"{rec_name},,")
        z.writestr(rec_name, "\n".join(record) + "\n")
    return name


def _dist_info_files() -> dict:
    d = _dist_info()
    return {f"{d}/METADATA": _metadata().encode(), f"{d}/WHEEL": _wheel_text().encode()}


# ---- PEP 517 hooks ------------------------------------------------------------------------------
def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    d = Path(metadata_directory) / _dist_info()
    d.mkdir(parents=True, exist_ok=True)
    for arc, data in _dist_info_files().items():
        (Path(metadata_directory) / arc).write_bytes(data)
    return d.name


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    pkg = _build()
    files = {}
    for f in sorted(pkg.iterdir()):
        if f.is_file() and (f.suffix == ".py" or f.name.startswith("_epx")):
            files[f"{NAME}/{f.name}"] = f.read_bytes()
    files.update(_dist_info_files())
    return _write_wheel(wheel_directory, files)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    pkg = _build()
    src_pkg = ROOT / "python" / NAME
    for f in pkg.glob("_epx*"):
        shutil.copy2(f, src_pkg / f.name)
    files = {f"_{NAME}_editable.pth": (str(ROOT / "python") + "\n").encode()}
    files.update(_dist_info_files())
    return _write_wheel(wheel_directory, files)


def build_sdist(sdist_directory, config_settings=None):
    """The committed tree (git archive HEAD) as <name>-<version>.tar.gz."""
    base = f"{NAME}-{_version()}"
    out = Path(sdist_directory) / f"{base}.tar.gz"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar.gz", f"--prefix={base}/", "-o", str(out), "HEAD"], check=True)
    return out.name
