// epx/config.h: the one configuration struct (STYLE.md §5).
//
// Precedence: default < JSON file (EPX_CONFIG or load_file) < EPX_* environment < explicit API argument.
// The field list lives once, in src/core/config.cpp (for_each_field); JSON loading, environment
// overrides, validation and `epx info` all walk it. Unknown JSON keys and unknown EPX_* variables
// are errors that suggest the nearest known key.
#pragma once

#include <string>
#include <vector>

namespace epx {

struct Config {
  // ---- general ----
  double timeout_s = 60.0;           ///< longest wait on a peer before Timeout [s]; 1e-3 <= value <= 1e9
                                     ///< (deadlines are int64 ns), else InvalidArgument
  std::string log_level = "warn";    ///< trace | debug | info | warn | error | off

  // ---- parameters that affect performance (launch shapes; defaults chosen by measurement) ----
  int ll_warps_per_block = 16;       ///< warps per block of LL kernels; multiple of 4 (16: bench/NOTES.md, fourth session)
  int ll_num_blocks = 0;             ///< blocks of LL kernels; 0 = one per SM (on virtual ranks, per SM of the rank's share: SMs / ranks per GPU)
  /// ll combine reduction for epx bench: column | partial_fp32 | partial_bf16 (epx::LlCombine; the
  /// API takes DispatchConfig::ll_combine, the same default, chosen by measurement).
  std::string ll_combine = "partial_fp32";
  /// ll completion signal: chunk (default, by measurement: with ll.expand = message the counts and each
  /// message slot's source token are sent tagged before the payload, and each expansion item waits only
  /// for the flags of the send blocks that stored its chunks; -3.5 us at ll-v3 against block, seventh and
  /// eighth sessions, bench/NOTES.md; the slot-token words carry the call's own number since the eighth
  /// session, so no stale word passes as current) | block (one flag word per (source, send block), the
  /// receiver waits for all, then loads the counts and expands) | rank (the source's last block to
  /// finish stores one word per destination: +2-3 us at ll-v3 for its fence and atomic chain).
  std::string ll_signal = "chunk";
  /// ll dispatch expansion: message (default, by measurement: the sender ranks each token per expert,
  /// warps copy (message, chunk) items; -10 us at ll-v3) | expert (a block per local expert scans
  /// all messages; bench/NOTES.md).
  std::string ll_expand = "message";
  /// ll work items: run (default, by measurement: a warp takes a run of consecutive chunks of one
  /// message / token: the partial combine's send and receive, the dispatch expansion; routing loaded
  /// once, all the run's loads in flight; -1.4 us dispatch, -2.7 us partial_bf16 combine at ll-v3,
  /// bench/NOTES.md "fifth session") | chunk (a warp takes one chunk at a time). Rank-local, same results.
  std::string ll_items = "run";
  /// ll partial combine (partial_fp32 / partial_bf16), how the receiver learns that a partial row
  /// arrived: flag (one flag word per (source, send block), released after the block's stores; the
  /// receiver waits for all, then reduces) | data (the partial rows are the signal: the receiver
  /// re-poisons every row it read with an impossible word and polls the row itself, so each
  /// (token, run) is reduced as soon as its rows land; no release round trip; bench/NOTES.md seventh
  /// session). All ranks must agree (flag_lane counts as flag); the same results. flag stays the default:
  /// data measured 2 us faster in two runs and 0.9 us slower in a third, and slower at T = 1 (bench/NOTES.md).
  /// flag stores the fp32 partial rows as whole 128-byte lines per warp instruction (eighth session);
  /// flag_lane (A/B, rank-local) keeps the seventh session's per-lane stores. data's A/B variants
  /// (data_nofence, data_fence, data_cg, data_weak) were removed and are refused.
  std::string ll_combine_wait = "flag";
  int ht_num_sms = 64;               ///< SM budget of HT kernels (on virtual ranks at most SMs / ranks per GPU) (64: measured, bench/NOTES.md "Fourth session: bandwidth")
  int ht_warps_per_block = 16;       ///< warps per block of HT kernels
  int ht_combine_mode = 0;           ///< HT combine on CUDA: 0 all sends then all reduces, 1 pipelined (bench/NOTES.md)
  int ht_chunk_rows = 4;             ///< HT combine on CUDA: rows per chunk flag (bench/NOTES.md "HT kernels")
  int ht_fp8_unroll = 0;             ///< HT fp8 dispatch on CUDA: 1x128 groups in flight per warp / 4 (4 or 7); 0 = auto (bench/NOTES.md)
  /// HT on CUDA: 1 launches the dispatch kernel with programmatic dependent launch behind the layout
  /// kernel (default, by measurement), 2 also has each warp's first row of x prefetched into L2
  /// meanwhile (it delays the layout's routing compare: slower), 0 neither (bench/NOTES.md, fifth session)
  int ht_pdl = 1;
  int experts_simt = 0;              ///< 1: CUDA experts always take the SIMT reference GEMMs (A/B, debugging)
  int experts_fp8_pairs = 0;         ///< 1: the FP8 tensor-core mainloop that runs K blocks in pairs (bench/NOTES.md)
  int experts_fp8_prefill = 1;       ///< experts with > 64 rows take the FP8 warp-specialized prefill GEMMs: 1 the measured fastest (30's kernels since the twelfth session: TMA loads with the lean consumer, the Flat gate_up's token rows permuted into row-space order first, 2-CTA clusters sharing the weight tile), 8 cp.async loads (tokens in wgmma A), 17 = 8 with early scales / release, bulk-copy stores and wgmma A in registers, 10 = 17 with TMA loads, 23 = 10 with the lean consumer (pinned per-thread offsets, 40 / 232 registers), 27 = 23 loading the next K block under the last promotion, 29 = 27 with the Flat gate_up's token rows copied into row-space order first (one TMA box per tile; the default's kernels in the eleventh session), 30 = 29 as 2-CTA clusters whose CTAs (two 128-token tiles of one expert) share the weight tile, each TMA-multicasting one 128-row half into both (the default's kernels), 31 = 30's clusters without the multicast (measured level with 30), 33 = 30 pairing the tile list's entries in plain expert order (the twelfth session's pairing; 1, 30 and 31 order the tiles so that each pair is one expert's but one per two odd-count experts, ScheduleParams::pair_big); 0 off; 2-7, 9, 11-16, 18-22, 24-26, 28 and 32 were removed after measurement and are refused (bench/NOTES.md)
  int experts_fp8_prefill_stages = 0; ///< their ring depth in 48 KiB stages: 0 = maximum (gate_up 4, down 3), 2..4
  /// the prefill section runs only when the experts with > 64 rows need at least this many 128-row
  /// tiles in all (decided on the device per apply); below it every tile stays on the 64-row kernels,
  /// whose persistent grid spreads a lone big expert (the fused shared expert at decode) over all SMs
  /// instead of a serial tail launch on a few. 0 = one wave: ceil(SMs / gate_up weight tiles per
  /// row tile) (bench/NOTES.md, sixth session); 1 = any big expert (the fifth session's behaviour)
  int experts_fp8_prefill_min_tiles = 0;
  int experts_mxfp4_tc = 1;          ///< 0: mxfp4 experts keep the SIMT GEMMs; 1: MXFP4 tensor-core kernels; 2: their 512-thread (wide) variant; 3, 7: A/Bs of the mma.sync decode path (experts_mxfp4_cuda.h, MixedGemmParams::decode)
  int moe_chunk_size = 0;            ///< DP chunk: at most this many tokens per MoE call per rank; 0 = no chunking
  /// capability gate: fuse the shared expert when M <= this (layers that run it DP-sharded take
  /// fhmoe_max_tokens_sharded instead). 4096 = the largest M measured, and fused never measurably
  /// slower up to there (seventh session, EP2, bench/results/h200x2/fhmoe-s7-batch{1,2}-*/):
  /// fused / separate - 1 through the layer, DeepSeek-V3, ll (graph, decode) -30 % at M = 1, -13 %
  /// at 8, -6 % at 32 and 128, -3 % at 512; eager 512..4096: ht -3..-5 %, all2allv -2..-12 %, ll
  /// with the local shared slot a tie (-8..+6 % over two batches, +3..+14 % at 512 through the dispatch); DeepSeek-V4-Pro (MXFP4 routed, FP8 shared): ll decode
  /// -16 % at 1, -5..-7 % at 8, -1..-2 % at 32..512; eager 512..3072 ht, all2allv, ll within
  /// -3..+2 % (ties). Above 4096 not measured. Eleventh session, one H200, whole layer (ll loopback, graph; the MXFP4
  /// decode path of that session): V4-Pro -24 % at 1, -12 % at 4, -9 % at 8, -1 % at 128; V3 -15 / -14 / -5 / -3 %
  /// (bench/results/h200x1/fhmoe1-s11-f55e988/).
  int fhmoe_max_tokens = 4096;
  /// The gate of heterogeneous layers, whose shared expert's weight format differs from the routed experts'
  /// (DeepSeek-V4-Pro: FP8 shared, MXFP4 routed), in place of fhmoe_max_tokens (a DP-sharded layer still takes
  /// fhmoe_max_tokens_sharded). 1024: the largest M at which fused was not measurably slower through the whole
  /// V4-Pro layer on one H200 (thirteenth session, ht, eager prefill, 5 steps per M, bench/results/h200x1/
  /// lead-s13-4a9112b/: fused / separate - 1 = -2.5 / -2.5 / -0.4 / -0.3 / +1.3 / +3.0 % at M = 256 / 512 / 768 /
  /// 1024 / 2048 / 4096; the experts phase alone 0 / +42 / +238 / +540 us at 768 / 1024 / 2048 / 4096: the mixed
  /// grouped launch costs more than the MXFP4 experts plus a separate FP8 shared expert once M is large). The
  /// kernel-level sweep (epx-gemm-mxfp4-bench, eleventh / twelfth sessions) puts the crossover a little lower
  /// (fused <= separate up to 512 with 192 local experts, 768 with 48), without the dispatch / combine the layer
  /// adds. Homogeneous layers (V3: FP8 both) keep fhmoe_max_tokens = 4096: there the fused experts phase stayed
  /// faster up to 4096 in the same session (bench/results/h200x1/fhmoe-s13-ec1f763/).
  int fhmoe_max_tokens_mixed = 1024;
  /// On a backend of per-expert slots (ll: ExpertMajor, one node, CUDA), fused chunks with M > this
  /// write their shared expert rows into the shared replica's slot (local expert L-1) by hand instead
  /// of dispatching them as route id E: they are this rank's own tokens, so they skip the dispatch
  /// and the combine; the grouped launch still runs them with the routed experts, and out += g * y
  /// after the combine (the separate path's rounding). A whole-layer graph decides at capture with
  /// M = T_max. 512: measured (seventh session, bench/results/h200x2/fhmoe-s7-batch{1,2}-*/): through
  /// the dispatch ll's fused prepare grew to 2.78 ms against 0.56 at 4096 (fused / separate - 1 =
  /// +11..+32 % eager at 768..4096), with the slot -1..-8 % (V3) and -0.3..+1.7 % (V4-Pro); in a
  /// graph of T_max = 512 the slot cost 10-45 us per replay more than the dispatch (V3 fused /
  /// separate - 1 at T = 1: -18 % against -30 %), so graphs up to 512 keep the dispatch.
  int fhmoe_local_shared_tokens = 512;  ///< (tokens) the local shared slot when M > this
  /// The gate of layers that run the shared expert DP-sharded on fused chunks (backends that gather
  /// every rank's tokens: naive, allgather_reducescatter; ModularMoEOptions::shard_shared_expert).
  /// 0 = never fuse there: with 50 steps per T (ninth session, bench/results/h200x2/fhmoe-sharded-s9-*/,
  /// DeepSeek-V3 decode, eager) fused / separate - 1 was +16.0 / +9.2 % at 1 token per rank (naive /
  /// allgather_reducescatter; the fused chunk's larger dispatch), -1.0 / -6.0 % at 8, +1.6 / -1.2 % at 32,
  /// -2.4 / -3.7 % at 128, and +2.5 / +3.1 % at 512 (seventh session): the fused experts phase equals the
  /// separate experts + shared expert phases at every T, so fusing saves no compute on these backends,
  /// and a max-tokens gate cannot keep 8..128 without 1, where the loss is largest.
  int fhmoe_max_tokens_sharded = 0;

