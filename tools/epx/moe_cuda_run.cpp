// tools/epx/moe_cuda_run.cpp: `epx moe --device cuda` (see moe_cuda_run.h).
#include "moe_cuda_run.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <thread>

#include "comm/launcher.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/routing.h"
#include "epx/trace.h"
#include "moe_checkpoint.h"
#include "moe_report.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "comm/group_virtual.h"
#endif

namespace epx::cli {

std::string nccl_version_string() {
  const int v = cuda::nccl_runtime_version();
  if (v <= 0) return "";
  return std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." + std::to_string(v % 100);
}

#ifndef EPX_WITH_CUDA

std::string gpu_device_name(int) { return ""; }
std::vector<std::string> gpu_topology_lines() { return {}; }

CudaRanks cuda_ranks_for(std::string_view op, int ranks) {
  require_arg(op, "--device", "cuda", false, "this build has no CUDA (configure with -DEPX_CUDA=ON)");
  return CudaRanks{ranks, 0, false};
}

int launch_cuda_ranks(std::string_view op, const CudaRanks&, const Config&, const std::string&,
                      const std::function<int(const std::shared_ptr<Group>&)>&) {
  throw Unsupported(std::string(op) + ": --device = cuda: this build has no CUDA (configure with -DEPX_CUDA=ON)");
}

int run_moe_cuda(const MoeOptions&, const Config&, const std::vector<std::string>&, bool, const std::string&) {
  throw Unsupported("epx moe: --device = cuda: this build has no CUDA (configure with -DEPX_CUDA=ON)");
}

#else

namespace {

constexpr std::string_view kOp = "epx moe";

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CudaError(std::string("epx moe: ") + what + ": " + cudaGetErrorString(e));
}

/// Rows [0, V_r) of each rank's tokens in one step: V_r = min(V, T_r) (V = 0: all).
std::vector<int64_t> validated_rows(const StepInput& st, int validate_tokens) {
  std::vector<int64_t> v;
  for (const Tensor& x : st.x) v.push_back(validate_tokens > 0 ? std::min<int64_t>(validate_tokens, x.size(0)) : x.size(0));
  return v;
}

/// One backend's measurements on this rank (rank 0: also everyone's validated rows).
struct RankBackendRun {
  BackendResult result;
  std::vector<Tensor> outputs;  ///< rank 0: per step, [sum_r V_r, H] bf16 (rank order)
};

/// The reference on the validated subset of every step: [sum_r V_r, H] bf16 per step. Builds the
/// experts those rows select on top of this rank's (add_random_experts), their fp32 caches in
/// parallel, then moe_reference_cpu, split by the path (fused or not) each token's chunk took.
/// What decides a run's reference on an fp8 wire: per token, fused (one rounding) or not, from the
/// mode and the layer's gate; a layer with the local shared slot rounds like the separate path.
struct RefKey {
  SharedExpertMode mode = SharedExpertMode::auto_gate;
  int64_t fhmoe_max_tokens = -1;
  int64_t local_slot_tokens = -1;
  int64_t graph_tokens = 0;  ///< T_max of a whole-layer graph (its paths were decided at capture), else 0
  bool operator==(const RefKey&) const = default;
};

std::vector<std::vector<Tensor>> subset_references(const Workload& w, const MoeOptions& o, const std::vector<RefKey>& modes) {
  const int64_t H = w.model.hidden;
  const int K = w.model.router.top_k, E = w.model.router.num_experts;
  struct Subset { Tensor x, idx, wts; std::vector<std::vector<char>> fused; };  // fused: per mode
  std::vector<Subset> subs;
  std::vector<char> touched(static_cast<size_t>(E), 0);
  for (const StepInput& st : w.steps) {
    const std::vector<int64_t> v = validated_rows(st, o.validate_tokens);
    std::vector<int64_t> rows;
    int64_t offset = 0;
    for (size_t r = 0; r < st.x.size(); ++r) {
      for (int64_t t = 0; t < v[r]; ++t) rows.push_back(offset + t);
      offset += st.x[r].size(0);
    }
    Subset s;
    s.x = gather_rows(concat_rows(st.x, DType::bf16, H), rows);
    const int64_t N = s.x.size(0);
    if (w.use_router) {
      Tensor logits = Tensor::empty({N, E}, DType::fp32);
      s.idx = Tensor::empty({N, K}, DType::int32);
      s.wts = Tensor::empty({N, K}, DType::fp32);
      router_logits_cpu(*w.weights, s.x, logits);
      route(w.model.router, logits, w.weights->correction_bias.view(), s.idx, s.wts);
    } else {
      s.idx = gather_rows(concat_rows(st.topk_idx, DType::int32, K), rows);
      s.wts = gather_rows(concat_rows(st.topk_weights, DType::fp32, K), rows);
    }
    for (const RefKey& key : modes) {
      s.fused.emplace_back();
      // bf16 wire: fused and separate references coincide (both round once); the local slot's rows round twice.
      if (w.model.num_shared_experts == 0 || (w.dispatch_dtype == DType::bf16 && key.local_slot_tokens < 0)) continue;
      Workload wm = w;  // shallow: tensors share storage
      wm.shared_mode = key.mode;
      const std::vector<char> all = fused_per_token(wm, st, key.fhmoe_max_tokens, key.local_slot_tokens, key.graph_tokens);
      for (int64_t t : rows) s.fused.back().push_back(all[static_cast<size_t>(t)]);
    }
    for (int64_t i = 0; i < N * K; ++i) {
      const int32_t e = s.idx.ptr<const int32_t>()[i];
      if (e >= 0 && e < E) touched[static_cast<size_t>(e)] = 1;
    }
    subs.push_back(std::move(s));
  }
  // Reference weights: this rank's experts plus the selected others, from the same seed.
  auto ref = std::make_shared<MoEWeights>(*w.weights);
  std::vector<int> ids;
  for (int e = 0; e < E; ++e)
    if (touched[static_cast<size_t>(e)]) ids.push_back(e);
  const auto t0 = std::chrono::steady_clock::now();
  add_workload_experts(o, *ref, ids);  // from the seed, or the --checkpoint
  // Dequantized fp32 copies, built in parallel (moe_reference_cpu would build them one by one).
  std::vector<const ExpertWeights*> need;
  for (int e : ids) need.push_back(ref->experts[static_cast<size_t>(e)].get());
  if (ref->shared) need.push_back(ref->shared.get());
  {
    const size_t nt = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, std::max<size_t>(need.size(), 1));
    std::vector<std::thread> threads;
    for (size_t t = 0; t < nt; ++t)
      threads.emplace_back([&, t] {
        for (size_t i = t; i < need.size(); i += nt) (void)need[i]->w13_f32();
      });
    for (auto& th : threads) th.join();
  }
  std::vector<std::vector<Tensor>> refs_per_mode;
  ReferenceOptions ro;
  ro.dispatch_dtype = w.dispatch_dtype;
  for (size_t mi = 0; mi < modes.size(); ++mi) {
    std::vector<Tensor>& refs = refs_per_mode.emplace_back();
    // Same routing and weights for every mode; the modes differ only in the fp8 wire's shared input.
    if (mi > 0 && subs.front().fused[mi].empty() && subs.front().fused.front().empty()) {
      refs = refs_per_mode.front();
      continue;
    }
    for (Subset& s : subs) {
      const int64_t N = s.x.size(0);
      Tensor out = Tensor::empty({N, H}, DType::bf16);
      std::vector<int64_t> rows[3];  // by path: separate, fused (one rounding each), local slot (two roundings)
      const std::vector<char>& fused = s.fused[mi];
      for (int64_t t = 0; t < N; ++t) rows[fused.empty() ? 0 : fused[static_cast<size_t>(t)]].push_back(t);
      for (int f = 0; f < 3; ++f) {
        ro.shared_fused = f == 1;
        ro.two_roundings = f == 2;
        if (rows[f].size() == static_cast<size_t>(N)) {
          moe_reference_cpu(*ref, s.x, s.idx, s.wts, out, ro);
        } else if (!rows[f].empty()) {
          Tensor part = Tensor::empty({static_cast<int64_t>(rows[f].size()), H}, DType::bf16);
          moe_reference_cpu(*ref, gather_rows(s.x, rows[f]), gather_rows(s.idx, rows[f]), gather_rows(s.wts, rows[f]), part, ro);
          for (size_t i = 0; i < rows[f].size(); ++i)
            std::memcpy(out.ptr<uint16_t>() + rows[f][i] * H, part.ptr<uint16_t>() + i * H, static_cast<size_t>(H * 2));
        }
      }
      refs.push_back(std::move(out));
    }
  }
  std::cerr << "reference: " << ids.size() << " experts, " << subs.size() << " steps, " << modes.size() << " shared mode(s) in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s\n";
  return refs_per_mode;
}

