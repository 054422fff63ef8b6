// Tests of the CPU group: every collective's result, agreement checks, faults (a throwing rank, a
// missing rank, mismatched collectives) never hang, and worlds leak nothing.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <limits>
#include <set>
#include <stdexcept>
#include <thread>

#include "comm/group_cpu.h"
#include "core/timeout.h"
#include "epx/config.h"
#include "epx/error.h"
#include "epx/group.h"

using namespace epx;

namespace {

// What each rank threw, as a type tag and message, so a test can check every rank, not just the first.
struct Outcome {
  std::string type = "none";
  std::string what;
};

template <class Fn>
std::vector<Outcome> run_and_collect(const std::vector<std::shared_ptr<Group>>& g, Fn fn) {
  std::vector<Outcome> out(g.size());
  run_ranks(g, [&](int r) {
    try {
      fn(r);
    } catch (const Timeout& e) {
      out[static_cast<size_t>(r)] = {"Timeout", e.what()};
    } catch (const CommError& e) {
      out[static_cast<size_t>(r)] = {"CommError", e.what()};
    } catch (const InvalidArgument& e) {
      out[static_cast<size_t>(r)] = {"InvalidArgument", e.what()};
    }
  });
  return out;
}

}  // namespace

TEST(GroupCpu, RankSizeNameDevice) {
  auto g = make_cpu_groups(3);
  auto h = make_cpu_groups(3);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(g[r]->rank(), r);
    EXPECT_EQ(g[r]->size(), 3);
    EXPECT_TRUE(g[r]->device().is_cpu());
    EXPECT_EQ(g[r]->name(), g[0]->name());
  }
  EXPECT_NE(g[0]->name(), h[0]->name()) << "two worlds must not share a name";
  EXPECT_THROW(make_cpu_groups(0), InvalidArgument);
  EXPECT_THROW(make_cpu_groups(2, 0.0), InvalidArgument);
}

TEST(GroupCpu, AllGatherAndGatherv) {
  for (int R : {1, 2, 5}) {
    auto g = make_cpu_groups(R);
    run_ranks(g, [&](int r) {
      int64_t mine[2] = {10 * r, 10 * r + 1};
      std::vector<int64_t> all(2 * R, -1);
      g[r]->all_gather(mine, all.data(), sizeof(mine));
      for (int q = 0; q < R; ++q) {
        EXPECT_EQ(all[2 * q], 10 * q);
        EXPECT_EQ(all[2 * q + 1], 10 * q + 1);
      }
      EXPECT_EQ(g[r]->all_gather_i64(r * r), [&] { std::vector<int64_t> v; for (int q = 0; q < R; ++q) v.push_back(q * q); return v; }());
      // Rank q contributes q bytes of value q (rank 0 contributes nothing).
      std::vector<int64_t> sizes(R);
      std::iota(sizes.begin(), sizes.end(), 0);
      std::vector<uint8_t> send(static_cast<size_t>(r), static_cast<uint8_t>(r));
      std::vector<uint8_t> recv(static_cast<size_t>(R * (R - 1) / 2) + 1, 0xAB);
      g[r]->all_gatherv(send.data(), recv.data(), sizes);
      size_t off = 0;
      for (int q = 0; q < R; ++q)
        for (int i = 0; i < q; ++i) EXPECT_EQ(recv[off++], q);
      EXPECT_EQ(recv[off], 0xAB) << "wrote past the end";
    });
  }
}

TEST(GroupCpu, AllReduceSumFp32Bf16InPlace) {
  const int R = 4;
  const int64_t n = 1001;  // not divisible by R
  auto g = make_cpu_groups(R);
  run_ranks(g, [&](int r) {
    std::vector<float> x(n), y(n);
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(i) + 0.25f * r;
    g[r]->all_reduce_sum(x.data(), y.data(), n, DType::fp32);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], 4.0f * i + 1.5f);
    g[r]->all_reduce_sum(x.data(), x.data(), n, DType::fp32);  // in place
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x[i], 4.0f * i + 1.5f);

    // bf16: summed in fp32 in rank order, rounded once. 1 + 3 * 2^-9 is not a bf16 value, and
    // rounding after each add would give 1 (each 2^-9 ties to even); rounding once gives 1 + 2^-7.
    std::vector<uint16_t> b(n), c(n);
    const float v = r == 0 ? 1.0f : 1.0f / 512.0f;
    for (int64_t i = 0; i < n; ++i) b[i] = float_to_bf16_bits(v);
    g[r]->all_reduce_sum(b.data(), c.data(), n, DType::bf16);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bf16_bits_to_float(c[i]), round_bf16(1.0f + 3.0f / 512.0f));
  });
}

