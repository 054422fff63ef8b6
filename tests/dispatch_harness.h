// tests/dispatch_harness.h: a whole EP layer on CPU ranks for the dispatch tests, built around a
// cheap deterministic expert, plus the two oracles it is compared with.
//
// Expert e (global id; e == E is the shared expert) maps a row x [H] to
//   y[i] = round_bf16(a_e * x[i] + b_e * ((i % 5) - 2)),  a_e = 0.5 + 0.03 (e + 1), b_e = 0.001 (e + 1)
// so a token sent to the wrong expert, twice, or not at all changes the result.
// Oracles, on the tokens as the wire carries them (x~ = x, or x quantized to FP8 1x128 and back):
//   reference_out : out[t] = round_bf16(sum over valid k, in column order, of w[t,k] * f_{e_k}(x~[t]))
//                   (the no-EP layer; the LL backend must match it bit for bit with
//                   LlCombine::column, its default)
//   flat_out      : the same sum split by destination rank: partial_d = round_bf16(sum over columns on
//                   rank d), out = round_bf16(sum over d in rank order of partial_d); what the Flat
//                   backends compute given the Experts contract (bf16 per-rank partials); ll with
//                   LlCombine::partial_bf16 computes exactly this too, and with partial_fp32 the same
//                   without the partials' rounding (round_partials = false)
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "epx/dispatch.h"
#include "epx/experts.h"
#include "epx/group.h"
#include "epx/quant.h"
#include "test_util.h"

namespace epx::test {

inline void expert_fn(int e, const float* x, int64_t H, float* y) {
  const float a = 0.5f + 0.03f * static_cast<float>(e + 1), b = 0.001f * static_cast<float>(e + 1);
  for (int64_t i = 0; i < H; ++i) y[i] = round_bf16(a * x[i] + b * static_cast<float>(i % 5 - 2));
}

/// Experts over both layouts with expert_fn; local expert l is global expert global_ids[l].
class TestExperts final : public Experts {
 public:
  TestExperts(std::vector<int> global_ids, int64_t hidden) : ids_(std::move(global_ids)), hidden_(hidden) {}
  int num_local_experts() const override { return static_cast<int>(ids_.size()); }
  int64_t hidden() const override { return hidden_; }
  bool supports(ActivationLayout) const override { return true; }
  int64_t rows_without_local_selection = 0;  ///< Flat rows that no local expert selects

  void apply(const ExpertsInput& in, const TensorView& out, Stream) override {
    const int64_t H = hidden_;
    std::vector<float> xr(static_cast<size_t>(H)), y(static_cast<size_t>(H)), acc(static_cast<size_t>(H));
    auto load_row = [&](int64_t row) {
      if (in.x.dtype == DType::fp8_e4m3)
        dequantize_fp8_row(in.x.ptr<const uint8_t>() + row * H, in.x_scales.ptr<const float>() + row * (H / kFp8GroupSize), H, xr.data(),
                           kFp8GroupSize);
      else
        for (int64_t i = 0; i < H; ++i) xr[static_cast<size_t>(i)] = bf16_bits_to_float(in.x.ptr<const uint16_t>()[row * H + i]);
    };
    uint16_t* o = static_cast<uint16_t*>(out.data);
    if (in.layout == ActivationLayout::ExpertMajor) {
      const int64_t L = in.x.size(0), cap = in.x.size(1);
      EXPECT_EQ(L, num_local_experts());
      for (int64_t l = 0; l < L; ++l) {
        const int32_t n = in.recv_count.ptr<const int32_t>()[l];
        EXPECT_LE(n, cap);
        for (int64_t j = 0; j < n; ++j) {
          load_row(l * cap + j);
          expert_fn(ids_[static_cast<size_t>(l)], xr.data(), H, y.data());
          for (int64_t i = 0; i < H; ++i) o[(l * cap + j) * H + i] = float_to_bf16_bits(y[static_cast<size_t>(i)]);
        }
      }
      return;
    }
    const int64_t N = in.x.size(0), K = in.topk_idx.size(1);
    for (int64_t n = 0; n < N; ++n) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      bool any = false;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t l = in.topk_idx.ptr<const int32_t>()[n * K + k];
        if (l < 0) continue;
        EXPECT_LT(l, num_local_experts());
        if (!any) load_row(n);
        any = true;
        expert_fn(ids_[static_cast<size_t>(l)], xr.data(), H, y.data());
        const float w = in.topk_weights.ptr<const float>()[n * K + k];
        for (int64_t i = 0; i < H; ++i) acc[static_cast<size_t>(i)] += w * y[static_cast<size_t>(i)];
      }
      rows_without_local_selection += !any;
      if (out.dtype == DType::fp32)  // the unrounded partial (flat_combine partial_fp32)
        std::copy(acc.begin(), acc.end(), out.ptr<float>() + n * H);
      else
        for (int64_t i = 0; i < H; ++i) o[n * H + i] = float_to_bf16_bits(acc[static_cast<size_t>(i)]);
    }
  }

 private:
  std::vector<int> ids_;
  int64_t hidden_;
};

