// dispatch/ht/ht_cuda_test.cpp: the ht backend on CUDA (ht_cuda.h) against HtCpu (ht.h) on CPU ranks with
// the same inputs: every prepare output (x, x_scales, local topk_idx, topk_weights, recv_count, N_recv),
// the handle (rank prefix matrix, is_token_in_rank, recv_src_idx, per-expert counts), the stats, and
// every finalize output, bit for bit. Multi-rank cases run through tests/cuda_ranks.h run_cuda_ranks:
// one forked process per GPU where the machine has enough GPUs, else R virtual ranks (threads) on GPU 0;
// at 2 ranks, and at 4 and 8 ranks on small shapes where a case takes a rank count.
//
// Inputs: fresh random tokens (never zeros). On 2 ranks ht-v3 (H 7168, E 256, top-8) and hidden 2048;
// T per rank in {0, 1, 4095, 4096, 8192}; uniform and Zipf routing; bf16 and fp8 (incl. UE8M0); -1
// selections, duplicate experts, the shared route, int64 ids, expert_alignment > 1, the
// expert-contiguous layout. On 2, 4 and 8 ranks small shapes (hidden 256..1024, capacity 8..128) with
// T in {0, 1, 7, 128} differing between ranks and between rounds, the same features. Three rounds per
// object: A, then A's routing with new tokens (the cached layout must be reused: one cache hit), then
// a new routing. The experts step is replaced by a deterministic random expert_out [N_recv, H] (a
// function of case, round and rank), the same on both sides, so combine is checked exactly. Device
// outputs are poisoned before each call.
// Also, at 2, 4 and 8 ranks: worst-case sizing (use_worst_case_sizing) eagerly and under CUDA-graph
// capture and replay (replays with new inputs, the first equal to the eager call on the same inputs),
// the device token count under one graph (T per replay and rank, 0 included), and bad arguments (a bad
// id, an oversized T: InvalidArgument on every rank naming the rank, object usable after). On 1 rank: the
// device token count. Ranks out of step and the caller's Config: ht_ranks_cuda_test.cpp; the harness and
// the cases: ht_cuda_testing.h.
// Rank bodies work on their own cudaStreamNonBlocking stream and wait on it or on the legacy stream,
// never on the whole device between multi-rank calls (cuda_ranks.h), and never touch the environment
// (set before run_cuda_ranks).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>  // setenv (the test bodies' callers only)
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_ranks.h"
#include "test_util.h"
#include "dispatch/ht/ht.h"
#include "dispatch_harness.h"
#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "forked_ranks.h"

using namespace epx;
using namespace epx::test;

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "dispatch/hier/hier.h"
#include "dispatch/ht/ht_cuda.h"
#include "dispatch/ht/ht_cuda_testing.h"

namespace {

// ---- worst-case sizing, eagerly and under a CUDA graph ---------------------------------------------

/// The graph case: bf16, expert_out = the received x itself (a device copy inside the graph), so the
/// combine output is known from HtCpu with the same "experts". T per rank is fixed (the captured shapes)
/// and differs between ranks.
struct GraphCase {
  Case c;
  Rounds rounds;
  std::vector<std::vector<Snapshot>> want;
};

GraphCase make_graph_case(int R) {
  GraphCase g;
  Case& c = g.c;
  c.R = R;
  c.E = 32;
  c.K = 4;
  c.H = R == 2 ? 2048 : 1024;
  c.cap = R == 2 ? 512 : 128;
  c.T = R == 2 ? std::vector<int64_t>{500, 512} : per_rank(R, {128, 7, 0, 1});
  c.dtype = DType::bf16;
  c.masked = 0.2;
  c.zipf = 1.1;
  c.seed = 77;
  c.flat_combine = FlatCombine::partial_bf16;  // the received bf16 x is the experts' output: the two-roundings opt-in
  const auto a = make_inputs(c);
  Case c2 = c;
  c2.seed = 78;
  auto b = make_inputs(c2);
  Case c3 = c;
  c3.seed = 79;
  auto a_again = make_inputs(c3);
  for (int r = 0; r < c.R; ++r) {  // same routing as a, new tokens: the cached layout inside the graph
    a_again[static_cast<size_t>(r)].topk_idx = a[static_cast<size_t>(r)].topk_idx;
    a_again[static_cast<size_t>(r)].topk_weights = a[static_cast<size_t>(r)].topk_weights;
  }
  g.rounds = {a, b, a_again, b};
  auto groups = make_cpu_groups(c.R, 60.0);
  g.want.assign(g.rounds.size(), std::vector<Snapshot>(static_cast<size_t>(c.R)));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize("ht", groups[static_cast<size_t>(r)], c.config());
    for (size_t i = 0; i < g.rounds.size(); ++i) {
      const RankInput& ri = g.rounds[i][static_cast<size_t>(r)];
      Snapshot& s = g.want[i][static_cast<size_t>(r)];
      const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      take_prepare(p, s);
      Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      pf->finalize({p.x, out});
      s.out = host_bytes(out);
      s.stats = pf->stats();
    }
  });
  return g;
}

