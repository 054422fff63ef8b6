// tools/epx/bench_run.cpp: `epx bench` (see bench_run.h).
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

namespace epx::cli {

namespace {

constexpr std::string_view kOp = "epx bench";
constexpr const char* kRaw = "nccl_a2a_raw";
constexpr uint64_t kWhatHidden = 101, kWhatRouting = 103, kWhatOrder = 102;  // stream_seed tags
/// --padded: "nccl_raw:<backend>" times the Group collectives the padded form of <backend> makes.
constexpr std::string_view kPaddedRawPrefix = "nccl_raw:";

bool is_padded_raw(const std::string& backend) { return backend.rfind(kPaddedRawPrefix, 0) == 0; }
/// A job that only moves bytes (no epx backend, nothing to validate).
bool is_raw(const std::string& backend) { return backend == kRaw || is_padded_raw(backend); }
/// The backends with a padded form (DispatchConfig::use_worst_case_sizing: C rows per rank's block, no host wait).
bool has_padded_form(const std::string& backend) {
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

RankInputs make_inputs(const BenchCase& c, size_t case_idx, int64_t T, int rank, int R, const BenchOptions& o) {
  RankInputs in;
  in.x = random_hidden(T, c.hidden, stream_seed(o.seed, kWhatHidden, case_idx, static_cast<uint64_t>(rank)));
  std::vector<int> perm(static_cast<size_t>(c.num_experts));
  for (int e = 0; e < c.num_experts; ++e) perm[static_cast<size_t>(e)] = e;
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(stream_seed(o.seed, kWhatOrder, case_idx, 0)));
  synthetic_routing(T, c.top_k, c.num_experts, o.routing == "zipf" ? o.zipf_s : 0.0, perm,
                    stream_seed(o.seed, kWhatRouting, case_idx, static_cast<uint64_t>(rank)), in.idx, in.wts);
  std::vector<char> seen(static_cast<size_t>(R));
  for (int64_t t = 0; t < T; ++t) {
    std::fill(seen.begin(), seen.end(), 0);
    for (int k = 0; k < c.top_k; ++k) {
      const int32_t e = in.idx.ptr<const int32_t>()[t * c.top_k + k];
      if (e < 0) continue;
      ++in.valid_selections;
      const int d = expert_rank(c.num_experts, R, e);
      if (!seen[static_cast<size_t>(d)]) ++in.dedup_rows;
      seen[static_cast<size_t>(d)] = 1;
    }
  }
  return in;
}

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

DispatchConfig dispatch_config(const BenchCase& c, int64_t T, const Job& job) {
  DispatchConfig cfg;
  cfg.hidden = c.hidden;
  cfg.num_experts = c.num_experts;
  cfg.top_k = c.top_k;
  cfg.num_max_dispatch_tokens_per_rank = static_cast<int>(std::max<int64_t>(T, 1));
  cfg.dispatch_dtype = job.dtype;
  // ll's combine reduction from the config (JSON "ll.combine" / EPX_LL_COMBINE; the ranks and the
  // CPU reference of the validation read the same).
  cfg.ll_combine = parse_ll_combine(Config::load().ll_combine, "ll.combine");
  // --flat-combine: the Flat backends' partials cross ranks in fp32 (partial_fp32, the default: one
  // rounding, 4 B per element in combine) or bf16 (partial_bf16: two roundings, 2 B); the identity
  // experts write their Flat rows in the matching dtype (expert_out_dtype).
  cfg.flat_combine = job.flat_combine;
  // --padded: naive / allgather_reducescatter / all2allv in their padded form (C = max(T, 1) rows per
  // rank's block, no host wait); the other backends keep their own form.
  cfg.use_worst_case_sizing = job.padded && has_padded_form(job.backend);
  return cfg;
}

/// The dtype the identity experts write for `layout` under `cfg`: fp32 Flat rows with flat_combine
/// partial_fp32 (the unrounded partial finalize takes), bf16 otherwise.
DType expert_out_dtype(ActivationLayout layout, const DispatchConfig& cfg) {
  return layout == ActivationLayout::Flat && cfg.flat_combine == FlatCombine::partial_fp32 ? DType::fp32 : DType::bf16;
}

/// Starts a timed iteration on every rank at the same moment: the group barrier (host), then a
/// one-float all-reduce on the rank's stream, so the GPUs leave it together whatever the skew with
/// which the hosts left the barrier; the caller records its first event after it.
void align_ranks(Group& group, const Tensor& word, Stream stream) {
  group.barrier();
  group.all_reduce_sum(word.data(), word.data(), 1, DType::fp32, stream);
}

#ifdef EPX_WITH_CUDA
/// One captured CUDA graph (stream capture of `body` on `stream`).
class CapturedGraph {
 public:
  CapturedGraph() = default;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec_) (void)cudaGraphExecDestroy(exec_);
  }
  void capture(Stream stream, const std::function<void()>& body) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
    ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    cudaGraph_t g = nullptr;
    try {
      body();
    } catch (...) {
      (void)cudaStreamEndCapture(s, &g);
      if (g) (void)cudaGraphDestroy(g);
      (void)cudaGetLastError();
      throw;
    }
    ok(cudaStreamEndCapture(s, &g), "cudaStreamEndCapture");
    const cudaError_t e = cudaGraphInstantiate(&exec_, g, 0);
    (void)cudaGraphDestroy(g);
    ok(e, "cudaGraphInstantiate");
  }
  void launch(Stream stream) { ok(cudaGraphLaunch(exec_, static_cast<cudaStream_t>(stream.handle)), "cudaGraphLaunch"); }

 private:
  static void ok(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw CudaError(std::string("epx bench --graph: ") + what + ": " + cudaGetErrorString(e));
  }
  cudaGraphExec_t exec_ = nullptr;
};

/// --graph: after the rank alignment the GPU idles this long (200 us) before the start event, so the host has
/// queued the timed replays by then and their launch latency on the host is not in the figure.
constexpr long long kAlignDelayNs = 200000;
/// --kernel-time rounds: 1 ms instead. CUPTI's API records slow the host, and with 200 us one rank's graph can
/// still be queued when the GPUs leave the alignment (one rank's ll dispatch kernel then waits tens of us for the
/// other's), which the kernel time of the waiting rank then holds (bench/NOTES.md, 'kernel time (CUPTI)').
constexpr long long kKernelAlignDelayNs = 1000000;

/// --graph alignment: host barrier, the delay kernel (the hosts queue the rest meanwhile), *then* the
/// device-side 1-float all-reduce, so the GPUs leave it within a signal latency of each other. (A
/// delay after the all-reduce would start on each GPU when its own host launched it: the host jitter,
/// tens of us, would become start skew in the dispatch figure.)
void align_ranks_delayed(Group& group, const Tensor& word, Stream stream, long long delay_ns = kAlignDelayNs) {
  group.barrier();
  dispatch::launch_gpu_delay(delay_ns, static_cast<cudaStream_t>(stream.handle));
  group.all_reduce_sum(word.data(), word.data(), 1, DType::fp32, stream);
}

/// --graph, ll diagnostics (stderr; bench/NOTES.md, 'LL combine runs, per-phase stamps, the launch floor'):
/// (1) the launch floor under the same timing, CUDA events around a graph of one empty kernel of the LL kernels'
/// launch shape, and of a one-warp kernel; (2) the kernels' per-phase stamps (LlTraceSlot) over 20 untimed rounds with
/// stamp kernels before and after each graph, medians. Collective (the ranks align every round).
template <class Stamped>
void ll_diagnostics(dispatch::LlCuda& ll, Group& group, const Tensor& word, Stream stream, IterTimer& timer, Stamped stamped,
                    const char* what);
template <class Stamped>
void ll_diagnostics_guarded(dispatch::LlCuda& ll, Group& group, const Tensor& word, Stream stream, IterTimer& timer, Stamped stamped,
                            const char* what) {
  try {
    ll_diagnostics(ll, group, word, stream, timer, stamped, what);
  } catch (const std::exception& e) {
    std::cerr << "epx bench: ll diagnostics failed: " << e.what() << "\n";
  }
}
template <class Stamped>
void ll_diagnostics(dispatch::LlCuda& ll, Group& group, const Tensor& word, Stream stream, IterTimer& timer, Stamped stamped,
                    const char* what) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  if (std::string(what) == "T per rank") {
    for (int tiny = 0; tiny < 2; ++tiny) {
      CapturedGraph ge;
      if (!tiny) ll.launch_empty(stream);  // eager first (module load)
      ge.capture(stream, [&] {
        if (tiny) dispatch::launch_gpu_delay(0, static_cast<cudaStream_t>(stream.handle));
        else ll.launch_empty(stream);
      });
      std::vector<double> us;
      for (int i = 0; i < 100; ++i) {
        align_ranks_delayed(group, word, stream);
        timer.mark(0);
        ge.launch(stream);
        timer.mark(1);
        timer.mark(2);
        timer.mark(3);
        us.push_back(timer.finish().first);
      }
      std::sort(us.begin(), us.end());
      os << "epx bench: ll launch floor, rank " << group.rank() << ": events around a graph of one "
         << (tiny ? "1 x 32-thread kernel" : "empty kernel of the LL launch shape") << ": p50 " << us[us.size() / 2] << " us (p10 "
         << us[us.size() / 10] << ", p90 " << us[us.size() * 9 / 10] << ")\n";
    }
  }
  std::map<std::string, std::vector<double>> vals;
  std::vector<std::string> order;
  for (int i = 0; i < 20; ++i) {
    stamped(ll);
    timer.sync();
    for (const auto& [name, v] : ll.trace_named()) {
      if (!vals.count(name)) order.push_back(name);
      vals[name].push_back(v);
    }
  }
  os << "epx bench: ll stamps, rank " << group.rank() << ", " << what << " (median of 20 rounds with stamp kernels, us from each kernel's start):";
  for (const auto& name : order) {
    auto& v = vals[name];
    std::sort(v.begin(), v.end());
    os << " " << name << " " << v[v.size() / 2] << ";";
  }
  os << "\n";
  std::cerr << os.str();
}

