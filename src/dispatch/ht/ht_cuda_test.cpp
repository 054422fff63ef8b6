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
// the device token count under one graph (T per replay and rank, 0 included), bad arguments (a bad id,
// an oversized T: InvalidArgument on every rank naming the rank, object usable after), the caller's
// Config and the SM share on virtual ranks, and a stopped rank (created the object, never calls
// prepare, or never calls finalize): every other rank gets Timeout naming it within the short group
// timeout, no hang. On 2 ranks: a late rank is not overrun, and the hierarchical ht takes the caller's
// Config (also on 4 ranks in 2 nodes). On 1 rank: the device token count.
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

namespace {

using test::RankStream;
using test::per_rank;
using test::throw_failures;
using test::say_where;
using test::has_gpu;

/// SMs of the group's GPU.
int device_sms(const std::shared_ptr<Group>& g) {
  int sms = 0;
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g->device().index), "SM count");
  return sms;
}

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

/// Deterministic stand-in for the experts: [N, H] values in +-[2^-8, 2) with random bits from
/// (seed, index) (splitmix64: ~20x cheaper than a normal draw, and these rows are hundreds of MB).
/// bf16 (7 mantissa bits), or fp32 with 23 random mantissa bits (the Flat partials of flat_combine
/// partial_fp32, which a bf16 rounding anywhere before the sum would change).
Tensor expert_out_for(int64_t N, int64_t H, uint64_t seed, DType dtype = DType::bf16) {
  Tensor t = Tensor::empty({N, H}, dtype);
  const bool f32 = dtype == DType::fp32;
  for (int64_t i = 0; i < N * H; ++i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    // sign, exponent 119..127 (2^-8 .. 2^0), 7 (bf16) or 23 (fp32) mantissa bits
    const uint32_t sign = static_cast<uint32_t>(z & 1), exp = static_cast<uint32_t>(119 + (z >> 1) % 9);
    if (f32) {
      const uint32_t bits = (sign << 31) | (exp << 23) | static_cast<uint32_t>((z >> 8) & 0x7FFFFF);
      std::memcpy(t.ptr<float>() + i, &bits, 4);
    } else {
      t.ptr<uint16_t>()[i] = static_cast<uint16_t>((sign << 15) | (exp << 7) | ((z >> 8) & 0x7F));
    }
  }
  return t;
}

/// dtype of the expert_out a finalize takes: the expert-contiguous rows are bf16, the Flat partials
/// as the case's flat_combine says (fp32 by default, one rounding).
DType eo_dtype(const Case& c, bool contig) { return contig ? DType::bf16 : c.expert_out_dtype(ActivationLayout::Flat); }

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
      const Tensor eo = expert_out_for(contig ? s.contig_rows : s.num_recv_tokens, c.H, eo_seed(c, i, r), eo_dtype(c, contig));
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
        const Tensor eo2 = expert_out_for(s.num_recv_tokens, c.H, eo_seed2(c, i, r), eo_dtype(c, contig));
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

/// Three rounds on one object: A, A's routing with new tokens (the cached layout: one cache hit), then a
/// new routing, with T3 tokens per rank when given (else A's).
Rounds three_rounds(const Case& c, const std::vector<int64_t>& T3 = {}) {
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
  if (!T3.empty()) c3.T = T3;
  return {a, a2, make_inputs(c3)};
}

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
  std::vector<int64_t> T3 = {};  ///< tokens per rank of the third round (empty: T)
  FlatCombine flat_combine = FlatCombine::partial_fp32;  ///< one case per list keeps the two-roundings opt-in
};

HtCase make_ht_case(int R, const Spec& sp, uint64_t seed) {
  HtCase g;
  g.contig = sp.contig;
  Case& c = g.c;
  c.R = R;
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
  c.seed = seed;
  c.flat_combine = sp.flat_combine;
  g.rounds = three_rounds(c, sp.T3);
  return g;
}

