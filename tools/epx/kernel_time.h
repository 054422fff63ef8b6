// tools/epx/kernel_time.h: `epx bench --kernel-time`: the GPU duration of the kernels of each timed call,
// from the CUPTI Activity API (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, which also records the kernels of
// CUDA-graph replays), the way DeepEP's tests read it (bench_kineto: torch.profiler / Kineto = CUPTI activity
// records, the kernels' GPU durations averaged per call), next to our CUDA-event figures.
//
// How a kernel is tied to a call: the bench pushes an external correlation id (CUPTI_EXTERNAL_CORRELATION_KIND_
// CUSTOM0, id = call_id(iteration, op)) around the host calls of one dispatch or combine (a graph launch, or
// the eager launches of a backend); CUPTI emits an external-correlation record (correlationId -> id) for
// every runtime/driver API record made in that region, and each kernel record carries the correlationId
// of the API call that launched it (for a graph replay: the cudaGraphLaunch). A kernel launched by another
// thread has no external id (epx's NCCL communicators are non-blocking, so an eager NCCL call's kernel is
// launched by NCCL's own thread while the caller waits): it belongs to the call whose host time window
// (CUPTI timestamps at the region's start and end) holds the start of its launching API call. Kernels
// launched outside the regions (the ranks' alignment all-reduce, the delay kernel, the identity expert
// step) belong to no call.
//
// The aggregation below is plain C++ (tests/kernel_time_test.cpp tests it without a GPU); KernelTimer
// (kernel_time.cpp) is the CUPTI part, compiled with EPX_WITH_CUPTI (CMake EPX_CUPTI=AUTO|ON|OFF).
#pragma once

#include <cxxabi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace epx::cli::kt {

/// One CUPTI kernel record, reduced to what the aggregation uses (ns on CUPTI's clock).
struct KernelRecord {
  uint32_t correlation_id = 0;
  uint64_t start_ns = 0, end_ns = 0;
  std::string name;  ///< as CUPTI gives it (mangled)
};
/// One CUPTI external-correlation record: API call correlation_id was made inside the region of external_id.
struct CorrelationRecord {
  uint32_t correlation_id = 0;
  uint64_t external_id = 0;
};

/// One CUPTI runtime/driver API record: when the call with this correlation id started (any thread).
struct ApiRecord {
  uint32_t correlation_id = 0;
  uint64_t start_ns = 0;
};
/// The host time window of one call's region (CUPTI clock).
struct CallWindow {
  uint64_t call_id = 0;
  uint64_t begin_ns = 0, end_ns = 0;
};

/// The two ops of a timed iteration.
enum class Op : int { dispatch = 0, combine = 1 };
/// External correlation id of (iteration, op): 1-based, so 0 (CUPTI's "none") never names a call.
inline uint64_t call_id(int64_t iteration, Op op) { return static_cast<uint64_t>(iteration) * 2 + static_cast<uint64_t>(op) + 1; }

/// The kernels of one call on one rank.
struct CallTime {
  int kernels = 0;
  double sum_us = NAN;   ///< sum over the call's kernels of (end - start): GPU busy time; NaN when none was seen
  double span_us = NAN;  ///< last end - first start over the call's kernels (includes the gaps between them)
};

/// Per op: one CallTime per iteration, and how many kernels of each (short) name were seen over all calls.
struct OpTimes {
  std::vector<CallTime> calls;
  std::map<std::string, int64_t> names;
};

/// "epx::dispatch::ll_dispatch_kernel<8>(Args)" -> "epx::dispatch::ll_dispatch_kernel": demangled (when it is
/// an Itanium name, "_Z..."), template arguments and parameter list dropped; a C name stays as it is.
inline std::string short_kernel_name(const std::string& mangled) {
  std::string name = mangled;
  if (mangled.rfind("_Z", 0) == 0) {  // only Itanium names: __cxa_demangle would read "d" as the type double
    int status = -1;
    std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status), std::free);
    if (status == 0 && d) name = d.get();
  }
  for (size_t at = name.find("(anonymous namespace)"); at != std::string::npos; at = name.find("(anonymous namespace)"))
    name.replace(at, 21, "{anon}");
  // Cut at the first '<' or '(': the function's qualified name.
  const size_t cut = name.find_first_of("<(");
  if (cut != std::string::npos && cut > 0) name = name.substr(0, cut);
  // A return type before the name ("void foo"): keep the last word.
  const size_t sp = name.rfind(' ');
  if (sp != std::string::npos) name = name.substr(sp + 1);
  return name;
}