/// Runs one backend over all steps on this rank. Collective; every rank returns with the same
/// status (an exception on any rank reaches the others through the status all_gather or a
/// collective's timeout).
RankBackendRun run_backend_on_rank(const Workload& w, const MoeOptions& o, const std::string& backend,
                                   SharedExpertMode shared_mode, const std::shared_ptr<Group>& group, cudaStream_t stream, const std::vector<Tensor>& x_dev,
                                   const std::vector<Tensor>& idx_dev, const std::vector<Tensor>& wts_dev,
                                   std::vector<Tensor>& out_dev) {
  const int r = group->rank(), R = group->size();
  const int64_t H = w.model.hidden;
  const size_t S = w.steps.size();
  RankBackendRun run;
  BackendResult& res = run.result;
  res.backend = backend;
  std::vector<double> my_us(S, 0.0);
  std::vector<PhaseTimes> my_phases(S);
  int64_t status = 0;  // 0 ok, 1 unsupported, 2 error
  std::string message;
  DispatchConfig dcfg;
  dcfg.num_max_dispatch_tokens_per_rank = static_cast<int>(w.capacity);
  dcfg.dispatch_dtype = w.dispatch_dtype;
  dcfg.expert_contiguous = w.expert_contiguous && backend == "ht";  // (an ht option: the other backends run as without it)
  ModularMoEOptions mo;
  mo.shared_mode = shared_mode;
  mo.chunk_size = w.chunk_size;
  mo.time_phases = true;  // eager steps: five events per chunk, read after the step's end event
  res.shared_mode = shared_mode;
  PathCounters counters;
  try {
    ModularMoE layer(w.weights, group, backend, dcfg, w.config, mo);
    res.shared_sharded = layer.shared_expert_sharded();
    res.fhmoe_max_tokens = layer.fhmoe_max_tokens();
    res.shared_local_slot_tokens = layer.shared_local_slot_tokens();
    const Stream s{stream};
    // Decode: the whole layer as one CUDA graph on static buffers of T_max rows, refilled per step
    // (outside the timed region); the valid row count goes to the device. Else eager.
    const int64_t T_max = w.max_tokens_per_rank;
    std::optional<std::string> why_not;
    if (w.use_graph) why_not = layer.why_no_graph(T_max);
    const bool graph = w.use_graph && !why_not;
    if (why_not) res.graph_reason = *why_not;
    const int K = w.model.router.top_k;
    Tensor gx, gidx, gwts, gout, gcount;
    if (graph) {
      gx = Tensor::zeros({T_max, H}, DType::bf16, group->device());
      gout = Tensor::empty({T_max, H}, DType::bf16, group->device());
      gcount = Tensor::zeros({1}, DType::int32, group->device());
      if (!w.use_router) {
        gidx = Tensor::zeros({T_max, K}, idx_dev.front().dtype(), group->device());
        gwts = Tensor::zeros({T_max, K}, DType::fp32, group->device());
      }
    }
    // Refill the static buffers with step `step`'s rows (stream-ordered, before the timed region).
    auto stage = [&](size_t step) {
      const int64_t T = x_dev[step].size(0);
      const int32_t count = static_cast<int32_t>(T);
      cuda_ok(cudaMemcpyAsync(gcount.data(), &count, sizeof count, cudaMemcpyHostToDevice, stream), "stage num_tokens");
      if (T == 0) return;
      cuda_ok(cudaMemcpyAsync(gx.data(), x_dev[step].data(), static_cast<size_t>(x_dev[step].nbytes()), cudaMemcpyDeviceToDevice, stream), "stage x");
      if (!w.use_router) {
        cuda_ok(cudaMemcpyAsync(gidx.data(), idx_dev[step].data(), static_cast<size_t>(idx_dev[step].nbytes()), cudaMemcpyDeviceToDevice, stream), "stage topk_idx");
        cuda_ok(cudaMemcpyAsync(gwts.data(), wts_dev[step].data(), static_cast<size_t>(wts_dev[step].nbytes()), cudaMemcpyDeviceToDevice, stream), "stage topk_weights");
      }
      cuda_ok(cudaStreamSynchronize(stream), "stage");  // count lives on the host stack
    };
    auto unstage = [&](size_t step) {
      const int64_t bytes = out_dev[step].nbytes();
      if (bytes > 0) cuda_ok(cudaMemcpyAsync(out_dev[step].data(), gout.data(), static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream), "unstage out");
    };
    auto call = [&](size_t step, const TensorView& out) {
      if (graph) {
        layer.replay_graph(s);
        return;
      }
      if (w.use_router) layer.forward(x_dev[step], out, s);
      else layer.forward_routed(x_dev[step], idx_dev[step], wts_dev[step], out, s);
    };
    if (graph) {
      stage(0);
      layer.capture_graph(gx, gidx, gwts, gout, gcount, s);
      res.graph = true;
    }
    for (int i = 0; i < w.warmup; ++i) {
      const size_t st = static_cast<size_t>(i) % S;
      if (graph) stage(st);
      call(st, out_dev[st]);
    }
    cuda_ok(cudaStreamSynchronize(stream), "warm-up");
    const PathCounters before = layer.counters();
    const Tensor word = Tensor::zeros({1}, DType::fp32, group->device());
    cudaEvent_t e0, e1;
    cuda_ok(cudaEventCreate(&e0), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&e1), "cudaEventCreate");
    for (size_t st = 0; st < S; ++st) {
      // NaN-poison the output, so a row the layer never writes fails validation.
      cuda_ok(cudaMemsetAsync(out_dev[st].data(), 0xFF, static_cast<size_t>(out_dev[st].nbytes()), stream), "poison");
      if (graph) {
        cuda_ok(cudaMemsetAsync(gout.data(), 0xFF, static_cast<size_t>(gout.nbytes()), stream), "poison");
        stage(st);
      }
      // Barrier, then a one-float all-reduce on the stream: the GPUs start the step together
      // whatever the skew with which the hosts left the barrier.
      group->barrier();
      group->all_reduce_sum(word.data(), word.data(), 1, DType::fp32, s);
      cuda_ok(cudaEventRecord(e0, stream), "cudaEventRecord");
      call(st, out_dev[st]);
      cuda_ok(cudaEventRecord(e1, stream), "cudaEventRecord");
      if (graph) unstage(st);
      cuda_ok(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float ms = 0;
      cuda_ok(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
      my_us[st] = ms * 1e3;
      if (!graph) my_phases[st] = layer.last_phase_times();
      if (r == o.debug_kill_rank) {
        std::cerr << "epx moe: rank " << r << ": --debug-kill-rank: killing myself after step " << st << "\n";
        std::raise(SIGKILL);
      }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    counters = layer.counters();
    counters.calls -= before.calls;
    counters.chunks -= before.chunks;
    counters.idle_chunks -= before.idle_chunks;
    counters.shared_fused -= before.shared_fused;
    counters.shared_separate -= before.shared_separate;
    counters.shared_sharded -= before.shared_sharded;
    counters.graph_replays -= before.graph_replays;
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Unsupported& e) {
    status = 1;
    message = e.what();
  } catch (const std::exception& e) {
    status = 2;
    message = e.what();
  }
  // Agree on the outcome (throws if the group died with a peer).
  const std::vector<int64_t> statuses = group->all_gather_i64(status);
  int64_t worst = 0;
  int worst_rank = 0;
  for (int q = 0; q < R; ++q)
    if (statuses[q] > worst) worst = statuses[q], worst_rank = q;
  if (worst != 0) {
    res.status = worst == 1 ? "unsupported" : "error";
    res.message = status != 0 ? message : "rank " + std::to_string(worst_rank) + " failed (see its error on stderr)";
    if (status != 0 && R > 1) std::cerr << "epx moe: rank " << r << ": " << backend << ": " << message << "\n";
    return run;
  }
  // Latency per step: the slowest rank's.
  res.step_us.assign(S, 0.0);
  for (size_t st = 0; st < S; ++st) {
    const std::vector<int64_t> ns = group->all_gather_i64(static_cast<int64_t>(my_us[st] * 1e3));
    for (int64_t v : ns) res.step_us[st] = std::max(res.step_us[st], static_cast<double>(v) * 1e-3);
  }
  // Phase times per step: each phase's slowest rank (eager steps only).
  bool any_phases = false;
  for (const PhaseTimes& p : my_phases) any_phases = any_phases || p.chunks > 0;
  bool all_phases = true;  // every rank timed its steps (same decision everywhere: no collective mismatch)
  for (int64_t v : group->all_gather_i64(any_phases ? 1 : 0)) all_phases = all_phases && v == 1;
  if (all_phases) {
    for (size_t st = 0; st < S; ++st) {
      const PhaseTimes& p = my_phases[st];
      PhaseTimes m;
      m.chunks = p.chunks;
      double* dst[4] = {&m.prepare_us, &m.experts_us, &m.finalize_us, &m.shared_us};
      const double src[4] = {p.prepare_us, p.experts_us, p.finalize_us, p.shared_us};
      for (int k = 0; k < 4; ++k)
        for (int64_t v : group->all_gather_i64(static_cast<int64_t>(src[k] * 1e3))) *dst[k] = std::max(*dst[k], static_cast<double>(v) * 1e-3);
      res.phases.push_back(m);
    }
  }
  res.counters = counters;
  // Validated rows to rank 0.
  for (size_t st = 0; st < S; ++st) {
    const std::vector<int64_t> v = validated_rows(w.steps[st], o.validate_tokens);
    std::vector<int64_t> bytes(static_cast<size_t>(R));
    int64_t total = 0;
    for (int q = 0; q < R; ++q) total += (bytes[q] = v[q] * H * 2);
    Tensor mine = Tensor::empty({v[r], H}, DType::bf16);
    if (v[r] > 0) copy(mine, out_dev[st].view().slice_rows(0, v[r]));
    Tensor all = Tensor::empty({total / (H * 2), H}, DType::bf16);
    group->all_gatherv(mine.data(), all.data(), bytes);
    if (r == 0) run.outputs.push_back(std::move(all));
  }
  res.status = "ran";
  return run;
}

/// One rank of `epx moe --device cuda`, on its group (NCCL or virtual: launch_cuda_ranks). Rank 0
/// validates and reports after the others returned; returns the exit code (0 on the other ranks).
int moe_rank(const MoeOptions& options, const Config& config, const std::vector<std::string>& backends, bool all_backends,
             const std::string& command, const CudaRanks& where, const std::shared_ptr<Group>& group) {
  const int r = group->rank(), R = group->size();
  // This rank's experts only (full-size presets hold 10^10 weights over all experts).
  const MoEConfig model = workload_model(options);
  const ExpertRange range = expert_range(model.router.num_experts, R, r);
  MoeOptions o = options;
  o.expert_begin = range.begin;
  o.expert_end = range.end;
  const auto t_build = std::chrono::steady_clock::now();
  Workload w = build_workload(o, config);
  w.device_name = where.device_name();
  w.nodes = group->node_layout();
  w.has_nodes = true;
  w.nccl_version = where.nccl_version();
  w.ranks_per_gpu = where.ranks_per_gpu();
  if (r == 0) {
    print_header(std::cout, w);
    std::cout << std::flush;
    std::cerr << "rank 0: workload and experts [" << range.begin << ", " << range.end << ") built in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - t_build).count() << " s\n";
  }
  const size_t S = w.steps.size();
  const int64_t H = w.model.hidden;
  const Device dev = group->device();
  std::vector<Tensor> x_dev, idx_dev, wts_dev, out_dev;
  for (size_t st = 0; st < S; ++st) {
    const StepInput& in = w.steps[st];
    x_dev.push_back(in.x[r].to(dev));
    if (!w.use_router) {
      idx_dev.push_back(in.topk_idx[r].to(dev));
      wts_dev.push_back(in.topk_weights[r].to(dev));
    }
    out_dev.push_back(Tensor::empty({in.x[r].size(0), H}, DType::bf16, dev));
  }
  // The rank's own non-blocking stream (virtual ranks share one GPU: the legacy stream would
  // serialise them behind each other's kernels that wait on peers).
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<RankBackendRun> runs;
  const std::vector<RunVariant> variants = run_variants(w, backends, o.compare);
  try {
    for (const RunVariant& v : variants) {
      const auto t0 = std::chrono::steady_clock::now();
      runs.push_back(run_backend_on_rank(w, o, v.backend, v.shared_mode, group, stream, x_dev, idx_dev, wts_dev, out_dev));
      if (r == 0)
        std::cerr << v.backend << " [" << shared_mode_name(v.shared_mode) << "]: " << runs.back().result.status << " ("
                  << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)\n";
    }
    group->barrier();
  } catch (...) {
    (void)cudaStreamDestroy(stream);
    throw;
  }
  (void)cudaStreamDestroy(stream);  // every use above was waited for (events, synchronous copies)
  if (r != 0) return 0;  // rank 0 validates and reports after the others have left

  // ---- rank 0: validate the gathered rows against the reference on the same subset ----
  bool any_ran = false;
  for (const auto& run : runs) any_ran = any_ran || run.result.status == "ran";
  std::vector<RefKey> modes;  // one reference per distinct key among the runs
  auto key_of = [&](const BackendResult& r) {
    return RefKey{r.shared_mode, r.fhmoe_max_tokens, r.shared_local_slot_tokens, r.graph ? w.max_tokens_per_rank : 0};
  };
  for (const auto& run : runs)
    if (run.result.status == "ran" && std::find(modes.begin(), modes.end(), key_of(run.result)) == modes.end())
      modes.push_back(key_of(run.result));
  std::vector<std::vector<Tensor>> refs_per_mode;
  if (any_ran) refs_per_mode = subset_references(w, o, modes);
  std::vector<BackendResult> results;
  for (auto& run : runs) {
    BackendResult res = run.result;
    if (res.status == "ran") {
      const size_t mi = static_cast<size_t>(std::find(modes.begin(), modes.end(), key_of(res)) - modes.begin());
      const std::vector<Tensor>& refs = refs_per_mode[mi];
      bool ok = true;
      int64_t validated = 0;
      for (size_t st = 0; st < S; ++st) {
        validated += refs[st].size(0);
        if (!check_step(run.outputs[st], refs[st], st, res)) ok = false;
      }
      res.validated = true;
      res.validated_tokens = validated;
      res.status = ok ? "pass" : "FAIL";
    }
    results.push_back(std::move(res));
  }
  print_table(std::cout, w, results);
  if (!o.json.empty()) {
    write_results_json(o.json, command, w, results);
    std::cout << "wrote " << o.json << "\n";
  }
  std::cout << "repro: " << command << "\n" << std::flush;
  for (const BackendResult& res : results) {
    if (res.status == "pass") continue;
    if (res.status == "unsupported" && all_backends) continue;
    return 1;
  }
  return 0;
}

}  // namespace

