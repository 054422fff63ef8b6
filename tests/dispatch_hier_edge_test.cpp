// tests/dispatch_hier_edge_test.cpp: awkward input (BEHAVIOUR.md) for the hierarchical ll / ht
// (src/dispatch/hier/hier.h) on CPU groups that report several nodes (make_cpu_groups(R, timeout, P), and
// a wrapper group for layouts make_cpu_groups cannot express). Every case either gives the flat
// reference's answer on every rank (rounds of one object, each checked) or a clear epx::Error on
// every rank, after which the object still works; never a hang (the groups' timeout is short, so a
// rank left waiting shows up as a Timeout / CommError instead of the expected error).
//
// Oracles (tests/dispatch_harness.h): with one rank per node, out is bit for bit oracle_out(flat,
// round_partials) (the per-node bf16 partials, summed in fp32, rounded once, hier.h "Numerics");
// with several ranks per node, within bf16 noise of it (the existing dispatch_hier_test checks the
// exact hierarchical arithmetic there). Rows without a valid selection are exactly zero.
// Inputs are fresh random rows and routing; outputs are poisoned (NaN) first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "dispatch/hier/hier.h"
#include "dispatch_harness.h"
#include "epx/config.h"
#include "epx/error.h"
#include "epx/moe.h"

using namespace epx;
using namespace epx::test;

namespace {

constexpr double kTimeout = 10.0;  // a rank left waiting fails within this, instead of hanging the test

struct Outcome {
  Tensor out;         ///< [T, H] bf16 when the round ran
  std::string kind;   ///< "" ok, else "InvalidArgument", "Unsupported", "Timeout", "CommError", "Error"
  std::string what;
};

std::pair<std::string, std::string> classify(const std::exception_ptr& ep) {
  try {
    std::rethrow_exception(ep);
  } catch (const InvalidArgument& e) {
    return {"InvalidArgument", e.what()};
  } catch (const Unsupported& e) {
    return {"Unsupported", e.what()};
  } catch (const Timeout& e) {
    return {"Timeout", e.what()};
  } catch (const CommError& e) {
    return {"CommError", e.what()};
  } catch (const Error& e) {
    return {"Error", e.what()};
  } catch (const std::exception& e) {
    return {"std::exception", e.what()};
  }
}

std::vector<int> local_ids(const Case& c, int r) {
  std::vector<int> ids;
  const ExpertRange range = expert_range(c.E, c.R, r);
  for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
  if (c.shared) ids.push_back(c.E);
  return ids;
}

/// `name` on `groups` (one object per rank), one prepare / experts / finalize per round; what each
/// rank got in each round ([round][rank]). A round that throws on a rank is recorded, and that rank
/// goes on with the next round.
std::vector<std::vector<Outcome>> run_rounds(const std::string& name, const Case& c, const std::vector<std::shared_ptr<Group>>& groups,
                                             const std::vector<std::vector<RankInput>>& rounds, DispatchConfig cfg) {
  std::vector<std::vector<Outcome>> res(rounds.size(), std::vector<Outcome>(static_cast<size_t>(c.R)));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], cfg);
    TestExperts experts(local_ids(c, r), c.H);
    for (size_t i = 0; i < rounds.size(); ++i) {
      const RankInput& ri = rounds[i][static_cast<size_t>(r)];
      Outcome& o = res[i][static_cast<size_t>(r)];
      try {
        const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
        std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
        Tensor eo = Tensor::empty(shape, DType::bf16);
        poison(eo);
        if (experts.num_local_experts() > 0) experts.apply(p.experts_input(), eo, {});
        o.out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
        poison(o.out);
        pf->finalize({eo, o.out});
      } catch (...) {
        std::tie(o.kind, o.what) = classify(std::current_exception());
      }
    }
  });
  return res;
}

/// Element-wise: NaN where the oracle has NaN, else the same bits (P = 1) or close (P > 1); rows
/// the oracle has at exact zero are exact zero.
void expect_out(const Tensor& got, const Tensor& want, int P, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const uint16_t* g = got.ptr<const uint16_t>();
  const uint16_t* w = want.ptr<const uint16_t>();
  int64_t bad = 0, first = -1;
  double num = 0, den = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float a = bf16_bits_to_float(g[i]), b = bf16_bits_to_float(w[i]);
    bool ok;
    if (std::isnan(b)) ok = std::isnan(a);
    else if (std::isinf(b) || P == 1 || b == 0.0f) ok = g[i] == w[i] || (a == 0.0f && b == 0.0f);
    else {
      ok = std::isfinite(a);
      num += (static_cast<double>(a) - b) * (static_cast<double>(a) - b);
      den += static_cast<double>(b) * b;
    }
    if (!ok && first < 0) first = i;
    bad += !ok;
  }
  EXPECT_EQ(bad, 0) << what << ": first bad element " << first << " got " << (first >= 0 ? bf16_bits_to_float(g[first]) : 0.0f)
                    << " want " << (first >= 0 ? bf16_bits_to_float(w[first]) : 0.0f);
  if (den > 0) {
    EXPECT_LT(std::sqrt(num / den), 1e-2) << what;
  }
}

