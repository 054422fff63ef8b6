#!/usr/bin/env python3
"""tools/scale_model.py: the byte and latency model of docs/scale.md (issue 11).

Counts, per rank and per call, the rows and bytes every stage of an EP dispatch / combine moves for
DeepSeek-V3's routing (top-8 of 256 experts, 8 groups of 32, top-4 groups when node-limited), over
nodes of 8 GPUs, for EP16/32/64, and turns them into time with the link figures below. Routing is
sampled (fixed seed, uniform scores: every expert equally likely, as in DeepEP's tests), so the
expectations carry a small sampling error (< 1 % at the default 20000 tokens).

Usage: python3 tools/scale_model.py [--tokens 128] [--samples 20000] [--markdown]
No dependencies beyond the standard library.
"""
import argparse
import random

HIDDEN = 7168
FP8_ROW = HIDDEN + HIDDEN // 128 * 4   # 7392 B: FP8 e4m3 row + fp32 1x128 scales
LL_ROW = FP8_ROW + 16                  # 7408 B: DeepEP LL accounting (ANCHORS.md)
BF16_ROW = HIDDEN * 2                  # 14336 B: combine rows
EXPERTS, TOPK, GROUPS, TOPK_GROUPS = 256, 8, 8, 4
GPUS_PER_NODE = 8

# Link figures (assumptions; docs/scale.md says where each comes from).
RDMA_GBPS = 50.0       # 400 Gb/s per GPU (CX7), the figure DeepEP quotes as "~50 GB/s maximum"
RDMA_EFF_GBPS = 42.0   # what DeepEP's HT kernels reach across nodes (43-58 GB/s), rounded down
NVL_GBPS = 350.0       # SM-driven NVLink stores measured here: 335-369 GB/s (ANCHORS.md)
ALPHA_NET_US = 15.0    # one grouped ncclSend/ncclRecv step across nodes (host proxy, network)
ALPHA_NVL_US = 8.0     # one LSA kernel stage inside a node (launch + flag round trips)


def route(rng, node_limited):
    """One token's 8 experts: uniform top-8 of 256, or top-8 inside 4 random groups of 32."""
    if not node_limited:
        return rng.sample(range(EXPERTS), TOPK)
    per_group = EXPERTS // GROUPS
    groups = rng.sample(range(GROUPS), TOPK_GROUPS)
    pool = [g * per_group + i for g in groups for i in range(per_group)]
    return rng.sample(pool, TOPK)


