"""README quick start: the epx MoE layer in a 2-rank torch job, checked against epx's CPU reference.

    torchrun --nproc-per-node 2 examples/quickstart_torch.py
"""

import os

import torch
import torch.distributed as dist

import epx

rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
group = epx.group_from_torch()  # an NCCL group of the torch ranks (unique id broadcast over torch)

# A Qwen3-30B-A3B-shaped layer (128 experts, top-8) at small width; every rank builds the same weights.
weights = epx.MoEWeights.random("qwen3-30b-a3b-mini", seed=1)
layer = epx.ModularMoE(weights, group, "all2allv", num_max_dispatch_tokens_per_rank=128)

torch.manual_seed(rank)
x = torch.randn(128 - 32 * rank, weights.config.hidden, device="cuda").to(torch.bfloat16)
out = layer(x)  # router -> prepare (dispatch) -> experts -> finalize (combine), on torch's current stream

# Check: the same routing through forward_routed and through the single-rank CPU reference.
logits = torch.empty(x.shape[0], weights.config.router.num_experts)
epx.router_logits(weights, x.cpu(), logits)
topk_idx = torch.empty(x.shape[0], weights.config.router.top_k, dtype=torch.int32)
topk_weights = torch.empty(x.shape[0], weights.config.router.top_k)
epx.route(weights.config.router, logits, None, topk_idx, topk_weights)
routed = layer.forward_routed(x, topk_idx.cuda(), topk_weights.cuda())
ref = torch.empty(x.shape, dtype=torch.bfloat16)
epx.moe_reference(weights, x.cpu(), topk_idx, topk_weights, ref)
err = float((routed.cpu().float() - ref.float()).norm() / ref.float().norm())
print(f"rank {rank}: {tuple(x.shape)} -> {tuple(out.shape)} {out.dtype}; rel L2 vs CPU reference {err:.1e}",
      "ok" if err < 1e-2 else "FAIL", flush=True)
dist.destroy_process_group()
raise SystemExit(0 if err < 1e-2 else 1)