/// The call id of a kernel: its external correlation id, else the call whose window holds the start of its
/// launching API call, else 0 (none). `windows` sorted by begin_ns and disjoint.
class CallFinder {
 public:
  CallFinder(const std::vector<CorrelationRecord>& correlations, const std::vector<ApiRecord>& apis, const std::vector<CallWindow>& windows)
      : windows_(windows) {
    for (const CorrelationRecord& c : correlations) ext_[c.correlation_id] = c.external_id;
    for (const ApiRecord& a : apis) api_start_[a.correlation_id] = a.start_ns;
  }
  /// {call id or 0, true when found through a window (another thread's launch)}.
  std::pair<uint64_t, bool> find(uint32_t correlation_id) const {
    const auto it = ext_.find(correlation_id);
    if (it != ext_.end() && it->second != 0) return {it->second, false};
    const auto a = api_start_.find(correlation_id);
    if (a == api_start_.end()) return {0, false};
    const auto w = std::upper_bound(windows_.begin(), windows_.end(), a->second,
                                    [](uint64_t t, const CallWindow& cw) { return t < cw.begin_ns; });
    if (w == windows_.begin()) return {0, false};
    const CallWindow& cw = *(w - 1);
    return a->second <= cw.end_ns ? std::pair<uint64_t, bool>{cw.call_id, true} : std::pair<uint64_t, bool>{0, false};
  }

 private:
  std::unordered_map<uint32_t, uint64_t> ext_, api_start_;
  const std::vector<CallWindow>& windows_;
};

/// Sorts the records of `iterations` iterations into calls (CallFinder). Kernels that map to no call id in
/// [call_id(0, dispatch), call_id(iterations - 1, combine)] are ignored (they ran outside the regions).
inline std::vector<OpTimes> aggregate(const std::vector<KernelRecord>& kernels, const std::vector<CorrelationRecord>& correlations,
                                      int64_t iterations, const std::vector<ApiRecord>& apis = {},
                                      const std::vector<CallWindow>& windows = {}) {
  std::vector<OpTimes> ops(2);
  for (auto& o : ops) o.calls.assign(static_cast<size_t>(std::max<int64_t>(iterations, 0)), CallTime{});
  if (iterations <= 0) return ops;
  const CallFinder finder(correlations, apis, windows);
  const uint64_t max_id = call_id(iterations - 1, Op::combine);
  struct Acc {
    uint64_t first = std::numeric_limits<uint64_t>::max(), last = 0;
    double busy_ns = 0;
    int n = 0;
  };
  std::vector<Acc> acc(static_cast<size_t>(max_id + 1));
  for (const KernelRecord& k : kernels) {
    const uint64_t id = finder.find(k.correlation_id).first;
    if (id == 0 || id > max_id) continue;
    if (k.end_ns < k.start_ns) continue;  // an incomplete record (CUPTI leaves end = 0 when it has no timestamp)
    Acc& a = acc[id];
    a.first = std::min(a.first, k.start_ns);
    a.last = std::max(a.last, k.end_ns);
    a.busy_ns += static_cast<double>(k.end_ns - k.start_ns);
    ++a.n;
    ops[static_cast<size_t>((id - 1) % 2)].names[short_kernel_name(k.name)] += 1;
  }
  for (uint64_t id = 1; id <= max_id; ++id) {
    const Acc& a = acc[id];
    if (a.n == 0) continue;
    CallTime& c = ops[static_cast<size_t>((id - 1) % 2)].calls[static_cast<size_t>((id - 1) / 2)];
    c.kernels = a.n;
    c.sum_us = a.busy_ns * 1e-3;
    c.span_us = static_cast<double>(a.last - a.first) * 1e-3;
  }
  return ops;
}

/// The p-th percentile (0..100) of the finite values, linear interpolation between order statistics
/// (the same rule as epx::cli::percentile); NaN when there is none.
inline double percentile_finite(const std::vector<double>& values, double p) {
  std::vector<double> v;
  for (double x : values)
    if (std::isfinite(x)) v.push_back(x);
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const double pos = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos)), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

