"""Small single-process reproductions for the device (tools/device/py-debug.sh): one mode per run, so a
crash names its mode. Modes:
  internals:<order>   pybind11 internals keys in the interpreter-state dict and builtins after importing
                      the modules in <order> (e.g. torch,epx)
  from_float:<order>  epx.from_float(numpy float32) after importing <order>
  prepare:<order>     a 1-rank NCCL group, naive prepare/finalize of 0 and 8 tokens (epx tensors without
                      torch, torch tensors when torch is imported)
"""
import ctypes
import importlib
import os
import sys
import tempfile


def pybind_keys():
    api = ctypes.pythonapi
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    api.PyInterpreterState_GetDict.restype = ctypes.py_object
    api.PyInterpreterState_GetDict.argtypes = [ctypes.c_void_p]
    d = api.PyInterpreterState_GetDict(api.PyInterpreterState_Get())
    import builtins
    return sorted(str(k) for k in d if "pybind11" in str(k)), sorted(k for k in vars(builtins) if "pybind11" in k)


def main():
    mode, _, order = sys.argv[1].partition(":")
    mods = {}
    for name in [m for m in order.split(",") if m]:
        mods[name] = importlib.import_module(name)
        if mode == "internals":
            print(f"after import {name}: {pybind_keys()}", flush=True)
    import numpy as np
    import epx
    print("numpy", np.__version__, "epx", epx.__version__, flush=True)
    if mode == "internals":
        if "torch" in mods:
            t = mods["torch"]
            print("torch._C pybind11 abi:", [getattr(t._C, a, None) for a in ("_PYBIND11_COMPILER_TYPE", "_PYBIND11_STDLIB", "_PYBIND11_BUILD_ABI")])
        return
    if mode == "from_float":
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        print("from_float ...", flush=True)
        t = epx.from_float(a, "bf16")
        print("from_float ok", t, flush=True)
        v = epx.as_tensor(a)
        print("as_tensor ok", v, flush=True)
        print("np.from_dlpack ok", np.from_dlpack(t.bits()).shape, flush=True)
        return
    if mode == "prepare":
        H, E, K = 128, 4, 2
        rdv = os.path.join(tempfile.mkdtemp(), "rdv")
        print("group ...", flush=True)
        g = epx.make_nccl_group(rdv, 0, 1, 0, 30.0)
        print("group ok", g, flush=True)
        cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=8)
        pf = epx.make_prepare_finalize("naive", g, cfg)
        print("create ok", flush=True)
        torch = mods.get("torch")
        for T in (0, 8):
            if torch is None:
                if T:
                    continue
                x, idx, w = epx.empty([0, H], "bf16", "cuda:0"), epx.empty([0, K], "int32", "cuda:0"), epx.empty([0, K], "fp32", "cuda:0")
            else:
                torch.cuda.set_device(0)
                x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
                idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64, device="cuda")
                w = torch.rand(T, K, device="cuda")
            print(f"prepare T={T} ...", flush=True)
            p = pf.prepare(x, idx, w)
            print(f"prepare T={T} ok", p.raw, flush=True)
            y = p.x
            out = pf.finalize(y)
            print(f"finalize T={T} ok", flush=True)
            if torch is not None:
                torch.cuda.synchronize()
                print("max |out - x*sum(w)|:", float((out.float() - x.float() * w.sum(1, keepdim=True)).abs().max()) if T else 0.0, flush=True)


if __name__ == "__main__":
    main()
