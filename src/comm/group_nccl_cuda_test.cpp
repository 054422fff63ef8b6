// comm/group_nccl_cuda_test.cpp: the NCCL group on CUDA, and the Group semantics it shares with
// virtual ranks.
//
// Group semantics (every collective's results against a host reference, on the rank's stream and on
// the legacy default stream, in place, host pointers, agreement checks throwing on every rank,
// symmetric memory written into the next rank, graph capture of a collective, a rank that never calls)
// run through tests/cuda_ranks.h run_cuda_ranks at 1 / 2 / 4 / 8 ranks: one forked process per GPU
// with an NCCL group where the machine has enough GPUs, else R virtual ranks (threads) on GPU 0.
// NCCL internals (LSA windows, the device communicator and LSA barrier, the node layout NCCL's
// environment gives, groups from the launcher's environment, creation without a rank, a rank's process
// dying) keep the real form: one forked process per GPU, skipped with the reason when GPUs are short.
//
// The gtest process itself never initialises CUDA (cuda::device_count() asks a child), so the ranks
// it forks can each open their GPU. A rank reports by throwing (its message goes to stderr); the
// parent kills every rank still running after a deadline, so a hang fails the test instead of the
// suite. Rank bodies that may run as virtual ranks wait on their own stream (or the legacy stream),
// never on the whole device, and never touch the environment.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/group.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "comm/group_nccl.h"
#include "cuda_ranks.h"
#endif
#include "forked_ranks.h"

namespace epx {
namespace {

[[maybe_unused]] void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

using test::fresh_dir;
using test::run_ranks_forked;

TEST(NcclRendezvous, TimesOutWhenRankZeroNeverWrites) {
  const std::string path = fresh_dir() + "/never_written";
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(exchange_unique_id(path, /*rank=*/1, /*timeout_s=*/0.3), Timeout);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
}

TEST(NcclRendezvous, UniqueIdHexRoundTrip) {
  UniqueId id;
  for (int i = 0; i < UniqueId::kBytes; ++i) id.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 37 + 5);
  EXPECT_EQ(UniqueId::parse(id.hex()), id);
  EXPECT_THROW(UniqueId::parse("abc"), InvalidArgument);
  std::string bad = id.hex();
  bad[7] = 'g';
  EXPECT_THROW(UniqueId::parse(bad), InvalidArgument);
}

#ifdef EPX_WITH_CUDA

/// Visible GPUs, counted without initialising CUDA here.
int gpus() { return cuda::device_count(); }

using test::cuda_ok;

template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  cuda_ok(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(T)), "cudaMalloc");
  test::upload_device(d, h.data(), h.size() * sizeof(T), "H2D");  // waits: the tests' streams are non-blocking
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) cuda_ok(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), "D2H");
  return h;
}

/// Rank r's random bytes for a test named by `salt` (every rank can regenerate every other's).
std::vector<uint8_t> rank_bytes(int rank, int salt, size_t n) {
  std::mt19937_64 g(static_cast<uint64_t>(rank) * 1000003u + static_cast<uint64_t>(salt));
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(g());
  return v;
}
std::vector<float> rank_floats(int rank, int salt, size_t n) {
  std::mt19937_64 g(static_cast<uint64_t>(rank) * 7919u + static_cast<uint64_t>(salt));
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = d(g);
    if (x == 0.0f) x = 0.5f;
  }
  return v;
}
std::vector<uint16_t> rank_bf16(int rank, int salt, size_t n) {
  auto f = rank_floats(rank, salt, n);
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float_to_bf16_bits(f[i]);
  return v;
}

