"""Shared helpers of the CPU tests of the Python bindings (test_cpu*.py): the sizes, the module-scoped
`experts` fixture (bf16 experts and their numpy functions), inputs, run_ranks with results, and the numpy
experts steps on prepare's layouts; outputs are poisoned (NaN bit patterns) before the call that writes them."""

import time

import numpy as np
import pytest

import epx
from np_reference import bits_bf16, expert_fn, moe_out

H, I, E, K, R, T = 128, 64, 8, 3, 2, 12
NAN_BF16 = np.uint16(0x7FC1)


def poisoned(shape):
    return np.full(shape, NAN_BF16, dtype=np.uint16)


def f32(bits):
    return epx.to_float32(bits)


@pytest.fixture(scope="module")
def experts():
    ws = [epx.ExpertWeights.random("bf16", H, I, seed=100 + e) for e in range(E)]
    return ws, [expert_fn(w) for w in ws]


def make_inputs(rng, tokens, with_gaps=True):
    x_bits = bits_bf16(rng.standard_normal((tokens, H)).astype(np.float32))
    idx = np.stack([rng.choice(E, size=K, replace=False) for _ in range(tokens)]).astype(np.int32) if tokens else \
        np.zeros((0, K), np.int32)
    if with_gaps and tokens:
        idx[rng.random((tokens, K)) < 0.15] = -1  # no selection
    w = rng.random((tokens, K)).astype(np.float32)
    return x_bits, idx, w


def run(groups, fn):
    """run_ranks, returning each rank's result."""
    results = [None] * len(groups)

    def body(rank):
        results[rank] = fn(rank)

    epx.run_ranks(groups, body)
    return results


def numpy_experts(prepared, local_fns, scales_group=128):
    """The experts step written in numpy against prepare's layout (both layouts, bf16 or fp8). Flat rows are
    written in prepared.expert_out_dtype: fp32 (the weighted sum unrounded, flat_combine partial_fp32) or bf16."""
    x = f32(prepared.x)
    if prepared.x_scales is not None:  # fp8: dequantize 1x128 groups
        s = np.asarray(prepared.x_scales, dtype=np.float32)
        x = x * np.repeat(s, scales_group, axis=-1)
    fp32 = prepared.expert_out_dtype == "fp32"
    out = np.full(prepared.x.shape, np.nan, np.float32) if fp32 else poisoned(prepared.x.shape)
    if prepared.layout == "expert_major":
        counts = np.asarray(prepared.recv_count)
        for l, n in enumerate(counts):
            if n:
                out[l, :n] = bits_bf16(local_fns[l](x[l, :n]))
    else:
        idx, w = np.asarray(prepared.topk_idx), np.asarray(prepared.topk_weights)
        for n in range(x.shape[0]):
            acc = np.zeros(H, np.float32)
            for k in range(idx.shape[1]):
                if idx[n, k] >= 0:
                    acc += w[n, k] * local_fns[idx[n, k]](x[n:n + 1])[0]
            out[n] = acc if fp32 else bits_bf16(acc)
    return out


def contiguous_experts(c, local_fns, scales_group=128):
    """The grouped-GEMM experts step in numpy on Prepared.contiguous: row i = expert row_expert[i] applied
    to x[i], unweighted; padding rows (row_expert -1) stay poisoned (finalize must not read them)."""
    x = f32(c.x)
    if c.x_scales is not None:
        x = x * np.repeat(np.asarray(c.x_scales, dtype=np.float32), scales_group, axis=-1)
    out = poisoned(c.x.shape)
    for i, e in enumerate(np.asarray(c.row_expert)):
        if e >= 0:
            out[i] = bits_bf16(local_fns[e](x[i:i + 1])[0])
    return out


def layer_reference(weights, x_all):
    """moe_reference of all ranks' tokens with the model's router on the whole batch (what ModularMoE.forward computes)."""
    cfg = weights.config
    logits = np.zeros((x_all.shape[0], cfg.router.num_experts), np.float32)
    epx.router_logits(weights, x_all, logits)
    idx = np.zeros((x_all.shape[0], cfg.router.top_k), np.int32)
    w = np.zeros((x_all.shape[0], cfg.router.top_k), np.float32)
    epx.route(cfg.router, logits, weights.correction_bias, idx, w)
    ref = poisoned(x_all.shape)
    epx.moe_reference(weights, x_all, idx, w, ref)
    return ref


def _both_ranks(groups, bad_rank_args, good_args, call):
    """Rank 0 calls with bad arguments, rank 1 with good ones; returns the exceptions (None = no error)."""
    errors = [None, None]

    def body(rank):
        try:
            call(rank, bad_rank_args if rank == 0 else good_args)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            errors[rank] = e

    t0 = time.monotonic()
    epx.run_ranks(groups, body)
    assert time.monotonic() - t0 < 10, "a bad argument on one rank must not leave the other waiting"
    return errors


def _deepep_round(groups, fns, call):
    """Both ranks: ll and ht dispatch through epx.deepep.Buffer, experts in numpy; call(rank, buf, ll, ht) then
    runs the combines; returns each rank's (result or exception, reference output)."""
    results = [None] * len(groups)

    def body(rank):
        buf = epx.deepep.Buffer(groups[rank])
        begin, end = epx.expert_range(E, R, rank)
        x, idx, w = make_inputs(np.random.default_rng(70 + rank), 6)
        ref = moe_out(fns, f32(x), idx, w)
        _, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, topk_weights=w, use_fp8=False)
        ll_y = numpy_experts(ll_handle.prepared, fns[begin:end])
        _, _, recv_w, _, ht_handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        ht_y = numpy_experts(ht_handle.prepared, fns[begin:end])
        try:
            results[rank] = (call(rank, buf, (ll_y, idx, w, ll_handle), (ht_y, recv_w, ht_handle)), ref)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[rank] = (e, ref)

    t0 = time.monotonic()
    epx.run_ranks(groups, body)
    assert time.monotonic() - t0 < 10, "a rejected combine on one rank must not leave the other waiting"
    return results
