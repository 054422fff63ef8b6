"""CPU tests of the Python bindings (numpy only; ranks are threads of CPU groups). Run by ctest as
python_test (label cpu). Every result is compared with the plain-numpy reference in np_reference.py
on fresh random inputs; outputs are poisoned (NaN bit patterns) before the call that writes them."""

import json
import threading
import time

import numpy as np
import pytest

import epx
from np_reference import bits_bf16, expert_fn, moe_out, rel_l2, round_bf16

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


def test_version_and_build():
    assert epx.__version__.count(".") == 2
    assert isinstance(epx.built_with_cuda(), bool)
    assert epx.backend_names() == ["naive", "allgather_reducescatter", "all2allv", "ll", "ht"]
    assert "deepseek-v3-mini" in epx.preset_names()


def test_error_hierarchy():
    assert issubclass(epx.InvalidArgument, ValueError) and issubclass(epx.InvalidArgument, epx.Error)
    assert issubclass(epx.Unsupported, NotImplementedError) and issubclass(epx.Unsupported, epx.Error)
    assert issubclass(epx.Timeout, TimeoutError) and issubclass(epx.Timeout, epx.Error)
    assert issubclass(epx.CommError, epx.Error) and issubclass(epx.Error, RuntimeError)
    with pytest.raises(ValueError, match="deepseek-v3"):
        epx.preset("deepseek-v9")


def test_dlpack_zero_copy_both_ways():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 16)).astype(np.float32)
    t = epx.from_float(a, "bf16")
    assert (t.shape, t.dtype, t.device, t.strides) == ((5, 16), "bf16", "cpu", (16, 1))
    np.testing.assert_array_equal(np.from_dlpack(t.float()), round_bf16(a))
    bits = np.from_dlpack(t.bits())  # numpy reads epx memory (read-only array in numpy 1.x)
    assert bits.dtype == np.uint16 and bits.ctypes.data == t.data_ptr
    view = epx.as_tensor(bits, "bf16")  # and epx reads numpy memory back, also from a read-only array
    assert view.data_ptr == t.data_ptr and view.dtype == "bf16"
    f = np.arange(12, dtype=np.float32).reshape(3, 4)
    ft = epx.as_tensor(f)
    assert ft.data_ptr == f.ctypes.data and ft.dtype == "fp32"
    f[1, 2] = 42.0  # same memory
    assert np.from_dlpack(ft)[1, 2] == 42.0
    # DLPack 1.x capsules (versioned) as well as legacy ones
    assert type(t.__dlpack__(max_version=(1, 0))).__name__ == "PyCapsule"
    assert t.__dlpack_device__() == (1, 0)


def test_bad_tensor_arguments_raise():
    with pytest.raises(TypeError, match="expected a tensor"):
        epx.as_tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="float64"):
        epx.as_tensor(np.zeros(3))
    with pytest.raises(ValueError, match="ndim"):
        epx.as_tensor(np.zeros((1, 1, 1, 1, 2), np.float32))
    if not epx.built_with_cuda():
        with pytest.raises(NotImplementedError, match="CUDA"):
            epx.empty([2, 2], "bf16", "cuda:0")
    with pytest.raises(ValueError, match="device"):
        epx.empty([2], "bf16", "tpu")


def test_config_json_and_env(tmp_path):
    p = tmp_path / "epx.json"
    p.write_text(json.dumps({"timeout_s": 7.5, "moe.chunk_size": 32}))
    c = epx.Config.load(str(p))
    assert c.timeout_s == 7.5 and c.moe_chunk_size == 32
    assert dict(c.sources)["timeout_s"].startswith("json")
    c.set("fhmoe.max_tokens", 64)
    assert c.fhmoe_max_tokens == 64 and dict(c.sources)["fhmoe.max_tokens"] == "api"
    with pytest.raises(ValueError, match="timeout_s"):
        c.set("timeout_sec", 1)  # unknown key: the nearest known one is suggested
    assert any(line.startswith("timeout_s") for line in c.describe())


