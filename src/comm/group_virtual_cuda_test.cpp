// comm/group_virtual_cuda_test.cpp: virtual ranks (make_virtual_cuda_groups): R ranks as threads of
// one process on one GPU. Every collective against the CPU group on the same inputs (bit for bit),
// with device and host memory, on the rank's stream and on the legacy default stream, in place;
// symmetric memory; CUDA-graph capture and replay; the launch share of ll; and the timeouts that
// name a rank that stops taking part, on the host side and on the device side.
//
// Each case runs in a forked child (tests/cuda_ranks.h with EPX_TEST_VIRTUAL_RANKS forced), so the
// gtest process never initialises CUDA and a hang is killed at the deadline.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/group.h"
#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#include "cuda_ranks.h"

namespace epx {
namespace {

#ifdef EPX_WITH_CUDA

using test::cuda_ok;
using test::has_gpu;
using test::run_ranks_forked;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

/// fn(rank, group) on R virtual ranks in one forked child; "" on success.
std::string on_virtual_ranks(int R, const std::function<void(int, const std::shared_ptr<Group>&)>& fn, double timeout_s = 30.0,
                             int ranks_per_node = 0) {
  return run_ranks_forked(1, 240.0, [&](int) {
    auto groups = make_virtual_cuda_groups(R, 0, timeout_s, ranks_per_node);
    run_ranks(groups, [&](int rank) {
      cuda_ok(cudaSetDevice(0), "cudaSetDevice");
      fn(rank, groups[static_cast<size_t>(rank)]);
    });
  });
}

/// Random bf16 bit patterns of finite values (fresh per call).
std::vector<uint16_t> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-4.0f, 4.0f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16_bits(d(gen));
  return v;
}

std::vector<float> random_f32(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-4.0f, 4.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

/// Device buffer of `bytes`, poisoned with 0xFF, freed at scope end.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n) : bytes(n) {
    cuda_ok(cudaMalloc(&p, std::max<size_t>(n, 1)), "cudaMalloc");
    cuda_ok(cudaMemset(p, 0xFF, std::max<size_t>(n, 1)), "poison");
    cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), "poison");
  }
  ~DevBuf() { (void)cudaFree(p); }
  void upload(const void* src, size_t n) {
    cuda_ok(cudaMemcpy(p, src, n, cudaMemcpyHostToDevice), "upload");
    cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), "upload");
  }
  std::vector<uint8_t> download(cudaStream_t s) const {
    std::vector<uint8_t> out(bytes);
    cuda_ok(cudaStreamSynchronize(s), "sync");
    if (bytes) cuda_ok(cudaMemcpy(out.data(), p, bytes, cudaMemcpyDeviceToHost), "download");
    return out;
  }
};

