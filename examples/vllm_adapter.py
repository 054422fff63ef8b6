"""epx as the prepare/finalize of a vLLM-style modular MoE kernel, checked against a plain-torch MoE.

vLLM splits a fused MoE into [router] -> prepare (quantize + dispatch) -> experts -> finalize (combine)
(vllm/model_executor/layers/fused_moe/modular_kernel.py: FusedMoEPrepareAndFinalize,
FusedMoEPermuteExpertsUnpermute, FusedMoEModularKernel). EpxPrepareAndFinalize below has that shape:
prepare returns (quantized activations, their scales, per-expert token counts, topk ids, topk weights)
and finalize writes the combined output into the caller's tensor in place. The experts here are plain
torch; in an engine they would be the engine's grouped GEMMs. vLLM itself is not imported.

Run (2 GPUs):  python examples/vllm_adapter.py      (spawns 2 ranks; prints PASS or FAIL per case)
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import epx

HIDDEN, INTER, NUM_EXPERTS, TOP_K, MAX_TOKENS = 512, 256, 16, 4, 64


@dataclass
class ExpertTokensMetadata:
    """vLLM's per-expert token counts: on the device, and optionally on the host."""
    expert_num_tokens: torch.Tensor
    expert_num_tokens_cpu: Optional[torch.Tensor] = None


class EpxPrepareAndFinalize:
    """FusedMoEPrepareAndFinalize over an epx dispatch backend ("ll": batched [L, cap, H] activations,
    vLLM's BatchedExperts format; the others: flat [N, H], vLLM's Standard format)."""

    def __init__(self, group: epx.Group, backend: str, *, hidden: int, num_experts: int, top_k: int,
                 max_num_tokens: int, quant_dtype: Optional[torch.dtype] = None):
        fp8 = quant_dtype == torch.float8_e4m3fn
        self.group = group
        self.pf = epx.make_prepare_finalize(backend, group, epx.DispatchConfig(
            hidden=hidden, num_experts=num_experts, top_k=top_k, num_max_dispatch_tokens_per_rank=max_num_tokens,
            dispatch_dtype="fp8_e4m3" if fp8 else "bf16"))

    @property
    def activation_format(self) -> str:
        return "BatchedExperts" if self.pf.capabilities["layout"] == "expert_major" else "Standard"

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.pf.config.num_max_dispatch_tokens_per_rank

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None  # int32 and int64 both accepted

    def num_dispatchers(self) -> int:
        return self.group.size

    def output_is_reduced(self) -> bool:
        return False  # each rank gets back the output of its own tokens

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: Optional[torch.Tensor], apply_router_weight_on_input: bool, quant_config=None):
        """Quantize (fp8: 1x128 scales) and dispatch. Returns (a1q, a1q_scale, expert_tokens_meta,
        expert_topk_ids, expert_topk_weights); the last two are None for the batched format."""
        if apply_router_weight_on_input:
            raise NotImplementedError("epx applies the router weights in finalize (combine)")
        if expert_map is not None:
            raise NotImplementedError("epx places experts itself (contiguous ranges, epx.expert_range)")
        p = self.pf.prepare(a1, topk_ids, topk_weights)  # stream: torch.cuda.current_stream()
        meta = ExpertTokensMetadata(expert_num_tokens=p.recv_count)
        return p.x, p.x_scales, meta, p.topk_idx, p.topk_weights

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool, weight_and_reduce_impl=None) -> None:
        """Combine fused_expert_output into `output` [T, H] in place (weighted by the topk_weights of prepare)."""
        self.pf.finalize(fused_expert_output, output)


