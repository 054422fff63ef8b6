// Every dispatch backend (registry order) on CPU ranks: bad input on one rank (capacity, ids, dtypes, shapes,
// finalize arguments, configs, shared-route rules, tensors on another device) must make every rank throw,
// before any write, never hang; the registry's names and its refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "dispatch_harness.h"
#include "epx/config.h"
#include "epx/error.h"

using namespace epx;
using namespace epx::test;

namespace {

class Backend : public ::testing::TestWithParam<std::string> {};

}  // namespace

// ---- errors: raised on every rank, before any write, never a hang ------------------------------

namespace {

struct RankError {
  std::string type = "none", what;
};

/// Runs `fn(rank, pf)` on every rank of a fresh group with backend `name`; collects what each threw.
template <class Fn>
std::vector<RankError> errors_on_ranks(const std::string& name, const Case& c, Fn fn) {
  auto groups = make_cpu_groups(c.R, 10.0);
  std::vector<RankError> errs(static_cast<size_t>(c.R));
  const auto t0 = std::chrono::steady_clock::now();
  run_ranks(groups, [&](int r) {
    try {
      fn(r, groups[static_cast<size_t>(r)]);
    } catch (const InvalidArgument& e) {
      errs[static_cast<size_t>(r)] = {"InvalidArgument", e.what()};
    } catch (const Unsupported& e) {
      errs[static_cast<size_t>(r)] = {"Unsupported", e.what()};
    } catch (const CommError& e) {
      errs[static_cast<size_t>(r)] = {"CommError", e.what()};
    } catch (const Timeout& e) {
      errs[static_cast<size_t>(r)] = {"Timeout", e.what()};
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << "an error path waited for a timeout";
  return errs;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_P(Backend, CapacityOverflowOnOneRankThrowsOnAllRanks) {
  const std::string name = GetParam();
  Case c;
  c.R = 3;
  c.cap = 8;
  c.T = {4, 9, 2};  // rank 1 exceeds the capacity
  const auto in = make_inputs(c);
  Case ok = c;
  ok.T = {4, 8, 2};
  const auto in_ok = make_inputs(ok);
  const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    auto pf = make_prepare_finalize(name, g, c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    try {
      pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    } catch (const InvalidArgument&) {
      // The object stays usable: a good call afterwards works on every rank.
      const RankInput& good = in_ok[static_cast<size_t>(r)];
      PrepareResult p = pf->prepare({good.x, good.topk_idx, good.topk_weights});
      std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
      Tensor eo = Tensor::zeros(shape, DType::bf16), out = Tensor::empty({good.x.size(0), c.H}, DType::bf16);
      pf->finalize({eo, out});
      throw;
    }
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " rank " << r;
    EXPECT_TRUE(contains(errs[r].what, "num_tokens = 9")) << errs[r].what;
    EXPECT_TRUE(contains(errs[r].what, "num_max_dispatch_tokens_per_rank = 8")) << errs[r].what;
    if (r != 1) {
      EXPECT_TRUE(contains(errs[r].what, "rank 1")) << errs[r].what;
    }
  }
  EXPECT_EQ(errs[1].what, name + ".prepare: num_tokens = 9: must be <= num_max_dispatch_tokens_per_rank = 8 (fixed at create; split the batch)");
}

TEST_P(Backend, BadIdsDtypesAndShapesThrowOnAllRanks) {
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  c.E = 6;
  const auto in = make_inputs(c);
  // (what rank 1 gets wrong, the text its error must contain)
  const std::vector<std::pair<int, std::string>> faults = {
      {0, "topk_idx[1, 0] = 6"}, {1, "topk_idx[1, 0] = -2"}, {2, "x.dtype = fp32"}, {3, "x.shape[1] = 16"}, {4, "topk_weights.shape"}};
  for (const auto& [fault, text] : faults) {
    const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
      auto pf = make_prepare_finalize(name, g, c.config());
      RankInput ri = in[static_cast<size_t>(r)];
      Tensor x = ri.x, idx = Tensor::empty({ri.topk_idx.size(0), c.K}, DType::int32), w = ri.topk_weights;
      std::memcpy(idx.data(), ri.topk_idx.data(), static_cast<size_t>(idx.nbytes()));
      if (r == 1) {
        if (fault == 0) idx.ptr<int32_t>()[2] = c.E;  // E without shared_route
        if (fault == 1) idx.ptr<int32_t>()[2] = -2;
        if (fault == 2) x = Tensor::zeros({x.size(0), c.H}, DType::fp32);
        if (fault == 3) x = Tensor::zeros({x.size(0), 2 * c.H}, DType::bf16);
        if (fault == 4) w = Tensor::zeros({x.size(0), c.K + 1}, DType::fp32);
      }
      pf->prepare({x, idx, w});
    });
    for (int r = 0; r < c.R; ++r) {
      EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " fault " << fault << " rank " << r;
      EXPECT_TRUE(contains(errs[r].what, text)) << errs[r].what;
    }
  }
}

TEST_P(Backend, BadFinalizeArgsThrowOnAllRanks) {
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  const auto in = make_inputs(c);
  const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    auto pf = make_prepare_finalize(name, g, c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
    Tensor eo = Tensor::zeros(shape, DType::bf16);
    Tensor out = Tensor::empty({ri.x.size(0) + (r == 0 ? 1 : 0), c.H}, DType::bf16);  // rank 0: one row too many
    pf->finalize({eo, out});
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " rank " << r;
    EXPECT_TRUE(contains(errs[r].what, "out.shape")) << errs[r].what;
  }
}

TEST_P(Backend, FinalizeTwiceOnOneRankIsNamedOnEveryRank) {
  // Every rank makes the same sequence of calls (dispatch.h). Here rank 0 finalizes its prepare twice (which is
  // fine when every rank does it) while rank 1 moves on to its next prepare: both ranks throw InvalidArgument
  // naming the two calls that met (not a collective's "bytes_per_rank must agree" or a timeout).
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  const auto in = make_inputs(c);
  const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    auto pf = make_prepare_finalize(name, g, c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
    Tensor eo = Tensor::zeros(shape, DType::bf16);
    Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
    pf->finalize({eo, out});
    if (r == 0) pf->finalize({eo, out});
    else pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " rank " << r << ": " << errs[r].what;
    EXPECT_TRUE(contains(errs[r].what, name + ".finalize on rank 0") && contains(errs[r].what, name + ".prepare on rank 1") &&
                contains(errs[r].what, "same sequence of calls"))
        << name << " rank " << r << ": " << errs[r].what;
  }
}

TEST_P(Backend, ConfigDisagreementAndBadConfig) {
  const std::string name = GetParam();
  Case c;
  c.R = 3;
  auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    DispatchConfig cfg = c.config();
    if (r == 2) cfg.hidden = 16;
    make_prepare_finalize(name, g, cfg);
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "CommError");
    EXPECT_EQ(errs[r].what, name + ".create: hidden = 8 on rank 0 but 16 on rank 2: all ranks must agree");
  }
  for (const auto& [field, text] : std::vector<std::pair<int, std::string>>{
           {0, "hidden = 7"}, {1, "hidden = 64: must be a multiple of 128"}, {2, "top_k = 0"}, {3, "num_experts = 0"}}) {
    errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
      DispatchConfig cfg = c.config();
      if (field == 0) cfg.hidden = 7;
      if (field == 1) cfg.hidden = 64, cfg.dispatch_dtype = DType::fp8_e4m3;
      if (field == 2) cfg.top_k = 0;
      if (field == 3) cfg.num_experts = 0;
      make_prepare_finalize(name, g, cfg);
    });
    for (int r = 0; r < c.R; ++r) EXPECT_TRUE(errs[r].type == "InvalidArgument" && contains(errs[r].what, text)) << errs[r].what;
  }
}