struct Case {
  int R = 2;
  int E = 8;
  int K = 2;                      ///< columns of topk_idx (incl. the shared column with shared_route)
  int64_t H = 8;
  int cap = 16;                   ///< num_max_dispatch_tokens_per_rank
  std::vector<int64_t> T;         ///< tokens per rank; empty = cap/2 + r
  DType dtype = DType::bf16;
  bool ue8m0 = false;
  bool shared = false;            ///< shared_route: last column = E with weight 1.0
  double masked = 0.15;
  bool dups = false;
  double zipf = 0.0;
  int align = 1;
  bool idx64 = false;
  uint64_t seed = 1;
  LlCombine ll_combine = LlCombine::column;  ///< ll only (the "bit for bit" rule holds for column)
  /// Flat backends. These cases keep the bf16 partials (two roundings) their oracle was written for;
  /// one_rounding_test.cpp runs partial_fp32, DispatchConfig's default.
  FlatCombine flat_combine = FlatCombine::partial_bf16;
  /// dtype of expert_out for a prepare of `layout`.
  DType expert_out_dtype(ActivationLayout layout) const {
    return layout == ActivationLayout::Flat && flat_combine == FlatCombine::partial_fp32 ? DType::fp32 : DType::bf16;
  }

  int64_t tokens(int r) const { return T.empty() ? cap / 2 + r : T[static_cast<size_t>(r)]; }
  DispatchConfig config() const {
    DispatchConfig c;
    c.hidden = H;
    c.num_experts = E;
    c.top_k = K;
    c.num_max_dispatch_tokens_per_rank = cap;
    c.dispatch_dtype = dtype;
    c.use_ue8m0 = ue8m0;
    c.shared_route = shared;
    c.expert_alignment = align;
    c.ll_combine = ll_combine;
    c.flat_combine = flat_combine;
    return c;
  }
  std::string describe() const {
    std::ostringstream os;
    os << "R=" << R << " E=" << E << " K=" << K << " H=" << H << " cap=" << cap << " T=[";
    for (int r = 0; r < R; ++r) os << (r ? "," : "") << tokens(r);
    os << "] dtype=" << dtype_name(dtype) << (ue8m0 ? " ue8m0" : "") << (shared ? " shared_route" : "") << " masked=" << masked
       << (dups ? " dups" : "") << " zipf=" << zipf << " align=" << align << (idx64 ? " int64" : "") << " seed=" << seed
       << (ll_combine != LlCombine::column ? std::string(" ll_combine=") + ll_combine_name(ll_combine) : std::string());
    return os.str();
  }
};

struct RankInput {
  Tensor x, topk_idx, topk_weights;  ///< [T, H] bf16, [T, K] int32|int64, [T, K] fp32
};