TEST(GroupCpu, ReduceScattervAndAllToAllv) {
  const int R = 3;
  auto g = make_cpu_groups(R);
  run_ranks(g, [&](int r) {
    const std::vector<int64_t> counts = {2, 0, 3};
    std::vector<float> send(5);
    for (int i = 0; i < 5; ++i) send[i] = static_cast<float>(100 * r + i);
    std::vector<float> recv(static_cast<size_t>(counts[r]) + 1, -7.0f);
    g[r]->reduce_scatterv(send.data(), recv.data(), counts, DType::fp32);
    const int64_t off = r == 0 ? 0 : (r == 1 ? 2 : 2);
    for (int64_t i = 0; i < counts[r]; ++i) EXPECT_EQ(recv[i], 300.0f + 3.0f * (off + i));
    EXPECT_EQ(recv[counts[r]], -7.0f);

    // all_to_allv: rank s sends (s + d) bytes of value 16*s + d to rank d.
    std::vector<int64_t> sb(R), rb(R);
    std::vector<uint8_t> sendb;
    for (int d = 0; d < R; ++d) {
      sb[d] = r + d;
      rb[d] = d + r;
      for (int i = 0; i < r + d; ++i) sendb.push_back(static_cast<uint8_t>(16 * r + d));
    }
    std::vector<uint8_t> recvb(static_cast<size_t>(std::accumulate(rb.begin(), rb.end(), int64_t{0})));
    g[r]->all_to_allv(sendb.data(), sb, recvb.data(), rb);
    size_t k = 0;
    for (int s = 0; s < R; ++s)
      for (int i = 0; i < s + r; ++i) EXPECT_EQ(recvb[k++], 16 * s + r);
  });
}

TEST(GroupCpu, AllocSymmetricGivesPeerPointers) {
  const int R = 4;
  auto g = make_cpu_groups(R);
  std::vector<SymmetricBuffer> bufs(R);
  run_ranks(g, [&](int r) {
    SymmetricBuffer b = g[r]->alloc_symmetric(R * sizeof(int32_t));
    ASSERT_EQ(static_cast<int>(b.peers.size()), R);
    EXPECT_EQ(b.peers[r], b.local);
    for (int q = 0; q < R; ++q) EXPECT_EQ(static_cast<int32_t*>(b.local)[q], 0) << "zero-filled";
    g[r]->barrier();  // everyone checked its zeros before anyone writes
    // Each rank writes its id into slot r of every peer's buffer.
    for (int q = 0; q < R; ++q) static_cast<int32_t*>(b.peers[q])[r] = 100 + r;
    g[r]->barrier();
    for (int q = 0; q < R; ++q) EXPECT_EQ(static_cast<int32_t*>(b.local)[q], 100 + q);
    bufs[r] = b;
  });
  g.clear();  // buffers outlive the groups that made them
  for (int r = 0; r < R; ++r) EXPECT_EQ(static_cast<int32_t*>(bufs[r].peers[(r + 1) % R])[0], 100);
}

