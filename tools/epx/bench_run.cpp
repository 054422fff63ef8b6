// tools/epx/bench_run.cpp: `epx bench` (see bench_run.h): the jobs and their inputs, the padded-form
// plans, the gather of every rank's results to rank 0, the cases, the predictions and run_bench
// (bench_internal.h).
#include "bench_internal.h"

namespace epx::cli {

namespace bench_internal {

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

}  // namespace bench_internal

using namespace bench_internal;

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
