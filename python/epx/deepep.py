"""DeepEP-Buffer-shaped entry points over epx's ll and ht backends, for users migrating from DeepEP.

Names, argument order and result tuples follow deep_ep.Buffer where that costs nothing:

    buf = epx.deepep.Buffer(group)          # an epx.Group or a torch.distributed ProcessGroup
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                                       num_experts, topk_weights=w, use_fp8=True)
    combined_x, event, hook = buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=w, num_experts=num_experts)
    combined_x, _, event = buf.combine(expert_out, handle)

Differences from DeepEP, each one because epx's backends are stream-ordered prepare/finalize objects:
- topk_weights go to the dispatch (as in vLLM's prepare), not the combine. DeepEP's low_latency_combine
  weights the expert outputs by the topk_weights it is given; epx's ll weights them with the ones the
  dispatch carried (partial sums on the expert side), so low_latency_combine's topk_weights must be the
  very object given to low_latency_dispatch(topk_weights=...); another tensor raises Unsupported (see
  Errors below; its values are not read: comparing them would synchronise the device). topk_idx is not
  read again.
- DeepEP's HT combine(x, handle, topk_weights=w) sums x without weights (as here) and also reduces w
  to the source ranks (its second result). epx's ht combine does not carry top-k weights back:
  topk_weights other than None raises Unsupported (see Errors), and the second result is None (as
  DeepEP's when topk_weights is None). The reduced weights of an unchanged recv_topk_weights are the
  dispatch's own topk_weights where topk_idx >= 0 (0 where -1).
- event and hook are always None: every call is ordered on the caller's stream (stream=None means
  torch.cuda.current_stream()); there is no async_finish / return_recv_hook split.
- HT dispatch takes bf16 x (use_fp8=True quantizes to FP8 1x128 inside the dispatch) and recomputes the
  layout itself: the get_dispatch_layout tensors are accepted and not needed; cached-handle dispatch is
  not supported (Unsupported).
- Buffer sizes (num_nvl_bytes, num_rdma_bytes) are derived by epx from the shapes; they are accepted and
  ignored. HT dispatch without num_max_dispatch_tokens_per_rank agrees on a capacity over the ranks each
  call (the largest T rounded up to a power of two >= 128: one small all-gather on the host). The backends are created at the first call of each shape (collective), so the first call of
  a shape must not be inside CUDA-graph capture.

Errors (BEHAVIOUR.md: a bad argument on one rank must not leave the others waiting): bad tensors (dtype,
shape, ids, T over the capacity) are checked inside the collective calls and raise on every rank. The
shim's own checks do too: HT dispatch's (cached handle, topk_idx/topk_weights None, no num_experts) go
through one all-gather of the host (the capacity's, when it agrees on one; one more otherwise), and the
combines' topk_weights checks through the combine's own status exchange, which CPU groups run; ll and ht
on CUDA check combine arguments on their own rank with no host exchange (graph-safe), so there a rejected
combine raises on its rank; with ll the others' combines then end at once (their out NaN) and their next
combine (after its launch) or check() raises epx.InvalidArgument naming that rank (the rejecting rank's flags carry a marker); with ht the
others' combine kernels raise epx.Timeout. Not covered, because no
collective runs there: get_dispatch_layout (a local computation, as in DeepEP) raises on the rank that
holds a bad id only, HT dispatch with num_worst_tokens (graph-safe mode: no host all-gather) raises its
own checks on that rank only, and a Python-level misuse (a missing argument, x not 2-D) raises before
any collective. The other ranks then wait in their next collective until the group's timeout_s (60 s
by default; make_cpu_groups / group_from_torch / make_nccl_group take it) and raise epx.Timeout
(TimeoutError) naming the operation; under epx.run_ranks (CPU groups) the raising rank aborts the
others at once.
"""

from __future__ import annotations

from typing import Optional