/// The 2-rank cases at full size (ht-v3 and hidden 2048).
std::vector<HtCase> make_cases() {
  const std::vector<Spec> specs = {
      {7168, DType::fp8_e4m3, false, 256, 8, 4096, {4096, 4096}, 0.0, 0.05, false, false, false, 1},   // ht-v3 fp8
      {7168, DType::bf16, false, 256, 8, 4096, {4095, 1}, 1.2, 0.1, false, true, true, 1},            // ht-v3 bf16, Zipf
      {2048, DType::fp8_e4m3, true, 256, 8, 8192, {8192, 0}, 1.1, 0.2, false, false, false, 128},     // UE8M0, aligned
      {2048, DType::bf16, false, 64, 6, 16, {0, 0}, 0.0, 0.0, false, false, false, 1},                 // nobody sends
      {7168, DType::bf16, false, 256, 9, 4096, {1, 4096}, 0.0, 0.1, true, true, false, 32},            // shared route
      {2048, DType::fp8_e4m3, false, 16, 4, 8192, {8192, 8192}, 1.5, 0.3, false, true, true, 1},       // skewed, small E
      {2048, DType::bf16, false, 3, 2, 300, {300, 299}, 0.0, 0.2, false, false, false, 1, false, {}, FlatCombine::partial_bf16},  // a rank holds 1 expert; bf16 partials
      {2048, DType::fp8_e4m3, false, 256, 8, 2048, {2048, 2047}, 1.2, 0.1, false, true, false, 128, true},  // expert-contiguous, Zipf
      {7168, DType::bf16, false, 64, 6, 1024, {1000, 1}, 0.0, 0.1, true, true, true, 32, true},        // expert-contiguous, shared
      {2048, DType::bf16, false, 16, 4, 64, {0, 0}, 0.0, 0.0, false, false, false, 8, true},            // expert-contiguous, empty
      {7168, DType::fp8_e4m3, false, 256, 8, 8192, {8192, 1}, 1.2, 0.05, false, false, false, 1},      // ht-v3 fp8, Zipf, T = 8192 / 1
  };
  std::vector<HtCase> cases;
  uint64_t seed = 41;
  for (const Spec& sp : specs) cases.push_back(make_ht_case(2, sp, seed++));
  return cases;
}

/// Small shapes for R ranks (2, 4 or 8): T in {0, 1, 7, 128} differing between ranks, and between the
/// first rounds and the third; bf16, fp8 and fp8 + UE8M0; Flat and expert-contiguous.
std::vector<HtCase> make_small_cases(int R) {
  const auto T = [R](std::vector<int64_t> pattern) { return per_rank(R, pattern); };
  const std::vector<Spec> specs = {
      {1024, DType::bf16, false, 4 * R, 4, 128, T({128, 7, 0, 1}), 0.0, 0.2, false, true, false, 1, false, T({1, 0, 128, 7})},
      {512, DType::fp8_e4m3, false, 2 * R + 4, 4, 128, T({1, 128, 0, 7}), 1.2, 0.15, false, false, true, 1, false, T({7, 1, 128, 0}),
       FlatCombine::partial_bf16},  // bf16 partials (two roundings)
      {384, DType::fp8_e4m3, true, R + 3, 3, 16, T({7, 16, 0, 1}), 0.0, 0.25, true, false, false, 8, false, T({16, 0, 1, 7})},  // shared route
      {512, DType::fp8_e4m3, false, 4 * R, 4, 128, T({128, 1, 7, 0}), 1.1, 0.2, false, true, false, 16, true, T({0, 7, 1, 128})},  // contiguous
      {1024, DType::bf16, false, 4 * R, 6, 128, T({0, 7, 128, 1}), 0.0, 0.1, true, false, true, 8, true, T({128, 0, 1, 7})},   // contiguous, shared
      {256, DType::bf16, false, 2 * R, 2, 8, T({0}), 0.0, 0.0, false, false, false, 1},                                          // nobody sends
  };
  std::vector<HtCase> cases;
  uint64_t seed = 500 + 10 * static_cast<uint64_t>(R);
  for (const Spec& sp : specs) cases.push_back(make_ht_case(R, sp, seed++));
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
    const Tensor eo = expert_out_for(contig ? s.contig_rows : s.num_recv_tokens, c.H, eo_seed(c, i, r), eo_dtype(c, contig)).to(dev);
    const Tensor out = Tensor::empty({T, c.H}, DType::bf16, dev);
    test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison out");
    FinalizeArgs fa{eo, out, Stream{stream}};
    if (contig) fa.topk_weights = p.topk_weights;
    if (r == drive.late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(drive.late_ms));
    pf->finalize(fa);
    cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
    s.out = host_bytes(out);
    if (contig || drive.twice) {
      const Tensor eo2 = contig ? eo : expert_out_for(s.num_recv_tokens, c.H, eo_seed2(c, i, r), eo_dtype(c, contig)).to(dev);
      test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison out");
      pf->finalize({eo2, out, Stream{stream}});
      cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
      s.out2 = host_bytes(out);
    }
    s.stats = pf->stats();
  }
  return snaps;
}

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