def test_config_docstrings_come_from_the_registry():
    """Every knob of the registry (epx.Config.knobs(), what `epx info --knobs` prints) is an attribute whose
    docstring carries its meaning, type, default, rule, JSON key and variable; the class docstring lists them all;
    the defaults are the attributes' values on a fresh Config."""
    knobs = epx.Config.knobs()
    assert len(knobs) >= 15 and {"key", "env", "attr", "type", "default", "rule", "meaning"} <= set(knobs[0])
    c = epx.Config()
    for k in knobs:
        doc = getattr(epx.Config, k["attr"]).__doc__
        for part in (k["meaning"], k["rule"], k["key"], k["env"], "default " + k["default"]):
            assert part in doc, (k["key"], part, doc)
        assert k["attr"] + " (" + k["key"] + ";" in epx.Config.__doc__, k["key"]
        assert str(getattr(c, k["attr"])) == k["default"] or float(getattr(c, k["attr"])) == float(k["default"]), k["key"]
    assert "| `ll.num_blocks` |" in epx.Config.knobs_markdown("ll.")


def test_config_set_and_apply_json_validate():
    """Config.set / apply_json hold the same rules as attribute assignment: a value that parses but breaks
    its field's rule (ht.num_sms = 0, ll.combine_wait = "flags", ll.warps_per_block = 6) raises ValueError naming
    the key, value and rule, and the Config keeps its old values (also the other keys of that JSON)."""
    c = epx.Config()
    for key, bad, attr in (("ht.num_sms", 0, "ht_num_sms"), ("ll.combine_wait", "flags", "ll_combine_wait"),
                           ("ll.warps_per_block", 6, "ll_warps_per_block"), ("timeout_s", -1, "timeout_s")):
        before = getattr(c, attr)
        with pytest.raises(ValueError, match=key.replace(".", r"\.") + " = " + str(bad) + ": must"):
            c.set(key, bad)
        assert getattr(c, attr) == before, key
        with pytest.raises(ValueError, match=key.replace(".", r"\.") + " = " + str(bad) + ": must"):
            c.apply_json(json.dumps({"moe.chunk_size": 8, key: bad}))
        assert getattr(c, attr) == before and c.moe_chunk_size == 0, key
        assert "api" not in dict(c.sources).values() and "python" not in dict(c.sources).values(), c.sources
    c.apply_json(json.dumps({"ht.num_sms": 24, "ll.combine_wait": "data"}))
    assert (c.ht_num_sms, c.ll_combine_wait) == (24, "data")


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


def test_config_launch_settings(monkeypatch):
    """Config exposes ll.combine_wait / ht.num_sms (and the other launch settings) by attribute: defaults, assignment
    recorded as source "api", bad values raise ValueError naming the key and leave the old value, the EPX_*
    variables reach Config.load(); make_prepare_finalize(settings=) and ModularMoE(config=) take a Config."""
    c = epx.Config()
    assert (c.ll_combine_wait, c.ll_combine) == ("flag", "partial_fp32")
    c.ll_combine_wait, c.ll_num_blocks, c.ht_num_sms, c.ht_pdl = "data", 8, 24, 0
    assert (c.ll_combine_wait, c.ll_num_blocks, c.ht_num_sms, c.ht_pdl) == ("data", 8, 24, 0)
    src = dict(c.sources)
    assert src["ll.combine_wait"] == "api" and src["ll.num_blocks"] == "api" and src["ht.num_sms"] == "api"
    for attr, bad, key in (("ll_combine_wait", "rows", "ll.combine_wait"), ("ll_num_blocks", -1, "ll.num_blocks"),
                           ("ht_num_sms", 0, "ht.num_sms"), ("ll_warps_per_block", 6, "ll.warps_per_block"),
                           ("ht_chunk_rows", "many", "ht.chunk_rows"), ("timeout_s", -1, "timeout_s")):
        before = getattr(c, attr)
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            setattr(c, attr, bad)
        assert getattr(c, attr) == before, attr
    monkeypatch.setenv("EPX_LL_COMBINE_WAIT", "data")
    monkeypatch.setenv("EPX_LL_NUM_BLOCKS", "8")
    env = epx.Config.load()
    assert (env.ll_combine_wait, env.ll_num_blocks) == ("data", 8)
    assert dict(env.sources)["ll.combine_wait"] == "env EPX_LL_COMBINE_WAIT"
    monkeypatch.setenv("EPX_LL_COMBINE_WAIT", "sometimes")
    with pytest.raises(ValueError, match=r"ll\.combine_wait"):
        epx.Config.load()
    monkeypatch.delenv("EPX_LL_COMBINE_WAIT")
    monkeypatch.delenv("EPX_LL_NUM_BLOCKS")

    groups = epx.make_cpu_groups(R, timeout_s=20)
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T)

    def body(rank):  # the CPU backends have no launch settings: the Config is accepted and ignored
        pf = epx.make_prepare_finalize("ll", groups[rank], cfg, settings=c)
        x, idx, w = make_inputs(np.random.default_rng(rank), 4)
        p = pf.prepare(x, idx, w)
        pf.finalize(np.zeros(p.x.shape, np.uint16))
        return pf.config.num_max_dispatch_tokens_per_rank

    assert run(groups, body) == [T, T]


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


