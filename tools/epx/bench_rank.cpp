// tools/epx/bench_rank.cpp: `epx bench`, the per-rank run loop (bench_internal.h): each job's timed
// rounds on one rank (eager, CUDA-graph replays, the raw collectives, the --kernel-time rounds).
#include "bench_internal.h"

namespace epx::cli::bench_internal {

namespace {

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

}  // namespace

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

}  // namespace epx::cli::bench_internal