TEST_P(Backend, OutOfRuleConfigStructIsRefusedOnEveryRank) {
  // A Config built in C++ (fields set directly, not through Config::set / JSON / EPX_*) reaches the
  // backends' launch settings unchecked: ll.combine_wait "flags" ran a mode nobody asked for, ht.chunk_rows = 0 divided by
  // zero in ht's CUDA combine. make_prepare_finalize(name, group, cfg, config) must refuse it with the rule
  // validate() names, on every rank (also when only one rank's Config is bad), before anything is built; the
  // group stays usable.
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  const auto in = make_inputs(c);
  for (const bool only_rank1 : {false, true}) {
    const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
      Config bad;
      if (!only_rank1 || r == 1) bad.ll_combine_wait = "flags", bad.ht_chunk_rows = 0;
      try {
        make_prepare_finalize(name, g, c.config(), bad);
      } catch (const InvalidArgument&) {
        // Nothing held is lost: the same group then builds the backend and runs a round.
        auto pf = make_prepare_finalize(name, g, c.config(), Config{});
        const RankInput& ri = in[static_cast<size_t>(r)];
        PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
        std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
        Tensor eo = Tensor::zeros(shape, DType::bf16), out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
        pf->finalize({eo, out});
        throw;
      }
    });
    for (int r = 0; r < c.R; ++r) {
      EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " rank " << r << (only_rank1 ? " (rank 1 bad)" : "");
      if (!only_rank1 || r == 1)
        EXPECT_TRUE(contains(errs[r].what, "config: ll.combine_wait = flags: must be flag or data")) << errs[r].what;
      else
        EXPECT_TRUE(contains(errs[r].what, "rank 1")) << errs[r].what;
    }
  }
}

