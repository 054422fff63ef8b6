#!/usr/bin/env python3
"""bench/fhmoe_sweep_trace.py: an epx-trace (docs/trace-format.md, JSON form) that sweeps the tokens
per rank T over steps, for the FHMoE gate measurement through the whole layer in one `epx moe` run
(the weights are built once; per-step latencies are in the JSON's step_latency_us, sliced by
bench/fhmoe_sweep_report.py).

Routing: uniform, top-K distinct experts per token, weights uniform in [0.05, 1) normalised to sum 1.
The first token of each rank and step (the one `epx moe --validate-tokens 1` checks on rank 0)
routes into rank 0's experts [0, E/R) when T >= --local-first-from, so the CPU reference needs few
experts beyond rank 0's own; below that it is uniform like the rest (at small T it is a large part
of the traffic).

Usage: fhmoe_sweep_trace.py --experts 256 --top-k 8 --ranks 2 --tokens 1,8,32,128,512 --steps 5 -o t.json
"""
import argparse
import json
import random


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, required=True, help="E (num_experts of the preset)")
    ap.add_argument("--top-k", type=int, required=True, help="K (top_k of the preset)")
    ap.add_argument("--ranks", type=int, default=2, help="R")
    ap.add_argument("--tokens", default="1,8,32,128,512", help="T per rank of each block of steps, comma-separated")
    ap.add_argument("--steps", type=int, default=5, help="steps per T (the first block also serves the warm-up step)")
    ap.add_argument("--local-first-from", type=int, default=32, help="T from which the validated first token stays on rank 0's experts")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    E, K, R = a.experts, a.top_k, a.ranks
    tokens = [int(t) for t in a.tokens.split(",")]
    steps = []
    for T in tokens:
        for _ in range(a.steps):
            ranks = []
            for _r in range(R):
                idx, wts = [], []
                for t in range(T):
                    pool = E // R if (t == 0 and T >= a.local_first_from) else E
                    ids = rng.sample(range(pool), K)
                    w = [rng.uniform(0.05, 1.0) for _ in range(K)]
                    s = sum(w)
                    idx.append(ids)
                    wts.append([float("%.6g" % (x / s)) for x in w])
                ranks.append({"topk_idx": idx, "topk_weights": wts})
            steps.append({"ranks": ranks})
    trace = {"format": "epx-trace", "version": 1, "num_ranks": R, "num_experts": E, "top_k": K,
             "source": "bench/fhmoe_sweep_trace.py --tokens %s --steps %d --seed %d" % (a.tokens, a.steps, a.seed),
             "steps": steps}
    with open(a.output, "w") as f:
        json.dump(trace, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