std::vector<uint8_t> as_bytes(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

/// The CPU group's results of one rank for the same calls (the oracle): runs `fn` on R CPU ranks.
template <class Fn>
std::vector<std::vector<uint8_t>> cpu_results(int R, Fn&& fn) {
  std::vector<std::vector<uint8_t>> out(static_cast<size_t>(R));
  auto groups = make_cpu_groups(R, 30.0);
  run_ranks(groups, [&](int r) { out[static_cast<size_t>(r)] = fn(r, *groups[static_cast<size_t>(r)]); });
  return out;
}

// Per rank r: a block of r + 3 elements (all_gatherv / all_to_allv sizes differ per rank pair).
int64_t block_elems(int from, int to) { return 3 + from + 2 * to; }

/// Every collective once, on one group, with device buffers on `stream` (or host buffers when
/// `host`); returns the concatenated result bytes. The same function runs on CPU ranks (host).
std::vector<uint8_t> all_collectives(int r, Group& g, cudaStream_t stream, bool host, uint32_t seed) {
  const int R = g.size();
  std::vector<uint8_t> result;
  auto run = [&](const std::vector<uint8_t>& send, size_t recv_bytes, const std::function<void(const void*, void*)>& call) {
    if (host || g.device().is_cpu()) {
      std::vector<uint8_t> recv(recv_bytes, 0xAB);
      call(send.data(), recv.data());
      result.insert(result.end(), recv.begin(), recv.end());
      return;
    }
    DevBuf ds(send.size()), dr(recv_bytes);
    ds.upload(send.data(), send.size());
    call(ds.p, dr.p);
    const auto got = dr.download(stream);
    result.insert(result.end(), got.begin(), got.end());
  };
  const Stream st{stream};
  {  // all_gather: 40 bytes per rank
    const auto v = random_bf16(20, seed + static_cast<uint32_t>(r));
    run(as_bytes(v.data(), 40), static_cast<size_t>(40 * R), [&](const void* s, void* d) { g.all_gather(s, d, 40, st); });
  }
  {  // all_gatherv: rank q sends 2 * (q + 1) bytes
    std::vector<int64_t> sizes;
    int64_t total = 0;
    for (int q = 0; q < R; ++q) total += sizes.emplace_back(2 * (q + 1));
    const auto v = random_bf16(static_cast<size_t>(r + 1), seed + 100 + static_cast<uint32_t>(r));
    run(as_bytes(v.data(), static_cast<size_t>(2 * (r + 1))), static_cast<size_t>(total), [&](const void* s, void* d) { g.all_gatherv(s, d, sizes, st); });
  }
  for (DType dt : {DType::bf16, DType::fp32}) {  // all_reduce_sum, 37 elements
    const size_t es = dt == DType::bf16 ? 2 : 4;
    std::vector<uint8_t> send;
    if (dt == DType::bf16) {
      const auto v = random_bf16(37, seed + 200 + static_cast<uint32_t>(r));
      send = as_bytes(v.data(), 37 * es);
    } else {
      const auto v = random_f32(37, seed + 300 + static_cast<uint32_t>(r));
      send = as_bytes(v.data(), 37 * es);
    }
    run(send, 37 * es, [&](const void* s, void* d) { g.all_reduce_sum(s, d, 37, dt, st); });
    // reduce_scatterv: counts[q] = q + 2
    std::vector<int64_t> counts;
    int64_t total = 0;
    for (int q = 0; q < R; ++q) total += counts.emplace_back(q + 2);
    std::vector<uint8_t> rs_send;
    if (dt == DType::bf16) {
      const auto w = random_bf16(static_cast<size_t>(total), seed + 400 + static_cast<uint32_t>(r));
      rs_send = as_bytes(w.data(), static_cast<size_t>(total) * es);
    } else {
      const auto w = random_f32(static_cast<size_t>(total), seed + 450 + static_cast<uint32_t>(r));
      rs_send = as_bytes(w.data(), static_cast<size_t>(total) * es);
    }
    run(rs_send, static_cast<size_t>(r + 2) * es,
        [&](const void* s, void* d) { g.reduce_scatterv(s, d, counts, dt, st); });
  }
  {  // all_to_allv: rank r sends block_elems(r, d) bf16 to d
    std::vector<int64_t> sb, rb;
    int64_t stotal = 0, rtotal = 0;
    for (int q = 0; q < R; ++q) {
      stotal += sb.emplace_back(2 * block_elems(r, q));
      rtotal += rb.emplace_back(2 * block_elems(q, r));
    }
    const auto v = random_bf16(static_cast<size_t>(stotal / 2), seed + 500 + static_cast<uint32_t>(r));
    run(as_bytes(v.data(), static_cast<size_t>(stotal)), static_cast<size_t>(rtotal),
        [&](const void* s, void* d) { g.all_to_allv(s, sb, d, rb, st); });
  }
  return result;
}

class VirtualRanks : public ::testing::TestWithParam<int> {};

TEST_P(VirtualRanks, EveryCollectiveEqualsTheCpuGroup) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  const int R = GetParam();
  const uint32_t seed = static_cast<uint32_t>(std::random_device{}());
  const auto want = cpu_results(R, [&](int r, Group& g) { return all_collectives(r, g, nullptr, true, seed); });
  for (int mode = 0; mode < 3; ++mode) {  // 0: device memory on the rank's stream, 1: legacy stream, 2: host memory
    const std::string failed = on_virtual_ranks(R, [&](int r, const std::shared_ptr<Group>& g) {
      require(g->device().is_cuda() && g->ranks_per_gpu() == R && g->size() == R && g->rank() == r, "group identity");
      cudaStream_t s = nullptr;
      if (mode != 1) cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
      const auto got = all_collectives(r, *g, s, mode == 2, seed);
      if (s) cuda_ok(cudaStreamDestroy(s), "stream");
      const auto& w = want[static_cast<size_t>(r)];
      require(got.size() == w.size(), "result size " + std::to_string(got.size()) + " want " + std::to_string(w.size()));
      for (size_t i = 0; i < got.size(); ++i)
        require(got[i] == w[i], "mode " + std::to_string(mode) + " rank " + std::to_string(r) + ": byte " + std::to_string(i) + " is " +
                                    std::to_string(got[i]) + ", the CPU group's " + std::to_string(w[i]));
    });
    EXPECT_EQ(failed, "") << "mode " << mode << " seed " << seed;
  }
}

