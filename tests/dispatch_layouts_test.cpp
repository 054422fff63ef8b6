// The exact layouts each backend's prepare produces (not only the end-to-end result): LL's packed
// expert-major slots and handle, the rank-deduplicated flat rows of all2allv/ht and their order,
// ht's aligned counts and cached layout, naive's gathered rows, and the remote byte counts.
#include <gtest/gtest.h>

#include <cstring>

#include "dispatch/ht/ht.h"
#include "dispatch/ll/ll.h"
#include "dispatch_harness.h"

using namespace epx;
using namespace epx::test;

namespace {

/// The row of token t of rank s as this backend's x holds it: bf16 bits, or fp8 codes + scales.
struct WireRow {
  std::vector<uint8_t> payload;
  std::vector<float> scales;
};

WireRow expected_row(const Case& c, const RankInput& ri, int64_t t) {
  WireRow w;
  if (c.dtype == DType::fp8_e4m3) {
    std::vector<float> x(static_cast<size_t>(c.H));
    for (int64_t i = 0; i < c.H; ++i) x[static_cast<size_t>(i)] = bf16_bits_to_float(ri.x.ptr<uint16_t>()[t * c.H + i]);
    w.payload.resize(static_cast<size_t>(c.H));
    w.scales.resize(static_cast<size_t>(c.H / kFp8GroupSize));
    quantize_fp8_row(x.data(), c.H, w.payload.data(), w.scales.data(), kFp8GroupSize, c.ue8m0);
  } else {
    w.payload.resize(static_cast<size_t>(2 * c.H));
    std::memcpy(w.payload.data(), ri.x.ptr<uint16_t>() + t * c.H, w.payload.size());
  }
  return w;
}

bool row_equals(const Case& c, const PrepareResult& p, int64_t row, const WireRow& w) {
  const int64_t pb = static_cast<int64_t>(w.payload.size());
  if (std::memcmp(static_cast<const uint8_t*>(p.x.data) + row * pb, w.payload.data(), w.payload.size()) != 0) return false;
  if (c.dtype == DType::fp8_e4m3)
    return std::memcmp(p.x_scales.ptr<const float>() + row * (c.H / kFp8GroupSize), w.scales.data(), 4 * w.scales.size()) == 0;
  return true;
}

/// Local index of global id e (from source s) on rank d, or -1.
int local_of(const Case& c, int32_t e, int s, int d) {
  if (e < 0) return -1;
  if (e == c.E) return s == d ? expert_range(c.E, c.R, d).size() : -1;
  const ExpertRange range = expert_range(c.E, c.R, d);
  return e >= range.begin && e < range.end ? e - range.begin : -1;
}

template <class Check>
void for_each_rank_prepare(const std::string& name, const Case& c, const std::vector<RankInput>& in, int calls, Check check) {
  auto groups = make_cpu_groups(c.R, 20.0);
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    for (int call = 0; call < calls; ++call) {
      PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      check(r, call, *pf, p);
    }
  });
}

}  // namespace