def test_make_cpu_groups_rejects_a_negative_ranks_per_node():
    """ranks_per_node = 0 (the default) is one node; a negative count is a mistake, not one node."""
    assert len(epx.make_cpu_groups(4, 5, 0)) == 4
    with pytest.raises(ValueError, match=r"ranks_per_node = -2: must be"):
        epx.make_cpu_groups(4, 5, -2)


def test_make_virtual_cuda_groups_checks_its_arguments_first():
    """Virtual ranks (threads on one GPU): a bad num_ranks or ranks_per_node is a ValueError naming it, raised
    before any GPU is asked for (so also here, without one); a CPU-only build raises NotImplementedError."""
    assert "ranks_per_gpu" in dir(epx.Group)
    assert epx.make_cpu_groups(2)[0].ranks_per_gpu == 1
    if not epx.built_with_cuda():
        with pytest.raises(NotImplementedError):
            epx.make_virtual_cuda_groups(2)
        return
    for kwargs, what in [({"num_ranks": 0}, "num_ranks = 0"), ({"num_ranks": 65}, "num_ranks = 65"),
                         ({"num_ranks": 4, "ranks_per_node": 3}, "ranks_per_node = 3")]:
        with pytest.raises(ValueError, match=what):
            epx.make_virtual_cuda_groups(**kwargs)


def test_run_ranks_propagates_python_errors():
    groups = epx.make_cpu_groups(R, timeout_s=30)

    def body(rank):
        if rank == 0:
            raise KeyError("rank 0 fails")
        groups[rank].barrier()  # would wait for rank 0 forever without the abort

    t0 = time.monotonic()
    with pytest.raises(KeyError, match="rank 0 fails"):
        epx.run_ranks(groups, body)
    assert time.monotonic() - t0 < 10


def test_ranks_run_in_parallel_without_the_gil():
    """Both ranks must be inside a collective at once: holding the GIL there would deadlock."""
    groups = epx.make_cpu_groups(R, timeout_s=10)
    seen = []
    lock = threading.Lock()

    def body(rank):
        v = groups[rank].all_gather_i64(10 + rank)
        with lock:
            seen.append(tuple(v))

    epx.run_ranks(groups, body)
    assert seen == [(10, 11), (10, 11)]


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