/// Every round on every rank ran and matches the oracle (P ranks per node).
void expect_rounds_ok(const Case& c, int P, const std::vector<std::vector<RankInput>>& rounds,
                      const std::vector<std::vector<Outcome>>& res, const std::string& what) {
  for (size_t i = 0; i < rounds.size(); ++i)
    for (int r = 0; r < c.R; ++r) {
      const Outcome& o = res[i][static_cast<size_t>(r)];
      const std::string w = what + " round " + std::to_string(i) + " rank " + std::to_string(r);
      ASSERT_EQ(o.kind, "") << w << ": " << o.what;
      ASSERT_EQ(o.out.size(0), rounds[i][static_cast<size_t>(r)].x.size(0)) << w;
      expect_out(o.out, oracle_out(c, rounds[i][static_cast<size_t>(r)], r, /*flat=*/true, /*round_partials=*/true), P, w);
    }
}

/// Every rank of one round threw `kind` with every part of `parts` in its message.
void expect_round_throws(const std::vector<Outcome>& round, const std::string& kind, const std::vector<std::string>& parts,
                         const std::string& what) {
  for (size_t r = 0; r < round.size(); ++r) {
    EXPECT_EQ(round[r].kind, kind) << what << " rank " << r << ": " << round[r].what;
    for (const auto& p : parts) {
      EXPECT_NE(round[r].what.find(p), std::string::npos) << what << " rank " << r << ": " << round[r].what;
    }
  }
}

Case small_case(int R, uint64_t seed) {
  Case c;
  c.R = R;
  c.E = 3 * R + 1;
  c.K = 4;
  c.H = 64;
  c.cap = 9;
  c.seed = seed;
  c.masked = 0.2;
  c.dups = true;
  for (int r = 0; r < R; ++r) c.T.push_back((r * 5 + 3) % 10);
  return c;
}

std::vector<RankInput> inputs_with_T(Case c, const std::vector<int64_t>& T, uint64_t seed) {
  c.T = T;
  c.seed = seed;
  return make_inputs(c);
}

void set_id(RankInput& ri, int K, int64_t t, int k, int64_t v) {
  if (ri.topk_idx.dtype() == DType::int64) ri.topk_idx.ptr<int64_t>()[t * K + k] = v;
  else ri.topk_idx.ptr<int32_t>()[t * K + k] = static_cast<int32_t>(v);
}

RankInput copy_input(const RankInput& ri) {
  RankInput c;
  c.x = Tensor::empty({ri.x.size(0), ri.x.size(1)}, DType::bf16);
  c.topk_idx = Tensor::empty({ri.topk_idx.size(0), ri.topk_idx.size(1)}, ri.topk_idx.dtype());
  c.topk_weights = Tensor::empty({ri.topk_weights.size(0), ri.topk_weights.size(1)}, DType::fp32);
  std::memcpy(c.x.data(), ri.x.data(), static_cast<size_t>(ri.x.nbytes()));
  std::memcpy(c.topk_idx.data(), ri.topk_idx.data(), static_cast<size_t>(ri.topk_idx.nbytes()));
  std::memcpy(c.topk_weights.data(), ri.topk_weights.data(), static_cast<size_t>(ri.topk_weights.nbytes()));
  return c;
}

/// A group that forwards to `inner` but reports the node layout of `keys` (equal keys = one node):
/// layouts make_cpu_groups cannot express (nodes of unequal size, nodes of non-consecutive ranks).
class LayoutGroup final : public Group {
 public:
  LayoutGroup(std::shared_ptr<Group> inner, const std::vector<int64_t>& keys)
      : inner_(std::move(inner)), layout_(NodeLayout::from_keys(keys, inner_->rank())) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Device device() const override { return inner_->device(); }
  std::string name() const override { return inner_->name() + "-layout"; }
  double timeout_s() const override { return inner_->timeout_s(); }
  void barrier() override { inner_->barrier(); }
  void all_gather(const void* s, void* r, int64_t b, Stream st) override { inner_->all_gather(s, r, b, st); }
  void all_gatherv(const void* s, void* r, const std::vector<int64_t>& b, Stream st) override { inner_->all_gatherv(s, r, b, st); }
  void all_reduce_sum(const void* s, void* r, int64_t n, DType d, Stream st) override { inner_->all_reduce_sum(s, r, n, d, st); }
  void reduce_scatterv(const void* s, void* r, const std::vector<int64_t>& c, DType d, Stream st) override {
    inner_->reduce_scatterv(s, r, c, d, st);
  }
  void all_to_allv(const void* s, const std::vector<int64_t>& sb, void* r, const std::vector<int64_t>& rb, Stream st) override {
    inner_->all_to_allv(s, sb, r, rb, st);
  }
  SymmetricBuffer alloc_symmetric(int64_t bytes) override { return inner_->alloc_symmetric(bytes); }
  NodeLayout node_layout() const override { return layout_; }

