#!/usr/bin/env python3
"""Writes tests/fixtures/moe/<family>-<layout>/: tiny MoE layers built from transformers' own modules.

For every MoE family the installed transformers has (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3,
gpt-oss, and DeepSeek-V4 when present) this builds the model's MoE block from its configuration
class with small random weights (every value bf16-representable, non-trivial biases where the model
has them), runs it in fp32 on fixed bf16 inputs, and saves per family and layout:

  config.json + model.safetensors  one decoder layer's MoE block as layer 0 of a checkpoint
                                   (docs/checkpoint.md), in the layout the directory name says:
                                   per_expert (transformers 4.x modules), fused (5.x gate_up_proj
                                   [E, 2I, H] / down_proj [E, H, I]) or stacked (gpt-oss, one layout)
  io.safetensors                   x BF16 [T, H], out F32 [T, H] (the block's output), topk_idx I64
                                   [T, K], topk_weights F32 [T, K], router_logits F32 [T, E]; the
                                   metadata records the transformers and torch versions

tests/moe_fixtures_test.cpp reads them. The routing saved is computed here from the model's router
formula, and the block's output is recomputed from it here and compared with the module's output
(the script stops if they differ): the fixture says what transformers computes, and the script
checks that it reads transformers right. Needs torch, transformers and safetensors; no network.

  python3 tools/make_moe_fixtures.py [--out tests/fixtures/moe] [--tokens 32] [--seed 0]
"""

import argparse
import json
import math
import os
import shutil
import sys

import torch
import torch.nn.functional as F

import transformers
from safetensors.torch import save_file

H = 128  # FP8 dispatch needs H % 128 == 0


def bf16_(t):
    """Rounds a tensor's values to bf16 in place (the checkpoint stores bf16: both sides see the same)."""
    t.data.copy_(t.data.to(torch.bfloat16).to(t.dtype))
    return t


def randomize(module, gen, transposed, bias_scale=0.5):
    """N(0, 1/fan_in) weights, N(0, (bias_scale / 2)^2) biases (non-trivial, as the issue asks), all bf16-valued.
    Expert tensors are [E, out, in] (5.x) or, `transposed` (gpt-oss, used as x @ W), [E, in, out]."""
    for name, p in module.named_parameters():
        if p.dim() == 3:
            fan_in = p.shape[1] if transposed else p.shape[2]
            p.data.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
        elif p.dim() == 2:
            p.data.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
        else:
            p.data.normal_(0.0, bias_scale / 2, generator=gen)
        bf16_(p)
    for name, b in module.named_buffers():
        if "e_score_correction_bias" in name:
            b.data.uniform_(-0.05, 0.05, generator=gen)


# ---- families ---------------------------------------------------------------------------------

def has(module_name, *names):
    try:
        mod = __import__("transformers.models." + module_name, fromlist=list(names))
        return all(hasattr(mod, n) for n in names)
    except ImportError:
        return False