/// Worst-case sizing on one object: an eager prepare + experts copy + finalize on round 0's inputs (against
/// HtCpu), then the same three steps captured in one graph and replayed once per round with new inputs
/// (against HtCpu; the first replay, on round 0's inputs, also against the eager call).
std::string run_graph(const GraphCase& gc, const std::shared_ptr<Group>& g, cudaStream_t stream) {
  const Case& c = gc.c;
  const int r = g->rank();
  const Device dev = g->device();
  DispatchConfig cfg = c.config();
  cfg.use_worst_case_sizing = true;
  auto pf = make_prepare_finalize("ht", g, cfg);
  if (!pf->capabilities().graph_safe) return "worst-case ht does not report graph_safe; ";
  const int64_t T = c.tokens(r), rows = static_cast<int64_t>(c.R) * c.cap;
  const Tensor x = Tensor::empty({T, c.H}, DType::bf16, dev);
  const Tensor idx = Tensor::empty({T, c.K}, DType::int32, dev), w = Tensor::empty({T, c.K}, DType::fp32, dev);
  const Tensor eo = Tensor::empty({rows, c.H}, DType::bf16, dev), out = Tensor::empty({T, c.H}, DType::bf16, dev);
  // Round i's inputs into the captured buffers, out poisoned (legacy-stream copies, waited for).
  auto load = [&](size_t i) {
    const RankInput& ri = gc.rounds[i][static_cast<size_t>(r)];
    copy(x, ri.x);
    copy(idx, ri.topk_idx);
    copy(w, ri.topk_weights);
    poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison out");
  };
  // What the call on `p` left (after the stream), compared with `want`; "" when equal.
  auto check = [&](const PrepareResult& p, const Snapshot& want, Snapshot& got) {
    int32_t n = -1;
    cuda_ok(cudaMemcpy(&n, p.num_recv_tokens_device.data, 4, cudaMemcpyDeviceToHost), "read N_recv");
    std::string d;
    if (n != want.num_recv_tokens) d += "N_recv " + std::to_string(n) + ", want " + std::to_string(want.num_recv_tokens) + "; ";
    got.num_recv_tokens = n;
    const int64_t N = std::min<int64_t>(std::max(n, 0), rows);
    got.x = host_bytes(p.x.slice_rows(0, N));
    got.topk_idx = host_bytes(p.topk_idx.slice_rows(0, N));
    got.topk_weights = host_bytes(p.topk_weights.slice_rows(0, N));
    got.recv_count = host_bytes(p.recv_count);
    got.out = host_bytes(out);
    d += first_diff("x", got.x, want.x) + first_diff("topk_idx", got.topk_idx, want.topk_idx) +
         first_diff("topk_weights", got.topk_weights, want.topk_weights) + first_diff("recv_count", got.recv_count, want.recv_count) +
         first_diff("out", got.out, want.out);
    const std::vector<uint8_t> pad = host_bytes(p.topk_idx.slice_rows(N, rows));
    for (size_t j = 0; j < pad.size(); ++j)
      if (pad[j] != 0xFF) {
        d += "topk_idx beyond N_recv is not -1 at byte " + std::to_string(j) + "; ";
        break;
      }
    return d;
  };
  std::string failures;
  // Eager, on round 0's inputs.
  load(0);
  g->barrier();
  const PrepareResult pe = pf->prepare({x, idx, w, Stream{stream}});
  if (pe.num_recv_tokens != rows)
    failures += "eager worst-case num_recv_tokens " + std::to_string(pe.num_recv_tokens) + ", want " + std::to_string(rows) + "; ";
  cuda_ok(cudaMemcpyAsync(eo.data(), pe.x.data, static_cast<size_t>(rows * c.H * 2), cudaMemcpyDeviceToDevice, stream), "experts copy");
  pf->finalize({eo, out, Stream{stream}});
  cuda_ok(cudaStreamSynchronize(stream), "eager sync");
  Snapshot eager;
  const std::string de = check(pe, gc.want[0][static_cast<size_t>(r)], eager);
  if (!de.empty()) failures += "eager worst-case call rank " + std::to_string(r) + ": " + de + "\n";
  // The same steps in one graph.
  cudaGraph_t graph = nullptr;
  PrepareResult p;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  p = pf->prepare({x, idx, w, Stream{stream}});
  cuda_ok(cudaMemcpyAsync(eo.data(), p.x.data, static_cast<size_t>(rows * c.H * 2), cudaMemcpyDeviceToDevice, stream), "experts copy");
  pf->finalize({eo, out, Stream{stream}});
  cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  if (p.num_recv_tokens != rows) return "worst-case num_recv_tokens " + std::to_string(p.num_recv_tokens) + ", want " + std::to_string(rows) + "; ";
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (size_t i = 0; i < gc.rounds.size(); ++i) {
    load(i);
    cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
    cuda_ok(cudaStreamSynchronize(stream), "graph sync");
    Snapshot got;
    std::string d = check(p, gc.want[i][static_cast<size_t>(r)], got);
    if (i == 0) {  // the eager call's inputs: the replay must equal it
      if (got.num_recv_tokens != eager.num_recv_tokens)
        d += "N_recv " + std::to_string(got.num_recv_tokens) + ", eager " + std::to_string(eager.num_recv_tokens) + "; ";
      d += first_diff("x vs eager", got.x, eager.x) + first_diff("topk_idx vs eager", got.topk_idx, eager.topk_idx) +
           first_diff("topk_weights vs eager", got.topk_weights, eager.topk_weights) +
           first_diff("recv_count vs eager", got.recv_count, eager.recv_count) + first_diff("out vs eager", got.out, eager.out);
    }
    if (!d.empty()) failures += "graph replay " + std::to_string(i) + " rank " + std::to_string(r) + ": " + d + "\n";
  }
  // The stats of the last replay, from the device record.
  const DispatchStats& st = pf->stats();
  const DispatchStats& want_st = gc.want.back()[static_cast<size_t>(r)].stats;
  if (st.num_valid_selections != want_st.num_valid_selections || st.num_rank_dedup_rows != want_st.num_rank_dedup_rows)
    failures += "worst-case stats {" + std::to_string(st.num_valid_selections) + ", " + std::to_string(st.num_rank_dedup_rows) + "} on rank " +
                std::to_string(r) + ", want {" + std::to_string(want_st.num_valid_selections) + ", " + std::to_string(want_st.num_rank_dedup_rows) +
                "} (not refreshed from the device record?); ";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  if (r == 0)
    std::printf("graph: eager call + %zu replays (worst-case sizing, %lld rows) %s\n", gc.rounds.size(), static_cast<long long>(rows),
                failures.empty() ? "bit-exact vs HtCpu, first replay equal to the eager call" : "DIFFER");
  std::fflush(stdout);
  return failures;
}