 private:
  std::shared_ptr<Group> inner_;
  NodeLayout layout_;
};

class HierEdge : public ::testing::TestWithParam<std::string> {};

// ---- tokens and selections ----------------------------------------------------------------------

TEST_P(HierEdge, AllSelectionsMinusOneGiveExactZerosOnEveryRank) {
  for (int P : {1, 2}) {
    Case c = small_case(4, 3);
    c.masked = 1.0;  // every selection -1 on every rank
    const std::vector<std::vector<RankInput>> rounds = {inputs_with_T(c, {0, 9, 4, 1}, 3), inputs_with_T(c, {9, 0, 1, 4}, 4)};
    auto groups = make_cpu_groups(c.R, kTimeout, P);
    const auto res = run_rounds(GetParam(), c, groups, rounds, c.config());
    expect_rounds_ok(c, P, rounds, res, GetParam() + " all -1 P=" + std::to_string(P));
    for (const auto& round : res)
      for (const Outcome& o : round)
        for (int64_t i = 0; i < o.out.numel(); ++i) {
          ASSERT_EQ(o.out.ptr<uint16_t>()[i], 0) << "element " << i;
        }
  }
}

TEST_P(HierEdge, OneRankAllMinusOneOthersRouted) {
  Case c = small_case(4, 5);
  std::vector<RankInput> in = inputs_with_T(c, {7, 9, 3, 0}, 5);
  for (int64_t t = 0; t < in[1].x.size(0); ++t)
    for (int k = 0; k < c.K; ++k) set_id(in[1], c.K, t, k, -1);
  for (int P : {1, 2}) {
    auto groups = make_cpu_groups(c.R, kTimeout, P);
    const auto res = run_rounds(GetParam(), c, groups, {in}, c.config());
    expect_rounds_ok(c, P, {in}, res, GetParam() + " rank 1 all -1 P=" + std::to_string(P));
  }
}

TEST_P(HierEdge, ZeroTokensOnEveryRank) {
  Case c = small_case(4, 6);
  const std::vector<std::vector<RankInput>> rounds = {inputs_with_T(c, {0, 0, 0, 0}, 6), inputs_with_T(c, {2, 0, 0, 9}, 7),
                                                      inputs_with_T(c, {0, 0, 0, 0}, 8)};
  for (int P : {1, 2}) {
    auto groups = make_cpu_groups(c.R, kTimeout, P);
    expect_rounds_ok(c, P, rounds, run_rounds(GetParam(), c, groups, rounds, c.config()), GetParam() + " T=0 P=" + std::to_string(P));
  }
}

TEST_P(HierEdge, DuplicateExpertIdsInARowAddUp) {
  // Rows whose routed columns name one expert K-1 times (on another node, on the own node), one
  // expert twice beside experts of other nodes, and one expert of each kind twice: each copy
  // contributes (weights add). The shared route stays in the last column (the FHMoE rule).
  Case c = small_case(4, 9);
  c.shared = true;
  c.K = 5;
  std::vector<RankInput> in = inputs_with_T(c, {6, 6, 6, 6}, 9);
  for (int r = 0; r < c.R; ++r) {
    const int remote = expert_range(c.E, c.R, (r + 2) % c.R).begin, own = expert_range(c.E, c.R, r).begin;
    const int next = expert_range(c.E, c.R, (r + 1) % c.R).begin;
    for (int k = 0; k + 1 < c.K; ++k) {
      set_id(in[r], c.K, 0, k, remote);
      set_id(in[r], c.K, 1, k, own);
      set_id(in[r], c.K, 2, k, k < 2 ? own : remote);
      set_id(in[r], c.K, 3, k, k < 2 ? remote : next);
    }
    for (int t = 0; t < 4; ++t) set_id(in[r], c.K, t, c.K - 1, t == 3 ? -1 : c.E);
  }
  for (int P : {1, 2}) {
    auto groups = make_cpu_groups(c.R, kTimeout, P);
    expect_rounds_ok(c, P, {in}, run_rounds(GetParam(), c, groups, {in}, c.config()), GetParam() + " dups P=" + std::to_string(P));
  }
}