class TorchExperts:
    """FusedMoEPermuteExpertsUnpermute in plain torch: SwiGLU experts [e0, e1) of this rank, both formats."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, first_expert: int, num_local: int):
        self.w13 = w13[first_expert:first_expert + num_local]  # [L, 2I, H] bf16
        self.w2 = w2[first_expert:first_expert + num_local]    # [L, H, I]
        self.inter = w2.shape[-1]

    def _mlp(self, l: int, x: torch.Tensor) -> torch.Tensor:
        gu = x @ self.w13[l].float().T
        h = (F.silu(gu[:, :self.inter]) * gu[:, self.inter:]).to(torch.bfloat16).float()
        return (h @ self.w2[l].float().T).to(torch.bfloat16).float()

    def apply(self, output, hidden_states, a1q_scale, expert_tokens_meta, topk_ids, topk_weights, activation_format):
        x = hidden_states.float()
        if a1q_scale is not None:
            x = x * a1q_scale.repeat_interleave(x.shape[-1] // a1q_scale.shape[-1], dim=-1)
        if activation_format == "BatchedExperts":
            for l, n in enumerate(expert_tokens_meta.expert_num_tokens.tolist()):
                if n:
                    output[l, :n] = self._mlp(l, x[l, :n]).to(output.dtype)
            return
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        idx = topk_ids.long()
        for l in range(self.w13.shape[0]):
            rows, cols = (idx == l).nonzero(as_tuple=True)
            if rows.numel():
                acc.index_add_(0, rows, topk_weights[rows, cols, None] * self._mlp(l, x[rows]))
        output.copy_(acc.to(output.dtype))


def modular_kernel_forward(pf: EpxPrepareAndFinalize, experts: TorchExperts, hidden_states, topk_weights, topk_ids):
    """FusedMoEModularKernel.forward: prepare -> experts -> finalize, output written in place."""
    output = torch.empty_like(hidden_states)
    a1q, a1q_scale, meta, ids, weights = pf.prepare(hidden_states, topk_weights, topk_ids, NUM_EXPERTS, None, False)
    fused_out = torch.empty(a1q.shape, dtype=torch.bfloat16, device=a1q.device)
    experts.apply(fused_out, a1q, a1q_scale, meta, ids, weights, pf.activation_format)
    pf.finalize(output, fused_out, topk_weights, topk_ids, False)
    return output


def reference_moe(x, w13, w2, topk_weights, topk_ids, fp8: bool):
    """The plain-torch MoE on one rank's tokens with every expert: no epx involved."""
    xf = x.float()
    if fp8:  # the activations as the fp8 wire carries them: 1x128 groups, scale = max(amax, 1e-4) / 448
        g = xf.reshape(xf.shape[0], -1, 128)
        s = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / 448.0
        xf = ((g / s).to(torch.float8_e4m3fn).float() * s).reshape(xf.shape)
    inter = w2.shape[-1]
    out = torch.zeros_like(xf)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gu = xf[t:t + 1] @ w13[e].float().T
            h = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(torch.bfloat16).float()
            out[t] += topk_weights[t, k] * (h @ w2[e].float().T).to(torch.bfloat16).float()[0]
    return out.to(torch.bfloat16)


def run(rank: int, world: int, port: int, failures) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = epx.group_from_torch()  # NCCL unique id broadcast over the torch process group
    gen = torch.Generator(device="cuda").manual_seed(0)  # same weights on every rank
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / INTER ** 0.5).to(torch.bfloat16)
    router = torch.randn(NUM_EXPERTS, HIDDEN, device="cuda", generator=gen) / HIDDEN ** 0.5
    first, end = epx.expert_range(NUM_EXPERTS, world, rank)
    experts = TorchExperts(w13, w2, first, end - first)
    ok = True
    for backend in ("ll", "ht", "all2allv", "allgather_reducescatter", "naive"):
        for quant in (None, torch.float8_e4m3fn):
            try:
                pf = EpxPrepareAndFinalize(group, backend, hidden=HIDDEN, num_experts=NUM_EXPERTS, top_k=TOP_K,
                                           max_num_tokens=MAX_TOKENS, quant_dtype=quant)
            except NotImplementedError as e:
                if rank == 0:
                    print(f"{backend:>24} {'fp8' if quant else 'bf16'}: skipped ({e})")
                continue
            tokens = MAX_TOKENS - 13 * rank
            torch.manual_seed(100 + rank)
            x = torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16)
            probs = torch.softmax(x.float() @ router.T, dim=-1)  # Mixtral-style router, renormalised top-k
            topk_weights, topk_ids = probs.topk(TOP_K, dim=-1)
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
            out = modular_kernel_forward(pf, experts, x, topk_weights, topk_ids)
            ref = reference_moe(x, w13, w2, topk_weights, topk_ids, fp8=quant is not None)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            good = err < 1.5e-2
            ok &= good
            print(f"rank {rank} {backend:>24} {'fp8' if quant else 'bf16'} [{pf.activation_format}]: "
                  f"{tokens} tokens, rel L2 vs torch MoE {err:.2e} {'ok' if good else 'FAIL'}", flush=True)
    if not ok:
        failures.put(rank)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    world = 2
    if torch.cuda.device_count() < world:
        print(f"needs {world} GPUs, found {torch.cuda.device_count()}")
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    mp.spawn(run, args=(world, port, failures), nprocs=world, join=True)
    failed = []
    while not failures.empty():
        failed.append(failures.get())
    print("PASS" if not failed else f"FAIL on ranks {sorted(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
