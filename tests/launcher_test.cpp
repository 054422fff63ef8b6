// tests/launcher_test.cpp: the epx launcher (src/comm/launcher.h) with CPU-only children: agreed exit
// codes pass through, a rank that dies or fails early stops its peers within the grace period and is
// named, exceptions become exit codes, and the rendezvous directory is fresh and removed.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "test_util.h"
#include "comm/launcher.h"
#include "epx/error.h"
#include "epx/group.h"

namespace epx::comm {
namespace {

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(Launcher, AllRanksSucceed) {
  LaunchOptions o;
  o.num_ranks = 3;
  LaunchResult r = launch_ranks(o, [](const RankEnv& env) {
    // Every rank sees its place, the same run directory and a rendezvous path inside it.
    if (env.world != 3 || env.rank < 0 || env.rank >= 3) return 5;
    if (!std::filesystem::is_directory(env.run_dir)) return 6;
    if (env.rendezvous_path.rfind(env.run_dir, 0) != 0) return 7;
    std::ofstream(env.run_dir + "/rank" + std::to_string(env.rank)) << env.rank;
    return 0;
  });
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_TRUE(r.failure.empty()) << r.failure;
  ASSERT_EQ(r.ranks.size(), 3u);
  for (const RankExit& e : r.ranks) EXPECT_TRUE(e.exited && e.exit_code == 0);
}

TEST(Launcher, AgreedFailureCodePassesThroughWithoutKilling) {
  LaunchOptions o;
  o.num_ranks = 2;
  o.grace_s = 30;
  LaunchResult r = launch_ranks(o, [](const RankEnv& env) {
    if (env.rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 0 reports last
    return 1;
  });
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(r.failure.empty()) << r.failure;
  for (const RankExit& e : r.ranks) EXPECT_FALSE(e.killed_by_launcher);
}

TEST(Launcher, ReporterRankDecidesAfterThePeersFinished) {
  LaunchOptions o;
  o.num_ranks = 2;
  o.reporter_rank = 0;
  LaunchResult r = launch_ranks(o, [](const RankEnv& env) {
    if (env.rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // validates after rank 1 left
      return 1;
    }
    return 0;
  });
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(r.failure.empty()) << r.failure;
}

TEST(Launcher, DeadRankStopsThePeersAndIsNamed) {
  LaunchOptions o;
  o.num_ranks = 3;
  o.grace_s = 0.5;
  LaunchResult r;
  const double s = seconds_of([&] {
    r = launch_ranks(o, [](const RankEnv& env) {
      if (env.rank == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        ::raise(SIGKILL);  // a rank killed mid-run
      }
      std::this_thread::sleep_for(std::chrono::seconds(120));  // peers stuck, e.g. in a collective
      return 0;
    });
  });
  EXPECT_LT(s, 10.0) << "the launcher must not wait for stuck peers";
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.failure.find("rank 1 was killed by signal 9"), std::string::npos) << r.failure;
  EXPECT_NE(r.failure.find("ranks 0, 2 were still running"), std::string::npos) << r.failure;
  EXPECT_TRUE(r.ranks[0].killed_by_launcher);
  EXPECT_FALSE(r.ranks[1].killed_by_launcher);
  EXPECT_TRUE(r.ranks[2].killed_by_launcher);
}

TEST(Launcher, EarlyExitIsAFailureOfThatRank) {
  LaunchOptions o;
  o.num_ranks = 2;
  o.grace_s = 0.2;
  LaunchResult r = launch_ranks(o, [](const RankEnv& env) {
    if (env.rank == 0) std::this_thread::sleep_for(std::chrono::seconds(120));
    return 7;
  });
  EXPECT_EQ(r.exit_code, 7);
  EXPECT_NE(r.failure.find("rank 1 exited with status 7"), std::string::npos) << r.failure;
  EXPECT_TRUE(r.ranks[0].killed_by_launcher);
}

TEST(Launcher, ExceptionsBecomeExitCodes) {
  LaunchOptions o;
  o.num_ranks = 2;
  o.grace_s = 5;
  LaunchResult r = launch_ranks(o, [](const RankEnv& env) -> int {
    if (env.rank == 0) throw InvalidArgument("test: x = 1: must be 2");
    throw std::runtime_error("boom");
  });
  EXPECT_EQ(r.ranks[0].exit_code, 2);
  EXPECT_EQ(r.ranks[1].exit_code, 1);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_FALSE(r.failure.empty());
}

TEST(Launcher, RunDirectoryIsRemoved) {
  std::string dir;
  LaunchOptions o;
  o.num_ranks = 1;
  // The child's view of the path is printed through its exit code only; learn it from a file name.
  const auto marker = std::filesystem::temp_directory_path() / ("epx_launcher_test_" + std::to_string(::getpid()));
  LaunchResult r = launch_ranks(o, [&](const RankEnv& env) {
    std::ofstream(marker) << env.run_dir;
    return 0;
  });
  ASSERT_EQ(r.exit_code, 0);
  std::ifstream(marker) >> dir;
  std::filesystem::remove(marker);
  ASSERT_FALSE(dir.empty());
  EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
}

TEST(Launcher, TcpRendezvousFromTheEnvironment) {
  // EPX_RENDEZVOUS=tcp://... reaches every rank, and the ranks meet over it (fake id, no NCCL).
  const int port = epx::test::free_tcp_port();
  ASSERT_GT(port, 0);
  const std::string where = "tcp://127.0.0.1:" + std::to_string(port);
  ::setenv("EPX_RENDEZVOUS", where.c_str(), 1);
  UniqueId id;
  for (int i = 0; i < UniqueId::kBytes; ++i) id.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 3 + 1);
  LaunchOptions o;
  o.num_ranks = 3;
  LaunchResult r = launch_ranks(o, [&](const RankEnv& env) {
    if (env.rendezvous_path != where) return 5;
    const RendezvousAddress a = RendezvousAddress::parse(env.rendezvous_path);
    if (!a.tcp || a.port != port) return 6;
    const UniqueId got = exchange_unique_id_tcp(a.host, a.port, env.rank, env.world, 20.0, env.rank == 0 ? &id : nullptr);
    return got == id ? 0 : 7;
  });
  ::unsetenv("EPX_RENDEZVOUS");
  EXPECT_EQ(r.exit_code, 0) << r.failure;
  // A file path in EPX_RENDEZVOUS is not used: every run needs a fresh file of its own.
  ::setenv("EPX_RENDEZVOUS", "/tmp/some/shared/file", 1);
  r = launch_ranks(o, [](const RankEnv& env) { return env.rendezvous_path.rfind(env.run_dir, 0) == 0 ? 0 : 8; });
  ::unsetenv("EPX_RENDEZVOUS");
  EXPECT_EQ(r.exit_code, 0) << r.failure;
}

TEST(Launcher, RejectsBadOptions) {
  LaunchOptions o;
  o.num_ranks = 0;
  EXPECT_THROW(launch_ranks(o, [](const RankEnv&) { return 0; }), InvalidArgument);
}

}  // namespace
}  // namespace epx::comm