void check_collectives(Group& g, cudaStream_t stream) {
  const int R = g.size(), me = g.rank();
  const Stream s{stream};

  // all_gather on device memory.
  {
    const size_t n = 4099;
    auto mine = rank_bytes(me, 1, n);
    uint8_t* send = to_device(mine);
    uint8_t* recv = to_device(std::vector<uint8_t>(n * R, 0xAB));
    g.all_gather(send, recv, static_cast<int64_t>(n), s);
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    auto got = to_host(recv, n * R);
    for (int r = 0; r < R; ++r)
      require(std::memcmp(got.data() + r * n, rank_bytes(r, 1, n).data(), n) == 0, "all_gather block " + std::to_string(r));
    cudaFree(send);
    cudaFree(recv);
  }
  // all_gatherv with unequal sizes and one empty rank.
  {
    std::vector<int64_t> sizes(R);
    for (int r = 0; r < R; ++r) sizes[r] = r == 1 ? 0 : 1000 + 37 * r;
    int64_t total = 0;
    for (auto v : sizes) total += v;
    uint8_t* send = to_device(rank_bytes(me, 2, static_cast<size_t>(sizes[me])));
    uint8_t* recv = to_device(std::vector<uint8_t>(static_cast<size_t>(total), 0xCD));
    g.all_gatherv(send, recv, sizes, s);
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    auto got = to_host(recv, static_cast<size_t>(total));
    int64_t off = 0;
    for (int r = 0; r < R; ++r) {
      auto want = rank_bytes(r, 2, static_cast<size_t>(sizes[r]));
      require(std::memcmp(got.data() + off, want.data(), want.size()) == 0, "all_gatherv block " + std::to_string(r));
      off += sizes[r];
    }
    cudaFree(send);
    cudaFree(recv);
  }
  // all_reduce_sum fp32 (exact for R <= 2: a + b is NCCL's only order then) and bf16 (rank order).
  {
    const size_t n = 5003;
    float* buf = to_device(rank_floats(me, 3, n));
    g.all_reduce_sum(buf, buf, static_cast<int64_t>(n), DType::fp32, s);  // in place
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    auto got = to_host(buf, n);
    std::vector<float> want(n, 0.0f);
    for (int r = 0; r < R; ++r) {
      auto v = rank_floats(r, 3, n);
      for (size_t i = 0; i < n; ++i) want[i] += v[i];
    }
    for (size_t i = 0; i < n; ++i) {
      const double tol = R <= 2 ? 0.0 : 1e-5 * std::fabs(want[i]) + 1e-6;
      require(std::fabs(got[i] - want[i]) <= tol, "all_reduce_sum fp32 at " + std::to_string(i) + ": " +
                                                       std::to_string(got[i]) + " vs " + std::to_string(want[i]));
    }
    cudaFree(buf);

    uint16_t* send = to_device(rank_bf16(me, 4, n));
    uint16_t* recv = to_device(std::vector<uint16_t>(n, 0xFFFF));
    g.all_reduce_sum(send, recv, static_cast<int64_t>(n), DType::bf16, s);
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    auto gotb = to_host(recv, n);
    std::vector<float> acc(n, 0.0f);
    for (int r = 0; r < R; ++r) {
      auto v = rank_bf16(r, 4, n);
      for (size_t i = 0; i < n; ++i) acc[i] += bf16_bits_to_float(v[i]);
    }
    for (size_t i = 0; i < n; ++i)
      require(gotb[i] == float_to_bf16_bits(acc[i]), "all_reduce_sum bf16 at " + std::to_string(i));
    cudaFree(send);
    cudaFree(recv);
  }
  // reduce_scatterv, fp32 and bf16, unequal counts with one empty rank: bit-exact rank-order sums.
  for (DType dt : {DType::fp32, DType::bf16}) {
    std::vector<int64_t> counts(R);
    for (int r = 0; r < R; ++r) counts[r] = (R > 1 && r == R - 1) ? 0 : 777 + 101 * r;
    int64_t total = 0;
    for (auto c : counts) total += c;
    int64_t my_off = 0;
    for (int r = 0; r < me; ++r) my_off += counts[r];
    const size_t es = dt == DType::fp32 ? 4 : 2;
    std::vector<uint8_t> mine(static_cast<size_t>(total) * es);
    if (dt == DType::fp32) std::memcpy(mine.data(), rank_floats(me, 5, total).data(), mine.size());
    else std::memcpy(mine.data(), rank_bf16(me, 6, total).data(), mine.size());
    uint8_t* send = to_device(mine);
    uint8_t* recv = to_device(std::vector<uint8_t>(static_cast<size_t>(counts[me]) * es + 1, 0xEE));
    g.reduce_scatterv(send, recv, counts, dt, s);
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    auto got = to_host(recv, static_cast<size_t>(counts[me]) * es);
    std::vector<std::vector<float>> all(R);
    for (int r = 0; r < R; ++r) {
      if (dt == DType::fp32) {
        all[r] = rank_floats(r, 5, total);
      } else {
        auto b = rank_bf16(r, 6, total);
        all[r].resize(b.size());
        for (size_t i = 0; i < b.size(); ++i) all[r][i] = bf16_bits_to_float(b[i]);
      }
    }
    for (int64_t i = 0; i < counts[me]; ++i) {
      float acc = 0.0f;
      for (int r = 0; r < R; ++r) acc += all[r][static_cast<size_t>(my_off + i)];
      if (dt == DType::fp32) {
        float v;
        std::memcpy(&v, got.data() + i * 4, 4);
        require(std::memcmp(&v, &acc, 4) == 0, "reduce_scatterv fp32 at " + std::to_string(i));
      } else {
        uint16_t v;
        std::memcpy(&v, got.data() + i * 2, 2);
        require(v == float_to_bf16_bits(acc), "reduce_scatterv bf16 at " + std::to_string(i));
      }
    }
    cudaFree(send);
    cudaFree(recv);
  }
  // all_to_allv: rank r sends (r + 1) * 100 + 13 * p bytes to p (0 from the last rank to rank 0).
  {
    auto bytes_from_to = [&](int from, int to) -> int64_t {
      if (R > 1 && from == R - 1 && to == 0) return 0;
      return (from + 1) * 100 + 13 * to;
    };
    std::vector<int64_t> sb(R), rb(R);
    int64_t st = 0, rt = 0;
    for (int p = 0; p < R; ++p) {
      sb[p] = bytes_from_to(me, p);
      rb[p] = bytes_from_to(p, me);
      st += sb[p];
      rt += rb[p];
    }
    std::vector<uint8_t> send_h;
    for (int p = 0; p < R; ++p) {
      auto blk = rank_bytes(me * 64 + p, 7, static_cast<size_t>(sb[p]));
      send_h.insert(send_h.end(), blk.begin(), blk.end());
    }
    uint8_t* send = to_device(send_h);
    uint8_t* recv = to_device(std::vector<uint8_t>(static_cast<size_t>(rt), 0x11));
    g.all_to_allv(send, sb, recv, rb, s);
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    auto got = to_host(recv, static_cast<size_t>(rt));
    int64_t off = 0;
    for (int p = 0; p < R; ++p) {
      auto want = rank_bytes(p * 64 + me, 7, static_cast<size_t>(rb[p]));
      require(std::memcmp(got.data() + off, want.data(), want.size()) == 0, "all_to_allv block from " + std::to_string(p));
      off += rb[p];
    }
    cudaFree(send);
    cudaFree(recv);
  }
  // Host pointers are staged (Group::all_gather_i64 and check_agreement use them).
  {
    const auto all = g.all_gather_i64(1000 + 7 * me);
    require(static_cast<int>(all.size()) == R, "all_gather_i64 size");
    for (int r = 0; r < R; ++r) require(all[r] == 1000 + 7 * r, "all_gather_i64 value " + std::to_string(r));
    g.check_agreement("test.agree", {{"hidden", 7168}, {"experts", 256}});
    if (R > 1) {
      bool threw = false;
      try {
        g.check_agreement("test.disagree", {{"hidden", me == 0 ? 7168 : 4096}});
      } catch (const CommError& e) {
        threw = std::string(e.what()).find("hidden") != std::string::npos;
      }
      require(threw, "check_agreement must throw CommError naming the field on every rank");
    }
  }
  g.barrier();
}