/// Device token count (DispatchArgs::num_tokens) under one captured graph: x / topk_* buffers of
/// cap rows, a different T per replay and rank (0 and cap included), rows beyond T hold stale tokens of
/// an earlier replay; out rows beyond T must stay untouched (poison).
struct DeviceTCase {
  Case c;
  Rounds rounds;  // [replay][rank], x with T rows of that replay
  std::vector<std::vector<Snapshot>> want;
};

DeviceTCase make_device_t_case(int R) {
  DeviceTCase g;
  Case& c = g.c;
  c.R = R;
  c.E = 32;
  c.K = 4;
  c.H = R <= 2 ? 1024 : 512;
  c.cap = R <= 2 ? 256 : 128;
  c.dtype = DType::fp8_e4m3;
  c.masked = 0.1;
  c.zipf = 1.2;
  c.flat_combine = FlatCombine::partial_fp32;
  std::vector<std::vector<int64_t>> Ts;
  if (R <= 2) {  // R = 1: 256, 0, 1, 130
    for (const std::vector<int64_t>& t : std::vector<std::vector<int64_t>>{{256, 200}, {0, 17}, {1, 256}, {130, 0}})
      Ts.emplace_back(t.begin(), t.begin() + R);
  } else {
    Ts = {per_rank(R, {128, 7, 0, 1}), per_rank(R, {0, 1, 128, 7}), per_rank(R, {1, 0, 7, 128}), per_rank(R, {7, 128, 1, 0})};
  }
  for (size_t i = 0; i < Ts.size(); ++i) {
    Case ci = c;
    ci.T = Ts[i];
    ci.seed = 300 + i;
    g.rounds.push_back(make_inputs(ci));
  }
  auto groups = make_cpu_groups(c.R, 60.0);
  g.want.assign(g.rounds.size(), std::vector<Snapshot>(static_cast<size_t>(c.R)));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize("ht", groups[static_cast<size_t>(r)], c.config());
    for (size_t i = 0; i < g.rounds.size(); ++i) {
      const RankInput& ri = g.rounds[i][static_cast<size_t>(r)];
      Snapshot& s = g.want[i][static_cast<size_t>(r)];
      const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      take_prepare(p, s);
      Tensor eo = expert_out_for(p.num_recv_tokens, c.H, eo_seed(c, i, r), eo_dtype(c, false));
      Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      pf->finalize({eo, out});
      s.out = host_bytes(out);
    }
  });
  return g;
}