TEST_P(VirtualRanks, AllReduceInPlaceAndSymmetricMemory) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  const int R = GetParam();
  const std::string failed = on_virtual_ranks(R, [&](int r, const std::shared_ptr<Group>& g) {
    cudaStream_t s;
    cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    // In place: recv == send; every rank's value r + 1 at every element: the sum is R (R + 1) / 2.
    const int64_t n = 1000;
    std::vector<float> v(static_cast<size_t>(n), static_cast<float>(r + 1));
    DevBuf b(static_cast<size_t>(n) * 4);
    b.upload(v.data(), static_cast<size_t>(n) * 4);
    g->all_reduce_sum(b.p, b.p, n, DType::fp32, Stream{s});
    const auto got = b.download(s);
    const float want = static_cast<float>(R * (R + 1) / 2);
    for (int64_t i = 0; i < n; ++i) {
      float x;
      std::memcpy(&x, got.data() + i * 4, 4);
      require(x == want, "in place: element " + std::to_string(i) + " is " + std::to_string(x) + ", want " + std::to_string(want));
    }
    // Symmetric memory: zero-filled, peers[q] is rank q's allocation, writable from any rank.
    SymmetricBuffer buf = g->alloc_symmetric(4096);
    require(buf.peers.size() == static_cast<size_t>(R) && buf.peers[static_cast<size_t>(r)] == buf.local, "peers[rank] == local");
    std::vector<uint8_t> zero(4096, 1);
    cuda_ok(cudaMemcpy(zero.data(), buf.local, 4096, cudaMemcpyDeviceToHost), "read");
    for (uint8_t x : zero) require(x == 0, "alloc_symmetric is zero-filled");
    g->barrier();  // every rank has checked its zeros before any peer writes into its buffer
    const int next = (r + 1) % R;
    const uint32_t word = 0xC0DE0000u + static_cast<uint32_t>(r);
    cuda_ok(cudaMemcpyAsync(static_cast<char*>(buf.peers[static_cast<size_t>(next)]) + 64, &word, 4, cudaMemcpyHostToDevice, s), "write peer");
    cuda_ok(cudaStreamSynchronize(s), "sync");
    g->barrier();
    uint32_t seen = 0;
    cuda_ok(cudaMemcpy(&seen, static_cast<char*>(buf.local) + 64, 4, cudaMemcpyDeviceToHost), "read own");
    const int prev = (r + R - 1) % R;
    require(seen == 0xC0DE0000u + static_cast<uint32_t>(prev), "rank " + std::to_string(r) + " holds " + std::to_string(seen) + " from its peer");
    g->barrier();
    cuda_ok(cudaStreamDestroy(s), "stream");
  });
  EXPECT_EQ(failed, "");
}

