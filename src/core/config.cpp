#include "epx/config.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/timeout.h"
#include "epx/error.h"
#include "epx/log.h"

extern char** environ;

namespace epx {

namespace {
struct Field {
  const char* key;
  const char* env;
  const char* unit;
  const char* description;
};

// THE list of configuration fields. Everything else walks it.
template <class C, class Visit>
void for_each_field(C& c, Visit&& v) {
  v(Field{"timeout_s", "EPX_TIMEOUT_S", "s", "longest wait on a peer before Timeout; >= 0.001, <= 1e9"}, c.timeout_s);
  v(Field{"log_level", "EPX_LOG_LEVEL", "", "trace|debug|info|warn|error|off"}, c.log_level);
  v(Field{"ll.warps_per_block", "EPX_LL_WARPS_PER_BLOCK", "warps", "warps per block of LL kernels; multiple of 4, 4..32"}, c.ll_warps_per_block);
  v(Field{"ll.num_blocks", "EPX_LL_NUM_BLOCKS", "blocks", "blocks of LL kernels; 0 = one per SM (per SM of the rank's share on virtual ranks)"}, c.ll_num_blocks);
  v(Field{"ll.combine", "EPX_LL_COMBINE", "", "ll combine reduction: column|partial_fp32|partial_bf16"}, c.ll_combine);
  v(Field{"ll.combine_wait", "EPX_LL_COMBINE_WAIT", "", "ll partial combine, receive signal: flag|data (every rank the same)"}, c.ll_combine_wait);
  v(Field{"ht.num_sms", "EPX_HT_NUM_SMS", "SMs", "SM budget of HT kernels; 1..132 (at most SMs / ranks per GPU on virtual ranks)"}, c.ht_num_sms);
  v(Field{"ht.warps_per_block", "EPX_HT_WARPS_PER_BLOCK", "warps", "warps per block of HT kernels; 1..32 (ht on CUDA: 1..16)"}, c.ht_warps_per_block);
  v(Field{"ht.combine_mode", "EPX_HT_COMBINE_MODE", "", "HT combine on CUDA: 0 all sends then all reduces, 1 pipelined (one target per token only)"}, c.ht_combine_mode);
  v(Field{"ht.chunk_rows", "EPX_HT_CHUNK_ROWS", "rows", "HT combine on CUDA: rows per chunk flag; 1..4096"}, c.ht_chunk_rows);
  v(Field{"ht.fp8_unroll", "EPX_HT_FP8_UNROLL", "", "HT fp8 dispatch on CUDA: steps of 4 groups loaded per warp before quantizing: 4 or 7; 0 = auto"}, c.ht_fp8_unroll);
  v(Field{"ht.pdl", "EPX_HT_PDL", "", "HT on CUDA: 1 dispatch kernel by programmatic dependent launch, 2 also prefetches x rows into L2; 0..2"}, c.ht_pdl);
  v(Field{"experts.simt", "EPX_EXPERTS_SIMT", "", "1: CUDA experts always use the SIMT reference GEMMs; 0..1"}, c.experts_simt);
  v(Field{"experts.fp8_pairs", "EPX_EXPERTS_FP8_PAIRS", "", "1: FP8 tensor-core mainloop over K-block pairs; 0..1"}, c.experts_fp8_pairs);
  v(Field{"experts.fp8_prefill", "EPX_EXPERTS_FP8_PREFILL", "", "1: experts with > 64 rows take the FP8 prefill GEMMs (128-row tiles); 0: the 64-row kernels; 0..1"}, c.experts_fp8_prefill);
  v(Field{"experts.fp8_prefill_stages", "EPX_EXPERTS_FP8_PREFILL_STAGES", "stages", "FP8 prefill GEMMs' ring depth; 0 = maximum (gate_up 4, down 3), else 2..4"}, c.experts_fp8_prefill_stages);
  v(Field{"experts.fp8_prefill_min_tiles", "EPX_EXPERTS_FP8_PREFILL_MIN_TILES", "tiles", "FP8 prefill GEMMs run only when the experts with > 64 rows fill at least this many 128-row tiles; 0 = one wave of the GPU, 1 = always"}, c.experts_fp8_prefill_min_tiles);
  v(Field{"experts.mxfp4_tc", "EPX_EXPERTS_MXFP4_TC", "", "1: mxfp4 experts run on the MXFP4 tensor-core kernels; 0: the SIMT GEMMs; 0..1"}, c.experts_mxfp4_tc);
  v(Field{"moe.chunk_size", "EPX_MOE_CHUNK_SIZE", "tokens", "DP chunk: max tokens per MoE call per rank; 0 = unchunked"}, c.moe_chunk_size);
  v(Field{"fhmoe.max_tokens", "EPX_FHMOE_MAX_TOKENS", "tokens", "fuse the shared expert when M <= this (capability gate)"}, c.fhmoe_max_tokens);
  v(Field{"fhmoe.local_shared_tokens", "EPX_FHMOE_LOCAL_SHARED_TOKENS", "tokens",
          "on ll (per-expert slots) fused chunks with M > this put the shared rows into the shared expert's local slot instead of the dispatch"},
    c.fhmoe_local_shared_tokens);
  v(Field{"fhmoe.max_tokens_mixed", "EPX_FHMOE_MAX_TOKENS_MIXED", "tokens",
          "the gate of layers whose shared expert's weight format differs from the routed experts' (V4-Pro: FP8 shared, MXFP4 routed)"},
    c.fhmoe_max_tokens_mixed);
  v(Field{"fhmoe.max_tokens_sharded", "EPX_FHMOE_MAX_TOKENS_SHARDED", "tokens",
          "the gate of layers whose fused path runs the shared expert DP-sharded (naive, allgather_reducescatter)"},
    c.fhmoe_max_tokens_sharded);
}

const char* kBootstrapEnv[] = {"EPX_CONFIG", "EPX_RANK", "EPX_WORLD_SIZE", "EPX_RENDEZVOUS", "EPX_LOCAL_RANK", "EPX_UNIQUE_ID"};

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> d(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) d[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t prev = d[0];
    d[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cur = d[j];
      d[j] = std::min({d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] == b[j - 1] ? 0 : 1)});
      prev = cur;
    }
  }
  return d[b.size()];
}

