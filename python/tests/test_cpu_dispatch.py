"""CPU tests of the Python bindings' prepare / finalize (numpy only; ranks are threads of CPU groups): every
backend with the experts in numpy, the hierarchical path, the combine modes, the expert-contiguous layout,
and arguments refused on every rank. Run by ctest as python_test (label cpu); helpers: cpu_common.py."""

import numpy as np
import pytest

import epx
from cpu_common import H, E, K, R, T, poisoned, f32, make_inputs, run, numpy_experts, contiguous_experts, _both_ranks
from cpu_common import experts  # noqa: F401 - the module-scoped pytest fixture
from np_reference import bits_bf16, moe_out, rel_l2


@pytest.mark.parametrize("backend", epx.backend_names())
@pytest.mark.parametrize("dispatch_dtype", ["bf16", "fp8_e4m3"])
def test_prepare_finalize_numpy_experts(experts, backend, dispatch_dtype):
    """Dispatch with each backend, run the experts in numpy on the layout prepare returns, combine, and
    compare every rank's output with the numpy reference MoE. Rank 1 has 0 tokens in one round."""
    weights, fns = experts
    groups = epx.make_cpu_groups(R, timeout_s=20)
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T,
                             dispatch_dtype=dispatch_dtype)

    def body(rank):
        pf = epx.make_prepare_finalize(backend, groups[rank], cfg)
        begin, end = epx.expert_range(E, R, rank)
        errs = []
        for rnd, tokens in enumerate([T, 0 if rank == 1 else 5]):
            rng = np.random.default_rng(1000 * rnd + rank)
            x, idx, w = make_inputs(rng, tokens)
            prepared = pf.prepare(x, idx, w)
            assert prepared.layout == pf.capabilities["layout"]
            assert prepared.x.ctypes.data == prepared.raw.x.data_ptr  # a view of the backend's buffer
            expert_out = numpy_experts(prepared, fns[begin:end])
            out = poisoned((tokens, H))
            assert pf.finalize(expert_out, out) is out
            if tokens:
                errs.append(rel_l2(f32(out), moe_out(fns, f32(x), idx, w)))
        return errs

    errs = [e for r in run(groups, body) for e in r]
    tol = 1.5e-2 if dispatch_dtype == "bf16" else 8e-2
    assert errs and max(errs) < tol, errs


@pytest.mark.parametrize("backend", ["ll", "ht"])
def test_hierarchical_path_across_cpu_nodes(experts, backend):
    """make_cpu_groups(ranks_per_node=1) gives R nodes of one rank: ll and ht take their hierarchical path
    (capabilities["hierarchical"]) and still match the numpy reference MoE; one node keeps the flat path;
    a ranks_per_node that does not divide R raises ValueError."""
    weights, fns = experts
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T)
    for rpn, hierarchical in ((1, True), (R, False)):
        groups = epx.make_cpu_groups(R, timeout_s=20, ranks_per_node=rpn)

        def body(rank):
            pf = epx.make_prepare_finalize(backend, groups[rank], cfg)
            assert pf.capabilities["hierarchical"] is hierarchical
            begin, end = epx.expert_range(E, R, rank)
            tokens = T if rank == 0 else 3
            x, idx, w = make_inputs(np.random.default_rng(77 + rank), tokens)
            prepared = pf.prepare(x, idx, w)
            out = poisoned((tokens, H))
            pf.finalize(numpy_experts(prepared, fns[begin:end]), out)
            return rel_l2(f32(out), moe_out(fns, f32(x), idx, w))

        errs = run(groups, body)
        assert max(errs) < 1.5e-2, (rpn, errs)
    with pytest.raises(ValueError, match="ranks_per_node"):
        epx.make_cpu_groups(R, timeout_s=5, ranks_per_node=R + 1)


