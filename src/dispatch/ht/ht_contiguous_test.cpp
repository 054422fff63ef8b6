// dispatch/ht/ht_contiguous_test.cpp: ht's optional expert-contiguous layout on CPU ranks (HtCpu, the
// reference of ht on CUDA): the layout's invariants against the Flat rows of the same prepare, and
// finalize through it, weighted and unweighted, against the per-rank-partial oracle of
// dispatch_harness.h (bit for bit) with the test experts run on the contiguous rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "dispatch_harness.h"
#include "epx/error.h"
#include "epx/experts.h"

using namespace epx;
using namespace epx::test;

namespace {

struct RankError {
  std::string type, what;
};

/// Runs fn(rank, group) on every rank of a fresh CPU group; collects what each threw.
template <class Fn>
std::vector<RankError> errors_on_ranks(const Case& c, Fn fn) {
  auto groups = make_cpu_groups(c.R, 10.0);
  std::vector<RankError> errs(static_cast<size_t>(c.R));
  run_ranks(groups, [&](int r) {
    try {
      fn(r, groups[static_cast<size_t>(r)]);
    } catch (const InvalidArgument& e) {
      errs[static_cast<size_t>(r)] = {"InvalidArgument", e.what()};
    } catch (const Error& e) {
      errs[static_cast<size_t>(r)] = {"other", e.what()};
    }
  });
  return errs;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Global expert id of local expert l on rank r (the shared route is the last local expert).
int global_id(const Case& c, int r, int l) {
  const ExpertRange range = expert_range(c.E, c.R, r);
  return l < range.size() ? range.begin + l : c.E;
}

void check_contiguous_case(const Case& c) {
  SCOPED_TRACE(c.describe());
  const auto in = make_inputs(c);
  std::vector<RankInput> ones = in;  // the same routing with every weight 1: the unweighted oracle
  for (int r = 0; r < c.R; ++r) {
    Tensor w = Tensor::empty({in[static_cast<size_t>(r)].x.size(0), c.K}, DType::fp32);
    for (int64_t i = 0; i < w.numel(); ++i) w.ptr<float>()[i] = 1.0f;
    ones[static_cast<size_t>(r)].topk_weights = w;
  }
  auto groups = make_cpu_groups(c.R, 30.0);
  std::vector<Tensor> weighted(static_cast<size_t>(c.R)), unweighted(static_cast<size_t>(c.R));
  std::vector<std::string> problems(static_cast<size_t>(c.R));
  run_ranks(groups, [&](int r) {
    DispatchConfig cfg = c.config();
    cfg.expert_contiguous = true;
    auto pf = make_prepare_finalize("ht", groups[static_cast<size_t>(r)], cfg);
    const RankInput& ri = in[static_cast<size_t>(r)];
    const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    const ExpertContiguousLayout& cl = p.contiguous;
    std::string& bad = problems[static_cast<size_t>(r)];
    const int64_t N = p.num_recv_tokens, H = c.H, K = c.K, L = p.recv_count.numel(), M = cl.num_rows;
    const bool fp8 = c.dtype == DType::fp8_e4m3;
    const int64_t payload = fp8 ? H : 2 * H, G = H / kFp8GroupSize;
    const int32_t* off = cl.expert_offsets.ptr<const int32_t>();
    const int32_t* count = p.recv_count.ptr<const int32_t>();
    // Offsets = exclusive prefix sum of the aligned counts.
    int64_t acc = 0;
    for (int64_t l = 0; l < L; ++l) {
      if (off[l] != acc) bad += "offsets[" + std::to_string(l) + "]; ";
      if (count[l] % c.align != 0) bad += "recv_count not aligned; ";
      acc += count[l];
    }
    if (off[L] != acc || M != acc) bad += "M = " + std::to_string(M) + ", want " + std::to_string(acc) + "; ";
    // Every pair: its row holds the Flat row, belongs to the expert, duplicates share it; each
    // expert's rows in received order, then padding.
    std::vector<int64_t> used(static_cast<size_t>(M), -1);
    const int32_t* idx = p.topk_idx.ptr<const int32_t>();
    const int32_t* pair = cl.pair_row.ptr<const int32_t>();
    const int32_t* row_expert = cl.row_expert.ptr<const int32_t>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[n * K + k], row = pair[n * K + k];
        if (e < 0) {
          if (row != -1) bad += "pair_row of a -1 selection; ";
          continue;
        }
        if (row < off[e] || row >= off[e + 1] || row_expert[row] != e) {
          bad += "pair (" + std::to_string(n) + ", " + std::to_string(k) + ") outside its expert; ";
          continue;
        }
        if (used[static_cast<size_t>(row)] >= 0 && used[static_cast<size_t>(row)] != n) bad += "a row shared by two received rows; ";
        used[static_cast<size_t>(row)] = n;
        if (std::memcmp(cl.x.ptr<const uint8_t>() + row * payload, p.x.ptr<const uint8_t>() + n * payload, static_cast<size_t>(payload)) ||
            (fp8 && std::memcmp(cl.x_scales.ptr<const float>() + row * G, p.x_scales.ptr<const float>() + n * G, static_cast<size_t>(G * 4))))
          bad += "row " + std::to_string(row) + " is not received row " + std::to_string(n) + "; ";
      }
    for (int64_t l = 0; l < L; ++l) {
      int64_t prev = -1;
      bool padding = false;
      for (int64_t row = off[l]; row < off[l + 1]; ++row) {
        const int64_t n = used[static_cast<size_t>(row)];
        if (n < 0) {
          padding = true;
          if (row_expert[row] != -1) bad += "padding row_expert; ";
          for (int64_t b = 0; b < payload; ++b)
            if (cl.x.ptr<const uint8_t>()[row * payload + b] != 0) {
              bad += "padding row not zero; ";
              break;
            }
        } else if (padding || n <= prev) {
          bad += "expert " + std::to_string(l) + " rows out of order; ";
        }
        if (n >= 0) prev = n;
      }
    }
    // The experts on the contiguous rows, unweighted; finalize weights them (or not).
    Tensor eo = Tensor::empty({M, H}, DType::bf16);
    poison(eo);
    std::vector<float> xr(static_cast<size_t>(H)), y(static_cast<size_t>(H));
    for (int64_t row = 0; row < M; ++row) {
      if (row_expert[row] < 0) continue;
      if (fp8)
        dequantize_fp8_row(cl.x.ptr<const uint8_t>() + row * H, cl.x_scales.ptr<const float>() + row * G, H, xr.data(), kFp8GroupSize);
      else
        for (int64_t i = 0; i < H; ++i) xr[static_cast<size_t>(i)] = bf16_bits_to_float(cl.x.ptr<const uint16_t>()[row * H + i]);
      expert_fn(global_id(c, r, row_expert[row]), xr.data(), H, y.data());
      for (int64_t i = 0; i < H; ++i) eo.ptr<uint16_t>()[row * H + i] = float_to_bf16_bits(y[static_cast<size_t>(i)]);
    }
    const int64_t T = ri.x.size(0);
    weighted[static_cast<size_t>(r)] = Tensor::empty({T, H}, DType::bf16);
    unweighted[static_cast<size_t>(r)] = Tensor::empty({T, H}, DType::bf16);
    poison(weighted[static_cast<size_t>(r)]);
    poison(unweighted[static_cast<size_t>(r)]);
    FinalizeArgs fa{eo, weighted[static_cast<size_t>(r)]};
    fa.topk_weights = p.topk_weights;
    pf->finalize(fa);
    pf->finalize({eo, unweighted[static_cast<size_t>(r)]});
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(problems[static_cast<size_t>(r)], "") << "rank " << r;
    // Each rank's partial kept fp32 (flat_combine partial_fp32, one rounding) or rounded to bf16 (partial_bf16).
    const bool round_partials = c.flat_combine == FlatCombine::partial_bf16;
    EXPECT_EQ(count_bit_diffs(weighted[static_cast<size_t>(r)], oracle_out(c, in[static_cast<size_t>(r)], r, true, round_partials)), 0)
        << "weighted, rank " << r;
    EXPECT_EQ(count_bit_diffs(unweighted[static_cast<size_t>(r)], oracle_out(c, ones[static_cast<size_t>(r)], r, true, round_partials)), 0)
        << "unweighted, rank " << r;
  }
}

}  // namespace

TEST(HtContiguous, MatchesTheFlatRowsAndTheOracle) {
  Case c;
  c.R = 2;
  c.E = 16;
  c.K = 4;
  c.H = 256;
  c.cap = 64;
  c.T = {64, 37};
  c.dups = true;
  c.masked = 0.2;
  c.align = 8;
  c.seed = 11;
  c.flat_combine = FlatCombine::partial_fp32;  // DispatchConfig's default (one rounding)
  check_contiguous_case(c);
  c.dtype = DType::fp8_e4m3;
  c.zipf = 1.3;
  c.seed = 12;
  check_contiguous_case(c);
  c.flat_combine = FlatCombine::partial_bf16;  // the two-roundings opt-in
  check_contiguous_case(c);
  c.flat_combine = FlatCombine::partial_fp32;
  c.R = 3;
  c.E = 7;
  c.K = 3;
  c.shared = true;
  c.align = 1;
  c.T = {0, 5, 64};
  c.seed = 13;
  check_contiguous_case(c);
  c.T = {0, 0, 0};
  check_contiguous_case(c);
}

TEST(HtContiguous, ExpertsOnTheContiguousLayoutMatchTheFlatPath) {
  // What a grouped-GEMM user plugs together: ht's prepare with expert_contiguous, Experts::apply on
  // ActivationLayout::Contiguous with the layout's [L + 1] expert_offsets (padding rows included, aligned
  // to 8), then finalize weighting the unweighted rows; against the Flat path of the same prepare
  // (Experts::apply on the Flat rows weights them, finalize sums). Real CPU experts (bf16 weights).
  for (const DType dt : {DType::bf16, DType::fp8_e4m3}) {
    Case c;
    c.R = 2;
    c.E = 8;
    c.K = 4;
    c.H = 256;
    c.cap = 32;
    c.T = {32, 19};
    c.dups = true;
    c.masked = 0.2;
    c.align = 8;
    c.dtype = dt;
    c.seed = dt == DType::bf16 ? 21 : 22;
    c.flat_combine = FlatCombine::partial_fp32;  // the Flat path's experts write fp32 partials (the default)
    SCOPED_TRACE(c.describe());
    std::vector<std::shared_ptr<const ExpertWeights>> all;
    for (int e = 0; e < c.E; ++e) all.push_back(ExpertWeights::random(WeightFormat::bf16, c.H, 64, 700 + e));
    const auto in = make_inputs(c);
    auto groups = make_cpu_groups(c.R, 30.0);
    std::vector<Tensor> via_contiguous(static_cast<size_t>(c.R)), via_flat(static_cast<size_t>(c.R));
    run_ranks(groups, [&](int r) {
      DispatchConfig cfg = c.config();
      cfg.expert_contiguous = true;
      auto pf = make_prepare_finalize("ht", groups[static_cast<size_t>(r)], cfg);
      const ExpertRange range = expert_range(c.E, c.R, r);
      auto experts = make_experts_cpu({all.begin() + range.begin, all.begin() + range.begin + range.size()});
      const RankInput& ri = in[static_cast<size_t>(r)];
      const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      const ExpertContiguousLayout& cl = p.contiguous;
      const int64_t T = ri.x.size(0);
      const ExpertsInput ec = cl.experts_input();
      Tensor eo = Tensor::empty({cl.num_rows, c.H}, DType::bf16), ef;
      poison(eo);
      experts->apply(ec, eo);
      via_contiguous[static_cast<size_t>(r)] = Tensor::empty({T, c.H}, DType::bf16);
      FinalizeArgs fa{eo, via_contiguous[static_cast<size_t>(r)]};
      fa.topk_weights = p.topk_weights;
      pf->finalize(fa);
      // The Flat path: ht without expert_contiguous (whose finalize takes the Flat rows).
      auto pf_flat = make_prepare_finalize("ht", groups[static_cast<size_t>(r)], c.config());
      const PrepareResult pfl = pf_flat->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      ef = Tensor::empty({pfl.num_recv_tokens, c.H}, c.expert_out_dtype(ActivationLayout::Flat));
      poison(ef);
      experts->apply(pfl.experts_input(), ef);
      via_flat[static_cast<size_t>(r)] = Tensor::empty({T, c.H}, DType::bf16);
      pf_flat->finalize({ef, via_flat[static_cast<size_t>(r)]});
    });
    for (int r = 0; r < c.R; ++r) {
      const Tensor& a = via_contiguous[static_cast<size_t>(r)];
      const Tensor& b = via_flat[static_cast<size_t>(r)];
      int64_t non_finite = 0;
      for (int64_t i = 0; i < a.numel(); ++i) non_finite += !std::isfinite(bf16_bits_to_float(a.ptr<const uint16_t>()[i]));
      EXPECT_EQ(non_finite, 0) << "rank " << r;
      // Same weights and order (fp32 sum over k, the ranks' fp32 partials summed, one rounding); the expert rows come from sgemm
      // batches of other sizes (padding rows, duplicates shared), so allow the bf16 tolerance of METHOD.md.
      EXPECT_LT(rel_l2_error(a, b), 1e-2) << "rank " << r << ", " << count_bit_diffs(a, b) << " elements differ in bits";
    }
  }
}

TEST(HtContiguous, AlignmentWhoseRowsPassInt32IsRefusedAtCreate) {
  // The aligned per-expert counts (recv_count) and the layout's expert_offsets are int32. expert_alignment = 2^29
  // over 4 local experts made M = 2^31 wrap to -2^31 ("TensorView: shape[0] = -2147483648"), 2^30 wrapped to 0 and
  // the layout was written past its rows (segfault). ht's create now bounds the worst case it also sizes on CUDA,
  // R * num_max_dispatch_tokens_per_rank * min(top_k, L) + L * (expert_alignment - 1), by int32, on every rank.
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 4;
  c.H = 8;
  c.cap = 4;
  for (const bool contiguous : {false, true}) {
    for (const int align : {1 << 29, 1 << 30, 2147483647}) {
      const auto errs = errors_on_ranks(c, [&](int, std::shared_ptr<Group> g) {
        DispatchConfig cfg = c.config();
        cfg.expert_alignment = align;
        cfg.expert_contiguous = contiguous;
        make_prepare_finalize("ht", g, cfg);
      });
      for (int r = 0; r < c.R; ++r) {
        EXPECT_EQ(errs[r].type, "InvalidArgument") << align << " rank " << r;
        EXPECT_TRUE(contains(errs[r].what, "ht.create: expert_alignment = " + std::to_string(align))) << errs[r].what;
        EXPECT_TRUE(contains(errs[r].what, "within int32")) << errs[r].what;
      }
    }
  }
  // The largest alignment that fits still runs: 2 * 4 * 4 + 4 * (a - 1) <= 2^31 - 1.
  Case ok = c;
  ok.align = (2147483647 - 32) / 4 + 1;
  ok.T = {1, 1};
  ok.masked = 0.0;
  const auto in = make_inputs(ok);
  const auto errs = errors_on_ranks(ok, [&](int r, std::shared_ptr<Group> g) {
    DispatchConfig cfg = ok.config();
    auto pf = make_prepare_finalize("ht", g, cfg);
    const RankInput& ri = in[static_cast<size_t>(r)];
    const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    for (int l = 0; l < p.recv_count.shape[0]; ++l) {
      const int32_t n = p.recv_count.ptr<const int32_t>()[l];
      EXPECT_TRUE(n == 0 || n == ok.align) << "recv_count[" << l << "] = " << n;
    }
  });
  for (int r = 0; r < ok.R; ++r) EXPECT_EQ(errs[r].type, "") << errs[r].what;
}

TEST(HtContiguous, ErrorsNameTheArgument) {
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 2;
  c.H = 64;
  c.cap = 16;
  const auto in = make_inputs(c);
  // expert_contiguous is an ht option.
  auto errs = errors_on_ranks(c, [&](int, std::shared_ptr<Group> g) {
    DispatchConfig cfg = c.config();
    cfg.expert_contiguous = true;
    make_prepare_finalize("all2allv", g, cfg);
  });
  for (int r = 0; r < c.R; ++r) EXPECT_TRUE(contains(errs[r].what, "expert_contiguous")) << errs[r].what;
  // Combine weights without the contiguous layout: InvalidArgument on every rank.
  errs = errors_on_ranks(c, [&](int r, std::shared_ptr<Group> g) {
    auto pf = make_prepare_finalize("ht", g, c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    Tensor eo = Tensor::zeros({p.num_recv_tokens, c.H}, DType::bf16), out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
    FinalizeArgs fa{eo, out};
    fa.topk_weights = p.topk_weights;
    pf->finalize(fa);
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument") << "rank " << r;
    EXPECT_TRUE(contains(errs[r].what, "topk_weights")) << errs[r].what;
  }
  // Every other backend: FinalizeArgs::topk_weights is rejected on every rank.
  for (const std::string name : {"naive", "allgather_reducescatter", "all2allv", "ll"}) {
    errs = errors_on_ranks(c, [&](int r, std::shared_ptr<Group> g) {
      auto pf = make_prepare_finalize(name, g, c.config());
      const RankInput& ri = in[static_cast<size_t>(r)];
      const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
      Tensor eo = Tensor::zeros(shape, DType::bf16), out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      FinalizeArgs fa{eo, out};
      fa.topk_weights = ri.topk_weights;
      pf->finalize(fa);
    });
    for (int r = 0; r < c.R; ++r) {
      EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " rank " << r;
      EXPECT_TRUE(contains(errs[r].what, "topk_weights")) << name << ": " << errs[r].what;
    }
  }
  // Contiguous: expert_out with N_recv rows instead of M on rank 1 -> every rank throws.
  errs = errors_on_ranks(c, [&](int r, std::shared_ptr<Group> g) {
    DispatchConfig cfg = c.config();
    cfg.expert_contiguous = true;
    auto pf = make_prepare_finalize("ht", g, cfg);
    const RankInput& ri = in[static_cast<size_t>(r)];
    const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    Tensor eo = Tensor::zeros({r == 1 ? p.contiguous.num_rows + 1 : p.contiguous.num_rows, c.H}, DType::bf16);
    Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
    pf->finalize({eo, out});
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument") << "rank " << r;
    EXPECT_TRUE(contains(errs[r].what, r == 1 ? "expert_out.shape" : "rank 1")) << errs[r].what;
  }
}
