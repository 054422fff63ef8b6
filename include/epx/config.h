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
  int ll_warps_per_block = 16;       ///< warps per block of LL kernels; multiple of 4 (16: measured, bench/NOTES.md, 'LL polling load and the expansion')
  int ll_num_blocks = 0;             ///< blocks of LL kernels; 0 = one per SM (on virtual ranks, per SM of the rank's share: SMs / ranks per GPU)
  /// ll combine reduction for epx bench: column | partial_fp32 | partial_bf16 (epx::LlCombine; the
  /// API takes DispatchConfig::ll_combine, the same default, chosen by measurement).
  std::string ll_combine = "partial_fp32";
  /// ll partial combine (partial_fp32 / partial_bf16), how the receiver learns that a partial row
  /// arrived: flag (one flag word per (source, send block), released after the block's stores; the
  /// receiver waits for all, then reduces) | data (the partial rows are the signal: the receiver
  /// re-poisons every row it read with an impossible word and polls the row itself, so each
  /// (token, run) is reduced as soon as its rows land; no release round trip). All ranks must agree;
  /// the same results. flag is the default: data is faster in some runs and slower in others, and
  /// slower at T = 1 (bench/NOTES.md, 'LL combine, the rows as the signal').
  std::string ll_combine_wait = "flag";
  int ht_num_sms = 64;               ///< SM budget of HT kernels (on virtual ranks at most SMs / ranks per GPU) (64: measured, bench/NOTES.md, 'HT kernels')
  int ht_warps_per_block = 16;       ///< warps per block of HT kernels
  int ht_combine_mode = 0;           ///< HT combine on CUDA: 0 all sends then all reduces, 1 pipelined (bench/NOTES.md)
  int ht_chunk_rows = 4;             ///< HT combine on CUDA: rows per chunk flag (bench/NOTES.md "HT kernels")
  int ht_fp8_unroll = 0;             ///< HT fp8 dispatch on CUDA: 1x128 groups in flight per warp / 4 (4 or 7); 0 = auto (bench/NOTES.md)
  /// HT on CUDA: 1 launches the dispatch kernel with programmatic dependent launch behind the layout
  /// kernel (default, by measurement), 2 also has each warp's first row of x prefetched into L2
  /// meanwhile (it delays the layout's routing compare: slower), 0 neither (bench/NOTES.md, 'HT kernels')
  int ht_pdl = 1;
  int experts_simt = 0;              ///< 1: CUDA experts always take the SIMT reference GEMMs (for comparison and debugging)
  int experts_fp8_pairs = 0;         ///< 1: the FP8 tensor-core mainloop that runs K blocks in pairs (bench/NOTES.md)
  /// 1: experts with > 64 rows take the FP8 warp-specialized prefill GEMMs (128-row tiles: TMA loads,
  /// 2-CTA clusters sharing the weight tile; the cp.async kernels where a TMA map cannot be encoded);
  /// 0: every tile stays on the 64-row kernels (bench/NOTES.md, 'FP8 prefill GEMM')
  int experts_fp8_prefill = 1;
  int experts_fp8_prefill_stages = 0; ///< their ring depth in 48 KiB stages: 0 = maximum (gate_up 4, down 3), 2..4
  /// the prefill section runs only when the experts with > 64 rows need at least this many 128-row
  /// tiles in all (decided on the device per apply); below it every tile stays on the 64-row kernels,
  /// whose persistent grid spreads a lone big expert (the fused shared expert at decode) over all SMs
  /// instead of a serial tail launch on a few. 0 = one wave: ceil(SMs / gate_up weight tiles per
  /// row tile) (bench/NOTES.md, 'the fused decode regression'); 1 = any big expert
  int experts_fp8_prefill_min_tiles = 0;
  int experts_mxfp4_tc = 1;          ///< 1: mxfp4 experts run on the MXFP4 tensor-core kernels; 0: the SIMT GEMMs
  int moe_chunk_size = 0;            ///< DP chunk: at most this many tokens per MoE call per rank; 0 = no chunking
  /// capability gate: fuse the shared expert when M <= this (layers that run it DP-sharded take
  /// fhmoe_max_tokens_sharded instead, layers of mixed weight formats fhmoe_max_tokens_mixed). 4096 = the
  /// largest M measured: through the whole layer (DeepSeek-V3 and V4-Pro; ll, ht, all2allv; decode and eager
  /// prefill) fused is never measurably slower up to there, and faster at decode sizes (-30 % at M = 1 for
  /// V3 on ll); above 4096 it is not measured (bench/NOTES.md, 'FHMoE on DeepSeek-V4-Pro, the gate between
  /// 512 and 4096').
  int fhmoe_max_tokens = 4096;
  /// The gate of heterogeneous layers, whose shared expert's weight format differs from the routed experts'
  /// (DeepSeek-V4-Pro: FP8 shared, MXFP4 routed), in place of fhmoe_max_tokens (a DP-sharded layer still takes
  /// fhmoe_max_tokens_sharded). 1024: the largest M at which fused is not measurably slower through the whole
  /// V4-Pro layer (one H200, ht, eager prefill): once M is large the mixed grouped launch costs more than the
  /// MXFP4 experts plus a separate FP8 shared expert. Homogeneous layers (V3: FP8 both) keep
  /// fhmoe_max_tokens = 4096: there the fused experts phase stays faster up to 4096 (bench/NOTES.md, 'the
  /// FHMoE gate at prefill sizes').
  int fhmoe_max_tokens_mixed = 1024;
  /// On a backend of per-expert slots (ll: ExpertMajor, one node, CUDA), fused chunks with M > this
  /// write their shared expert rows into the shared replica's slot (local expert L-1) by hand instead
  /// of dispatching them as route id E: they are this rank's own tokens, so they skip the dispatch
  /// and the combine; the grouped launch still runs them with the routed experts, and out += g * y
  /// after the combine (the separate path's rounding). A whole-layer graph decides at capture with
  /// M = T_max. 512, by measurement (bench/NOTES.md, 'FHMoE on DeepSeek-V4-Pro, the gate between 512 and
  /// 4096'): above it ll's fused prepare through the dispatch grows to several times the separate one's, and
  /// the slot makes fused level or faster; in a graph of T_max <= 512 the slot costs more per replay than the
  /// dispatch, so graphs up to 512 keep the dispatch.
  int fhmoe_local_shared_tokens = 512;  ///< (tokens) the local shared slot when M > this
  /// The gate of layers that run the shared expert DP-sharded on fused chunks (backends that gather
  /// every rank's tokens: naive, allgather_reducescatter; ModularMoEOptions::shard_shared_expert).
  /// 0 = never fuse there: the fused experts phase equals the separate experts + shared expert phases at
  /// every T, so fusing saves no compute on these backends; the fused chunk's larger dispatch loses most at
  /// 1 token per rank (DeepSeek-V3 decode), and a max-tokens gate cannot keep 8..128 without 1
  /// (bench/NOTES.md, 'The sharded gate, measured').
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
