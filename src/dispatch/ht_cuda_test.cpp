// dispatch/ht_cuda_test.cpp: the ht backend on CUDA (ht_cuda.h) on 2 forked ranks against HtCpu
// (ht.h) on CPU ranks with the same inputs: every prepare output (x, x_scales, local topk_idx,
// topk_weights, recv_count, N_recv), the handle (rank prefix matrix, is_token_in_rank, recv_src_idx,
// per-expert counts), the stats, and every finalize output, bit for bit.
//
// Inputs: fresh random tokens (never zeros); ht-v3 (H 7168, E 256, top-8) and hidden 2048; T per
// rank in {0, 1, 4095, 4096, 8192}; uniform and Zipf routing; bf16 and fp8 (incl. UE8M0); -1
// selections, duplicate experts, the shared route, int64 ids, expert_alignment > 1. Three rounds
// per object: A, then A's routing with new tokens (the cached layout must be reused: one cache hit),
// then a new routing. The experts step is replaced by a deterministic random expert_out [N_recv, H]
// (a function of case, round and rank), the same on both sides, so combine is checked exactly.
// Device outputs are poisoned before each call. Also: worst-case sizing under CUDA-graph capture and
// replay (three replays with new inputs), a bad id and an oversized T (InvalidArgument on every
// rank, object usable after), and a silent peer (Timeout naming it, no hang).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dispatch/ht.h"
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

#include "dispatch/hier.h"
#include "dispatch/ht_cuda.h"

namespace {

template <class T>
std::vector<uint8_t> vec_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

struct Snapshot {
  int64_t num_recv_tokens = -1;
  std::vector<uint8_t> x, x_scales, topk_idx, topk_weights, recv_count, out;
  std::vector<uint8_t> prefix, in_rank, src_idx, per_expert;
  // expert-contiguous layout; out2 = the unweighted finalize (out: weighted with topk_weights)
  int64_t contig_rows = -1;
  std::vector<uint8_t> cx, cscales, coffsets, crow_expert, cpair_row, out2;
  int64_t cache_hits = 0;
  DispatchStats stats;
};

void take_prepare(const PrepareResult& p, Snapshot& s) {
  s.num_recv_tokens = p.num_recv_tokens;
  s.contig_rows = p.contiguous.num_rows;
  s.cx = host_bytes(p.contiguous.x);
  s.cscales = host_bytes(p.contiguous.x_scales);
  s.coffsets = host_bytes(p.contiguous.expert_offsets);
  s.crow_expert = host_bytes(p.contiguous.row_expert);
  s.cpair_row = host_bytes(p.contiguous.pair_row);
  s.x = host_bytes(p.x);
  s.x_scales = host_bytes(p.x_scales);
  s.topk_idx = host_bytes(p.topk_idx);
  s.topk_weights = host_bytes(p.topk_weights);
  s.recv_count = host_bytes(p.recv_count);
}

/// Deterministic stand-in for the experts: [N, H] bf16 values in +-[2^-8, 2) with random bits from
/// (seed, index) (splitmix64: ~20x cheaper than a normal draw, and these rows are hundreds of MB).
Tensor expert_out_for(int64_t N, int64_t H, uint64_t seed) {
  Tensor t = Tensor::empty({N, H}, DType::bf16);
  uint16_t* p = t.ptr<uint16_t>();
  for (int64_t i = 0; i < N * H; ++i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    // sign, exponent 119..127 (2^-8 .. 2^0), 7 mantissa bits
    p[i] = static_cast<uint16_t>(((z & 1) << 15) | ((119 + (z >> 1) % 9) << 7) | ((z >> 8) & 0x7F));
  }
  return t;
}

using Rounds = std::vector<std::vector<RankInput>>;  // [round][rank]

struct HtCase {
  Case c;
  bool contig = false;  ///< DispatchConfig::expert_contiguous (finalize weighted, then unweighted)
  Rounds rounds;
  std::vector<std::vector<Snapshot>> want;  // [round][rank]
};

uint64_t eo_seed(const Case& c, size_t round, int rank) { return c.seed * 7919 + round * 131 + static_cast<uint64_t>(rank) + 5; }

/// How run_cpu / run_gpu drive an object. twice: a Flat object is finalized twice per prepare (the
/// second time with other expert_out rows, into Snapshot::out2; expert_contiguous always finalizes
/// twice). late_rank: that rank sleeps late_ms on the host before its first finalize of every round,
/// so its peer runs ahead (on the GPU only; HtCpu is synchronous).
struct Drive {
  bool twice = false;
  int late_rank = -1;
  int late_ms = 0;
};

/// expert_out seed of the second Flat finalize (Drive::twice).
uint64_t eo_seed2(const Case& c, size_t round, int rank) { return eo_seed(c, round, rank) + 0x5EED; }

DispatchConfig config_of(const Case& c, bool contig) {
  DispatchConfig cfg = c.config();
  cfg.expert_contiguous = contig;
  return cfg;
}

std::vector<std::vector<Snapshot>> run_cpu(const Case& c, const Rounds& rounds, bool contig, const Drive& drive = {}) {
  auto groups = make_cpu_groups(c.R, 120.0);
  std::vector<std::vector<Snapshot>> snaps(rounds.size(), std::vector<Snapshot>(static_cast<size_t>(c.R)));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize("ht", groups[static_cast<size_t>(r)], config_of(c, contig));
    auto* ht = dynamic_cast<dispatch::HtCpu*>(pf.get());
    if (!ht) throw std::runtime_error("ht on CPU is not HtCpu");
    for (size_t i = 0; i < rounds.size(); ++i) {
      const RankInput& ri = rounds[i][static_cast<size_t>(r)];
      Snapshot& s = snaps[i][static_cast<size_t>(r)];
      const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      take_prepare(p, s);
      const dispatch::HtHandle& h = ht->handle();
      s.prefix = vec_bytes(h.rank_prefix_matrix);
      s.in_rank = vec_bytes(h.is_token_in_rank);
      s.src_idx = vec_bytes(h.recv_src_idx);
      s.per_expert = vec_bytes(h.num_recv_tokens_per_expert);
      s.cache_hits = h.layout_cache_hits;
      const Tensor eo = expert_out_for(contig ? s.contig_rows : s.num_recv_tokens, c.H, eo_seed(c, i, r));
      Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      poison(out);
      FinalizeArgs fa{eo, out};
      if (contig) fa.topk_weights = p.topk_weights;
      pf->finalize(fa);
      s.out = host_bytes(out);
      if (contig) {
        poison(out);
        pf->finalize({eo, out});
        s.out2 = host_bytes(out);
      } else if (drive.twice) {
        const Tensor eo2 = expert_out_for(s.num_recv_tokens, c.H, eo_seed2(c, i, r));
        poison(out);
        pf->finalize({eo2, out});
        s.out2 = host_bytes(out);
      }
      s.stats = pf->stats();
    }
  });
  return snaps;
}