  /// Where each field's value came from ("default", "json <file>", "env EPX_...", "api").
  std::vector<std::pair<std::string, std::string>> sources;

  /// default < JSON file named by EPX_CONFIG (if set) < EPX_* env. Throws InvalidArgument on bad values.
  static Config load();
  /// default < `json_path` (may be empty) < EPX_* env.
  static Config load(const std::string& json_path);
  /// Apply a JSON document (one flat object of "key": value, the dotted keys `epx info` prints);
  /// unknown keys throw with a suggestion. All or nothing: on any error the Config is unchanged.
  void apply_json_text(const std::string& text, const std::string& origin);
  /// Apply EPX_* environment variables; unknown EPX_* names (other than EPX_CONFIG, EPX_RANK,
  /// EPX_WORLD_SIZE, EPX_RENDEZVOUS, EPX_LOCAL_RANK) throw with a suggestion. All or nothing: on any
  /// error the Config is unchanged.
  void apply_env();
  /// Set one field by key from text (origin "api" unless given). Throws InvalidArgument for an unknown
  /// key, a value that does not parse, or one that breaks the key's rule (as validate() names it, with
  /// the origin); the Config is then unchanged.
  void set(const std::string& key, const std::string& value, const std::string& origin = "api");
  /// Validates every field's rule; throws InvalidArgument naming the first bad one, its value, the
  /// rule and, for a value that is not the default, where it came from ("(set by env EPX_...)").
  void validate() const;
  /// Lines "key = value  [source]  description", as printed by `epx info`.
  std::vector<std::string> describe() const;

 private:
  void validate_fields() const;
};

/// Reads an EPX_* variable that is not a Config field (rank bootstrap: EPX_RANK, EPX_WORLD_SIZE,
/// EPX_RENDEZVOUS, EPX_LOCAL_RANK). The only other place getenv is allowed is config.cpp itself.
std::string env_or(const char* name, const std::string& fallback);

}  // namespace epx