/// --graph: prepare and finalize captured separately; per iteration: barrier, delay, device-side align, event, prepare replay,
/// event, identity experts (eager, untimed), event, finalize replay, event. Graph-safe backends only.
void run_epx_backend_graph(const Job& job, const BenchCase& c, int64_t T, const std::shared_ptr<Group>& group, Device dev,
                           const TensorView& x, const TensorView& idx, const TensorView& wts, int warmup, int iters, Stream stream,
                           IterTimer& timer, RankJobResult& res, const KernelTimeMode& ktm) {
  const int R = group->size(), rank = group->rank();
  const DispatchConfig cfg = dispatch_config(c, T, job);
  auto pf = make_prepare_finalize(job.backend, group, cfg);
  if (!pf->capabilities().graph_safe)
    throw Unsupported("epx bench --graph: backend " + job.backend + " is not graph-safe (it waits on the host in every call)");
  res.hierarchical = pf->capabilities().hierarchical;
  auto experts = make_identity_experts(num_local_experts(cfg, R, rank), c.hidden, dev);
  Tensor out = Tensor::empty({T, c.hidden}, DType::bf16, dev);
  const Tensor word = Tensor::zeros({1}, DType::fp32, dev);
  Tensor num_tokens = Tensor::empty({1}, DType::int32, dev);
  auto set_tokens = [&](int32_t v) {
    // Waited for: a pageable cudaMemcpy may return before its DMA lands, on the legacy stream, which the
    // replays' non-blocking stream does not wait for (a T = 1 replay could read the old T).
    if (cudaMemcpy(num_tokens.data(), &v, 4, cudaMemcpyHostToDevice) != cudaSuccess || cudaStreamSynchronize(cudaStreamLegacy) != cudaSuccess)
      throw CudaError("epx bench --graph: num_tokens upload");
  };
  set_tokens(static_cast<int32_t>(T));
  DispatchArgs a;
  a.x = x;
  a.topk_idx = idx;
  a.topk_weights = wts;
  a.stream = stream;
  a.num_tokens = num_tokens;
  // One eager round first (module load, first-touch), then capture.
  PrepareResult p = pf->prepare(a);
  std::vector<int64_t> dims(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
  Tensor expert_out = Tensor::empty(dims, expert_out_dtype(p.layout, cfg), dev);
  experts->apply(p.experts_input(), expert_out, stream);
  pf->finalize({expert_out, out, stream});
  timer.sync();
  CapturedGraph gp, gf;
  gp.capture(stream, [&] { p = pf->prepare(a); });
  gf.capture(stream, [&] { pf->finalize({expert_out, out, stream}); });
  auto iteration = [&](bool timed, std::vector<double>& d_us, std::vector<double>& c_us, int64_t kt_iter = -1) {
    if (timed) {
      align_ranks_delayed(*group, word, stream, kt_iter >= 0 ? kKernelAlignDelayNs : kAlignDelayNs);
      timer.mark(0);
    }
    {
      KtCall k(kt_iter, kt::Op::dispatch);
      gp.launch(stream);
    }
    if (timed) timer.mark(1);
    experts->apply(p.experts_input(), expert_out, stream);
    if (timed) timer.mark(2);
    {
      KtCall k(kt_iter, kt::Op::combine);
      gf.launch(stream);
    }
    if (timed) {
      timer.mark(3);
      const auto [d, cmb] = timer.finish();
      d_us.push_back(d);
      c_us.push_back(cmb);
    }
  };
  std::vector<double> scratch_d, scratch_c;
  for (int i = 0; i < warmup; ++i) iteration(false, scratch_d, scratch_c);
  timer.sync();
  for (int i = 0; i < iters; ++i) iteration(true, res.dispatch_us, res.combine_us);
  timer.sync();
  kernel_rounds(ktm, *group, iters, iteration, stream, res.kernel);
  // ll diagnostics: one untimed round with stamp kernels around the graphs.
  auto iteration_stamped = [&](dispatch::LlCuda& ll) {
    align_ranks_delayed(*group, word, stream);
    ll.stamp(dispatch::kTrHostPreDisp, stream);
    gp.launch(stream);
    ll.stamp(dispatch::kTrHostPostDisp, stream);
    experts->apply(p.experts_input(), expert_out, stream);
    ll.stamp(dispatch::kTrHostPreComb, stream);
    gf.launch(stream);
    ll.stamp(dispatch::kTrHostPostComb, stream);
  };
  // The same with each graph replayed twice back to back: the second call's stamps are those of a
  // kernel whose code and tables the SMs have just run (cold vs warm start).
  auto iteration_twice = [&](dispatch::LlCuda& ll) {
    align_ranks_delayed(*group, word, stream);
    gp.launch(stream);
    ll.stamp(dispatch::kTrHostPreDisp, stream);
    gp.launch(stream);
    ll.stamp(dispatch::kTrHostPostDisp, stream);
    experts->apply(p.experts_input(), expert_out, stream);
    gf.launch(stream);
    ll.stamp(dispatch::kTrHostPreComb, stream);
    gf.launch(stream);
    ll.stamp(dispatch::kTrHostPostComb, stream);
  };
  auto print_trace = [&](const char* what) {
    if (auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get())) {
      const std::vector<double> tr = ll->trace();
      std::ostringstream os;
      os << std::fixed << std::setprecision(2) << "epx bench: ll kernel timeline, rank " << rank << ", " << what
         << " (us from kernel start, last iteration): dispatch flags stored " << tr[0] << ", waits done " << tr[1] << ", done " << tr[2]
         << "; combine flags stored " << tr[3] << ", waits done " << tr[4] << ", done " << tr[5]
         << "; last block started: dispatch " << tr[6] << ", combine " << tr[7] << "; last block done waiting: dispatch " << tr[8]
         << ", combine " << tr[9] << "\n";
      std::cerr << os.str();
    }
  };
  if (auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get())) ll->check(stream);
  print_trace("T per rank");
  if (auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get())) {
    ll_diagnostics_guarded(*ll, *group, word, stream, timer, iteration_stamped, "T per rank");
    ll_diagnostics_guarded(*ll, *group, word, stream, timer, iteration_twice, "T per rank, second of two back-to-back replays");
  }
  res.out = out.to(Device::cpu());
  // No rank queues the T = 1 warm-up (kernels that wait on peers) before every rank is past the diagnostics,
  // whose trace reads wait for the whole device: on virtual ranks (one GPU) that wait would hold a peer's
  // kernel waiting for this rank's next one.
  group->barrier();
  // The fixed floor: the same graphs with one token per rank.
  set_tokens(std::min<int32_t>(1, static_cast<int32_t>(T)));
  for (int i = 0; i < warmup; ++i) iteration(false, scratch_d, scratch_c);
  timer.sync();
  for (int i = 0; i < iters; ++i) iteration(true, res.dispatch_us_1tok, res.combine_us_1tok);
  timer.sync();
  kernel_rounds(ktm, *group, iters, iteration, stream, res.kernel_1tok);
  print_trace("T = 1");
  if (auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get())) {
    ll_diagnostics_guarded(*ll, *group, word, stream, timer, iteration_stamped, "T = 1");
    ll_diagnostics_guarded(*ll, *group, word, stream, timer, iteration_twice, "T = 1, second of two back-to-back replays");
  }
  if (auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get())) {
    ll->check(stream);
    int sms = 0;
    (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev.index);
    res.sms = std::min(ll->num_blocks(), sms);
  }
  res.graph = true;
  group->barrier();
}
#endif

/// The alignment of a --kernel-time round (cuda): host barrier, a 1 ms delay kernel, the device-side
/// all-reduce (align_ranks_delayed), for every backend, so that the GPUs start each call together even
/// where the host is slowed by CUPTI (the eager event rounds align without the delay: align_ranks).
void align_ranks_for_kernel_time(Group& group, const Tensor& word, Stream stream) {
#ifdef EPX_WITH_CUDA
  align_ranks_delayed(group, word, stream, kKernelAlignDelayNs);
#else
  align_ranks(group, word, stream);
#endif
}

/// Raw collectives timed as a backend's prepare and finalize are: `dispatch` and `combine` on the buffers they own.
struct RawCalls {
  std::vector<Tensor> buffers;
  std::function<void()> dispatch, combine;
};

/// One round of `calls` under the backends' protocol (timed: align, event, dispatch call, event, event, combine
/// call, event); with `host`, the host wall time of each timed call goes to its host_dispatch_us / host_combine_us.
void raw_round(Group& group, const Tensor& word, Stream stream, IterTimer& timer, const RawCalls& calls, bool graph, bool timed,
               std::vector<double>& d_us, std::vector<double>& c_us, int64_t kt_iter, RankJobResult* host) {
  if (timed) {
#ifdef EPX_WITH_CUDA
    if (kt_iter >= 0) align_ranks_for_kernel_time(group, word, stream);
    else if (graph) align_ranks_delayed(group, word, stream);
    else align_ranks(group, word, stream);
#else
    (void)graph;
    align_ranks(group, word, stream);
#endif
    timer.mark(0);
  }
  const auto h0 = std::chrono::steady_clock::now();
  {
    KtCall k(kt_iter, kt::Op::dispatch);
    calls.dispatch();
  }
  const auto h1 = std::chrono::steady_clock::now();
  if (timed) {
    timer.mark(1);
    timer.mark(2);
  }
  const auto h2 = std::chrono::steady_clock::now();
  {
    KtCall k(kt_iter, kt::Op::combine);
    calls.combine();
  }
  const auto h3 = std::chrono::steady_clock::now();
  if (timed) {
    timer.mark(3);
    const auto [d, cmb] = timer.finish();
    d_us.push_back(d);
    c_us.push_back(cmb);
    if (host) {
      using us = std::chrono::duration<double, std::micro>;
      host->host_dispatch_us.push_back(us(h1 - h0).count());
      host->host_combine_us.push_back(us(h3 - h2).count());
    }
  }
}

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

PaddedRawPlan padded_raw_plan(const BenchCase& c, int64_t T, const Job& job, int R) {
  Job padded = job;
  padded.backend = is_padded_raw(job.backend) ? job.backend.substr(kPaddedRawPrefix.size()) : job.backend;
  padded.padded = true;
  const DispatchConfig cfg = dispatch_config(c, T, padded);
  const dispatch::RowCodec codec{cfg.hidden, cfg.top_k, cfg.dispatch_dtype == DType::fp8_e4m3, cfg.use_ue8m0};
  const int64_t C = cfg.num_max_dispatch_tokens_per_rank, H = cfg.hidden;
  using Call = PaddedRawPlan::Call;
  PaddedRawPlan p;
  p.ranks = R;
  p.combine_dtype = cfg.flat_combine == FlatCombine::partial_fp32 ? DType::fp32 : DType::bf16;
  const int64_t es = dtype_size(p.combine_dtype);
  // Dispatch: each rank's block is its plan record's header and C rows (flat_cuda.h padded_block_bytes).
  p.dispatch_bytes = dispatch::padded_block_bytes(R, C, codec.row_bytes());
  if (padded.backend == "all2allv") {  // one block per destination both ways; combine: C partial rows per peer
    p.dispatch = p.combine = Call::all_to_all;
    p.combine_bytes = C * H * es;
  } else if (padded.backend == "allgather_reducescatter") {  // reduce-scatter of C rows per rank
    p.combine = Call::reduce_scatter;
    p.combine_bytes = C * H * es;
  } else {  // naive: every rank's [R * C, H] partials, all-gathered (fp32) or all-reduced (bf16)
    p.combine = p.combine_dtype == DType::fp32 ? Call::all_gather : Call::all_reduce;
    p.combine_bytes = R * C * H * es;
  }
  return p;
}