/// Mean of the finite values; NaN when there is none.
inline double mean_finite(const std::vector<double>& values) {
  double s = 0;
  int64_t n = 0;
  for (double x : values)
    if (std::isfinite(x)) s += x, ++n;
  return n ? s / static_cast<double>(n) : NAN;
}

/// Per iteration the slowest rank (the maximum; NaN when any rank saw no kernel for that call, since the
/// iteration's figure is then unknown): per_rank[r][i] -> out[i]. Ranks with fewer values count as NaN.
inline std::vector<double> slowest_rank(const std::vector<std::vector<double>>& per_rank) {
  size_t n = 0;
  for (const auto& v : per_rank) n = std::max(n, v.size());
  std::vector<double> out(n, -std::numeric_limits<double>::infinity());
  for (const auto& v : per_rank)
    for (size_t i = 0; i < n; ++i) {
      const double x = i < v.size() ? v[i] : NAN;
      out[i] = std::isnan(out[i]) || std::isnan(x) ? NAN : std::max(out[i], x);
    }
  return out;
}

/// `--kernel-time on` asks for kernel time or a failed run (auto reports "unavailable" and goes on): a job
/// whose kernel rounds ended "unavailable: <why>" at run time (CUPTI refused or failed on some rank) then
/// fails with this sentence; "" when the job passes on this account (auto / off, or the rounds ran).
inline std::string kernel_time_failure(const std::string& flag, bool ran, const std::string& reason) {
  if (flag != "on" || ran || reason.rfind("unavailable", 0) != 0) return "";
  return "--kernel-time = on: no kernel time was measured (" + reason + "); use auto to run without it";
}

/// The CUPTI side (kernel_time.cpp). One per process; every call is a no-op when unavailable.
class KernelTimer {
 public:
  /// The process's timer. available() is false without CUPTI in the build or when CUPTI refuses.
  static KernelTimer& instance();
  bool available() const { return available_; }
  /// Why not available ("built without CUPTI (EPX_CUPTI=OFF or not found)", "cuptiActivityEnable: ...").
  const std::string& reason() const { return reason_; }
  /// Starts collecting (enables the activity kinds) and forgets earlier records. On a CUPTI error it
  /// becomes unavailable (reason() says which call) and returns false.
  bool begin_rounds();
  /// The host calls of (iteration, op) follow, until end_call().
  void begin_call(int64_t iteration, Op op);
  void end_call();
  /// After the device finished the rounds (the caller synchronizes): flushes, disables collection and
  /// sorts the records of `iterations` iterations into calls. dropped(): records CUPTI dropped.
  std::vector<OpTimes> end_rounds(int64_t iterations);
  uint64_t dropped() const { return dropped_; }
  /// What the last end_rounds saw: kernel and correlation records, kernels tied to a call, names of the others.
  const std::string& stats() const { return stats_; }

 private:
  KernelTimer();
  bool available_ = false;
  bool collecting_ = false;
  std::string reason_;
  uint64_t dropped_ = 0;
  std::string stats_;
  std::vector<CallWindow> windows_;  ///< this round's call regions, in order
};

/// "N kernel records (M in calls, W of them by window), C external correlations; outside the calls: name xk; ..."
/// (diagnostics).
inline std::string record_stats(const std::vector<KernelRecord>& kernels, const std::vector<CorrelationRecord>& correlations,
                                const std::vector<ApiRecord>& apis = {}, const std::vector<CallWindow>& windows = {}) {
  const CallFinder finder(correlations, apis, windows);
  std::map<std::string, int64_t> outside;
  int64_t in = 0, by_window = 0;
  for (const KernelRecord& k : kernels) {
    const auto [id, window] = finder.find(k.correlation_id);
    if (id != 0) ++in, by_window += window ? 1 : 0;
    else ++outside[short_kernel_name(k.name)];
  }
  std::string s = std::to_string(kernels.size()) + " kernel records (" + std::to_string(in) + " in calls, " + std::to_string(by_window) +
                  " of them by window), " + std::to_string(correlations.size()) + " external correlations; outside the calls:";
  for (const auto& [name, n] : outside) s += " " + name + " x" + std::to_string(n) + ";";
  return s;
}

}  // namespace epx::cli::kt