// ---- Group semantics: NCCL groups where there are enough GPUs, virtual ranks otherwise -------------

using test::run_cuda_ranks;
using test::virtual_ranks_for;

/// run_cuda_ranks with the rank prepended to a failing rank's message (on virtual ranks only the
/// first rank's exception comes back, so the message must say whose it is).
std::string on_ranks(int R, double deadline_s, const std::function<void(int, const std::shared_ptr<Group>&)>& fn, double timeout_s = 60.0) {
  std::printf("%d rank%s: %s\n", R, R == 1 ? "" : "s", virtual_ranks_for(R) ? "virtual ranks on GPU 0" : "one GPU per rank (NCCL)");
  std::fflush(stdout);
  return run_cuda_ranks(
      R, deadline_s,
      [&](int rank, const std::shared_ptr<Group>& g) {
        try {
          fn(rank, g);
        } catch (const std::exception& e) {
          throw std::runtime_error("rank " + std::to_string(rank) + ": " + e.what());
        }
      },
      timeout_s);
}

using test::RankStream;

/// Group semantics at R ranks (1, 2, 4, 8).
class GroupCuda : public ::testing::TestWithParam<int> {};
/// Group semantics that need a peer (2, 4, 8 ranks).
class GroupCudaPeers : public ::testing::TestWithParam<int> {};

