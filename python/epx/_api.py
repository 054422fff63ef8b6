"""The Python-facing API over epx._epx: results in the caller's framework, default streams, outputs
allocated when not given, groups from torch.distributed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from . import _epx
from ._frameworks import empty_bf16, empty_fp32, framework, resolve_stream, to_framework


@dataclass
class ExpertContiguous:
    """ht with DispatchConfig(expert_contiguous=True): the received rows grouped by local expert for a
    grouped GEMM (the m-grouped contiguous layout of DeepGEMM / vLLM's DeepEP-HT path; include/epx/dispatch.h
    ExpertContiguousLayout), in the framework of prepare's x, views valid until the next prepare.

    x               [M, H] bf16 | fp8_e4m3 (as Prepared.x); received row n appears once per distinct local
                    expert it selects; expert l owns rows [expert_offsets[l], expert_offsets[l + 1]):
                    its rows in received-row order, then zero padding rows up to expert_alignment
    x_scales        fp8: [M, H/128] fp32 (0 in padding rows); else None
    expert_offsets  [L + 1] int32, exclusive prefix sum of recv_count (expert_offsets[L] = M)
    row_expert      [M] int32 local expert of each row, -1 = padding (DeepGEMM m_indices)
    pair_row        [N_recv, K] int32 row of (n, topk_idx[n, k]) in x, -1 where topk_idx is -1
    num_rows        M (ht on CUDA with use_worst_case_sizing: the row capacity; M is expert_offsets[L] on the device)

    The experts write expert_out [M, H] bf16, row i = expert row_expert[i] applied to x[i], unweighted;
    finalize(expert_out, topk_weights=prepared.topk_weights) weights and reduces them (or pass no
    topk_weights when the weights were applied before the experts)."""

    x: Any
    x_scales: Any
    expert_offsets: Any
    row_expert: Any
    pair_row: Any
    num_rows: int


@dataclass
class Prepared:
    """What prepare (dispatch) delivers, in the framework of prepare's x (views into the backend's
    buffers, valid until the next prepare of the same object).

    layout          "expert_major" (ll: x [L, cap, H], recv_count [L]) or "flat" (x [N_recv, H] with
                    per-row topk_idx / topk_weights [N_recv, K], local expert id or -1)
    x               bf16, or fp8_e4m3 when dispatch_dtype is fp8 (then x_scales [.., H/128] fp32)
    recv_count      [L] int32 tokens per local expert (ht: aligned to expert_alignment)
    topk_idx        Flat: [N_recv, K] int32 local expert index of each received row's selections, -1 = none
                    (another rank's expert or no selection); ExpertMajor: None
    topk_weights    Flat: [N_recv, K] fp32, the source's topk_weights for those selections; ExpertMajor: None
    num_recv_tokens Flat: N_recv (ht with use_worst_case_sizing: the row capacity); ExpertMajor: sum of recv_count
                    (-1 for ll on CUDA, where only the device knows it)
    raw             the epx._epx.PrepareResult (what Experts.apply takes)
    num_recv_tokens_device  ht on CUDA: [1] int32 N_recv on the device; else None
    contiguous      ht with DispatchConfig(expert_contiguous=True): an ExpertContiguous; else None
    expert_out_dtype  what finalize takes as expert_out: "fp32" for the Flat layout with DispatchConfig.flat_combine
                    "partial_fp32" (the default: each rank's weighted partial stays fp32 until the one rounding),
                    else "bf16"; Experts.apply allocates its out in it
    """

    layout: str
    x: Any
    x_scales: Any
    recv_count: Any
    topk_idx: Any
    topk_weights: Any
    num_recv_tokens: int
    raw: Any
    num_recv_tokens_device: Any = None
    contiguous: Optional[ExpertContiguous] = None
    expert_out_dtype: str = "bf16"


class PrepareFinalize:
    """One dispatch backend on one rank (vLLM: FusedMoEPrepareAndFinalize; include/epx/dispatch.h).

    prepare (dispatch) and finalize (combine) are collective: every rank calls them, also with 0 tokens.
    Tensors are torch tensors, numpy arrays or epx.Tensor (any __dlpack__ object) on the group's device;
    results come back in the framework of x. stream: None = torch.cuda.current_stream() for CUDA torch
    tensors (else the legacy default stream), or an int cudaStream_t / torch.cuda.Stream.
    Errors: InvalidArgument (ValueError) for a bad argument, raised on every rank; Unsupported
    (NotImplementedError) for a backend/device pair that does not exist; Timeout; CommError.

    config: the DispatchConfig (or its fields as keywords). settings: an epx.Config whose launch settings
    the CUDA kernels take (ll: ll_warps_per_block, ll_num_blocks, ll_combine_wait; ht: ht_num_sms,
    ht_warps_per_block, ht_chunk_rows, ht_pdl); None = Config.load() (EPX_CONFIG, EPX_* variables).
    """

    def __init__(self, name: str, group: _epx.Group, config: Optional[_epx.DispatchConfig] = None,
                 settings: Optional[_epx.Config] = None, **kwargs):
        if config is None:
            config = _epx.DispatchConfig(**kwargs)
        elif kwargs:
            raise TypeError("PrepareFinalize: pass either config or keyword fields, not both")
        self._impl = _epx.make_prepare_finalize(name, group, config, settings)
        self._fw = "epx"
        self._out_like = None
        self._out_rows = 0

    @property
    def capabilities(self) -> dict:
        """name, layout, graph_safe, supports_fp8_dispatch, static_buffers, hierarchical (ll / ht across nodes)."""
        return self._impl.capabilities

    @property
    def config(self) -> _epx.DispatchConfig:
        return self._impl.config

    @property
    def group(self) -> _epx.Group:
        return self._impl.group

    @property
    def stats(self) -> dict:
        return self._impl.stats

    def why_unsupported(self, x, topk_idx, topk_weights) -> Optional[str]:
        return self._impl.why_unsupported(x, topk_idx, topk_weights)

    def prepare(self, x, topk_idx, topk_weights, stream=None, num_tokens=None, *, reject=None) -> Prepared:
        """Dispatch x [T, H] bf16 with topk_idx [T, K] int32/int64 (-1 = none) and topk_weights [T, K]
        fp32 (applied in finalize). T <= num_max_dispatch_tokens_per_rank. num_tokens: optional [1] int32
        on the GPU, the rows of x that take part (ll on CUDA, so one captured CUDA graph serves every T).
        reject: None, or an exception instance (epx.InvalidArgument / epx.Unsupported) this rank raises for
        the call: the collective still runs its status exchange, so every other rank raises too, naming
        this rank and the same sentence (how epx.deepep's own checks fail on every rank)."""
        s = resolve_stream(stream, x, topk_idx, topk_weights)
        r = self._impl.prepare(x, topk_idx, topk_weights, s, num_tokens, reject)
        fw = framework(x)
        self._fw, self._out_like, self._out_rows = fw, x, _rows(x)
        c = r.contiguous
        contiguous = None if c is None else ExpertContiguous(
            to_framework(c.x, fw), to_framework(c.x_scales, fw), to_framework(c.expert_offsets, fw),
            to_framework(c.row_expert, fw), to_framework(c.pair_row, fw), c.num_rows)
        fp32 = r.layout == "flat" and c is None and self.config.flat_combine == "partial_fp32"
        return Prepared(r.layout, to_framework(r.x, fw), to_framework(r.x_scales, fw), to_framework(r.recv_count, fw),
                        to_framework(r.topk_idx, fw), to_framework(r.topk_weights, fw), r.num_recv_tokens, r,
                        to_framework(r.num_recv_tokens_device, fw), contiguous, "fp32" if fp32 else "bf16")

    def finalize(self, expert_out, out=None, stream=None, topk_weights=None, *, reject=None):
        """Combine expert_out (ExpertMajor [L, cap, H] bf16 / Flat [N_recv, H] fp32, or bf16 with flat_combine
        "partial_bf16": Prepared.expert_out_dtype, as the experts wrote it;
        ht with expert_contiguous: [M, H] bf16, one unweighted row per Prepared.contiguous row) for the
        last prepare into out [T, H] bf16 (allocated like prepare's x when None); returns out.

        topk_weights: ht with expert_contiguous only, [N_recv, K] fp32 (usually prepared.topk_weights):
        finalize weights the rows itself, sum_k topk_weights[n, k] * expert_out[pair_row[n, k]] in fp32;
        None = weight 1 (the weights were applied before the experts). Given to any other backend or
        layout it raises InvalidArgument (ValueError) on every rank. reject: as in prepare."""
        if out is None:
            out = _empty_rows_like(self._out_like, self._out_rows, self.config.hidden, self._fw, self.group.device)
        s = resolve_stream(stream, expert_out, out)
        self._impl.finalize(expert_out, out, s, topk_weights, reject)
        return out


def _rows(x) -> int:
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) >= 1 else 0


def _empty_rows_like(like, rows, hidden, fw, device):
    if fw == "torch":
        import torch

        return torch.empty((rows, hidden), dtype=torch.bfloat16, device=like.device)
    return empty_bf16((rows, hidden), fw, device)


def make_prepare_finalize(name: str, group: _epx.Group, config: Optional[_epx.DispatchConfig] = None,
                          settings: Optional[_epx.Config] = None, **kwargs) -> PrepareFinalize:
    """Creates backend `name` (backend_names()) on `group` (collective; all ranks agree on the config).
    settings: an epx.Config for the CUDA kernels' launch settings (see PrepareFinalize); None = Config.load()."""
    return PrepareFinalize(name, group, config, settings, **kwargs)


class Experts:
    """Grouped SwiGLU experts over this rank's local experts (vLLM: FusedMoEPermuteExpertsUnpermute)."""

    def __init__(self, local_experts, device: str = "cpu"):
        self._impl = _epx.make_experts(list(local_experts), device)
        self.device = device

    @property
    def num_local_experts(self) -> int:
        return self._impl.num_local_experts

    @property
    def hidden(self) -> int:
        """H of every local expert."""
        return self._impl.hidden

    def supports(self, layout: str) -> bool:
        """Whether apply() / apply_contiguous() take `layout`: "expert_major", "flat" or "contiguous" (any other name
        raises epx.InvalidArgument)."""
        return self._impl.supports(layout)

    def apply(self, prepared: Prepared, out=None, stream=None):
        """ExpertMajor: out [L, cap, H] rows < recv_count[l] = expert_l(x[l, j]) (unweighted).
        Flat: out [N, H] = sum over local selections of w * expert(x), fp32 accumulation. out bf16, or fp32 (the sum
        unrounded); allocated in prepared.expert_out_dtype when None (what that prepare's finalize takes). Returns out."""
        fw = framework(prepared.x)
        if out is None:
            shape = tuple(prepared.raw.x.shape)
            fp32 = getattr(prepared, "expert_out_dtype", "bf16") == "fp32"
            if fw == "torch":
                import torch

                out = torch.empty(shape, dtype=torch.float32 if fp32 else torch.bfloat16, device=prepared.x.device)
            elif fp32:
                out = empty_fp32(shape, fw, self.device)
            else:
                out = empty_bf16(shape, fw, self.device)
        s = resolve_stream(stream, prepared.x, out)
        self._impl.apply(prepared.raw, out, s)
        return out

    def apply_contiguous(self, x, expert_offsets, out=None, x_scales=None, stream=None):
        """Rows already sorted by local expert (the m-grouped contiguous layout of torch._grouped_mm, DeepGEMM, and
        ht's Prepared.contiguous): x [N, H] bf16, or fp8_e4m3 with x_scales [N, H/128] fp32 (numpy: uint16 bf16 bits /
        uint8 e4m3 bits); expert_offsets int32 [L] cumulative ends (torch's `offs`) or [L + 1] starts then the end
        (Prepared.contiguous.expert_offsets); x_scales given with bf16 x raise epx.InvalidArgument. Returns out [N, H] bf16: row i of expert l's rows = expert_l(x[i]),
        unweighted; rows outside every expert's range are not written (a new out leaves them uninitialized).
        Offsets that decrease or leave [0, N] raise epx.InvalidArgument naming the entry (CUDA: the next call)."""
        fw = framework(x)
        if out is None:
            shape = getattr(x, "shape", None)
            if shape is None:  # what the binding says of a non-tensor argument
                raise TypeError(f"epx.Experts.apply_contiguous: x: expected a tensor (torch.Tensor, numpy.ndarray, epx.Tensor or "
                                f"any object with __dlpack__), got {type(x)}")
            if len(shape) != 2:  # out is [N, H] like x: name x's rank, as the experts would
                raise _epx.InvalidArgument(f"epx.Experts.apply_contiguous: x.ndim = {len(shape)}: must be 2 ([N, H]) for the "
                                           "contiguous layout")
            out = _empty_rows_like(x, int(shape[0]), int(shape[1]), fw, self.device)
        s = resolve_stream(stream, x, out)
        self._impl.apply_contiguous(x, expert_offsets, out, x_scales, s)
        return out


class ModularMoE:
    """The EP MoE layer on one rank (include/epx/moe.h): router -> prepare -> experts -> finalize, plus
    the shared expert. Construction is collective. forward(x) -> out [T, H] bf16 in x's framework.

    weights: MoEWeights holding at least this rank's experts; backend: a name from backend_names();
    num_max_dispatch_tokens_per_rank: capacity per rank per call (0 = no limit; with chunk_size, chunks).
    config: an epx.Config (launch settings such as ll_num_blocks / ht_num_sms; None = Config.load()).
    ll_combine: ll's combine reduction, "partial_fp32" (default) | "partial_bf16" | "column" (DispatchConfig.ll_combine).
    flat_combine: the Flat backends' partials across ranks, "partial_fp32" (default, one rounding) | "partial_bf16"
    (two roundings) (DispatchConfig.flat_combine).
    expert_contiguous: ht only (DispatchConfig.expert_contiguous): the experts run on prepare's expert-contiguous rows
    (Experts.apply_contiguous's layout) and finalize weights them, instead of the Flat rows the experts weight.
    """

    def __init__(self, weights, group, backend: str, *, num_max_dispatch_tokens_per_rank: int = 0, dispatch_dtype: str = "bf16",
                 use_ue8m0: bool = False, expert_alignment: int = 1, config: Optional[_epx.Config] = None,
                 shared_mode: str = "auto", chunk_size: int = 0, fhmoe_max_tokens: int = -1, ll_combine: str = "partial_fp32",
                 expert_contiguous: bool = False, flat_combine: str = "partial_fp32"):
        self._impl = _epx.ModularMoE(weights, group, backend, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                     dispatch_dtype=dispatch_dtype, use_ue8m0=use_ue8m0, expert_alignment=expert_alignment,
                                     config=config, shared_mode=shared_mode, chunk_size=chunk_size, fhmoe_max_tokens=fhmoe_max_tokens,
                                     ll_combine=ll_combine, expert_contiguous=expert_contiguous, flat_combine=flat_combine)
        self.weights, self.group, self.backend = weights, group, backend

    @property
    def counters(self) -> dict:
        return self._impl.counters

    def forward(self, x, out=None, stream=None):
        """x [T, H] bf16 -> out [T, H] bf16 with the layer's router (collective)."""
        out = self._out(x, out)
        self._impl.forward(x, out, resolve_stream(stream, x, out))
        return out

    def forward_routed(self, x, topk_idx, topk_weights, out=None, stream=None):
        """Same with given routing: topk_idx [T, K] int32/int64, topk_weights [T, K] fp32 (collective)."""
        out = self._out(x, out)
        self._impl.forward_routed(x, topk_idx, topk_weights, out, resolve_stream(stream, x, out))
        return out

    __call__ = forward

    def _out(self, x, out):
        if out is not None:
            return out
        return _empty_rows_like(x, _rows(x), self.weights.config.hidden, framework(x), self.group.device)


def route(config: _epx.RouterConfig, logits, correction_bias, topk_idx, topk_weights, stream=None) -> None:
    """Routes T tokens (include/epx/routing.h): logits [T, E] fp32/bf16 -> topk_idx [T, K] int32/int64 and
    topk_weights [T, K] fp32, written; correction_bias [E] fp32 or None. CPU or CUDA tensors (all on one device)."""
    _epx.route(config, logits, correction_bias, topk_idx, topk_weights, resolve_stream(stream, logits, topk_idx))


def quantize_fp8_per_token_group(x, q, scales, group_size: int = 128, ue8m0: bool = False, stream=None) -> None:
    """x [T, H] bf16/fp32 -> q [T, H] fp8_e4m3 and scales [T, H/group_size] fp32, written (DeepSeek-V3 1x128
    recipe: scale = max(amax, 1e-4) / 448; ue8m0 rounds it up to a power of two). CPU or CUDA tensors."""
    _epx.quantize_fp8_per_token_group(x, q, scales, group_size, ue8m0, resolve_stream(stream, x, q))


def group_from_torch(process_group=None, device: Optional[int] = None, timeout_s: float = 60.0) -> _epx.Group:
    """An NCCL epx group over the ranks of a torch.distributed process group (default: WORLD).

    Group rank 0 creates the NCCL unique id; it is broadcast as hex over `process_group` with
    dist.broadcast_object_list. device: the CUDA device of this rank (default torch.cuda.current_device()).
    Collective over the process group. Raises Unsupported (NotImplementedError) in a CPU-only build."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    if device is None:
        device = torch.cuda.current_device()
    uid_hex = [None]
    err = [None]
    if rank == 0:
        try:
            uid_hex[0] = _epx.UniqueId.create().hex()
        except _epx.Error as e:  # tell the peers instead of leaving them in the broadcast
            err[0] = str(e)
    payload = [uid_hex[0], err[0]]
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    dist.broadcast_object_list(payload, src=src, group=process_group)
    if payload[1] is not None:
        raise _epx.Unsupported(f"epx.group_from_torch: rank 0 could not create the NCCL unique id: {payload[1]}")
    return _epx.make_nccl_group(_epx.UniqueId.parse(payload[0]), rank, world, int(device), timeout_s)
