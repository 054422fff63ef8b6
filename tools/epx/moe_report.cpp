// tools/epx/moe_report.cpp: the `epx moe` table and its RESULTS.md JSON file.
#include "moe_report.h"

#include <array>
#include <cmath>
#include <cstdio>
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
std::string shared_mode_name(SharedExpertMode m) {
  return m == SharedExpertMode::separate ? "separate" : m == SharedExpertMode::fused ? "fused" : "auto";
}

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

std::string cpu_device_name() {
  const unsigned n = std::thread::hardware_concurrency();
  return "cpu (" + std::to_string(n ? n : 1) + " threads)";
}

void print_header(std::ostream& os, const Workload& w) {
  const MoEConfig& m = w.model;
  os << "epx moe: " << m.name << " (H=" << m.hidden << " I=" << m.intermediate << " E=" << m.router.num_experts
     << " K=" << m.router.top_k << ", " << m.num_shared_experts << " shared, " << weight_format_name(m.routed_format)
     << " weights), " << w.num_ranks << " ranks, " << w.steps.size() << " steps (+" << w.warmup << " warm-up), routing "
     << w.routing << ", dispatch " << dtype_name(w.dispatch_dtype) << ", shared " << shared_mode_name(w.shared_mode)
     << ", chunk " << (w.chunk_size > 0 ? std::to_string(w.chunk_size) : std::string("none")) << ", capacity "
     << w.capacity << ", device " << (w.device_name.empty() ? cpu_device_name() : w.device_name) << "\n";
  if (!w.trace_source.empty()) os << "trace: " << w.trace_source << "\n";
}

void print_table(std::ostream& os, const Workload& w, const std::vector<BackendResult>& results) {
  int64_t total = 0;
  for (const auto& st : w.steps) total += st.num_tokens();
  os << std::left << std::setw(25) << "backend" << std::right << std::setw(12) << "tokens/rank" << std::setw(10) << "p50 ms"
     << std::setw(10) << "p90 ms" << std::setw(10) << "p99 ms" << std::setw(13) << "max rel err" << std::setw(11) << "rel L2"
     << "  " << std::left << std::setw(12) << "result" << "shared fused/separate\n";
  for (const BackendResult& r : results) {
    const bool ran = !r.step_us.empty();
    os << std::left << std::setw(25) << r.backend << std::right << std::setw(12) << w.max_tokens_per_rank << std::setw(10)
       << (ran ? fixed(percentile(r.step_us, 50) / 1e3, 3) : "-") << std::setw(10)
       << (ran ? fixed(percentile(r.step_us, 90) / 1e3, 3) : "-") << std::setw(10)
       << (ran ? fixed(percentile(r.step_us, 99) / 1e3, 3) : "-") << std::setw(13) << (r.validated ? sci(r.max_rel_error) : "-")
       << std::setw(11) << (r.validated ? sci(r.rel_l2_error) : "-") << "  " << std::left << std::setw(12) << r.status
       << (ran ? std::to_string(r.counters.shared_fused) + "/" + std::to_string(r.counters.shared_separate) : "-") << "\n";
  }
  for (const BackendResult& r : results)
    if (!r.message.empty()) os << r.backend << ": " << r.message << "\n";
  int passed = 0;
  for (const BackendResult& r : results) passed += r.status == "pass";
  os << passed << "/" << results.size() << " backends pass (rel L2 <= " << kRelL2Tolerance << " against the single-rank "
     << "no-EP reference on "
     << (!results.empty() && results[0].validated_tokens >= 0 ? std::to_string(results[0].validated_tokens) + " of " : std::string("all "))
     << total << " tokens of " << w.steps.size() << " steps; tokens/rank is the max per step)\n";
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
        {"dtype", std::string(dtype_name(w.dispatch_dtype))},
        {"weight_format", std::string(weight_format_name(m.routed_format))},
        {"routing", w.routing},
        {"shared_mode", shared_mode_name(w.shared_mode)},
        {"chunk_size", w.chunk_size},
        {"num_max_dispatch_tokens_per_rank", w.capacity},
        {"latency_us_p50", lat(50)},
        {"latency_us_p10", lat(10)},
        {"latency_us_p90", lat(90)},
        {"latency_us_p99", lat(99)},
        {"latency_us_mean", ran ? json(mean(r.step_us)) : json(nullptr)},
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
                      {"shared_fused", r.counters.shared_fused}, {"shared_separate", r.counters.shared_separate}}},
    };
    if (!r.message.empty()) j["message"] = r.message;
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
  if (!w.trace_source.empty()) doc["trace_source"] = w.trace_source;
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