TEST_P(VirtualRanks, GraphReplayEqualsEager) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  const int R = GetParam();
  const std::string failed = on_virtual_ranks(R, [&](int r, const std::shared_ptr<Group>& g) {
    cudaStream_t s;
    cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    const int64_t n = 256;
    DevBuf in(static_cast<size_t>(n) * 2), gathered(static_cast<size_t>(n * R) * 2), summed(static_cast<size_t>(n) * 2);
    auto step = [&] {
      g->all_gather(in.p, gathered.p, n * 2, Stream{s});
      g->all_reduce_sum(in.p, summed.p, n, DType::bf16, Stream{s});
    };
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
    step();
    cuda_ok(cudaStreamEndCapture(s, &graph), "end capture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    for (int round = 0; round < 3; ++round) {
      const auto v = random_bf16(static_cast<size_t>(n), static_cast<uint32_t>(1000 * round + r + 7));
      in.upload(v.data(), static_cast<size_t>(n) * 2);
      step();  // eager
      const auto eager_g = gathered.download(s), eager_s = summed.download(s);
      cuda_ok(cudaMemsetAsync(gathered.p, 0xFF, gathered.bytes, s), "poison");
      cuda_ok(cudaMemsetAsync(summed.p, 0xFF, summed.bytes, s), "poison");
      g->barrier();  // every rank read its eager results before any replay overwrites them
      cuda_ok(cudaGraphLaunch(exec, s), "replay");
      require(gathered.download(s) == eager_g, "round " + std::to_string(round) + ": replayed all_gather differs from eager");
      require(summed.download(s) == eager_s, "round " + std::to_string(round) + ": replayed all_reduce_sum differs from eager");
      g->barrier();
    }
    cuda_ok(cudaGraphExecDestroy(exec), "exec");
    cuda_ok(cudaGraphDestroy(graph), "graph");
    cuda_ok(cudaStreamDestroy(s), "stream");
  });
  EXPECT_EQ(failed, "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, VirtualRanks, ::testing::Values(1, 2, 4, 8), [](const auto& info) { return "R" + std::to_string(info.param); });

TEST(VirtualRanksTimeout, ARankThatReturnsIsNamedOnEveryOther) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  for (int R : {2, 4}) {
    const int stopped = R - 1;
    const std::string failed = run_ranks_forked(1, 120.0, [&](int) {
      auto groups = make_virtual_cuda_groups(R, 0, 2.0);
      std::vector<std::string> seen(static_cast<size_t>(R));
      try {
        run_ranks(groups, [&](int r) {
          cuda_ok(cudaSetDevice(0), "cudaSetDevice");
          if (r == stopped) return;  // stops taking part
          std::vector<int64_t> v(static_cast<size_t>(R));
          try {
            groups[static_cast<size_t>(r)]->all_gather(&r, v.data(), 4, Stream{});
          } catch (const Error& e) {
            seen[static_cast<size_t>(r)] = e.what();
            throw;
          }
        });
      } catch (const Error&) {
      }
      for (int r = 0; r < R; ++r) {
        if (r == stopped) continue;
        const std::string& m = seen[static_cast<size_t>(r)];
        // The first rank to time out names the missing rank; the others may see the world aborted with that reason.
        require(m.find("rank " + std::to_string(stopped)) != std::string::npos || m.find("[" + std::to_string(stopped)) != std::string::npos ||
                    m.find(std::to_string(stopped) + "]") != std::string::npos,
                "rank " + std::to_string(r) + "'s error does not name rank " + std::to_string(stopped) + ": " + m);
      }
    });
    EXPECT_EQ(failed, "") << "R = " << R;
  }
}