def expectations(ep, node_limited, samples, seed=1):
    """Per source token (from rank 0 = node 0, local GPU 0): expected rows per stage."""
    rng = random.Random(seed)
    nodes = ep // GPUS_PER_NODE
    per_rank = EXPERTS // ep
    acc = dict(sel_remote_node=0, ranks_remote_node=0, nodes_remote=0, nvl_fanout=0, ranks_total=0, nodes_total=0)
    for _ in range(samples):
        experts = route(rng, node_limited)
        ranks = {e // per_rank for e in experts}
        touched = {r // GPUS_PER_NODE for r in ranks}
        acc["sel_remote_node"] += sum(1 for e in experts if (e // per_rank) // GPUS_PER_NODE != 0)
        acc["ranks_remote_node"] += sum(1 for r in ranks if r // GPUS_PER_NODE != 0)
        acc["nodes_remote"] += len(touched - {0})
        acc["ranks_total"] += len(ranks)
        acc["nodes_total"] += len(touched)
        # Hierarchical: the token enters node n at GPU (n, 0) (same local index as the source, as
        # DeepEP does), which forwards it over NVLink to every other touched GPU of that node.
        for n in touched:
            acc["nvl_fanout"] += sum(1 for r in ranks if r // GPUS_PER_NODE == n and r % GPUS_PER_NODE != 0)
    return {k: v / samples for k, v in acc.items()}, nodes


def us(bytes_, gbps):
    return bytes_ / (gbps * 1e3)  # GB/s = 1e3 bytes per us


def table(tokens, samples):
    rows = []
    for ep in (16, 32, 64):
        for limited in (False, True):
            e, nodes = expectations(ep, limited, samples)
            flat_sel = tokens * e["sel_remote_node"]       # DeepEP LL: one RDMA write per remote selection
            flat_rank = tokens * e["ranks_remote_node"]    # all2allv: once per remote rank
            hier = tokens * e["nodes_remote"]              # hierarchical: once per remote node
            fan = tokens * e["nvl_fanout"]
            worst = tokens * (nodes - 1)                   # graph-safe over host NCCL: sizes fixed at capture
            rows.append(dict(
                ep=ep, d_graph_mb=worst * FP8_ROW / 1e6, c_graph_mb=worst * BF16_ROW / 1e6, nodes=nodes, limited=limited, nodes_per_tok=e["nodes_total"], remote_nodes=e["nodes_remote"],
                ranks_per_tok=e["ranks_total"],
                d_flat_sel_mb=flat_sel * LL_ROW / 1e6, d_flat_rank_mb=flat_rank * FP8_ROW / 1e6, d_hier_mb=hier * FP8_ROW / 1e6,
                d_nvl_mb=fan * FP8_ROW / 1e6,
                c_flat_sel_mb=flat_sel * BF16_ROW / 1e6, c_hier_mb=hier * BF16_ROW / 1e6, c_nvl_mb=fan * BF16_ROW / 1e6,
            ))
    return rows


def times(r):
    """Predicted us per stage: (net at 50, net at 42, nvl) for dispatch and combine, hierarchical."""
    d_net = ALPHA_NET_US + us(r["d_hier_mb"] * 1e6, RDMA_EFF_GBPS)
    d_net_peak = ALPHA_NET_US + us(r["d_hier_mb"] * 1e6, RDMA_GBPS)
    d_nvl = ALPHA_NVL_US + us(r["d_nvl_mb"] * 1e6, NVL_GBPS)
    c_nvl = ALPHA_NVL_US + us(r["c_nvl_mb"] * 1e6, NVL_GBPS)
    c_net = ALPHA_NET_US + us(r["c_hier_mb"] * 1e6, RDMA_EFF_GBPS)
    c_net_peak = ALPHA_NET_US + us(r["c_hier_mb"] * 1e6, RDMA_GBPS)
    return dict(d_net=d_net, d_net_peak=d_net_peak, d_nvl=d_nvl, d_total=d_net + d_nvl, d_total_peak=d_net_peak + d_nvl,
                c_nvl=c_nvl, c_net=c_net, c_net_peak=c_net_peak, c_total=c_net + c_nvl, c_total_peak=c_net_peak + c_nvl,
                d_flat_sel=us(r["d_flat_sel_mb"] * 1e6, RDMA_GBPS), c_flat_sel=us(r["c_flat_sel_mb"] * 1e6, RDMA_GBPS))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--samples", type=int, default=20000)
    a = ap.parse_args()
    rows = table(a.tokens, a.samples)
    print(f"T = {a.tokens} tokens per rank, hidden {HIDDEN}, top-{TOPK} of {EXPERTS}, {GPUS_PER_NODE} GPUs per node")
    print("\nbytes per rank per call (MB):")
    print("| EP | nodes | routing | nodes/token | remote nodes/token | ranks/token | dispatch RDMA: per selection (DeepEP LL) "
          "| per remote rank | per remote node (hierarchical) | dispatch NVLink fan-out | combine RDMA: per selection | hierarchical "
          "| combine NVLink |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ep']} | {r['nodes']} | {'node-limited (4 groups)' if r['limited'] else 'uniform'} | {r['nodes_per_tok']:.2f} "
              f"| {r['remote_nodes']:.2f} | {r['ranks_per_tok']:.2f} | {r['d_flat_sel_mb']:.2f} | {r['d_flat_rank_mb']:.2f} "
              f"| {r['d_hier_mb']:.2f} | {r['d_nvl_mb']:.2f} | {r['c_flat_sel_mb']:.2f} | {r['c_hier_mb']:.2f} | {r['c_nvl_mb']:.2f} |")
    print("\ngraph-safe hierarchical over host NCCL (ncclSend sizes fixed at capture: T rows to every remote node), MB per rank:")
    print("| EP | dispatch RDMA | combine RDMA | vs hierarchical with exact counts (uniform / node-limited) |")
    print("|---|---|---|---|")
    for u, l in zip(rows[0::2], rows[1::2]):
        print(f"| {u['ep']} | {u['d_graph_mb']:.2f} | {u['c_graph_mb']:.2f} | {u['d_graph_mb'] / u['d_hier_mb']:.2f}x / {l['d_graph_mb'] / l['d_hier_mb']:.2f}x |")
    print(f"\npredicted time per call (us), hierarchical; RDMA at {RDMA_EFF_GBPS:.0f} GB/s (at {RDMA_GBPS:.0f} in brackets), "
          f"alpha_net {ALPHA_NET_US:.0f} us, NVLink {NVL_GBPS:.0f} GB/s + {ALPHA_NVL_US:.0f} us:")
    print("| EP | routing | dispatch: RDMA stage | NVLink stage | total | combine: NVLink stage | RDMA stage | total "
          "| per-selection RDMA bytes alone at 50 GB/s: dispatch / combine |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = times(r)
        print(f"| {r['ep']} | {'node-limited' if r['limited'] else 'uniform'} | {t['d_net']:.0f} ({t['d_net_peak']:.0f}) "
              f"| {t['d_nvl']:.0f} | {t['d_total']:.0f} ({t['d_total_peak']:.0f}) | {t['c_nvl']:.0f} | {t['c_net']:.0f} ({t['c_net_peak']:.0f}) "
              f"| {t['c_total']:.0f} ({t['c_total_peak']:.0f}) | {t['d_flat_sel']:.0f} / {t['c_flat_sel']:.0f} |")


if __name__ == "__main__":
    main()
