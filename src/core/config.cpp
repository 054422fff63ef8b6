#include "epx/config.h"

#include <algorithm>
#include <cmath>
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
constexpr double kNoBound = std::numeric_limits<double>::infinity();

/// What a knob's value must be: one of `choices` (a choice), or a number in [lo, hi] (a multiple of
/// `multiple` where it is > 0; `besides` also allowed outside the range, e.g. "0" for auto). `why` is
/// appended to the rule's text in parentheses.
struct Rule {
  std::vector<const char*> choices;
  double lo = -kNoBound, hi = kNoBound;
  int multiple = 0;
  const char* besides = nullptr;
  const char* why = nullptr;
};

Rule one_of(std::vector<const char*> choices) {
  Rule r;
  r.choices = std::move(choices);
  return r;
}
Rule in_range(double lo, double hi, int multiple = 0, const char* why = nullptr) {
  Rule r;
  r.lo = lo, r.hi = hi, r.multiple = multiple, r.why = why;
  return r;
}
Rule at_least(double lo) { return in_range(lo, kNoBound); }
/// `besides` (auto, "the most") or a number in [lo, hi].
Rule or_in_range(const char* besides, double lo, double hi) {
  Rule r = in_range(lo, hi);
  r.besides = besides;
  return r;
}

/// One knob: the registry's entry. The default is the Config field's initializer.
struct Field {
  const char* key;
  const char* env;
  const char* unit;
  Rule rule;
  const char* meaning;  // one line; no '|' (it stands in a Markdown table)
};