std::string compare(const Snapshot& got, const Snapshot& want) {
  std::string d;
  if (got.num_recv_tokens != want.num_recv_tokens)
    d += "num_recv_tokens " + std::to_string(got.num_recv_tokens) + ", want " + std::to_string(want.num_recv_tokens) + "; ";
  d += first_diff("x", got.x, want.x);
  d += first_diff("x_scales", got.x_scales, want.x_scales);
  d += first_diff("topk_idx", got.topk_idx, want.topk_idx);
  d += first_diff("topk_weights", got.topk_weights, want.topk_weights);
  d += first_diff("recv_count", got.recv_count, want.recv_count);
  d += first_diff("out", got.out, want.out);
  if (got.contig_rows != want.contig_rows)
    d += "contiguous.num_rows " + std::to_string(got.contig_rows) + ", want " + std::to_string(want.contig_rows) + "; ";
  d += first_diff("contiguous.x", got.cx, want.cx);
  d += first_diff("contiguous.x_scales", got.cscales, want.cscales);
  d += first_diff("contiguous.expert_offsets", got.coffsets, want.coffsets);
  d += first_diff("contiguous.row_expert", got.crow_expert, want.crow_expert);
  d += first_diff("contiguous.pair_row", got.cpair_row, want.cpair_row);
  d += first_diff("out (unweighted)", got.out2, want.out2);
  d += first_diff("rank_prefix_matrix", got.prefix, want.prefix);
  d += first_diff("is_token_in_rank", got.in_rank, want.in_rank);
  d += first_diff("recv_src_idx", got.src_idx, want.src_idx);
  d += first_diff("num_recv_tokens_per_expert", got.per_expert, want.per_expert);
  if (got.cache_hits != want.cache_hits)
    d += "layout_cache_hits " + std::to_string(got.cache_hits) + ", want " + std::to_string(want.cache_hits) + "; ";
  const DispatchStats& a = got.stats;
  const DispatchStats& b = want.stats;
  if (a.num_valid_selections != b.num_valid_selections || a.num_rank_dedup_rows != b.num_rank_dedup_rows ||
      a.remote_bytes_dispatch != b.remote_bytes_dispatch || a.remote_bytes_combine != b.remote_bytes_combine)
    d += "stats {" + std::to_string(a.num_valid_selections) + ", " + std::to_string(a.num_rank_dedup_rows) + ", " +
         std::to_string(a.remote_bytes_dispatch) + ", " + std::to_string(a.remote_bytes_combine) + "}, want {" +
         std::to_string(b.num_valid_selections) + ", " + std::to_string(b.num_rank_dedup_rows) + ", " +
         std::to_string(b.remote_bytes_dispatch) + ", " + std::to_string(b.remote_bytes_combine) + "}; ";
  return d;
}

