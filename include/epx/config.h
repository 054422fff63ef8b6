// epx/config.h: the one configuration struct (STYLE.md §5).
//
// Precedence: default < JSON file (EPX_CONFIG or load_file) < EPX_* environment < explicit API argument.
// Every knob is described once, in the registry of src/core/config.cpp (key, environment variable,
// type, rule, one line of meaning; the default is the initializer below). JSON loading, environment
// overrides, validation, `epx info`, the Python docstrings and docs/configuration.md's table all come
// from it (Config::knobs()). Unknown JSON keys and unknown EPX_* variables are errors that suggest the
// nearest known key.
#pragma once

#include <string>
#include <vector>

namespace epx {

/// One knob as the registry describes it (Config::knobs()).
struct Knob {
  std::string key;            ///< the JSON key, dotted: "ll.num_blocks"
  std::string env;            ///< its environment variable: "EPX_LL_NUM_BLOCKS"
  std::string attr;           ///< the Config field and Python attribute: "ll_num_blocks"
  std::string type;           ///< "int", "float" or "choice"
  std::string unit;           ///< "s", "tokens", ...; empty for none
  std::string default_value;  ///< the default, as `epx info` prints values
  std::string allowed;        ///< the values the rule allows: "in [1, 132]", "flag or data", ">= 0"
  std::string rule;           ///< validate()'s rule text: "must be " + allowed (+ why)
  std::string meaning;        ///< one line: what the knob sets
};

struct Config {
  // The meaning, rule and unit of each field: the registry (`epx info --knobs`, docs/configuration.md).
  // ---- general ----
  double timeout_s = 60.0;
  std::string log_level = "warn";

  // ---- launch shapes and kernel choices (defaults chosen by measurement, bench/NOTES.md) ----
  int ll_warps_per_block = 16;  ///< bench/NOTES.md, 'LL polling load and the expansion'
  int ll_num_blocks = 0;
  std::string ll_combine = "partial_fp32";  ///< for `epx bench`; the API takes DispatchConfig::ll_combine
  std::string ll_combine_wait = "flag";     ///< bench/NOTES.md, 'LL combine, the rows as the signal'
  int ht_num_sms = 64;                      ///< bench/NOTES.md, 'HT kernels'
  int ht_warps_per_block = 16;
  int ht_chunk_rows = 4;
  int ht_pdl = 1;                           ///< bench/NOTES.md, 'HT kernels'
  int experts_simt = 0;
  int experts_fp8_prefill = 1;              ///< bench/NOTES.md, 'FP8 prefill GEMM'
  int experts_fp8_prefill_stages = 0;
  int experts_fp8_prefill_min_tiles = 0;    ///< bench/NOTES.md, 'the fused decode regression'
  int experts_mxfp4_tc = 1;
  int moe_chunk_size = 0;

  // ---- the fused shared expert (FHMoE) gates, in tokens (M = the largest token count of any rank) ----
  /// 4096: the largest M measured; fused is never measurably slower up to there through the whole layer
  /// (bench/NOTES.md, 'FHMoE on DeepSeek-V4-Pro, the gate between 512 and 4096').
  int fhmoe_max_tokens = 4096;
  /// 1024: above it the mixed grouped launch costs more than MXFP4 experts plus a separate FP8 shared
  /// expert (bench/NOTES.md, 'the FHMoE gate at prefill sizes').
  int fhmoe_max_tokens_mixed = 1024;
  /// 512: above it ll's fused prepare grows past the separate one's and the local slot makes fused level
  /// or faster; a whole-layer graph decides at capture with M = T_max (same section as fhmoe_max_tokens).
  int fhmoe_local_shared_tokens = 512;
  /// 0: on the backends that gather every rank's tokens fusing saves no compute and the larger dispatch
  /// loses most at 1 token per rank (bench/NOTES.md, 'The sharded gate, measured').
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
  /// Lines "key = value  [source]  meaning", as printed by `epx info`.
  std::vector<std::string> describe() const;

  /// Every knob, in the registry's order (what `epx info --knobs` prints).
  static std::vector<Knob> knobs();
  /// The Markdown table of the knobs whose key starts with `prefix` ("" for all; "ll." for ll's), as
  /// `epx info --knobs [PREFIX]` prints it and docs/configuration.md holds it (tests/docs_test.cpp).
  static std::string knobs_markdown(const std::string& prefix = "");

 private:
  void validate_fields() const;
};

/// Reads an EPX_* variable that is not a Config field (rank bootstrap: EPX_RANK, EPX_WORLD_SIZE,
/// EPX_RENDEZVOUS, EPX_LOCAL_RANK). The only other place getenv is allowed is config.cpp itself.
std::string env_or(const char* name, const std::string& fallback);

}  // namespace epx
