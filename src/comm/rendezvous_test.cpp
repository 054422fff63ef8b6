// Tests of the rendezvous over TCP (threads and forked processes, fake ids: no NCCL needed), the
// EPX_RENDEZVOUS address parser, and the node layout (NodeLayout, node_key_from_env).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"
#include "epx/config.h"
#include "epx/error.h"
#include "epx/group.h"

using namespace epx;

namespace {

// A port nobody listens on right now (test::free_tcp_port; racy in principle, see there).
int free_port() {
  const int port = test::free_tcp_port();
  EXPECT_GT(port, 0);
  return port;
}

UniqueId fake_id(uint8_t seed) {
  UniqueId id;
  for (int i = 0; i < UniqueId::kBytes; ++i) id.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(seed * 31 + i * 7);
  return id;
}

struct Outcome {
  UniqueId id;
  std::string type = "none";
  std::string what;
};

// Runs the TCP rendezvous on one thread per entry of `ranks` (rank, world) and collects results.
std::vector<Outcome> rendezvous_threads(int port, const std::vector<std::pair<int, int>>& ranks, double timeout_s, const UniqueId& id,
                                        const std::string& host = "127.0.0.1") {
  std::vector<Outcome> out(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        out[i].id = exchange_unique_id_tcp(host, port, ranks[i].first, ranks[i].second, timeout_s, ranks[i].first == 0 ? &id : nullptr);
      } catch (const Timeout& e) {
        out[i] = {{}, "Timeout", e.what()};
      } catch (const CommError& e) {
        out[i] = {{}, "CommError", e.what()};
      } catch (const InvalidArgument& e) {
        out[i] = {{}, "InvalidArgument", e.what()};
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace

TEST(Rendezvous, TcpThreadsEveryRankGetsRankZerosId) {
  const UniqueId id = fake_id(3);
  for (int world : {1, 2, 5}) {
    const int port = free_port();
    std::vector<std::pair<int, int>> ranks;
    for (int r = world - 1; r >= 0; --r) ranks.push_back({r, world});  // rank 0 last: clients retry until it listens
    const auto out = rendezvous_threads(port, ranks, 20.0, id);
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_EQ(out[i].type, "none") << "world " << world << " rank " << ranks[i].first << ": " << out[i].what;
      EXPECT_EQ(out[i].id, id) << "world " << world << " rank " << ranks[i].first;
    }
  }
}

TEST(Rendezvous, TcpProcessesAndLocalhostName) {
  // Forked processes (as ranks really are), meeting at tcp://localhost (IPv6 or IPv4 resolution).
  const UniqueId id = fake_id(9);
  const int port = free_port();
  const int world = 3;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 0;
      try {
        const UniqueId got = RendezvousAddress::parse("tcp://localhost:" + std::to_string(port)).tcp
                                 ? exchange_unique_id_tcp("localhost", port, r, world, 20.0, r == 0 ? &id : nullptr)
                                 : UniqueId{};
        code = got == id ? 0 : 3;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] %s\n", r, e.what());
        code = 1;
      }
      _exit(code);
    }
    pids.push_back(pid);
  }
  for (int r = 0; r < world; ++r) {
    int status = 0;
    ASSERT_EQ(waitpid(pids[static_cast<size_t>(r)], &status, 0), pids[static_cast<size_t>(r)]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << " status " << status;
  }
}

TEST(Rendezvous, TcpRankZeroAbsentTimesOutNamingTheAddress) {
  const int port = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  const auto out = rendezvous_threads(port, {{1, 2}}, 0.5, fake_id(1));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(out[0].type, "Timeout") << out[0].what;
  EXPECT_NE(out[0].what.find("rank 1 could not reach rank 0 at tcp://127.0.0.1:" + std::to_string(port)), std::string::npos) << out[0].what;
  EXPECT_LT(s, 5.0) << "the wait must be bounded by timeout_s";
}

TEST(Rendezvous, TcpMissingRankTimesOutOnEveryoneNamingIt) {
  const int port = free_port();
  // World 3 but rank 2 never comes: rank 0 names it; rank 1 (connected, no id) times out too.
  const auto out = rendezvous_threads(port, {{0, 3}, {1, 3}}, 1.0, fake_id(2));
  EXPECT_EQ(out[0].type, "Timeout") << out[0].what;
  EXPECT_NE(out[0].what.find("heard from 1 of 2 ranks"), std::string::npos) << out[0].what;
  EXPECT_NE(out[0].what.find("rank(s) 2 never connected"), std::string::npos) << out[0].what;
  EXPECT_TRUE(out[1].type == "Timeout" || out[1].type == "CommError") << out[1].type << ": " << out[1].what;
  EXPECT_NE(out[1].what.find("got no unique id"), std::string::npos) << out[1].what;
}

