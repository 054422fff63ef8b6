"""A DLPack producer in ctypes, for tests: hand-made legacy ("dltensor", DLPack 0.x ABI) and versioned
("dltensor_versioned", DLPack 1.x ABI: DLManagedTensorVersioned) capsules over a numpy array's memory,
with the version, flags, device, dtype, shape, strides and data pointer under the test's control, and
a deleter that counts its calls (exactly one per capsule is the rule, consumed or not).

Layouts: dmlc/dlpack include/dlpack/dlpack.h (v1.1); capsule protocol: Python array API __dlpack__.
Works with any numpy (1.x has no versioned DLPack of its own), so CI exercises the versioned path.
"""

import ctypes
from ctypes import POINTER, c_char_p, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import numpy as np

KDL_CPU, KDL_CUDA = 1, 2
FLAG_READ_ONLY, FLAG_IS_COPIED = 1, 2
CODE = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


LEGACY_DELETER = ctypes.CFUNCTYPE(None, POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", LEGACY_DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


VERSIONED_DELETER = ctypes.CFUNCTYPE(None, POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", VERSIONED_DELETER),
                                     ("flags", c_uint64), ("dl_tensor", DLTensor)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [c_void_p, c_char_p, c_void_p]
_api.PyCapsule_GetName.restype = c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, c_char_p]
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, c_void_p, c_char_p)(("PyCapsule_IsValid", _api))
_capsule_pointer = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(("PyCapsule_GetPointer", _api))

# Capsule names must outlive their capsules (PyCapsule keeps the pointer).
_NAMES = {n: ctypes.create_string_buffer(n) for n in (b"dltensor", b"dltensor_versioned", b"used_dltensor",
                                                     b"used_dltensor_versioned", b"not_a_dltensor")}
_LIVE = {}  # managed-struct address -> its Producer (for the capsule destructor)


@ctypes.CFUNCTYPE(None, c_void_p)
def _capsule_destructor(cap):
    """DLPack: a capsule dropped unconsumed (name unchanged) calls the deleter; a consumed one does not."""
    for name in (b"dltensor", b"dltensor_versioned"):
        if _capsule_is_valid(cap, _NAMES[name]):
            addr = _capsule_pointer(cap, _NAMES[name])
            prod = _LIVE.get(addr)
            if prod is not None:
                prod._delete(addr)


def capsule_name(cap) -> str:
    return _api.PyCapsule_GetName(cap).decode()


def read_versioned(cap):
    """(version, flags, DLTensor fields) of an unconsumed versioned capsule (e.g. epx's own export)."""
    p = _api.PyCapsule_GetPointer(cap, _NAMES[b"dltensor_versioned"])
    m = DLManagedTensorVersioned.from_address(p)
    t = m.dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
    return {"version": (m.version.major, m.version.minor), "flags": m.flags, "data": t.data,
            "device": (t.device.device_type, t.device.device_id), "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes),
            "shape": shape, "strides": strides}


def consume_and_delete(cap):
    """What a consumer does when done: rename the capsule to used_*, then call the producer's deleter."""
    name = capsule_name(cap)
    p = _api.PyCapsule_GetPointer(cap, _NAMES[name.encode()])
    _api.PyCapsule_SetName(cap, _NAMES[b"used_" + name.encode()])
    if name == "dltensor_versioned":
        m = DLManagedTensorVersioned.from_address(p)
        m.deleter(ctypes.cast(p, POINTER(DLManagedTensorVersioned)))
    else:
        m = DLManagedTensor.from_address(p)
        m.deleter(ctypes.cast(p, POINTER(DLManagedTensor)))