def families():
    """(name, model_type, convention, config, block factory, E, K, I)."""
    out = []
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral import modeling_mixtral as mm
    from transformers.models.qwen2_moe import modeling_qwen2_moe as q2
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3

    c = MixtralConfig(hidden_size=H, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
    out.append(("mixtral", c, lambda c=c: mm.MixtralSparseMoeBlock(c), 8, 2, 64))
    c = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=4)
    out.append(("qwen2_moe", c, lambda c=c: q2.Qwen2MoeSparseMoeBlock(c), 8, 2, 64))
    c = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=4, norm_topk_prob=True,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=32)
    out.append(("qwen3_moe", c, lambda c=c: q3.Qwen3MoeSparseMoeBlock(c), 8, 4, 64))
    if has("deepseek_v3", "DeepseekV3MoE"):
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as d3
        c = DeepseekV3Config(hidden_size=H, moe_intermediate_size=32, intermediate_size=256, n_routed_experts=16,
                             num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                             routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                             q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
        out.append(("deepseek_v3", c, lambda c=c: d3.DeepseekV3MoE(c), 16, 4, 32))
    if has("gpt_oss", "GptOssMLP"):
        from transformers import GptOssConfig
        from transformers.models.gpt_oss import modeling_gpt_oss as go
        c = GptOssConfig(hidden_size=H, intermediate_size=64, num_local_experts=8, num_experts_per_tok=4,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=32)
        out.append(("gpt_oss", c, lambda c=c: go.GptOssMLP(c), 8, 4, 64))
    if has("deepseek_v4", "DeepseekV4SparseMoeBlock"):
        print("note: transformers has DeepSeek-V4; its block needs input_ids (hash layers) and sqrtsoftplus "
              "scoring, which epx refuses by name: no fixture written for it", file=sys.stderr)
    return out


# ---- the model's formulas (to check this script's reading of the module) ------------------------

def experts_params(block, E, I, transposed):
    """Per expert (w13 [2I, H] = [gate; up], w2 [H, I], b13 [2I] or None, b2 [H] or None), from either layout."""
    ex = block.experts
    res = []
    if isinstance(ex, torch.nn.ModuleList):  # 4.x modules
        for m in ex:
            g, u, d = (m.w1, m.w3, m.w2) if hasattr(m, "w1") else (m.gate_proj, m.up_proj, m.down_proj)
            res.append((torch.cat([g.weight, u.weight], 0), d.weight, None, None))
        return res
    gu, dn = ex.gate_up_proj, ex.down_proj
    gub = getattr(ex, "gate_up_proj_bias", None)
    dnb = getattr(ex, "down_proj_bias", None)
    for e in range(E):
        if transposed:  # gpt-oss: [E, H, 2I], interleaved columns; down [E, I, H]
            w = gu[e].t()
            w13 = torch.cat([w[0::2], w[1::2]], 0)
            b13 = torch.cat([gub[e][0::2], gub[e][1::2]], 0) if gub is not None else None
            w2 = dn[e].t()
        else:  # 5.x: [E, 2I, H] gate rows then up rows, down [E, H, I]
            w13, w2, b13 = gu[e], dn[e], None
        res.append((w13, w2, b13, dnb[e] if dnb is not None else None))
    return res


def route(name, block, cfg, x, E, K):
    """(logits [T, E], topk_idx [T, K], topk_weights [T, K]) as the model's router computes them, fp32."""
    if name == "gpt_oss":
        logits = F.linear(x, block.router.weight, block.router.bias)
        val, idx = torch.topk(logits, K, dim=-1)
        return logits, idx, torch.softmax(val, dim=-1)
    logits = F.linear(x, block.gate.weight)
    if name == "deepseek_v3":
        s = logits.sigmoid()
        choice = s + block.gate.e_score_correction_bias
        G = cfg.n_group
        gs = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        gidx = torch.topk(gs, cfg.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~smask.bool(), 0.0)
        idx = torch.topk(choice, K, dim=-1, sorted=False)[1]
        w = s.gather(1, idx)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return logits, idx, w * cfg.routed_scaling_factor
    p = torch.softmax(logits, dim=-1, dtype=torch.float)
    w, idx = torch.topk(p, K, dim=-1)
    if name == "mixtral" or getattr(cfg, "norm_topk_prob", False):
        w = w / w.sum(-1, keepdim=True)
    return logits, idx, w


def formula_out(name, block, cfg, x, E, K, I, idx, w):
    params = experts_params(block, E, I, name == "gpt_oss")
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            w13, w2, b13, b2 = params[int(idx[t, k])]
            gu = w13 @ x[t] + (b13 if b13 is not None else 0)
            g, u = gu[:I], gu[I:]
            if name == "gpt_oss":
                g = g.clamp(max=7.0)
                u = u.clamp(-7.0, 7.0)
                h = (u + 1) * g * torch.sigmoid(1.702 * g)
            else:
                h = F.silu(g) * u
            y = w2 @ h + (b2 if b2 is not None else 0)
            out[t] += w[t, k] * y
    sh = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    if sh is not None:
        y = sh(x)
        if hasattr(block, "shared_expert_gate"):
            y = torch.sigmoid(block.shared_expert_gate(x)) * y
        out += y
    return out


# ---- checkpoint layouts ------------------------------------------------------------------------

def layouts(name, block, E, I):
    """{layout: {tensor name: tensor}} with the names transformers 4.x / 5.x checkpoints use."""
    sd = {k: v.detach().clone() for k, v in block.state_dict().items()}
    mlp = "model.layers.0.mlp."
    if name == "gpt_oss":
        return {"stacked": {mlp + k: v for k, v in sd.items()}}
    per, fused = {}, {}
    params = experts_params(block, E, I, False)
    is_mixtral = name == "mixtral"
    pre = "model.layers.0.block_sparse_moe." if is_mixtral else mlp
    names = ("w1", "w3", "w2") if is_mixtral else ("gate_proj", "up_proj", "down_proj")
    for k, v in sd.items():
        if k.startswith("experts."):
            continue
        per[pre + k] = v
        fused[mlp + k] = v
    for e, (w13, w2, _, _) in enumerate(params):
        per[f"{pre}experts.{e}.{names[0]}.weight"] = w13[:I].detach().clone()
        per[f"{pre}experts.{e}.{names[1]}.weight"] = w13[I:].detach().clone()
        per[f"{pre}experts.{e}.{names[2]}.weight"] = w2.detach().clone()
    fused[mlp + "experts.gate_up_proj"] = torch.stack([p[0] for p in params]).detach().clone()
    fused[mlp + "experts.down_proj"] = torch.stack([p[1] for p in params]).detach().clone()
    return {"per_expert": per, "fused": fused}


def save_layer(dirname, tensors, cfg, meta):
    os.makedirs(dirname, exist_ok=True)
    out = {}
    for k, v in tensors.items():
        v = v.contiguous()
        out[k] = v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
    save_file(out, os.path.join(dirname, "model.safetensors"), metadata={"format": "pt", **meta})
    c = json.loads(cfg.to_json_string(use_diff=False))
    c["num_hidden_layers"] = 1
    with open(os.path.join(dirname, "config.json"), "w") as f:
        json.dump(c, f, indent=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "moe"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    meta = {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "generator": "tools/make_moe_fixtures.py"}
    if os.path.isdir(a.out):
        shutil.rmtree(a.out)
    failures = []
    for i, (name, cfg, make, E, K, I) in enumerate(families()):
        gen = torch.Generator().manual_seed(a.seed * 1000 + i)
        torch.manual_seed(a.seed * 1000 + i)
        block = make().float().eval()
        randomize(block, gen, transposed=name == "gpt_oss")
        x = torch.randn(a.tokens, H, generator=gen).to(torch.bfloat16)
        xf = x.float()
        r = block(xf.unsqueeze(0))
        out = (r[0] if isinstance(r, tuple) else r).reshape(a.tokens, H).float()
        logits, idx, w = route(name, block, cfg, xf, E, K)
        ref = formula_out(name, block, cfg, xf, E, K, I, idx, w)
        err = ((ref - out).norm() / out.norm()).item()
        print(f"{name}: E={E} K={K} I={I} |out|={out.norm():.3f} formula vs module rel L2 {err:.2e}")
        if not err < 1e-4:
            failures.append(f"{name}: this script's formula differs from transformers' module (rel L2 {err:.2e})")
            continue
        io = {"x": x.contiguous(), "out": out.contiguous(), "topk_idx": idx.to(torch.int64).contiguous(),
              "topk_weights": w.float().contiguous(), "router_logits": logits.float().contiguous()}
        for layout, tensors in layouts(name, block, E, I).items():
            d = os.path.join(a.out, f"{name}-{layout}")
            save_layer(d, tensors, cfg, {**meta, "family": name, "layout": layout})
            save_file(io, os.path.join(d, "io.safetensors"), metadata={**meta, "family": name, "layout": layout})
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(a.out) for f in fs) if os.path.isdir(a.out) else 0
    print(f"wrote {a.out}: {total / 1e6:.2f} MB, transformers {transformers.__version__}, torch {torch.__version__}")
    for f in failures:
        print("FAILED " + f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
