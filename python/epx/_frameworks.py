"""Framework glue: which framework a tensor comes from, the default CUDA stream, and results returned
in the caller's framework (torch.Tensor for torch callers, numpy.ndarray for numpy callers) through
DLPack, without a copy.

numpy has no bfloat16 or float8: numpy callers pass and receive those as their bit patterns
(uint16 / uint8 arrays); epx.Tensor.float() or to_float32() decode them.
"""

from __future__ import annotations

import sys

from . import _epx

_BITS_DTYPES = ("bf16", "fp8_e4m3", "e8m0", "fp4_e2m1x2")


def framework(obj) -> str:
    """'torch', 'numpy' or 'epx' (anything else with __dlpack__ is answered with epx.Tensor)."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        return "torch"
    if mod == "numpy":
        return "numpy"
    return "epx"


def _torch():
    return sys.modules.get("torch")


def resolve_stream(stream, *tensors) -> int:
    """The CUDA stream of a call as an int handle (0 = legacy default stream).

    `stream` may be None, an int (cudaStream_t), or a torch.cuda.Stream / anything with .cuda_stream.
    None means torch.cuda.current_stream() of the first CUDA torch tensor among `tensors`, else 0."""
    if stream is not None:
        return int(getattr(stream, "cuda_stream", stream))
    torch = _torch()
    if torch is not None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                return int(torch.cuda.current_stream(t.device).cuda_stream)
    return 0


def to_framework(t, fw: str):
    """epx.Tensor -> the framework `fw` ('torch', 'numpy', 'epx'), sharing memory."""
    if t is None or fw == "epx":
        return t
    if fw == "torch":
        import torch

        if t.dtype in ("fp8_e4m3", "e8m0"):
            target = torch.float8_e4m3fn if t.dtype == "fp8_e4m3" else getattr(torch, "float8_e8m0fnu", torch.uint8)
            try:
                return torch.from_dlpack(t)
            except Exception:  # torch versions without float8 DLPack: same bytes as uint8, then a view
                return torch.from_dlpack(t.bits()).view(target)
        return torch.from_dlpack(t)
    return numpy_view(t)


_TYPESTR = {"fp32": "<f4", "fp16": "<f2", "int32": "<i4", "int64": "<i8", "uint8": "|u1",
            "bf16": "<u2", "fp8_e4m3": "|u1", "e8m0": "|u1", "fp4_e2m1x2": "|u1"}


class _ArrayInterface:
    """Holds an epx.Tensor and describes its memory to numpy (numpy.asarray keeps this object alive)."""

    def __init__(self, t):
        itemsize = int(_TYPESTR[t.dtype][2:])
        self._t = t
        self.__array_interface__ = {"version": 3, "shape": tuple(t.shape), "typestr": _TYPESTR[t.dtype],
                                    "data": (t.data_ptr, False), "strides": tuple(s * itemsize for s in t.strides)}


def numpy_view(t):
    """A writable numpy array over a CPU epx.Tensor's memory (no copy; bf16/fp8 as uint16/uint8 bits).

    Through the array interface rather than numpy.from_dlpack, whose arrays numpy 1.x makes read-only
    (and then cannot export again)."""
    import numpy as np

    if t.device != "cpu":
        raise _epx.InvalidArgument(f"epx: tensor.device = {t.device}: numpy arrays live on the CPU only")
    return np.asarray(_ArrayInterface(t))


def empty_like_rows(like, rows: int, cols: int, fw: str, device: str):
    """An uninitialised bf16 [rows, cols] tensor in framework `fw` next to `like`."""
    if fw == "torch":
        import torch

        return torch.empty((rows, cols), dtype=torch.bfloat16, device=like.device if like is not None else device)
    if fw == "numpy":
        import numpy as np

        return np.empty((rows, cols), dtype=np.uint16)
    return _epx.empty([rows, cols], "bf16", device)


def empty_bf16(shape, fw: str, device: str):
    if fw == "torch":
        import torch

        return torch.empty(tuple(shape), dtype=torch.bfloat16, device=device)
    if fw == "numpy":
        import numpy as np

        return np.empty(tuple(shape), dtype=np.uint16)
    return _epx.empty(list(shape), "bf16", device)


def empty_fp32(shape, fw: str, device: str):
    if fw == "torch":
        import torch

        return torch.empty(tuple(shape), dtype=torch.float32, device=device)
    if fw == "numpy":
        import numpy as np

        return np.empty(tuple(shape), dtype=np.float32)
    return _epx.empty(list(shape), "fp32", device)


def to_float32(x):
    """fp32 values of a bf16 / fp8 / fp16 / fp32 tensor: torch -> torch.float32 tensor, numpy (bit
    patterns: uint16 = bf16, uint8 = fp8_e4m3) -> float32 ndarray, epx.Tensor -> float32 ndarray."""
    fw = framework(x)
    if fw == "torch":
        return x.float()
    import numpy as np

    if fw == "numpy":
        if x.dtype == np.uint16:
            x = _epx.as_tensor(x, "bf16")
        elif x.dtype == np.uint8:
            x = _epx.as_tensor(x, "fp8_e4m3")
        else:
            return x.astype(np.float32)
    return numpy_view(x.float())


def bf16(x):
    """float32 array -> bf16 in the array's framework (numpy: uint16 bit patterns; RNE)."""
    fw = framework(x)
    if fw == "torch":
        import torch

        return x.to(torch.bfloat16)
    import numpy as np

    return np.from_dlpack(_epx.from_float(np.ascontiguousarray(x, dtype=np.float32), "bf16").bits())