/// The collectives of `p` on buffers of zeros on `dev`, stream-ordered on `stream`.
RawCalls padded_raw_calls(const PaddedRawPlan& p, const std::shared_ptr<Group>& group, Device dev, Stream stream) {
  RawCalls rc;
  const int R = p.ranks;
  auto buffer = [&](int64_t bytes) {
    rc.buffers.push_back(Tensor::zeros({std::max<int64_t>(bytes, 1)}, DType::uint8, dev));
    return rc.buffers.back().data();
  };
  auto make = [&](PaddedRawPlan::Call call, int64_t bytes, DType dt) -> std::function<void()> {
    using Call = PaddedRawPlan::Call;
    std::shared_ptr<Group> g = group;
    switch (call) {
      case Call::all_gather: {
        void *send = buffer(bytes), *recv = buffer(R * bytes);
        return [=] { g->all_gather(send, recv, bytes, stream); };
      }
      case Call::all_reduce: {
        void *send = buffer(bytes), *recv = buffer(bytes);
        const int64_t n = bytes / dtype_size(dt);
        return [=] { g->all_reduce_sum(send, recv, n, dt, stream); };
      }
      case Call::reduce_scatter: {
        void *send = buffer(R * bytes), *recv = buffer(bytes);
        const std::vector<int64_t> counts(static_cast<size_t>(R), bytes / dtype_size(dt));
        return [=] { g->reduce_scatterv(send, recv, counts, dt, stream); };
      }
      case Call::all_to_all: {
        void *send = buffer(R * bytes), *recv = buffer(R * bytes);
        const std::vector<int64_t> blocks(static_cast<size_t>(R), bytes);
        return [=] { g->all_to_allv(send, blocks, recv, blocks, stream); };
      }
    }
    throw InvalidArgument("epx bench --padded: unknown collective");
  };
  rc.dispatch = make(p.dispatch, p.dispatch_bytes, DType::uint8);
  rc.combine = make(p.combine, p.combine_bytes, p.combine_dtype);
  return rc;
}

/// --padded: the nccl_raw:<backend> twin, timed in the same iterations as its backend.
struct RawTwin {
  RawCalls calls;
  RankJobResult& res;
};

/// The dispatch -> identity experts -> combine round trip of one backend on one rank, `warmup` +
/// `iters` times; times prepare and finalize of the last `iters`, and the host wall time of those calls.
/// With `twin` (--padded), each iteration also runs the twin's raw calls, aligned on their own, the order
/// of the two alternating from one iteration to the next. Collective.
void run_epx_backend(const Job& job, const BenchCase& c, int64_t T, const std::shared_ptr<Group>& group, Device dev,
                     const TensorView& x, const TensorView& idx, const TensorView& wts, int warmup, int iters, Stream stream,
                     IterTimer& timer, RankJobResult& res, const KernelTimeMode& ktm, RawTwin* twin = nullptr) {
  const int R = group->size(), rank = group->rank();
  const DispatchConfig cfg = dispatch_config(c, T, job);
  auto pf = make_prepare_finalize(job.backend, group, cfg);
  res.hierarchical = pf->capabilities().hierarchical;
#ifdef EPX_WITH_CUDA
  if (auto* ht = dynamic_cast<dispatch::HtCuda*>(pf.get())) res.sms = ht->num_sms();
#endif
  auto experts = make_identity_experts(num_local_experts(cfg, R, rank), c.hidden, dev);
  Tensor out = Tensor::empty({T, c.hidden}, DType::bf16, dev);
  Tensor expert_out;
  const Tensor word = Tensor::zeros({1}, DType::fp32, dev);
  auto round_trip_into = [&](bool timed, std::vector<double>& d_us, std::vector<double>& c_us, int64_t kt_iter = -1) {
    if (timed) {
      if (kt_iter >= 0) align_ranks_for_kernel_time(*group, word, stream);
      else align_ranks(*group, word, stream);
      timer.mark(0);
    }
    DispatchArgs a;
    a.x = x;
    a.topk_idx = idx;
    a.topk_weights = wts;
    a.stream = stream;
    PrepareResult p;
    const auto h0 = std::chrono::steady_clock::now();
    {
      KtCall k(kt_iter, kt::Op::dispatch);
      p = pf->prepare(a);
    }
    const auto h1 = std::chrono::steady_clock::now();
    if (timed) timer.mark(1);
    std::vector<int64_t> dims(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
    TensorView eo(nullptr, expert_out_dtype(p.layout, cfg), dims, dev);
    if (!expert_out.defined() || expert_out.nbytes() < eo.nbytes())
      expert_out = Tensor::empty({std::max<int64_t>(eo.numel(), 1)}, eo.dtype, dev);
    eo.data = expert_out.data();
    experts->apply(p.experts_input(), eo, stream);
    if (timed) timer.mark(2);
    FinalizeArgs f;
    f.expert_out = eo;
    f.out = out;
    f.stream = stream;
    const auto h2 = std::chrono::steady_clock::now();
    {
      KtCall k(kt_iter, kt::Op::combine);
      pf->finalize(f);
    }
    const auto h3 = std::chrono::steady_clock::now();
    if (timed) {
      timer.mark(3);
      const auto [d, cmb] = timer.finish();
      d_us.push_back(d);
      c_us.push_back(cmb);
      if (kt_iter < 0) {
        using us = std::chrono::duration<double, std::micro>;
        res.host_dispatch_us.push_back(us(h1 - h0).count());
        res.host_combine_us.push_back(us(h3 - h2).count());
      }
    }
  };
  auto twin_round = [&](bool timed, std::vector<double>& d_us, std::vector<double>& c_us, int64_t kt_iter = -1) {
    raw_round(*group, word, stream, timer, twin->calls, false, timed, d_us, c_us, kt_iter, kt_iter < 0 ? &twin->res : nullptr);
  };
  std::vector<double> scratch_d, scratch_c;
  auto iteration = [&](int i, bool timed) {
    std::vector<double>& d = timed ? res.dispatch_us : scratch_d;
    std::vector<double>& cmb = timed ? res.combine_us : scratch_c;
    if (!twin) return round_trip_into(timed, d, cmb);
    std::vector<double>& rd = timed ? twin->res.dispatch_us : scratch_d;
    std::vector<double>& rc = timed ? twin->res.combine_us : scratch_c;
    if (i % 2 == 1) twin_round(timed, rd, rc);
    round_trip_into(timed, d, cmb);
    if (i % 2 == 0) twin_round(timed, rd, rc);
  };
  for (int i = 0; i < warmup; ++i) iteration(i, false);
  timer.sync();
  for (int i = 0; i < iters; ++i) iteration(i, true);
  timer.sync();
  kernel_rounds(ktm, *group, iters, round_trip_into, stream, res.kernel);
  if (twin) kernel_rounds(ktm, *group, iters, twin_round, stream, twin->res.kernel);
  res.remote_bytes_dispatch = pf->stats().remote_bytes_dispatch;
  res.remote_bytes_combine = pf->stats().remote_bytes_combine;
  res.out = out.device().is_cpu() ? out : out.to(Device::cpu());
}

/// NCCL's (or the CPU group's) all-to-all of equal blocks: rows_per_peer rows of `row_bytes` to
/// every rank (incl. self), once at the dispatch row size and once at the bf16 combine size.
void run_raw_a2a(const BenchCase& c, DType dtype, int64_t rows_per_peer, const std::shared_ptr<Group>& group, Device dev,
                 int warmup, int iters, Stream stream, IterTimer& timer, RankJobResult& res, bool graph, const KernelTimeMode& ktm) {
  const int R = group->size();
  const int64_t disp_row = dtype == DType::fp8_e4m3 ? c.hidden + c.hidden / kFp8GroupSize * 4 : 2 * c.hidden;
  const int64_t comb_row = 2 * c.hidden;
  const std::vector<int64_t> disp(static_cast<size_t>(R), rows_per_peer * disp_row), comb(static_cast<size_t>(R), rows_per_peer * comb_row);
  RawCalls calls;
  for (int64_t bytes : {disp_row, disp_row, comb_row, comb_row})
    calls.buffers.push_back(Tensor::zeros({std::max<int64_t>(1, R * rows_per_peer * bytes)}, DType::uint8, dev));
  void *send_d = calls.buffers[0].data(), *recv_d = calls.buffers[1].data(), *send_c = calls.buffers[2].data(), *recv_c = calls.buffers[3].data();
  const Tensor word = Tensor::zeros({1}, DType::fp32, dev);
  calls.dispatch = [&] { group->all_to_allv(send_d, disp, recv_d, disp, stream); };
  calls.combine = [&] { group->all_to_allv(send_c, comb, recv_c, comb, stream); };
#ifdef EPX_WITH_CUDA
  CapturedGraph gd, gc;
  if (graph && dev.is_cuda()) {
    // NCCL send/recv are capturable (NCCL >= 2.9); if this NCCL refuses, time eagerly and say so.
    try {
      gd.capture(stream, calls.dispatch);
      gc.capture(stream, calls.combine);
      calls.dispatch = [&] { gd.launch(stream); };
      calls.combine = [&] { gc.launch(stream); };
      res.graph = true;
    } catch (const std::exception& e) {
      std::cerr << "epx bench --graph: nccl_a2a_raw capture failed (" << e.what() << "), timing it eagerly\n";
      group->barrier();
    }
  }
#else
  (void)graph;
#endif
  // Graph replays: no host time (the host launch of a graph is not the calls' enqueue).
  auto once_into = [&](bool timed, std::vector<double>& d_us, std::vector<double>& c_us, int64_t kt_iter = -1) {
    raw_round(*group, word, stream, timer, calls, res.graph, timed, d_us, c_us, kt_iter, res.graph || kt_iter >= 0 ? nullptr : &res);
  };
  std::vector<double> scratch_d, scratch_c;
  for (int i = 0; i < warmup; ++i) once_into(false, scratch_d, scratch_c);
  timer.sync();
  for (int i = 0; i < iters; ++i) once_into(true, res.dispatch_us, res.combine_us);
  timer.sync();
  kernel_rounds(ktm, *group, iters, once_into, stream, res.kernel);
  res.moved_bytes_dispatch = R * rows_per_peer * disp_row;
  res.moved_bytes_combine = R * rows_per_peer * comb_row;
}

/// The case's tokens per rank on this device.
int64_t tokens_for(const BenchCase& c, const BenchOptions& o, bool cuda) {
  if (o.tokens_per_rank > 0) return o.tokens_per_rank;
  return cuda ? c.tokens_per_rank : std::min<int64_t>(c.tokens_per_rank, 16);
}

std::vector<Job> make_jobs(const BenchOptions& o, const std::vector<BenchCase>& cases) {
  // A comma-separated list runs those backends in one run (e.g. "ht,nccl_a2a_raw"); "all" = every one.
  std::vector<std::string> backends;
  std::string list = o.backend + ",";
  for (size_t at = list.find(','); at != std::string::npos; at = list.find(',')) {
    const std::string b = list.substr(0, at);
    list.erase(0, at + 1);
    if (b == "all") {
      // --padded: every backend with a padded form (each with its nccl_raw twin below).
      for (const std::string& n : backend_names())
        if (!o.padded || has_padded_form(n)) backends.push_back(n);
      if (!o.padded) backends.push_back(kRaw);
    } else if (!b.empty()) {
      require_arg(kOp, "--backend", b, !o.padded || b == kRaw || has_padded_form(b),
                  "has no padded form: --padded takes naive, allgather_reducescatter, all2allv, nccl_a2a_raw or all");
      backends.push_back(b);
    }
  }
  std::vector<Job> jobs;
  const FlatCombine fc = parse_flat_combine(o.flat_combine, "--flat-combine");
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    std::vector<DType> dtypes = cases[ci].dtypes;
    if (!o.dtype.empty()) dtypes = {parse_dtype(o.dtype)};
    for (DType dt : dtypes)
      for (const std::string& b : backends) {
        const bool padded = o.padded && has_padded_form(b);
        jobs.push_back({ci, dt, b, fc, padded});
        // The twin right after its backend: run_jobs_on_rank times the two in the same iterations.
        if (padded) jobs.push_back({ci, dt, std::string(kPaddedRawPrefix) + b, fc, true});
      }
  }
  return jobs;
}