TEST(GroupCpu, AgreementMismatchThrowsCommErrorOnEveryRank) {
  const int R = 3;
  auto g = make_cpu_groups(R, 5.0);
  auto out = run_and_collect(g, [&](int r) {
    g[r]->check_agreement("group.create", {{"hidden", 7168}, {"num_experts", 256}});  // agrees
    g[r]->check_agreement("group.create", {{"hidden", r == 2 ? 4096 : 7168}, {"num_experts", 256}});
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(out[r].type, "CommError") << "rank " << r;
    EXPECT_EQ(out[r].what, "group.create: hidden = 7168 on rank 0 but 4096 on rank 2: all ranks must agree");
  }
  // The world stays usable after an agreement failure.
  run_ranks(g, [&](int r) { g[r]->barrier(); });
  // Different field lists are reported too.
  out = run_and_collect(g, [&](int r) {
    if (r == 1) g[r]->check_agreement("x", {{"a", 1}, {"b", 2}});
    else g[r]->check_agreement("x", {{"a", 1}});
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(out[r].type, "CommError") << out[r].what;
}

TEST(GroupCpu, SizeMismatchInCollectiveThrowsOnEveryRank) {
  const int R = 2;
  auto g = make_cpu_groups(R, 5.0);
  auto out = run_and_collect(g, [&](int r) {
    std::array<char, 16> a{}, b{};
    g[r]->all_gather(a.data(), b.data(), r == 0 ? 8 : 4);
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(out[r].type, "CommError") << out[r].what;
  out = run_and_collect(g, [&](int r) {
    std::array<char, 16> a{}, b{};
    g[r]->all_to_allv(a.data(), {1, 1}, b.data(), {1, r == 1 ? 2 : 1});
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(out[r].type, "CommError") << out[r].what;
  run_ranks(g, [&](int r) { g[r]->barrier(); });  // still usable
}

TEST(GroupCpu, MismatchedCollectivesThrowInsteadOfHanging) {
  auto g = make_cpu_groups(2, 10.0);
  const auto t0 = std::chrono::steady_clock::now();
  auto out = run_and_collect(g, [&](int r) {
    if (r == 0) g[r]->barrier();
    else g[r]->all_gather_i64(1);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out[r].type, "CommError");
    EXPECT_NE(out[r].what.find("group.barrier"), std::string::npos) << out[r].what;
  }
}

TEST(GroupCpu, ThrowingRankDoesNotHangOthers) {
  const int R = 4;
  auto g = make_cpu_groups(R, 30.0);  // long timeout: the abort, not the timeout, must free the peers
  std::vector<std::string> peer_error(R);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    run_ranks(g, [&](int r) {
      if (r == 1) throw std::runtime_error("boom on rank 1");
      try {
        g[r]->barrier();
      } catch (const CommError& e) {
        peer_error[r] = e.what();
        throw;
      }
    });
    FAIL() << "run_ranks did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom on rank 1");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  for (int r : {0, 2, 3}) EXPECT_NE(peer_error[r].find("boom on rank 1"), std::string::npos) << peer_error[r];
  // An aborted world stays aborted: later collectives fail at once.
  EXPECT_THROW(run_ranks(g, [&](int r) { g[r]->barrier(); }), CommError);
}

TEST(GroupCpu, MissingRankTimesOutNamingItAndTheOperation) {
  const int R = 3;
  auto g = make_cpu_groups(R, 0.2);
  const auto t0 = std::chrono::steady_clock::now();
  auto out = run_and_collect(g, [&](int r) {
    if (r == 2) return;  // never arrives
    std::vector<int64_t> v = g[r]->all_gather_i64(r);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  int timeouts = 0;
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(out[r].type == "Timeout" || out[r].type == "CommError") << out[r].type;
    if (out[r].type == "Timeout") {
      ++timeouts;
      EXPECT_NE(out[r].what.find("group.all_gather"), std::string::npos) << out[r].what;
      EXPECT_NE(out[r].what.find("rank 2 did not arrive"), std::string::npos) << out[r].what;
      EXPECT_NE(out[r].what.find("timeout_s = 0.2"), std::string::npos) << out[r].what;
    }
  }
  EXPECT_GE(timeouts, 1);
  EXPECT_EQ(out[2].type, "none");
  // run_ranks itself rethrows the Timeout when it is not caught.
  auto h = make_cpu_groups(2, 0.1);
  EXPECT_THROW(run_ranks(h, [&](int r) { if (r == 0) h[r]->barrier(); }), Timeout);
}

// A huge timeout_s must not wrap the deadline into the past (the duration cast overflowed int64
// nanoseconds: 1e10 s timed out at once): up to the documented maximum it waits; above it, and a
// non-finite one, is refused naming the value and the rule.
TEST(GroupCpu, HugeTimeoutWaitsAndNonFiniteOrTooLargeIsRefused) {
  auto g = make_cpu_groups(2, kMaxTimeoutS);
  run_ranks(g, [&](int r) {
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    g[r]->barrier();
  });
  for (double bad : {kMaxTimeoutS * 10, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(), 0.0}) {
    try {
      make_cpu_groups(2, bad);
      ADD_FAILURE() << "timeout_s = " << bad << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("timeout_s"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("1e9"), std::string::npos) << e.what();
    }
  }
  Config c;
  EXPECT_THROW(c.set("timeout_s", "1e10"); c.validate(), InvalidArgument);
}

TEST(GroupCpu, CreateDestroyRecreateLeaksNothing) {
  const int64_t base = comm::cpu_world_live_count();
  std::set<std::string> names;
  for (int i = 0; i < 30; ++i) {
    auto g = make_cpu_groups(1 + i % 4);
    EXPECT_EQ(comm::cpu_world_live_count(), base + 1);
    names.insert(g[0]->name());
    run_ranks(g, [&](int r) {
      SymmetricBuffer b = g[r]->alloc_symmetric(1024);
      g[r]->barrier();
    });
  }
  EXPECT_EQ(comm::cpu_world_live_count(), base);
  EXPECT_EQ(names.size(), 30u);
}

TEST(GroupCpu, ManyCollectivesBackToBack) {
  // Stress the two-phase protocol: fast ranks must never overwrite a descriptor a slow rank reads.
  const int R = 8;
  auto g = make_cpu_groups(R);
  std::atomic<int64_t> bad{0};
  run_ranks(g, [&](int r) {
    for (int it = 0; it < 300; ++it) {
      std::vector<int64_t> v = g[r]->all_gather_i64(it * 100 + r);
      for (int q = 0; q < R; ++q)
        if (v[q] != it * 100 + q) ++bad;
    }
  });
  EXPECT_EQ(bad.load(), 0);
}
