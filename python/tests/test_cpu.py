"""CPU tests of the Python bindings (numpy only; ranks are threads of CPU groups): version, errors, DLPack,
Config, groups and run_ranks, the experts binding, torch CPU tensors and checkpoints. Run by ctest as
python_test (label cpu), with test_cpu_dispatch.py and test_cpu_layer.py (helpers: cpu_common.py). Every
result is compared with the plain-numpy reference in np_reference.py on fresh random inputs; outputs are
poisoned (NaN bit patterns) before the call that writes them."""

import json
import threading
import time

import numpy as np
import pytest

import epx
from cpu_common import H, E, K, R, T, f32, make_inputs, run, numpy_experts
from cpu_common import experts  # noqa: F401 - the module-scoped pytest fixture
from np_reference import moe_out, rel_l2, round_bf16


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