// THE list of configuration knobs. Everything else walks it: JSON, environment, set(), validate(),
// describe(), knobs() (`epx info --knobs`, the Python docstrings, docs/configuration.md).
template <class C, class Visit>
void for_each_field(C& c, Visit&& v) {
  v(Field{"timeout_s", "EPX_TIMEOUT_S", "s",
          in_range(kMinTimeoutS, kMaxTimeoutS, 0, "a shorter wait cannot outlast one step of a peer; deadlines are int64 nanoseconds"),
          "longest wait on a peer rank before epx::Timeout"},
    c.timeout_s);
  v(Field{"log_level", "EPX_LOG_LEVEL", "", one_of({"trace", "debug", "info", "warn", "error", "off"}),
          "the least severe log message printed"},
    c.log_level);
  v(Field{"ll.warps_per_block", "EPX_LL_WARPS_PER_BLOCK", "warps", in_range(4, 32, 4), "warps per block of the ll CUDA kernels"},
    c.ll_warps_per_block);
  v(Field{"ll.num_blocks", "EPX_LL_NUM_BLOCKS", "blocks", at_least(0),
          "blocks of the ll CUDA kernels; 0 = one per SM (per SM of the rank's share on virtual ranks)"},
    c.ll_num_blocks);
  v(Field{"ll.combine", "EPX_LL_COMBINE", "", one_of({"column", "partial_fp32", "partial_bf16"}),
          "ll's combine reduction in `epx bench` (the API takes DispatchConfig::ll_combine): partial_fp32 one fp32 row per "
          "(token, rank) and one rounding, partial_bf16 half those bytes and two roundings, column the no-EP reference's sum bit for bit"},
    c.ll_combine);
  v(Field{"ll.combine_wait", "EPX_LL_COMBINE_WAIT", "", one_of({"flag", "data"}),
          "how ll's partial combine on CUDA learns that a row arrived: flag = one flag per send block, then the reduction; "
          "data = the rows themselves, each token reduced as its rows land; the same on every rank"},
    c.ll_combine_wait);
  v(Field{"ht.num_sms", "EPX_HT_NUM_SMS", "SMs", in_range(1, 132),
          "SM budget of the ht CUDA kernels (at most SMs / ranks per GPU on virtual ranks)"},
    c.ht_num_sms);
  v(Field{"ht.warps_per_block", "EPX_HT_WARPS_PER_BLOCK", "warps", in_range(1, 32), "warps per block of the ht kernels (ht on CUDA takes 1..16)"},
    c.ht_warps_per_block);
  v(Field{"ht.chunk_rows", "EPX_HT_CHUNK_ROWS", "rows", in_range(1, 4096), "ht combine on CUDA: received rows per chunk flag"},
    c.ht_chunk_rows);
  v(Field{"ht.pdl", "EPX_HT_PDL", "", one_of({"0", "1"}),
          "ht on CUDA: 1 starts the dispatch kernel behind the layout kernel by programmatic dependent launch, 0 after it"},
    c.ht_pdl);
  v(Field{"experts.simt", "EPX_EXPERTS_SIMT", "", one_of({"0", "1"}),
          "1: the CUDA experts always run the SIMT reference GEMMs; 0: the tensor-core kernels where the GPU and the build have them"},
    c.experts_simt);
  v(Field{"experts.fp8_prefill", "EPX_EXPERTS_FP8_PREFILL", "", one_of({"0", "1"}),
          "1: FP8 experts with > 64 rows run the 128-row-tile prefill GEMMs; 0: every tile on the 64-row kernels"},
    c.experts_fp8_prefill);
  v(Field{"experts.fp8_prefill_stages", "EPX_EXPERTS_FP8_PREFILL_STAGES", "stages", or_in_range("0", 2, 4),
          "ring depth of the FP8 prefill GEMMs in 48 KiB stages; 0 = the most that fits (gate_up 4, down 3)"},
    c.experts_fp8_prefill_stages);
  v(Field{"experts.fp8_prefill_min_tiles", "EPX_EXPERTS_FP8_PREFILL_MIN_TILES", "tiles", at_least(0),
          "the FP8 prefill GEMMs run only when the experts with > 64 rows fill at least this many 128-row tiles; 0 = one wave of the GPU, 1 = any"},
    c.experts_fp8_prefill_min_tiles);
  v(Field{"experts.mxfp4_tc", "EPX_EXPERTS_MXFP4_TC", "", one_of({"0", "1"}),
          "1: MXFP4 experts run the MXFP4 tensor-core kernels; 0: the SIMT GEMMs"},
    c.experts_mxfp4_tc);
  v(Field{"moe.chunk_size", "EPX_MOE_CHUNK_SIZE", "tokens", at_least(0), "at most this many tokens per MoE call per rank (DP chunking); 0 = no chunking"},
    c.moe_chunk_size);
  v(Field{"fhmoe.max_tokens", "EPX_FHMOE_MAX_TOKENS", "tokens", at_least(0),
          "fuse the shared expert into the routed experts' launch when M (the largest token count of any rank) <= this"},
    c.fhmoe_max_tokens);
  v(Field{"fhmoe.local_shared_tokens", "EPX_FHMOE_LOCAL_SHARED_TOKENS", "tokens", at_least(0),
          "on ll (per-expert slots), fused chunks with M > this put the rank's own shared-expert rows into the shared expert's "
          "local slot instead of the dispatch"},
    c.fhmoe_local_shared_tokens);
  v(Field{"fhmoe.max_tokens_mixed", "EPX_FHMOE_MAX_TOKENS_MIXED", "tokens", at_least(0),
          "fhmoe.max_tokens for layers whose shared expert's weight format differs from the routed experts' (DeepSeek-V4-Pro)"},
    c.fhmoe_max_tokens_mixed);
  v(Field{"fhmoe.max_tokens_sharded", "EPX_FHMOE_MAX_TOKENS_SHARDED", "tokens", at_least(0),
          "fhmoe.max_tokens for layers that run the shared expert DP-sharded (naive, allgather_reducescatter); 0 = never fuse there"},
    c.fhmoe_max_tokens_sharded);
}

/// A bound as a person writes it: 4, 0.001, 1e9.
std::string number_text(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e7) return std::to_string(static_cast<long long>(v));
  std::ostringstream os;
  os << v;
  std::string s = os.str();
  const size_t e = s.find("e+");
  if (e != std::string::npos) {
    size_t d = e + 2;
    while (d + 1 < s.size() && s[d] == '0') ++d;
    s = s.substr(0, e + 1) + s.substr(d);
  }
  return s;
}

