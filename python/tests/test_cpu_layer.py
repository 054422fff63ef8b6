"""CPU tests of the Python bindings' ModularMoE and epx.deepep.Buffer (numpy only; ranks are threads of CPU
groups), against the numpy / moe_reference outputs. Run by ctest as python_test (label cpu); helpers:
cpu_common.py."""

import time

import numpy as np
import pytest

import epx
from cpu_common import H, E, R, T, f32, make_inputs, run, numpy_experts, layer_reference, _deepep_round
from cpu_common import experts  # noqa: F401 - the module-scoped pytest fixture
from np_reference import bits_bf16, moe_out, rel_l2


def test_modular_moe_matches_reference():
    """ModularMoE.forward on 2 ranks (ll, DeepSeek-V3-mini with its shared expert) vs moe_reference of
    all tokens with the same routing (router_logits + route on the whole batch)."""
    weights = epx.MoEWeights.random("deepseek-v3-mini", seed=7)
    cfg = weights.config
    groups = epx.make_cpu_groups(R, timeout_s=30)
    tokens = [9, 4]
    rng = np.random.default_rng(3)
    xs = [bits_bf16(rng.standard_normal((t, cfg.hidden)).astype(np.float32)) for t in tokens]

    def body(rank):
        with pytest.raises(ValueError, match="ll_combine"):
            epx.ModularMoE(weights, groups[rank], "ll", num_max_dispatch_tokens_per_rank=16, ll_combine="rows")
        settings = epx.Config()
        settings.ll_combine_wait = "data"  # a launch setting of ll on CUDA; the CPU backend ignores it
        layer = epx.ModularMoE(weights, groups[rank], "ll", num_max_dispatch_tokens_per_rank=16, shared_mode="separate",
                               config=settings, ll_combine="column")
        out = layer.forward(xs[rank])
        assert out.dtype == np.uint16 and out.shape == xs[rank].shape
        assert layer.counters["calls"] == 1
        return out

    outs = run(groups, body)
    assert rel_l2(f32(np.concatenate(outs)), f32(layer_reference(weights, np.concatenate(xs)))) < 1e-2


@pytest.mark.parametrize("shared_mode", ["fused", "separate"])
def test_modular_moe_ht_expert_contiguous(shared_mode):
    """ModularMoE(..., "ht", expert_contiguous=True): the experts run on prepare's expert-contiguous rows and finalize
    weights them; the output matches moe_reference of all tokens (DeepSeek-V3-mini, its shared expert fused as a
    route or separate); on "ll" the option is refused on every rank, naming it."""
    weights = epx.MoEWeights.random("deepseek-v3-mini", seed=9)
    cfg = weights.config
    groups = epx.make_cpu_groups(R, timeout_s=30)
    tokens = [10, 3]
    rng = np.random.default_rng(5)
    xs = [bits_bf16(rng.standard_normal((t, cfg.hidden)).astype(np.float32)) for t in tokens]

    def body(rank):
        with pytest.raises(Exception, match="expert_contiguous"):
            epx.ModularMoE(weights, groups[rank], "ll", num_max_dispatch_tokens_per_rank=16, expert_contiguous=True)
        layer = epx.ModularMoE(weights, groups[rank], "ht", num_max_dispatch_tokens_per_rank=16, shared_mode=shared_mode,
                               expert_alignment=4, expert_contiguous=True)
        return layer.forward(xs[rank])

    outs = run(groups, body)
    assert rel_l2(f32(np.concatenate(outs)), f32(layer_reference(weights, np.concatenate(xs)))) < 1e-2