@pytest.mark.parametrize("mode", ["column", "partial_fp32", "partial_bf16"])
def test_ll_combine_modes(experts, mode):
    """DispatchConfig.ll_combine picks ll's combine reduction; every mode matches the numpy reference MoE, and
    a bad name raises ValueError naming the field."""
    weights, fns = experts
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T, ll_combine=mode)
    assert cfg.ll_combine == mode
    groups = epx.make_cpu_groups(R, timeout_s=20)

    def body(rank):
        pf = epx.make_prepare_finalize("ll", groups[rank], cfg)
        begin, end = epx.expert_range(E, R, rank)
        rng = np.random.default_rng(77 + rank)
        x, idx, w = make_inputs(rng, T)
        prepared = pf.prepare(x, idx, w)
        out = poisoned((T, H))
        pf.finalize(numpy_experts(prepared, fns[begin:end]), out)
        return rel_l2(f32(out), moe_out(fns, f32(x), idx, w))

    errs = run(groups, body)
    assert max(errs) < 1.5e-2, errs
    with pytest.raises(ValueError, match="ll_combine"):
        epx.DispatchConfig(ll_combine="rows")


@pytest.mark.parametrize("backend", ["naive", "allgather_reducescatter", "all2allv", "ht"])
def test_flat_combine_rounds_once_by_default(backend):
    """DispatchConfig.flat_combine: with the default "partial_fp32" prepare says expert_out is fp32 and the two-rank
    cancellation (rank 0's experts give 2^-9, rank 1's give 1 + (-1) ... summed: 1 + 2^-9 - 1) returns 2^-9; with
    "partial_bf16" (two roundings: rank 0's partial 1 + 2^-9 rounds to 1) it returns 0. A bad name raises ValueError."""
    E2, K2, T2 = 2, 2, 4
    groups = epx.make_cpu_groups(2, timeout_s=20)
    for mode, want in (("partial_fp32", 2.0 ** -9), ("partial_bf16", 0.0)):
        cfg = epx.DispatchConfig(hidden=H, num_experts=E2, top_k=K2, num_max_dispatch_tokens_per_rank=T2, flat_combine=mode)
        assert cfg.flat_combine == mode

        def body(rank):
            pf = epx.make_prepare_finalize(backend, groups[rank], cfg)
            tokens = T2 if rank == 0 else 0
            x = bits_bf16(np.ones((tokens, H), np.float32))
            idx = np.tile(np.array([[0, 1]], np.int32), (tokens, 1))  # expert 0 on rank 0, expert 1 on rank 1
            w = np.ones((tokens, K2), np.float32)
            p = pf.prepare(x, idx, w)
            assert p.expert_out_dtype == ("fp32" if mode == "partial_fp32" else "bf16")
            # Rank 0's partial: 1 + 2^-9 (its expert 0 gives it); rank 1's: -1.
            value = 1.0 + 2.0 ** -9 if rank == 0 else -1.0
            n = p.x.shape[0]
            y = np.full((n, H), value, np.float32)
            y[np.asarray(p.topk_idx).max(axis=1) < 0] = 0.0  # rows without a local selection are zeros
            out = poisoned((tokens, H))
            pf.finalize(y if mode == "partial_fp32" else bits_bf16(y), out)
            return f32(out)

        got = run(groups, body)[0]
        assert np.all(got == np.float32(want)), (backend, mode, np.unique(got))
    with pytest.raises(ValueError, match="flat_combine"):
        epx.DispatchConfig(flat_combine="fp32")
    with pytest.raises(ValueError, match="ll_combine"):
        cfg.ll_combine = "partial_fp16"