class Producer:
    """Exports `array` (numpy) through __dlpack__ with hand-set fields.

    protocol  "honour": versioned when max_version >= (1, 0), else legacy (what the spec asks);
              "legacy_only": an old producer whose __dlpack__ takes no max_version (TypeError);
              "versioned_only": always versioned (raises TypeError without max_version >= 1).
    version, flags: of versioned capsules. device: (type, id) for the capsule and __dlpack_device__.
    dtype: (code, bits, lanes), default from the array. shape/strides (elements; strides None = NULL,
    "auto" = the array's). byte_offset, data (int address; default the array's). capsule_name: override.
    raises: an exception __dlpack__ raises. returns: an object __dlpack__ returns instead of a capsule.
    calls: the keyword arguments of each __dlpack__ call. deleted: deleter calls so far."""

    def __init__(self, array, *, protocol="honour", version=(1, 1), flags=0, device=(KDL_CPU, 0), dtype=None,
                 shape=None, strides="auto", byte_offset=0, data=None, capsule_name=None, raises=None, returns=None):
        self.array = array
        self.protocol, self.version, self.flags, self.device = protocol, version, flags, device
        a = np.asarray(array)
        self.dtype = dtype or (CODE[a.dtype.kind], 8 * a.dtype.itemsize, 1)
        self.shape = tuple(a.shape) if shape is None else tuple(shape)
        if strides == "auto":
            strides = tuple(s // a.dtype.itemsize for s in a.strides) if shape is None else None
        self.strides = strides
        self.byte_offset, self.capsule_name = byte_offset, capsule_name
        self.data = a.ctypes.data if data is None else data
        self.raises, self.returns = raises, returns
        self.calls, self.deleted = [], 0
        self._keep = {}  # address -> ctypes objects of one export

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        self.calls.append(dict(kwargs))
        if self.protocol == "legacy_only" and set(kwargs) - {"stream"}:
            raise TypeError(f"__dlpack__() got an unexpected keyword argument {sorted(set(kwargs) - {'stream'})[0]!r}")
        if self.raises is not None:
            raise self.raises
        if self.returns is not None:
            return self.returns
        mv = kwargs.get("max_version")
        versioned = mv is not None and mv[0] >= 1
        if self.protocol == "legacy_only":
            versioned = False
        if self.protocol == "versioned_only":
            if not versioned:
                raise TypeError("this producer exports DLPack >= 1.0 only: pass max_version")
            versioned = True
        return self._capsule(versioned)

    def _capsule(self, versioned):
        nd = len(self.shape)
        shape = (c_int64 * max(nd, 1))(*self.shape)
        strides = (c_int64 * max(nd, 1))(*self.strides) if self.strides is not None else None
        t = DLTensor(c_void_p(self.data), DLDevice(*self.device), nd, DLDataType(*self.dtype),
                     ctypes.cast(shape, POINTER(c_int64)),
                     ctypes.cast(strides, POINTER(c_int64)) if strides is not None else None, self.byte_offset)
        if versioned:
            deleter = VERSIONED_DELETER(lambda m: self._delete(ctypes.addressof(m.contents)))
            m = DLManagedTensorVersioned(DLPackVersion(*self.version), None, deleter, self.flags, t)
            name = self.capsule_name or "dltensor_versioned"
        else:
            deleter = LEGACY_DELETER(lambda m: self._delete(ctypes.addressof(m.contents)))
            m = DLManagedTensor(t, None, deleter)
            name = self.capsule_name or "dltensor"
        addr = ctypes.addressof(m)
        self._keep[addr] = (m, shape, strides, deleter)
        _LIVE[addr] = self
        return _api.PyCapsule_New(addr, _NAMES[name.encode()], ctypes.cast(_capsule_destructor, c_void_p))

    def _delete(self, addr):
        self.deleted += 1
        _LIVE.pop(addr, None)
        # The ctypes objects stay in self._keep: a second (wrong) deleter call must be counted, not crash.


class Wrapper:
    """An object that is not an epx.Tensor but exports one through __dlpack__ (epx's own capsules in)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        self.calls.append(dict(kwargs))
        return self.inner.__dlpack__(**kwargs)