TEST_P(Backend, SharedRouteRulesThrowOnAllRanksAndKeepWhatWasHeld) {
  // FHMoE routes (issue 6): with shared_route, exactly top_k = K+1 columns, the shared id E in the
  // last column only, and the last column E or -1. Rank 1 breaks one rule per round: every rank
  // throws InvalidArgument naming the entry, the value and the rule, before anything moves; the
  // prepare made before the bad call still finalizes to the oracle, and a good call after it works.
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  c.E = 6;
  c.K = 3;  // 2 routed columns + the shared route
  c.shared = true;
  c.masked = 0.0;
  c.T = {4, 5};
  const auto in = make_inputs(c);
  const std::string E = std::to_string(c.E);
  // (what rank 1 gets wrong, texts its error must contain)
  const std::vector<std::pair<int, std::vector<std::string>>> faults = {
      {0, {"topk_idx.shape[1] = 2", "must equal top_k = 3 with shared_route", "shared route column"}},  // the routed columns only
      {1, {"topk_weights.shape[1] = 4", "must equal top_k = 3 with shared_route"}},                       // one weight column too many
      {2, {"topk_idx[1, 2] = 1", "must be num_experts = " + E + " (the shared route) or -1", "not a routed expert's"}},  // shared id missing
      {3, {"topk_idx[1, 0] = " + E, "belongs in the last column (k = 2) only"}},                          // shared id first, routed last
      {4, {"topk_idx[1, 1] = " + E, "a routed expert id in [0, num_experts = " + E + ")"}},                // shared id also in a routed column
      {5, {"topk_idx[1, 2] = " + std::to_string(c.E + 1), "the shared route"}},                            // past the shared id
      {6, {"topk_idx[1, 2] = -2", "the shared route"}}};
  for (const auto& [fault, texts] : faults) {
    std::vector<Tensor> held(static_cast<size_t>(c.R)), after(static_cast<size_t>(c.R));
    const auto errs = errors_on_ranks(name, c, [&, fault = fault](int r, std::shared_ptr<Group> g) {
      auto pf = make_prepare_finalize(name, g, c.config());
      std::vector<int> ids;
      const ExpertRange range = expert_range(c.E, c.R, r);
      for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
      ids.push_back(c.E);
      TestExperts experts(ids, c.H);
      const RankInput& ri = in[static_cast<size_t>(r)];
      auto finalize_into = [&](const PrepareResult& p, Tensor& out) {
        std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
        Tensor eo = Tensor::empty(shape, DType::bf16);
        poison(eo);
        experts.apply(p.experts_input(), eo, {});
        out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
        poison(out);
        pf->finalize({eo, out});
      };
      const PrepareResult p0 = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      const int64_t T = ri.x.size(0);
      int kc = c.K, wc = c.K;
      if (r == 1 && fault == 0) kc = wc = c.K - 1;
      if (r == 1 && fault == 1) wc = c.K + 1;
      Tensor idx = Tensor::empty({T, kc}, DType::int32), w = Tensor::empty({T, wc}, DType::fp32);
      for (int64_t t = 0; t < T; ++t) {
        for (int k = 0; k < kc; ++k) idx.ptr<int32_t>()[t * kc + k] = id_at(ri, t, c.K, k);
        for (int k = 0; k < wc; ++k) w.ptr<float>()[t * wc + k] = k < c.K ? ri.topk_weights.ptr<const float>()[t * c.K + k] : 1.0f;
      }
      int32_t* row1 = idx.ptr<int32_t>() + 1 * kc;
      if (r == 1 && fault == 2) row1[2] = 1;
      if (r == 1 && fault == 3) std::swap(row1[0], row1[2]);
      if (r == 1 && fault == 4) row1[1] = c.E;
      if (r == 1 && fault == 5) row1[2] = c.E + 1;
      if (r == 1 && fault == 6) row1[2] = -2;
      try {
        pf->prepare({ri.x, idx, w});
      } catch (const InvalidArgument&) {
        finalize_into(p0, held[static_cast<size_t>(r)]);  // the earlier prepare is still there
        finalize_into(pf->prepare({ri.x, ri.topk_idx, ri.topk_weights}), after[static_cast<size_t>(r)]);
        throw;
      }
    });
    for (int r = 0; r < c.R; ++r) {
      const std::string what = name + " fault " + std::to_string(fault) + " rank " + std::to_string(r);
      EXPECT_EQ(errs[r].type, "InvalidArgument") << what << ": " << errs[r].what;
      for (const auto& text : texts) EXPECT_TRUE(contains(errs[r].what, text)) << what << ": " << errs[r].what << " lacks " << text;
      ASSERT_TRUE(held[r].defined() && after[r].defined()) << what;
      const Tensor want = oracle_out(c, in[static_cast<size_t>(r)], r, name != "ll", name != "ll");
      EXPECT_EQ(count_bit_diffs(held[r], want), 0) << what << " (finalize of the prepare before the bad call)";
      EXPECT_EQ(count_bit_diffs(after[r], want), 0) << what << " (a good call after it)";
    }
  }
  // The rules hold routes that fit them: -1 in the last column (shared expert not fused) and -1 in
  // routed columns are valid (make_inputs masks every 5th token's shared column).
  Case ok = c;
  ok.masked = 0.3;
  ok.T = {9, 7};
  const auto in_ok = make_inputs(ok);
  expect_matches_oracle(name, ok, in_ok, run_layer(name, ok, {in_ok}));
}

