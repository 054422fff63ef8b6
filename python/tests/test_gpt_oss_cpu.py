"""gpt-oss from numpy through the Python bindings (CPU): ExpertActivation, the experts' biases b13 / b2 and
the router bias, against a numpy replica of transformers' modeling_gpt_oss.py block (GptOssTopKRouter +
GptOssExperts, fp32). Run by ctest as python_test (label cpu)."""

import numpy as np
import pytest

import epx
from np_reference import bits_bf16, rel_l2, round_bf16

H, I, E, K = 128, 64, 8, 2


def gpt_oss_params(seed, scale=3.0):
    """The block's parameters in modeling_gpt_oss.py's own layout, bf16-valued (so bf16 weights hold them
    exactly): router weight [E, H] and bias [E]; gate_up_proj [E, H, 2I] (x @ W; gate = columns ::2, up =
    columns 1::2) and gate_up_proj_bias [E, 2I] interleaved alike; down_proj [E, I, H], down_proj_bias [E, H].
    `scale` widens the gate / up projections so that the clamp at `limit` is reached."""
    rng = np.random.default_rng(seed)
    p = {
        "router_weight": rng.standard_normal((E, H)) / np.sqrt(H),
        "router_bias": rng.standard_normal(E) * 0.5,
        "gate_up_proj": rng.standard_normal((E, H, 2 * I)) * scale / np.sqrt(H),
        "gate_up_proj_bias": rng.standard_normal((E, 2 * I)) * 0.5,
        "down_proj": rng.standard_normal((E, I, H)) / np.sqrt(I),
        "down_proj_bias": rng.standard_normal((E, H)) * 0.1,
    }
    return {k: round_bf16(v.astype(np.float32)) for k, v in p.items()}