/// A late rank must not be overrun (the ordering bug that compute-sanitizer's slow-down exposed:
/// bench/NOTES.md "ht ordering bug"). Rank 1 has no tokens, so its combines wait for nothing; rank 0
/// sleeps before its first finalize of every round; each prepare is finalized twice (expert_contiguous:
/// weighted, then unweighted; Flat: two expert_out). Without the "combine done" wait rank 1's second
/// combine stores into rank 0's `back` before rank 0 has reduced the first one, deterministically: rank
/// 0's first out comes out of the second combine's rows.
void run_late_rank() {
  struct LateSpec {
    bool contig;
    DType dtype;
    int64_t H;
  };
  const std::vector<LateSpec> specs = {{true, DType::bf16, 2048}, {false, DType::fp8_e4m3, 2048}, {false, DType::bf16, 7168}};
  std::vector<HtCase> cases;
  uint64_t seed = 90;
  for (const LateSpec& sp : specs) {
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
  say_where(2);
  const std::string failed = run_cuda_ranks(2, 200.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
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
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

/// make_prepare_finalize(name, group, cfg, config): HtCuda takes its launch settings from the caller's
/// Config (ModularMoE passes its own), not from a Config::load() of its own, at most the rank's share of
/// the SMs (SMs / ranks_per_gpu: all of them with one rank per GPU, 1/R on R virtual ranks); and still
/// round-trips.
void run_callers_config(int R) {
  say_where(R);
  Case c;
  c.R = R;
  c.E = std::max(8, 2 * R);
  c.K = 2;
  c.H = 256;
  c.cap = 32;
  c.T = per_rank(R, {20, 32, 0, 1});
  c.seed = 7;
  const auto in = make_inputs(c);
  const auto want = run_cpu(c, {in}, false);
  const std::string failed = run_cuda_ranks(R, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const int sms = device_sms(g), share = g->ranks_per_gpu() > 1 ? sms / g->ranks_per_gpu() - 1 : sms;  // the layout CTA counts
    if (g->ranks_per_gpu() != (virtual_ranks_for(R) ? R : 1))
      throw std::runtime_error("ranks_per_gpu " + std::to_string(g->ranks_per_gpu()) + " on rank " + std::to_string(rank));
    std::string failures;
    Config config;  // defaults, then two fields: whatever EPX_HT_* says must not matter
    config.ht_num_sms = 5;
    config.ht_warps_per_block = 3;
    auto pf = make_prepare_finalize("ht", g, c.config(), config);
    auto* ht = dynamic_cast<dispatch::HtCuda*>(pf.get());
    const int want_sms = std::min(5, share);
    if (!ht) failures += "not HtCuda; ";
    else if (ht->num_sms() != want_sms || ht->warps_per_block() != 3)
      failures += "num_sms " + std::to_string(ht->num_sms()) + " warps " + std::to_string(ht->warps_per_block()) + ", want " +
                  std::to_string(want_sms) + " and 3; ";
    pf.reset();
    config.ht_num_sms = sms;  // every SM asked for: the rank gets its share
    pf = make_prepare_finalize("ht", g, c.config(), config);
    ht = dynamic_cast<dispatch::HtCuda*>(pf.get());
    if (ht && ht->num_sms() != share)
      failures += "ht_num_sms = " + std::to_string(sms) + " (all SMs) gave num_sms " + std::to_string(ht->num_sms()) + ", want the share " +
                  std::to_string(share) + "; ";
    if (rank == 0) std::printf("ht num_sms: %d of %d SMs asked for 5, %d asked for all (%d ranks per GPU)\n", want_sms, sms, share, g->ranks_per_gpu());
    pf.reset();
    const auto got = run_gpu(c, {in}, false, g, stream);  // the default object still matches HtCpu
    failures += compare(got[0], want[0][static_cast<size_t>(rank)]);
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

/// Sets the NCCL variables that make every GPU its own node, in this (the gtest) process before the real
/// form's ranks are forked (NCCL reads its environment once per process; a rank's thread must not set
/// it), and restores the previous values when it goes.
class NcclNodesEnv {
 public:
  NcclNodesEnv() : p2p_("NCCL_P2P_DISABLE", "1"), shm_("NCCL_SHM_DISABLE", "1") {}

 private:
  test::ScopedEnv p2p_, shm_;
};

/// The same across nodes (the hierarchical ht of hier.h): in the real form every GPU its own node (NCCL
/// without P2P / SHM), on virtual ranks nodes of `virtual_per_node` ranks; the caller's Config reaches
/// the node backend (HtCuda on the node group).
void run_hier_callers_config(int R, int virtual_per_node) {
  say_where(R);
  const bool virt = virtual_ranks_for(R);
  const int want_nodes = virt ? R / virtual_per_node : R;
  std::optional<NcclNodesEnv> env;
  if (!virt) env.emplace();
  Case c;
  c.R = R;
  c.E = std::max(8, 2 * R);
  c.K = 2;
  c.H = 256;
  c.cap = 32;
  const std::string failed = run_cuda_ranks(
      R, 120.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        std::string failures;
        if (g->num_nodes() != want_nodes) failures += "num_nodes " + std::to_string(g->num_nodes()) + ", want " + std::to_string(want_nodes) + "; ";
        const int want_sms = std::min(5, device_sms(g) / std::max(1, g->ranks_per_gpu()));
        Config config;
        config.ht_num_sms = 5;
        config.ht_warps_per_block = 3;
        auto pf = make_prepare_finalize("ht", g, c.config(), config);
        const auto* node = dynamic_cast<const dispatch::HtCuda*>(dispatch::hierarchical_node_backend(*pf));
        if (!pf->capabilities().hierarchical || !node) failures += "not hierarchical ht over HtCuda; ";
        else if (node->num_sms() != want_sms || node->warps_per_block() != 3)
          failures += "node backend num_sms " + std::to_string(node->num_sms()) + " warps " + std::to_string(node->warps_per_block()) + ", want " +
                      std::to_string(want_sms) + " and 3; ";
        g->barrier();
        throw_failures(rank, failures);
      },
      60.0, virt ? virtual_per_node : 0);
  EXPECT_EQ(failed, "");
}

// ---- a stopped rank ------------------------------------------------------------------------------

/// The group timeout of the stopped-rank tests: every device wait of ht is bounded by it.
constexpr double kStopTimeout = 3.0;

/// The stopped rank's part: on virtual ranks its body returns at once (its thread ends; the buffers its
/// peers store into are co-owned and stay); in the real form its process sleeps past its peers' timeouts
/// (a process that exits while its peers still store into its memory over NVLink is not what this tests).
void stopped_rank(bool real) {
  if (real) std::this_thread::sleep_for(std::chrono::duration<double>(kStopTimeout + 4.0));
}

/// The end of a stopped-rank test's body. Real form (one process per GPU): the process exits here without
/// teardown (the stopped rank never consumed what its peers sent); on virtual ranks the body returns (or
/// throws the failures) like any other, and its objects are destroyed: their waits are over.
void end_stopped_test(int rank, const std::string& failures, bool real) {
  std::fflush(stdout);
  if (real) {
    if (!failures.empty()) std::fprintf(stderr, "[rank %d] FAILED: %s\n", rank, failures.c_str());
    std::fflush(stderr);
    _exit(failures.empty() ? 0 : 1);
  }
  throw_failures(rank, failures);
}

/// Rank `stopped` creates the object with the others but never calls prepare (at_finalize false), or
/// prepares with them and never calls finalize (at_finalize true: every rank's token 0 selects one of its
/// experts, so every other rank's combine waits for its rows). Every other rank gets Timeout naming the
/// stopped rank within about the group timeout (prepare: from that call; finalize: once the combine has
/// given up, from the next call), then CommError from the call after; nothing hangs.
void run_stopped_rank(int R, int stopped, bool at_finalize) {
  say_where(R);
  const bool real = !virtual_ranks_for(R);
  std::printf("rank %d stops before its %s (%s)\n", stopped, at_finalize ? "finalize" : "prepare", real ? "sleeps" : "returns at once");
  Case c;
  c.R = R;
  c.E = std::max(8, 2 * R);
  c.K = 2;
  c.H = 256;
  c.cap = 16;
  c.T = per_rank(R, {8, 5, 1, 7});
  c.masked = 0.0;
  c.seed = 51;
  std::vector<RankInput> in = make_inputs(c);
  const ExpertRange sr = expert_range(c.E, c.R, stopped);
  for (RankInput& ri : in) {  // token 0 of every rank: column 0 := an expert of the stopped rank that it does not name yet
    int32_t* id = ri.topk_idx.ptr<int32_t>();  // int32 ids (Case::idx64 false), T >= 1 everywhere
    bool there = false;
    for (int k = 0; k < c.K; ++k) there = there || (id[k] >= sr.begin && id[k] < sr.end);
    for (int e = sr.begin; !there && e < sr.end; ++e) {
      bool named = false;
      for (int k = 0; k < c.K; ++k) named = named || id[k] == e;
      if (!named) id[0] = e, there = true;
    }
  }
  const std::string who = "rank " + std::to_string(stopped);
  const std::string failed = run_cuda_ranks(
      R, 90.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        const Device dev = g->device();
        const RankStream rs;
        const cudaStream_t s = rs.s;
        auto pf = make_prepare_finalize("ht", g, c.config());
        const RankInput& ri = in[static_cast<size_t>(rank)];
        const Tensor x = ri.x.to(dev), idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
        std::string failures;
        if (rank == stopped && !at_finalize) {
          stopped_rank(real);
          return end_stopped_test(rank, failures, real);
        }
        std::string what;
        auto t0 = std::chrono::steady_clock::now();
        try {
          const PrepareResult p = pf->prepare({x, idx, w, Stream{s}});
          cuda_ok(cudaStreamSynchronize(s), "sync prepare");
          if (at_finalize) {
            if (rank == stopped) {
              stopped_rank(real);
              return end_stopped_test(rank, failures, real);
            }
            const Tensor eo = Tensor::zeros({p.num_recv_tokens, c.H}, DType::bf16, dev), out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16, dev);
            t0 = std::chrono::steady_clock::now();
            pf->finalize({eo, out, Stream{s}});
            cuda_ok(cudaStreamSynchronize(s), "sync finalize");  // the combine gives up after the timeout
            pf->prepare({x, idx, w, Stream{s}});                   // the next call reports it
          }
        } catch (const Timeout& e) {
          what = e.what();
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: timeout after %.2f s (bound %.1f s): %s\n", rank, secs, kStopTimeout, what.c_str());
        const char* op = at_finalize ? "finalize" : "prepare";
        if (what.find(who) == std::string::npos || what.find(op) == std::string::npos)
          failures += "want Timeout naming " + who + " and the " + op + ": '" + what + "'; ";
        if (secs < kStopTimeout * 0.9 || secs > kStopTimeout + 15.0) failures += "timeout took " + std::to_string(secs) + " s; ";
        bool comm_error = false;
        try {
          pf->prepare({x, idx, w, Stream{s}});
        } catch (const CommError&) {
          comm_error = true;
        }
        if (!comm_error) failures += "the call after a timeout did not throw CommError; ";
        cuda_ok(cudaStreamSynchronize(s), "sync");
        end_stopped_test(rank, failures, real);
      },
      kStopTimeout);
  EXPECT_EQ(failed, "");
}

/// Diagnostics (run with --gtest_also_run_disabled_tests): ht-v3 round trips aligned as `epx bench`
/// aligns them (host barrier, then a one-float all-reduce on the stream), CUDA-event times of prepare
/// and finalize and the device timeline (HtTimeline, us after the layout kernel's start), medians over
/// the iterations, per rank; no correctness claim. Real form only (one GPU per rank): it times NVLink, and
/// HtCuda::timeline_us synchronizes the whole device, which on virtual ranks waits for the peers' kernels.
void run_timeline() {
  Case c;
  c.R = 2;
  c.E = 256;
  c.K = 8;
  c.H = 7168;
  c.cap = 4096;
  c.T = {4096, 4096};
  c.masked = 0.0;
  c.flat_combine = FlatCombine::partial_fp32;  // the default combine: fp32 partials
  const auto in = make_inputs(c);
  const std::string failed = run_cuda_ranks(2, 200.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const Device dev = g->device();
    const Tensor x = in[static_cast<size_t>(rank)].x.to(dev), idx = in[static_cast<size_t>(rank)].topk_idx.to(dev),
                 w = in[static_cast<size_t>(rank)].topk_weights.to(dev);
    const Tensor out = Tensor::empty({4096, c.H}, DType::bf16, dev), eo = Tensor::zeros({2 * 4096, c.H}, DType::fp32, dev);
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
  if (virtual_ranks_for(2)) GTEST_SKIP() << "needs 2 GPUs: times the kernels over NVLink, and timeline_us synchronizes the whole device";
  run_timeline();
}

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

TEST(HtCuda, LateRankIsNotOverrun) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_late_rank();
}

TEST(HtCuda, TakesTheCallersConfigTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_callers_config(2);
}

TEST(HtCuda, TakesTheCallersConfigFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_callers_config(4);
}

TEST(HtCuda, TakesTheCallersConfigEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_callers_config(8);
}

// Real form: 2 GPUs, each its own node; virtual ranks: 2 nodes of 1 rank.
TEST(HtCuda, HierarchicalTakesTheCallersConfigTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_callers_config(2, 1);
}

// Real form: 4 GPUs, each its own node; virtual ranks: 2 nodes of 2 ranks.
TEST(HtCuda, HierarchicalTakesTheCallersConfigFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_callers_config(4, 2);
}

TEST(HtCuda, StoppedRankTimesOutInPrepareTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(2, 1, false);
}

TEST(HtCuda, StoppedRankTimesOutInPrepareFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(4, 2, false);
}

TEST(HtCuda, StoppedRankTimesOutInPrepareEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(8, 5, false);
}

TEST(HtCuda, StoppedRankTimesOutInFinalizeTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(2, 0, true);
}

TEST(HtCuda, StoppedRankTimesOutInFinalizeFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(4, 3, true);
}

TEST(HtCuda, StoppedRankTimesOutInFinalizeEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(8, 6, true);
}

#else
TEST(HtCuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }
#endif
