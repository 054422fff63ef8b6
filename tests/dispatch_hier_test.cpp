// Hierarchical ll / ht (src/dispatch/hier/hier.h) on CPU groups that report several nodes
// (make_cpu_groups(R, timeout, ranks_per_node)), against the flat CPU backends (LlCpu / HtCpu, the
// reference) on the same inputs:
//   - one rank per node: prepare outputs bit for bit (same rows, same slot order) and combine bit for
//     bit against the per-node-partial oracle (each node's partial rounded to bf16, summed in fp32,
//     rounded once: the one extra rounding hier.h documents);
//   - several ranks per node (the NVLink fan-out stage, which our 2-GPU machine cannot exercise):
//     combine bit for bit against the hierarchical arithmetic (hier_oracle: the node backend's own
//     combine per node, rounded, summed over nodes) and within bf16 noise of the no-EP reference;
//   - a group on one node never takes the hierarchical path (Capabilities::hierarchical, no node
//     backend), so the single-node fast path is what runs there;
//   - bad input on one rank throws on every rank; a node without experts is Unsupported everywhere.
// Inputs are fresh random rows and routing (never zeros); outputs are poisoned (NaN) first.
#include <gtest/gtest.h>

#include <cstring>

#include "dispatch/hier/hier.h"
#include "dispatch_harness.h"
#include "epx/error.h"

using namespace epx;
using namespace epx::test;

namespace {

struct Snap {
  bool hierarchical = false;
  bool has_node_backend = false;
  int64_t num_recv_tokens = 0;
  std::vector<int64_t> x_shape;
  std::vector<uint8_t> x, x_scales, topk_idx, topk_weights;
  std::vector<int32_t> recv_count;
  Tensor out;
};

std::vector<uint8_t> bytes_of(const TensorView& t) {
  if (!t.defined() || t.numel() == 0) return {};
  std::vector<uint8_t> b(static_cast<size_t>(t.nbytes()));
  std::memcpy(b.data(), t.data, b.size());
  return b;
}

/// `name` on R CPU ranks (ranks_per_node = 0: one node, the flat backend), `rounds` calls on one
/// object (round i uses inputs[i]); the last round's snapshot per rank.
std::vector<Snap> run(const std::string& name, const Case& c, const std::vector<std::vector<RankInput>>& inputs, int ranks_per_node) {
  auto groups = ranks_per_node > 0 ? make_cpu_groups(c.R, 30.0, ranks_per_node) : make_cpu_groups(c.R, 30.0);
  std::vector<Snap> snaps(static_cast<size_t>(c.R));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], c.config());
    std::vector<int> ids;
    const ExpertRange range = expert_range(c.E, c.R, r);
    for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
    if (c.shared) ids.push_back(c.E);
    TestExperts experts(ids, c.H);
    Snap& s = snaps[static_cast<size_t>(r)];
    s.hierarchical = pf->capabilities().hierarchical;
    s.has_node_backend = dispatch::hierarchical_node_backend(*pf) != nullptr;
    for (const auto& round : inputs) {
      const RankInput& ri = round[static_cast<size_t>(r)];
      const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      s.num_recv_tokens = p.num_recv_tokens;
      s.x_shape.assign(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
      s.x = bytes_of(p.x);
      s.x_scales = bytes_of(p.x_scales);
      s.topk_idx = bytes_of(p.topk_idx);
      s.topk_weights = bytes_of(p.topk_weights);
      s.recv_count.assign(p.recv_count.ptr<const int32_t>(), p.recv_count.ptr<const int32_t>() + p.recv_count.numel());
      Tensor expert_out = Tensor::empty(s.x_shape, DType::bf16);
      poison(expert_out);
      if (!ids.empty()) experts.apply(p.experts_input(), expert_out, {});
      s.out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      poison(s.out);
      pf->finalize({expert_out, s.out});
    }
  });
  return snaps;
}