TEST(Rendezvous, TcpWorldMismatchAndDuplicateRankAreCommErrors) {
  {
    const int port = free_port();
    const auto out = rendezvous_threads(port, {{0, 2}, {1, 3}}, 10.0, fake_id(4));
    EXPECT_EQ(out[0].type, "CommError") << out[0].what;
    EXPECT_NE(out[0].what.find("world = 2 on rank 0 but 3 on rank 1"), std::string::npos) << out[0].what;
    EXPECT_EQ(out[1].type, "CommError") << out[1].what;
    EXPECT_NE(out[1].what.find("world = 3 on rank 1 but 2 on rank 0"), std::string::npos) << out[1].what;
  }
  {
    const int port = free_port();
    const auto out = rendezvous_threads(port, {{0, 3}, {1, 3}, {1, 3}}, 10.0, fake_id(5));
    EXPECT_EQ(out[0].type, "CommError") << out[0].what;
    EXPECT_NE(out[0].what.find("rank 1 connected twice"), std::string::npos) << out[0].what;
    int twice = 0;
    for (size_t i = 1; i < out.size(); ++i) twice += out[i].what.find("connected to tcp://127.0.0.1:" + std::to_string(port) + " twice") != std::string::npos;
    // One of the two rank-1 threads is told it is a duplicate; the other loses rank 0 (CommError).
    EXPECT_EQ(twice, 1) << out[1].what << " | " << out[2].what;
    for (size_t i = 1; i < out.size(); ++i) EXPECT_EQ(out[i].type, "CommError") << out[i].what;
  }
}

TEST(Rendezvous, TcpPortInUseIsACommErrorOnRankZero) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof a;
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int port = ntohs(a.sin_port);
  const UniqueId id = fake_id(6);
  try {
    exchange_unique_id_tcp("127.0.0.1", port, 0, 2, 1.0, &id);
    ADD_FAILURE() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on port " + std::to_string(port)), std::string::npos) << e.what();
  }
  ::close(fd);
}

TEST(Rendezvous, TcpArgumentsAreChecked) {
  const UniqueId id = fake_id(7);
  EXPECT_THROW(exchange_unique_id_tcp("", 1234, 0, 2, 1.0, &id), InvalidArgument);
  EXPECT_THROW(exchange_unique_id_tcp("127.0.0.1", 0, 0, 2, 1.0, &id), InvalidArgument);
  EXPECT_THROW(exchange_unique_id_tcp("127.0.0.1", 70000, 0, 2, 1.0, &id), InvalidArgument);
  EXPECT_THROW(exchange_unique_id_tcp("127.0.0.1", 1234, 2, 2, 1.0, &id), InvalidArgument);
  EXPECT_THROW(exchange_unique_id_tcp("127.0.0.1", 1234, 0, 2, 0.0, &id), InvalidArgument);
}

TEST(Rendezvous, AddressParse) {
  const auto f = RendezvousAddress::parse("/tmp/run/uid");
  EXPECT_FALSE(f.tcp);
  EXPECT_EQ(f.path, "/tmp/run/uid");
  const auto t = RendezvousAddress::parse("tcp://node0.cluster:29500");
  EXPECT_TRUE(t.tcp);
  EXPECT_EQ(t.host, "node0.cluster");
  EXPECT_EQ(t.port, 29500);
  const auto v6 = RendezvousAddress::parse("tcp://[fe80::1]:65535");
  EXPECT_EQ(v6.host, "fe80::1");
  EXPECT_EQ(v6.port, 65535);
  for (const char* bad : {"", "tcp://", "tcp://host", "tcp://host:", "tcp://:80", "tcp://host:0", "tcp://host:65536", "tcp://host:12x",
                          "tcp://a:b:80", "tcp://[::1]80", "http://host:80"}) {
    try {
      RendezvousAddress::parse(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("tcp://host:port"), std::string::npos) << e.what();
    }
  }
}