/// Runs every job on this rank. `publish(job index, result)` hands each result over (collective on
/// multi-process groups). Inputs are made per case and uploaded to `dev` once.
void run_jobs_on_rank(const BenchOptions& o, const std::vector<BenchCase>& cases, const std::vector<Job>& jobs,
                      const std::shared_ptr<Group>& group, Stream stream,
                      const std::function<void(size_t, RankJobResult&&)>& publish) {
  const int R = group->size(), rank = group->rank();
  const Device dev = group->device();
  IterTimer timer(dev.is_cuda(), stream);
  KernelTimeMode ktm;
  if (!dev.is_cuda()) {
    ktm.reason = "unavailable: --device cpu (no GPU kernels)";
  } else if (o.kernel_time == "off") {
    ktm.reason = "off";
  } else if (group->ranks_per_gpu() > 1) {
    // One CUPTI timer per process (kernel_time.h): R ranks' threads cannot each run their rounds on it.
    ktm.reason = "unavailable: virtual ranks (one CUPTI timer per process, shared by the ranks' threads)";
  } else {
    ktm.on = true;
    (void)kt::KernelTimer::instance();  // CUPTI attaches here, before any graph is captured (kernel_time.cpp)
  }
  size_t cur_case = static_cast<size_t>(-1);
  RankInputs in;
  Tensor x, idx, wts;
  int64_t T = 0, rows_per_peer = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    const BenchCase& c = cases[job.case_idx];
    if (job.case_idx != cur_case) {
      cur_case = job.case_idx;
      T = tokens_for(c, o, dev.is_cuda());
      in = make_inputs(c, job.case_idx, T, rank, R, o);
      x = dev.is_cpu() ? in.x : in.x.to(dev);
      idx = dev.is_cpu() ? in.idx : in.idx.to(dev);
      wts = dev.is_cpu() ? in.wts : in.wts.to(dev);
      // nccl_a2a_raw: the mean rank-deduplicated rows of this routing, in equal blocks per peer.
      int64_t total = 0;
      for (int64_t v : group->all_gather_i64(in.dedup_rows)) total += v;
      rows_per_peer = (total / R + R - 1) / R;
    }
    RankJobResult res, twin_res;
    res.valid_selections = twin_res.valid_selections = in.valid_selections;
    res.dedup_rows = twin_res.dedup_rows = in.dedup_rows;
    // --padded: the backend's job is followed by its nccl_raw twin's (make_jobs); both run now.
    const bool with_twin = job.padded && !is_raw(job.backend) && j + 1 < jobs.size() && is_padded_raw(jobs[j + 1].backend);
    try {
      if (with_twin) {
        const PaddedRawPlan plan = padded_raw_plan(c, T, job, R);
        twin_res.moved_bytes_dispatch = plan.send_bytes(true);
        twin_res.moved_bytes_combine = plan.send_bytes(false);
        RawTwin twin{padded_raw_calls(plan, group, dev, stream), twin_res};
        run_epx_backend(job, c, T, group, dev, x, idx, wts, o.warmup, o.iters, stream, timer, res, ktm, &twin);
      } else if (job.backend == kRaw) {
        run_raw_a2a(c, job.dtype, rows_per_peer, group, dev, o.warmup, o.iters, stream, timer, res, o.graph, ktm);
      } else if (o.graph) {
#ifdef EPX_WITH_CUDA
        run_epx_backend_graph(job, c, T, group, dev, x, idx, wts, o.warmup, o.iters, stream, timer, res, ktm);
#endif
      } else {
        run_epx_backend(job, c, T, group, dev, x, idx, wts, o.warmup, o.iters, stream, timer, res, ktm);
      }
    } catch (const Unsupported& e) {
      res.status = twin_res.status = 1;
      res.message = twin_res.message = e.what();
    } catch (const std::exception& e) {
      res.status = twin_res.status = 2;
      res.message = twin_res.message = e.what();
    }
    if (rank == 0 || res.status == 2)
      std::cerr << "epx bench: rank " << rank << ": " << c.name << " " << dtype_name(job.dtype) << " " << job.backend
                << (job.padded ? " (padded" + std::string(with_twin ? ", with its nccl_raw twin)" : ")") : std::string()) << ": "
                << (res.status == 0 ? "ran" : res.status == 1 ? "unsupported" : "error: " + res.message) << "\n";
    publish(j, std::move(res));
    if (with_twin) publish(++j, std::move(twin_res));
  }
}

/// Multi-process: every rank's result of one job reaches rank 0 (statuses, times, counts, outputs).
[[maybe_unused]] void gather_to_rank0(Group& g, RankJobResult&& mine, JobResult& acc) {
  const int R = g.size(), rank = g.rank();
  const std::vector<int64_t> statuses = g.all_gather_i64(mine.status);
  int64_t worst = 0;
  for (int64_t s : statuses) worst = std::max(worst, s);
  if (rank == 0) acc.ranks.assign(static_cast<size_t>(R), RankJobResult{});
  if (worst != 0) {
    if (rank == 0)
      for (int q = 0; q < R; ++q) {
        acc.ranks[q].status = statuses[q];
        acc.ranks[q].message = q == 0 ? mine.message : "rank " + std::to_string(q) + ": see its stderr";
      }
    return;
  }
  const int64_t n = static_cast<int64_t>(mine.dispatch_us.size());
  std::vector<double> d(static_cast<size_t>(n * R)), cmb(static_cast<size_t>(n * R));
  g.all_gather(mine.dispatch_us.data(), d.data(), n * 8);
  g.all_gather(mine.combine_us.data(), cmb.data(), n * 8);
  const int64_t n1 = static_cast<int64_t>(mine.dispatch_us_1tok.size());  // the same on every rank (same job)
  std::vector<double> d1(static_cast<size_t>(n1 * R)), c1(static_cast<size_t>(n1 * R));
  if (n1 > 0) {
    g.all_gather(mine.dispatch_us_1tok.data(), d1.data(), n1 * 8);
    g.all_gather(mine.combine_us_1tok.data(), c1.data(), n1 * 8);
  }
  const std::vector<int64_t> sms = g.all_gather_i64(mine.sms), graphs = g.all_gather_i64((mine.graph ? 1 : 0) | (mine.hierarchical ? 2 : 0));
  const std::vector<int64_t> sel = g.all_gather_i64(mine.valid_selections), dd = g.all_gather_i64(mine.dedup_rows);
  const std::vector<int64_t> md = g.all_gather_i64(mine.moved_bytes_dispatch), mc = g.all_gather_i64(mine.moved_bytes_combine);
  const std::vector<int64_t> rbd = g.all_gather_i64(mine.remote_bytes_dispatch), rbc = g.all_gather_i64(mine.remote_bytes_combine);
  // Host times: as many per rank as timed eager iterations (the same on every rank for one job; none for graphs).
  const int64_t nh = static_cast<int64_t>(mine.host_dispatch_us.size());
  std::vector<double> hd(static_cast<size_t>(nh * R)), hc(static_cast<size_t>(nh * R));
  if (nh > 0) {
    g.all_gather(mine.host_dispatch_us.data(), hd.data(), nh * 8);
    g.all_gather(mine.host_combine_us.data(), hc.data(), nh * 8);
  }
  // --kernel-time: ran (agreed in kernel_rounds, so the same on every rank) with iters values per vector.
  std::vector<KernelRun> kruns;
  for (KernelRun* kr : {&mine.kernel, &mine.kernel_1tok}) {
    KernelRun got;
    got.reason = kr->reason;
    got.ran = kr->ran;
    if (kr->ran) {
      for (int op = 0; op < 2; ++op) {
        const int64_t m = static_cast<int64_t>(kr->sum_us[op].size());
        std::vector<double> a(static_cast<size_t>(m * R)), b(static_cast<size_t>(m * R)), e(static_cast<size_t>(m * R));
        std::vector<double> ev = kr->events_us[op];
        ev.resize(static_cast<size_t>(m), NAN);
        g.all_gather(kr->sum_us[op].data(), a.data(), m * 8);
        g.all_gather(kr->span_us[op].data(), b.data(), m * 8);
        g.all_gather(ev.data(), e.data(), m * 8);
        got.sum_us[op] = std::move(a);  // R blocks of m, rank-major
        got.span_us[op] = std::move(b);
        got.events_us[op] = std::move(e);
        got.names[op] = kr->names[op];
        got.per_call[op] = kr->per_call[op];
      }
      int64_t dropped = 0;
      for (int64_t v : g.all_gather_i64(kr->dropped)) dropped += v;
      got.dropped = dropped;
    }
    kruns.push_back(std::move(got));
  }
  const bool has_out = mine.out.defined();
  std::vector<Tensor> outs;
  if (has_out) {
    const int64_t bytes = mine.out.nbytes();
    Tensor all = Tensor::empty({R * mine.out.size(0), mine.out.size(1)}, DType::bf16);
    g.all_gather(mine.out.data(), all.data(), bytes);
    for (int q = 0; q < R && rank == 0; ++q) {
      Tensor o = Tensor::empty({mine.out.size(0), mine.out.size(1)}, DType::bf16);
      std::memcpy(o.data(), static_cast<const char*>(all.data()) + q * bytes, static_cast<size_t>(bytes));
      outs.push_back(std::move(o));
    }
  }
  if (rank != 0) return;
  for (int q = 0; q < R; ++q) {
    RankJobResult& r = acc.ranks[q];
    r.dispatch_us.assign(d.begin() + q * n, d.begin() + (q + 1) * n);
    r.combine_us.assign(cmb.begin() + q * n, cmb.begin() + (q + 1) * n);
    r.dispatch_us_1tok.assign(d1.begin() + q * n1, d1.begin() + (q + 1) * n1);
    r.combine_us_1tok.assign(c1.begin() + q * n1, c1.begin() + (q + 1) * n1);
    r.sms = sms[q];
    r.graph = (graphs[q] & 1) != 0;
    r.hierarchical = (graphs[q] & 2) != 0;
    r.valid_selections = sel[q];
    r.dedup_rows = dd[q];
    r.moved_bytes_dispatch = md[q];
    r.moved_bytes_combine = mc[q];
    r.remote_bytes_dispatch = rbd[q];
    r.remote_bytes_combine = rbc[q];
    r.host_dispatch_us.assign(hd.begin() + q * nh, hd.begin() + (q + 1) * nh);
    r.host_combine_us.assign(hc.begin() + q * nh, hc.begin() + (q + 1) * nh);
    if (has_out) r.out = outs[q];
    KernelRun* dst[2] = {&r.kernel, &r.kernel_1tok};
    for (int k = 0; k < 2; ++k) {
      const KernelRun& src = kruns[static_cast<size_t>(k)];
      KernelRun& d = *dst[k];
      d = KernelRun{};
      d.ran = src.ran;
      d.reason = src.reason;
      d.dropped = src.dropped;
      if (!src.ran) continue;
      for (int op = 0; op < 2; ++op) {
        const size_t m = src.sum_us[op].size() / static_cast<size_t>(R);
        d.sum_us[op].assign(src.sum_us[op].begin() + q * m, src.sum_us[op].begin() + (q + 1) * m);
        d.span_us[op].assign(src.span_us[op].begin() + q * m, src.span_us[op].begin() + (q + 1) * m);
        d.events_us[op].assign(src.events_us[op].begin() + q * m, src.events_us[op].begin() + (q + 1) * m);
        d.names[op] = src.names[op];  // rank 0's
        d.per_call[op] = src.per_call[op];
      }
    }
  }
}