std::string nearest(const std::string& name, bool env) {
  Config c;
  std::string best;
  size_t best_d = SIZE_MAX;
  for_each_field(c, [&](const Field& f, auto&) {
    std::string k = env ? f.env : f.key;
    size_t d = edit_distance(name, k);
    if (d < best_d) best_d = d, best = k;
  });
  return best;
}

template <class T>
void parse_into(const std::string& key, const std::string& text, T& out) {
  if constexpr (std::is_same_v<T, std::string>) {
    out = text;
  } else {
    // Blanks around the number are allowed (" 7" and "7 " alike); anything else is not.
    const size_t b = text.find_first_not_of(" \t"), e = text.find_last_not_of(" \t");
    std::string num = b == std::string::npos ? std::string() : text.substr(b, e - b + 1);
    if (num.size() > 1 && num[0] == '+' && num[1] != '-') num.erase(0, 1);  // "+7" as before (from_chars takes no '+')
    T v{};
    if constexpr (std::is_integral_v<T>) {
      const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
      // A whole integer that does not fit is named with the field's range, not as "not an integer".
      require_arg("config", key, text, !(ec == std::errc::result_out_of_range && end == num.data() + num.size()),
                  "must be an integer in [" + std::to_string(std::numeric_limits<T>::min()) + ", " +
                      std::to_string(std::numeric_limits<T>::max()) + "]");
      require_arg("config", key, text, ec == std::errc() && end == num.data() + num.size() && !num.empty(), "must be an integer");
    } else {
      std::istringstream is(num);
      is >> v;
      require_arg("config", key, text, !num.empty() && !is.fail() && is.eof(), "must be a number");
    }
    out = v;
  }
}

void set_source(Config& c, const std::string& key, const std::string& origin) {
  for (auto& [k, s] : c.sources)
    if (k == key) { s = origin; return; }
  c.sources.emplace_back(key, origin);
}
}  // namespace

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

void Config::set(const std::string& key, const std::string& value, const std::string& origin) {
  // The value's rule first, on defaults (all valid, so a failure is this key's), naming the origin as
  // validate() does; only then *this changes, so a bad value leaves the Config as it was.
  Config probe;
  bool found = false;
  for_each_field(probe, [&](const Field& f, auto& field) {
    if (key == f.key) {
      parse_into(key, value, field);
      found = true;
    }
  });
  if (!found) throw InvalidArgument(arg_message("config", "key", key, "unknown (did you mean '" + nearest(key, false) + "'?)"));
  set_source(probe, key, origin);
  probe.validate();
  for_each_field(*this, [&](const Field& f, auto& field) {
    if (key == f.key) parse_into(key, value, field);
  });
  set_source(*this, key, origin);
}

