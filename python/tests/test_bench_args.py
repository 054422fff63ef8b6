"""Argument handling of the GPU benchmark scripts under bench/, on the CPU: the scripts are loaded with a stub
torch module (they import torch at the top), so a check that must come before any GPU work can be seen to."""
import importlib.util
import pathlib
import sys
import types

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def load_bench(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # any torch use fails: AttributeError
    spec = importlib.util.spec_from_file_location(name, BENCH / (name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gemm_vs_torch_uneven_rows_never_negative(monkeypatch):
    """--uneven moves up to 256 rows between the experts of a pair (d = 16 ((7 j + 3) mod 33 - 16)), so --rows below
    256 gave experts a negative row count (decreasing offsets, found only on the GPU after the weights were built):
    refused by name before any torch call. The default split keeps every count >= 0 and the total at L * rows."""
    g = load_bench(monkeypatch, "gemm_vs_torch")
    counts = g.counts_for(128, 256, True)
    assert min(counts) == 0 and sum(counts) == 128 * 256
    for argv in (["--uneven", "--rows", "100"], ["--uneven", "--rows", "255", "--experts", "20"]):
        monkeypatch.setattr(sys, "argv", ["gemm_vs_torch.py"] + argv)
        with pytest.raises(SystemExit) as e:
            g.main()
        assert "--rows" in str(e.value.code), e.value.code
    # Few enough experts that the largest move is not reached: accepted (fails later, at the stub torch).
    monkeypatch.setattr(sys, "argv", ["gemm_vs_torch.py", "--uneven", "--rows", "255", "--experts", "2"])
    with pytest.raises(AttributeError):
        g.main()


@pytest.mark.parametrize("argv,word", [(["--cool", "-1"], "--cool"), (["--json", "/nonexistent-dir/x.json"], "--json")])
def test_gemm_vs_torch_refuses_late_failures_up_front(monkeypatch, argv, word):
    """A negative --cool (time.sleep raised after the weights, tokens and check had run) and a --json path that cannot be
    written (found after every round) stop the script before any torch call, naming the flag."""
    g = load_bench(monkeypatch, "gemm_vs_torch")
    monkeypatch.setattr(sys, "argv", ["gemm_vs_torch.py"] + argv)
    with pytest.raises(SystemExit) as e:
        g.main()
    assert word in str(e.value.code), e.value.code