/// out[t] = round_bf16(sum over valid k of w[t,k] * round_bf16(x~[t])): what any correct backend
/// computes with identity experts, rounded once; a backend that rounds once (ll partial_fp32 /
/// column, the Flat backends with flat_combine partial_fp32) differs from it only in the fp32
/// summation order (within 1 bf16 ulp), one with partial_bf16 rounds each rank's partial first.
Tensor identity_formula(const RankInputs& in, int K, DType dtype) {
  const int64_t T = in.x.size(0), H = in.x.size(1);
  Tensor out = Tensor::empty({T, H}, DType::bf16);
  std::vector<float> row(static_cast<size_t>(H)), acc(static_cast<size_t>(H));
  std::vector<uint8_t> q(static_cast<size_t>(H));
  std::vector<float> sc(static_cast<size_t>(H / kFp8GroupSize + 1));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) row[h] = bf16_bits_to_float(in.x.ptr<const uint16_t>()[t * H + h]);
    if (dtype == DType::fp8_e4m3) {
      quantize_fp8_row(row.data(), H, q.data(), sc.data(), kFp8GroupSize, false);
      dequantize_fp8_row(q.data(), sc.data(), H, row.data(), kFp8GroupSize);
    }
    for (float& v : row) v = round_bf16(v);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      if (in.idx.ptr<const int32_t>()[t * K + k] < 0) continue;
      const float w = in.wts.ptr<const float>()[t * K + k];
      for (int64_t h = 0; h < H; ++h) acc[h] += w * row[h];
    }
    for (int64_t h = 0; h < H; ++h) out.ptr<uint16_t>()[t * H + h] = float_to_bf16_bits(acc[h]);
  }
  return out;
}

/// Fraction of elements of `out` more than `ulps` bf16 ulps from `ref` (both bf16 [.., H]; NaN counts as far).
double fraction_beyond_ulps(const Tensor& out, const Tensor& ref, int ulps) {
  const int64_t n = std::min(out.numel(), ref.numel());
  if (n == 0) return 0.0;
  // bf16 bits as a monotone integer line (negative values mirrored), so adjacent values differ by 1.
  auto ordered = [](uint16_t b) { return (b & 0x8000) ? -static_cast<int32_t>(b & 0x7FFF) : static_cast<int32_t>(b); };
  int64_t far = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t a = out.ptr<const uint16_t>()[i], b = ref.ptr<const uint16_t>()[i];
    const bool nan = std::isnan(bf16_bits_to_float(a)) || std::isnan(bf16_bits_to_float(b));
    far += nan || std::abs(ordered(a) - ordered(b)) > ulps;
  }
  return static_cast<double>(far) / static_cast<double>(n);
}

/// Whether `job` promises one rounding (ll unless ll_combine partial_bf16; the Flat backends with
/// flat_combine partial_fp32), so its output must lie within 1 ulp of the identity formula.
bool rounds_once(const Job& job, const Config& config) {
  if (job.backend == "ll") return config.ll_combine != "partial_bf16";
  return job.flat_combine == FlatCombine::partial_fp32;
}