def test_experts_binding_matches_numpy(experts):
    """epx.Experts (CPU) on a Flat prepare result equals the numpy experts."""
    weights, fns = experts
    groups = epx.make_cpu_groups(R, timeout_s=20)
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T)

    def body(rank):
        begin, end = epx.expert_range(E, R, rank)
        ex = epx.make_experts(weights[begin:end], "cpu")
        assert ex.num_local_experts == end - begin
        pf = epx.make_prepare_finalize("all2allv", groups[rank], cfg)
        x, idx, w = make_inputs(np.random.default_rng(9 + rank), T)
        prepared = pf.prepare(x, idx, w)
        mine = ex.apply(prepared)
        ref = numpy_experts(prepared, fns[begin:end])
        err = rel_l2(f32(mine), f32(ref))
        pf.finalize(mine)
        return err

    assert max(run(groups, body)) < 1e-2


def test_torch_cpu_tensors_in_and_out(experts):
    """torch CPU tensors (bf16) through a CPU group: results are torch tensors sharing epx's memory, the
    output is written in place, and the result matches the numpy reference. Skips without torch."""
    torch = pytest.importorskip("torch")
    weights, fns = experts
    groups = epx.make_cpu_groups(R, timeout_s=20)
    cfg = epx.DispatchConfig(hidden=H, num_experts=E, top_k=K, num_max_dispatch_tokens_per_rank=T)

    def body(rank):
        pf = epx.make_prepare_finalize("ht", groups[rank], cfg)
        begin, end = epx.expert_range(E, R, rank)
        x_bits, idx, w = make_inputs(np.random.default_rng(70 + rank), T)
        x = torch.from_numpy(f32(x_bits)).to(torch.bfloat16)
        p = pf.prepare(x, torch.from_numpy(idx).long(), torch.from_numpy(w))
        assert isinstance(p.x, torch.Tensor) and p.x.dtype == torch.bfloat16 and p.x.data_ptr() == p.raw.x.data_ptr
        assert isinstance(p.recv_count, torch.Tensor) and p.recv_count.dtype == torch.int32
        y = epx.make_experts(weights[begin:end]).apply(p)
        assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
        assert pf.finalize(y, out) is out
        return rel_l2(out.float().numpy(), moe_out(fns, f32(x_bits), idx, w))

    assert max(run(groups, body)) < 1.5e-2


def test_versioned_dlpack_round_trip():
    """DLPack 1.x (versioned) capsules: exported by epx.Tensor on request, consumed by epx, deleter run."""

    class Versioned:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__(max_version=(1, 0))

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    t = epx.from_float(np.arange(6, dtype=np.float32).reshape(2, 3), "bf16")
    v = epx.as_tensor(Versioned(t))
    assert (v.data_ptr, v.shape, v.dtype) == (t.data_ptr, (2, 3), "bf16")
    np.testing.assert_array_equal(np.from_dlpack(v.float()), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_checkpoint_round_trip(tmp_path):
    """write_moe_checkpoint then load_moe_layer (Mixtral convention, 2 shards): the same weights, and
    rank 1's load holds only its experts."""
    w = epx.MoEWeights.random("mixtral-8x7b-mini", seed=4)
    epx.write_moe_checkpoint(str(tmp_path), w, convention="mixtral", layer=3, num_shards=2, router_dtype="F32")
    loaded, notes, info = epx.load_moe_layer(str(tmp_path), 3)
    assert info["convention"] == "mixtral" and info["layer"] == 3 and isinstance(notes, list)
    assert loaded.config.router.num_experts == w.config.router.num_experts
    np.testing.assert_array_equal(np.from_dlpack(loaded.router_weight), np.from_dlpack(w.router_weight))
    for a, b in zip(loaded.experts, w.experts):
        np.testing.assert_array_equal(np.from_dlpack(a.w13_float()), np.from_dlpack(b.w13_float()))
        np.testing.assert_array_equal(np.from_dlpack(a.w2_float()), np.from_dlpack(b.w2_float()))
    begin, end = epx.expert_range(w.config.router.num_experts, 2, 1)
    part, _, _ = epx.load_moe_layer(str(tmp_path), 3, expert_begin=begin, expert_end=end)
    assert [e is not None for e in part.experts] == [begin <= e < end for e in range(len(part.experts))]
    with pytest.raises(ValueError):
        epx.load_moe_layer(str(tmp_path / "missing"), 0)
