// tools/epx/bench_internal.h: what the parts of `epx bench` (bench_run.h) share: the jobs, the
// per-rank results, the timers and the padded-form plans. bench_run.cpp makes the jobs and the
// inputs, gathers the ranks' results and runs the bench; bench_rank.cpp is the per-rank run loop;
// bench_report.cpp validates and writes the table and the JSON.
#pragma once

#include "bench_run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "comm/launcher.h"
#include "dispatch/flat_cuda.h"
#include "dispatch/row_codec.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/quant.h"
#include "experts/identity.h"
#include "kernel_time.h"
#include "moe_cuda_run.h"
#include "moe_report.h"
#include "moe_run.h"
#include "validators.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "dispatch/ll/ll_cuda.h"
#include "dispatch/ht/ht_cuda.h"
#endif

#include <functional>
#include <memory>

namespace epx::cli::bench_internal {

constexpr std::string_view kOp = "epx bench";
constexpr const char* kRaw = "nccl_a2a_raw";
constexpr uint64_t kWhatHidden = 101, kWhatRouting = 103, kWhatOrder = 102;  // stream_seed tags
/// --padded: "nccl_raw:<backend>" times the Group collectives the padded form of <backend> makes.
constexpr std::string_view kPaddedRawPrefix = "nccl_raw:";

inline bool is_padded_raw(const std::string& backend) { return backend.rfind(kPaddedRawPrefix, 0) == 0; }
/// A job that only moves bytes (no epx backend, nothing to validate).
inline bool is_raw(const std::string& backend) { return backend == kRaw || is_padded_raw(backend); }
/// The backends with a padded form (DispatchConfig::use_worst_case_sizing: C rows per rank's block, no host wait).
inline bool has_padded_form(const std::string& backend) {
  return backend == "naive" || backend == "allgather_reducescatter" || backend == "all2allv";
}

struct Job {
  size_t case_idx = 0;
  DType dtype = DType::bf16;
  std::string backend;
  FlatCombine flat_combine = FlatCombine::partial_fp32;  ///< --flat-combine (the Flat backends)
  bool padded = false;  ///< --padded: the backend's padded form, or (nccl_raw:<backend>) that form's collectives
};

/// A backend that rounds once may differ from the identity formula by 1 bf16 ulp (fp32 summation
/// order); at most this fraction of elements may differ by more (>= 99.9 % within 1 ulp).
constexpr double kOneRoundingFarFraction = 1e-3;

/// One rank's inputs for one case, on the host, with its byte-accounting counts.
struct RankInputs {
  Tensor x, idx, wts;
  int64_t valid_selections = 0;  ///< (t, k) with idx >= 0
  int64_t dedup_rows = 0;        ///< sum over tokens of the distinct destination ranks (incl. self)
};

/// One rank's inputs of case `case_idx` (bench_run.cpp).
RankInputs make_inputs(const BenchCase& c, size_t case_idx, int64_t T, int rank, int R, const BenchOptions& o);

/// --kernel-time: what the CUPTI rounds of one job measured on one rank (kernel_time.h). Index 0 dispatch, 1 combine.
struct KernelRun {
  bool ran = false;
  std::string reason;               ///< why not (off, unavailable: ...), when !ran
  std::vector<double> sum_us[2];    ///< per iteration: the call's kernels' summed GPU durations (NaN: none seen)
  std::vector<double> span_us[2];   ///< per iteration: last end - first start
  std::vector<double> events_us[2]; ///< per iteration: the CUDA events of the same rounds
  std::string names[2];             ///< "name x per-call; ..." of the kernels seen
  std::map<std::string, double> per_call[2];  ///< short kernel name -> kernels per call
  int64_t dropped = 0;
};

/// What one rank measured for one job.
struct RankJobResult {
  int64_t status = 0;  ///< 0 ran, 1 unsupported, 2 error
  std::string message;
  std::vector<double> dispatch_us, combine_us;
  std::vector<double> dispatch_us_1tok, combine_us_1tok;  ///< --graph, ll: the same graphs at T = 1 (device-side count)
  int64_t sms = -1;              ///< SMs the backend's kernels use (-1: unknown / host collectives)
  bool graph = false;            ///< timed as CUDA-graph replays
  bool hierarchical = false;     ///< ll / ht across nodes: the hierarchical path (Capabilities::hierarchical)
  Tensor out;                    ///< epx backends: [T, H] bf16 on the host, last iteration
  int64_t valid_selections = 0, dedup_rows = 0;
  int64_t moved_bytes_dispatch = 0, moved_bytes_combine = 0;  ///< raw rows: the send buffer's bytes (incl. self)
  int64_t remote_bytes_dispatch = -1, remote_bytes_combine = -1;  ///< epx backends: DispatchStats of the last call
  /// Eager rounds: host wall time of each timed prepare / finalize (or raw collective) call itself.
  std::vector<double> host_dispatch_us, host_combine_us;
  KernelRun kernel, kernel_1tok;  ///< --kernel-time: the case's T, and (--graph, ll) T = 1
};

/// --kernel-time on this rank: "on" when cuda and not off (CUPTI availability is agreed in kernel_rounds).
struct KernelTimeMode {
  bool on = false;
  std::string reason;  ///< when off: why
};

/// The host calls of op in kernel-time iteration i (i < 0: not a kernel-time round) are attributed to it.
class KtCall {
 public:
  KtCall(int64_t i, kt::Op op) : on_(i >= 0) {
    if (on_) kt::KernelTimer::instance().begin_call(i, op);
  }
  ~KtCall() {
    if (on_) kt::KernelTimer::instance().end_call();
  }
  KtCall(const KtCall&) = delete;
  KtCall& operator=(const KtCall&) = delete;