TEST_P(GroupCuda, CollectivesMatchHostReference) {
  if (gpus() < 1) GTEST_SKIP() << "needs a GPU (virtual ranks run on one), found none";
  const int R = GetParam();
  const bool virt = virtual_ranks_for(R);
  const std::string failed = on_ranks(R, 240.0, [&](int rank, const std::shared_ptr<Group>& g) {
    require(g->rank() == rank && g->size() == R, "rank/size");
    require(g->device() == Device::cuda(virt ? 0 : rank), "device " + g->device().str());
    require(g->ranks_per_gpu() == (virt ? R : 1), "ranks_per_gpu " + std::to_string(g->ranks_per_gpu()));
    const RankStream rs;
    check_collectives(*g, rs.s);
    // The legacy default stream works too.
    check_collectives(*g, nullptr);
    if (rank == 0) std::printf("collectives OK on %d ranks (%s)\n", R, g->name().c_str());
  });
  EXPECT_EQ(failed, "");
}

// alloc_symmetric: zero-filled, peers[rank] is the local buffer and every peer pointer is usable from
// this rank: host-ordered stores into the next rank (stream sync, host barrier) land there.
TEST_P(GroupCudaPeers, SymmetricMemoryHostOrderedWriteToNextRank) {
  if (gpus() < 1) GTEST_SKIP() << "needs a GPU (virtual ranks run on one), found none";
  const int R = GetParam();
  const std::string failed = on_ranks(R, 240.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const int64_t bytes = (1 << 20) + 12;  // not a multiple of 4 KiB
    const int64_t words = bytes / 4;
    SymmetricBuffer buf = g->alloc_symmetric(bytes);
    require(buf.bytes == bytes && buf.local != nullptr, "buffer");
    require(static_cast<int>(buf.peers.size()) == R && buf.peers[static_cast<size_t>(rank)] == buf.local, "peers[rank] == local");
    for (int r = 0; r < R; ++r) require(buf.peers[static_cast<size_t>(r)] != nullptr, "peer pointer " + std::to_string(r));
    auto got = to_host(static_cast<const uint32_t*>(buf.local), static_cast<size_t>(words));
    for (int64_t i = 0; i < words; ++i) require(got[static_cast<size_t>(i)] == 0, "zero-filled at " + std::to_string(i));
    const RankStream rs;
    const int next = (rank + 1) % R, prev = (rank + R - 1) % R;
    g->barrier();  // every rank's zero check is done before anyone writes
    comm::launch_fill_pattern(static_cast<uint32_t*>(buf.peers[static_cast<size_t>(next)]), words, 2000u + rank, rs.s);
    cuda_ok(cudaStreamSynchronize(rs.s), "sync");
    g->barrier();
    got = to_host(static_cast<const uint32_t*>(buf.local), static_cast<size_t>(words));
    for (int64_t i = 0; i < words; ++i)
      require(got[static_cast<size_t>(i)] == comm::pattern_word(2000u + prev, static_cast<uint64_t>(i)),
              "word " + std::to_string(i) + " from rank " + std::to_string(prev));
    g->barrier();  // every rank's reads are done before the buffers go
    if (rank == 0) std::printf("symmetric memory OK: %d ranks wrote %lld bytes each into the next rank\n", R, static_cast<long long>(bytes));
  });
  EXPECT_EQ(failed, "");
}