from . import _epx
from ._api import Prepared, PrepareFinalize, group_from_torch
from ._frameworks import framework


def _ht_capacity(tokens: int) -> int:
    """num_max_dispatch_tokens_per_rank for an ht dispatch that names none: DeepEP's normal mode has no such
    bound, but epx's ht on CUDA sizes its buffers at create and all ranks must agree on it. So: the largest T
    of any rank in this call (gathered by Buffer._agree), rounded up to a power of two >= 128, so that later
    calls up to that size reuse the backend."""
    capacity = 128
    while capacity < tokens:
        capacity *= 2
    return capacity


def _raise_bad_id(t: int, k: int, value: int, num_experts: int):
    """The dispatch's id rule (prepare_finalize_base.cpp bad_topk_id), for the host-side layout."""
    raise _epx.InvalidArgument(f"epx.deepep.Buffer.get_dispatch_layout: topk_idx[{t}, {k}] = {value}: must be -1 (no selection) "
                               f"or an expert id in [0, num_experts = {num_experts})")


class Handle:
    """What combine needs from its dispatch: the backend object, its prepare result and the topk_weights
    object the dispatch carried (ll: the only weights its combine applies)."""

    def __init__(self, backend: PrepareFinalize, prepared: Prepared, topk_weights=None):
        self.backend = backend
        self.prepared = prepared
        self.topk_weights = topk_weights