 private:
  bool on_;
};

/// --kernel-time: `iters` more timed iterations with CUPTI collecting, after the event rounds (so CUPTI's cost
/// stays out of latency_us_*). iteration(timed, d_us, c_us, kt_iter) wraps its dispatch and combine host calls in
/// KtCall(kt_iter, op). Collective: the ranks agree that every one of them collects, or none does.
template <class Iteration>
void kernel_rounds(const KernelTimeMode& mode, Group& group, int iters, Iteration&& iteration, Stream stream, KernelRun& kr) {
  if (!mode.on) {
    kr.reason = mode.reason;
    return;
  }
  kt::KernelTimer& t = kt::KernelTimer::instance();
  const bool mine = t.begin_rounds();
  bool all = true;
  for (int64_t v : group.all_gather_i64(mine ? 1 : 0)) all = all && v == 1;
  if (!all) {
    (void)t.end_rounds(0);
    kr.reason = "unavailable: " + (mine ? std::string("CUPTI refused on another rank (see its stderr)") : t.reason());
    if (!mine) std::cerr << "epx bench: rank " << group.rank() << ": kernel time unavailable: " << t.reason() << "\n";
    return;
  }
  for (int i = 0; i < iters; ++i) iteration(true, kr.events_us[0], kr.events_us[1], static_cast<int64_t>(i));
#ifdef EPX_WITH_CUDA
  if (cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    throw CudaError("epx bench --kernel-time: synchronize after the CUPTI rounds failed");
#endif
  const std::vector<kt::OpTimes> ops = t.end_rounds(iters);
  bool ok = t.available();
  for (int64_t v : group.all_gather_i64(ok ? 1 : 0)) ok = ok && v == 1;
  if (!ok) {
    kr.reason = "unavailable: " + (t.available() ? std::string("CUPTI failed on another rank") : t.reason());
    kr.events_us[0].clear();
    kr.events_us[1].clear();
    return;
  }
  for (int op = 0; op < 2; ++op) {
    for (const kt::CallTime& c : ops[op].calls) {
      kr.sum_us[op].push_back(c.sum_us);
      kr.span_us[op].push_back(c.span_us);
    }
    std::ostringstream os;
    for (const auto& [name, n] : ops[op].names) {
      const double per_call = static_cast<double>(n) / std::max(iters, 1);
      kr.per_call[op][name] = per_call;
      os << (os.tellp() > 0 ? "; " : "") << name << " x" << std::setprecision(3) << per_call;
    }
    kr.names[op] = os.str();
  }
  kr.dropped = static_cast<int64_t>(t.dropped());
  kr.ran = true;
  if (group.rank() == 0) std::cerr << "epx bench --kernel-time: rank 0: " << t.stats() << " dropped " << kr.dropped << "\n";
}

struct JobResult {
  Job job;
  std::vector<RankJobResult> ranks;
};

/// Per-iteration timestamps: CUDA events on the rank's stream, or the host clock on the CPU.
class IterTimer {
 public:
  IterTimer(bool cuda, Stream stream) : cuda_(cuda), stream_(stream) {
#ifdef EPX_WITH_CUDA
    if (cuda_)
      for (auto& e : ev_) ok(cudaEventCreate(&e), "cudaEventCreate");
#endif
  }
  ~IterTimer() {
#ifdef EPX_WITH_CUDA
    if (cuda_)
      for (auto& e : ev_) (void)cudaEventDestroy(e);
#endif
  }
  IterTimer(const IterTimer&) = delete;
  IterTimer& operator=(const IterTimer&) = delete;
  void mark(int i) {
#ifdef EPX_WITH_CUDA
    if (cuda_) {
      ok(cudaEventRecord(ev_[i], static_cast<cudaStream_t>(stream_.handle)), "cudaEventRecord");
      return;
    }
#endif
    t_[i] = std::chrono::steady_clock::now();
  }
  /// Waits for mark 3; returns {us(0 -> 1), us(2 -> 3)}.
  std::pair<double, double> finish() {
#ifdef EPX_WITH_CUDA
    if (cuda_) {
      ok(cudaEventSynchronize(ev_[3]), "cudaEventSynchronize");
      float a = 0, b = 0;
      ok(cudaEventElapsedTime(&a, ev_[0], ev_[1]), "cudaEventElapsedTime");
      ok(cudaEventElapsedTime(&b, ev_[2], ev_[3]), "cudaEventElapsedTime");
      return {a * 1e3, b * 1e3};
    }
#endif
    using us = std::chrono::duration<double, std::micro>;
    return {us(t_[1] - t_[0]).count(), us(t_[3] - t_[2]).count()};
  }
  void sync() {
#ifdef EPX_WITH_CUDA
    if (cuda_) ok(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_.handle)), "cudaStreamSynchronize");
#endif
  }