std::string run_device_t(const DeviceTCase& dc, const std::shared_ptr<Group>& g, cudaStream_t stream) {
  const Case& c = dc.c;
  const int r = g->rank();
  const Device dev = g->device();
  DispatchConfig cfg = c.config();
  cfg.use_worst_case_sizing = true;
  auto pf = make_prepare_finalize("ht", g, cfg);
  const int64_t cap = c.cap, rows = static_cast<int64_t>(c.R) * cap;
  const Tensor x = Tensor::empty({cap, c.H}, DType::bf16, dev), idx = Tensor::empty({cap, c.K}, DType::int32, dev),
               w = Tensor::empty({cap, c.K}, DType::fp32, dev), nt = Tensor::zeros({1}, DType::int32, dev);
  const Tensor eo = Tensor::empty({rows, c.H}, eo_dtype(c, false), dev), out = Tensor::empty({cap, c.H}, DType::bf16, dev);
  poison_device(x.data(), static_cast<size_t>(x.nbytes()), "x", 0);
  poison_device(idx.data(), static_cast<size_t>(idx.nbytes()), "idx", 0);  // expert 0 everywhere: stale rows that would move
  poison_device(w.data(), static_cast<size_t>(w.nbytes()), "w", 0);
  g->barrier();
  cudaGraph_t graph = nullptr;
  PrepareResult p;
  DispatchArgs a{x, idx, w, Stream{stream}};
  a.num_tokens = nt;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  p = pf->prepare(a);
  pf->finalize({eo, out, Stream{stream}});
  cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  std::string failures;
  for (size_t i = 0; i < dc.rounds.size(); ++i) {
    const RankInput& ri = dc.rounds[i][static_cast<size_t>(r)];
    const Snapshot& want = dc.want[i][static_cast<size_t>(r)];
    const int64_t T = ri.x.size(0);
    if (T > 0) {
      upload_device(x.data(), ri.x.data(), static_cast<size_t>(ri.x.nbytes()), "x");
      upload_device(idx.data(), ri.topk_idx.data(), static_cast<size_t>(ri.topk_idx.nbytes()), "idx");
      upload_device(w.data(), ri.topk_weights.data(), static_cast<size_t>(ri.topk_weights.nbytes()), "w");
    }
    const int32_t t32 = static_cast<int32_t>(T);
    upload_device(nt.data(), &t32, 4, "num_tokens");
    // The experts' stand-in: the same random rows as HtCpu's, in the first N_recv rows (known from the CPU).
    const int64_t N = want.num_recv_tokens;
    if (N > 0) {
      const Tensor e = expert_out_for(N, c.H, eo_seed(c, i, r), eo_dtype(c, false));
      upload_device(eo.data(), e.data(), static_cast<size_t>(e.nbytes()), "eo");
    }
    poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison");
    g->barrier();
    cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
    cuda_ok(cudaStreamSynchronize(stream), "graph sync");
    int32_t n = -1;
    cuda_ok(cudaMemcpy(&n, p.num_recv_tokens_device.data, 4, cudaMemcpyDeviceToHost), "read N_recv");
    std::string d;
    if (n != N) d += "N_recv " + std::to_string(n) + ", want " + std::to_string(N) + "; ";
    const int64_t Ng = std::min<int64_t>(std::max(n, 0), rows);
    d += first_diff("x", host_bytes(p.x.slice_rows(0, Ng)), want.x) + first_diff("x_scales", host_bytes(p.x_scales.slice_rows(0, Ng)), want.x_scales) +
         first_diff("topk_idx", host_bytes(p.topk_idx.slice_rows(0, Ng)), want.topk_idx) +
         first_diff("recv_count", host_bytes(p.recv_count), want.recv_count) + first_diff("out", host_bytes(out.view().slice_rows(0, T)), want.out);
    const std::vector<uint8_t> beyond = host_bytes(out.view().slice_rows(T, cap));
    for (size_t j = 0; j < beyond.size(); ++j)
      if (beyond[j] != 0xFF) {
        d += "out row " + std::to_string(T + static_cast<int64_t>(j) / (2 * c.H)) + " >= num_tokens was written; ";
        break;
      }
    if (!d.empty()) failures += "device-T replay " + std::to_string(i) + " (T = " + std::to_string(T) + ") rank " + std::to_string(r) + ": " + d + "\n";
  }
  // A device count above x.shape[0]: nothing moved, InvalidArgument from the next call's finalize, after its
  // launch (never from a prepare, where one rank would stop alone before a launch its peers wait for).
  const int32_t too_many = static_cast<int32_t>(cap + 1 + r);
  upload_device(nt.data(), &too_many, 4, "num_tokens");
  cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
  cuda_ok(cudaStreamSynchronize(stream), "graph sync");
  // The next call is a good one (T = 1): its own layout must not erase the bad replay's verdict before the host
  // reads it (the record keeps the last bad layout until the next bad one).
  const int32_t one = 1;
  upload_device(nt.data(), &one, 4, "num_tokens");
  std::string what, where = "no call";
  try {
    where = "prepare";
    pf->prepare(a);
    // The good call's layout has completed (and rewritten the record) before the host reads it: without the
    // kept verdict this check fails every time, not only when the host happens to be early.
    cuda_ok(cudaStreamSynchronize(stream), "sync prepare");
    where = "finalize";
    pf->finalize({eo, out, Stream{stream}});
    where = "no call";
  } catch (const InvalidArgument& e) {
    what = where + ": " + e.what();
  }
  if (what.rfind("finalize: ", 0) != 0 || what.find("num_tokens = " + std::to_string(too_many)) == std::string::npos)
    failures += "device num_tokens " + std::to_string(too_many) + " on rank " + std::to_string(r) + ": '" + what + "'; ";
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  if (r == 0) std::printf("device num_tokens: %zu graph replays, T per replay varies: %s\n", dc.rounds.size(), failures.empty() ? "bit-exact vs HtCpu" : "DIFFER");
  std::fflush(stdout);
  return failures;
}

