"""Staged GPU smoke run of the Python bindings, to locate a crash: every step prints a marker before and
after it (flushed), and faulthandler prints the Python stack of a fatal signal. First without
torch.distributed (epx group over a file rendezvous), then with an epx group from a torch NCCL process
group, so a fault that needs torch's NCCL in the process is told apart from one that does not.

    python -X faulthandler python/tests/gpu_smoke.py          (2 GPUs; spawns 2 ranks)
"""

import faulthandler
import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

import epx

faulthandler.enable(all_threads=True)
H, E, K, T = 256, 16, 4, 32


def step(rank, name, fn):
    print(f"[rank {rank}] {name} ...", flush=True)
    out = fn()
    print(f"[rank {rank}] {name} ok", flush=True)
    return out


def exercise(rank, group, tag):
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, device="cuda")
    step(rank, f"{tag}: all_gather_i64", lambda: group.all_gather_i64(rank))
    t = step(rank, f"{tag}: epx.zeros cuda", lambda: epx.zeros([4, 8], "fp32", f"cuda:{rank}"))
    step(rank, f"{tag}: torch.from_dlpack(epx.Tensor)", lambda: float(torch.from_dlpack(t).sum()))
    step(rank, f"{tag}: epx.as_tensor(torch cuda)", lambda: epx.as_tensor(x).data_ptr == x.data_ptr())
    for backend in ("naive", "all2allv", "ht"):
        pf = step(rank, f"{tag}: {backend} create", lambda backend=backend: epx.make_prepare_finalize(
            backend, group, epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T)))
        p = step(rank, f"{tag}: {backend} prepare", lambda pf=pf: pf.prepare(x, idx, w))
        y = torch.zeros(p.x.shape, dtype=torch.float32 if p.expert_out_dtype == "fp32" else torch.bfloat16, device="cuda")
        step(rank, f"{tag}: {backend} finalize", lambda pf=pf: pf.finalize(y))
        step(rank, f"{tag}: {backend} sync", torch.cuda.synchronize)
        del pf, p
    weights = step(rank, f"{tag}: MoEWeights.random", lambda: epx.MoEWeights.random("qwen3-30b-a3b-mini", seed=1))
    layer = step(rank, f"{tag}: ModularMoE create", lambda: epx.ModularMoE(weights, group, "all2allv",
                                                                           num_max_dispatch_tokens_per_rank=T))
    xm = torch.randn(T, weights.config.hidden, device="cuda").to(torch.bfloat16)
    step(rank, f"{tag}: ModularMoE forward", lambda: layer(xm))
    step(rank, f"{tag}: sync", torch.cuda.synchronize)


def run(rank, world, rdv, port):
    try:
        step(rank, "set_device", lambda: torch.cuda.set_device(rank))
        g1 = step(rank, "epx group (file rendezvous)", lambda: epx.make_nccl_group(rdv, rank, world, rank, 30.0))
        exercise(rank, g1, "file-group")
        import torch.distributed as dist

        step(rank, "torch init_process_group", lambda: dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world))
        g2 = step(rank, "epx.group_from_torch", lambda: epx.group_from_torch(timeout_s=30.0))
        exercise(rank, g2, "torch-group")
        dist.destroy_process_group()
        print(f"[rank {rank}] SMOKE PASS", flush=True)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        raise


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdv = os.path.join(tempfile.mkdtemp(prefix="epx-smoke-"), "rendezvous")
    mp.spawn(run, args=(2, rdv, port), nprocs=2, join=True)