def test_deepep_buffer_aliases(experts):
    """low_latency_dispatch/combine and get_dispatch_layout/dispatch/combine give the reference result."""
    weights, fns = experts
    groups = epx.make_cpu_groups(R, timeout_s=20)

    def body(rank):
        buf = epx.deepep.Buffer(groups[rank])
        begin, end = epx.expert_range(E, R, rank)
        rng = np.random.default_rng(50 + rank)
        x, idx, w = make_inputs(rng, T)
        idx64 = idx.astype(np.int64)
        ref = moe_out(fns, f32(x), idx, w)
        recv, counts, handle, event, hook = buf.low_latency_dispatch(x, idx64, T, E, topk_weights=w, use_fp8=False)
        assert event is None and hook is None and recv.shape == (end - begin, R * T, H)
        y = numpy_experts(handle.prepared, fns[begin:end])
        out_ll, _, _ = buf.low_latency_combine(y, idx64, w, handle)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx64, E)
        exp_in_rank = np.zeros((T, R), bool)
        for t in range(T):
            for e in idx[t]:
                if e >= 0:
                    exp_in_rank[t, epx.expert_rank(E, R, int(e))] = True
        np.testing.assert_array_equal(in_rank, exp_in_rank)
        np.testing.assert_array_equal(per_rank, exp_in_rank.sum(0))
        np.testing.assert_array_equal(per_expert, np.bincount(idx[idx >= 0], minlength=E))
        recv_x, recv_idx, recv_w, counts_list, h2, _ = buf.dispatch(x, topk_idx=idx64, topk_weights=w, num_experts=E)
        assert isinstance(counts_list, list) and len(counts_list) == end - begin
        assert h2.backend.config.num_max_dispatch_tokens_per_rank == 128  # agreed over the ranks (ht on CUDA needs one)
        y2 = numpy_experts(h2.prepared, fns[begin:end])
        out_ht, _, _ = buf.combine(y2, h2)
        return rel_l2(f32(out_ll), ref), rel_l2(f32(out_ht), ref)

    for e_ll, e_ht in run(groups, body):
        assert e_ll < 1.5e-2 and e_ht < 1.5e-2


@pytest.mark.parametrize("bad", [E, E + 5, -2])
def test_deepep_dispatch_layout_rejects_bad_ids(bad):
    """get_dispatch_layout holds the dispatch's id rule (-1 or [0, num_experts)): an id out of range raises
    ValueError naming topk_idx[t, k], the value and the rule, instead of a per_expert of the wrong length
    or a selection silently dropped. No collective runs, so the other ranks are not involved."""
    buf = epx.deepep.Buffer(epx.make_cpu_groups(1)[0])
    idx = np.array([[0, 1, -1], [2, 3, 4]], np.int64)
    idx[1, 2] = bad
    with pytest.raises(ValueError, match=rf"topk_idx\[1, 2\] = {bad}: must be -1 \(no selection\) or an expert id in \[0, num_experts = {E}\)"):
        buf.get_dispatch_layout(idx, E)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx[:1], E)
    assert per_expert.shape == (E,) and in_rank.shape == (1, 1) and per_rank.tolist() == [1]


@pytest.mark.parametrize("ranks", ["both", "one"])
@pytest.mark.parametrize("which", ["ht_topk_weights", "ll_other_weights"])
def test_deepep_combine_weights_follow_deepep_or_raise(experts, which, ranks):
    """DeepEP's HT combine(x, handle, topk_weights=w) sums x without weights and reduces w to the source ranks;
    its low_latency_combine weights x by the topk_weights it is given. epx carries neither at combine, so
    instead of ignoring them (the shim once returned a result as if they were not given): HT topk_weights
    other than None, or LL weights other than the dispatch's object, raise NotImplementedError naming
    topk_weights and the rule on every rank (also when only one rank passes them), and the handles stay
    usable: the combine with the right arguments then gives the reference result."""
    _, fns = experts
    groups = epx.make_cpu_groups(R, timeout_s=20)

    def call(rank, buf, ll, ht):
        bad = ranks == "both" or rank == 0
        ll_y, idx, w, ll_handle = ll
        ht_y, recv_w, ht_handle = ht
        error = None
        try:
            if which == "ht_topk_weights":
                buf.combine(ht_y, ht_handle, topk_weights=recv_w if bad else None)
            else:
                buf.low_latency_combine(ll_y, idx, w.copy() if bad else w, ll_handle)
        except Exception as e:  # noqa: BLE001
            error = e
        out_ll, _, _ = buf.low_latency_combine(ll_y, idx, w, ll_handle)
        out_ht, combined_w, _ = buf.combine(ht_y, ht_handle)
        assert combined_w is None
        return error, out_ll, out_ht

    for rank, ((error, out_ll, out_ht), ref) in enumerate(_deepep_round(groups, fns, call)):
        if ranks == "both" or rank == 0:
            assert isinstance(error, NotImplementedError), repr(error)
            assert "topk_weights" in str(error) and "must be" in str(error), str(error)
        else:
            assert isinstance(error, epx.Error) and "rank 0 rejected its arguments" in str(error), repr(error)
            assert "topk_weights" in str(error), str(error)
        assert rel_l2(f32(out_ll), ref) < 1.5e-2 and rel_l2(f32(out_ht), ref) < 1.5e-2