// ---- errors --------------------------------------------------------------------------------------

/// Bad arguments on one rank reach every rank: a bad id on rank 1, T > capacity on rank 0 (InvalidArgument
/// on every rank, the others naming the rank); the object is usable after; a finalize with the wrong rows.
std::string check_errors(const std::shared_ptr<Group>& g, cudaStream_t stream) {
  const int r = g->rank(), R = g->size();
  const Device dev = g->device();
  Case c;
  c.R = R;
  c.E = std::max(8, 2 * R);
  c.K = 2;
  c.H = 256;
  c.cap = 32;
  c.T = per_rank(R, {20, 32});
  c.seed = 5;
  c.flat_combine = FlatCombine::partial_fp32;  // DispatchConfig's default: finalize takes fp32 partials
  const auto in = make_inputs(c);
  auto pf = make_prepare_finalize("ht", g, c.config());
  const RankInput& ri = in[static_cast<size_t>(r)];
  const Tensor x = ri.x.to(dev), w = ri.topk_weights.to(dev);
  std::string failures;
  // A bad id on rank 1: InvalidArgument everywhere, naming the entry on rank 1 and rank 1 elsewhere.
  Tensor bad = ri.topk_idx;
  if (r == 1) {
    bad = Tensor::empty({ri.x.size(0), c.K}, DType::int32);
    std::memcpy(bad.data(), ri.topk_idx.data(), static_cast<size_t>(bad.nbytes()));
    bad.ptr<int32_t>()[c.K * 3 + 1] = c.E + 3;
  }
  std::string what;
  try {
    pf->prepare({x, bad.to(dev), w, Stream{stream}});
  } catch (const InvalidArgument& e) {
    what = e.what();
  }
  if ((r == 1 && what.find("topk_idx[3, 1]") == std::string::npos) || (r != 1 && what.find("rank 1") == std::string::npos))
    failures += "bad id: rank " + std::to_string(r) + " threw '" + what + "'; ";
  if (r == 0) std::printf("bad id: %s\n", what.c_str());
  // T > capacity on rank 0.
  const Tensor big_x = Tensor::empty({40, c.H}, DType::bf16, dev), big_i = Tensor::zeros({40, c.K}, DType::int32, dev),
               big_w = Tensor::zeros({40, c.K}, DType::fp32, dev);
  what.clear();
  try {
    if (r == 0) pf->prepare({big_x, big_i, big_w, Stream{stream}});
    else pf->prepare({x, ri.topk_idx.to(dev), w, Stream{stream}});
  } catch (const InvalidArgument& e) {
    what = e.what();
  }
  if ((r == 0 && what.find("num_tokens = 40") == std::string::npos) || (r != 0 && what.find("rank 0") == std::string::npos))
    failures += "T > capacity: rank " + std::to_string(r) + " threw '" + what + "'; ";
  if (r == 0) std::printf("T > capacity: %s\n", what.c_str());
  // Still usable.
  const PrepareResult p = pf->prepare({x, ri.topk_idx.to(dev), w, Stream{stream}});
  const Tensor eo = Tensor::zeros({p.num_recv_tokens, c.H}, DType::fp32, dev), out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16, dev);
  pf->finalize({eo, out, Stream{stream}});
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  // A finalize with the wrong expert_out rows: InvalidArgument on this rank, before anything moves
  // (every rank makes the same mistake, so none waits).
  what.clear();
  try {
    const Tensor eo_bad = Tensor::zeros({p.num_recv_tokens + 1, c.H}, DType::fp32, dev);
    pf->finalize({eo_bad, out, Stream{stream}});
  } catch (const InvalidArgument& e) {
    what = e.what();
  }
  if (what.find("expert_out.shape[0]") == std::string::npos) failures += "finalize rows: '" + what + "'; ";
  // bf16 partials to an object on partial_fp32: InvalidArgument naming the dtype and the mode.
  what.clear();
  try {
    const Tensor eo_bf16 = Tensor::zeros({p.num_recv_tokens, c.H}, DType::bf16, dev);
    pf->finalize({eo_bf16, out, Stream{stream}});
  } catch (const InvalidArgument& e) {
    what = e.what();
  }
  if (what.find("expert_out.dtype") == std::string::npos || what.find("partial_fp32") == std::string::npos)
    failures += "finalize bf16 expert_out on partial_fp32: '" + what + "'; ";
  // Combine weights need the expert-contiguous layout (Flat rows come weighted from the experts).
  what.clear();
  try {
    FinalizeArgs fa{eo, out, Stream{stream}};
    fa.topk_weights = p.topk_weights;
    pf->finalize(fa);
  } catch (const InvalidArgument& e) {
    what = e.what();
  }
  if (what.find("topk_weights") == std::string::npos) failures += "finalize topk_weights without expert_contiguous: '" + what + "'; ";
  return failures;
}

