"""epx: expert-parallel (EP) Mixture-of-Experts dispatch/combine and the modular MoE layer.

The C++ core (include/epx/*.h) through a pybind11 module, epx._epx. Tensors cross through DLPack in
both directions without a copy: pass torch tensors, numpy arrays or any __dlpack__ object; results
come back in the framework of the input (numpy has no bf16/fp8: numpy callers use uint16/uint8 bit
patterns, see epx.bf16 / epx.to_float32). CUDA calls are ordered on `stream` (None = torch's current
stream for CUDA torch tensors).

    groups = epx.make_cpu_groups(2)                    # ranks as threads (CPU reference)
    groups = epx.make_virtual_cuda_groups(4)           # or: 4 ranks as threads on one GPU (run_ranks drives both)
    group  = epx.group_from_torch()                    # or: one NCCL group over a torch.distributed job
    pf     = epx.make_prepare_finalize("ll", group, epx.DispatchConfig(hidden=..., num_experts=..., top_k=...,
                                                   num_max_dispatch_tokens_per_rank=...))
    prepared = pf.prepare(x, topk_idx, topk_weights)   # dispatch
    ...experts on prepared.x...
    out = pf.finalize(expert_out)                      # combine
    layer = epx.ModularMoE(weights, group, "ll", num_max_dispatch_tokens_per_rank=128); out = layer(x)

Errors: epx.Error (RuntimeError) and its subclasses InvalidArgument (also ValueError), Unsupported
(also NotImplementedError), Timeout (also TimeoutError), CommError, CudaError.
"""

from . import _epx
from ._epx import (  # noqa: F401
    CommError,
    Config,
    CudaError,
    DispatchConfig,
    Error,
    ExpertActivation,
    ExpertWeights,
    Group,
    InvalidArgument,
    MoEConfig,
    MoEWeights,
    RouterConfig,
    Tensor,
    Timeout,
    UniqueId,
    Unsupported,
    as_tensor,
    backend_names,
    built_with_cuda,
    cuda_device_count,
    empty,
    exchange_unique_id,
    expert_range,
    expert_rank,
    from_float,
    make_cpu_groups,
    make_nccl_group,
    make_nccl_group_from_env,
    make_virtual_cuda_groups,
    moe_reference,
    nccl_version,
    num_local_experts,
    preset,
    preset_names,
    router_logits,
    load_moe_layer,
    run_ranks,
    write_moe_checkpoint,
    zeros,
)
from ._api import (  # noqa: F401
    ExpertContiguous,
    Experts,
    ModularMoE,
    Prepared,
    PrepareFinalize,
    group_from_torch,
    make_prepare_finalize,
    quantize_fp8_per_token_group,
    route,
)
from ._frameworks import bf16, resolve_stream, to_float32  # noqa: F401
from . import deepep  # noqa: F401

__version__ = _epx.__version__


def make_experts(local_experts, device: str = "cpu") -> Experts:
    """Experts over `local_experts` (a list of ExpertWeights; index = local expert id) on "cpu" or "cuda:N"."""
    return Experts(local_experts, device)


def group_from_env(timeout_s: float = 60.0) -> Group:
    """make_nccl_group_from_env: EPX_RANK, EPX_WORLD_SIZE, EPX_RENDEZVOUS, EPX_LOCAL_RANK."""
    return make_nccl_group_from_env(timeout_s)
