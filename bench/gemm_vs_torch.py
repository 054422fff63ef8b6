#!/usr/bin/env python3
"""bench/gemm_vs_torch.py: epx's FP8 grouped expert GEMMs and torch._scaled_grouped_mm in one process, on the same
weights and tokens, timed in interleaved rounds (issue 6: speed "measured in the same run beside PyTorch's").

Why: the H200's SM clock is power- and heat-limited; identical GPU work moves by 10-17 % within one process
(bench/NOTES.md, twelfth session), so two backends timed minutes apart, or in separate processes, compare two clock
states. Here every round times each backend back to back (order rotated per round), and the reported ratio is the
median of the per-round ratios.

Shape: DeepSeek-V3 experts (H 7168, I 2048), --experts local experts (128 = EP2 of 256, ANCHORS.md), --rows rows per
expert (256 = ANCHORS.md's prefill case), rows contiguous by expert with torch-style offsets ([L] cumulative ends):
  epx-wgmma contiguous      epx.Experts(...).apply_contiguous: FP8 e4m3 x with 1x128 scales, weights with 128x128
                            block scales (DeepSeek-V3's recipe), SiLU-and-mul and h's 1x128 FP8 requantization fused,
                            bf16 out (the sm_90a prefill kernels)
  torch._scaled_grouped_mm  the same MLP as bench/gemm_torch.py: rowwise FP8 scales (one per row of x, one per output
                            column of W), silu*up and h's rowwise requantization as torch ops, bf16 out
--uneven adds the pairs-of-experts split of bench/gemm_torch.py --uneven (256 +- d rows, d = 16 ((7 j + 3) mod 33 - 16)).

Weights: --distinct random fp8_block experts (epx.ExpertWeights.random), repeated cyclically over the local experts
(each local expert still has its own device copy in both backends: the same bytes move as with 128 distinct experts).
torch's weights are the rowwise FP8 requantization of epx's dequantized weights, so both approximate one function.
Checked in the run, on the first 32 rows of each distinct expert: epx's output (poisoned with NaN first; every row of
those experts must be written) against an fp32 reference from epx's dequantized weights and FP8 tokens with h rounded
to FP8 1x128 as epx's kernel rounds it (rel. L2 < 2e-2: accumulation order and h's rounding boundaries; the GPU tests
check the kernels against the CPU oracle exactly); torch's output against the same reference without h's rounding
(reported, not gated: torch's rowwise re-quantization of the weights and h is a different recipe).
FLOPs: 2 * rows * H * 3I per expert (gate_up 2I x H, down H x I), the accounting of epx-gemm-bench and gemm_torch.py.

The uniform case also times the measured dense FP8 ceiling in the same rounds (torch._scaled_mm, cuBLASLt, per-tensor
scales, 8192^3), so fraction_of_peak (RESULTS.md: achieved / measured ceiling) compares one clock state.

Usage (the device machine; a CUDA build of the module on PYTHONPATH):
  python3 bench/gemm_vs_torch.py --rounds 9 --iters 10 --uneven --json gemm-vs-torch.json
Writes RESULTS.md JSON (--json): one row per case and backend (p50 = median over the rounds of each round's p50,
p10 / p90 = the min / max over the rounds), plus "cool" rows (each backend's first timing after --cool seconds idle).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

import epx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_torch import counts_for, rowwise_fp8  # noqa: E402  (the same recipe and split as bench/gemm_torch.py)

H, I = 7168, 2048


def time_calls(fn, iters):
    """p50 (us) of `iters` calls, each between its own pair of CUDA events, after 2 untimed calls."""
    for _ in range(2):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in evs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rows", type=int, default=256, help="rows per expert (mean, with --uneven)")
    ap.add_argument("--distinct", type=int, default=8, help="distinct random experts, repeated over --experts")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cool", type=float, default=10.0, help="idle seconds before each backend's 'cool' timing")
    ap.add_argument("--uneven", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.rounds < 1 or args.iters < 1 or args.distinct < 1 or args.experts < 1 or args.rows < 1:
        sys.exit("--rounds, --iters, --distinct, --experts and --rows must be >= 1")
    if not args.cool >= 0:  # (NaN too) time.sleep would raise only after the weights, the tokens and the check
        sys.exit(f"--cool {args.cool} must be >= 0 (seconds idle before each backend's cool timing)")
    if args.json:  # before the run, not after every round
        path = os.path.abspath(args.json)
        if os.path.exists(path):
            writable = os.path.isfile(path) and os.access(path, os.W_OK)
        else:
            writable = os.path.isdir(os.path.dirname(path)) and os.access(os.path.dirname(path), os.W_OK)
        if not writable:
            sys.exit(f"--json {args.json}: cannot be written (no writable file or directory there)")
    if args.uneven:  # d reaches -256 (pair j = 9): a mean below 256 rows would give an expert a negative count
        low = min(counts_for(args.experts, args.rows, True))
        if low < 0:
            sys.exit(f"--rows {args.rows} with --uneven and --experts {args.experts}: an expert would get {low} rows "
                     f"(--uneven moves up to 256 rows within a pair); use --rows >= {args.rows - low}")
    L, D = args.experts, min(args.distinct, args.experts)
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    t0 = time.time()
    ew = [epx.ExpertWeights.random("fp8_block", H, I, seed=100 + d) for d in range(D)]
    experts = epx.Experts([ew[l % D] for l in range(L)], "cuda")
    # torch: rowwise FP8 of epx's dequantized weights, [L, N, K] (K-major) viewed as [L, K, N] for 2d x 3d.
    w13f = [torch.from_numpy(np.ascontiguousarray(epx.to_float32(w.w13_float()))).to(dev) for w in ew]  # [2I, H]
    w2f = [torch.from_numpy(np.ascontiguousarray(epx.to_float32(w.w2_float()))).to(dev) for w in ew]    # [H, I]
    q13 = [rowwise_fp8(w) for w in w13f]
    q2 = [rowwise_fp8(w) for w in w2f]
    w13_q = torch.stack([q13[l % D][0] for l in range(L)])
    w13_s = torch.stack([q13[l % D][1] for l in range(L)])
    w2_q = torch.stack([q2[l % D][0] for l in range(L)])
    w2_s = torch.stack([q2[l % D][1] for l in range(L)])
    torch.cuda.synchronize()
    print(f"weights: {L} experts ({D} distinct), ready in {time.time() - t0:.1f} s", flush=True)

    # The measured dense FP8 ceiling (RESULTS.md: fraction_of_peak = achieved / measured ceiling): torch._scaled_mm
    # (cuBLASLt, per-tensor scales, no block-scale promotion) on 8192^3, timed in the same rounds as the two backends.
    dn = 8192
    da = torch.randn(dn, dn, device=dev).to(torch.float8_e4m3fn)
    db = torch.randn(dn, dn, device=dev).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=dev)
    dense_flops = 2.0 * dn ** 3

    def run_dense():
        return torch._scaled_mm(da, db.t(), one, one, out_dtype=torch.bfloat16)

    rows, summary = [], []
    cases = [("prefill-v3", False)] + ([("prefill-v3-uneven", True)] if args.uneven else [])
    for case, uneven in cases:
        counts = counts_for(L, args.rows, uneven)
        N = sum(counts)
        offs = torch.tensor(np.cumsum(counts), device=dev, dtype=torch.int32)
        x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
        xq = torch.empty(N, H, device=dev, dtype=torch.float8_e4m3fn)
        xs = torch.empty(N, H // 128, device=dev, dtype=torch.float32)
        epx.quantize_fp8_per_token_group(x, xq, xs)
        x_q, x_s = rowwise_fp8(x)
        out_e = torch.empty(N, H, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * N * H * 3 * I

        def run_epx():
            experts.apply_contiguous(xq, offs, out=out_e, x_scales=xs)

        def run_torch():
            gu = torch._scaled_grouped_mm(x_q, w13_q.transpose(-2, -1), x_s, w13_s, offs=offs, out_dtype=torch.bfloat16)
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            h_q, h_s = rowwise_fp8(h)
            return torch._scaled_grouped_mm(h_q, w2_q.transpose(-2, -1), h_s, w2_s, offs=offs, out_dtype=torch.bfloat16)

        # Check: poisoned outputs, then both against an fp32 reference on the first rows of the first D experts.
        out_e.fill_(float("nan"))
        run_epx()
        y_t = run_torch()
        torch.cuda.synchronize()
        starts = [0] + list(np.cumsum(counts)[:-1])
        errs_e, errs_t, unwritten = [], [], 0
        for l in range(min(D, L)):
            if counts[l] == 0:
                continue
            r0, r1 = starts[l], starts[l] + counts[l]
            unwritten += int(torch.isnan(out_e[r0:r1]).any(dim=1).sum())
            s1 = min(r1, r0 + 32)
            xd = xq[r0:s1].float() * xs[r0:s1].repeat_interleave(128, dim=1)  # epx's FP8 tokens, dequantized
            gu = xd @ w13f[l % D].t()
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            ref = h @ w2f[l % D].t()  # torch's reference: h unrounded
            hq = torch.empty(s1 - r0, I, device=dev, dtype=torch.float8_e4m3fn)
            hs = torch.empty(s1 - r0, I // 128, device=dev, dtype=torch.float32)
            epx.quantize_fp8_per_token_group(h, hq, hs)  # epx's reference: h rounded to FP8 1x128, as its kernel does
            ref_e = (hq.float() * hs.repeat_interleave(128, dim=1)) @ w2f[l % D].t()
            errs_e.append((out_e[r0:s1].float() - ref_e).norm().item() / ref_e.norm().item())
            errs_t.append((y_t[r0:s1].float() - ref).norm().item() / ref.norm().item())
        # (no sampled rows when every sampled expert is empty: not checked, so not ok)
        err_e, err_t = (max(errs_e), max(errs_t)) if errs_e else (float("nan"), float("nan"))
        ok = unwritten == 0 and err_e < 2e-2 and not np.isnan(err_e)
        print(f"{case}: N {N} rows ({min(counts)} .. {max(counts)} per expert); check vs fp32 reference: epx rel_l2 "
              f"{err_e:.2e}, torch {err_t:.2e}; unwritten epx rows {unwritten}: {'ok' if ok else 'FAILED'}", flush=True)

        fns = {"epx-wgmma": run_epx, "torch._scaled_grouped_mm": run_torch}
        if not uneven:
            fns["dense-fp8-ceiling"] = run_dense  # RESULTS.md's fraction_of_peak: achieved / measured dense TFLOP/s
        names = list(fns)
        cool = {}
        for n in names:  # each backend's first timing after an idle gap
            torch.cuda.synchronize()
            time.sleep(args.cool)
            cool[n] = time_calls(fns[n], args.iters)
        per = {n: [] for n in names}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for n in order:
                per[n].append(time_calls(fns[n], args.iters))
        ratios = [t / e for e, t in zip(per["epx-wgmma"], per["torch._scaled_grouped_mm"])]
        ratio = statistics.median(ratios)
        dense = {}
        if "dense-fp8-ceiling" in per:  # per round: epx TFLOP/s over the dense ceiling's TFLOP/s of the same round
            fr = [(flops / e) / (dense_flops / d) for e, d in zip(per["epx-wgmma"], per["dense-fp8-ceiling"])]
            dense = {"dense_tflops_rounds": dense_flops / (statistics.median(per["dense-fp8-ceiling"]) * 1e-6) / 1e12,
                     "fraction_of_peak_rounds_median": statistics.median(fr), "fraction_of_peak_rounds_min": min(fr),
                     "fraction_of_peak_rounds_max": max(fr),
                     "fraction_of_peak_cool": (flops / cool["epx-wgmma"]) / (dense_flops / cool["dense-fp8-ceiling"])}
        for n in names:
            if n == "dense-fp8-ceiling":
                p50 = statistics.median(per[n])
                rows.append({"case": "ceiling-fp8-dense-8192", "backend": "torch._scaled_mm (cuBLASLt)", "op": "gemm",
                             "dtype": "fp8_e4m3 per-tensor", "accounting": "flops", "iterations": args.iters,
                             "latency_us_p50": p50, "latency_us_p10": min(per[n]), "latency_us_p90": max(per[n]),
                             "tflops": dense_flops / (p50 * 1e-6) / 1e12, "rounds": args.rounds, "rounds_us": per[n],
                             "cool_us": cool[n], "validated": False,
                             "note": "8192^3, timed in the same interleaved rounds as the prefill-v3 rows"})
                print(f"{'ceiling':18s} {n:26s} rounds p50 {p50:8.1f} us {dense_flops / (p50 * 1e-6) / 1e12:7.1f} TFLOP/s; "
                      f"cool {dense_flops / (cool[n] * 1e-6) / 1e12:7.1f} TFLOP/s", flush=True)
                continue
            p50 = statistics.median(per[n])
            layout = "contiguous" if n == "epx-wgmma" else "contiguous 2d x 3d"
            dt = "fp8_e4m3 1x128 / 128x128 block scales" if n == "epx-wgmma" else "fp8_e4m3 rowwise"
            base = {"case": case, "backend": n, "op": "gemm", "layout": layout, "num_local_experts": L,
                    "distinct_experts": D, "hidden": H, "intermediate": I, "rows_per_expert": args.rows,
                    "rows_min": min(counts), "rows_max": max(counts), "dtype": dt, "accounting": "flops",
                    "iterations": args.iters, "validated": ok if n == "epx-wgmma" else False,
                    "max_rel_error": err_e if n == "epx-wgmma" else err_t}
            if n == "epx-wgmma" and dense:
                base["fraction_of_peak"] = dense["fraction_of_peak_rounds_median"]
            rows.append(dict(base, latency_us_p50=p50, latency_us_p10=min(per[n]), latency_us_p90=max(per[n]),
                             tflops=flops / (p50 * 1e-6) / 1e12, rounds=args.rounds, rounds_us=per[n],
                             note=f"median over {args.rounds} interleaved rounds (order rotated) of each round's p50; "
                                  "p10 / p90: min / max over the rounds; max_rel_error vs an fp32 reference on sampled rows"))
            if n == "epx-wgmma" and dense:
                base["fraction_of_peak"] = dense["fraction_of_peak_cool"]
            rows.append(dict(base, case=case + "-cool", latency_us_p50=cool[n], tflops=flops / (cool[n] * 1e-6) / 1e12,
                             note=f"one timing of --iters calls after {args.cool} s idle (before the rounds)"))
            print(f"{case:18s} {n:26s} rounds p50 {p50:8.1f} us {flops / (p50 * 1e-6) / 1e12:7.1f} TFLOP/s "
                  f"(min {min(per[n]):.1f} max {max(per[n]):.1f}); cool {cool[n]:8.1f} us "
                  f"{flops / (cool[n] * 1e-6) / 1e12:7.1f} TFLOP/s", flush=True)
        cr = cool["torch._scaled_grouped_mm"] / cool["epx-wgmma"]
        print(f"{case:18s} epx speed-up over torch: rounds median {ratio:.3f}x (per round {min(ratios):.3f} .. "
              f"{max(ratios):.3f}); cool {cr:.3f}x", flush=True)
        if dense:
            print(f"{case:18s} epx / dense FP8 ceiling: rounds median {dense['fraction_of_peak_rounds_median']:.3f} (per round "
                  f"{dense['fraction_of_peak_rounds_min']:.3f} .. {dense['fraction_of_peak_rounds_max']:.3f}); cool "
                  f"{dense['fraction_of_peak_cool']:.3f}", flush=True)
        te = flops / (statistics.median(per["epx-wgmma"]) * 1e-6) / 1e12
        summary.append(dict({"case": case, "epx_tflops_rounds": te, "epx_tflops_cool": flops / (cool["epx-wgmma"] * 1e-6) / 1e12,
                             "fraction_of_datasheet_fp8_1979": te / 1979.0,
                             "speedup_rounds_median": ratio, "speedup_rounds_min": min(ratios),
                             "speedup_rounds_max": max(ratios), "speedup_cool": cr, "check_ok": ok}, **dense))
    doc = {"tool": "gemm bench (epx vs torch, one process)", "command": " ".join(["python3"] + sys.argv),
           "git_commit": os.environ.get("GEMM_BENCH_COMMIT", "unknown"),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "device": "1 x " + torch.cuda.get_device_name(0), "torch_version": torch.__version__,
           "summary": summary, "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print("wrote", args.json)
    return 0 if all(s["check_ok"] for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