std::vector<HtCase> make_cases() {
  struct Spec {
    int64_t H;
    DType dtype;
    bool ue8m0;
    int E, K, cap;
    std::vector<int64_t> T;
    double zipf, masked;
    bool shared, dups, idx64;
    int align;
    bool contig = false;
  };
  const std::vector<Spec> specs = {
      {7168, DType::fp8_e4m3, false, 256, 8, 4096, {4096, 4096}, 0.0, 0.05, false, false, false, 1},   // ht-v3 fp8
      {7168, DType::bf16, false, 256, 8, 4096, {4095, 1}, 1.2, 0.1, false, true, true, 1},            // ht-v3 bf16, Zipf
      {2048, DType::fp8_e4m3, true, 256, 8, 8192, {8192, 0}, 1.1, 0.2, false, false, false, 128},     // UE8M0, aligned
      {2048, DType::bf16, false, 64, 6, 16, {0, 0}, 0.0, 0.0, false, false, false, 1},                 // nobody sends
      {7168, DType::bf16, false, 256, 9, 4096, {1, 4096}, 0.0, 0.1, true, true, false, 32},            // shared route
      {2048, DType::fp8_e4m3, false, 16, 4, 8192, {8192, 8192}, 1.5, 0.3, false, true, true, 1},       // skewed, small E
      {2048, DType::bf16, false, 3, 2, 300, {300, 299}, 0.0, 0.2, false, false, false, 1},             // a rank holds 1 expert
      {2048, DType::fp8_e4m3, false, 256, 8, 2048, {2048, 2047}, 1.2, 0.1, false, true, false, 128, true},  // expert-contiguous, Zipf
      {7168, DType::bf16, false, 64, 6, 1024, {1000, 1}, 0.0, 0.1, true, true, true, 32, true},        // expert-contiguous, shared
      {2048, DType::bf16, false, 16, 4, 64, {0, 0}, 0.0, 0.0, false, false, false, 8, true},            // expert-contiguous, empty
      {7168, DType::fp8_e4m3, false, 256, 8, 8192, {8192, 1}, 1.2, 0.05, false, false, false, 1},      // ht-v3 fp8, Zipf, T = 8192 / 1
  };
  std::vector<HtCase> cases;
  uint64_t seed = 41;
  for (const Spec& sp : specs) {
    HtCase g;
    g.contig = sp.contig;
    Case& c = g.c;
    c.R = 2;
    c.E = sp.E;
    c.K = sp.K;
    c.H = sp.H;
    c.cap = sp.cap;
    c.T = sp.T;
    c.dtype = sp.dtype;
    c.ue8m0 = sp.ue8m0;
    c.shared = sp.shared;
    c.dups = sp.dups;
    c.idx64 = sp.idx64;
    c.masked = sp.masked;
    c.zipf = sp.zipf;
    c.align = sp.align;
    c.seed = seed++;
    const std::vector<RankInput> a = make_inputs(c);
    Case c2 = c;
    c2.seed = c.seed + 1000;
    std::vector<RankInput> a2 = make_inputs(c2);  // new tokens, A's routing
    for (int r = 0; r < c.R; ++r) {
      a2[static_cast<size_t>(r)].topk_idx = a[static_cast<size_t>(r)].topk_idx;
      a2[static_cast<size_t>(r)].topk_weights = a[static_cast<size_t>(r)].topk_weights;
    }
    Case c3 = c;
    c3.seed = c.seed + 2000;
    g.rounds = {a, a2, make_inputs(c3)};
    cases.push_back(std::move(g));
  }
  return cases;
}

std::vector<Snapshot> run_gpu(const Case& c, const Rounds& rounds, bool contig, const std::shared_ptr<Group>& g, cudaStream_t stream,
                              const Drive& drive = {}) {
  const int r = g->rank();
  const Device dev = g->device();
  auto pf = make_prepare_finalize("ht", g, config_of(c, contig));
  auto* ht = dynamic_cast<dispatch::HtCuda*>(pf.get());
  if (!ht) throw std::runtime_error("ht on CUDA is not HtCuda");
  std::vector<Snapshot> snaps(rounds.size());
  for (size_t i = 0; i < rounds.size(); ++i) {
    const RankInput& ri = rounds[i][static_cast<size_t>(r)];
    const int64_t T = ri.x.size(0);
    const Tensor x = ri.x.to(dev), idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
    const PrepareResult p = pf->prepare({x, idx, w, Stream{stream}});
    cuda_ok(cudaStreamSynchronize(stream), "sync after prepare");
    Snapshot& s = snaps[i];
    take_prepare(p, s);
    const dispatch::HtDeviceHandle& h = ht->handle();
    s.prefix = host_bytes(h.rank_prefix_matrix);
    s.in_rank = host_bytes(h.is_token_in_rank);
    s.src_idx = host_bytes(h.recv_src_idx);
    s.per_expert = host_bytes(h.num_recv_tokens_per_expert);
    s.cache_hits = h.layout_cache_hits;
    const Tensor eo = expert_out_for(contig ? s.contig_rows : s.num_recv_tokens, c.H, eo_seed(c, i, r)).to(dev);
    const Tensor out = Tensor::empty({T, c.H}, DType::bf16, dev);
    test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison out");
    FinalizeArgs fa{eo, out, Stream{stream}};
    if (contig) fa.topk_weights = p.topk_weights;
    if (r == drive.late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(drive.late_ms));
    pf->finalize(fa);
    cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
    s.out = host_bytes(out);
    if (contig || drive.twice) {
      const Tensor eo2 = contig ? eo : expert_out_for(s.num_recv_tokens, c.H, eo_seed2(c, i, r)).to(dev);
      test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison out");
      pf->finalize({eo2, out, Stream{stream}});
      cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
      s.out2 = host_bytes(out);
    }
    s.stats = pf->stats();
  }
  return snaps;
}