/// ExpertMajor: the valid rows [0, recv_count[l]) of every expert (bytes per row = row_bytes).
bool same_valid_rows(const Snap& a, const Snap& b, const std::vector<uint8_t>& xa, const std::vector<uint8_t>& xb, int64_t row_bytes) {
  if (a.recv_count != b.recv_count || a.x_shape != b.x_shape || xa.size() != xb.size()) return false;
  const int64_t cap = a.x_shape.size() == 3 ? a.x_shape[1] : 0;
  for (size_t l = 0; l < a.recv_count.size(); ++l) {
    const int64_t off = static_cast<int64_t>(l) * cap * row_bytes, n = a.recv_count[l] * row_bytes;
    if (std::memcmp(xa.data() + off, xb.data() + off, static_cast<size_t>(n)) != 0) return false;
  }
  return true;
}

/// The hierarchical combine's exact arithmetic for rank `src` (nodes of P ranks): out[t] =
/// round(sum over nodes n in order of round_bf16(node partial n)), fp32, where the node partial is
/// the node backend's own combine of the token's selections on node n: ll column mode: sum over
/// those columns in column order; otherwise sum over the node's ranks q in order of g(sum over q's
/// columns in column order), g = identity (ll partial_fp32) or round_bf16 (ll partial_bf16; ht,
/// whose rows the Flat experts already weighted and rounded).
Tensor hier_oracle(const std::string& name, const Case& c, const RankInput& ri, int src, int P) {
  const int64_t T = ri.x.size(0), H = c.H;
  Tensor out = Tensor::empty({T, H}, DType::bf16);
  std::vector<float> y(static_cast<size_t>(H)), acc(static_cast<size_t>(H)), node(static_cast<size_t>(H)), rank(static_cast<size_t>(H));
  const bool column = name == "ll" && c.ll_combine == LlCombine::column;
  const bool round_rank = name == "ht" || c.ll_combine == LlCombine::partial_bf16;
  auto rank_of = [&](int32_t e) { return e == c.E ? src : expert_rank(c.E, c.R, e); };
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> x = wire_row(c, ri, t);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int n = 0; n < c.R / P; ++n) {
      std::fill(node.begin(), node.end(), 0.0f);
      for (int q = column ? -1 : n * P; q < (column ? 0 : (n + 1) * P); ++q) {  // column: one pass over the node
        std::fill(rank.begin(), rank.end(), 0.0f);
        for (int k = 0; k < c.K; ++k) {
          const int32_t e = id_at(ri, t, c.K, k);
          if (e < 0) continue;
          if (column ? rank_of(e) / P != n : rank_of(e) != q) continue;
          expert_fn(e, x.data(), H, y.data());
          const float w = ri.topk_weights.ptr<float>()[t * c.K + k];
          for (int64_t i = 0; i < H; ++i) rank[static_cast<size_t>(i)] += w * y[static_cast<size_t>(i)];
        }
        for (int64_t i = 0; i < H; ++i)
          node[static_cast<size_t>(i)] += round_rank && !column ? round_bf16(rank[static_cast<size_t>(i)]) : rank[static_cast<size_t>(i)];
      }
      for (int64_t i = 0; i < H; ++i) acc[static_cast<size_t>(i)] += round_bf16(node[static_cast<size_t>(i)]);
    }
    for (int64_t i = 0; i < H; ++i) out.ptr<uint16_t>()[t * H + i] = float_to_bf16_bits(acc[static_cast<size_t>(i)]);
  }
  return out;
}