TEST_P(HierEdge, RepeatedRoundsWithDifferentTOnOneObject) {
  // One object, the same internal buffers, T changing every round (0, capacity, 1, ...), shared route
  // and int64 ids in one of them: every round is checked, not only the last.
  for (int P : {1, 2}) {
    Case c = small_case(4, 11);
    std::vector<std::vector<RankInput>> rounds;
    const std::vector<std::vector<int64_t>> Ts = {{9, 0, 1, 8}, {0, 9, 9, 0}, {1, 1, 1, 1}, {9, 9, 9, 9}, {0, 0, 5, 0}, {3, 7, 0, 9}};
    for (size_t i = 0; i < Ts.size(); ++i) rounds.push_back(inputs_with_T(c, Ts[i], 100 + i));
    auto groups = make_cpu_groups(c.R, kTimeout, P);
    expect_rounds_ok(c, P, rounds, run_rounds(GetParam(), c, groups, rounds, c.config()), GetParam() + " rounds P=" + std::to_string(P));
  }
}

TEST_P(HierEdge, NanAndInfWeightsPropagateOnlyWhereSelected) {
  // NaN / Inf weights of valid selections reach exactly the rows the reference gives NaN / Inf (the
  // other rows are unchanged); a NaN weight on a -1 selection changes nothing (select, not multiply).
  Case c = small_case(4, 13);
  c.masked = 0.0;
  std::vector<RankInput> in = inputs_with_T(c, {5, 5, 5, 5}, 13);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int r = 0; r < c.R; ++r) {
    float* w = in[r].topk_weights.ptr<float>();
    set_id(in[r], c.K, 0, 1, expert_range(c.E, c.R, (r + 3) % c.R).begin);  // a remote node's expert
    w[0 * c.K + 1] = nan;
    w[1 * c.K + 2] = inf;
    w[2 * c.K + 0] = -inf;
    set_id(in[r], c.K, 3, 3, -1);
    w[3 * c.K + 3] = nan;  // no selection: must not matter
  }
  for (int P : {1, 2}) {
    auto groups = make_cpu_groups(c.R, kTimeout, P);
    const auto res = run_rounds(GetParam(), c, groups, {in}, c.config());
    expect_rounds_ok(c, P, {in}, res, GetParam() + " NaN/Inf weights P=" + std::to_string(P));
    for (int r = 0; r < c.R; ++r) {
      const Tensor& o = res[0][static_cast<size_t>(r)].out;
      if (!o.defined()) continue;
      for (int64_t i = 3 * c.H; i < 5 * c.H; ++i) {
        EXPECT_TRUE(std::isfinite(bf16_bits_to_float(o.ptr<uint16_t>()[i]))) << "rank " << r << " element " << i << " P=" << P;
      }
    }
  }
}

// ---- bad arguments: clear error on every rank, nothing held lost ----------------------------------

TEST_P(HierEdge, TooManyTokensOnOneRankThrowsEverywhereAndTheLastPrepareSurvives) {
  // Round 0 prepares fine; rank 2 then passes T = capacity + 1: every rank throws naming both
  // numbers, before anything is sent; finalize of round 0's prepare still gives round 0's answer.
  Case c = small_case(4, 15);
  const std::vector<RankInput> good = inputs_with_T(c, {4, 9, 2, 0}, 15);
  const std::vector<RankInput> big = inputs_with_T(c, {3, 3, c.cap + 1, 3}, 16);
  for (int P : {1, 2}) {
    auto groups = make_cpu_groups(c.R, kTimeout, P);
    std::vector<Outcome> bad(static_cast<size_t>(c.R)), after(static_cast<size_t>(c.R));
    run_ranks(groups, [&](int r) {
      auto pf = make_prepare_finalize(GetParam(), groups[static_cast<size_t>(r)], c.config());
      TestExperts experts(local_ids(c, r), c.H);
      const RankInput& g = good[static_cast<size_t>(r)];
      const PrepareResult p = pf->prepare({g.x, g.topk_idx, g.topk_weights});
      try {
        const RankInput& b = big[static_cast<size_t>(r)];
        pf->prepare({b.x, b.topk_idx, b.topk_weights});
      } catch (...) {
        std::tie(bad[r].kind, bad[r].what) = classify(std::current_exception());
      }
      try {
        std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
        Tensor eo = Tensor::empty(shape, DType::bf16);
        poison(eo);
        if (experts.num_local_experts() > 0) experts.apply(p.experts_input(), eo, {});
        after[r].out = Tensor::empty({g.x.size(0), c.H}, DType::bf16);
        poison(after[r].out);
        pf->finalize({eo, after[r].out});
      } catch (...) {
        std::tie(after[r].kind, after[r].what) = classify(std::current_exception());
      }
    });
    const std::string what = GetParam() + " T > capacity P=" + std::to_string(P);
    expect_round_throws(bad, "InvalidArgument", {"num_tokens", std::to_string(c.cap + 1), "num_max_dispatch_tokens_per_rank = " + std::to_string(c.cap)},
                        what);
    expect_rounds_ok(c, P, {good}, {after}, what + " (finalize of the earlier prepare)");
  }
}