// An in-place all_reduce_sum captured into a CUDA graph on the rank's stream and replayed 20 times:
// every replay sums again (R^20 everywhere), after an eager call that connected the ranks.
TEST_P(GroupCudaPeers, GraphReplayOfCollective) {
  if (gpus() < 1) GTEST_SKIP() << "needs a GPU (virtual ranks run on one), found none";
  const int R = GetParam();
  const std::string failed = on_ranks(R, 240.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const int64_t n_red = 1024;
    float* red = to_device(std::vector<float>(n_red, 1.0f));
    g->all_reduce_sum(red, red, n_red, DType::fp32, Stream{stream});  // connect before capturing
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    auto got = to_host(red, static_cast<size_t>(n_red));
    for (int64_t i = 0; i < n_red; ++i) require(got[static_cast<size_t>(i)] == static_cast<float>(R), "eager all_reduce: " + std::to_string(got[static_cast<size_t>(i)]));
    g->barrier();  // every rank's eager sum is done before its input is reset
    test::upload_device(red, std::vector<float>(n_red, 1.0f).data(), n_red * 4, "reset");
    g->barrier();

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    g->all_reduce_sum(red, red, n_red, DType::fp32, Stream{stream});
    cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    constexpr int kReplays = 20;
    for (int i = 0; i < kReplays; ++i) cuda_ok(cudaGraphLaunch(exec, stream), "launch");
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    const float want = std::pow(static_cast<float>(R), static_cast<float>(kReplays));  // a power of two: exact
    got = to_host(red, static_cast<size_t>(n_red));
    for (int64_t i = 0; i < n_red; ++i)
      require(got[static_cast<size_t>(i)] == want, "all_reduce in graph: " + std::to_string(got[static_cast<size_t>(i)]) + " at " +
                                                       std::to_string(i) + ", want " + std::to_string(want));
    g->barrier();  // every rank's replays are done before the graph and buffer go
    cuda_ok(cudaGraphExecDestroy(exec), "exec destroy");
    cuda_ok(cudaGraphDestroy(graph), "graph destroy");
    cuda_ok(cudaFree(red), "free");
    if (rank == 0) std::printf("graph OK: %d replays of an in-place all_reduce on %d ranks\n", kReplays, R);
  });
  EXPECT_EQ(failed, "");
}