def gpt_oss_block(p, x, alpha=1.702, limit=7.0, epx_rounding=False):
    """GptOssMLP.forward in numpy, fp32: router_logits = F.linear(x, W, b); top-k of the logits; softmax over
    the top-k values; each expert gate_up = x @ gate_up_proj + bias, gate = [..., ::2], up = [..., 1::2],
    gate.clamp(max=limit), up.clamp(-limit, limit), glu = gate * sigmoid(gate * alpha),
    next = ((up + 1) * glu) @ down_proj + down_proj_bias, weighted by the router scores and summed.
    epx_rounding: also round where epx's rounding rule (include/epx/experts.h) rounds for bf16 weights: h (the down
    GEMM's bf16 operand) and each expert's output y + b2.
    Returns (out [T, H] fp32, topk_idx [T, K], clamped fraction of gate / up values)."""
    logits = x @ p["router_weight"].T + p["router_bias"]
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :K]
    top = np.take_along_axis(logits, idx, axis=1)
    w = np.exp(top - top.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    out = np.zeros_like(x)
    clamped = total = 0
    for t in range(x.shape[0]):
        for k in range(K):
            e = idx[t, k]
            gate_up = x[t] @ p["gate_up_proj"][e] + p["gate_up_proj_bias"][e]
            gate, up = gate_up[::2], gate_up[1::2]
            clamped += int(np.sum(gate > limit) + np.sum(np.abs(up) > limit))
            total += gate.size + up.size
            gate = np.minimum(gate, limit)
            up = np.clip(up, -limit, limit)
            glu = gate / (1.0 + np.exp(-gate * alpha))
            h = (up + 1) * glu
            if epx_rounding:
                h = round_bf16(h)
            y = h @ p["down_proj"][e] + p["down_proj_bias"][e]
            out[t] += w[t, k] * (round_bf16(y) if epx_rounding else y)
    return out.astype(np.float32), idx, clamped / total


def epx_weights(p, activation):
    """The same block as epx weights: w13 [2I, H] = [gate rows; up rows], b13 = [gate bias; up bias] (the
    de-interleaving the checkpoint loader does), w2 [H, I], b2 [H]; the router bias on MoEWeights."""
    experts = []
    for e in range(E):
        gu, b = p["gate_up_proj"][e], p["gate_up_proj_bias"][e]
        w13 = np.ascontiguousarray(np.concatenate([gu[:, ::2].T, gu[:, 1::2].T]))
        b13 = np.ascontiguousarray(np.concatenate([b[::2], b[1::2]]))
        experts.append(epx.ExpertWeights.from_float("bf16", w13, np.ascontiguousarray(p["down_proj"][e].T), b13=b13,
                                                    b2=np.ascontiguousarray(p["down_proj_bias"][e]), activation=activation))
    cfg = epx.MoEConfig()
    cfg.name, cfg.hidden, cfg.intermediate = "gpt-oss-tiny", H, I
    router = cfg.router
    router.num_experts, router.top_k, router.scoring, router.renormalize = E, K, "softmax", True
    cfg.router = router
    return epx.MoEWeights.from_parts(cfg, p["router_weight"], experts, router_bias=p["router_bias"])


def test_expert_activation_type():
    a = epx.ExpertActivation.gpt_oss()
    assert (a.kind, a.limit, a.is_plain_silu) == ("gpt_oss_glu", 7.0, False) and a.alpha == pytest.approx(1.702)
    assert a == epx.ExpertActivation("gpt_oss_glu", alpha=1.702, limit=7.0) and a != epx.ExpertActivation.silu()
    assert epx.ExpertActivation().is_plain_silu and not epx.ExpertActivation("silu_glu", limit=10.0).is_plain_silu
    assert "gpt_oss_glu(alpha=1.702, limit=7)" in repr(a)
    with pytest.raises(ValueError, match="kind"):
        epx.ExpertActivation("gelu")
    with pytest.raises(ValueError, match="limit"):
        epx.ExpertActivation("gpt_oss_glu")  # gpt_oss_glu needs a finite limit
    with pytest.raises(ValueError, match="limit"):
        epx.ExpertActivation.gpt_oss(limit=0.0)
    with pytest.raises(AttributeError):
        a.limit = 3.0  # a value type: build a new one


def test_expert_and_router_biases_round_trip_and_checks():
    w = epx.ExpertWeights.random("bf16", H, I, seed=1)
    assert w.b13 is None and w.b2 is None and w.activation == epx.ExpertActivation.silu()
    b13 = np.arange(2 * I, dtype=np.float32)
    w.b13, w.b2 = b13, np.ones(H, np.float32)
    np.testing.assert_array_equal(np.from_dlpack(w.b13), b13)
    w.activation = epx.ExpertActivation.gpt_oss(limit=5.0)
    assert w.activation.limit == 5.0
    with pytest.raises(ValueError, match=r"ExpertWeights\.b2"):
        w.b2 = np.ones(H + 1, np.float32)  # [H] only
    with pytest.raises(ValueError, match=r"ExpertWeights\.b13"):
        w.b13 = np.ones(2 * I, np.float64)  # fp32 only
    assert w.b2 is not None and np.from_dlpack(w.b2).shape == (H,)  # a refused value leaves the old one
    w.b13 = None
    assert w.b13 is None
    with pytest.raises(ValueError, match="b2"):
        epx.ExpertWeights.random("bf16", H, I, seed=1, b2=np.ones(I, np.float32))

    p = gpt_oss_params(0)
    weights = epx_weights(p, epx.ExpertActivation.gpt_oss())
    np.testing.assert_array_equal(np.from_dlpack(weights.router_bias), p["router_bias"])
    with pytest.raises(ValueError, match="router_bias"):
        weights.router_bias = np.ones(E - 1, np.float32)
    weights.router_bias = None
    assert weights.router_bias is None


def test_router_logits_take_the_router_bias():
    p = gpt_oss_params(1)
    weights = epx_weights(p, epx.ExpertActivation.gpt_oss())
    x = bits_bf16(np.random.default_rng(2).standard_normal((16, H)).astype(np.float32))
    logits = np.full((16, E), np.nan, np.float32)
    epx.router_logits(weights, x, logits)
    np.testing.assert_allclose(logits, epx.to_float32(x) @ p["router_weight"].T + p["router_bias"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend,ranks,limit", [("ll", 2, 7.0), ("all2allv", 2, 7.0), ("ht", 4, 7.0), ("naive", 1, 3.0)])
def test_gpt_oss_layer_matches_the_model_code(backend, ranks, limit):
    """A gpt-oss block built from numpy (modeling_gpt_oss.py's layout), run by ModularMoE on CPU ranks with its own
    router: rel L2 to the fp32 replica <= 1e-2 (epx rounds h and each expert's output to bf16, as its rounding rule
    says), every token's top-k the replica's; the clamp is reached; and the same weights without the biases or with
    plain silu_glu are far off (so the comparison can tell)."""
    p = gpt_oss_params(10 + ranks)
    act = epx.ExpertActivation.gpt_oss(limit=limit)
    weights = epx_weights(p, act)
    tokens = 24
    x_bits = bits_bf16(np.random.default_rng(20 + ranks).standard_normal((tokens, H)).astype(np.float32))
    ref, ref_idx, clamped = gpt_oss_block(p, epx.to_float32(x_bits), limit=limit)
    assert clamped > 0.01  # the clamps take part

    def run_layer(w):
        groups = epx.make_cpu_groups(ranks, timeout_s=30)
        per = tokens // ranks
        outs = [None] * ranks

        def body(rank):
            layer = epx.ModularMoE(w, groups[rank], backend, num_max_dispatch_tokens_per_rank=per)
            outs[rank] = layer.forward(x_bits[rank * per:(rank + 1) * per])

        epx.run_ranks(groups, body)
        return epx.to_float32(np.concatenate(outs))

    got = run_layer(weights)
    assert rel_l2(got, ref) <= 1e-2, rel_l2(got, ref)
    # With epx's two rounding points in the replica too, only fp32 summation order and the final rounding differ.
    ref_rounded, _, _ = gpt_oss_block(p, epx.to_float32(x_bits), limit=limit, epx_rounding=True)
    assert rel_l2(got, round_bf16(ref_rounded)) <= 2e-4, rel_l2(got, round_bf16(ref_rounded))

    # The layer's routing is the replica's: route() with the biased logits selects the same experts.
    logits = np.full((tokens, E), np.nan, np.float32)
    epx.router_logits(weights, x_bits, logits)
    idx = np.full((tokens, K), -1, np.int32)
    tw = np.full((tokens, K), np.nan, np.float32)
    epx.route(weights.config.router, logits, None, idx, tw)
    assert (np.sort(idx, axis=1) == np.sort(ref_idx, axis=1)).all()

    # Negative controls: each dropped piece moves the output far beyond the bound.
    plain = epx_weights(p, epx.ExpertActivation.silu())
    assert rel_l2(run_layer(plain), ref) > 0.1
    no_bias = epx_weights(p, act)
    for e in no_bias.experts:
        e.b13, e.b2 = None, None
    assert rel_l2(run_layer(no_bias), ref) > 0.1
    no_router_bias = epx_weights(p, act)
    no_router_bias.router_bias = None
    assert rel_l2(run_layer(no_router_bias), ref) > 0.1


def test_cuda_experts_take_gpt_oss_math():
    """make_experts on CUDA takes an expert with biases and the clamped SwiGLU (its results against the CPU experts:
    experts_cuda_test's BiasesAndActivationsEveryPathAgainstTheCpu), and names a bad bias as the CPU does."""
    if not epx.built_with_cuda() or epx.cuda_device_count() == 0:
        pytest.skip("needs a CUDA build and a GPU")
    w = epx.ExpertWeights.random("bf16", H, I, seed=3, activation=epx.ExpertActivation.gpt_oss())
    w.b13 = np.zeros(2 * I, np.float32)
    w.b2 = np.zeros(H, np.float32)
    assert epx.make_experts([w], "cuda:0").num_local_experts == 1