/// The values a rule allows, as its message says them after "must be ".
std::string allowed_text(const Rule& r) {
  if (!r.choices.empty()) {
    if (r.choices.size() == 2) return std::string(r.choices[0]) + " or " + r.choices[1];
    std::string s = "one of ";
    for (size_t i = 0; i < r.choices.size(); ++i) s += (i ? ", " : "") + std::string(r.choices[i]);
    return s;
  }
  std::string range;
  if (r.hi == kNoBound) range = ">= " + number_text(r.lo);
  else range = "in [" + number_text(r.lo) + ", " + number_text(r.hi) + "]";
  if (r.multiple > 0) range = "a multiple of " + std::to_string(r.multiple) + " " + range;
  if (r.besides) range = std::string(r.besides) + " or " + range;
  return range;
}

std::string rule_text(const Rule& r) {
  return "must be " + allowed_text(r) + (r.why ? std::string(" (") + r.why + ")" : std::string());
}

/// Whether `value` keeps rule `r`.
template <class T>
bool keeps(const Rule& r, const T& value) {
  if constexpr (std::is_same_v<T, std::string>) {
    return std::find(r.choices.begin(), r.choices.end(), value) != r.choices.end();
  } else {
    if (!r.choices.empty()) {
      std::ostringstream os;
      os << value;
      return std::find(r.choices.begin(), r.choices.end(), os.str()) != r.choices.end();
    }
    const double v = static_cast<double>(value);
    if (r.besides && v == std::stod(r.besides)) return true;
    if (!(v >= r.lo && v <= r.hi)) return false;  // NaN fails too
    if constexpr (std::is_integral_v<T>)
      if (r.multiple > 0 && value % r.multiple != 0) return false;
    return true;
  }
}

template <class T>
std::string type_name(const Rule& r) {
  if (!r.choices.empty()) return "choice";
  return std::is_integral_v<T> ? "int" : "float";
}

template <class T>
std::string value_text(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
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
  Config copy = *this;
  for_each_field(copy, [&](const Field& f, auto& field) { require_arg("config", f.key, field, keeps(f.rule, field), rule_text(f.rule)); });
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
    std::string src = "default";
    for (auto& [k, s] : sources)
      if (k == f.key) src = s;
    std::string line = std::string(f.key) + " = " + value_text(field);
    line.resize(std::max<size_t>(line.size() + 1, 32), ' ');  // at least one blank between the columns
    line += "[" + src + "]";
    line.resize(std::max<size_t>(line.size() + 1, 56), ' ');
    line += std::string(f.meaning) + (f.unit[0] ? std::string(" [") + f.unit + "]" : "");
    out.push_back(line);
  });
  return out;
}

std::vector<Knob> Config::knobs() {
  std::vector<Knob> out;
  Config defaults;
  for_each_field(defaults, [&](const Field& f, auto& field) {
    using T = std::decay_t<decltype(field)>;
    std::string attr = f.key;
    std::replace(attr.begin(), attr.end(), '.', '_');
    out.push_back(Knob{f.key, f.env, attr, type_name<T>(f.rule), f.unit, value_text(field), allowed_text(f.rule), rule_text(f.rule), f.meaning});
  });
  return out;
}

std::string Config::knobs_markdown(const std::string& prefix) {
  std::string s = "| key | environment | type | default | allowed | meaning |\n|---|---|---|---|---|---|\n";
  int rows = 0;
  for (const Knob& k : knobs()) {
    if (k.key.rfind(prefix, 0) != 0) continue;
    ++rows;
    s += "| `" + k.key + "` | `" + k.env + "` | " + k.type + (k.unit.empty() ? "" : " (" + k.unit + ")") + " | " + k.default_value + " | " +
         k.allowed + " | " + k.meaning + " |\n";
  }
  require_arg("config", "knob prefix", prefix, rows > 0, "must begin at least one key (ll., ht., experts., moe., fhmoe., ...; \"\" for all)");
  return s;
}

}  // namespace epx