/// Hierarchical (ranks_per_node P) against the flat backend on the same inputs (see the file comment).
void check(const std::string& name, const Case& c, int P, int rounds = 2) {
  std::vector<std::vector<RankInput>> inputs;
  for (int i = 0; i < rounds; ++i) {
    Case ci = c;
    ci.seed = c.seed + 100 * static_cast<uint64_t>(i);
    if (i % 2 == 1 && !ci.T.empty()) ci.T.assign(c.T.rbegin(), c.T.rend());
    inputs.push_back(make_inputs(ci));
  }
  const auto flat = run(name, c, inputs, 0);
  const auto hier = run(name, c, inputs, P);
  const std::string what = name + " " + std::to_string(c.R / P) + " nodes x " + std::to_string(P) + " " + c.describe();
  Case oracle_case = c;  // per-node partials: with P = 1 a node is a rank
  for (int r = 0; r < c.R; ++r) {
    const Snap& f = flat[static_cast<size_t>(r)];
    const Snap& h = hier[static_cast<size_t>(r)];
    EXPECT_FALSE(f.hierarchical) << what;
    EXPECT_FALSE(f.has_node_backend) << what;
    EXPECT_TRUE(h.hierarchical) << what;
    EXPECT_TRUE(h.has_node_backend) << what;
    const RankInput& ri = inputs.back()[static_cast<size_t>(r)];
    const int64_t T = ri.x.size(0);
    ASSERT_EQ(h.out.size(0), T) << what;
    if (T > 0) {
      const Tensor ref = oracle_out(c, ri, r, false);
      EXPECT_LT(rel_l2_error(h.out, ref), 1e-2) << what << " rank " << r;
      EXPECT_LT(rel_l2_error(f.out, ref), 1e-2) << what << " rank " << r;
    }
    EXPECT_EQ(count_bit_diffs(h.out, hier_oracle(name, c, ri, r, P)), 0) << what << " rank " << r << " (the hierarchical combine's arithmetic)";
    if (P != 1) continue;
    // One rank per node: the same rows in the same order, and the per-node-partial combine exactly.
    const bool fp8 = c.dtype == DType::fp8_e4m3;
    const int64_t row = fp8 ? c.H : 2 * c.H;
    if (name == "ll") {
      EXPECT_TRUE(same_valid_rows(h, f, h.x, f.x, row)) << what << " rank " << r << ": x / recv_count differ";
      if (fp8) {
        EXPECT_TRUE(same_valid_rows(h, f, h.x_scales, f.x_scales, 4 * (c.H / kFp8GroupSize))) << what << " rank " << r << ": x_scales";
      }
    } else {
      EXPECT_EQ(h.num_recv_tokens, f.num_recv_tokens) << what << " rank " << r;
      EXPECT_EQ(h.x_shape, f.x_shape) << what << " rank " << r;
      EXPECT_TRUE(h.x == f.x) << what << " rank " << r << ": x";
      EXPECT_TRUE(h.x_scales == f.x_scales) << what << " rank " << r << ": x_scales";
      EXPECT_TRUE(h.topk_idx == f.topk_idx) << what << " rank " << r << ": topk_idx";
      EXPECT_TRUE(h.topk_weights == f.topk_weights) << what << " rank " << r << ": topk_weights";
      EXPECT_EQ(h.recv_count, f.recv_count) << what << " rank " << r;
    }
    const Tensor exact = oracle_out(oracle_case, ri, r, /*flat=*/true, /*round_partials=*/true);
    EXPECT_EQ(count_bit_diffs(h.out, exact), 0) << what << " rank " << r << " (per-node partials, one rounding each)";
  }
}

Case base_case(int R, uint64_t seed) {
  Case c;
  c.R = R;
  c.E = 4 * R + 2;  // E % R != 0: nodes of different expert counts
  c.K = 4;
  c.H = 256;
  c.cap = 12;
  c.seed = seed;
  for (int r = 0; r < R; ++r) c.T.push_back((r * 7 + 5) % 13);  // includes 0 and cap
  c.masked = 0.2;
  c.dups = true;
  return c;
}

class Hier : public ::testing::TestWithParam<std::string> {};

TEST_P(Hier, OneRankPerNodeMatchesTheFlatBackendRowForRow) {
  for (int R : {2, 3, 4}) check(GetParam(), base_case(R, 10 + static_cast<uint64_t>(R)), 1);
}

TEST_P(Hier, SeveralRanksPerNodeWithinBf16OfTheReference) {
  check(GetParam(), base_case(4, 21), 2);
  check(GetParam(), base_case(6, 22), 2);
  check(GetParam(), base_case(6, 23), 3);
}