/// Every case of R ranks (the full-size ones on 2 ranks, the small ones on 2, 4 and 8), then the graph,
/// device-T and error checks on the same ranks.
void run_world(int R, double deadline_s) {
  say_where(R);
  std::vector<HtCase> cases = R == 2 ? make_cases() : std::vector<HtCase>{};
  for (HtCase& hc : make_small_cases(R)) cases.push_back(std::move(hc));
  for (HtCase& hc : cases) hc.want = run_cpu(hc.c, hc.rounds, hc.contig);
  const GraphCase gc = make_graph_case(R);
  const DeviceTCase dc = make_device_t_case(R);
  const std::string failed = run_cuda_ranks(R, deadline_s, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    std::string failures;
    for (const HtCase& hc : cases) {
      const auto got = run_gpu(hc.c, hc.rounds, hc.contig, g, stream);
      std::string case_failures;  // this case only (the summary line is per case)
      for (size_t i = 0; i < got.size(); ++i) {
        const std::string d = compare(got[i], hc.want[i][static_cast<size_t>(rank)]);
        if (!d.empty()) case_failures += "round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + hc.c.describe() + ": " + d + "\n";
      }
      failures += case_failures;
      if (rank == 0)
        std::printf("ht%s %s: N_recv %lld/%lld/%lld, cache hits %lld: %s\n", hc.contig ? " expert_contiguous" : "",
                    hc.c.describe().c_str(), static_cast<long long>(got[0].num_recv_tokens), static_cast<long long>(got[1].num_recv_tokens),
                    static_cast<long long>(got[2].num_recv_tokens), static_cast<long long>(got[2].cache_hits),
                    case_failures.empty() ? "bit-exact vs HtCpu (rank 0)" : "DIFFER");
      std::fflush(stdout);  // a later hang or timeout must not lose the lines before it
    }
    failures += run_graph(gc, g, stream);
    failures += run_device_t(dc, g, stream);
    failures += check_errors(g, stream);
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

}  // namespace

// The device token count under one graph, and the worst-case bad-count verdict kept until the host reads it
// (a later good call's layout must not erase it), on one rank.
TEST(HtCuda, DeviceTokenCountOneRank) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU";
  const DeviceTCase dc = make_device_t_case(1);
  const std::string failed = run_cuda_ranks(1, 200.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    throw_failures(rank, run_device_t(dc, g, rs.s));
  });
  EXPECT_EQ(failed, "");
}

TEST(HtCuda, MatchesHtCpuTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(2, 500.0);
}

TEST(HtCuda, MatchesHtCpuFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(4, 200.0);
}

TEST(HtCuda, MatchesHtCpuEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(8, 200.0);
}

#else
TEST(HtCuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }
#endif