TEST(VirtualRanksTimeout, AHeldUpStreamIsNamed) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  const std::string failed = run_ranks_forked(1, 120.0, [&](int) {
    auto groups = make_virtual_cuda_groups(2, 0, 2.0);
    std::string rank0_error;
    try {
      run_ranks(groups, [&](int r) {
        cuda_ok(cudaSetDevice(0), "cudaSetDevice");
        cudaStream_t s;
        cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
        DevBuf a(64), b(128);
        if (r == 1) {  // rank 1's stream is held up on the host for longer than the timeout
          cuda_ok(cudaLaunchHostFunc(s, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(4500)); }, nullptr), "hold");
        }
        try {
          groups[static_cast<size_t>(r)]->all_gather(a.p, b.p, 64, Stream{s});
        } catch (const Timeout& e) {
          if (r == 0) rank0_error = e.what();
          throw;
        }
        if (r == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(3500));
          try {
            groups[0]->all_gather(a.p, b.p, 64, Stream{s});
          } catch (const Timeout& e) {
            rank0_error = e.what();
          }
        }
        (void)cudaStreamSynchronize(s);
        (void)cudaStreamDestroy(s);
      });
    } catch (const Error&) {
    }
    // Named either by the device barrier (rank 1's thread arrived, its stream did not) or by the host
    // phase (rank 1's thread was held too: on an H100 its next CUDA call waited while its stream ran the
    // host function). Either way a named Timeout, never a hang.
    require(rank0_error.find("rank 1 did not reach the device side") != std::string::npos ||
                rank0_error.find("rank 1 did not arrive") != std::string::npos,
            "rank 0's error: '" + rank0_error + "'");
  });
  EXPECT_EQ(failed, "");
}

TEST(VirtualRanksShare, LlTakesItsShareOfTheSmsAndRefusesMore) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  const std::string failed = on_virtual_ranks(4, [&](int, const std::shared_ptr<Group>& g) {
    DispatchConfig cfg;
    cfg.num_experts = 8;
    cfg.top_k = 2;
    cfg.hidden = 256;
    cfg.num_max_dispatch_tokens_per_rank = 8;
    Config c = Config::load();
    c.ll_num_blocks = 0;
    auto pf = make_prepare_finalize("ll", g, cfg, c);  // one per SM of its share: fits
    int sms = 0;
    cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SMs");
    c.ll_num_blocks = std::min(sms, 256);  // the whole GPU: more than a quarter of what fits on it
    std::string msg;
    try {
      auto too_many = make_prepare_finalize("ll", g, cfg, c);
    } catch (const InvalidArgument& e) {
      msg = e.what();
    }
    require(msg.find("ll.num_blocks") != std::string::npos && msg.find("ranks sharing it") != std::string::npos,
            "ll.num_blocks = all SMs on 4 virtual ranks: '" + msg + "'");
  });
  EXPECT_EQ(failed, "");
}

// Lazy kernel loading (CUDA's default) is refused by name for more than one rank: this test runs
// itself again with CUDA_MODULE_LOADING=LAZY (the mode is read when CUDA starts, so it takes a fresh
// process) and the child checks the refusal.
TEST(VirtualRanksLoading, LazyKernelLoadingIsRefusedByName) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  if (!env_or("EPX_TEST_LAZY_CHILD", "").empty()) {
    std::string msg;
    try {
      auto groups = make_virtual_cuda_groups(2, 0);
    } catch (const Unsupported& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("CUDA_MODULE_LOADING"), std::string::npos) << "2 virtual ranks under lazy loading: '" << msg << "'";
    EXPECT_NO_THROW(make_virtual_cuda_groups(1, 0));  // one rank waits on nobody
    if (!msg.empty()) std::printf("refused: %s\n", msg.c_str());
    return;
  }
  const std::string cmd = "CUDA_MODULE_LOADING=LAZY EPX_TEST_LAZY_CHILD=1 /proc/self/exe "
                          "--gtest_filter=VirtualRanksLoading.LazyKernelLoadingIsRefusedByName 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int status = ::pclose(p);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("refused: "), std::string::npos) << out;
}

#else

TEST(VirtualRanks, NeedsACudaBuild) {
  EXPECT_THROW(make_virtual_cuda_groups(2), Unsupported);
  GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)";
}

#endif  // EPX_WITH_CUDA

}  // namespace
}  // namespace epx