TEST_P(Hier, Fp8SharedRouteInt64AndCombineModes) {
  Case c = base_case(2, 31);
  c.H = 256;
  c.dtype = DType::fp8_e4m3;
  c.shared = true;
  c.K = 3;
  c.idx64 = true;
  check(GetParam(), c, 1);
  c.R = 4;
  c.T = {3, 0, 12, 7};
  c.ue8m0 = true;
  check(GetParam(), c, 2);
  if (GetParam() == "ll") {
    for (LlCombine m : {LlCombine::partial_fp32, LlCombine::partial_bf16}) {
      Case d = base_case(2, 40 + static_cast<int>(m));
      d.ll_combine = m;
      check("ll", d, 1);
      d = base_case(4, 50 + static_cast<int>(m));
      d.ll_combine = m;
      check("ll", d, 2);
    }
  }
}

TEST_P(Hier, OneNodeIsTheFlatPath) {
  // The same code on a group of one node (explicitly, and by default) builds the flat backend.
  for (int per : {0, 4}) {
    auto groups = per > 0 ? make_cpu_groups(4, 30.0, per) : make_cpu_groups(4, 30.0);
    run_ranks(groups, [&](int r) {
      EXPECT_EQ(groups[static_cast<size_t>(r)]->num_nodes(), 1);
      auto pf = make_prepare_finalize(GetParam(), groups[static_cast<size_t>(r)], base_case(4, 1).config());
      EXPECT_FALSE(pf->capabilities().hierarchical);
      EXPECT_EQ(dispatch::hierarchical_node_backend(*pf), nullptr);
    });
  }
}

TEST_P(Hier, BadIdOnOneRankThrowsOnEveryRankAndTheObjectStaysUsable) {
  const Case c = base_case(4, 61);
  const auto in = make_inputs(c);
  auto groups = make_cpu_groups(c.R, 30.0, 2);
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(GetParam(), groups[static_cast<size_t>(r)], c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    Tensor idx = Tensor::empty({ri.x.size(0), c.K}, DType::int32);
    std::memcpy(idx.data(), ri.topk_idx.data(), static_cast<size_t>(idx.nbytes()));
    if (r == 2) idx.ptr<int32_t>()[0] = c.E + 3;
    std::string what;
    try {
      pf->prepare({ri.x, idx, ri.topk_weights});
    } catch (const InvalidArgument& e) {
      what = e.what();
    }
    EXPECT_NE(what.find("topk_idx[0, 0]"), std::string::npos) << "rank " << r << ": " << what;
    const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});  // usable afterwards
    EXPECT_TRUE(p.x.defined());
  });
  ASSERT_GT(c.tokens(2), 0);
}

TEST_P(Hier, NodeWithoutExpertsIsUnsupportedOnEveryRank) {
  Case c = base_case(4, 71);
  c.E = 2;  // ranks 0 and 1 (node 0) hold them; node 1 holds none
  auto groups = make_cpu_groups(c.R, 30.0, 2);
  run_ranks(groups, [&](int r) {
    std::string what;
    try {
      make_prepare_finalize(GetParam(), groups[static_cast<size_t>(r)], c.config());
    } catch (const Unsupported& e) {
      what = e.what();
    }
    EXPECT_NE(what.find("node layout = 2 nodes x 2 ranks"), std::string::npos) << what;
    EXPECT_NE(what.find("node 1 holds none"), std::string::npos) << what;
  });
}

INSTANTIATE_TEST_SUITE_P(LlHt, Hier, ::testing::Values("ll", "ht"), [](const auto& info) { return info.param; });

TEST(HierCpuGroups, RanksPerNodeMustDivide) {
  EXPECT_THROW(make_cpu_groups(4, 30.0, 3), InvalidArgument);
  EXPECT_THROW(make_cpu_groups(4, 30.0, 0), InvalidArgument);
  auto g = make_cpu_groups(6, 30.0, 2);
  const NodeLayout l = g[3]->node_layout();
  EXPECT_EQ(l.describe(), "3 nodes x 2 ranks");
  EXPECT_EQ(l.node, 1);
  EXPECT_EQ(l.local_rank, 1);
}

}  // namespace
