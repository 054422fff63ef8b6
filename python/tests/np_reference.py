"""Plain-numpy reference of the MoE experts and combine, independent of epx's C++ (used by the CPU
tests). Precision follows include/epx/experts.h for bf16 weights: h = silu(x Wg^T) * (x Wu^T) rounded to
bf16, y = h W2^T rounded to bf16, the weighted sum over top-k in fp32, rounded once to bf16."""

import numpy as np

import epx


def round_bf16(a):
    """float32 -> nearest bf16 value (round to nearest even), still float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def bits_bf16(a):
    """float32 -> bf16 bit patterns (uint16), round to nearest even."""
    return (round_bf16(a).view(np.uint32) >> 16).astype(np.uint16)


def expert_fn(w: "epx.ExpertWeights"):
    w13 = np.array(np.from_dlpack(w.w13_float()))
    w2 = np.array(np.from_dlpack(w.w2_float()))
    inter = w.intermediate

    def f(x):
        g = x @ w13[:inter].T
        u = x @ w13[inter:].T
        h = round_bf16(g / (1.0 + np.exp(-g)) * u)
        return round_bf16(h @ w2.T)

    return f


def moe_out(experts, x, topk_idx, topk_weights):
    """sum_k w[t,k] * expert_{idx[t,k]}(x[t]) in fp32 (idx -1 skipped), float32 [T, H] before rounding."""
    out = np.zeros_like(x, dtype=np.float32)
    for t in range(x.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e >= 0:
                out[t] += np.float32(topk_weights[t, k]) * experts[e](x[t:t + 1])[0]
    return out


def rel_l2(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