inline std::vector<RankInput> make_inputs(const Case& c) {
  std::vector<RankInput> in(static_cast<size_t>(c.R));
  for (int r = 0; r < c.R; ++r) {
    const int64_t T = c.tokens(r);
    const uint64_t seed = c.seed * 1000 + static_cast<uint64_t>(r);
    RankInput& ri = in[static_cast<size_t>(r)];
    ri.x = random_bf16(T, c.H, seed);
    const int routed_k = c.shared ? c.K - 1 : c.K;
    Tensor idx, w;
    random_routing(T, routed_k, c.E, seed + 7, {.masked_fraction = c.masked, .allow_duplicates = c.dups, .zipf_s = c.zipf}, idx, w);
    ri.topk_idx = Tensor::empty({T, c.K}, c.idx64 ? DType::int64 : DType::int32);
    ri.topk_weights = Tensor::empty({T, c.K}, DType::fp32);
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < c.K; ++k) {
        const bool shared_col = c.shared && k == c.K - 1;
        // Shared column: the shared expert (weight 1.0), masked for every 5th token to cover -1 there too.
        const int32_t id = shared_col ? (t % 5 == 4 ? -1 : c.E) : idx.ptr<int32_t>()[t * routed_k + k];
        const float wt = shared_col ? 1.0f : w.ptr<float>()[t * routed_k + k];
        if (c.idx64) ri.topk_idx.ptr<int64_t>()[t * c.K + k] = id;
        else ri.topk_idx.ptr<int32_t>()[t * c.K + k] = id;
        ri.topk_weights.ptr<float>()[t * c.K + k] = wt;
      }
  }
  return in;
}

inline int32_t id_at(const RankInput& ri, int64_t t, int K, int k) {
  return ri.topk_idx.dtype() == DType::int64 ? static_cast<int32_t>(ri.topk_idx.ptr<int64_t>()[t * K + k]) : ri.topk_idx.ptr<int32_t>()[t * K + k];
}

/// Token t of `ri` as the wire carries it (FP8 1x128 round trip for fp8 dispatch).
inline std::vector<float> wire_row(const Case& c, const RankInput& ri, int64_t t) {
  std::vector<float> x(static_cast<size_t>(c.H));
  for (int64_t i = 0; i < c.H; ++i) x[static_cast<size_t>(i)] = bf16_bits_to_float(ri.x.ptr<uint16_t>()[t * c.H + i]);
  if (c.dtype == DType::fp8_e4m3) {
    std::vector<uint8_t> q(static_cast<size_t>(c.H));
    std::vector<float> s(static_cast<size_t>(c.H / kFp8GroupSize));
    quantize_fp8_row(x.data(), c.H, q.data(), s.data(), kFp8GroupSize, c.ue8m0);
    dequantize_fp8_row(q.data(), s.data(), c.H, x.data(), kFp8GroupSize);
  }
  return x;
}

/// Oracle outputs [T, H] bf16 of rank `src` (see the file comment); flat = split by destination rank.
inline Tensor oracle_out(const Case& c, const RankInput& ri, int src, bool flat, bool round_partials = true) {
  const int64_t T = ri.x.size(0), H = c.H;
  Tensor out = Tensor::empty({T, H}, DType::bf16);
  std::vector<float> y(static_cast<size_t>(H)), acc(static_cast<size_t>(H)), part(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> x = wire_row(c, ri, t);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int d = 0; d < (flat ? c.R : 1); ++d) {
      std::fill(part.begin(), part.end(), 0.0f);
      for (int k = 0; k < c.K; ++k) {
        const int32_t e = id_at(ri, t, c.K, k);
        if (e < 0) continue;
        const int dest = e == c.E ? src : expert_rank(c.E, c.R, e);
        if (flat && dest != d) continue;
        expert_fn(e, x.data(), H, y.data());
        const float w = ri.topk_weights.ptr<float>()[t * c.K + k];
        for (int64_t i = 0; i < H; ++i) part[static_cast<size_t>(i)] += w * y[static_cast<size_t>(i)];
      }
      for (int64_t i = 0; i < H; ++i)
        acc[static_cast<size_t>(i)] += flat && round_partials ? round_bf16(part[static_cast<size_t>(i)]) : part[static_cast<size_t>(i)];
    }
    for (int64_t i = 0; i < H; ++i) out.ptr<uint16_t>()[t * H + i] = float_to_bf16_bits(acc[static_cast<size_t>(i)]);
  }
  return out;
}