TEST_P(HierEdge, OutOfRangeIdsThrowEverywhereNamingTheValue) {
  for (const bool idx64 : {false, true}) {
    Case c = small_case(4, 17);
    c.idx64 = idx64;
    const std::vector<RankInput> good = make_inputs(c);
    std::vector<int64_t> values = {-2, c.E, c.E + 1, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
    if (idx64) values.insert(values.end(), {int64_t{1} << 40, -(int64_t{1} << 40), (int64_t{1} << 32) + 1, (int64_t{1} << 32) - 1});
    for (int64_t v : values) {
      std::vector<RankInput> in;
      for (const auto& ri : good) in.push_back(copy_input(ri));
      set_id(in[1], c.K, 2, 3, v);  // (1 << 32) + 1 truncates to 1 in int32, 2^32 - 1 to -1: both must still be refused
      const std::vector<std::vector<RankInput>> rounds = {in, good};
      auto groups = make_cpu_groups(c.R, kTimeout, 2);
      const auto res = run_rounds(GetParam(), c, groups, rounds, c.config());
      const std::string what = GetParam() + " id " + std::to_string(v) + (idx64 ? " int64" : " int32");
      expect_round_throws(res[0], "InvalidArgument", {"topk_idx[2, 3]", std::to_string(v), "num_experts = " + std::to_string(c.E)}, what);
      expect_rounds_ok(c, 2, {good}, {res[1]}, what + " (the next round)");
    }
  }
}

TEST_P(HierEdge, FinalizeWithoutPrepareAndWrongOutShapeThrowEverywhere) {
  Case c = small_case(4, 19);
  const std::vector<RankInput> in = make_inputs(c);
  for (int P : {1, 2}) {
    auto groups = make_cpu_groups(c.R, kTimeout, P);
    std::vector<Outcome> first(static_cast<size_t>(c.R)), shape(static_cast<size_t>(c.R)), ok(static_cast<size_t>(c.R)),
        again(static_cast<size_t>(c.R));
    run_ranks(groups, [&](int r) {
      auto pf = make_prepare_finalize(GetParam(), groups[static_cast<size_t>(r)], c.config());
      TestExperts experts(local_ids(c, r), c.H);
      const RankInput& ri = in[static_cast<size_t>(r)];
      try {
        Tensor eo = Tensor::empty({1, c.H}, DType::bf16), out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
        pf->finalize({eo, out});
      } catch (...) {
        std::tie(first[r].kind, first[r].what) = classify(std::current_exception());
      }
      const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      std::vector<int64_t> s(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
      Tensor eo = Tensor::empty(s, DType::bf16);
      poison(eo);
      if (experts.num_local_experts() > 0) experts.apply(p.experts_input(), eo, {});
      try {  // rank 3 passes out with one row too many
        Tensor out = Tensor::empty({ri.x.size(0) + (r == 3 ? 1 : 0), c.H}, DType::bf16);
        pf->finalize({eo, out});
      } catch (...) {
        std::tie(shape[r].kind, shape[r].what) = classify(std::current_exception());
      }
      for (Outcome* o : {&ok[r], &again[r]}) {  // then finalize works, also twice on one prepare
        try {
          o->out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
          poison(o->out);
          pf->finalize({eo, o->out});
        } catch (...) {
          std::tie(o->kind, o->what) = classify(std::current_exception());
        }
      }
    });
    const std::string what = GetParam() + " P=" + std::to_string(P);
    expect_round_throws(first, "InvalidArgument", {"no prepare to finalize"}, what + " finalize before prepare");
    expect_round_throws(shape, "InvalidArgument", {"out"}, what + " wrong out shape on rank 3");
    expect_rounds_ok(c, P, {in}, {ok}, what + " finalize after the refused one");
    expect_rounds_ok(c, P, {in}, {again}, what + " a second finalize of one prepare");
  }
}

// ---- node layouts ---------------------------------------------------------------------------------

TEST_P(HierEdge, ManyNodes) {
  // 8 and 12 nodes, with experts split unevenly, and fewer experts than ranks (a rank with none, but
  // every node with one).
  for (const auto& [R, P, E] : std::vector<std::tuple<int, int, int>>{{8, 1, 19}, {8, 2, 8}, {12, 1, 13}, {12, 3, 10}, {4, 2, 3}}) {
    Case c = small_case(R, 21 + static_cast<uint64_t>(R * 10 + P));
    c.E = E;
    c.K = std::min(4, E);
    std::vector<std::vector<RankInput>> rounds;
    for (int i = 0; i < 2; ++i) {
      std::vector<int64_t> T;
      for (int r = 0; r < R; ++r) T.push_back((r * 3 + i * 5) % (c.cap + 1));
      rounds.push_back(inputs_with_T(c, T, 200 + static_cast<uint64_t>(i)));
    }
    auto groups = make_cpu_groups(R, kTimeout, P);
    expect_rounds_ok(c, P, rounds, run_rounds(GetParam(), c, groups, rounds, c.config()),
                     GetParam() + " " + std::to_string(R / P) + " nodes x " + std::to_string(P) + " E=" + std::to_string(E));
  }
}

TEST_P(HierEdge, ThirtyTwoNodesWorkThirtyThreeAreUnsupportedOnEveryRank) {
  {
    Case c = small_case(32, 23);
    c.E = 40;
    c.H = 16;
    c.cap = 3;
    c.T.clear();
    for (int r = 0; r < 32; ++r) c.T.push_back(r % 4);
    const std::vector<std::vector<RankInput>> rounds = {make_inputs(c)};
    auto groups = make_cpu_groups(32, kTimeout, 1);
    expect_rounds_ok(c, 1, rounds, run_rounds(GetParam(), c, groups, rounds, c.config()), GetParam() + " 32 nodes");
  }
  Case c = small_case(33, 24);
  c.H = 16;
  auto groups = make_cpu_groups(33, kTimeout, 1);
  std::vector<Outcome> res(33);
  run_ranks(groups, [&](int r) {
    try {
      make_prepare_finalize(GetParam(), groups[static_cast<size_t>(r)], c.config());
    } catch (...) {
      std::tie(res[r].kind, res[r].what) = classify(std::current_exception());
    }
  });
  expect_round_throws(res, "Unsupported", {"33 nodes", "at most 32 nodes"}, GetParam() + " 33 nodes");
}

TEST_P(HierEdge, UnequalOrInterleavedNodesAreUnsupportedOnEveryRank) {
  for (const auto& [keys, part] : std::vector<std::pair<std::vector<int64_t>, std::string>>{
           {{0, 0, 1}, "nodes of equal size"}, {{0, 0, 0, 1, 1}, "nodes of equal size"}, {{0, 1, 0, 1}, "consecutive"}}) {
    const int R = static_cast<int>(keys.size());
    Case c = small_case(R, 25);
    auto inner = make_cpu_groups(R, kTimeout);
    std::vector<std::shared_ptr<Group>> groups;
    for (auto& g : inner) groups.push_back(std::make_shared<LayoutGroup>(g, keys));
    std::vector<Outcome> res(static_cast<size_t>(R));
    run_ranks(groups, [&](int r) {
      try {
        make_prepare_finalize(GetParam(), groups[static_cast<size_t>(r)], c.config());
      } catch (...) {
        std::tie(res[r].kind, res[r].what) = classify(std::current_exception());
      }
    });
    expect_round_throws(res, "Unsupported", {"node layout = ", part}, GetParam() + " " + groups[0]->node_layout().describe());
    // The host-collective backends still run on such a layout.
    const std::vector<std::vector<RankInput>> rounds = {make_inputs(c)};
    expect_rounds_ok(c, 2, rounds, run_rounds("all2allv", c, groups, rounds, c.config()), "all2allv on " + groups[0]->node_layout().describe());
  }
}

TEST_P(HierEdge, TwoObjectsOnOneGroupInterleavedAndRecreated) {
  // Two layers on one group (two objects, their calls interleaved: A.prepare, B.prepare, B.finalize,
  // A.finalize), then both destroyed and made again three times: each answer is its own inputs'.
  Case c = small_case(4, 33);
  const std::vector<RankInput> a_in = inputs_with_T(c, {3, 9, 0, 6}, 33), b_in = inputs_with_T(c, {9, 1, 4, 0}, 34);
  auto groups = make_cpu_groups(c.R, kTimeout, 2);
  for (int round = 0; round < 3; ++round) {
    std::vector<Outcome> a(static_cast<size_t>(c.R)), b(static_cast<size_t>(c.R));
    run_ranks(groups, [&](int r) {
      auto pa = make_prepare_finalize(GetParam(), groups[static_cast<size_t>(r)], c.config());
      auto pb = make_prepare_finalize(GetParam(), groups[static_cast<size_t>(r)], c.config());
      TestExperts experts(local_ids(c, r), c.H);
      auto expert_out = [&](const PrepareResult& p) {
        std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
        Tensor eo = Tensor::empty(shape, DType::bf16);
        poison(eo);
        if (experts.num_local_experts() > 0) experts.apply(p.experts_input(), eo, {});
        return eo;
      };
      const RankInput& ra = a_in[static_cast<size_t>(r)];
      const RankInput& rb = b_in[static_cast<size_t>(r)];
      const PrepareResult p_a = pa->prepare({ra.x, ra.topk_idx, ra.topk_weights});
      const Tensor eo_a = expert_out(p_a);
      const PrepareResult p_b = pb->prepare({rb.x, rb.topk_idx, rb.topk_weights});
      const Tensor eo_b = expert_out(p_b);
      b[r].out = Tensor::empty({rb.x.size(0), c.H}, DType::bf16);
      poison(b[r].out);
      pb->finalize({eo_b, b[r].out});
      a[r].out = Tensor::empty({ra.x.size(0), c.H}, DType::bf16);
      poison(a[r].out);
      pa->finalize({eo_a, a[r].out});
    });
    expect_rounds_ok(c, 2, {a_in}, {a}, GetParam() + " object A, round " + std::to_string(round));
    expect_rounds_ok(c, 2, {b_in}, {b}, GetParam() + " object B, round " + std::to_string(round));
  }
}

INSTANTIATE_TEST_SUITE_P(LlHt, HierEdge, ::testing::Values("ll", "ht"), [](const auto& info) { return info.param; });

// ---- ht's expert-contiguous layout across nodes -------------------------------------------------

/// ht with expert_contiguous on `groups`: the experts on the contiguous rows, finalize weighted by
/// PrepareResult::topk_weights. bad_rank passes topk_weights with one row too few (-1: none).
std::vector<Outcome> run_contiguous(const Case& c, const std::vector<std::shared_ptr<Group>>& groups, const std::vector<RankInput>& in,
                                    int bad_rank) {
  std::vector<Outcome> res(static_cast<size_t>(c.R));
  run_ranks(groups, [&](int r) {
    DispatchConfig cfg = c.config();
    cfg.expert_contiguous = true;
    Outcome& o = res[static_cast<size_t>(r)];
    try {
      auto pf = make_prepare_finalize("ht", groups[static_cast<size_t>(r)], cfg);
      const std::vector<int> ids = local_ids(c, r);
      const RankInput& ri = in[static_cast<size_t>(r)];
      const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      const ExpertContiguousLayout& cl = p.contiguous;
      const int64_t M = cl.num_rows, H = c.H;
      Tensor eo = Tensor::empty({M, H}, DType::bf16);
      poison(eo);
      std::vector<float> xr(static_cast<size_t>(H)), y(static_cast<size_t>(H));
      for (int64_t row = 0; row < M; ++row) {
        const int32_t l = cl.row_expert.ptr<const int32_t>()[row];
        if (l < 0) continue;
        for (int64_t i = 0; i < H; ++i) xr[static_cast<size_t>(i)] = bf16_bits_to_float(cl.x.ptr<const uint16_t>()[row * H + i]);
        expert_fn(ids[static_cast<size_t>(l)], xr.data(), H, y.data());
        for (int64_t i = 0; i < H; ++i) eo.ptr<uint16_t>()[row * H + i] = float_to_bf16_bits(y[static_cast<size_t>(i)]);
      }
      o.out = Tensor::empty({ri.x.size(0), H}, DType::bf16);
      poison(o.out);
      FinalizeArgs fa{eo, o.out};
      fa.topk_weights = p.topk_weights;
      Tensor short_w;
      if (r == bad_rank) {
        short_w = Tensor::zeros({std::max<int64_t>(0, p.topk_weights.size(0) - 1), c.K}, DType::fp32);
        fa.topk_weights = short_w;
      }
      pf->finalize(fa);
    } catch (...) {
      std::tie(o.kind, o.what) = classify(std::current_exception());
    }
  });
  return res;
}

TEST(HierEdgeHt, ExpertContiguousAcrossNodesMatchesTheFlatReference) {
  for (int P : {1, 2}) {
    Case c = small_case(4, 27);
    const std::vector<RankInput> in = make_inputs(c);
    auto groups = make_cpu_groups(c.R, kTimeout, P);
    const auto res = run_contiguous(c, groups, in, -1);
    expect_rounds_ok(c, P, {in}, {res}, "ht expert_contiguous P=" + std::to_string(P));
  }
}

TEST(HierEdgeHt, ExpertContiguousBadCombineWeightsOnOneRankThrowEverywhere) {
  // A topk_weights of the wrong shape on rank 1 must be an InvalidArgument on every rank, not an
  // error on rank 1's node and a timeout (CPU) or a hang (NCCL) on the other node.
  Case c = small_case(4, 29);
  c.T = {5, 6, 7, 8};
  const std::vector<RankInput> in = make_inputs(c);
  for (int P : {0, 1, 2}) {  // 0: one node (the flat ht), the behaviour the hierarchical one must keep
    auto groups = P > 0 ? make_cpu_groups(c.R, kTimeout, P) : make_cpu_groups(c.R, kTimeout);
    const auto res = run_contiguous(c, groups, in, 1);
    expect_round_throws(res, "InvalidArgument", {"topk_weights"}, "ht expert_contiguous bad topk_weights P=" + std::to_string(P));
  }
}


TEST(HierEdgeHt, AlignedCountsAcrossNodesEqualTheFlatOnes) {
  // expert_alignment > 1: every rank's recv_count (aligned) and N_recv are the flat backend's, for
  // one and several ranks per node (the rows' order differs with P > 1, their number does not).
  for (const auto& [R, P] : std::vector<std::pair<int, int>>{{4, 1}, {4, 2}, {6, 3}}) {
    Case c = small_case(R, 31 + static_cast<uint64_t>(R * 10 + P));
    c.align = 4;
    const std::vector<RankInput> in = make_inputs(c);
    std::vector<std::vector<int32_t>> counts[2];
    std::vector<int64_t> recv[2];
    for (int hier = 0; hier < 2; ++hier) {
      auto groups = hier ? make_cpu_groups(R, kTimeout, P) : make_cpu_groups(R, kTimeout);
      counts[hier].resize(static_cast<size_t>(R));
      recv[hier].resize(static_cast<size_t>(R));
      run_ranks(groups, [&](int r) {
        auto pf = make_prepare_finalize("ht", groups[static_cast<size_t>(r)], c.config());
        const RankInput& ri = in[static_cast<size_t>(r)];
        const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
        counts[hier][r].assign(p.recv_count.ptr<const int32_t>(), p.recv_count.ptr<const int32_t>() + p.recv_count.numel());
        recv[hier][r] = p.num_recv_tokens;
      });
    }
    EXPECT_EQ(counts[1], counts[0]) << R / P << " nodes x " << P;
    EXPECT_EQ(recv[1], recv[0]) << R / P << " nodes x " << P;
  }
}

TEST(HierEdgeLayer, ModularMoEAcrossNodesMatchesOneNode) {
  // The whole layer (router, shared expert, FP8 block experts, DP chunks of changing size) on 2 nodes
  // x 2 ranks against the same layer on one node of 4: within bf16 noise, every rank's T rows.
  auto weights = MoEWeights::random(preset("deepseek-v3-mini"), 7);
  const int R = 4;
  const std::vector<int64_t> T = {13, 0, 32, 5};
  const Config config = Config::load();
  for (const std::string backend : {"ll", "ht"}) {
    for (const int chunk : {0, 7}) {
      std::vector<Tensor> out[2];
      for (int hier = 0; hier < 2; ++hier) {
        auto groups = hier ? make_cpu_groups(R, 30.0, 2) : make_cpu_groups(R, 30.0);
        out[hier].resize(R);
        run_ranks(groups, [&](int r) {
          DispatchConfig dc;
          dc.num_max_dispatch_tokens_per_rank = 32;
          ModularMoEOptions opt;
          opt.chunk_size = chunk;
          ModularMoE layer(weights, groups[static_cast<size_t>(r)], backend, dc, config, opt);
          const Tensor x = random_bf16(T[static_cast<size_t>(r)], weights->config.hidden, 500 + static_cast<uint64_t>(r));
          out[hier][r] = Tensor::empty({T[static_cast<size_t>(r)], weights->config.hidden}, DType::bf16);
          poison(out[hier][r]);
          layer.forward(x, out[hier][r]);
        });
      }
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(out[1][r].size(0), T[static_cast<size_t>(r)]);
        if (T[static_cast<size_t>(r)] > 0) {
          EXPECT_LT(rel_l2_error(out[1][r], out[0][r]), 1e-2) << backend << " chunk " << chunk << " rank " << r;
        }
      }
    }
  }
}

}  // namespace
