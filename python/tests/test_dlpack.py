"""DLPack in and out of epx on the CPU (numpy only; any numpy): both capsule ABIs (legacy "dltensor",
DLPack 0.x, and versioned "dltensor_versioned", DLPack 1.x: DLManagedTensorVersioned has another
layout), the max_version handshake with old and new producers, read-only / is-copied flags, bad
dtypes, devices, shapes, strides and capsules, and the deleter rule (exactly one call per capsule,
consumed or not). The producer is a ctypes one (dlpack_producer.py), so numpy 1.x CI exercises the
versioned path that numpy 2 / torch >= 2.4 take. Also: the module links one C++ runtime (the cause of
the GPU machine's crashes, python/CMakeLists.txt)."""

import gc
import os
import shutil
import subprocess

import numpy as np
import pytest

import epx
from dlpack_producer import FLAG_IS_COPIED, FLAG_READ_ONLY, KDL_CUDA, Producer, Wrapper, capsule_name, consume_and_delete, read_versioned
from np_reference import bits_bf16, round_bf16

MAX_VERSION = (1, 1)  # what epx asks producers for


def rnd(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_module_links_one_cxx_runtime():
    """A module carrying its own static libstdc++ (exported) beside the process's libstdc++.so.6 crashed
    on the GPU machine at the first std::ostringstream (bench/results/h200x2/python-debug-6ca1a6c.log)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    so = epx._epx.__file__
    out = subprocess.run([nm, "-D", "--defined-only", so], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    # Defined only inside libstdc++ itself (not inline/template code a module may instantiate).
    runtime = {"_Znwm", "_ZdlPv", "_ZNSt6locale7classicEv", "_ZNSo9_M_insertIlEERSoT_", "_ZNSt8ios_base4InitC1Ev",
               "__cxa_throw", "_ZTISt9exception"}
    assert not (exported & runtime), f"{os.path.basename(so)} exports libstdc++'s own symbols: {sorted(exported & runtime)}"


@pytest.mark.parametrize("protocol", ["honour", "versioned_only", "legacy_only"])
def test_import_versioned_and_legacy(protocol):
    """from_float reads the values through whichever capsule the producer gives: a layout mix-up would
    read garbage. epx asks for max_version (1, 1) and falls back without it for old producers."""
    a = rnd((5, 16))
    p = Producer(a, protocol=protocol)
    t = epx.from_float(p, "bf16")
    np.testing.assert_array_equal(epx.to_float32(np.from_dlpack(t.bits()).copy()), round_bf16(a))
    if protocol == "legacy_only":
        assert p.calls == [{"max_version": MAX_VERSION}, {}]
    else:
        assert p.calls == [{"max_version": MAX_VERSION}]
    assert p.deleted == 1


def test_import_strides_offset_and_views():
    a = rnd((3, 4), 1)
    # a transposed view: shape (4, 3), strides (1, 4) elements
    v = epx.as_tensor(Producer(a, shape=(4, 3), strides=(1, 4)))
    assert (v.shape, v.strides, v.is_contiguous(), v.data_ptr) == ((4, 3), (1, 4), False, a.ctypes.data)
    with pytest.raises(ValueError, match="contiguous"):
        epx.from_float(Producer(a, shape=(4, 3), strides=(1, 4)), "bf16")
    # strides NULL = row-major; byte_offset moves the start
    v = epx.as_tensor(Producer(a, shape=(2, 4), strides=None, byte_offset=16))
    assert (v.strides, v.data_ptr) == ((4, 1), a.ctypes.data + 16)
    t = epx.from_float(Producer(a, shape=(2, 4), strides=None, byte_offset=16), "fp32")
    np.testing.assert_array_equal(np.from_dlpack(t), a[1:3])
    # 0-d and empty tensors
    assert epx.as_tensor(Producer(np.float32(3.0).reshape(()))).shape == ()
    e = epx.as_tensor(Producer(np.zeros((0, 7), np.float32), strides=(0, 0)))
    assert (e.shape, e.strides) == ((0, 7), (7, 1))


def test_read_only_and_copied_outputs_are_refused():
    x = bits_bf16(rnd((2, 128), 2))
    q, s = np.zeros((2, 128), np.uint8), np.zeros((2, 1), np.float32)
    epx.quantize_fp8_per_token_group(x, q, s)  # writable outputs: fine
    assert s.min() > 0 and q.any()
    ro = Producer(q, flags=FLAG_READ_ONLY)
    with pytest.raises(ValueError, match="q.*read-only"):
        epx.quantize_fp8_per_token_group(x, ro, s)
    assert ro.deleted == 1
    with pytest.raises(ValueError, match="scales.*IS_COPIED"):
        epx.quantize_fp8_per_token_group(x, q, Producer(s, flags=FLAG_IS_COPIED))
    # read-only inputs are fine
    xr = Producer(x, flags=FLAG_READ_ONLY)
    epx.quantize_fp8_per_token_group(xr, q, s)
    assert xr.deleted == 1
    # numpy's own read-only arrays (numpy 1.x: through the array interface; 2.x: the DLPack flag)
    q2 = q.copy()
    q2.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        epx.quantize_fp8_per_token_group(x, q2, s)
    # an epx.Tensor borrowed read-only stays read-only: never an output, exported with the flag
    t = epx.as_tensor(Producer(q, flags=FLAG_READ_ONLY), "fp8_e4m3")
    assert t.read_only
    with pytest.raises(ValueError, match="read-only"):
        epx.quantize_fp8_per_token_group(x, t, s)
    cap = t.__dlpack__(max_version=(1, 0))
    assert read_versioned(cap)["flags"] & FLAG_READ_ONLY
    consume_and_delete(cap)
    with pytest.raises(BufferError, match="read-only"):
        t.__dlpack__()  # DLPack 0.x cannot say read-only
    assert not epx.as_tensor(Producer(q)).read_only


@pytest.mark.parametrize("case, match", [
    ("version2", "version"),
    ("complex", "dtype"),
    ("float64", "dtype"),
    ("lanes", "dtype"),
    ("bool", "dtype"),
    ("device", "device"),
    ("ndim5", "ndim"),
    ("negative_shape", "shape"),
    ("null_data", "data"),
    ("misaligned", "aligned"),
    ("capsule_name", "capsule"),
    ("used_capsule", "already consumed"),
    ("not_a_capsule", "capsule"),
    ("raises", "__dlpack__"),
    ("bad_device_tuple", "__dlpack_device__"),
])
@pytest.mark.parametrize("versioned", [True, False])
def test_bad_producers_raise_and_release(case, match, versioned):
    """Every bad producer gives a ValueError naming the problem, never a crash, and its capsule's
    deleter runs exactly once (no leak, no double free)."""
    a = rnd((4, 8), 3)
    kw = {"protocol": "honour" if versioned else "legacy_only"}
    if case == "version2":
        if not versioned:
            pytest.skip("legacy capsules carry no version")
        kw["version"] = (2, 0)
    elif case == "complex":
        kw["dtype"] = (5, 64, 1)
    elif case == "float64":
        a = a.astype(np.float64)
    elif case == "lanes":
        kw["dtype"] = (2, 32, 2)
    elif case == "bool":
        kw["dtype"] = (6, 8, 1)
    elif case == "device":
        kw["device"] = (4, 0)  # OpenCL
    elif case == "ndim5":
        kw.update(shape=(1, 1, 1, 4, 8), strides=None)
    elif case == "negative_shape":
        kw.update(shape=(4, -8), strides=None)
    elif case == "null_data":
        kw["data"] = 0
    elif case == "misaligned":
        kw["byte_offset"] = 2
    elif case == "capsule_name":
        kw["capsule_name"] = "not_a_dltensor"
    elif case == "used_capsule":
        kw["capsule_name"] = "used_dltensor_versioned" if versioned else "used_dltensor"
    elif case == "not_a_capsule":
        kw["returns"] = 42
    elif case == "raises":
        kw["raises"] = RuntimeError("producer failed")
    p = Producer(a, **kw)
    if case == "bad_device_tuple":
        p.__dlpack_device__ = lambda: "cpu"
    with pytest.raises(ValueError, match=match):
        epx.from_float(p, "bf16")
    gc.collect()
    exported = len(p.calls) and case not in ("not_a_capsule", "raises")
    if case in ("capsule_name", "used_capsule"):
        assert p.deleted == 0  # a capsule the consumer cannot read is the producer's to release
    else:
        assert p.deleted == (1 if exported else 0), (p.calls, p.deleted)


def test_cuda_producer_gets_the_stream_protocol():
    """CUDA producers are asked for their data on the call's stream (1 = legacy default stream) and for
    DLPack 1.1; CPU producers get no stream (numpy refuses one). Nothing is dereferenced here."""
    a = rnd((2, 8), 4)
    p = Producer(a, device=(KDL_CUDA, 0))
    t = epx.as_tensor(p)
    assert t.device == "cuda:0" and t.data_ptr == a.ctypes.data
    assert p.calls == [{"stream": 1, "max_version": MAX_VERSION}]
    old = Producer(a, device=(KDL_CUDA, 0), protocol="legacy_only")
    epx.as_tensor(old)
    assert old.calls == [{"stream": 1, "max_version": MAX_VERSION}, {"stream": 1}]
    cpu = Producer(a)
    epx.as_tensor(cpu)
    assert cpu.calls == [{"max_version": MAX_VERSION}]
    assert p.deleted == old.deleted == cpu.deleted == 1


def test_export_capsules():
    """epx.Tensor.__dlpack__: legacy without max_version, versioned (at most 1.1) with it; epx reads its own
    versioned capsules back (through an object that is not an epx.Tensor)."""
    a = rnd((3, 4), 5)
    t = epx.from_float(a, "fp32")
    assert capsule_name(t.__dlpack__()) == "dltensor"
    assert capsule_name(t.__dlpack__(max_version=(0, 8))) == "dltensor"
    for mv, want in [((1, 0), (1, 0)), ((1, 1), (1, 1)), ((1, 7), (1, 1)), ((2, 3), (1, 1))]:
        cap = t.__dlpack__(max_version=mv)
        info = read_versioned(cap)
        assert (capsule_name(cap), info["version"], info["flags"]) == ("dltensor_versioned", want, 0)
        assert (info["shape"], info["strides"], info["dtype"], info["device"], info["data"]) == ((3, 4), (4, 1), (2, 32, 1), (1, 0), t.data_ptr)
        consume_and_delete(cap)
    del cap
    gc.collect()
    w = Wrapper(t)
    back = epx.from_float(w, "fp32")
    assert w.calls == [{"max_version": MAX_VERSION}]
    np.testing.assert_array_equal(np.from_dlpack(back), a)
    with pytest.raises(TypeError, match="max_version"):
        t.__dlpack__(max_version="1.0")
    with pytest.raises(TypeError, match="dl_device"):
        t.__dlpack__(dl_device="cpu")
    with pytest.raises(BufferError, match="dl_device"):
        t.__dlpack__(dl_device=(2, 0))  # no copies to another device
    with pytest.raises(BufferError, match="copy"):
        t.__dlpack__(copy=True)