// A rank that stops taking part (rank R-1, alive: on virtual ranks its body returns, in the real form
// its process sleeps past the others' timeout, then exits without teardown): every other rank's
// barrier ends within the group's timeout (+ slack) with Timeout, or (virtual ranks: the group is
// aborted by the rank whose wait ran out first) CommError carrying that Timeout; on virtual ranks
// the error names the stopped rank (NCCL cannot tell which peer never called, so the real form's
// error names the operation only). The group is aborted: the next call throws CommError at once.
TEST_P(GroupCudaPeers, ARankThatNeverCallsTimesOut) {
  if (gpus() < 1) GTEST_SKIP() << "needs a GPU (virtual ranks run on one), found none";
  const int R = GetParam();
  const bool real = !virtual_ranks_for(R);
  const int stopped = R - 1;
  const double timeout = real ? 15.0 : 3.0;  // NCCL's start-up of R processes runs under this bound too
  const std::string who = "rank " + std::to_string(stopped);
  const std::string failed = on_ranks(
      R, 120.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        g->barrier();  // every rank alive
        if (rank == stopped) {
          if (real) {  // alive, but never calls; then gone without teardown
            std::this_thread::sleep_for(std::chrono::duration<double>(timeout + 3.0));
            std::fflush(stdout);
            _exit(0);
          }
          return;
        }
        const auto t0 = std::chrono::steady_clock::now();
        std::string what;
        try {
          g->barrier();
        } catch (const Timeout& e) {
          what = std::string("Timeout: ") + e.what();
        } catch (const CommError& e) {
          what = std::string("CommError: ") + e.what();
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: after %.2f s (timeout %.1f s): %s\n", rank, s, timeout, what.c_str());
        std::fflush(stdout);
        require(!what.empty(), "a barrier without " + who + " must throw Timeout or CommError");
        require(real || what.find(who) != std::string::npos, "the error does not name " + who + ": '" + what + "'");
        require(s >= 0.9 * timeout && s < timeout + 5.0, "the error came after " + std::to_string(s) + " s");
        bool threw = false;
        try {
          g->barrier();
        } catch (const CommError&) {
          threw = true;  // aborted group: every later call fails at once
        }
        require(threw, "a call after the abort must throw CommError");
        if (real) {  // the group is aborted: exit without teardown
          std::fflush(stdout);
          _exit(0);
        }
      },
      timeout);
  EXPECT_EQ(failed, "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, GroupCuda, ::testing::Values(1, 2, 4, 8), [](const auto& info) { return "R" + std::to_string(info.param); });
INSTANTIATE_TEST_SUITE_P(Ranks, GroupCudaPeers, ::testing::Values(2, 4, 8), [](const auto& info) { return "R" + std::to_string(info.param); });

// ---- NCCL internals: the real form, one forked process per GPU --------------------------------------

TEST(NcclGroupCuda, SymmetricMemoryLsaWriteToNextRank) {
  const int n = gpus();
  if (n < 1) GTEST_SKIP() << "needs a GPU: NCCL LSA windows and the LSA barrier (real form only), found none";
  const int world = n;
  const std::string path = fresh_dir() + "/uid";
  const std::string failed = run_ranks_forked(world, 240.0, [&](int rank) {
    auto g = make_nccl_group(path, rank, world, rank, 60.0);
    auto* ng = dynamic_cast<comm::NcclGroup*>(g.get());
    require(ng != nullptr, "make_nccl_group returns an NcclGroup");
    require(ng->lsa_size() == world, "one LSA team on one host: lsa_size = " + std::to_string(ng->lsa_size()));
    // The single-node fast path: one node, the device communicator on the global communicator.
    require(g->num_nodes() == 1 && g->node_layout().lsa_size == world && ng->node_comm() == ng->comm(),
            "one host is one node: layout " + g->node_layout().describe());
    const int64_t bytes = (8 << 20) + 12;  // not a multiple of the 4 KiB window alignment
    const int64_t words = bytes / 4;
    SymmetricBuffer buf = g->alloc_symmetric(bytes);
    require(buf.bytes == bytes && buf.local != nullptr, "buffer");
    require(static_cast<int>(buf.peers.size()) == world && buf.peers[rank] == buf.local, "peers[rank] == local");
    for (int r = 0; r < world; ++r) require(buf.peers[r] != nullptr, "peer pointer " + std::to_string(r));
    require(ng->window(buf) != nullptr, "window");
    auto zeros = to_host(static_cast<const uint32_t*>(buf.local), static_cast<size_t>(words));
    for (int64_t i = 0; i < words; ++i) require(zeros[i] == 0, "zero-filled at " + std::to_string(i));

    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    int* mismatches = to_device(std::vector<int>{0});
    const int next = (rank + 1) % world, prev = (rank + world - 1) % world;

    // Device-ordered: LSA stores into the next rank, LSA barrier (acq_rel), check in-stream.
    g->barrier();  // every rank's zero check is done before anyone writes
    comm::launch_fill_pattern(static_cast<uint32_t*>(buf.peers[next]), words, 1000u + rank, stream);
    ng->lsa_barrier(Stream{stream});
    comm::launch_count_pattern_mismatches(static_cast<const uint32_t*>(buf.local), words, 1000u + prev, mismatches, stream);
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    require(to_host(mismatches, 1)[0] == 0, "LSA round: " + std::to_string(to_host(mismatches, 1)[0]) +
                                                " words from rank " + std::to_string(prev) + " differ");
    auto got = to_host(static_cast<const uint32_t*>(buf.local), static_cast<size_t>(words));
    for (int64_t i = 0; i < words; ++i)
      require(got[i] == comm::pattern_word(1000u + prev, i), "LSA round host check at word " + std::to_string(i));

    // A second buffer gets its own window; a foreign pointer has none.
    SymmetricBuffer other = g->alloc_symmetric(4096);
    require(ng->window(other) != ng->window(buf), "distinct windows");
    bool threw = false;
    try {
      SymmetricBuffer fake;
      fake.local = mismatches;
      ng->window(fake);
    } catch (const InvalidArgument&) {
      threw = true;
    }
    require(threw, "window() of a foreign buffer throws InvalidArgument");
    g->barrier();  // quiesce before the buffers deregister (NCCL-DEVICE-API.md §1.5)
    cudaFree(mismatches);
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (rank == 0) std::printf("LSA OK: %d ranks wrote %lld bytes each into the next rank through the LSA barrier\n", world,
                               static_cast<long long>(bytes));
  });
  EXPECT_EQ(failed, "");
}

TEST(NcclGroupCuda, GraphReplayOfLsaKernelsAndCollective) {
  const int n = gpus();
  if (n < 1) GTEST_SKIP() << "needs a GPU: NCCL LSA stores and the LSA barrier in a CUDA graph (real form only), found none";
  const int world = n;
  const std::string path = fresh_dir() + "/uid";
  const std::string failed = run_ranks_forked(world, 240.0, [&](int rank) {
    auto g = make_nccl_group(path, rank, world, rank, 60.0);
    auto* ng = dynamic_cast<comm::NcclGroup*>(g.get());
    const int64_t words = 1 << 18;
    SymmetricBuffer buf = g->alloc_symmetric(words * 4);
    const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    int* mismatches = to_device(std::vector<int>{0});
    const int64_t n_red = 1024;
    float* red = to_device(std::vector<float>(n_red, 1.0f));
    g->all_reduce_sum(red, red, n_red, DType::fp32, Stream{stream});  // connect before capturing
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    test::upload_device(red, std::vector<float>(n_red, 1.0f).data(), n_red * 4, "reset");
    g->barrier();

    // One graph: LSA stores into the next rank, the LSA barrier, the in-stream check, and a host
    // collective. Replays must stay correct: barrier epochs live in device memory.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    comm::launch_fill_pattern(static_cast<uint32_t*>(buf.peers[next]), words, 3000u + rank, stream);
    ng->lsa_barrier(Stream{stream});
    comm::launch_count_pattern_mismatches(static_cast<const uint32_t*>(buf.local), words, 3000u + prev, mismatches, stream);
    g->all_reduce_sum(red, red, n_red, DType::fp32, Stream{stream});
    cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    constexpr int kReplays = 20;
    for (int i = 0; i < kReplays; ++i) cuda_ok(cudaGraphLaunch(exec, stream), "launch");
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    require(to_host(mismatches, 1)[0] == 0, "graph replays saw " + std::to_string(to_host(mismatches, 1)[0]) + " bad words");
    const float want = std::pow(static_cast<float>(world), static_cast<float>(kReplays));
    const auto got = to_host(red, static_cast<size_t>(n_red));
    for (int64_t i = 0; i < n_red; ++i) require(got[i] == want, "all_reduce in graph: " + std::to_string(got[i]));
    g->barrier();
    cuda_ok(cudaGraphExecDestroy(exec), "exec destroy");
    cuda_ok(cudaGraphDestroy(graph), "graph destroy");
    cudaFree(mismatches);
    cudaFree(red);
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (rank == 0) std::printf("graph OK: %d replays of LSA stores + LSA barrier + all_reduce on %d ranks\n", kReplays, world);
  });
  EXPECT_EQ(failed, "");
}

TEST(NcclGroupCuda, DeadPeerFailsBarrierWithinTimeout) {
  const int n = gpus();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs: a rank's process dies (real form only: virtual ranks share one process), found " << n;
  const std::string path = fresh_dir() + "/uid";
  const std::string failed = run_ranks_forked(2, 120.0, [&](int rank) {
    auto g = make_nccl_group(path, rank, 2, rank, 5.0);
    g->barrier();  // both alive
    if (rank == 1) {
      std::fflush(stdout);
      _exit(0);  // dies without cleanup, as a killed rank would
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::string what;
    try {
      g->barrier();
    } catch (const Timeout& e) {
      what = std::string("Timeout: ") + e.what();
    } catch (const CommError& e) {
      what = std::string("CommError: ") + e.what();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    require(!what.empty(), "barrier with a dead peer must throw Timeout or CommError");
    require(s < 30.0, "the failure came after " + std::to_string(s) + " s");
    std::printf("expected after %.1f s: %s\n", s, what.c_str());
    bool threw = false;
    try {
      g->barrier();
    } catch (const CommError&) {
      threw = true;  // aborted group: every later call fails at once
    }
    require(threw, "a call after the abort must throw CommError");
  });
  EXPECT_EQ(failed, "");
}

TEST(NcclGroupCuda, RecreateFromEnvironment) {
  const int n = gpus();
  if (n < 1) GTEST_SKIP() << "needs a GPU: NCCL groups from the launcher's environment (real form only), found none";
  const int world = n;
  const std::string dir = fresh_dir();
  const std::string failed = run_ranks_forked(world, 240.0, [&](int rank) {
    for (int round = 0; round < 2; ++round) {  // create, destroy, create again in one process
      setenv("EPX_RANK", std::to_string(rank).c_str(), 1);
      setenv("EPX_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("EPX_RENDEZVOUS", (dir + "/uid" + std::to_string(round)).c_str(), 1);
      setenv("EPX_LOCAL_RANK", std::to_string(rank).c_str(), 1);
      auto g = make_nccl_group_from_env(60.0);
      const auto all = g->all_gather_i64(round * 100 + rank);
      for (int r = 0; r < world; ++r) require(all[r] == round * 100 + r, "round " + std::to_string(round));
      SymmetricBuffer b = g->alloc_symmetric(1 << 16);
      g->barrier();
    }
  });
  EXPECT_EQ(failed, "");
}

// Two virtual nodes (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: NCCL's socket transport between the
// GPUs of one host, every GPU its own NCCL node), meeting over TCP: the layout is found and agrees
// with NCCL, host collectives run across the nodes, and each node gets its own communicator with a
// device communicator and windows (LSA team of 1: no peer pointer across nodes).
TEST(NcclGroupCuda, VirtualNodesOverTcp) {
  const int n = gpus();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs: NCCL's node layout over sockets, one GPU per rank (real form only), found " << n;
  const int world = 2;
  const int port = test::free_tcp_port();
  ASSERT_GT(port, 0);
  const std::string failed = run_ranks_forked(world, 240.0, [&](int rank) {
    setenv("NCCL_P2P_DISABLE", "1", 1);
    setenv("NCCL_SHM_DISABLE", "1", 1);
    setenv("EPX_RANK", std::to_string(rank).c_str(), 1);
    setenv("EPX_WORLD_SIZE", std::to_string(world).c_str(), 1);
    setenv("EPX_LOCAL_RANK", std::to_string(rank).c_str(), 1);
    setenv("EPX_RENDEZVOUS", ("tcp://127.0.0.1:" + std::to_string(port)).c_str(), 1);
    auto g = make_nccl_group_from_env(60.0);
    auto* ng = dynamic_cast<comm::NcclGroup*>(g.get());
    require(ng != nullptr, "make_nccl_group returns an NcclGroup");
    const NodeLayout l = g->node_layout();
    require(l.describe() == "2 nodes x 1 rank" && g->num_nodes() == 2 && g->node_id() == rank && g->local_rank() == 0 &&
                g->ranks_per_node() == 1 && l.node_of_rank == std::vector<int>({0, 1}),
            "layout " + l.describe() + ", node " + std::to_string(g->node_id()));
    require(l.lsa_size == 1 && ng->lsa_size() == 1, "NCCL's LSA team on a virtual node: " + std::to_string(l.lsa_size));
    require(ng->node_comm() != ng->comm(), "a per-node communicator beside the global one");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    check_collectives(*g, stream);  // across the nodes, NCCL's network transport
    // Symmetric memory on the node communicator: this rank's own buffer only.
    const int64_t words = 1 << 16;
    SymmetricBuffer buf = g->alloc_symmetric(words * 4);
    require(buf.peers[static_cast<size_t>(rank)] == buf.local && buf.peers[static_cast<size_t>(1 - rank)] == nullptr,
            "peers: own buffer, none across nodes");
    int* mismatches = to_device(std::vector<int>{0});
    comm::launch_fill_pattern(static_cast<uint32_t*>(buf.peers[static_cast<size_t>(rank)]), words, 77u + rank, stream);
    ng->lsa_barrier(Stream{stream});
    comm::launch_count_pattern_mismatches(static_cast<const uint32_t*>(buf.local), words, 77u + rank, mismatches, stream);
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    require(to_host(mismatches, 1)[0] == 0, "LSA store + barrier on the node communicator");
    g->barrier();
    cudaFree(mismatches);
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (rank == 0) std::printf("virtual nodes OK: %s, NCCL LSA team %d, collectives across nodes\n", l.describe().c_str(), l.lsa_size);
  });
  EXPECT_EQ(failed, "");
}

TEST(NcclGroupCuda, MissingRankTimesOut) {
  const int n = gpus();
  if (n < 1) GTEST_SKIP() << "needs a GPU: NCCL group creation without a rank (real form only), found none";
  const std::string path = fresh_dir() + "/uid";
  // Only rank 0 of a 2-rank group shows up: creation must fail with Timeout within its bound.
  const std::string failed = run_ranks_forked(1, 90.0, [&](int) {
    const auto t0 = std::chrono::steady_clock::now();
    bool timed_out = false;
    try {
      auto g = make_nccl_group(path, 0, 2, 0, 3.0);
    } catch (const Timeout& e) {
      timed_out = true;
      std::printf("expected: %s\n", e.what());
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    require(timed_out, "group creation without rank 1 must throw Timeout");
    require(s < 30.0, "Timeout came after " + std::to_string(s) + " s");
  });
  EXPECT_EQ(failed, "");
}

#endif  // EPX_WITH_CUDA

}  // namespace
}  // namespace epx