void Config::apply_json_text(const std::string& text, const std::string& origin) {
  nlohmann::json j;
  // Keys of the top-level object as the parser meets them: nlohmann keeps the last of a repeated key silently.
  std::vector<std::string> seen;
  std::string repeated;
  try {
    j = nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (depth == 1 && event == nlohmann::json::parse_event_t::key && repeated.empty()) {
        const std::string k = parsed.get<std::string>();
        if (std::find(seen.begin(), seen.end(), k) != seen.end()) repeated = k;
        else seen.push_back(k);
      }
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(arg_message("config", "json", origin, std::string("must be valid JSON (") + e.what() + ")"));
  }
  require_arg("config", "json", origin, j.is_object(), "must be a JSON object of \"key\": value");
  if (!repeated.empty())  // j holds the last value given
    throw InvalidArgument(arg_message("config", repeated, j[repeated].is_string() ? j[repeated].get<std::string>() : j[repeated].dump(),
                                      "is given twice in one JSON object (" + origin + "); give each key once"));
  Config next = *this;  // all or nothing: a bad entry leaves *this as it was
  for (auto& [k, v] : j.items()) {
    if (v.is_object()) {
      const std::string flat = k + "." + (v.empty() ? std::string("<name>") : v.begin().key());
      throw InvalidArgument(arg_message("config", "key", k,
                                        "holds a JSON object; keys are flat dotted names as `epx info` prints them (\"" + flat +
                                            "\": value), not nested objects"));
    }
    // A JSON file gives numbers as JSON numbers and names as JSON strings ("5" for a number would hide a
    // quoting slip; only EPX_* variables carry numbers as text). Unknown keys are left to set().
    int text_field = -1;  // 1: a string field, 0: a number, -1: not a key
    for_each_field(next, [&](const Field& f, auto& field) {
      if (k == f.key) text_field = std::is_same_v<std::decay_t<decltype(field)>, std::string> ? 1 : 0;
    });
    if (text_field == 0 && v.is_string())
      throw InvalidArgument(arg_message("config", k, v.dump(), "must be a JSON number, not a string (" + origin + ")"));
    if (text_field == 1 && !v.is_string())
      throw InvalidArgument(arg_message("config", k, v.dump(), "must be a JSON string (" + origin + ")"));
    next.set(k, v.is_string() ? v.get<std::string>() : v.dump(), origin);
  }
  *this = std::move(next);
}

void Config::apply_env() {
  Config next = *this;  // all or nothing: a bad variable leaves *this as it was
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    if (kv.rfind("EPX_", 0) != 0) continue;
    std::string name = kv.substr(0, kv.find('=')), value = kv.substr(kv.find('=') + 1);
    if (std::find(std::begin(kBootstrapEnv), std::end(kBootstrapEnv), name) != std::end(kBootstrapEnv)) continue;
    bool found = false;
    for_each_field(next, [&](const Field& f, auto& field) {
      if (name == f.env) {
        parse_into(name, value, field);
        set_source(next, f.key, "env " + name);
        found = true;
      }
    });
    if (!found) throw InvalidArgument(arg_message("config", "environment", name, "unknown EPX_* variable (did you mean " + nearest(name, true) + "?)"));
  }
  *this = std::move(next);
}

void Config::validate() const {
  try {
    validate_fields();
  } catch (const InvalidArgument& e) {
    // "config: <key> = <value>: <rule>": say where a value that is not the default came from (a JSON
    // file, an EPX_* variable), which the key alone does not tell.
    const std::string m = e.what(), head = "config: ";
    const size_t eq = m.find(" = ", head.size());
    if (m.rfind(head, 0) == 0 && eq != std::string::npos) {
      const std::string key = m.substr(head.size(), eq - head.size());
      for (const auto& [k, s] : sources)
        if (k == key) throw InvalidArgument(m + " (set by " + s + ")");
    }
    throw;
  }
}