TEST(NodeLayout, FromKeys) {
  // 4 ranks on 2 nodes, contiguous.
  const std::vector<int64_t> two = {7, 7, 9, 9};
  for (int r = 0; r < 4; ++r) {
    const NodeLayout l = NodeLayout::from_keys(two, r);
    EXPECT_EQ(l.num_nodes, 2);
    EXPECT_EQ(l.node, r / 2);
    EXPECT_EQ(l.local_rank, r % 2);
    EXPECT_EQ(l.local_size, 2);
    EXPECT_EQ(l.ranks_per_node(), 2);
    EXPECT_TRUE(l.contiguous());
    EXPECT_EQ(l.describe(), "2 nodes x 2 ranks");
  }
  EXPECT_EQ(NodeLayout::from_keys(two, 3).ranks_of_node(1), (std::vector<int>{2, 3}));
  // Every rank its own node (the virtual-node case) and one node of all.
  EXPECT_EQ(NodeLayout::from_keys({1, 2}, 1).describe(), "2 nodes x 1 rank");
  EXPECT_EQ(NodeLayout::from_keys({5, 5}, 1).describe(), "1 node x 2 ranks");
  // Interleaved and uneven.
  const NodeLayout odd = NodeLayout::from_keys({4, 8, 4, 6, 8}, 2);
  EXPECT_EQ(odd.num_nodes, 3);
  EXPECT_EQ(odd.node, 0);
  EXPECT_EQ(odd.local_rank, 1);
  EXPECT_EQ(odd.local_size, 2);
  EXPECT_EQ(odd.ranks_per_node(), 0);
  EXPECT_FALSE(odd.contiguous());
  EXPECT_EQ(odd.node_of_rank, (std::vector<int>{0, 1, 0, 2, 1}));
  EXPECT_EQ(odd.describe(), "3 nodes of 2+2+1 ranks");
  EXPECT_THROW(NodeLayout::from_keys({1, 2}, 2), InvalidArgument);
  EXPECT_THROW(odd.ranks_of_node(3), InvalidArgument);
}

TEST(NodeLayout, KeyFollowsNcclRules) {
  const char* vars[] = {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_HOSTID"};
  constexpr const char* kUnset = "\x01unset";
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* v : vars)
    if (const std::string x = env_or(v, kUnset); x != kUnset) saved.push_back({v, x});
  for (const char* v : vars) ::unsetenv(v);

  // One host: every rank the same key.
  EXPECT_EQ(node_key_from_env(0), node_key_from_env(1));
  // Only one of the two transports off: still one node (NCCL keeps an intra-node transport).
  ::setenv("NCCL_P2P_DISABLE", "1", 1);
  EXPECT_EQ(node_key_from_env(0), node_key_from_env(1));
  ::setenv("NCCL_SHM_DISABLE", "0", 1);
  EXPECT_EQ(node_key_from_env(0), node_key_from_env(1));
  // Both off: every rank its own node.
  ::setenv("NCCL_SHM_DISABLE", "1", 1);
  EXPECT_NE(node_key_from_env(0), node_key_from_env(1));
  const NodeLayout virt = NodeLayout::from_keys({node_key_from_env(0), node_key_from_env(1)}, 0);
  EXPECT_EQ(virt.describe(), "2 nodes x 1 rank");
  ::unsetenv("NCCL_P2P_DISABLE");
  ::unsetenv("NCCL_SHM_DISABLE");
  // NCCL_HOSTID replaces the host: two ids are two nodes.
  const int64_t here = node_key_from_env(0);
  ::setenv("NCCL_HOSTID", "a", 1);
  const int64_t a = node_key_from_env(0);
  ::setenv("NCCL_HOSTID", "b", 1);
  EXPECT_NE(a, node_key_from_env(0));
  EXPECT_NE(a, here);
  ::unsetenv("NCCL_HOSTID");

  for (const auto& [k, v] : saved) ::setenv(k.c_str(), v.c_str(), 1);
}

TEST(NodeLayout, CpuGroupIsOneNode) {
  auto g = make_cpu_groups(3);
  for (int r = 0; r < 3; ++r) {
    const NodeLayout l = g[r]->node_layout();
    EXPECT_EQ(l.num_nodes, 1);
    EXPECT_EQ(g[r]->num_nodes(), 1);
    EXPECT_EQ(g[r]->node_id(), 0);
    EXPECT_EQ(g[r]->local_rank(), r);
    EXPECT_EQ(g[r]->ranks_per_node(), 3);
    EXPECT_EQ(l.lsa_size, 3);
    EXPECT_EQ(l.describe(), "1 node x 3 ranks");
  }
}