// ---- worst-case sizing under a CUDA graph -----------------------------------------------------------

/// The graph case: bf16, expert_out = the received x itself (a device copy inside the graph), so the
/// combine output is known from HtCpu with the same "experts".
struct GraphCase {
  Case c;
  Rounds rounds;
  std::vector<std::vector<Snapshot>> want;
};

GraphCase make_graph_case() {
  GraphCase g;
  Case& c = g.c;
  c.R = 2;
  c.E = 32;
  c.K = 4;
  c.H = 2048;
  c.cap = 512;
  c.T = {500, 512};
  c.dtype = DType::bf16;
  c.masked = 0.2;
  c.zipf = 1.1;
  c.seed = 77;
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
    }
  });
  return g;
}

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
  copy(x, gc.rounds[0][static_cast<size_t>(r)].x);
  copy(idx, gc.rounds[0][static_cast<size_t>(r)].topk_idx);
  copy(w, gc.rounds[0][static_cast<size_t>(r)].topk_weights);
  g->barrier();
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
  std::string failures;
  for (size_t i = 0; i < gc.rounds.size(); ++i) {
    const RankInput& ri = gc.rounds[i][static_cast<size_t>(r)];
    copy(x, ri.x);
    copy(idx, ri.topk_idx);
    copy(w, ri.topk_weights);
    cuda_ok(cudaMemset(out.data(), 0xFF, static_cast<size_t>(out.nbytes())), "poison");
    cuda_ok(cudaDeviceSynchronize(), "sync inputs");
    cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
    cuda_ok(cudaStreamSynchronize(stream), "graph sync");
    const Snapshot& want = gc.want[i][static_cast<size_t>(r)];
    int32_t n = -1;
    cuda_ok(cudaMemcpy(&n, p.num_recv_tokens_device.data, 4, cudaMemcpyDeviceToHost), "read N_recv");
    std::string d;
    if (n != want.num_recv_tokens) d += "N_recv " + std::to_string(n) + ", want " + std::to_string(want.num_recv_tokens) + "; ";
    const int64_t N = std::min<int64_t>(std::max(n, 0), rows);
    Snapshot got;
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
    if (!d.empty()) failures += "graph replay " + std::to_string(i) + " rank " + std::to_string(r) + ": " + d + "\n";
  }
  const DispatchStats& st = pf->stats();
  if (st.num_rank_dedup_rows <= 0 && T > 0) failures += "worst-case stats not refreshed from the device record; ";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  if (r == 0) std::printf("graph: %zu replays (worst-case sizing, %lld rows) %s\n", gc.rounds.size(), static_cast<long long>(rows),
                          failures.empty() ? "bit-exact vs HtCpu" : "DIFFER");
  std::fflush(stdout);
  return failures;
}

/// Device token count (DispatchArgs::num_tokens) under one captured graph: x / topk_* buffers of
/// cap rows, a different T per replay (0 and cap included), rows beyond T hold stale tokens of an
/// earlier replay; out rows beyond T must stay untouched (poison).
struct DeviceTCase {
  Case c;
  Rounds rounds;  // [replay][rank], x with T rows of that replay
  std::vector<std::vector<Snapshot>> want;
};