@pytest.mark.parametrize("ranks_per_node", [0, 1])
@pytest.mark.parametrize("dispatch_dtype", ["bf16", "fp8_e4m3"])
def test_ht_expert_contiguous_layout(experts, dispatch_dtype, ranks_per_node):
    """ht with DispatchConfig(expert_contiguous=True), flat (one node) and hierarchical (ranks_per_node=1):
    Prepared.contiguous is the m-grouped layout (offsets = prefix sum of recv_count, rows grouped by expert,
    pair_row points at the row of (n, topk_idx[n, k]) holding x[n]); experts written on it unweighted, then
    finalize(topk_weights=prepared.topk_weights) matches the reference MoE, and finalize without weights
    matches the reference with weight 1 per valid selection."""
    weights, fns = experts
    align = 4
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T,
                             dispatch_dtype=dispatch_dtype, expert_contiguous=True, expert_alignment=align)
    assert cfg.expert_contiguous and "expert_contiguous=True" in repr(cfg)
    groups = epx.make_cpu_groups(R, timeout_s=20, ranks_per_node=ranks_per_node)

    def body(rank):
        pf = epx.make_prepare_finalize("ht", groups[rank], cfg)
        assert pf.capabilities["hierarchical"] is (ranks_per_node == 1)
        begin, end = epx.expert_range(E, R, rank)
        errs = []
        for rnd, tokens in enumerate([T, 0 if rank == 1 else 5]):
            x, idx, w = make_inputs(np.random.default_rng(500 + 10 * rnd + rank), tokens)
            p = pf.prepare(x, idx, w)
            c = p.contiguous
            assert isinstance(c, epx.ExpertContiguous)
            counts, offs = np.asarray(p.recv_count), np.asarray(c.expert_offsets)
            L = end - begin
            assert offs.shape == (L + 1,) and offs[0] == 0 and np.array_equal(np.diff(offs), counts)
            assert c.num_rows == offs[-1] == c.x.shape[0] and np.all(counts % align == 0)
            row_expert, pair_row = np.asarray(c.row_expert), np.asarray(c.pair_row)
            lidx = np.asarray(p.topk_idx)
            assert pair_row.shape == lidx.shape == (p.num_recv_tokens, K)
            for l in range(L):
                seg = row_expert[offs[l]:offs[l + 1]]
                assert np.all((seg == l) | (seg == -1)) and np.all(np.diff((seg == -1).astype(int)) >= 0)  # padding last
            for n, k in zip(*np.nonzero(lidx >= 0)):
                row = pair_row[n, k]
                assert row_expert[row] == lidx[n, k] and np.array_equal(np.asarray(c.x)[row], np.asarray(p.x)[n])
            assert np.all(pair_row[lidx < 0] == -1)
            y = contiguous_experts(c, fns[begin:end])
            out = poisoned((tokens, H))
            assert pf.finalize(y, out, topk_weights=p.topk_weights) is out
            out1 = pf.finalize(y)  # unweighted: the weights would have been applied before the experts
            if tokens:
                errs.append(rel_l2(f32(out), moe_out(fns, f32(x), idx, w)))
                errs.append(rel_l2(f32(out1), moe_out(fns, f32(x), idx, np.ones_like(w))))
        return errs

    errs = [e for r in run(groups, body) for e in r]
    tol = 1.5e-2 if dispatch_dtype == "bf16" else 8e-2
    assert errs and max(errs) < tol, errs


