"""Plain-torch reference MoE and plain-torch experts on epx's layouts (GPU tests and the example).

Precision follows include/epx/experts.h: h = silu(x Wg^T) * (x Wu^T) rounded to bf16, y = h W2^T rounded
to bf16, the weighted top-k sum in fp32, rounded once to bf16. Weights come from epx.MoEWeights through
DLPack (dequantized to fp32 once, then kept on the GPU)."""

import torch
import torch.nn.functional as F


def expert_fns(weights, device, expert_ids=None):
    """{global expert id: fn(x fp32 [M, H]) -> fp32 [M, H] (bf16-rounded)} for the ids given (default all)."""
    ids = range(len(weights.experts)) if expert_ids is None else expert_ids
    return {e: make_fn(weights.experts[e], device) for e in ids}


def make_fn(w, device):
    w13 = torch.from_dlpack(w.w13_float()).to(device)
    w2 = torch.from_dlpack(w.w2_float()).to(device)
    inter = w.intermediate

    fp8_h = w.format == "fp8_block"

    def f(x):
        g = x @ w13[:inter].T
        u = x @ w13[inter:].T
        h = F.silu(g) * u
        h = quant_dequant_fp8(h) if fp8_h else h.to(torch.bfloat16).float()
        return (h @ w2.T).to(torch.bfloat16).float()

    return f


def quant_dequant_fp8(h, group=128):
    """FP8 e4m3 1x128 with fp32 scales and back (include/epx/quant.h: scale = max(amax, 1e-4) / 448)."""
    m, n = h.shape
    g = h.reshape(m, n // group, group)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / 448.0
    q = (g / scale).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(m, n)


def moe_reference(fns, x, topk_idx, topk_weights, shared=None):
    """out [T, H] bf16 = round(sum_k w[t,k] * expert_{idx[t,k]}(x[t]) (+ shared(x[t]))), idx -1 skipped."""
    xf = x.float()
    out = torch.zeros_like(xf)
    idx = topk_idx.long()
    for e in torch.unique(idx[idx >= 0]).tolist():
        rows, cols = (idx == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, topk_weights[rows, cols, None].float() * fns[e](xf[rows]))
    if shared is not None:
        out += shared(xf)
    return out.to(torch.bfloat16)


def dequant(prepared):
    """prepare's x as fp32 (fp8: times its 1x128 scales)."""
    x = prepared.x.float()
    if prepared.x_scales is not None:
        x = x * prepared.x_scales.repeat_interleave(x.shape[-1] // prepared.x_scales.shape[-1], dim=-1)
    return x


def experts_on_layout(prepared, local_fns):
    """The experts step in plain torch on prepare's layout; local_fns[l] = expert of local id l.
    expert_major: out [L, cap, H], rows < recv_count[l] = expert_l(x) (reads the counts on the host).
    flat: out [N, H] = sum over local selections of w * expert(x), in prepared.expert_out_dtype (fp32: the partial
    unrounded, flat_combine partial_fp32; bf16: partial_bf16)."""
    x = dequant(prepared)
    if prepared.layout == "expert_major":
        out = torch.zeros(x.shape, dtype=torch.bfloat16, device=x.device)
        for l, n in enumerate(prepared.recv_count.tolist()):
            if n:
                out[l, :n] = local_fns[l](x[l, :n]).to(torch.bfloat16)
        return out
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    idx = prepared.topk_idx.long()
    for l in range(len(local_fns)):
        rows, cols = (idx == l).nonzero(as_tuple=True)
        if rows.numel():
            acc.index_add_(0, rows, prepared.topk_weights[rows, cols, None] * local_fns[l](x[rows]))
    return acc if prepared.expert_out_dtype == "fp32" else acc.to(torch.bfloat16)


def partial_dtype(prepared):
    """The torch dtype finalize takes as expert_out for this prepare (Prepared.expert_out_dtype)."""
    return torch.float32 if prepared.expert_out_dtype == "fp32" else torch.bfloat16


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