std::string CudaRanks::device_name() const { return gpu_device_name(virtual_ranks ? 1 : ranks); }

std::string CudaRanks::nccl_version() const { return virtual_ranks ? std::string() : nccl_version_string(); }

CudaRanks cuda_ranks_for(std::string_view op, int ranks) {
  CudaRanks where;
  where.ranks = ranks;
  where.gpus = cuda::device_count();
  require_arg(op, "--ranks", ranks, ranks >= 1, "must be >= 1");
  require_arg(op, "--device", "cuda", where.gpus >= 1, "no GPU is visible to this process");
  where.virtual_ranks = ranks > where.gpus;
  require_arg(op, "--ranks", ranks, !where.virtual_ranks || ranks <= comm::kMaxVirtualRanks,
              "must be <= the visible GPUs = " + std::to_string(where.gpus) + " (one process per GPU) or <= " +
                  std::to_string(comm::kMaxVirtualRanks) + " (virtual ranks: threads on one GPU)");
  return where;
}

int launch_cuda_ranks(std::string_view op, const CudaRanks& where, const Config& config, const std::string& tag,
                      const std::function<int(const std::shared_ptr<Group>&)>& body) {
  const int R = where.ranks;
  auto set_device = [op](int device) {
    const cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess)
      throw CudaError(std::string(op) + ": cudaSetDevice(" + std::to_string(device) + "): " + cudaGetErrorString(e));
  };
  comm::LaunchOptions lo;
  lo.tag = tag;
  lo.reporter_rank = 0;
  lo.grace_s = std::min(10.0, config.timeout_s);
  if (!where.virtual_ranks) {
    lo.num_ranks = R;
    const comm::LaunchResult lr = comm::launch_ranks(lo, [&](const comm::RankEnv& env) {
      set_device(env.rank);
      auto group = make_nccl_group(env.rendezvous_path, env.rank, env.world, env.rank, config.timeout_s);
      return body(group);
    });
    if (!lr.failure.empty()) std::cerr << "epx: error: " << op << ": " << lr.failure << "\n";
    return lr.exit_code;
  }
  // Virtual ranks: one child (this process stays without CUDA, like the launcher's parent), R threads.
  lo.num_ranks = 1;
  const comm::LaunchResult lr = comm::launch_ranks(lo, [&](const comm::RankEnv&) -> int {
    const std::vector<std::shared_ptr<Group>> groups = make_virtual_cuda_groups(R, 0, config.timeout_s);
    std::vector<int> codes(static_cast<size_t>(R), 0);
    try {
      run_ranks(groups, [&](int rank) {
        try {
          const std::shared_ptr<Group>& group = groups[static_cast<size_t>(rank)];
          set_device(group->device().index);
          codes[static_cast<size_t>(rank)] = body(group);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "epx: rank %d: error: %s\n", rank, e.what());
          throw;
        }
      });
    } catch (const InvalidArgument&) {
      return 2;
    } catch (const std::exception&) {
      return 1;
    }
    for (int q = 1; q < R; ++q)
      if (codes[static_cast<size_t>(q)] != 0) return codes[static_cast<size_t>(q)];
    return codes[0];
  });
  if (!lr.failure.empty() && !lr.ranks.empty()) {
    const comm::RankExit& e = lr.ranks[0];
    const char* name = e.exited ? nullptr : ::strsignal(e.signal);
    std::cerr << "epx: error: " << op << ": the process of the " << R << " virtual ranks "
              << (e.exited ? "exited with status " + std::to_string(e.exit_code)
                           : "was killed by signal " + std::to_string(e.signal) + " (" + (name ? name : "?") + ")")
              << "\n";
  }
  return lr.exit_code;
}