@pytest.mark.parametrize("dispatch_dtype", ["bf16", "fp8_e4m3"])
def test_experts_apply_contiguous(experts, dispatch_dtype):
    """Experts.apply_contiguous: (1) on ht's Prepared.contiguous ([L + 1] offsets, padding rows), then finalize with
    the weights, matches the reference MoE; (2) rows sorted by expert with torch-style [L] cumulative offsets give
    each expert's numpy output, and rows past the last offset stay as they were; (3) decreasing offsets raise
    naming the entry."""
    weights, fns = experts
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T,
                             dispatch_dtype=dispatch_dtype, expert_contiguous=True, expert_alignment=4)
    groups = epx.make_cpu_groups(R, timeout_s=20)

    def body(rank):
        pf = epx.make_prepare_finalize("ht", groups[rank], cfg)
        begin, end = epx.expert_range(E, R, rank)
        ex = epx.Experts(weights[begin:end])
        x, idx, w = make_inputs(np.random.default_rng(800 + rank), T)
        p = pf.prepare(x, idx, w)
        c = p.contiguous
        y = ex.apply_contiguous(c.x, c.expert_offsets, x_scales=c.x_scales)
        out = pf.finalize(y, topk_weights=p.topk_weights)
        return rel_l2(f32(out), moe_out(fns, f32(x), idx, w))

    tol = 1.5e-2 if dispatch_dtype == "bf16" else 8e-2
    errs = run(groups, body)
    assert max(errs) < tol, errs
    if dispatch_dtype != "bf16":
        return
    # (2) torch's form on the CPU Experts of experts 0..2, 2 tail rows.
    ex = epx.Experts(weights[:3])
    counts = [5, 0, 9]
    rng = np.random.default_rng(42)
    xs = bits_bf16(rng.standard_normal((sum(counts) + 2, H)).astype(np.float32))
    offs = np.cumsum(counts).astype(np.int32)
    out = poisoned(xs.shape)
    assert ex.apply_contiguous(xs, offs, out) is out
    for l, (b, e) in enumerate(zip(np.concatenate([[0], offs[:-1]]), offs)):
        if e > b:
            assert rel_l2(f32(out[b:e]), fns[l](f32(xs[b:e]))) < 1e-2
    assert np.array_equal(out[offs[-1]:], poisoned((2, H)))  # rows past the last offset untouched
    # (3) decreasing offsets
    with pytest.raises(epx.InvalidArgument, match=r"expert_offsets\[2\]"):
        ex.apply_contiguous(xs, np.array([5, 9, 8], np.int32), out)