void Config::validate_fields() const {
  require_timeout("config", "timeout_s", timeout_s);
  require_arg("config", "ll.warps_per_block", ll_warps_per_block, ll_warps_per_block % 4 == 0 && ll_warps_per_block >= 4 && ll_warps_per_block <= 32, "must be a multiple of 4 in [4, 32]");
  require_arg("config", "ll.combine", ll_combine, ll_combine == "column" || ll_combine == "partial_fp32" || ll_combine == "partial_bf16",
              "must be one of column, partial_fp32, partial_bf16");
  require_arg("config", "ll.num_blocks", ll_num_blocks, ll_num_blocks >= 0, "must be >= 0");
  require_arg("config", "ll.combine_wait", ll_combine_wait, ll_combine_wait == "flag" || ll_combine_wait == "data", "must be flag or data");
  require_arg("config", "ht.num_sms", ht_num_sms, ht_num_sms >= 1 && ht_num_sms <= 132, "must be in [1, 132]");
  require_arg("config", "ht.warps_per_block", ht_warps_per_block, ht_warps_per_block >= 1 && ht_warps_per_block <= 32, "must be in [1, 32]");
  require_arg("config", "ht.combine_mode", ht_combine_mode, ht_combine_mode == 0 || ht_combine_mode == 1, "must be 0 or 1");
  require_arg("config", "ht.chunk_rows", ht_chunk_rows, ht_chunk_rows >= 1 && ht_chunk_rows <= 4096, "must be in [1, 4096]");
  require_arg("config", "ht.fp8_unroll", ht_fp8_unroll, ht_fp8_unroll == 0 || ht_fp8_unroll == 4 || ht_fp8_unroll == 7, "must be 0, 4 or 7");
  require_arg("config", "ht.pdl", ht_pdl, ht_pdl >= 0 && ht_pdl <= 2, "must be 0, 1 or 2");
  require_arg("config", "experts.simt", experts_simt, experts_simt == 0 || experts_simt == 1, "must be 0 or 1");
  require_arg("config", "experts.fp8_pairs", experts_fp8_pairs, experts_fp8_pairs == 0 || experts_fp8_pairs == 1, "must be 0 or 1");
  require_arg("config", "experts.fp8_prefill", experts_fp8_prefill, experts_fp8_prefill == 0 || experts_fp8_prefill == 1, "must be 0 or 1");
  require_arg("config", "experts.fp8_prefill_stages", experts_fp8_prefill_stages,
              experts_fp8_prefill_stages == 0 || (experts_fp8_prefill_stages >= 2 && experts_fp8_prefill_stages <= 4), "must be 0 or in [2, 4]");
  require_arg("config", "experts.fp8_prefill_min_tiles", experts_fp8_prefill_min_tiles, experts_fp8_prefill_min_tiles >= 0, "must be >= 0 (0 = one wave)");
  require_arg("config", "experts.mxfp4_tc", experts_mxfp4_tc, experts_mxfp4_tc == 0 || experts_mxfp4_tc == 1, "must be 0 or 1");
  require_arg("config", "moe.chunk_size", moe_chunk_size, moe_chunk_size >= 0, "must be >= 0");
  require_arg("config", "fhmoe.max_tokens", fhmoe_max_tokens, fhmoe_max_tokens >= 0, "must be >= 0");
  require_arg("config", "fhmoe.max_tokens_sharded", fhmoe_max_tokens_sharded, fhmoe_max_tokens_sharded >= 0, "must be >= 0");
  require_arg("config", "fhmoe.max_tokens_mixed", fhmoe_max_tokens_mixed, fhmoe_max_tokens_mixed >= 0, "must be >= 0");
  require_arg("config", "fhmoe.local_shared_tokens", fhmoe_local_shared_tokens, fhmoe_local_shared_tokens >= 0, "must be >= 0");
  static const char* levels[] = {"trace", "debug", "info", "warn", "error", "off"};
  require_arg("config", "log_level", log_level, std::find(std::begin(levels), std::end(levels), log_level) != std::end(levels),
              "must be one of trace, debug, info, warn, error, off");
}

Config Config::load(const std::string& json_path) {
  Config c;
  if (!json_path.empty()) {
    std::ifstream f(json_path);
    std::error_code ec;  // a directory opens as an empty stream and read as "must be valid JSON (unexpected end of input)"
    require_arg("config", "json_path", json_path, f.good() && !std::filesystem::is_directory(json_path, ec), "must name a readable file");
    std::stringstream ss;
    ss << f.rdbuf();
    c.apply_json_text(ss.str(), "json " + json_path);
  }
  c.apply_env();
  c.validate();
  log::set_level(c.log_level);
  return c;
}

Config Config::load() { return load(env_or("EPX_CONFIG", "")); }

std::vector<std::string> Config::describe() const {
  std::vector<std::string> out;
  Config copy = *this;
  for_each_field(copy, [&](const Field& f, auto& field) {
    std::ostringstream os;
    os << f.key << " = " << field;
    std::string src = "default";
    for (auto& [k, s] : sources)
      if (k == f.key) src = s;
    std::string line = os.str();
    line.resize(std::max<size_t>(line.size() + 1, 32), ' ');  // at least one blank between the columns
    line += "[" + src + "]";
    line.resize(std::max<size_t>(line.size() + 1, 56), ' ');
    line += std::string(f.description) + (f.unit[0] ? std::string(" [") + f.unit + "]" : "");
    out.push_back(line);
  });
  return out;
}

}  // namespace epx