std::string gpu_device_name(int num_gpus) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return std::to_string(num_gpus) + " x CUDA device";
  return std::to_string(num_gpus) + " x " + prop.name;
}

std::vector<std::string> gpu_topology_lines() {
  std::vector<std::string> lines;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return lines;
  }
  char buf[512];
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    char bus[32] = "?";
    (void)cudaDeviceGetPCIBusId(bus, sizeof bus, i);
    std::snprintf(buf, sizeof buf, "cuda:%d  %s  %.1f GiB  sm_%d%d  %d SMs  PCI %s", i, p.name,
                  static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0), p.major, p.minor, p.multiProcessorCount, bus);
    lines.emplace_back(buf);
  }
  if (n < 2) return lines;
  // Peer matrix: X self; NV = P2P access with native atomics (NVLink-class); PCI = P2P access
  // without native atomics; -- = no P2P. The number is cudaDevP2PAttrPerformanceRank (0 = best).
  std::string header = "peers    ";
  for (int j = 0; j < n; ++j) header += "  cuda:" + std::to_string(j) + std::string(j < 10 ? " " : "");
  lines.push_back(header);
  for (int i = 0; i < n; ++i) {
    std::string row = "cuda:" + std::to_string(i) + std::string(i < 10 ? "   " : "  ");
    for (int j = 0; j < n; ++j) {
      std::string cell = "X";
      if (i != j) {
        int access = 0, atomics = 0, rank = 0;
        (void)cudaDeviceCanAccessPeer(&access, i, j);
        (void)cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, i, j);
        (void)cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, i, j);
        cell = !access ? "--" : (atomics ? "NV" : "PCI") + std::to_string(rank);
      }
      row += "  " + cell + std::string(cell.size() < 7 ? 7 - cell.size() : 0, ' ');
    }
    lines.push_back(row);
  }
  lines.emplace_back("(X self, NV<rank> P2P with native atomics: NVLink-class, PCI<rank> P2P without, -- no P2P; <rank> = P2P performance rank, 0 best)");
  (void)cudaGetLastError();
  return lines;
}