def test_experts_apply_contiguous_awkward_input(experts):
    """epx.Experts (the Python class) answers supports() and hidden as the C++ object does; apply_contiguous with bad
    input raises epx.InvalidArgument / TypeError naming the argument (x that is not 2-D or not a tensor also when out
    is allocated for it; x_scales given with bf16 x, as epx.Tensor or as numpy uint16 bits; fp8 x without x_scales),
    writes nothing, and the object then gives a fresh object's bytes."""
    weights, fns = experts
    ex = epx.Experts(weights[:2])
    assert ex.hidden == H
    assert ex.supports("contiguous") and ex.supports("flat") and ex.supports("expert_major")
    for bad in ["Contiguous", "", "expert-major", "flat "]:
        with pytest.raises(epx.InvalidArgument, match="layout"):
            ex.supports(bad)
    rng = np.random.default_rng(7)
    N = 6
    xs = bits_bf16(rng.standard_normal((N, H)).astype(np.float32))
    offs = np.array([2, N], np.int32)
    with pytest.raises(epx.InvalidArgument, match=r"x\.ndim = 1"):
        ex.apply_contiguous(xs[0], offs)
    with pytest.raises(epx.InvalidArgument, match=r"x\.ndim = 3"):
        ex.apply_contiguous(xs.reshape(2, 3, H), offs)
    with pytest.raises(TypeError, match="x"):
        ex.apply_contiguous(xs.tolist(), offs)
    out = poisoned((N, H))
    scales = np.ones((N, H // 128), np.float32)
    for x in (xs, epx.as_tensor(xs, "bf16")):  # bf16 x: numpy bits and epx.Tensor
        with pytest.raises(epx.InvalidArgument, match="x_scales"):
            ex.apply_contiguous(x, offs, out, x_scales=scales)
    for x in (np.zeros((N, H), np.uint8), epx.as_tensor(np.zeros((N, H), np.uint8), "fp8_e4m3")):  # fp8 x, no scales
        with pytest.raises(epx.InvalidArgument, match="x_scales"):
            ex.apply_contiguous(x, offs, out)
    assert np.array_equal(out, poisoned((N, H)))  # nothing written by the failed calls
    assert np.array_equal(ex.apply_contiguous(xs, offs, out), epx.Experts(weights[:2]).apply_contiguous(xs, offs))


@pytest.mark.parametrize("case", ["weights_to_ll", "weights_to_flat_ht", "wrong_weights_shape", "expert_contiguous_ll"])
def test_combine_weights_misuse_fails_on_every_rank(case):
    """finalize(topk_weights=) belongs to ht with expert_contiguous: given elsewhere, or with a wrong shape, on
    one rank, every rank raises (ValueError on the bad rank, epx.Error on the other) and none hangs;
    expert_contiguous on another backend is refused at creation on every rank."""
    backend = "ll" if case in ("weights_to_ll", "expert_contiguous_ll") else "ht"
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T,
                             expert_contiguous=case in ("wrong_weights_shape", "expert_contiguous_ll"))
    groups = epx.make_cpu_groups(R, timeout_s=20)
    x, idx, w = make_inputs(np.random.default_rng(9), 4)
    if case == "expert_contiguous_ll":
        errors = _both_ranks(groups, None, None, lambda rank, _: epx.make_prepare_finalize(backend, groups[rank], cfg))
        assert all(isinstance(e, ValueError) and "expert_contiguous" in str(e) for e in errors), errors
        return
    def call(rank, bad):
        pf = epx.make_prepare_finalize(backend, groups[rank], cfg)
        p = pf.prepare(x, idx, w)
        n = p.num_recv_tokens
        rows = p.contiguous.num_rows if p.contiguous is not None else n
        y = np.zeros((rows,) + tuple(p.x.shape[1:]) if p.contiguous is not None else p.x.shape,
                     np.float32 if p.expert_out_dtype == "fp32" else np.uint16)
        good_w = p.topk_weights if p.contiguous is not None else None
        tw = {"weights_to_ll": np.ones((4, K), np.float32), "weights_to_flat_ht": p.topk_weights,
              "wrong_weights_shape": np.ones((n + 1, K), np.float32)}[case] if bad else good_w
        pf.finalize(y, topk_weights=tw)

    errors = _both_ranks(groups, True, False, call)
    assert isinstance(errors[0], ValueError) and "topk_weights" in str(errors[0]), repr(errors[0])
    assert isinstance(errors[1], epx.Error) and "rank 0" in str(errors[1]), repr(errors[1])


@pytest.mark.parametrize("case", ["float32_x", "float64_x", "strided_x", "wrong_hidden", "over_capacity", "float_idx", "list_x"])
def test_bad_arguments_fail_on_every_rank(case):
    groups = epx.make_cpu_groups(R, timeout_s=20)
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T)
    rng = np.random.default_rng(5)
    x, idx, w = make_inputs(rng, 4)
    bad = {
        "float32_x": (f32(x), idx, w),
        "float64_x": (f32(x).astype(np.float64), idx, w),
        "strided_x": (np.asfortranarray(x), idx, w),
        "wrong_hidden": (x[:, :64].copy(), idx, w),
        "over_capacity": make_inputs(rng, T + 1),
        "float_idx": (x, idx.astype(np.float32), w),
        "list_x": (x.tolist(), idx, w),
    }[case]
    pfs = [None, None]

    def call(rank, args):
        if pfs[rank] is None:
            pfs[rank] = epx.make_prepare_finalize("ll", groups[rank], cfg)
        pfs[rank].prepare(*args)

    errors = _both_ranks(groups, bad, (x, idx, w), call)
    expected = TypeError if case == "list_x" else ValueError
    assert isinstance(errors[0], expected), repr(errors[0])
    assert isinstance(errors[1], epx.Error), repr(errors[1])  # the good rank is told, not left hanging
    # ... with the bad rank's own sentence (a float64 x once reached the peer as "x.dtype = uint8", the
    # placeholder the binding passes in the bad argument's place)
    assert f"rank 0 rejected its arguments: {errors[0]}" in str(errors[1]), (str(errors[0]), str(errors[1]))
    assert "= uint8: must be" not in str(errors[1]), str(errors[1])
    # the objects stay usable: a good round on both ranks still works
    def again(rank, args):
        p = pfs[rank].prepare(*args)
        pfs[rank].finalize(np.zeros(p.x.shape, np.uint16))

    assert _both_ranks(groups, (x, idx, w), (x, idx, w), again) == [None, None]