DeviceTCase make_device_t_case(int R = 2) {
  DeviceTCase g;
  Case& c = g.c;
  c.R = R;
  c.E = 32;
  c.K = 4;
  c.H = 1024;
  c.cap = 256;
  c.dtype = DType::fp8_e4m3;
  c.masked = 0.1;
  c.zipf = 1.2;
  const std::vector<std::vector<int64_t>> Ts = {{256, 200}, {0, 17}, {1, 256}, {130, 0}};
  for (size_t i = 0; i < Ts.size(); ++i) {
    Case ci = c;
    ci.T = std::vector<int64_t>(Ts[i].begin(), Ts[i].begin() + R);  // R = 1: 256, 0, 1, 130
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
      Tensor eo = expert_out_for(p.num_recv_tokens, c.H, eo_seed(c, i, r));
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
  const Tensor eo = Tensor::empty({rows, c.H}, DType::bf16, dev), out = Tensor::empty({cap, c.H}, DType::bf16, dev);
  cuda_ok(cudaMemset(x.data(), 0, static_cast<size_t>(x.nbytes())), "x");
  cuda_ok(cudaMemset(idx.data(), 0, static_cast<size_t>(idx.nbytes())), "idx");  // expert 0 everywhere: stale rows that would move
  cuda_ok(cudaMemset(w.data(), 0, static_cast<size_t>(w.nbytes())), "w");
  cuda_ok(cudaDeviceSynchronize(), "sync");
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
      cuda_ok(cudaMemcpy(x.data(), ri.x.data(), static_cast<size_t>(ri.x.nbytes()), cudaMemcpyHostToDevice), "x");
      cuda_ok(cudaMemcpy(idx.data(), ri.topk_idx.data(), static_cast<size_t>(ri.topk_idx.nbytes()), cudaMemcpyHostToDevice), "idx");
      cuda_ok(cudaMemcpy(w.data(), ri.topk_weights.data(), static_cast<size_t>(ri.topk_weights.nbytes()), cudaMemcpyHostToDevice), "w");
    }
    const int32_t t32 = static_cast<int32_t>(T);
    cuda_ok(cudaMemcpy(nt.data(), &t32, 4, cudaMemcpyHostToDevice), "num_tokens");
    // The experts' stand-in: the same random rows as HtCpu's, in the first N_recv rows (known from the CPU).
    const int64_t N = want.num_recv_tokens;
    if (N > 0) {
      const Tensor e = expert_out_for(N, c.H, eo_seed(c, i, r));
      cuda_ok(cudaMemcpy(eo.data(), e.data(), static_cast<size_t>(e.nbytes()), cudaMemcpyHostToDevice), "eo");
    }
    cuda_ok(cudaMemset(out.data(), 0xFF, static_cast<size_t>(out.nbytes())), "poison");
    cuda_ok(cudaDeviceSynchronize(), "sync inputs");
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
  // launch (f58869a: never from a prepare, where one rank would stop alone before a launch its peers wait for).
  const int32_t too_many = static_cast<int32_t>(cap + 1 + r);
  test::upload_device(nt.data(), &too_many, 4, "num_tokens");
  cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
  cuda_ok(cudaStreamSynchronize(stream), "graph sync");
  // The next call is a good one (T = 1): its own layout must not erase the bad replay's verdict before the host
  // reads it (the record keeps the last bad layout until the next bad one).
  const int32_t one = 1;
  test::upload_device(nt.data(), &one, 4, "num_tokens");
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

std::string check_errors(const std::shared_ptr<Group>& g, cudaStream_t stream) {
  const int r = g->rank();
  const Device dev = g->device();
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 2;
  c.H = 256;
  c.cap = 32;
  c.T = {20, 32};
  c.seed = 5;
  const auto in = make_inputs(c);
  auto pf = make_prepare_finalize("ht", g, c.config());
  const RankInput& ri = in[static_cast<size_t>(r)];
  const Tensor x = ri.x.to(dev), w = ri.topk_weights.to(dev);
  std::string failures;
  // A bad id on rank 1: InvalidArgument everywhere, naming the entry on rank 1.
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
  if ((r == 1 && what.find("topk_idx[3, 1]") == std::string::npos) || (r == 0 && what.find("rank 1") == std::string::npos))
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
  if ((r == 0 && what.find("num_tokens = 40") == std::string::npos) || (r == 1 && what.find("rank 0") == std::string::npos))
    failures += "T > capacity: rank " + std::to_string(r) + " threw '" + what + "'; ";
  if (r == 0) std::printf("T > capacity: %s\n", what.c_str());
  // Still usable.
  const PrepareResult p = pf->prepare({x, ri.topk_idx.to(dev), w, Stream{stream}});
  const Tensor eo = Tensor::zeros({p.num_recv_tokens, c.H}, DType::bf16, dev), out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16, dev);
  pf->finalize({eo, out, Stream{stream}});
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  // A finalize with the wrong expert_out rows: InvalidArgument on this rank, before anything moves
  // (both ranks make the same mistake, so neither waits).
  what.clear();
  try {
    const Tensor eo_bad = Tensor::zeros({p.num_recv_tokens + 1, c.H}, DType::bf16, dev);
    pf->finalize({eo_bad, out, Stream{stream}});
  } catch (const InvalidArgument& e) {
    what = e.what();
  }
  if (what.find("expert_out.shape[0]") == std::string::npos) failures += "finalize rows: '" + what + "'; ";
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

void run_world() {
  std::vector<HtCase> cases = make_cases();
  for (HtCase& hc : cases) hc.want = run_cpu(hc.c, hc.rounds, hc.contig);
  const GraphCase gc = make_graph_case();
  const DeviceTCase dc = make_device_t_case();
  const std::string path = fresh_dir() + "/uid";
  const std::string failed = run_ranks_forked(2, 500.0, [&](int rank) {
    auto g = make_nccl_group(path, rank, 2, rank, 60.0);
    cuda_ok(cudaSetDevice(rank), "cudaSetDevice");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
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
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("mismatches:\n" + failures);
  });
  EXPECT_EQ(failed, "");
}

/// A late rank must not be overrun (the ordering bug that compute-sanitizer's slow-down exposed:
/// bench/NOTES.md "ht ordering bug"). Rank 1 has no tokens, so its combines wait for nothing; rank 0
/// sleeps before its first finalize of every round; each prepare is finalized twice (expert_contiguous:
/// weighted, then unweighted; Flat: two expert_out). Before the fix rank 1's second combine stored
/// into rank 0's `back` before rank 0 had reduced the first one, deterministically: rank 0's first out
/// came out of the second combine's rows.
void run_late_rank() {
  struct Spec {
    bool contig;
    DType dtype;
    int64_t H;
  };
  const std::vector<Spec> specs = {{true, DType::bf16, 2048}, {false, DType::fp8_e4m3, 2048}, {false, DType::bf16, 7168}};
  std::vector<HtCase> cases;
  uint64_t seed = 90;
  for (const Spec& sp : specs) {
    HtCase g;
    g.contig = sp.contig;
    Case& c = g.c;
    c.R = 2;
    c.E = 16;
    c.K = 4;
    c.H = sp.H;
    c.cap = 512;
    c.T = {512, 0};
    c.dtype = sp.dtype;
    c.masked = 0.1;
    c.align = sp.contig ? 8 : 1;
    c.seed = seed++;
    Case c2 = c;
    c2.seed = c.seed + 1000;
    g.rounds = {make_inputs(c), make_inputs(c2)};
    cases.push_back(std::move(g));
  }
  Drive drive;
  drive.twice = true;
  drive.late_rank = 0;
  drive.late_ms = 300;
  for (HtCase& hc : cases) hc.want = run_cpu(hc.c, hc.rounds, hc.contig, drive);
  const std::string path = fresh_dir() + "/uid";
  const std::string failed = run_ranks_forked(2, 200.0, [&](int rank) {
    auto g = make_nccl_group(path, rank, 2, rank, 60.0);
    cuda_ok(cudaSetDevice(rank), "cudaSetDevice");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    std::string failures;
    for (const HtCase& hc : cases) {
      const auto got = run_gpu(hc.c, hc.rounds, hc.contig, g, stream, drive);
      std::string case_failures;
      for (size_t i = 0; i < got.size(); ++i) {
        const std::string d = compare(got[i], hc.want[i][static_cast<size_t>(rank)]);
        if (!d.empty()) case_failures += "round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + hc.c.describe() + ": " + d + "\n";
      }
      failures += case_failures;
      if (rank == 0)
        std::printf("late rank 0 (%d ms), two finalizes per prepare, ht%s %s: %s\n", drive.late_ms, hc.contig ? " expert_contiguous" : "",
                    hc.c.describe().c_str(), case_failures.empty() ? "bit-exact vs HtCpu (rank 0)" : "DIFFER");
      std::fflush(stdout);
    }
    g->barrier();
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("mismatches:\n" + failures);
  });
  EXPECT_EQ(failed, "");
}

/// make_prepare_finalize(name, group, cfg, config): HtCuda takes its launch settings from the caller's
/// Config (ModularMoE passes its own), not from a Config::load() of its own; and still round-trips.
void run_callers_config() {
  const std::string path = fresh_dir() + "/uid";
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 2;
  c.H = 256;
  c.cap = 32;
  c.T = {20, 32};
  c.seed = 7;
  const auto in = make_inputs(c);
  const auto want = run_cpu(c, {in}, false);
  const std::string failed = run_ranks_forked(2, 120.0, [&](int rank) {
    auto g = make_nccl_group(path, rank, 2, rank, 60.0);
    cuda_ok(cudaSetDevice(rank), "cudaSetDevice");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    Config config;  // defaults, then two fields: whatever EPX_HT_* says must not matter
    config.ht_num_sms = 5;
    config.ht_warps_per_block = 3;
    auto pf = make_prepare_finalize("ht", g, c.config(), config);
    auto* ht = dynamic_cast<dispatch::HtCuda*>(pf.get());
    std::string failures;
    if (!ht) failures += "not HtCuda; ";
    else if (ht->num_sms() != 5 || ht->warps_per_block() != 3)
      failures += "num_sms " + std::to_string(ht->num_sms()) + " warps " + std::to_string(ht->warps_per_block()) + ", want 5 and 3; ";
    pf.reset();
    const auto got = run_gpu(c, {in}, false, g, stream);  // the default object still matches HtCpu
    failures += compare(got[0], want[0][static_cast<size_t>(rank)]);
    g->barrier();
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("rank " + std::to_string(rank) + ": " + failures);
  });
  EXPECT_EQ(failed, "");
}

/// The same across 2 virtual nodes (NCCL without P2P / SHM: one rank per node, the hierarchical ht of
/// hier.h): the caller's Config reaches the node backend (HtCuda on the 1-rank node group).
void run_hier_callers_config() {
  const std::string path = fresh_dir() + "/uid";
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 2;
  c.H = 256;
  c.cap = 32;
  const std::string failed = run_ranks_forked(2, 120.0, [&](int rank) {
    for (const char* v : {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"}) ::setenv(v, "1", 1);
    auto g = make_nccl_group(path, rank, 2, rank, 60.0);
    cuda_ok(cudaSetDevice(rank), "cudaSetDevice");
    std::string failures;
    if (g->num_nodes() != 2) failures += "num_nodes " + std::to_string(g->num_nodes()) + ", want 2 (virtual nodes); ";
    Config config;
    config.ht_num_sms = 5;
    config.ht_warps_per_block = 3;
    auto pf = make_prepare_finalize("ht", g, c.config(), config);
    const auto* node = dynamic_cast<const dispatch::HtCuda*>(dispatch::hierarchical_node_backend(*pf));
    if (!pf->capabilities().hierarchical || !node) failures += "not hierarchical ht over HtCuda; ";
    else if (node->num_sms() != 5 || node->warps_per_block() != 3)
      failures += "node backend num_sms " + std::to_string(node->num_sms()) + " warps " + std::to_string(node->warps_per_block()) + ", want 5 and 3; ";
    g->barrier();
    if (!failures.empty()) throw std::runtime_error("rank " + std::to_string(rank) + ": " + failures);
  });
  EXPECT_EQ(failed, "");
}

/// Rank 1 never calls prepare: rank 0 gets Timeout naming rank 1 within about timeout_s, then
/// CommError on the next call; nothing hangs.
void run_timeout() {
  const std::string path = fresh_dir() + "/uid";
  const std::string failed = run_ranks_forked(2, 120.0, [&](int rank) {
    auto g = make_nccl_group(path, rank, 2, rank, 3.0);
    cuda_ok(cudaSetDevice(rank), "cudaSetDevice");
    Case c;
    c.R = 2;
    c.E = 8;
    c.K = 2;
    c.H = 256;
    c.cap = 16;
    c.T = {8, 8};
    const auto in = make_inputs(c);
    auto pf = make_prepare_finalize("ht", g, c.config());
    // Leak the group and the backend: the peer is gone, so no teardown that could wait on it.
    static auto* keep_g = new std::shared_ptr<Group>(g);
    static auto* keep_pf = new std::unique_ptr<PrepareFinalize>(std::move(pf));
    (void)keep_g;
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(6));
      return;
    }
    const Device dev = g->device();
    const RankInput& ri = in[0];
    const auto t0 = std::chrono::steady_clock::now();
    std::string what;
    try {
      (*keep_pf)->prepare({ri.x.to(dev), ri.topk_idx.to(dev), ri.topk_weights.to(dev)});
    } catch (const Timeout& e) {
      what = e.what();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("timeout after %.1f s: %s\n", s, what.c_str());
    if (what.find("rank 1") == std::string::npos || s > 20) throw std::runtime_error("want Timeout naming rank 1 within ~3 s: '" + what + "'");
    bool comm_error = false;
    try {
      (*keep_pf)->prepare({ri.x.to(dev), ri.topk_idx.to(dev), ri.topk_weights.to(dev)});
    } catch (const CommError&) {
      comm_error = true;
    }
    if (!comm_error) throw std::runtime_error("the call after a timeout did not throw CommError");
  });
  EXPECT_EQ(failed, "");
}

/// Diagnostics (run with --gtest_also_run_disabled_tests): ht-v3 round trips aligned as `epx bench`
/// aligns them (host barrier, then a one-float all-reduce on the stream), CUDA-event times of prepare
/// and finalize and the device timeline (HtTimeline, us after the layout kernel's start), medians over
/// the iterations, per rank; no correctness claim.
void run_timeline() {
  const std::string path = fresh_dir() + "/uid";
  Case c;
  c.R = 2;
  c.E = 256;
  c.K = 8;
  c.H = 7168;
  c.cap = 4096;
  c.T = {4096, 4096};
  c.masked = 0.0;
  const auto in = make_inputs(c);
  const std::string failed = run_ranks_forked(2, 200.0, [&](int rank) {
    auto g = make_nccl_group(path, rank, 2, rank, 60.0);
    cuda_ok(cudaSetDevice(rank), "cudaSetDevice");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    const Device dev = g->device();
    const Tensor x = in[static_cast<size_t>(rank)].x.to(dev), idx = in[static_cast<size_t>(rank)].topk_idx.to(dev),
                 w = in[static_cast<size_t>(rank)].topk_weights.to(dev);
    const Tensor out = Tensor::empty({4096, c.H}, DType::bf16, dev), eo = Tensor::zeros({2 * 4096, c.H}, DType::bf16, dev);
    const Tensor word = Tensor::zeros({1}, DType::fp32, dev);
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v.empty() ? 0.0 : v[v.size() / 2];
    };
    for (DType dt : {DType::fp8_e4m3, DType::bf16}) {
      Case cc = c;
      cc.dtype = dt;
      auto pf = make_prepare_finalize("ht", g, cc.config());
      auto* ht = dynamic_cast<dispatch::HtCuda*>(pf.get());
      cudaEvent_t ev[3];
      for (auto& e : ev) cuda_ok(cudaEventCreate(&e), "event");
      std::vector<double> disp, comb;
      std::vector<std::vector<double>> tls(dispatch::kTlCount);
      const int iters = 20;
      for (int i = 0; i < iters + 3; ++i) {
        g->barrier();
        g->all_reduce_sum(word.data(), word.data(), 1, DType::fp32, Stream{stream});
        cuda_ok(cudaEventRecord(ev[0], stream), "rec");
        const PrepareResult p = pf->prepare({x, idx, w, Stream{stream}});
        cuda_ok(cudaEventRecord(ev[1], stream), "rec");
        pf->finalize({eo.view().slice_rows(0, p.num_recv_tokens), out, Stream{stream}});
        cuda_ok(cudaEventRecord(ev[2], stream), "rec");
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        float a = 0, b = 0;
        cuda_ok(cudaEventElapsedTime(&a, ev[0], ev[1]), "elapsed");
        cuda_ok(cudaEventElapsedTime(&b, ev[1], ev[2]), "elapsed");
        if (i >= 3) {
          disp.push_back(a * 1000.0);
          comb.push_back(b * 1000.0);
          const std::vector<double> tl = ht->timeline_us();
          for (size_t j = 0; j < tls.size(); ++j) tls[j].push_back(tl[j]);
        }
      }
      std::vector<double> m(tls.size());
      for (size_t j = 0; j < tls.size(); ++j) m[j] = median(tls[j]);
      using namespace dispatch;
      std::printf("rank %d %s sms=%d warps=%d pdl=%d (medians of %d): prepare %.1f us, finalize %.1f us | layout planned %.1f published %.1f "
                  "counts seen %.1f end %.1f record %.1f | dispatch start %.1f ready %.1f arrive %.1f end %.1f | combine start %.1f sent %.1f end %.1f us\n",
                  rank, std::string(dtype_name(dt)).c_str(), ht->num_sms(), ht->warps_per_block(), Config::load().ht_pdl, iters, median(disp),
                  median(comb), m[kTlLayoutPlanned], m[kTlLayoutPublished], m[kTlLayoutCountsSeen], m[kTlLayoutEnd], m[kTlLayoutRecord],
                  m[kTlDispatchStart], m[kTlDispatchReady], m[kTlDispatchArrive], m[kTlDispatchEnd], m[kTlCombineStart], m[kTlCombineSent],
                  m[kTlCombineEnd]);
      std::fflush(stdout);
    }
    g->barrier();
  });
  EXPECT_EQ(failed, "");
}

}  // namespace