@pytest.mark.parametrize("capacity", [0, T])
@pytest.mark.parametrize("misuse", ["cached_handle", "no_topk_weights", "no_num_experts"])
def test_deepep_dispatch_misuse_on_one_rank_fails_on_every_rank(experts, misuse, capacity):
    """The shim's own dispatch checks once raised on the bad rank before any collective, and the other rank
    waited in its dispatch until the timeout. They now go through one host all-gather: both ranks raise at
    once (the bad rank its own error, the other naming rank 0 and the same sentence), and the Buffer stays
    usable."""
    _, fns = experts
    groups = epx.make_cpu_groups(R, timeout_s=20)

    def body_call(rank, buf, x, idx, w):
        kw = dict(topk_idx=idx, topk_weights=w, num_experts=E, num_max_dispatch_tokens_per_rank=capacity)
        if rank == 0:
            if misuse == "cached_handle":
                kw["handle"] = object()
            elif misuse == "no_topk_weights":
                kw["topk_weights"] = None
            else:
                kw["num_experts"] = None
        return buf.dispatch(x, **kw)

    errors = [None, None]
    outs = [None, None]

    def body(rank):
        buf = epx.deepep.Buffer(groups[rank])
        begin, end = epx.expert_range(E, R, rank)
        x, idx, w = make_inputs(np.random.default_rng(80 + rank), 5)
        try:
            body_call(rank, buf, x, idx, w)
        except Exception as e:  # noqa: BLE001
            errors[rank] = e
        _, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                        num_max_dispatch_tokens_per_rank=capacity)
        out, _, _ = buf.combine(numpy_experts(h.prepared, fns[begin:end]), h)
        outs[rank] = rel_l2(f32(out), moe_out(fns, f32(x), idx, w))

    t0 = time.monotonic()
    epx.run_ranks(groups, body)
    assert time.monotonic() - t0 < 10, "a misused dispatch on one rank must not leave the other waiting"
    expected = NotImplementedError if misuse == "cached_handle" else ValueError
    assert isinstance(errors[0], expected), repr(errors[0])
    assert isinstance(errors[1], expected), repr(errors[1])
    assert f"epx.deepep.Buffer.dispatch: rank 0 rejected its arguments: {errors[0]}" == str(errors[1])
    assert outs[0] < 1.5e-2 and outs[1] < 1.5e-2


def test_deepep_layout_error_on_one_rank_times_out_the_other():
    """get_dispatch_layout is a local computation (as in DeepEP): a bad id raises on its rank only, before
    any collective. What the module docstring promises for the other rank: its next collective raises
    epx.Timeout (TimeoutError) after the group's timeout_s, naming the operation; it does not hang."""
    groups = epx.make_cpu_groups(R, timeout_s=1.5)
    errors = [None, None]

    def body(rank):
        buf = epx.deepep.Buffer(groups[rank])
        x, idx, w = make_inputs(np.random.default_rng(90 + rank), 4)
        if rank == 0:
            idx[2, 1] = E
        try:
            buf.get_dispatch_layout(idx, E)
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        except Exception as e:  # noqa: BLE001
            errors[rank] = e

    t0 = time.monotonic()
    epx.run_ranks(groups, body)
    assert time.monotonic() - t0 < 10
    assert isinstance(errors[0], ValueError) and "topk_idx[2, 1]" in str(errors[0]), repr(errors[0])
    assert isinstance(errors[1], TimeoutError), repr(errors[1])
