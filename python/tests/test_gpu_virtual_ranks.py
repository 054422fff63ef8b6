"""GPU test of virtual ranks from Python: epx.make_virtual_cuda_groups(2) places 2 ranks as threads of this
process on one GPU, driven by epx.run_ranks, each rank on its own torch stream. Every dispatch backend x
{bf16, fp8} runs prepare -> experts (plain torch on prepare's layout) -> finalize over rounds of fresh random
inputs (one round with a rank of no tokens) into NaN-poisoned outputs; each rank's output must equal the same
backend's on CPU ranks (epx.make_cpu_groups) on the same inputs, within rel L2 1e-2.

Run on a machine with a GPU: pytest -m gpu python/tests (skips without torch, CUDA or a CUDA build of epx).
"""

import contextlib

import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402

pytestmark = pytest.mark.gpu

if not (epx.built_with_cuda() and torch.cuda.is_available() and torch.cuda.device_count() >= 1):
    pytest.skip("needs a CUDA build of epx, torch with CUDA and a GPU", allow_module_level=True)

R = 2
H, E, K, T = 256, 16, 4, 32
ROUNDS = [(T, T), (T, 0), (7, T)]  # tokens of rank 0 and rank 1 per round; a rank with none still takes part
SCALES = torch.linspace(0.5, 1.5, E)  # expert e scales its rows by SCALES[e]


def _inputs(rank, rnd, tokens):
    """x [tokens, H] bf16, topk_idx [tokens, K] int32 (distinct experts, ~15% -1), topk_weights [tokens, K] fp32."""
    gen = torch.Generator().manual_seed(1000 * rnd + rank)
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, E, generator=gen).argsort(dim=1)[:, :K].to(torch.int32).contiguous()
    idx[torch.rand(tokens, K, generator=gen) < 0.15] = -1
    w = torch.rand(tokens, K, generator=gen)
    return x, idx, w


INPUTS = [[_inputs(rank, rnd, tokens[rank]) for rnd, tokens in enumerate(ROUNDS)] for rank in range(R)]


def _experts(prepared, begin, end):
    """The expert step on prepare's layout, with no host sync (the ranks share one GPU): local expert l
    (global begin + l) scales its rows by SCALES[begin + l]. expert_major [L, cap, H]: rows below
    recv_count[l] scaled, the rest zero; flat [N_recv, H]: row n times sum_k w[n, k] * scale of its local
    selections (topk_idx >= 0). bf16 out, as experts write it (flat: prepared.expert_out_dtype, fp32 by default)."""
    x = prepared.x.float()
    if prepared.x_scales is not None:
        x = x * prepared.x_scales.float().repeat_interleave(x.shape[-1] // prepared.x_scales.shape[-1], dim=-1)
    s = SCALES[begin:end].to(x.device)
    if prepared.layout == "expert_major":
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < prepared.recv_count.to(x.device).long()[:, None]
        y = x * s[:, None, None]
        return torch.where(valid[:, :, None], y, torch.zeros_like(y)).to(torch.bfloat16)
    idx = prepared.topk_idx.long()
    w = prepared.topk_weights.float()
    per_row = torch.where(idx >= 0, w * s[idx.clamp(min=0)], torch.zeros_like(w)).sum(dim=1, keepdim=True)
    return x * per_row if prepared.expert_out_dtype == "fp32" else (x * per_row).to(torch.bfloat16)


def _run(groups, device, backend, dtype):
    """Every round of `backend` on `groups` (one thread per rank): outs[rank][round], fp32 on the host."""
    outs = [[None] * len(ROUNDS) for _ in range(R)]

    def body(rank):
        begin, end = epx.expert_range(E, R, rank)
        cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T, dispatch_dtype=dtype)
        stream = None
        ctx = contextlib.nullcontext()
        if device == "cuda":
            torch.cuda.set_device(0)
            stream = torch.cuda.Stream()  # non-blocking (torch's pool); the rank's own, as virtual ranks need
            ctx = torch.cuda.stream(stream)
        with ctx:  # epx follows torch's current stream
            pf = epx.make_prepare_finalize(backend, groups[rank], cfg)
            for rnd in range(len(ROUNDS)):
                x, idx, w = (t.to(device) for t in INPUTS[rank][rnd])
                p = pf.prepare(x, idx, w)
                y = _experts(p, begin, end)
                out = torch.full((x.shape[0], H), float("nan"), dtype=torch.bfloat16, device=device)
                assert pf.finalize(y, out) is out
                outs[rank][rnd] = out.float().cpu()  # waits for this rank's stream only, never the device
            del p, pf
        if stream is not None:
            stream.synchronize()

    epx.run_ranks(groups, body)
    return outs


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_virtual_groups_are_ranks_on_one_gpu():
    groups = epx.make_virtual_cuda_groups(R, 0, 30.0)
    assert [(g.rank, g.size, g.device, g.ranks_per_gpu) for g in groups] == [(r, R, "cuda:0", R) for r in range(R)]
    got = [None] * R

    def body(rank):
        got[rank] = groups[rank].all_gather_i64(10 + rank)

    epx.run_ranks(groups, body)
    assert got == [[10, 11]] * R


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("backend", epx.backend_names())
def test_dispatch_combine_on_virtual_ranks_equals_cpu_ranks(backend, dtype):
    want = _run(epx.make_cpu_groups(R, timeout_s=60.0), "cpu", backend, dtype)
    got = _run(epx.make_virtual_cuda_groups(R, 0, 60.0), "cuda", backend, dtype)
    for rank in range(R):
        for rnd, tokens in enumerate(ROUNDS):
            g, w = got[rank][rnd], want[rank][rnd]
            where = f"{backend} {dtype} rank {rank} round {rnd}"
            assert g.shape == (tokens[rank], H) and w.shape == g.shape, where
            assert bool(torch.isfinite(g).all()), f"{where}: non-finite rows (poison left)"
            if tokens[rank]:
                assert _rel_l2(g, w) < 1e-2, f"{where}: rel L2 {_rel_l2(g, w)}"