int run_moe_cuda(const MoeOptions& options, const Config& config, const std::vector<std::string>& backends, bool all_backends,
                 const std::string& command) {
  int R = options.ranks;
  if (!options.trace.empty()) R = load_trace(options.trace).num_ranks;
  const CudaRanks where = cuda_ranks_for(kOp, R);
  require_arg(kOp, "--validate-tokens", options.validate_tokens, options.validate_tokens >= 0, "must be >= 0 (0 = all)");
  require_arg(kOp, "--debug-kill-rank", options.debug_kill_rank, options.debug_kill_rank < R, "must be < ranks");
  require_arg(kOp, "--debug-kill-rank", options.debug_kill_rank, options.debug_kill_rank < 0 || !where.virtual_ranks,
              "kills a rank's process: it needs one process per rank (R <= visible GPUs), not virtual ranks");
  // Flags and shapes are checked here, before any rank starts (no experts built: cheap).
  {
    MoeOptions probe = options;
    probe.expert_begin = probe.expert_end = 0;
    (void)build_workload(probe, config);
  }
  return launch_cuda_ranks(kOp, where, config, "epx-moe", [&](const std::shared_ptr<Group>& group) {
    return moe_rank(options, config, backends, all_backends, command, where, group);
  });
}

#endif  // EPX_WITH_CUDA

}  // namespace epx::cli