 private:
  bool cuda_;
  Stream stream_;
  std::chrono::steady_clock::time_point t_[4];
#ifdef EPX_WITH_CUDA
  cudaEvent_t ev_[4]{};
  static void ok(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw CudaError(std::string("epx bench: ") + what + ": " + cudaGetErrorString(e));
  }
#endif
};

/// --padded: the Group collectives the padded form of a backend makes (gather_cuda.cpp, all2allv_cuda.cpp; the
/// CPU form makes the same calls' data movement), with their sizes: what its nccl_raw:<backend> twin times.
struct PaddedRawPlan {
  enum class Call { all_gather, all_reduce, reduce_scatter, all_to_all };
  int ranks = 1;
  Call dispatch = Call::all_gather, combine = Call::all_gather;
  int64_t dispatch_bytes = 0;  ///< one block: per rank (all_gather) or per peer (all_to_all)
  /// all_gather: bytes per rank; all_reduce: the whole buffer; reduce_scatter / all_to_all: per rank / peer
  int64_t combine_bytes = 0;
  DType combine_dtype = DType::fp32;  ///< the partials' dtype (flat_combine)

  static const char* name(Call c) {
    return c == Call::all_gather ? "all_gather" : c == Call::all_reduce ? "all_reduce_sum" : c == Call::reduce_scatter ? "reduce_scatterv" : "all_to_allv";
  }
  /// Bytes this rank hands to the call (its send buffer, incl. the block it keeps).
  int64_t send_bytes(bool dispatch_op) const {
    const Call c = dispatch_op ? dispatch : combine;
    const int64_t b = dispatch_op ? dispatch_bytes : combine_bytes;
    return c == Call::all_gather || c == Call::all_reduce ? b : ranks * b;
  }
  /// "group.all_gather of 2 x 119424 B blocks (record + C rows)", "group.reduce_scatterv of 2 x 458752 B (fp32)".
  std::string describe(bool dispatch_op) const {
    const Call c = dispatch_op ? dispatch : combine;
    const int64_t b = dispatch_op ? dispatch_bytes : combine_bytes;
    std::ostringstream os;
    os << "group." << name(c) << " of ";
    if (c != Call::all_reduce) os << ranks << " x ";
    os << b << " B";
    if (dispatch_op) os << " blocks (plan record + C rows)";
    else os << " (" << dtype_name(combine_dtype) << " partials)";
    return os.str();
  }
};

// bench_run.cpp
DispatchConfig dispatch_config(const BenchCase& c, int64_t T, const Job& job);
DType expert_out_dtype(ActivationLayout layout, const DispatchConfig& cfg);
int64_t tokens_for(const BenchCase& c, const BenchOptions& o, bool cuda);
std::vector<Job> make_jobs(const BenchOptions& o, const std::vector<BenchCase>& cases);
PaddedRawPlan padded_raw_plan(const BenchCase& c, int64_t T, const Job& job, int R);
void gather_to_rank0(Group& g, RankJobResult&& mine, JobResult& acc);
// bench_rank.cpp
void run_jobs_on_rank(const BenchOptions& o, const std::vector<BenchCase>& cases, const std::vector<Job>& jobs,
                      const std::shared_ptr<Group>& group, Stream stream,
                      const std::function<void(size_t, RankJobResult&&)>& publish);
// bench_report.cpp
int report(const BenchOptions& o, const std::vector<BenchCase>& cases, const std::vector<Job>& jobs, std::vector<JobResult>& results,
           bool cuda, int R, const Config& config, const std::string& command);

}  // namespace epx::cli::bench_internal