class Buffer:
    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 1, *, ll_backend: str = "ll", ht_backend: str = "ht", **_ignored):
        self.group = group if isinstance(group, _epx.Group) else group_from_torch(group)
        self.low_latency_mode = low_latency_mode
        self.ll_backend, self.ht_backend = ll_backend, ht_backend
        self._backends = {}

    def _backend(self, name: str, **cfg) -> PrepareFinalize:
        key = (name,) + tuple(sorted(cfg.items()))
        pf = self._backends.get(key)
        if pf is None:
            pf = PrepareFinalize(name, self.group, _epx.DispatchConfig(**cfg))
            self._backends[key] = pf
        return pf

    # ---- low latency (ll: expert-major [L, R * num_max_dispatch_tokens_per_rank, H]) ----------------
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int, *, topk_weights,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, stream=None):
        """x [T, H] bf16, topk_idx [T, K] (int64 as DeepEP, or int32), topk_weights [T, K] fp32.
        Returns ((recv_x, recv_x_scales) if use_fp8 else recv_x, recv_count [L] int32, handle, None, None)
        with recv_x [L, R * num_max_dispatch_tokens_per_rank, H] (fp8_e4m3 + fp32 scales [.., H/128])."""
        pf = self._backend(self.ll_backend, hidden=int(x.shape[1]), num_experts=int(num_experts), top_k=int(topk_idx.shape[1]),
                           num_max_dispatch_tokens_per_rank=int(num_max_dispatch_tokens_per_rank),
                           dispatch_dtype="fp8_e4m3" if use_fp8 else "bf16", use_ue8m0=bool(use_ue8m0 or round_scale))
        p = pf.prepare(x, topk_idx, topk_weights, stream)
        recv_x = (p.x, p.x_scales) if use_fp8 else p.x
        return recv_x, p.recv_count, Handle(pf, p, topk_weights), None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle: Handle, *, out=None, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False, stream=None):
        """x: expert outputs [L, R * num_max_dispatch_tokens_per_rank, H] bf16. Returns (combined_x [T, H], None, None),
        combined_x[t] = sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x_t) (DeepEP: reduce with weights).
        topk_weights must be the object given to low_latency_dispatch(topk_weights=...), whose values the
        combine applies (they travelled with the dispatch); another tensor raises Unsupported
        (NotImplementedError) on every rank, naming this rule. topk_idx is not read."""
        reject = None
        if topk_weights is not handle.topk_weights:
            reject = _epx.Unsupported(
                "epx.deepep.Buffer.low_latency_combine: topk_weights = a different tensor than low_latency_dispatch's: must be "
                "the topk_weights object given to low_latency_dispatch (epx's ll applies the weights the dispatch carried, on "
                "the expert side; it cannot weight by other values at combine)")
        return handle.backend.finalize(x, out, stream, reject=reject), None, None

    # ---- high throughput (ht: flat [N_recv, H], rank-deduplicated) ----------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, None),
        computed from topk_idx with epx's expert placement (contiguous ranges, sizes differ by at most one).
        An id other than -1 or [0, num_experts) raises InvalidArgument (ValueError) naming topk_idx[t, k]."""
        R = self.group.size
        bounds = [_epx.expert_range(int(num_experts), R, r)[1] for r in range(R)]
        if framework(topk_idx) == "torch":
            import torch

            idx = topk_idx.long()
            bad = ((idx < -1) | (idx >= int(num_experts))).nonzero()
            if bad.numel():
                t, k = (int(v) for v in bad[0])
                _raise_bad_id(t, k, int(idx[t, k]), int(num_experts))
            valid = idx >= 0
            rank_of = torch.bucketize(idx.clamp(min=0), torch.tensor(bounds, device=idx.device), right=True)
            in_rank = torch.zeros((idx.shape[0], R), dtype=torch.bool, device=idx.device)
            for r in range(R):
                in_rank[:, r] = ((rank_of == r) & valid).any(dim=1)
            per_rank = in_rank.sum(dim=0).to(torch.int32)
            per_expert = torch.bincount(idx[valid], minlength=int(num_experts)).to(torch.int32)
            return per_rank, None, per_expert, in_rank, None
        import numpy as np

        idx = np.from_dlpack(topk_idx).astype(np.int64)
        bad = np.argwhere((idx < -1) | (idx >= int(num_experts)))
        if bad.size:
            t, k = (int(v) for v in bad[0])
            _raise_bad_id(t, k, int(idx[t, k]), int(num_experts))
        valid = idx >= 0
        rank_of = np.searchsorted(np.asarray(bounds), np.clip(idx, 0, None), side="right")
        in_rank = np.stack([((rank_of == r) & valid).any(axis=1) for r in range(R)], axis=1) if idx.shape[0] else \
            np.zeros((0, R), dtype=bool)
        per_rank = in_rank.sum(axis=0).astype(np.int32)
        per_expert = np.bincount(idx[valid], minlength=int(num_experts)).astype(np.int32)
        return per_rank, None, per_expert, in_rank, None

    def dispatch(self, x, handle: Optional[Handle] = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment: int = 1,
                 config=None, previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                 num_experts: Optional[int] = None, num_max_dispatch_tokens_per_rank: int = 0, use_fp8: bool = False,
                 num_worst_tokens: int = 0, stream=None):
        """x [T, H] bf16 -> (recv_x [N_recv, H], recv_topk_idx [N_recv, K] local expert or -1, recv_topk_weights,
        num_recv_tokens_per_expert_list (Python ints; reading them synchronises), handle, None).
        num_worst_tokens > 0 (DeepEP's graph-safe mode): epx's use_worst_case_sizing, which needs
        num_max_dispatch_tokens_per_rank; recv_x then has R * num_max_dispatch_tokens_per_rank rows (rows past
        N_recv have recv_topk_idx -1) and the list is empty (no host read)."""
        error = None
        try:
            if handle is not None:
                raise _epx.Unsupported("epx.deepep.Buffer.dispatch: handle = cached: epx recomputes the layout every call; "
                                       "pass topk_idx and topk_weights instead")
            if topk_idx is None or topk_weights is None:
                raise _epx.InvalidArgument("epx.deepep.Buffer.dispatch: topk_idx/topk_weights = None: both are required")
            if num_experts is None:
                if num_tokens_per_expert is None:
                    raise _epx.InvalidArgument("epx.deepep.Buffer.dispatch: num_experts = None: pass num_experts= or "
                                               "num_tokens_per_expert")
                num_experts = int(num_tokens_per_expert.shape[0])
        except _epx.Error as e:
            error = e
        capacity = int(num_max_dispatch_tokens_per_rank)
        if num_worst_tokens > 0:
            if error is not None:  # graph-safe mode: no host collective here (module docstring: Errors)
                raise error
        else:
            # One all-gather of the host: every rank learns whether a rank's checks failed (then all raise),
            # and, without a capacity, the largest T.
            tokens = self._agree("epx.deepep.Buffer.dispatch", error, int(x.shape[0]) if len(x.shape) else 0)
            if capacity <= 0:
                capacity = _ht_capacity(max(tokens))
        pf = self._backend(self.ht_backend, hidden=int(x.shape[1]), num_experts=int(num_experts), top_k=int(topk_idx.shape[1]),
                           num_max_dispatch_tokens_per_rank=capacity,
                           dispatch_dtype="fp8_e4m3" if use_fp8 else "bf16", expert_alignment=int(expert_alignment),
                           use_worst_case_sizing=num_worst_tokens > 0, flat_combine="partial_bf16")
        p = pf.prepare(x, topk_idx, topk_weights, stream)
        counts = [] if num_worst_tokens > 0 else [int(c) for c in p.recv_count.tolist()]
        recv_x = (p.x, p.x_scales) if use_fp8 else p.x
        return recv_x, p.topk_idx, p.topk_weights, counts, Handle(pf, p, topk_weights), None

    def _agree(self, op: str, error: Optional[Exception], value: int) -> list:
        """Collective: all-gathers value (>= 0) or this rank's failure. If any rank failed, every rank raises:
        the failing rank its own error, the others the same type with "<op>: rank r rejected its arguments:
        <its sentence>" (the sentence travels 8 bytes per all-gather: the error path only). Else returns the
        values of all ranks."""
        kind = 0 if error is None else (2 if isinstance(error, NotImplementedError) else 1)
        got = self.group.all_gather_i64(-kind if kind else int(value))
        bad = [r for r, v in enumerate(got) if v < 0]
        if not bad:
            return got
        first = bad[0]
        text = str(error).encode() if self.group.rank == first else b""
        length = self.group.all_gather_i64(len(text))[first]
        chunks = []
        for i in range(0, length, 8):
            word = int.from_bytes(text[i:i + 8].ljust(8, b"\0"), "little", signed=True) if text else 0
            chunks.append(self.group.all_gather_i64(word)[first].to_bytes(8, "little", signed=True))
        if error is not None:
            raise error
        message = b"".join(chunks)[:length].decode(errors="replace")
        cls = _epx.Unsupported if got[first] == -2 else _epx.InvalidArgument
        raise cls(f"{op}: rank {first} rejected its arguments: {message}")

    def combine(self, x, handle: Handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False, *, out=None, stream=None):
        """x: expert outputs [N_recv, H] bf16 (weighted per row as epx Experts Flat writes them), summed without
        weights in fp32 and rounded once (DeepEP's HT combine; the shim's ht runs flat_combine "partial_bf16", as
        DeepEP's combine takes bf16 rows). Returns (combined_x [T, H], None, None). topk_weights: must be None;
        DeepEP reduces them to the source ranks as its second result, epx's ht does not carry weights back:
        given, it raises Unsupported (NotImplementedError) on every rank, naming this rule."""
        reject = None
        if topk_weights is not None:
            reject = _epx.Unsupported(
                "epx.deepep.Buffer.combine: topk_weights = a tensor: must be None (epx's ht combine sums the expert rows "
                "without weights, as DeepEP's, but does not reduce top-k weights back to the source ranks; the reduced "
                "weights of an unchanged recv_topk_weights are the dispatch's own topk_weights where topk_idx >= 0)")
        return handle.backend.finalize(x, out, stream, reject=reject), None, None
