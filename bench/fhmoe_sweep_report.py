#!/usr/bin/env python3
"""bench/fhmoe_sweep_report.py: fused vs separate shared expert per tokens-per-rank T, from the
RESULTS.md JSON of `epx moe --compare --trace <bench/fhmoe_sweep_trace.py output>`: the trace's
steps come in blocks of --steps steps per T (in --tokens order); step_latency_us holds one latency
per step (the slowest rank's), so block b of every result is T = tokens[b]. Prints per T the p50
(median of the block) of each shared mode, fused / separate - 1, and the path counters of the run.

Usage: fhmoe_sweep_report.py moe-sweep.json --tokens 1,8,32,128,512 --steps 5
"""
import argparse
import json
import statistics


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--tokens", default="1,8,32,128,512")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    d = json.load(open(a.json))
    tokens = [int(t) for t in a.tokens.split(",")]
    by = {}
    for r in d["results"]:
        lat = r.get("step_latency_us") or []
        if len(lat) != len(tokens) * a.steps:
            print("%s %s: %d step latencies, expected %d" % (r["backend"], r["shared_mode"], len(lat), len(tokens) * a.steps))
            continue
        blocks = [statistics.median(lat[b * a.steps:(b + 1) * a.steps]) for b in range(len(tokens))]
        by[(r["backend"], r["shared_mode"])] = (blocks, r)
    print("%-26s %7s %12s %12s %9s   %s" % ("case", "T/rank", "fused us", "separate us", "delta", "counters f/s/sh/g, rel L2 f / s"))
    for (backend, mode), (blocks, r) in sorted(by.items()):
        if mode != "fused" or (backend, "separate") not in by:
            continue
        sblocks, rs = by[(backend, "separate")]
        cf, cs = r["counters"], rs["counters"]
        cnt = "%d/%d/%d/%d, %d/%d/%d/%d" % (cf["shared_fused"], cf["shared_separate"], cf["shared_sharded"], cf["graph_replays"],
                                            cs["shared_fused"], cs["shared_separate"], cs["shared_sharded"], cs["graph_replays"])
        for b, T in enumerate(tokens):
            f, s = blocks[b], sblocks[b]
            print("%-26s %7d %12.1f %12.1f %+8.1f%%   %s, %.1e / %.1e %s/%s" % (
                r["case"] + " " + backend, T, f, s, 100.0 * (f / s - 1.0), cnt, r.get("rel_l2_error") or 0,
                rs.get("rel_l2_error") or 0, r.get("status"), rs.get("status")))
            # Eager runs: the phases' medians over the block (prepare / experts / finalize / separate shared).
            pf, ps = phase_blocks(r, a.steps, b), phase_blocks(rs, a.steps, b)
            if pf and ps:
                print("%-26s %7s   phases us p50 fused %s | separate %s" % ("", "", "/".join("%.0f" % v for v in pf),
                                                                        "/".join("%.0f" % v for v in ps)))


def phase_blocks(r, steps, b):
    """Median per phase column over block b of phase_us_per_step (eager runs), or None."""
    ph = (r.get("phase_us_per_step") or {}).get("steps") or []
    rows = ph[b * steps:(b + 1) * steps]
    if len(rows) != steps:
        return None
    return [statistics.median(row[c] for row in rows) for c in range(len(rows[0]))]


if __name__ == "__main__":
    main()
