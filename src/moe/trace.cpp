// src/moe/trace.cpp: the Trace type, its validation and statistics, the JSON form and the JSONL
// importer. The directory form (.npy files) lives in trace_npy.cpp. Format: docs/trace-format.md.
#include "epx/trace.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/topk_message.h"
#include "epx/error.h"
#include "moe/trace_npy.h"

namespace epx {

namespace {
using nlohmann::json;

std::string op_for(const std::string& origin) { return "trace " + origin; }

std::string elem(int64_t step, int64_t rank, const std::string& what) {
  return "steps[" + std::to_string(step) + "].ranks[" + std::to_string(rank) + "]." + what;
}

std::string read_text(const std::string& op, const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  require_arg(op, "path", path, f.good(), "must name a readable file");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Reads a [T, cols] array of numbers from `j` (an array of equal-length rows).
template <class T>
std::vector<T> read_rows(const std::string& op, const json& j, const std::string& what, const char* cols_name, int64_t cols,
                         int64_t* rows_out) {
  require_arg(op, what, j.is_array() ? "array" : std::string(j.type_name()), j.is_array(), "must be an array of rows");
  std::vector<T> out;
  out.reserve(j.size() * static_cast<size_t>(cols));
  for (size_t t = 0; t < j.size(); ++t) {
    const json& row = j[t];
    std::string name = what + "[" + std::to_string(t) + "]";
    require_arg(op, name + ".size", row.is_array() ? std::to_string(row.size()) : std::string(row.type_name()),
                row.is_array() && static_cast<int64_t>(row.size()) == cols,
                "must be a row of " + std::string(cols_name) + " = " + std::to_string(cols) + " numbers (rows may not be ragged)");
    for (size_t k = 0; k < row.size(); ++k) {
      const json& v = row[k];
      std::string vname = name + "[" + std::to_string(k) + "]";
      if constexpr (std::is_integral_v<T>) {
        require_arg(op, vname, v.dump(), v.is_number_integer(), "must be an integer expert id");
        int64_t id = v.get<int64_t>();
        require_arg(op, vname, id, id >= INT32_MIN && id <= INT32_MAX, "must fit in int32");
        out.push_back(static_cast<T>(id));
      } else {
        require_arg(op, vname, v.dump(), v.is_number(), "must be a number");
        out.push_back(v.get<T>());
      }
    }
  }
  *rows_out = static_cast<int64_t>(j.size());
  return out;
}

int get_int_field(const std::string& op, const json& j, const char* key) {
  require_arg(op, key, j.contains(key) ? j[key].dump() : std::string("(missing)"),
              j.contains(key) && j[key].is_number_integer(), "must be present as an integer");
  // get<int>() would wrap: num_experts = 2^32 + 4 read as 4. Both bounds for a signed value (parsed text
  // holds non-negative numbers as unsigned, but a json built in code holds them signed).
  const bool fits = j[key].is_number_unsigned() ? j[key].get<uint64_t>() <= INT32_MAX
                                                : j[key].get<int64_t>() >= INT32_MIN && j[key].get<int64_t>() <= INT32_MAX;
  require_arg(op, key, j[key].dump(), fits, "must fit in a 32-bit int (in [-2147483648, 2147483647])");
  return j[key].get<int>();
}
}  // namespace

// ---- Trace ------------------------------------------------------------------------------------

void Trace::validate(const std::string& origin) const {
  const std::string op = op_for(origin);
  require_arg(op, "num_ranks", num_ranks, num_ranks >= 1, "must be >= 1");
  require_arg(op, "num_experts", num_experts, num_experts >= 1, "must be >= 1");
  require_arg(op, "top_k", top_k, top_k >= 1, "must be >= 1");
  require_arg(op, "hidden", hidden, hidden >= 0, "must be >= 0 (0 = no hidden states)");
  for (size_t s = 0; s < steps.size(); ++s) {
    const auto& st = steps[s];
    require_arg(op, "steps[" + std::to_string(s) + "].ranks.size", st.ranks.size(),
                static_cast<int>(st.ranks.size()) == num_ranks, "must equal num_ranks = " + std::to_string(num_ranks));
    for (size_t r = 0; r < st.ranks.size(); ++r) {
      const TraceRank& tr = st.ranks[r];
      require_arg(op, elem(s, r, "topk_idx"), tr.topk_idx.defined() ? tr.topk_idx.view().describe() : "undefined",
                  tr.topk_idx.defined() && tr.topk_idx.dtype() == DType::int32 && tr.topk_idx.view().ndim == 2 &&
                      tr.topk_idx.size(1) == top_k,
                  "must be [T, top_k = " + std::to_string(top_k) + "] int32");
      const int64_t T = tr.topk_idx.size(0);
      require_arg(op, elem(s, r, "topk_weights"), tr.topk_weights.defined() ? tr.topk_weights.view().describe() : "undefined",
                  tr.topk_weights.defined() && tr.topk_weights.dtype() == DType::fp32 && tr.topk_weights.view().ndim == 2 &&
                      tr.topk_weights.size(0) == T && tr.topk_weights.size(1) == top_k,
                  "must be [T = " + std::to_string(T) + ", top_k = " + std::to_string(top_k) + "] fp32 like topk_idx");
      if (hidden > 0) {
        require_arg(op, elem(s, r, "hidden_states"), tr.hidden_states.defined() ? tr.hidden_states.view().describe() : "missing",
                    tr.hidden_states.defined() && tr.hidden_states.dtype() == DType::bf16 &&
                        tr.hidden_states.view().ndim == 2 && tr.hidden_states.size(0) == T && tr.hidden_states.size(1) == hidden,
                    "must be [T = " + std::to_string(T) + ", hidden = " + std::to_string(hidden) +
                        "] bf16 (hidden states are given for every rank or for none)");
      } else {
        require_arg(op, elem(s, r, "hidden_states"), "present", !tr.hidden_states.defined(),
                    "must be absent when hidden = 0 (set hidden to the row width)");
      }
      const int32_t* idx = tr.topk_idx.ptr<int32_t>();
      const float* w = tr.topk_weights.ptr<float>();
      for (int64_t i = 0; i < T * top_k; ++i) {
        if (idx[i] < -1 || idx[i] >= num_experts)
          throw InvalidArgument(arg_message(op, elem(s, r, detail::topk_elem("topk_idx", i / top_k, i % top_k)), idx[i],
                                            detail::topk_id_rule(num_experts)));
        if (!std::isfinite(w[i]))
          throw InvalidArgument(arg_message(op, elem(s, r, detail::topk_elem("topk_weights", i / top_k, i % top_k)), w[i], "must be finite"));
      }
    }
  }
}

int64_t Trace::max_tokens_per_rank() const {
  int64_t m = 0;
  for (const auto& st : steps)
    for (const auto& r : st.ranks) m = std::max(m, r.num_tokens());
  return m;
}

int64_t Trace::total_tokens() const {
  int64_t n = 0;
  for (const auto& st : steps)
    for (const auto& r : st.ranks) n += r.num_tokens();
  return n;
}

std::vector<std::vector<int64_t>> Trace::selection_counts() const {
  std::vector<std::vector<int64_t>> c(num_ranks, std::vector<int64_t>(num_experts, 0));
  for (const auto& st : steps)
    for (int r = 0; r < num_ranks && r < static_cast<int>(st.ranks.size()); ++r) {
      const TraceRank& tr = st.ranks[r];
      const int32_t* idx = tr.topk_idx.defined() ? tr.topk_idx.ptr<int32_t>() : nullptr;
      for (int64_t i = 0; i < tr.num_tokens() * top_k; ++i)
        if (idx[i] >= 0 && idx[i] < num_experts) ++c[r][idx[i]];
    }
  return c;
}

std::vector<int64_t> Trace::tokens_per_rank() const {
  std::vector<int64_t> n(num_ranks, 0);
  for (const auto& st : steps)
    for (int r = 0; r < num_ranks && r < static_cast<int>(st.ranks.size()); ++r) n[r] += st.ranks[r].num_tokens();
  return n;
}

std::vector<int64_t> Trace::expert_counts() const {
  std::vector<int64_t> n(num_experts, 0);
  for (const auto& per_rank : selection_counts())
    for (int e = 0; e < num_experts; ++e) n[e] += per_rank[e];
  return n;
}

TraceRank make_trace_rank(int top_k, const std::vector<int32_t>& topk_idx, const std::vector<float>& topk_weights,
                          int64_t hidden, const std::vector<uint16_t>& hidden_bf16) {
  require_arg("make_trace_rank", "top_k", top_k, top_k >= 1, "must be >= 1");
  require_arg("make_trace_rank", "topk_idx.size", topk_idx.size(), topk_idx.size() % top_k == 0,
              "must be a multiple of top_k = " + std::to_string(top_k));
  require_arg("make_trace_rank", "topk_weights.size", topk_weights.size(), topk_weights.size() == topk_idx.size(),
              "must equal topk_idx.size = " + std::to_string(topk_idx.size()));
  const int64_t T = static_cast<int64_t>(topk_idx.size()) / top_k;
  TraceRank r;
  r.topk_idx = Tensor::empty({T, top_k}, DType::int32);
  r.topk_weights = Tensor::empty({T, top_k}, DType::fp32);
  std::copy(topk_idx.begin(), topk_idx.end(), r.topk_idx.ptr<int32_t>());
  std::copy(topk_weights.begin(), topk_weights.end(), r.topk_weights.ptr<float>());
  if (!hidden_bf16.empty() || hidden > 0) {
    require_arg("make_trace_rank", "hidden_bf16.size", hidden_bf16.size(),
                hidden > 0 && static_cast<int64_t>(hidden_bf16.size()) == T * hidden,
                "must equal T * hidden = " + std::to_string(T * hidden));
    r.hidden_states = Tensor::empty({T, hidden}, DType::bf16);
    std::copy(hidden_bf16.begin(), hidden_bf16.end(), r.hidden_states.ptr<uint16_t>());
  }
  return r;
}

std::pair<int64_t, int64_t> deal_tokens(int64_t num_tokens, int num_ranks, int rank) {
  require_arg("deal_tokens", "num_ranks", num_ranks, num_ranks >= 1, "must be >= 1");
  require_arg("deal_tokens", "rank", rank, rank >= 0 && rank < num_ranks, "must be in [0, num_ranks)");
  const int64_t base = num_tokens / num_ranks, extra = num_tokens % num_ranks;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

// ---- JSON form --------------------------------------------------------------------------------

Trace parse_trace_json(const std::string& text, const std::string& origin) {
  const std::string op = op_for(origin);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw InvalidArgument(arg_message(op, "json", "unparsable", std::string("must be valid JSON (") + e.what() + ")"));
  }
  require_arg(op, "json", j.type_name(), j.is_object(), "must be a JSON object");
  require_arg(op, "format", j.contains("format") ? j["format"].dump() : "(missing)",
              j.value("format", json()) == "epx-trace", "must be \"epx-trace\"");
  require_arg(op, "version", j.contains("version") ? j["version"].dump() : "(missing)", j.value("version", json()) == 1,
              "must be 1 (the only version this build reads)");
  Trace t;
  t.num_ranks = get_int_field(op, j, "num_ranks");
  t.num_experts = get_int_field(op, j, "num_experts");
  t.top_k = get_int_field(op, j, "top_k");
  require_arg(op, "top_k", t.top_k, t.top_k >= 1, "must be >= 1");
  if (j.contains("hidden")) t.hidden = get_int_field(op, j, "hidden");
  require_arg(op, "hidden", t.hidden, t.hidden >= 0, "must be >= 0 (0 = no hidden states)");  // before the rows use it
  if (j.contains("source")) t.source = j["source"].is_string() ? j["source"].get<std::string>() : j["source"].dump();
  require_arg(op, "steps", j.contains("steps") ? j["steps"].type_name() : "(missing)", j.contains("steps") && j["steps"].is_array(),
              "must be an array of {\"ranks\": [...]}");
  for (size_t s = 0; s < j["steps"].size(); ++s) {
    const json& js = j["steps"][s];
    const std::string sname = "steps[" + std::to_string(s) + "]";
    require_arg(op, sname + ".ranks", js.contains("ranks") ? js["ranks"].type_name() : "(missing)",
                js.is_object() && js.contains("ranks") && js["ranks"].is_array(), "must be an array of per-rank objects");
    require_arg(op, sname + ".ranks.size", js["ranks"].size(), static_cast<int>(js["ranks"].size()) == t.num_ranks,
                "must equal num_ranks = " + std::to_string(t.num_ranks));
    TraceStep step;
    for (size_t r = 0; r < js["ranks"].size(); ++r) {
      const json& jr = js["ranks"][r];
      require_arg(op, elem(s, r, "topk_idx"), "(missing)", jr.is_object() && jr.contains("topk_idx"), "must be present");
      require_arg(op, elem(s, r, "topk_weights"), "(missing)", jr.contains("topk_weights"), "must be present");
      int64_t rows_idx = 0, rows_w = 0;
      auto idx = read_rows<int32_t>(op, jr["topk_idx"], elem(s, r, "topk_idx"), "top_k", t.top_k, &rows_idx);
      auto w = read_rows<float>(op, jr["topk_weights"], elem(s, r, "topk_weights"), "top_k", t.top_k, &rows_w);
      require_arg(op, elem(s, r, "topk_weights.rows"), rows_w, rows_w == rows_idx,
                  "must equal topk_idx.rows = " + std::to_string(rows_idx));
      std::vector<uint16_t> hid;
      const bool has_hidden = jr.contains("hidden_states");
      if (has_hidden) {
        require_arg(op, "hidden", t.hidden, t.hidden > 0, "must be > 0 when ranks carry hidden_states");
        int64_t rows_h = 0;
        auto h = read_rows<float>(op, jr["hidden_states"], elem(s, r, "hidden_states"), "hidden", t.hidden, &rows_h);
        require_arg(op, elem(s, r, "hidden_states.rows"), rows_h, rows_h == rows_idx,
                    "must equal topk_idx.rows = " + std::to_string(rows_idx));
        hid.resize(h.size());
        for (size_t i = 0; i < h.size(); ++i) hid[i] = float_to_bf16_bits(h[i]);
      } else {
        require_arg(op, elem(s, r, "hidden_states"), "(missing)", t.hidden == 0,
                    "must be present on every rank when hidden = " + std::to_string(t.hidden));
      }
      step.ranks.push_back(make_trace_rank(t.top_k, idx, w, has_hidden ? t.hidden : 0, hid));
    }
    t.steps.push_back(std::move(step));
  }
  t.validate(origin);
  return t;
}

std::string trace_to_json(const Trace& t) {
  t.validate();
  // Written by hand, one row per line, so small traces stay readable and diffable.
  std::ostringstream os;
  os << "{\"format\": \"epx-trace\", \"version\": 1, \"num_ranks\": " << t.num_ranks << ", \"num_experts\": " << t.num_experts
     << ", \"top_k\": " << t.top_k;
  if (t.hidden > 0) os << ", \"hidden\": " << t.hidden;
  os << ", \"source\": " << json(t.source).dump() << ",\n \"steps\": [";
  auto rows = [&](auto get, int64_t T, int64_t cols) {
    os << "[";
    for (int64_t i = 0; i < T; ++i) {
      os << (i ? ",\n     [" : "\n     [");
      for (int64_t c = 0; c < cols; ++c) os << (c ? "," : "") << get(i * cols + c);
      os << "]";
    }
    os << "]";
  };
  for (size_t s = 0; s < t.steps.size(); ++s) {
    os << (s ? ",\n  " : "\n  ") << "{\"ranks\": [";
    for (size_t r = 0; r < t.steps[s].ranks.size(); ++r) {
      const TraceRank& tr = t.steps[s].ranks[r];
      const int64_t T = tr.num_tokens();
      const int32_t* idx = tr.topk_idx.ptr<int32_t>();
      const float* w = tr.topk_weights.ptr<float>();
      os << (r ? ",\n    " : "\n    ") << "{\"topk_idx\": ";
      rows([&](int64_t i) { return idx[i]; }, T, t.top_k);
      os << ",\n     \"topk_weights\": ";
      rows([&](int64_t i) { return json(w[i]).dump(); }, T, t.top_k);
      if (t.hidden > 0) {
        const uint16_t* h = tr.hidden_states.ptr<uint16_t>();
        os << ",\n     \"hidden_states\": ";
        rows([&](int64_t i) { return json(bf16_bits_to_float(h[i])).dump(); }, T, t.hidden);
      }
      os << "}";
    }
    os << "]}";
  }
  os << "\n ]}\n";
  return os.str();
}

Trace load_trace(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return detail::load_trace_dir(path);
  return parse_trace_json(read_text(op_for(path), path), path);
}

void save_trace(const Trace& t, const std::string& path) {
  t.validate();
  const bool as_json = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  if (!as_json) return detail::save_trace_dir(t, path);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  require_arg("trace.save", "path", path, f.good(), "must be writable");
  f << trace_to_json(t);
  require_arg("trace.save", "path", path, f.good(), "write failed");
}

// ---- JSONL import -----------------------------------------------------------------------------

Trace import_routing_jsonl(std::istream& in, const TraceImportOptions& opt, const std::string& origin,
                           TraceImportSummary* summary) {
  const std::string op = "trace import";
  require_arg(op, "num_ranks", opt.num_ranks, opt.num_ranks >= 1, "must be >= 1");
  require_arg(op, "skip_passes", opt.skip_passes, opt.skip_passes >= 0, "must be >= 0");
  require_arg(op, "max_tokens_per_step", opt.max_tokens_per_step, opt.max_tokens_per_step >= 0, "must be >= 0 (0 = no limit)");
  require_arg(op, "num_experts", opt.num_experts, opt.num_experts >= 0, "must be >= 0 (0 = from the data)");

  struct Pass { std::vector<int32_t> idx; std::vector<float> w; };
  std::vector<Pass> passes;
  int top_k = 0, meta_experts = 0, max_id = -1;
  int64_t prev_token = -1, records = 0, skipped_records = 0;
  std::string line, model;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = origin + ":" + std::to_string(lineno);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      throw InvalidArgument(arg_message(op, where, "unparsable line", std::string("must be one JSON object per line (") + e.what() + ")"));
    }
    require_arg(op, where, j.type_name(), j.is_object(), "must be a JSON object");
    if (j.contains("type"))
      require_arg(op, where + " type", j["type"].dump(), j["type"].is_string(), "must be a string (\"route\", or a meta record's)");
    if (j.value("type", std::string("route")) != "route") {
      if (j.contains("top_k") && j["top_k"].is_number_integer()) top_k = get_int_field(op, j, "top_k");
      if (j.contains("num_experts") && j["num_experts"].is_number_integer()) meta_experts = get_int_field(op, j, "num_experts");
      if (j.contains("model_id") && j["model_id"].is_string()) model = j["model_id"].get<std::string>();
      continue;
    }
    for (const char* key : {"token_idx", "topk_ids", "topk_weights"})
      require_arg(op, where + " " + key, "(missing)", j.contains(key), "must be present in a route record");
    require_arg(op, where + " token_idx", j["token_idx"].dump(), j["token_idx"].is_number_integer(), "must be an integer");
    const int64_t token = j["token_idx"].get<int64_t>();
    if (token == 0) {
      passes.emplace_back();
    } else {
      require_arg(op, where + " token_idx", token, !passes.empty() && token == prev_token + 1,
                  "must be 0 (a new pass) or the previous token_idx + 1 = " + std::to_string(prev_token + 1));
    }
    prev_token = token;
    const json& ids = j["topk_ids"];
    const json& ws = j["topk_weights"];
    if (top_k == 0) top_k = ids.is_array() ? static_cast<int>(ids.size()) : 0;
    require_arg(op, where + " topk_ids.size", ids.is_array() ? std::to_string(ids.size()) : ids.type_name(),
                ids.is_array() && static_cast<int>(ids.size()) == top_k && top_k > 0,
                top_k > 0 ? "must be an array of top_k = " + std::to_string(top_k) + " ids"
                          : std::string("must be a non-empty array of expert ids (top_k >= 1; no meta line gave top_k)"));
    require_arg(op, where + " topk_weights.size", ws.is_array() ? std::to_string(ws.size()) : ws.type_name(),
                ws.is_array() && static_cast<int>(ws.size()) == top_k, "must be an array of top_k = " + std::to_string(top_k) + " numbers");
    Pass& p = passes.back();
    for (int k = 0; k < top_k; ++k) {
      require_arg(op, where + " topk_ids[" + std::to_string(k) + "]", ids[k].dump(), ids[k].is_number_integer() && ids[k].get<int64_t>() >= -1 && ids[k].get<int64_t>() < INT32_MAX,
                  "must be -1 (no selection) or an expert id in [0, 2147483646] (an integer; num_experts = id + 1 is an int)");
      require_arg(op, where + " topk_weights[" + std::to_string(k) + "]", ws[k].dump(), ws[k].is_number(), "must be a number");
      p.idx.push_back(ids[k].get<int32_t>());
      p.w.push_back(ws[k].get<float>());
      max_id = std::max(max_id, p.idx.back());
    }
    ++records;
  }
  require_arg(op, origin, "no route records", records > 0, "must hold at least one {\"type\": \"route\", ...} line");
  require_arg(op, "skip_passes", opt.skip_passes, opt.skip_passes < static_cast<int64_t>(passes.size()),
              "must be < the number of passes found = " + std::to_string(passes.size()));

