"""Grouped expert GEMMs on rows already sorted by expert: epx.Experts.apply_contiguous, the layout of
torch._grouped_mm / torch._scaled_grouped_mm (`offs`), DeepGEMM's m-grouped contiguous GEMM and ht's
Prepared.contiguous (which carries the [L + 1] form of the offsets).

    python examples/grouped_gemm_contiguous.py                  # CPU (numpy), bf16 activations
    python examples/grouped_gemm_contiguous.py --device cuda:0  # a CUDA build and torch: FP8 activations on the
                                                                # sm_90a grouped GEMMs, checked against the CPU experts
"""
import argparse

import numpy as np

import epx

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cpu")
args = ap.parse_args()

H, I = 256, 128                       # hidden, expert width (multiples of 128: FP8 block scales)
counts = [5, 0, 130, 37]              # rows per local expert, sorted by expert id; expert 1 has none
N = sum(counts) + 3                   # 3 trailing rows that belong to no expert (never read or written)
offs = np.cumsum(counts).astype(np.int32)  # torch's form: cumulative row ends, [L]
weights = [epx.ExpertWeights.random("fp8_block", H, I, seed=10 + l) for l in range(len(counts))]
rng = np.random.default_rng(0)
x = epx.bf16(rng.standard_normal((N, H)).astype(np.float32))  # numpy: bf16 as uint16 bit patterns

cpu = epx.Experts(weights, "cpu")
y = cpu.apply_contiguous(x, offs)     # [N, H] bf16 bits; row i of expert l = expert_l(x[i]), unweighted
starts = np.concatenate([[0], offs]).astype(np.int32)  # the [L + 1] form (starts, then the end): the same rows
same = np.array_equal(cpu.apply_contiguous(x, starts)[:offs[-1]], y[:offs[-1]])
print(f"cpu: x {x.shape} -> y {y.shape}; [L] and [L + 1] offsets agree: {same}")
ok = same

if args.device != "cpu":
    import torch

    dev = torch.device(args.device)
    xt = torch.from_numpy(epx.to_float32(x)).to(torch.bfloat16).to(dev)
    q = torch.empty((N, H), dtype=torch.float8_e4m3fn, device=dev)
    s = torch.empty((N, H // 128), dtype=torch.float32, device=dev)
    epx.quantize_fp8_per_token_group(xt, q, s)  # DeepSeek's 1x128 activation scales
    gpu = epx.Experts(weights, args.device)
    yg = gpu.apply_contiguous(q, torch.from_numpy(offs).to(dev), x_scales=s)  # torch in, torch out, current stream
    ref = cpu.apply_contiguous(q.cpu().view(torch.uint8).numpy(), offs, x_scales=s.cpu().numpy())
    got, want = yg[:offs[-1]].float().cpu().numpy(), epx.to_float32(ref[:offs[-1]])
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"{args.device}: FP8 rows on the tensor-core grouped GEMMs, rel L2 vs the CPU experts {err:.1e}")
    ok = ok and err < 5e-2  # the FP8 tensor-core tolerance of METHOD.md / experts_cuda_test

print("ok" if ok else "FAIL")
raise SystemExit(0 if ok else 1)
