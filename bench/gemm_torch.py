#!/usr/bin/env python3
"""bench/gemm_torch.py: PyTorch's grouped GEMMs on the epx-gemm-bench shapes (issue 6 baseline).

DeepSeek-V3 experts (H 7168, I 2048), 128 local experts, M rows per expert (8 = decode,
256 = prefill), the whole MLP per call: gate_up grouped GEMM, SiLU-and-mul, (FP8: rowwise
requantization of h), down grouped GEMM; rows contiguous by expert with offsets (2d x 3d).
  torch._scaled_grouped_mm  FP8 e4m3, rowwise scales (one per row of x, one per output column of W;
                            not DeepSeek's 128x128 blocks), bf16 out
  torch._grouped_mm         bf16
Timing: torch.cuda.Event around each call, median (p10/p90) over --iters calls after 3 warm-ups.
--uneven: also the FP8 MLP at 256 rows per expert on average in uneven experts (prefill-v3-uneven; pairs of experts
2j, 2j + 1 get 256 + d and 256 - d rows, d = 16 ((7 j + 3) mod 33 - 16): epx-gemm-bench's uneven Contiguous row).
Writes RESULTS.md JSON (--json). Usage: python3 bench/gemm_torch.py --json gemm-torch.json
"""
import argparse
import datetime
import json
import statistics
import sys

import torch

H, I = 7168, 2048


def timeit(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    us = sorted(a.elapsed_time(b) * 1e3 for a, b in evs)
    q = lambda f: us[min(len(us) - 1, int(f * (len(us) - 1) + 0.5))]
    return q(0.1), statistics.median(us), q(0.9)


def rowwise_fp8(x):
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-4)
    scale = amax / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def counts_for(L, m, uneven):
    """Rows per expert: m each, or with `uneven` pairs 2j, 2j + 1 get m + d and m - d, d = 16 ((7 j + 3) mod 33 - 16)
    (epx-gemm-bench's uneven Contiguous row; bench/gemm_vs_torch.py uses the same split)."""
    counts = [m] * L
    if uneven:
        for l in range(0, L - 1, 2):
            d = 16 * ((7 * (l // 2) + 3) % 33 - 16)
            counts[l] += d
            counts[l + 1] -= d
    return counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--uneven", action="store_true")
    args = ap.parse_args()
    L = args.experts
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows = []
    w_bytes_fp8 = L * 3 * H * I
    w_bytes_bf16 = 2 * w_bytes_fp8
    # Weights [L, N, K] (K-major), viewed as [L, K, N] for the 2d x 3d grouped GEMM.
    w13 = (torch.randn(L, 2 * I, H, device=dev, dtype=torch.bfloat16) * H ** -0.5)
    w2 = (torch.randn(L, H, I, device=dev, dtype=torch.bfloat16) * I ** -0.5)
    w13_q, w13_s = rowwise_fp8(w13)
    w2_q, w2_s = rowwise_fp8(w2)
    cases = [(8, False), (256, False)] + ([(256, True)] if args.uneven else [])
    for m, uneven in cases:
        counts = counts_for(L, m, uneven)
        offs = torch.tensor(counts, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        x = torch.randn(L * m, H, device=dev, dtype=torch.bfloat16)
        x_q, x_s = rowwise_fp8(x)
        flops = 2.0 * L * m * H * 3 * I

        def bf16_mlp():
            gu = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

        def fp8_mlp():
            gu = torch._scaled_grouped_mm(x_q, w13_q.transpose(-2, -1), x_s, w13_s, offs=offs, out_dtype=torch.bfloat16)
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            h_q, h_s = rowwise_fp8(h)
            return torch._scaled_grouped_mm(h_q, w2_q.transpose(-2, -1), h_s, w2_s, offs=offs, out_dtype=torch.bfloat16)

        case = "decode-v3" if m == 8 else "prefill-v3-uneven" if uneven else "prefill-v3"
        backends = (("torch._scaled_grouped_mm", fp8_mlp, w_bytes_fp8, "fp8_e4m3 rowwise"),
                    ("torch._grouped_mm", bf16_mlp, w_bytes_bf16, "bf16"))
        for name, fn, wb, dt in backends[:1] if uneven else backends:
            try:
                p10, p50, p90 = timeit(fn, args.iters)
            except Exception as e:  # report, keep going
                rows.append({"case": case, "backend": name, "error": repr(e)[:400]})
                print(f"{name} M/expert={m}: failed: {e!r}"[:300])
                continue
            gbps = wb / (p50 * 1e-6) / 1e9
            tfl = flops / (p50 * 1e-6) / 1e12
            rows.append({"case": case, "backend": name, "op": "gemm",
                         "layout": "contiguous 2d x 3d", "num_local_experts": L, "hidden": H, "intermediate": I,
                         "rows_per_expert": m, "dtype": dt, "latency_us_p50": p50, "latency_us_p10": p10,
                         "latency_us_p90": p90, "gbps": gbps, "tflops": tfl,
                         "accounting": "weight-bytes" if m == 8 else "flops", "iterations": args.iters,
                         "validated": False,
                         "note": "whole MLP: gate_up, silu*up, (fp8: rowwise requant of h), down" +
                                 (f"; uneven experts {min(counts)} .. {max(counts)} rows (mean {m})" if uneven else "")})
            print(f"{name:26s} M/expert={m:4d}{' uneven' if uneven else ''}: {p50:9.1f} us  {gbps:7.0f} GB/s weights  "
                  f"{tfl:6.1f} TFLOP/s")
    doc = {"tool": "gemm bench (torch)", "command": " ".join(["python3"] + sys.argv),
           "git_commit": "unknown", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "device": "1 x " + torch.cuda.get_device_name(0), "torch_version": torch.__version__, "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
