// dispatch/ht/ht_cuda_testing.h: what the ht CUDA tests share (ht_cuda_test.cpp, ht_ranks_cuda_test.cpp):
// host snapshots of a rank's prepare + finalize, deterministic expert outputs, the cases (full-size and
// small, three rounds each) and their HtCpu oracle, the comparison, and one rank's GPU rounds.
// Test-only; include after the CUDA headers, inside EPX_WITH_CUDA.
#pragma once

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

#include <cuda_runtime_api.h>

#include "dispatch/hier/hier.h"
#include "dispatch/ht/ht_cuda.h"

using namespace epx;
using namespace epx::test;

namespace {

using test::RankStream;
using test::per_rank;
using test::throw_failures;
using test::say_where;
using test::has_gpu;

/// SMs of the group's GPU.
inline int device_sms(const std::shared_ptr<Group>& g) {
  int sms = 0;
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g->device().index), "SM count");
  return sms;
}

template <class T>
inline std::vector<uint8_t> vec_bytes(const std::vector<T>& v) {
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

inline void take_prepare(const PrepareResult& p, Snapshot& s) {
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
inline Tensor expert_out_for(int64_t N, int64_t H, uint64_t seed, DType dtype = DType::bf16) {
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
inline DType eo_dtype(const Case& c, bool contig) { return contig ? DType::bf16 : c.expert_out_dtype(ActivationLayout::Flat); }

using Rounds = std::vector<std::vector<RankInput>>;  // [round][rank]

struct HtCase {
  Case c;
  bool contig = false;  ///< DispatchConfig::expert_contiguous (finalize weighted, then unweighted)
  Rounds rounds;
  std::vector<std::vector<Snapshot>> want;  // [round][rank]
};

inline uint64_t eo_seed(const Case& c, size_t round, int rank) { return c.seed * 7919 + round * 131 + static_cast<uint64_t>(rank) + 5; }

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
inline uint64_t eo_seed2(const Case& c, size_t round, int rank) { return eo_seed(c, round, rank) + 0x5EED; }

inline DispatchConfig config_of(const Case& c, bool contig) {
  DispatchConfig cfg = c.config();
  cfg.expert_contiguous = contig;
  return cfg;
}

inline std::vector<std::vector<Snapshot>> run_cpu(const Case& c, const Rounds& rounds, bool contig, const Drive& drive = {}) {
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

inline std::string compare(const Snapshot& got, const Snapshot& want) {
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
inline Rounds three_rounds(const Case& c, const std::vector<int64_t>& T3 = {}) {
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

inline HtCase make_ht_case(int R, const Spec& sp, uint64_t seed) {
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
inline std::vector<HtCase> make_cases() {
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
inline std::vector<HtCase> make_small_cases(int R) {
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

inline std::vector<Snapshot> run_gpu(const Case& c, const Rounds& rounds, bool contig, const std::shared_ptr<Group>& g, cudaStream_t stream,
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

}  // namespace