  Trace t;
  t.num_ranks = opt.num_ranks;
  t.top_k = top_k;
  t.num_experts = opt.num_experts > 0 ? opt.num_experts : (meta_experts > 0 ? meta_experts : max_id + 1);
  require_arg(op, "num_experts", t.num_experts, t.num_experts > max_id && t.num_experts >= 1,
              "must be > the largest expert id in the file = " + std::to_string(max_id));
  std::ostringstream src;
  src << (model.empty() ? std::string() : model + ", ") << "imported from " << std::filesystem::path(origin).filename().string()
      << " (skip_passes=" << opt.skip_passes << ", ranks=" << opt.num_ranks;
  if (opt.max_tokens_per_step > 0) src << ", max_tokens_per_step=" << opt.max_tokens_per_step;
  src << ")";
  t.source = src.str();
  for (size_t p = 0; p < passes.size(); ++p) {
    const int64_t n = static_cast<int64_t>(passes[p].idx.size()) / top_k;
    if (static_cast<int64_t>(p) < opt.skip_passes) {
      skipped_records += n;
      continue;
    }
    const int64_t per_step = opt.max_tokens_per_step > 0 ? opt.max_tokens_per_step : std::max<int64_t>(n, 1);
    for (int64_t first = 0; first < n; first += per_step) {
      const int64_t m = std::min(per_step, n - first);
      TraceStep step;
      for (int r = 0; r < opt.num_ranks; ++r) {
        auto [b, e] = deal_tokens(m, opt.num_ranks, r);
        const auto lo = static_cast<size_t>((first + b) * top_k), hi = static_cast<size_t>((first + e) * top_k);
        step.ranks.push_back(make_trace_rank(top_k, std::vector<int32_t>(passes[p].idx.begin() + lo, passes[p].idx.begin() + hi),
                                             std::vector<float>(passes[p].w.begin() + lo, passes[p].w.begin() + hi)));
      }
      t.steps.push_back(std::move(step));
    }
  }
  if (summary) *summary = {records, static_cast<int64_t>(passes.size()), skipped_records};
  t.validate(origin);
  return t;
}

Trace import_routing_jsonl_file(const std::string& path, const TraceImportOptions& opt, TraceImportSummary* summary) {
  std::ifstream f(path);
  require_arg("trace import", "input", path, f.good(), "must name a readable JSON Lines file");
  return import_routing_jsonl(f, opt, path, summary);
}

}  // namespace epx