/// The same backend on CPU ranks (threads) with identity experts, on the same inputs.
std::vector<Tensor> cpu_backend_outputs(const Job& job, const BenchCase& c, int64_t T, const std::vector<RankInputs>& ins,
                                        double timeout_s) {
  const int R = static_cast<int>(ins.size());
  auto groups = make_cpu_groups(R, timeout_s);
  std::vector<Tensor> outs(static_cast<size_t>(R));
  run_ranks(groups, [&](int r) {
    const DispatchConfig cfg = dispatch_config(c, T, job);
    auto pf = make_prepare_finalize(job.backend, groups[r], cfg);
    auto experts = make_identity_experts(num_local_experts(cfg, R, r), c.hidden, Device::cpu());
    DispatchArgs a;
    a.x = ins[r].x;
    a.topk_idx = ins[r].idx;
    a.topk_weights = ins[r].wts;
    const PrepareResult p = pf->prepare(a);
    std::vector<int64_t> dims(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
    Tensor eo = Tensor::empty(dims, expert_out_dtype(p.layout, cfg));
    experts->apply(p.experts_input(), eo, {});
    outs[r] = Tensor::empty({T, c.hidden}, DType::bf16);
    FinalizeArgs f;
    f.expert_out = eo;
    f.out = outs[r];
    pf->finalize(f);
  });
  return outs;
}

std::string fixed(double v, int digits) {
  if (!std::isfinite(v)) return "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

int64_t bytes_per_selection(const BenchCase& c, DType dtype, const std::string& op) {
  const int64_t H = c.hidden;
  if (op == "combine") return 2 * H;
  return dtype == DType::fp8_e4m3 ? H + H / kFp8GroupSize * 4 + (c.accounting == "deepep-ll" ? 16 : 0) : 2 * H;
}

/// Validation, table, JSON. Returns the exit code.
int report(const BenchOptions& o, const std::vector<BenchCase>& cases, const std::vector<Job>& jobs, std::vector<JobResult>& results,
           bool cuda, int R, const Config& config, const std::string& command) {
  using json = nlohmann::ordered_json;
  // Virtual ranks (R threads on one GPU): the times are one GPU's memory, not NVLink.
  const bool virtual_ranks = cuda && o.ranks_per_gpu_for_report > 1;
  const json ranks_per_gpu = cuda ? json(o.ranks_per_gpu_for_report) : json(nullptr);
  // Inputs of every rank, regenerated here (deterministic per (seed, case, rank)) for the references.
  std::vector<std::vector<RankInputs>> inputs(cases.size());
  auto inputs_of = [&](size_t ci) -> const std::vector<RankInputs>& {
    if (inputs[ci].empty())
      for (int r = 0; r < R; ++r) inputs[ci].push_back(make_inputs(cases[ci], ci, tokens_for(cases[ci], o, cuda), r, R, o));
    return inputs[ci];
  };
  json rows = json::array();
  bool ok = true;
  std::ostringstream table;
  // Wide enough for "nccl_raw:allgather_reducescatter" and "allgather_reducescatter [padded]".
  constexpr int kBackendWidth = 34;
  table << std::left << std::setw(7) << "case" << std::setw(9) << "dtype" << std::setw(kBackendWidth) << "backend" << std::setw(9) << "op"
        << std::right << std::setw(10) << "p50 us" << std::setw(10) << "p10 us" << std::setw(10) << "p90 us" << std::setw(9) << "GB/s"
        << std::setw(11) << "predicted" << std::setw(7) << "ratio" << std::setw(10) << "kern p50" << std::setw(10) << "kern p90"
        << std::setw(10) << "span p50" << std::setw(8) << "kGB/s" << "  " << std::left << "validated\n";
  std::ostringstream kernel_lines;  // the kernels seen, per (job, op)
  std::string kernel_state;         // the first row's kernel_time, for the footer
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    const BenchCase& c = cases[job.case_idx];
    JobResult& jr = results[j];
    const int64_t T = tokens_for(c, o, cuda);
    int64_t status = 0;
    std::string message;
    for (const RankJobResult& r : jr.ranks)
      if (r.status > status) status = r.status, message = r.message;
    // Validation of an epx backend's round trip.
    bool validated = false, passed = true;
    double max_rel = 0, rel_l2 = 0, beyond_ulp = 0, mismatch = 0;
    std::string reference;
    if (status == 0 && !is_raw(job.backend)) {
      try {
        const auto& ins = inputs_of(job.case_idx);
        std::vector<Tensor> refs;
        if (cuda) {
          refs = cpu_backend_outputs(job, c, T, ins, config.timeout_s);
          reference = "cpu backend " + job.backend + " + identity experts, same inputs";
        } else {
          for (const RankInputs& in : ins) refs.push_back(identity_formula(in, c.top_k, job.dtype));
          reference = "identity formula sum_k w * round_bf16(x~)";
        }
        for (int r = 0; r < R; ++r) {
          double a = 0, b = 0;
          errors_against(jr.ranks[r].out, refs[r], &a, &b);
          max_rel = std::max(max_rel, a);
          rel_l2 = std::max(rel_l2, b);
          beyond_ulp = std::max(beyond_ulp, fraction_beyond_ulps(jr.ranks[r].out, refs[r], 1));
          mismatch = std::max(mismatch, fraction_beyond_ulps(jr.ranks[r].out, refs[r], 0));
        }
        validated = true;
        if (!(rel_l2 <= kRelL2Tolerance)) {
          passed = false;
          message = "rel L2 error " + std::to_string(rel_l2) + " > " + std::to_string(kRelL2Tolerance) + " against the " + reference;
        } else if (!cuda && rounds_once(job, config) && !(beyond_ulp <= kOneRoundingFarFraction)) {
          // One rounding: only the fp32 summation order differs from the formula.
          passed = false;
          message = "one rounding promised, but " + std::to_string(100 * beyond_ulp) + " % of elements are more than 1 ulp from the " +
                    reference + " (at most " + std::to_string(100 * kOneRoundingFarFraction) + " %)";
        }
        ok = ok && passed;
      } catch (const std::exception& e) {
        ok = passed = false;
        message = std::string("validation failed: ") + e.what();
      }
    }
    if (status == 2) ok = false;
    const bool has_1tok = status == 0 && !jr.ranks.empty() && !jr.ranks[0].dispatch_us_1tok.empty();
    for (const bool one_token : {false, true})
    for (const char* op_name : {"dispatch", "combine"}) {
      if (one_token && !has_1tok) continue;
      const std::string op = op_name;
      std::vector<double> per_iter;
      double bytes = 0, moved = 0;
      if (status == 0) {
        const size_t n = one_token ? jr.ranks[0].dispatch_us_1tok.size() : jr.ranks[0].dispatch_us.size();
        per_iter.assign(n, 0.0);
        for (const RankJobResult& r : jr.ranks) {
          const auto& v = one_token ? (op == "dispatch" ? r.dispatch_us_1tok : r.combine_us_1tok) : (op == "dispatch" ? r.dispatch_us : r.combine_us);
          for (size_t i = 0; i < n && i < v.size(); ++i) per_iter[i] = std::max(per_iter[i], v[i]);
          const int64_t count = c.accounting == "deepep-ll" ? r.valid_selections : r.dedup_rows;
          if (!one_token) bytes += static_cast<double>(count * bytes_per_selection(c, job.dtype, op)) / R;
          moved += static_cast<double>(op == "dispatch" ? r.moved_bytes_dispatch : r.moved_bytes_combine) / R;
        }
      }
      const bool ran = !per_iter.empty();
      const double p50 = ran ? percentile(per_iter, 50) : NAN;
      const double gbps = ran && p50 > 0 ? bytes / (p50 * 1e3) : NAN;
      const Prediction pred = predict(c.name, job.dtype, job.backend, op, R);
      // Predictions were written for the GPUs at the case's own shape and uniform routing.
      // None for the padded form (its bytes and host work differ from what they were written for).
      const bool has_pred = !one_token && !job.padded && pred.predicted_us > 0 && cuda && !virtual_ranks && T == c.tokens_per_rank &&
                            o.routing == "uniform";
      // Host wall time of the timed calls (eager rounds): per iteration the slowest rank's.
      std::vector<double> host_iter;
      if (status == 0 && !one_token && !jr.ranks.empty() && !jr.ranks[0].host_dispatch_us.empty()) {
        host_iter.assign(jr.ranks[0].host_dispatch_us.size(), 0.0);
        for (const RankJobResult& r : jr.ranks) {
          const auto& v = op == "dispatch" ? r.host_dispatch_us : r.host_combine_us;
          for (size_t i = 0; i < host_iter.size() && i < v.size(); ++i) host_iter[i] = std::max(host_iter[i], v[i]);
        }
      }
      const bool row_validated = validated && !one_token;
      // --kernel-time (KernelRun): each rank's own p50 / p90 / mean of its calls' kernel sums (and spans), the
      // largest over the ranks; the per-iteration slowest rank's p50 beside it (it also holds the iterations
      // where one rank's kernel waited for a peer that started late).
      const int opi = op == "dispatch" ? 0 : 1;
      const KernelRun* kr0 = status == 0 && !jr.ranks.empty() ? (one_token ? &jr.ranks[0].kernel_1tok : &jr.ranks[0].kernel) : nullptr;
      const bool kran = kr0 && kr0->ran;
      std::vector<std::vector<double>> ksum, kspan, kev;
      json kper_rank = json::array();
      if (kran)
        for (const RankJobResult& r : jr.ranks) {
          const KernelRun& k = one_token ? r.kernel_1tok : r.kernel;
          ksum.push_back(k.sum_us[opi]);
          kspan.push_back(k.span_us[opi]);
          kev.push_back(k.events_us[opi]);
          const double v = kt::percentile_finite(k.sum_us[opi], 50);
          kper_rank.push_back(std::isfinite(v) ? json(v) : json(nullptr));
        }
      const std::vector<double> kit = kran ? kt::slowest_rank(ksum) : std::vector<double>{};
      const std::vector<double> ksp = kran ? kt::slowest_rank(kspan) : std::vector<double>{};
      const std::vector<double> kevs = kran ? kt::slowest_rank(kev) : std::vector<double>{};
      auto num = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
      auto worst = [](double a, double b) { return std::isnan(a) ? b : std::isnan(b) ? a : std::max(a, b); };
      double k50 = NAN, k90 = NAN, kmean = NAN, s50 = NAN, s90 = NAN;
      for (size_t q = 0; q < ksum.size(); ++q) {
        k50 = worst(k50, kt::percentile_finite(ksum[q], 50));
        k90 = worst(k90, kt::percentile_finite(ksum[q], 90));
        kmean = worst(kmean, kt::mean_finite(ksum[q]));
        s50 = worst(s50, kt::percentile_finite(kspan[q], 50));
        s90 = worst(s90, kt::percentile_finite(kspan[q], 90));
      }
      const double kgbps = std::isfinite(k50) && k50 > 0 && !one_token && status == 0 ? bytes / (k50 * 1e3) : NAN;
      const std::string kstate = kran ? "cupti" : kr0 ? kr0->reason : status == 0 ? "unavailable" : "n/a (the job did not run)";
      if (const std::string why = kr0 ? kt::kernel_time_failure(o.kernel_time, kran, kr0->reason) : ""; !why.empty()) {
        ok = false;  // a runtime CUPTI failure ran as auto and exited 0
        if (message.empty()) message = why;
      }
      if (kernel_state.empty() && kr0) kernel_state = kstate;
      json kernels = json::object();
      if (kran)
        for (const auto& [name, n] : kr0->per_call[opi]) kernels[name] = n;
      if (kran)
        kernel_lines << "  kernels of " << job.backend << (one_token ? " (T=1) " : " ") << op << ": "
                     << (kr0->names[opi].empty() ? std::string("none seen") : kr0->names[opi]) << " (per call, rank 0)\n";
      json row = {
          {"case", c.name},
          {"backend", job.backend},
          {"op", op},
          {"tokens_per_rank", one_token ? int64_t{1} : T},
          {"hidden", c.hidden},
          {"top_k", c.top_k},
          {"num_experts", c.num_experts},
          {"ranks", R},
          {"ranks_per_gpu", ranks_per_gpu},
          {"dtype", std::string(dtype_name(op == "dispatch" ? job.dtype : DType::bf16))},
          {"dispatch_dtype", std::string(dtype_name(job.dtype))},
          {"routing", o.routing == "zipf" ? "zipf(s=" + fixed(o.zipf_s, 2) + ")" : o.routing},
          {"ll_combine", job.backend == "ll" ? json(config.ll_combine) : json(nullptr)},
          {"ll_combine_wait", job.backend == "ll" ? json(config.ll_combine_wait) : json(nullptr)},
          {"latency_us_p50", ran ? json(p50) : json(nullptr)},
          {"latency_us_p10", ran ? json(percentile(per_iter, 10)) : json(nullptr)},
          {"latency_us_p90", ran ? json(percentile(per_iter, 90)) : json(nullptr)},
          {"gbps", std::isfinite(gbps) && !one_token ? json(gbps) : json(nullptr)},
          {"accounting", c.accounting},
          {"bytes_per_rank", ran ? json(bytes) : json(nullptr)},
          {"tflops", nullptr},
          {"fraction_of_peak", nullptr},
          {"sms", status == 0 && jr.ranks[0].sms > 0 ? json(jr.ranks[0].sms) : json(nullptr)},
          {"timing", status == 0 && jr.ranks[0].graph ? "cuda-graph replay" : "eager"},
          {"path", status == 0 && jr.ranks[0].hierarchical ? "hierarchical (inter-node NCCL blocks, then the backend inside each node)"
                                                           : "flat"},
          {"iterations", ran ? json(per_iter.size()) : json(0)},
          {"warmup", o.warmup},
          {"validated", row_validated},
          {"max_rel_error", row_validated ? json(max_rel) : json(nullptr)},
          {"rel_l2_error", row_validated ? json(rel_l2) : json(nullptr)},
          {"mismatch_fraction", row_validated ? json(mismatch) : json(nullptr)},
          {"beyond_1ulp_fraction", row_validated ? json(beyond_ulp) : json(nullptr)},
          {"flat_combine", job.backend == "ll" || job.backend == kRaw ? json(nullptr) : json(flat_combine_name(job.flat_combine))},
          {"form", has_padded_form(job.backend) ? json(job.padded ? "padded" : "dynamic") : json(nullptr)},
          {"host_enqueue_us_p50", host_iter.empty() ? json(nullptr) : json(percentile(host_iter, 50))},
          {"host_enqueue_us_p90", host_iter.empty() ? json(nullptr) : json(percentile(host_iter, 90))},
          {"ratio_to_nccl_raw", nullptr},                        // padded rows: set below, against the twin
          {"prepare_plus_finalize_ratio_to_nccl_raw", nullptr},  // the same
          {"raw_calls", is_padded_raw(job.backend) ? json(padded_raw_plan(c, T, job, R).describe(op == "dispatch")) : json(nullptr)},
          {"remote_bytes_rank0", status == 0 && !is_raw(job.backend) && !one_token && !jr.ranks.empty() &&
                                         (op == "dispatch" ? jr.ranks[0].remote_bytes_dispatch : jr.ranks[0].remote_bytes_combine) >= 0
                                     ? json(op == "dispatch" ? jr.ranks[0].remote_bytes_dispatch : jr.ranks[0].remote_bytes_combine)
                                     : json(nullptr)},
          {"reference", row_validated ? json(reference)
                                      : json(is_raw(job.backend) ? "none: data movement only"
                                                                 : one_token ? "none: latency floor (same graphs, device-side T = 1)" : "none")},
          {"predicted_us", has_pred ? json(pred.predicted_us) : json(nullptr)},
          {"prediction", has_pred ? json(pred.derivation) : json(nullptr)},
          {"ratio_to_predicted", has_pred && ran ? json(p50 / pred.predicted_us) : json(nullptr)},
          {"status", status == 0 ? (validated && !passed ? "FAIL" : "ran") : status == 1 ? "unsupported" : "error"},
          {"kernel_time", kstate},
          {"kernel_us_p50", num(k50)},
          {"kernel_us_p90", num(k90)},
          {"kernel_us_mean", num(kmean)},
          {"kernel_us_p50_slowest_rank_per_iteration", kran ? num(kt::percentile_finite(kit, 50)) : json(nullptr)},
          {"kernel_span_us_p50", num(s50)},
          {"kernel_span_us_p90", num(s90)},
          {"kernel_us_p50_per_rank", kran ? kper_rank : json(nullptr)},
          {"kernel_gbps", num(kgbps)},
          {"kernels", kran ? kernels : json(nullptr)},
          {"kernel_iterations", kran ? json(kit.size()) : json(nullptr)},
          {"latency_us_p50_cupti_rounds", kran ? num(kt::percentile_finite(kevs, 50)) : json(nullptr)},
          {"kernel_records_dropped", kran ? json(kr0->dropped) : json(nullptr)},
      };
      if (is_raw(job.backend) && ran) row["moved_bytes_per_rank"] = moved;
      if (one_token) row["note"] = "1 token per rank: the fixed floor, the same captured graphs replayed with num_tokens = 1 on the device";
      if (!message.empty()) row["message"] = message;
      rows.push_back(row);
      const std::string label = job.backend + (job.padded && !is_raw(job.backend) ? " [padded]" : "");
      table << std::left << std::setw(7) << c.name << std::setw(9) << dtype_name(job.dtype) << std::setw(kBackendWidth)
            << (one_token ? label + " (T=1)" : label) << std::setw(9) << op << std::right << std::setw(10) << (ran ? fixed(p50, 1) : "-") << std::setw(10)
            << (ran ? fixed(percentile(per_iter, 10), 1) : "-") << std::setw(10) << (ran ? fixed(percentile(per_iter, 90), 1) : "-")
            << std::setw(9) << (one_token ? std::string("-") : fixed(gbps, 1)) << std::setw(11) << (has_pred ? fixed(pred.predicted_us, 0) : "-") << std::setw(7)
            << (has_pred && ran ? fixed(p50 / pred.predicted_us, 2) : "-") << std::setw(10) << fixed(k50, 1) << std::setw(10)
            << fixed(k90, 1) << std::setw(10) << fixed(s50, 1)
            << std::setw(8) << fixed(kgbps, 0) << "  " << std::left
            << (status == 1 ? "unsupported" : status == 2 ? "ERROR" : validated ? (passed ? "yes" : "FAIL") : "n/a")
            << "\n";
    }
    if (!message.empty()) table << "  " << job.backend << ": " << message << "\n";
  }
  // --padded: each padded row against its nccl_raw twin, timed in the same iterations (same case, dtype, op).
  std::ostringstream padded_lines;
  auto p50_of = [](const json& r) { return r["latency_us_p50"].is_number() ? r["latency_us_p50"].get<double>() : NAN; };
  auto twin_of = [&](const json& row, const std::string& op) -> const json* {
    for (const auto& raw : rows)
      if (raw["backend"] == std::string(kPaddedRawPrefix) + row["backend"].get<std::string>() && raw["case"] == row["case"] &&
          raw["dispatch_dtype"] == row["dispatch_dtype"] && raw["op"] == op && raw["tokens_per_rank"] == row["tokens_per_rank"])
        return &raw;
    return nullptr;
  };
  auto pair_of = [&](const json& row, const std::string& op) -> const json* {
    for (const auto& r : rows)
      if (r["backend"] == row["backend"] && r["form"] == row["form"] && r["case"] == row["case"] &&
          r["dispatch_dtype"] == row["dispatch_dtype"] && r["op"] == op && r["tokens_per_rank"] == row["tokens_per_rank"])
        return &r;
    return nullptr;
  };
  for (auto& row : rows) {
    if (row["form"] != "padded") continue;
    const json* raw = twin_of(row, row["op"]);
    const json* other = pair_of(row, row["op"] == "dispatch" ? "combine" : "dispatch");
    const json* raw_other = other ? twin_of(*other, (*other)["op"]) : nullptr;
    const double mine = p50_of(row), theirs = raw ? p50_of(*raw) : NAN;
    row["ratio_to_nccl_raw"] = std::isfinite(mine) && std::isfinite(theirs) && theirs > 0 ? json(mine / theirs) : json(nullptr);
    const double sum = other ? mine + p50_of(*other) : NAN, raw_sum = raw && raw_other ? theirs + p50_of(*raw_other) : NAN;
    row["prepare_plus_finalize_ratio_to_nccl_raw"] = std::isfinite(sum) && std::isfinite(raw_sum) && raw_sum > 0 ? json(sum / raw_sum) : json(nullptr);
    if (std::isfinite(mine) && std::isfinite(theirs)) {
      auto host = [&](const json& r) { return r["host_enqueue_us_p50"].is_number() ? fixed(r["host_enqueue_us_p50"].get<double>(), 1) : "-"; };
      padded_lines << "  " << row["case"].get<std::string>() << " " << row["dispatch_dtype"].get<std::string>() << " "
                   << row["backend"].get<std::string>() << " " << (row["op"] == "dispatch" ? "prepare " : "finalize") << ": p50 "
                   << fixed(mine, 1) << " us vs " << fixed(theirs, 1) << " us raw (" << fixed(mine / theirs, 2) << "x"
                   << (row["prepare_plus_finalize_ratio_to_nccl_raw"].is_number()
                           ? "; prepare + finalize " + fixed(row["prepare_plus_finalize_ratio_to_nccl_raw"].get<double>(), 2) + "x"
                           : std::string())
                   << "); host enqueue p50 " << host(row) << " us (raw " << host(*raw) << " us); raw: "
                   << (*raw)["raw_calls"].get<std::string>() << "\n";
    }
  }
  // Ratio to NCCL's raw all-to-all measured in the same run (same case, dispatch dtype, op, tokens).
  for (auto& row : rows) {
    if (is_raw(row["backend"].get<std::string>()) || row["latency_us_p50"].is_null()) continue;
    for (const auto& raw : rows)
      if (raw["backend"] == kRaw && raw["case"] == row["case"] && raw["dispatch_dtype"] == row["dispatch_dtype"] && raw["op"] == row["op"] &&
          raw["tokens_per_rank"] == row["tokens_per_rank"] && !raw["latency_us_p50"].is_null())
        row["speedup_vs_nccl_a2a_raw"] = raw["latency_us_p50"].get<double>() / row["latency_us_p50"].get<double>();
  }
  std::cout << "node layout: " << o.node_layout_for_report.describe()
            << (virtual_ranks ? std::string(" (virtual ranks: threads on one GPU)")
                              : " (NCCL LSA team " + std::to_string(o.node_layout_for_report.lsa_size) + ")")
            << "\n" << table.str() << kernel_lines.str();
  if (!padded_lines.str().empty())
    std::cout << "padded form against the raw collectives it makes (nccl_raw:<backend>, same iterations, order alternating):\n"
              << padded_lines.str();
  if (virtual_ranks)
    std::cout << virtual_ranks_note(R) << ": epx bench measures one GPU's memory, not NVLink; " << kRaw
              << (o.padded ? " and nccl_raw:<backend> are the virtual group's collectives" : " is the virtual group's all_to_allv")
              << " (copies on the GPU, no NCCL); no predictions (written for NVLink)\n";
  std::cout << "GB/s: bytes per rank (mean over ranks) / p50; accounting per case (ANCHORS.md): ";
  for (const BenchCase& c : cases) std::cout << c.name << " " << c.accounting << "  ";
  std::cout << "\nlatency: per iteration the slowest rank's, " << (cuda ? (o.graph ? "CUDA events around CUDA-graph replays" : "CUDA events") : "host clock") << ", after " << o.warmup
            << " warm-up iterations; expert step = identity (untimed)\n";
  if (kernel_state == "cupti")
    std::cout << "kernel time: CUPTI activity records (CONCURRENT_KERNEL) in " << o.iters
              << " separate iterations after the event ones; kern = sum of a call's kernel durations, span = first start to last end,"
                 " each rank's percentile, the largest over the ranks; kGB/s on kern p50\n";
  else if (!kernel_state.empty())
    std::cout << "kernel time: " << (kernel_state.rfind("unavailable: ", 0) == 0 ? "unavailable (" + kernel_state.substr(13) + ")" : kernel_state)
              << "\n";

  if (!o.json.empty()) {
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    ::gmtime_r(&now, &tm);
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json doc = {{"tool", "epx bench"},
                {"command", command},
                {"git_commit", git_commit()},
                {"date", date},
                {"device", cuda ? o.device_name_for_report : cpu_device_name()},
                {"nccl_version", cuda && !virtual_ranks ? json(nccl_version_string()) : json(nullptr)},
                {"ranks_per_gpu", ranks_per_gpu},
                {"epx_version", EPX_VERSION},
                {"results", std::move(rows)}};
    doc["config"] = config.describe();
    doc["node_layout"] = node_layout_json(o.node_layout_for_report);
    const auto parent = std::filesystem::path(o.json).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    std::ofstream f(o.json, std::ios::trunc);
    require_arg(kOp, "--json", o.json, f.good(), "must be a writable file path");
    f << doc.dump(2) << "\n";
    std::cout << "wrote " << o.json << "\n";
  }
  std::cout << "repro: " << command << "\n" << std::flush;
  return ok ? 0 : 1;
}

}  // namespace