TEST(HtCuda, DISABLED_Timeline) {
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, found " << n;
  run_timeline();
}

// The device token count under one graph, and the worst-case bad-count verdict kept until the host reads it
// (a later good call's layout must not erase it), on one rank: runs on the one-GPU machine too.
TEST(HtCuda, DeviceTokenCountOneRank) {
  if (cuda::device_count() < 1) GTEST_SKIP() << "needs 1 GPU";
  const DeviceTCase dc = make_device_t_case(1);
  const std::string path = fresh_dir() + "/uid";
  const std::string failed = run_ranks_forked(1, 200.0, [&](int rank) {
    auto g = make_nccl_group(path, rank, 1, rank, 60.0);
    cuda_ok(cudaSetDevice(rank), "cudaSetDevice");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    const std::string failures = run_device_t(dc, g, stream);
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("mismatches:\n" + failures);
  });
  EXPECT_EQ(failed, "");
}

TEST(HtCuda, MatchesHtCpuTwoRanks) {
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, found " << n;
  run_world();
}

TEST(HtCuda, LateRankIsNotOverrun) {
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, found " << n;
  run_late_rank();
}

TEST(HtCuda, TakesTheCallersConfig) {
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, found " << n;
  run_callers_config();
}

TEST(HtCuda, HierarchicalTakesTheCallersConfig) {
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, found " << n;
  run_hier_callers_config();
}

TEST(HtCuda, SilentPeerTimesOut) {
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, found " << n;
  run_timeout();
}

#else
TEST(HtCuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }
#endif