TEST(LlPrepare, PackedExpertMajorSlotsAndHandle) {
  for (DType dt : {DType::bf16, DType::fp8_e4m3}) {
    Case c;
    c.R = 3;
    c.E = 7;
    c.K = 4;
    c.H = 128;
    c.cap = 6;
    c.T = {6, 0, 5};
    c.dups = true;
    c.shared = true;
    c.dtype = dt;
    const auto in = make_inputs(c);
    for_each_rank_prepare("ll", c, in, 2, [&](int d, int, PrepareFinalize& pf, const PrepareResult& p) {
      const auto& ll = dynamic_cast<const dispatch::LlCpu&>(pf);
      const int L = num_local_experts(c.config(), c.R, d);
      const int64_t cap = static_cast<int64_t>(c.R) * c.cap;
      ASSERT_EQ(p.layout, ActivationLayout::ExpertMajor);
      ASSERT_EQ(p.x.ndim, 3);
      EXPECT_EQ(p.x.shape[0], L);
      EXPECT_EQ(p.x.shape[1], cap);
      EXPECT_EQ(p.x.shape[2], c.H);
      EXPECT_EQ(p.x.dtype, dt);
      int64_t total = 0;
      for (int l = 0; l < L; ++l) {
        // Expected slots: every (source rank, token) selecting l at least once, rank then token order.
        int64_t j = 0;
        for (int s = 0; s < c.R; ++s) {
          const int64_t begin = j;
          const RankInput& ri = in[static_cast<size_t>(s)];
          for (int64_t t = 0; t < c.tokens(s); ++t) {
            int first = -1;
            for (int k = 0; k < c.K && first < 0; ++k)
              if (local_of(c, id_at(ri, t, c.K, k), s, d) == l) first = k;
            if (first < 0) continue;
            const int64_t row = l * cap + j;
            EXPECT_EQ(ll.handle().src_rank.ptr<int32_t>()[row], s);
            EXPECT_EQ(ll.handle().src_token.ptr<int32_t>()[row], t);
            EXPECT_EQ(ll.handle().topk_column.ptr<int32_t>()[row], first);
            EXPECT_TRUE(row_equals(c, p, row, expected_row(c, ri, t))) << "rank " << d << " expert " << l << " slot " << j;
            ++j;
          }
          const int64_t range = ll.handle().layout_range.ptr<int64_t>()[l * c.R + s];
          EXPECT_EQ(range >> 32, begin);
          EXPECT_EQ(range & 0xffffffff, j - begin);
        }
        EXPECT_EQ(p.recv_count.ptr<int32_t>()[l], j) << "rank " << d << " expert " << l;
        total += j;
      }
      EXPECT_EQ(p.num_recv_tokens, total);
      // Remote dispatch bytes: one message per (token, other destination rank).
      const dispatch::LlLayout& lay = ll.layout();
      int64_t messages = 0;
      const RankInput& mine = in[static_cast<size_t>(d)];
      for (int64_t t = 0; t < c.tokens(d); ++t) {
        std::vector<bool> to(static_cast<size_t>(c.R), false);
        for (int k = 0; k < c.K; ++k) {
          const int32_t e = id_at(mine, t, c.K, k);
          if (e >= 0 && e < c.E && expert_rank(c.E, c.R, e) != d) to[static_cast<size_t>(expert_rank(c.E, c.R, e))] = true;
        }
        for (bool b : to) messages += b;
      }
      EXPECT_EQ(pf.stats().remote_bytes_dispatch, messages * lay.msg_bytes());
    });
  }
}

TEST(FlatLayouts, RankDedupRowsOrderedBySourceThenToken) {
  for (const std::string name : {"all2allv", "ht", "naive", "allgather_reducescatter"}) {
    Case c;
    c.R = 4;
    c.E = 9;
    c.K = 3;
    c.H = 128;
    c.T = {5, 0, 7, 3};
    c.cap = 8;
    c.dups = true;
    c.shared = true;
    c.align = 4;
    c.dtype = DType::fp8_e4m3;
    const bool dedup = name == "all2allv" || name == "ht";
    const auto in = make_inputs(c);
    for_each_rank_prepare(name, c, in, 1, [&](int d, int, PrepareFinalize& pf, const PrepareResult& p) {
      ASSERT_EQ(p.layout, ActivationLayout::Flat);
      const int L = num_local_experts(c.config(), c.R, d);
      std::vector<int32_t> counts(static_cast<size_t>(L), 0);
      std::vector<int32_t> src_rank, src_idx;
      int64_t row = 0;
      for (int s = 0; s < c.R; ++s) {
        const RankInput& ri = in[static_cast<size_t>(s)];
        for (int64_t t = 0; t < c.tokens(s); ++t) {
          std::vector<int> local(static_cast<size_t>(c.K));
          bool any = false;
          for (int k = 0; k < c.K; ++k) {
            local[static_cast<size_t>(k)] = local_of(c, id_at(ri, t, c.K, k), s, d);
            any |= local[static_cast<size_t>(k)] >= 0;
          }
          if (dedup && !any) continue;  // a token goes only where it has work
          ASSERT_LT(row, p.num_recv_tokens);
          EXPECT_TRUE(row_equals(c, p, row, expected_row(c, ri, t))) << name << " rank " << d << " row " << row;
          for (int k = 0; k < c.K; ++k) {
            EXPECT_EQ(p.topk_idx.ptr<int32_t>()[row * c.K + k], local[static_cast<size_t>(k)]);
            EXPECT_EQ(p.topk_weights.ptr<float>()[row * c.K + k], ri.topk_weights.ptr<float>()[t * c.K + k]);
          }
          for (int l = 0; l < L; ++l)
            if (std::find(local.begin(), local.end(), l) != local.end()) ++counts[static_cast<size_t>(l)];
          src_rank.push_back(s);
          src_idx.push_back(static_cast<int32_t>(t));
          ++row;
        }
      }
      EXPECT_EQ(p.num_recv_tokens, row) << name << " rank " << d;
      const int align = name == "ht" ? c.align : 1;
      for (int l = 0; l < L; ++l)
        EXPECT_EQ(p.recv_count.ptr<int32_t>()[l], (counts[static_cast<size_t>(l)] + align - 1) / align * align) << name << " expert " << l;
      if (name == "ht") {
        const auto& h = dynamic_cast<const dispatch::HtCpu&>(pf).handle();
        EXPECT_EQ(h.recv_src_rank, src_rank);
        EXPECT_EQ(h.recv_src_idx, src_idx);
        EXPECT_EQ(h.rank_prefix_matrix[static_cast<size_t>((c.R - 1) * c.R + d)], row);  // prefix over all sources
      }
    });
  }
}