std::vector<BenchCase> bench_cases() {
  return {
      {"ll-v3", 128, 7168, 8, 256, {DType::fp8_e4m3}, "deepep-ll"},
      {"ht-v3", 4096, 7168, 8, 256, {DType::fp8_e4m3, DType::bf16}, "deepep-ht"},
      {"ll-v4", 128, 7168, 6, 384, {DType::fp8_e4m3}, "deepep-ll"},
  };
}

Prediction predict(const std::string& case_name, DType dtype, const std::string& backend, const std::string& op, int ranks) {
  // bench/NOTES.md, 'NCCL host-collective backends on CUDA'; ranges
  // there, their midpoints here. 2 ranks only: nothing was written down for other R.
  if (ranks != 2) return {};
  const bool disp = op == "dispatch";
  if (case_name == "ll-v3" && dtype == DType::fp8_e4m3) {
    if (backend == kRaw) return {57, "ANCHORS: 1024 rows x 7168, 1-byte and bf16 both ~57 us (latency-bound)"};
    if (backend == "naive")
      return disp ? Prediction{80, "all-gather 0.95 MB fp8 ~20-30 us + host sync of T and routing ~15-30 us + mapping kernel: 60-100 us"}
                  : Prediction{80, "all-reduce of [256, 7168] bf16 (3.7 MB) ~40 us + host sync: 60-100 us"};
    if (backend == "allgather_reducescatter")
      return disp ? Prediction{80, "same gather as naive: 60-100 us"} : Prediction{40, "reduce-scatter moves half of naive's all-reduce: 30-50 us"};
    if (backend == "ll")  // bench/NOTES.md "LL kernels (issue 4)", graph replay
      return disp ? Prediction{9, "0.5 launch + ~2 send items + 0.95 MB remote at ~300 GB/s (overlapped) + 1.3 signal + ~3 expansion: 8-9 us"}
                  : Prediction{27, "7.3 MB of bf16 slot rows remote at ~350 GB/s (~21 us) + 1.3 signal + ~4 column-order reduction: 26-28 us"};
    if (backend == "all2allv")
      return disp ? Prediction{100, "host sync for per-destination counts + pack + grouped send/recv (~57 us like raw) + unpack: 80-120 us"}
                  : Prediction{75, "grouped send/recv of bf16 rows + unpack: 60-90 us"};
  }
  if (case_name == "ht-v3") {
    // bf16 figures from NOTES.md; fp8 dispatch scaled by its row bytes (7392 / 14336 = 0.52) on the
    // bandwidth part (written with this harness, before the run); combine is bf16 either way.
    const bool fp8 = dtype == DType::fp8_e4m3;
    if (backend == kRaw)
      return disp && fp8 ? Prediction{120, "4096 x 7392 B = 30 MB remote at ~291 GB/s (bf16 row of NOTES.md x 0.52)"}
                         : Prediction{225, "4096 x 14336 B = 58.7 MB remote at ~291 GB/s: 200-250 us"};
    if (backend == "ht")  // bench/NOTES.md "HT kernels": written before the first measurement
      return disp ? (fp8 ? Prediction{110, "~4055 remote rows x 7392 B = 30 MB at 362 GB/s (SM peer stores) = 83 us + layout/count exchange ~10 us + launches and the host read of N_recv ~15 us"}
                         : Prediction{180, "~4055 remote rows x 14336 B = 58 MB at 362 GB/s = 160 us + layout ~10 us + launches/host read ~10 us"})
                  : Prediction{250, "58 MB of partial rows at 362 GB/s = 160 us + handshake + local fp32 reduce of 8192 rows (176 MB of HBM traffic on the SM budget) ~80 us"};
    if (backend == "all2allv")
      return disp && fp8 ? Prediction{200, "~4096 remote rows of 7392 B (~105 us) + pack/unpack ~30 us + host sync + count exchange"}
                         : Prediction{350, "~4096 remote rows each way + pack/unpack HBM passes (~30 us) + host sync: 300-400 us"};
    if (backend == "naive" || backend == "allgather_reducescatter")
      return disp ? (fp8 ? Prediction{200, "dispatch like all2allv (fp8 rows)"} : Prediction{350, "dispatch like all2allv: 300-400 us"})
                  : Prediction{400, "reduce of [8192, 7168] bf16 = 117 MB at ~300 GB/s ~ 400 us"};
  }
  return {};
}

