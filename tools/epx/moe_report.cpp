// tools/epx/moe_report.cpp: the `epx moe` table and its RESULTS.md JSON file.
#include "moe_report.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "epx/error.h"

namespace epx::cli {

namespace {
std::string fixed(double v, int digits) {
  if (std::isinf(v) || std::isnan(v)) return "inf";
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

std::string sci(double v) {
  if (std::isinf(v) || std::isnan(v)) return "inf";
  std::ostringstream os;
  os << std::scientific << std::setprecision(2) << v;
  return os.str();
}

// First line of `cmd`'s stdout, or "" when it fails.
std::string run_line(const std::string& cmd) {
  std::array<char, 256> buf{};
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    if (std::fgets(buf.data(), static_cast<int>(buf.size()), p)) out = buf.data();
    const int rc = ::pclose(p);
    if (rc != 0) out.clear();
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == std::string::npos)
    return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

nlohmann::ordered_json number_or_null(double v) {
  return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
}
}  // namespace

std::string git_commit() {
  // The repository the binary was built in (build dirs live inside it), else the working directory.
  std::error_code ec;
  const auto exe_dir = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path();
  for (const std::string& dir : {ec ? std::string() : exe_dir.string(), std::string(".")}) {
    if (dir.empty()) continue;
    const std::string c = run_line("git -C " + shell_quote(dir) + " rev-parse --short=12 HEAD 2>/dev/null");
    if (!c.empty()) {
      const std::string dirty = run_line("git -C " + shell_quote(dir) + " status --porcelain --untracked-files=no 2>/dev/null | head -c 1");
      return dirty.empty() ? c : c + "-dirty";
    }
  }
  return "unknown";
}

std::string command_line(int argc, char** argv) {
  std::string s = "epx";
  for (int i = 1; i < argc; ++i) s += " " + shell_quote(argv[i]);
  return s;
}

std::string virtual_ranks_note(int ranks) {
  return "virtual ranks: " + std::to_string(ranks) + " on one GPU (timings measure one GPU's memory, not NVLink)";
}

std::string cpu_device_name() {
  const unsigned n = std::thread::hardware_concurrency();
  return "cpu (" + std::to_string(n ? n : 1) + " threads)";
}

nlohmann::ordered_json node_layout_json(const NodeLayout& l) {
  nlohmann::ordered_json env = nlohmann::ordered_json::object();
  for (const char* v : {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_HOSTID"}) {
    const char* x = std::getenv(v);
    env[v] = x ? nlohmann::ordered_json(x) : nlohmann::ordered_json(nullptr);
  }
  return {{"num_nodes", l.num_nodes},
          {"ranks_per_node", l.ranks_per_node()},
          {"node_of_rank", l.node_of_rank},
          {"describe", l.describe()},
          {"nccl_lsa_size", l.lsa_size},
          {"path", l.num_nodes > 1 ? "multi-node: per-node NCCL communicators (device API), host collectives on the global one; "
                                     "ll and ht hierarchical (src/dispatch/hier/hier.h)"
                                   : "single-node: one NVLink domain (NCCL: device communicator on the global communicator)"},
          {"env", env}};
}

void print_header(std::ostream& os, const Workload& w) {
  const MoEConfig& m = w.model;
  os << "epx moe: " << m.name << " (H=" << m.hidden << " I=" << m.intermediate << " E=" << m.router.num_experts
     << " K=" << m.router.top_k << ", " << m.num_shared_experts << " shared, " << weight_format_name(m.routed_format)
     << " weights), " << w.num_ranks << " ranks, " << w.steps.size() << " steps (+" << w.warmup << " warm-up), routing "
     << w.routing << ", dispatch " << dtype_name(w.dispatch_dtype) << ", shared " << shared_mode_name(w.shared_mode)
     << ", chunk " << (w.chunk_size > 0 ? std::to_string(w.chunk_size) : std::string("none")) << ", capacity "
     << w.capacity << ", device " << (w.device_name.empty() ? cpu_device_name() : w.device_name)
     << (w.mode.empty() ? std::string() : ", mode " + w.mode + (w.use_graph ? " (graph replay where graph-safe)" : ""))
     << (w.compare ? ", A/B" : "") << (w.expert_contiguous ? ", ht expert-contiguous" : "") << "\n";
  if (!w.trace_source.empty()) os << "trace: " << w.trace_source << "\n";
  if (w.weights && w.weights->expert_pool > 0)
    os << "expert pool: " << w.weights->expert_pool << " (random expert e holds the values of expert e mod "
       << w.weights->expert_pool << "; one copy per expert on the device)\n";
  if (w.ranks_per_gpu > 1) os << virtual_ranks_note(w.ranks_per_gpu) << "\n";
  if (w.has_nodes)
    os << "node layout: " << w.nodes.describe()
       << (w.ranks_per_gpu > 1 ? std::string(" (virtual ranks: threads on one GPU)") : " (NCCL LSA team " + std::to_string(w.nodes.lsa_size) + ")")
       << "\n";
}

namespace {
std::string counters_text(const BackendResult& r) {
  const PathCounters& c = r.counters;
  return std::to_string(c.shared_fused) + "/" + std::to_string(c.shared_separate) + "/" + std::to_string(c.shared_sharded) + "/" +
         std::to_string(c.graph_replays);
}

std::string row_name(const BackendResult& r, const Workload& w) {
  return r.backend + (w.compare && w.model.num_shared_experts > 0 ? " [" + shared_mode_name(r.shared_mode) + "]" : "");
}

double pct(double a, double b) { return b > 0 ? (a - b) / b * 100.0 : 0.0; }

std::string signed_pct(double v) {
  std::ostringstream os;
  os << std::showpos << std::fixed << std::setprecision(1) << v << "%";
  return os.str();
}

/// p50 over steps of each phase (ModularMoE::last_phase_times, the slowest rank per step).
std::array<double, 4> phase_p50(const std::vector<PhaseTimes>& phases) {
  std::array<std::vector<double>, 4> v;
  for (const PhaseTimes& p : phases) {
    v[0].push_back(p.prepare_us);
    v[1].push_back(p.experts_us);
    v[2].push_back(p.finalize_us);
    v[3].push_back(p.shared_us);
  }
  return {percentile(v[0], 50), percentile(v[1], 50), percentile(v[2], 50), percentile(v[3], 50)};
}

nlohmann::ordered_json phase_p50_json(const std::vector<PhaseTimes>& phases) {
  const auto p = phase_p50(phases);
  return {{"prepare", p[0]}, {"experts", p[1]}, {"finalize", p[2]}, {"shared_separate", p[3]},
          {"what", "eager steps, summed over chunks: CUDA runs device time (CUDA events), slowest rank per step; CPU runs rank 0 host time"}};
}

/// The A/B pairs of --compare: rows of the same backend, fused and separate.
struct SharedPair {
  const BackendResult* fused = nullptr;
  const BackendResult* separate = nullptr;
};
std::vector<SharedPair> shared_pairs(const std::vector<BackendResult>& results) {
  std::vector<SharedPair> pairs;
  for (const BackendResult& f : results) {
    if (f.shared_mode != SharedExpertMode::fused) continue;
    for (const BackendResult& s : results)
      if (s.backend == f.backend && s.shared_mode == SharedExpertMode::separate) pairs.push_back({&f, &s});
  }
  return pairs;
}

/// The baseline of the backend comparison: the first row that ran, per shared mode.
const BackendResult* baseline_for(const std::vector<BackendResult>& results, SharedExpertMode mode) {
  for (const BackendResult& r : results)
    if (r.shared_mode == mode && !r.step_us.empty()) return &r;
  return nullptr;
}
}  // namespace

void print_table(std::ostream& os, const Workload& w, const std::vector<BackendResult>& results) {
  int64_t total = 0;
  for (const auto& st : w.steps) total += st.num_tokens();
  os << std::left << std::setw(36) << "backend" << std::right << std::setw(8) << "T/rank" << std::setw(7) << "graph" << std::setw(9)
     << "p25 ms" << std::setw(9) << "p50 ms" << std::setw(9) << "p75 ms" << std::setw(9) << "p99 ms" << std::setw(9) << "mean ms"
     << std::setw(12) << "tokens/s" << std::setw(11) << "rel L2" << "  " << std::left << std::setw(12) << "result"
     << "fused/separate/sharded/graph\n";
  for (const BackendResult& r : results) {
    const bool ran = !r.step_us.empty();
    auto ms = [&](double p) { return ran ? fixed(percentile(r.step_us, p) / 1e3, 3) : std::string("-"); };
    os << std::left << std::setw(36) << row_name(r, w) << std::right << std::setw(8) << w.max_tokens_per_rank << std::setw(7)
       << (r.graph ? "yes" : "no") << std::setw(9) << ms(25) << std::setw(9) << ms(50) << std::setw(9) << ms(75) << std::setw(9)
       << ms(99) << std::setw(9) << (ran ? fixed(mean(r.step_us) / 1e3, 3) : "-") << std::setw(12)
       << (ran ? fixed(tokens_per_second(w, r), 0) : "-") << std::setw(11) << (r.validated ? sci(r.rel_l2_error) : "-") << "  "
       << std::left << std::setw(12) << r.status << (ran ? counters_text(r) : "-") << "\n";
  }
  for (const BackendResult& r : results)
    if (!r.message.empty()) os << row_name(r, w) << ": " << r.message << "\n";
  // Graph refusals: one line when every run gives the same reason (e.g. CPU ranks), else per run.
  std::vector<const BackendResult*> refused;
  for (const BackendResult& r : results)
    if (!r.graph_reason.empty() && !r.graph) refused.push_back(&r);
  bool same = !refused.empty();
  for (const BackendResult* r : refused) same = same && r->graph_reason == refused.front()->graph_reason;
  if (same && refused.size() == results.size()) {
    os << "all runs eager, no graph: " << refused.front()->graph_reason << "\n";
  } else {
    for (const BackendResult* r : refused) os << row_name(*r, w) << ": eager, no graph: " << r->graph_reason << "\n";
  }
  int passed = 0;
  for (const BackendResult& r : results) passed += r.status == "pass";
  os << passed << "/" << results.size() << " runs pass (rel L2 <= " << kRelL2Tolerance << " against the single-rank "
     << "no-EP reference on "
     << (!results.empty() && results[0].validated_tokens >= 0 ? std::to_string(results[0].validated_tokens) + " of " : std::string("all "))
     << total << " tokens of " << w.steps.size() << " steps; T/rank is the max per step; latency per step is the slowest rank's;"
     << " counters: chunks whose shared expert ran fused / separate / DP-sharded, graph replays)\n";
  bool any_phases = false;
  for (const BackendResult& r : results) any_phases = any_phases || !r.phases.empty();
  if (any_phases) {
    os << "phases, p50 ms (eager steps; CUDA: slowest rank per step, CPU: rank 0): prepare = quantize + dispatch, experts, finalize = combine, "
          "separate shared expert\n";
    for (const BackendResult& r : results) {
      if (r.phases.empty()) continue;
      const auto p = phase_p50(r.phases);
      os << "  " << std::left << std::setw(34) << row_name(r, w) << std::right << " prepare " << fixed(p[0] / 1e3, 3) << "  experts "
         << fixed(p[1] / 1e3, 3) << "  finalize " << fixed(p[2] / 1e3, 3) << "  shared " << fixed(p[3] / 1e3, 3) << "\n";
    }
  }
  if (w.compare) print_compare(os, w, results);
}

void print_compare(std::ostream& os, const Workload& w, const std::vector<BackendResult>& results) {
  os << "\nA/B: backends (p50 against the first backend of the same shared mode)\n";
  os << std::left << std::setw(36) << "backend" << std::right << std::setw(10) << "p50 ms" << std::setw(12) << "delta" << std::setw(12)
     << "tokens/s\n";
  for (const BackendResult& r : results) {
    if (r.step_us.empty()) continue;
    const BackendResult* base = baseline_for(results, r.shared_mode);
    const double p50 = percentile(r.step_us, 50);
    os << std::left << std::setw(36) << row_name(r, w) << std::right << std::setw(10) << fixed(p50 / 1e3, 3) << std::setw(12)
       << (base == &r ? std::string("baseline") : signed_pct(pct(p50, percentile(base->step_us, 50)))) << std::setw(12)
       << fixed(tokens_per_second(w, r), 0) << "\n";
  }
  const auto pairs = shared_pairs(results);
  if (pairs.empty()) return;
  os << "A/B: shared expert fused against separate (delta = fused / separate - 1; counters prove the path that ran)\n";
  os << std::left << std::setw(26) << "backend" << std::right << std::setw(11) << "fused p50" << std::setw(11) << "sep. p50"
     << std::setw(10) << "delta" << "   fused run f/s/sh/g   separate run f/s/sh/g\n";
  for (const SharedPair& p : pairs) {
    const bool ran = !p.fused->step_us.empty() && !p.separate->step_us.empty();
    const double f = ran ? percentile(p.fused->step_us, 50) : 0, s = ran ? percentile(p.separate->step_us, 50) : 0;
    os << std::left << std::setw(26) << p.fused->backend << std::right << std::setw(11) << (ran ? fixed(f / 1e3, 3) : "-")
       << std::setw(11) << (ran ? fixed(s / 1e3, 3) : "-") << std::setw(10) << (ran ? signed_pct(pct(f, s)) : "-") << "   "
       << std::left << std::setw(21) << counters_text(*p.fused) << counters_text(*p.separate) << "\n";
  }
}

void write_results_json(const std::string& path, const std::string& command, const Workload& w,
                        const std::vector<BackendResult>& results) {
  using json = nlohmann::ordered_json;  // keys in RESULTS.md order
  const MoEConfig& m = w.model;
  int64_t total = 0;
  for (const auto& st : w.steps) total += st.num_tokens();
  json rs = json::array();
  for (const BackendResult& r : results) {
    const bool ran = !r.step_us.empty();
    auto lat = [&](double p) { return ran ? json(percentile(r.step_us, p)) : json(nullptr); };
    json j = {
        {"case", m.name},
        {"backend", r.backend},
        {"op", "layer"},
        {"tokens_per_rank", w.max_tokens_per_rank},
        {"tokens_total", total},
        {"hidden", m.hidden},
        {"intermediate", m.intermediate},
        {"top_k", m.router.top_k},
        {"num_experts", m.router.num_experts},
        {"num_shared_experts", m.num_shared_experts},
        {"ranks", w.num_ranks},
        {"ranks_per_gpu", w.ranks_per_gpu > 0 ? json(w.ranks_per_gpu) : json(nullptr)},
        {"dtype", std::string(dtype_name(w.dispatch_dtype))},
        {"weight_format", std::string(weight_format_name(m.routed_format))},
        {"routing", w.routing},
        {"shared_mode", shared_mode_name(r.shared_mode)},
        {"shared_sharded", r.shared_sharded},
        {"shared_local_slot_tokens", r.shared_local_slot_tokens},
        {"fhmoe_max_tokens", r.fhmoe_max_tokens >= 0 ? json(r.fhmoe_max_tokens) : json(nullptr)},
        {"mode", w.mode.empty() ? json(nullptr) : json(w.mode)},
        {"graph", r.graph},
        {"chunk_size", w.chunk_size},
        {"expert_contiguous", w.expert_contiguous && r.backend == "ht"},
        {"num_max_dispatch_tokens_per_rank", w.capacity},
        {"latency_us_p50", lat(50)},
        {"latency_us_p10", lat(10)},
        {"latency_us_p25", lat(25)},
        {"latency_us_p75", lat(75)},
        {"latency_us_p90", lat(90)},
        {"latency_us_p99", lat(99)},
        {"latency_us_mean", ran ? json(mean(r.step_us)) : json(nullptr)},
        {"tokens_per_s", ran ? json(tokens_per_second(w, r)) : json(nullptr)},
        {"step_latency_us", r.step_us},
        {"gbps", nullptr},
        {"accounting", nullptr},
        {"tflops", nullptr},
        {"iterations", r.step_us.size()},
        {"steps", w.steps.size()},
        {"warmup", w.warmup},
        {"validated", r.validated},
        {"max_rel_error", r.validated ? number_or_null(r.max_rel_error) : json(nullptr)},
        {"rel_l2_error", r.validated ? number_or_null(r.rel_l2_error) : json(nullptr)},
        {"tolerance_rel_l2", kRelL2Tolerance},
        {"status", r.status},
        {"validated_tokens", !r.validated ? json(0) : r.validated_tokens >= 0 ? json(r.validated_tokens) : json(total)},
        {"counters", {{"calls", r.counters.calls}, {"chunks", r.counters.chunks}, {"idle_chunks", r.counters.idle_chunks},
                      {"shared_fused", r.counters.shared_fused}, {"shared_separate", r.counters.shared_separate},
                      {"shared_sharded", r.counters.shared_sharded}, {"graph_replays", r.counters.graph_replays}}},
    };
    if (!r.message.empty()) j["message"] = r.message;
    if (!r.graph_reason.empty()) j["graph_reason"] = r.graph_reason;
    if (!r.phases.empty()) {
      j["phase_us_p50"] = phase_p50_json(r.phases);
      // Per step (the same order as step_latency_us): a trace that sweeps T slices them per T.
      json per_step = json::array();
      for (const PhaseTimes& ph : r.phases) per_step.push_back({ph.prepare_us, ph.experts_us, ph.finalize_us, ph.shared_us});
      j["phase_us_per_step"] = {{"columns", {"prepare", "experts", "finalize", "shared_separate"}}, {"steps", std::move(per_step)}};
    }
    rs.push_back(std::move(j));
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
  json doc = {{"tool", "epx moe"},       {"command", command},          {"git_commit", git_commit()},
              {"date", date},            {"device", w.device_name.empty() ? cpu_device_name() : w.device_name},
              {"nccl_version", w.nccl_version.empty() ? json(nullptr) : json(w.nccl_version)},
              {"epx_version", EPX_VERSION}, {"results", std::move(rs)}};
  // Ranks sharing one GPU: 1 (one process per GPU), R (virtual ranks: timings of one GPU's memory, not NVLink), null (CPU).
  doc["ranks_per_gpu"] = w.ranks_per_gpu > 0 ? json(w.ranks_per_gpu) : json(nullptr);
  if (!w.trace_source.empty()) doc["trace_source"] = w.trace_source;
  if (w.weights && w.weights->expert_pool > 0) doc["expert_pool"] = w.weights->expert_pool;  // MoEWeights::expert_pool
  doc["node_layout"] = node_layout_json(w.has_nodes ? w.nodes : NodeLayout::from_keys(std::vector<int64_t>(static_cast<size_t>(std::max(1, w.num_ranks)), 0), 0));
  if (w.compare) {
    json backends = json::array(), shared = json::array();
    for (const BackendResult& r : results) {
      if (r.step_us.empty()) continue;
      const BackendResult* base = baseline_for(results, r.shared_mode);
      const double p50 = percentile(r.step_us, 50);
      backends.push_back({{"backend", r.backend}, {"shared_mode", shared_mode_name(r.shared_mode)}, {"latency_us_p50", p50},
                          {"baseline", base->backend}, {"delta_pct_vs_baseline", pct(p50, percentile(base->step_us, 50))},
                          {"tokens_per_s", tokens_per_second(w, r)}});
    }
    for (const SharedPair& p : shared_pairs(results)) {
      if (p.fused->step_us.empty() || p.separate->step_us.empty()) continue;
      const double f = percentile(p.fused->step_us, 50), s = percentile(p.separate->step_us, 50);
      auto counters = [](const PathCounters& c) {
        return json{{"shared_fused", c.shared_fused}, {"shared_separate", c.shared_separate}, {"shared_sharded", c.shared_sharded},
                    {"graph_replays", c.graph_replays}};
      };
      shared.push_back({{"backend", p.fused->backend}, {"fused_latency_us_p50", f}, {"separate_latency_us_p50", s},
                        {"delta_pct_fused_vs_separate", pct(f, s)}, {"fused_counters", counters(p.fused->counters)},
                        {"separate_counters", counters(p.separate->counters)}});
    }
    doc["compare"] = {{"backends", std::move(backends)}, {"shared_fused_vs_separate", std::move(shared)}};
  }
  doc["config"] = w.config.describe();  // effective values and where each came from (env/JSON are not in "command")
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::ofstream f(path, std::ios::trunc);
  require_arg("epx moe", "--json", path, f.good(), "must be a writable file path");
  f << doc.dump(2) << "\n";
  require_arg("epx moe", "--json", path, f.good(), "write failed");
}

}  // namespace epx::cli