/// Elements whose bits differ (NaN poison left behind counts as a difference).
inline int64_t count_bit_diffs(const TensorView& a, const TensorView& b) {
  if (a.numel() != b.numel()) return -1;
  int64_t n = 0;
  for (int64_t i = 0; i < a.numel(); ++i) n += a.ptr<uint16_t>()[i] != b.ptr<uint16_t>()[i];
  return n;
}

struct RankResult {
  Tensor out;                ///< [T, H] bf16 of the last iteration
  DispatchStats stats;
  int64_t num_recv_tokens = 0;
  int64_t rows_without_local_selection = 0;
};

/// Builds backend `name` on R CPU ranks, runs `iterations` prepare/experts/finalize rounds on the
/// same object (round i uses inputs[i % size]), returns each rank's last result. Expert outputs and
/// `out` are poisoned (NaN) first, so unwritten or wrongly read rows show.
inline std::vector<RankResult> run_layer(const std::string& name, const Case& c, const std::vector<std::vector<RankInput>>& inputs,
                                         int iterations = 1, double timeout_s = 20.0) {
  auto groups = make_cpu_groups(c.R, timeout_s);
  std::vector<RankResult> res(static_cast<size_t>(c.R));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], c.config());
    std::vector<int> ids;
    const ExpertRange range = expert_range(c.E, c.R, r);
    for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
    if (c.shared) ids.push_back(c.E);
    TestExperts experts(ids, c.H);
    for (int it = 0; it < iterations; ++it) {
      const RankInput& ri = inputs[static_cast<size_t>(it) % inputs.size()][static_cast<size_t>(r)];
      PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
      Tensor expert_out = Tensor::empty(shape, c.expert_out_dtype(p.layout));
      poison(expert_out);
      if (ids.empty()) {
        // As the MoE layer does: a rank without experts runs none; the poison must not be read.
        EXPECT_EQ(p.num_recv_tokens, 0) << name << " rank " << r;
      } else {
        experts.apply(p.experts_input(), expert_out, {});
      }
      RankResult& rr = res[static_cast<size_t>(r)];
      rr.out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      poison(rr.out);
      pf->finalize({expert_out, rr.out});
      rr.stats = pf->stats();
      rr.num_recv_tokens = p.num_recv_tokens;
    }
    res[static_cast<size_t>(r)].rows_without_local_selection = experts.rows_without_local_selection;
  });
  return res;
}

/// Checks every rank's output against the oracle for `name`: bit-exact (LL: the no-EP reference, or
/// with a partial c.ll_combine the per-rank-partial oracle, fp32 partials unrounded; Flat backends:
/// the per-rank-partial oracle) and within bf16 noise of the no-EP reference.
inline void expect_matches_oracle(const std::string& name, const Case& c, const std::vector<RankInput>& in,
                                  const std::vector<RankResult>& res) {
  const bool flat = name != "ll" || c.ll_combine != LlCombine::column;
  const bool round_partials = name != "ll" ? c.flat_combine == FlatCombine::partial_bf16 : c.ll_combine == LlCombine::partial_bf16;
  for (int r = 0; r < c.R; ++r) {
    const RankInput& ri = in[static_cast<size_t>(r)];
    const Tensor& out = res[static_cast<size_t>(r)].out;
    ASSERT_EQ(out.size(0), ri.x.size(0)) << name << " rank " << r << " " << c.describe();
    const Tensor exact = oracle_out(c, ri, r, flat, round_partials);
    EXPECT_EQ(count_bit_diffs(out, exact), 0) << name << " rank " << r << " " << c.describe();
    if (ri.x.size(0) > 0) {
      const Tensor ref = oracle_out(c, ri, r, false);
      EXPECT_LT(rel_l2_error(out, ref), 1e-2) << name << " rank " << r << " " << c.describe();
    }
  }
}

}  // namespace epx::test