TEST_P(Backend, TensorsOnAnotherDeviceAreUnsupportedOnAllRanks) {
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  const auto in = make_inputs(c);
  const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    auto pf = make_prepare_finalize(name, g, c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    TensorView x = ri.x.view();
    if (r == 0) {
      x.device = Device::cuda(0);  // never dereferenced: rejected before any read
      EXPECT_TRUE(pf->why_unsupported({x, ri.topk_idx, ri.topk_weights}).has_value());
    }
    EXPECT_EQ(pf->why_unsupported({ri.x, ri.topk_idx, ri.topk_weights}), std::nullopt);
    pf->prepare({x, ri.topk_idx, ri.topk_weights});
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "Unsupported") << errs[r].what;
    EXPECT_TRUE(contains(errs[r].what, "cuda:0")) << errs[r].what;
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Backend, ::testing::ValuesIn(backend_names()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(DispatchRegistry, NamesAndUnknownBackend) {
  EXPECT_EQ(backend_names(), (std::vector<std::string>{"naive", "allgather_reducescatter", "all2allv", "ll", "ht"}));
  Case c;
  c.R = 2;
  const auto errs = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) { make_prepare_finalize("deepep", g, c.config()); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument");
    EXPECT_TRUE(contains(errs[r].what, "naive, allgather_reducescatter, all2allv, ll, ht")) << errs[r].what;
  }
  // A rank asking for another backend than its peers is a disagreement, not a hang.
  const auto mixed = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) { make_prepare_finalize(r ? "ll" : "ht", g, c.config()); });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(mixed[r].type, "CommError") << mixed[r].what;
  // The disagreement names the values as the caller wrote them (backend and dtype names, not enum indices).
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(contains(mixed[r].what, "backend = ht on rank 0 but ll on rank 1: all ranks must agree")) << mixed[r].what;
  const auto dtypes = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) {
    DispatchConfig cfg = c.config();
    cfg.hidden = 128;
    if (r == 1) cfg.dispatch_dtype = DType::fp8_e4m3;
    make_prepare_finalize("naive", g, cfg);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(dtypes[r].what, "naive.create: dispatch_dtype = bf16 on rank 0 but fp8_e4m3 on rank 1: all ranks must agree") << dtypes[r].what;
  const auto combine = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) {
    DispatchConfig cfg = c.config();
    cfg.ll_combine = r ? LlCombine::partial_bf16 : LlCombine::partial_fp32;
    make_prepare_finalize("naive", g, cfg);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(contains(combine[r].what, "ll_combine = partial_fp32 on rank 0 but partial_bf16 on rank 1")) << combine[r].what;
  const auto unknown = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) { make_prepare_finalize(r ? "deepep" : "naive", g, c.config()); });
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(contains(unknown[r].what, "backend = naive on rank 0 but an unknown name on rank 1")) << unknown[r].what;
}

TEST(DispatchRegistry, LlNeedsACapacity) {
  Case c;
  c.R = 2;
  c.cap = 0;
  const auto errs = errors_on_ranks("ll", c, [&](int r, std::shared_ptr<Group> g) { make_prepare_finalize("ll", g, c.config()); });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(contains(errs[r].what, "num_max_dispatch_tokens_per_rank = 0")) << errs[r].what;
  // Dynamic backends accept 0 = no limit.
  Case d = c;
  d.T = {40, 3};
  const auto in = make_inputs(d);
  expect_matches_oracle("all2allv", d, in, run_layer("all2allv", d, {in}));
}