TEST(HtLayout, SameRoutingReusesTheCachedLayout) {
  Case c;
  c.R = 2;
  c.E = 4;
  c.K = 2;
  const auto a = make_inputs(c);
  Case c2 = c;
  c2.seed = 77;
  const auto b = make_inputs(c2);
  auto groups = make_cpu_groups(c.R, 20.0);
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize("ht", groups[static_cast<size_t>(r)], c.config());
    const auto& ht = dynamic_cast<const dispatch::HtCpu&>(*pf);
    auto call = [&](const RankInput& ri) { pf->prepare({ri.x, ri.topk_idx, ri.topk_weights}); };
    call(a[static_cast<size_t>(r)]);
    EXPECT_EQ(ht.handle().layout_cache_hits, 0);
    const auto first_src = ht.handle().recv_src_idx;
    call(a[static_cast<size_t>(r)]);
    EXPECT_EQ(ht.handle().layout_cache_hits, 1);
    EXPECT_EQ(ht.handle().recv_src_idx, first_src);
    call(b[static_cast<size_t>(r)]);  // new routing: recomputed
    EXPECT_EQ(ht.handle().layout_cache_hits, 1);
  });
}

TEST(Stats, RemoteBytesOfDedupBackendsAndLl) {
  Case c;
  c.R = 3;
  c.E = 6;
  c.K = 3;
  c.H = 16;
  c.dups = true;
  const auto in = make_inputs(c);
  // Per rank: tokens with work on another rank, once per such rank (dispatch rows), and
  // (token, distinct remote expert) pairs (LL combine slots, as DeepEP's LL combine).
  std::vector<int64_t> remote_rows(static_cast<size_t>(c.R), 0), remote_slots(static_cast<size_t>(c.R), 0);
  for (int r = 0; r < c.R; ++r) {
    const RankInput& ri = in[static_cast<size_t>(r)];
    for (int64_t t = 0; t < c.tokens(r); ++t) {
      std::vector<bool> to(static_cast<size_t>(c.R), false), seen(static_cast<size_t>(c.E), false);
      for (int k = 0; k < c.K; ++k) {
        const int32_t e = id_at(ri, t, c.K, k);
        if (e < 0 || expert_rank(c.E, c.R, e) == r) continue;
        to[static_cast<size_t>(expert_rank(c.E, c.R, e))] = true;
        remote_slots[static_cast<size_t>(r)] += !seen[static_cast<size_t>(e)];
        seen[static_cast<size_t>(e)] = true;
      }
      for (bool b : to) remote_rows[static_cast<size_t>(r)] += b;
    }
  }
  int64_t all_rows = 0, all_slots = 0;
  for (int r = 0; r < c.R; ++r) all_rows += remote_rows[static_cast<size_t>(r)], all_slots += remote_slots[static_cast<size_t>(r)];
  for (const std::string name : {"all2allv", "ht", "ll"}) {
    const auto res = run_layer(name, c, {in});
    int64_t combine = 0;
    for (int r = 0; r < c.R; ++r) {
      const DispatchStats& st = res[static_cast<size_t>(r)].stats;
      const int64_t msg = name == "ll" ? dispatch::LlLayout{c.H, c.R, c.cap, c.K, false}.msg_bytes() : 2 * c.H + 8 * c.K + 4;
      EXPECT_EQ(st.remote_bytes_dispatch, remote_rows[static_cast<size_t>(r)] * msg) << name << " rank " << r;
      combine += st.remote_bytes_combine;  // counted by the rank that sends it back
    }
    // Flat backends return one partial row per remote dispatch row; LL one row per remote slot.
    EXPECT_EQ(combine, (name == "ll" ? all_slots : all_rows) * 2 * c.H) << name;
  }
}