int run_bench(const BenchOptions& options, const std::string& command) {
  BenchOptions o = options;
  require_arg(kOp, "--ranks", o.ranks, o.ranks >= 1 && o.ranks <= 1024, "must be in [1, 1024]");
  require_arg(kOp, "--iters", o.iters, o.iters >= 1, "must be >= 1");
  require_arg(kOp, "--warmup", o.warmup, o.warmup >= 0, "must be >= 0");
  require_arg(kOp, "--tokens-per-rank", o.tokens_per_rank, o.tokens_per_rank >= 0, "must be >= 0 (0 = the case's)");
  require_writable_json(kOp, o.json);  // before the run, not after it
  if (!o.dtype.empty()) {
    const DType d = parse_dtype(o.dtype);
    require_arg(kOp, "--dtype", o.dtype, d == DType::bf16 || d == DType::fp8_e4m3, "must be bf16 or fp8");
  }
  const std::vector<BenchCase> all = bench_cases();
  std::vector<BenchCase> cases;
  std::string known;
  for (const BenchCase& c : all) known += (known.empty() ? "" : ", ") + c.name;
  for (const std::string& name : o.cases) {
    if (name == "all") {
      cases = all;
      break;
    }
    auto it = std::find_if(all.begin(), all.end(), [&](const BenchCase& c) { return c.name == name; });
    require_arg(kOp, "--case", name, it != all.end(), "must be one of {" + known + ", all}");
    cases.push_back(*it);
  }
  const Config config = o.config.empty() ? Config::load() : Config::load(o.config);
  bool cuda = o.device == "cuda";
  if (o.device == "auto") cuda = cuda::built_with_cuda() && cuda::device_count() >= o.ranks;
  CudaRanks where;  // --device cuda: one process per GPU, or virtual ranks on GPU 0 when fewer GPUs are visible
  if (cuda) {
    require_arg(kOp, "--device", o.device, cuda::built_with_cuda(), "this build has no CUDA (configure with -DEPX_CUDA=ON); use --device cpu");
    where = cuda_ranks_for(kOp, o.ranks);
  }
  require_arg(kOp, "--graph", "set", !o.graph || cuda, "needs --device cuda (CUDA graphs)");
  require_arg(kOp, "--padded", "set", !o.padded || !o.graph,
              "times eager calls and their host enqueue; it does not take --graph (the padded form's graph replays: epx moe --mode decode)");
  // on = kernel time or a failed run (auto reports 'unavailable' and goes on): refuse what cannot measure it.
  require_arg(kOp, "--kernel-time", o.kernel_time, o.kernel_time != "on" || cuda,
              "on needs --device cuda (the GPU durations of the calls' kernels); use auto or off with CPU ranks");
  require_arg(kOp, "--kernel-time", o.kernel_time, o.kernel_time != "on" || !where.virtual_ranks,
              "on needs one process per GPU (R <= visible GPUs = " + std::to_string(where.gpus) +
                  "): CUPTI's timer is one per process, and virtual ranks share one; use auto or off");
#ifndef EPX_WITH_CUPTI
  require_arg(kOp, "--kernel-time", o.kernel_time, o.kernel_time != "on",
              "on needs a build with CUPTI (CMake EPX_CUPTI=AUTO|ON finding CUDA::cupti, or EPX_CUPTI_ROOT); this build has "
              "none: use auto or off");
#endif
  const std::vector<Job> jobs = make_jobs(o, cases);
  const int R = o.ranks;
  std::cout << "epx bench: " << cases.size() << " case(s), " << jobs.size() << " (case, dtype, backend) jobs, " << R << " ranks on "
            << (!cuda ? "cpu (threads)" : where.virtual_ranks ? "cuda (virtual ranks: threads of one process on GPU 0)" : "cuda (one process per GPU)")
            << ", " << o.iters << " iterations after " << o.warmup << " warm-up, routing " << o.routing << "\n";
  if (cuda && where.virtual_ranks)
    std::cout << virtual_ranks_note(R) << ": epx bench measures one GPU's memory, not NVLink\n";
  std::cout << std::flush;

  if (!cuda) {
    std::vector<JobResult> results(jobs.size());
    for (size_t j = 0; j < jobs.size(); ++j) {
      results[j].job = jobs[j];
      results[j].ranks.resize(static_cast<size_t>(R));
    }
    auto groups = make_cpu_groups(R, config.timeout_s);
    run_ranks(groups, [&](int r) {
      run_jobs_on_rank(o, cases, jobs, groups[r], Stream{}, [&](size_t j, RankJobResult&& res) { results[j].ranks[r] = std::move(res); });
    });
    BenchOptions ro = o;
    ro.node_layout_for_report = groups[0]->node_layout();
    return report(ro, cases, jobs, results, false, R, config, command);
  }
#ifdef EPX_WITH_CUDA
  // One body per rank on its group, NCCL (one process per GPU) or virtual (threads on GPU 0).
  return launch_cuda_ranks(kOp, where, config, "epx-bench", [&](const std::shared_ptr<Group>& group) -> int {
    // The rank's own non-blocking stream: virtual ranks share one GPU, and the legacy stream would
    // serialise them behind each other's kernels that wait on peers.
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) throw CudaError("epx bench: cudaStreamCreate failed");
    std::vector<JobResult> results(jobs.size());
    try {
      run_jobs_on_rank(o, cases, jobs, group, Stream{stream}, [&](size_t j, RankJobResult&& res) {
        results[j].job = jobs[j];
        gather_to_rank0(*group, std::move(res), results[j]);
      });
      group->barrier();
    } catch (...) {
      (void)cudaStreamDestroy(stream);
      throw;
    }
    (void)cudaStreamDestroy(stream);  // every use was waited for (timer syncs, synchronous gathers)
    if (group->rank() != 0) return 0;  // rank 0 validates and reports after the others have left
    BenchOptions ro = o;
    ro.device_name_for_report = where.device_name();
    ro.ranks_per_gpu_for_report = where.ranks_per_gpu();
    ro.node_layout_for_report = group->node_layout();
    return report(ro, cases, jobs, results, true, R, config, command);
  });
#else
  return 1;
#endif
}

}  // namespace epx::cli
