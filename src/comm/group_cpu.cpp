// comm/group_cpu.cpp: epx::Group for CPU ranks (threads of one process sharing host memory), on the
// two-phase protocol of comm/world.h: each rank moves its own share of the data with memcpy and
// host loops between the phases.
#include "comm/group_cpu.h"

#include "comm/world.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "core/timeout.h"
#include "epx/error.h"
#include "epx/group.h"

namespace epx {
namespace {

using comm::Posted;
using comm::World;

float load_elem(const void* base, int64_t i, DType dt) {
  if (dt == DType::fp32) return static_cast<const float*>(base)[i];
  return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
}
void store_elem(void* base, int64_t i, DType dt, float v) {
  if (dt == DType::fp32) static_cast<float*>(base)[i] = v;
  else static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(v);
}

class CpuGroup final : public comm::ThreadWorldGroup {
 public:
  CpuGroup(std::shared_ptr<World> world, int rank, int ranks_per_node = 0)
      : world_(std::move(world)), rank_(rank), ranks_per_node_(ranks_per_node) {}

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  Device device() const override { return Device::cpu(); }
  std::string name() const override { return world_->name(); }
  World& world() override { return *world_; }
  double timeout_s() const override { return world_->timeout_s(); }
  const std::shared_ptr<World>& world_ptr() const { return world_; }
  NodeLayout node_layout() const override { return comm::thread_node_layout(size(), ranks_per_node_, rank_); }

  void barrier() override {
    world_->collective(rank_, "group.barrier", {}, [] {}, [] {});
  }

  void all_gather(const void* send, void* recv, int64_t bytes_per_rank, Stream) override {
    Posted p;
    p.send = send;
    p.n = bytes_per_rank;
    world_->collective(
        rank_, "group.all_gather", p, [&] { world_->check_same_n("group.all_gather", "bytes_per_rank"); },
        [&] {
          const int64_t n = world_->posted[0].n;
          for (int r = 0; r < size(); ++r)
            if (n > 0) std::memcpy(static_cast<char*>(recv) + r * n, world_->posted[static_cast<size_t>(r)].send, static_cast<size_t>(n));
        });
  }

  void all_gatherv(const void* send, void* recv, const std::vector<int64_t>& recv_bytes, Stream) override {
    Posted p;
    p.send = send;
    p.recv_sizes = &recv_bytes;
    world_->collective(
        rank_, "group.all_gatherv", p, [&] { world_->check_same_sizes("group.all_gatherv", "recv_bytes"); },
        [&] {
          int64_t off = 0;
          for (int r = 0; r < size(); ++r) {
            const int64_t n = recv_bytes[static_cast<size_t>(r)];
            if (n > 0) std::memcpy(static_cast<char*>(recv) + off, world_->posted[static_cast<size_t>(r)].send, static_cast<size_t>(n));
            off += n;
          }
        });
  }

  void all_reduce_sum(const void* send, void* recv, int64_t n, DType dtype, Stream) override {
    Posted p;
    p.send = send;
    p.recv = recv;
    p.n = n;
    p.dtype = dtype;
    world_->collective(
        rank_, "group.all_reduce_sum", p,
        [&] {
          world_->check_same_n("group.all_reduce_sum", "n");
          world_->check_reduce_dtype("group.all_reduce_sum");
        },
        [&] {
          // Rank q reduces elements [q*n/R, (q+1)*n/R) of every send and writes them into every recv:
          // only rank q touches that range, so recv may alias send (in place).
          const int R = size();
          const int64_t lo = n * rank_ / R, hi = n * (rank_ + 1) / R;
          for (int64_t i = lo; i < hi; ++i) {
            float acc = 0.0f;
            for (int r = 0; r < R; ++r) acc += load_elem(world_->posted[static_cast<size_t>(r)].send, i, dtype);
            for (int r = 0; r < R; ++r) store_elem(world_->posted[static_cast<size_t>(r)].recv, i, dtype, acc);
          }
        });
  }

  void reduce_scatterv(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype, Stream) override {
    Posted p;
    p.send = send;
    p.recv_sizes = &counts;
    p.dtype = dtype;
    world_->collective(
        rank_, "group.reduce_scatterv", p,
        [&] {
          world_->check_same_sizes("group.reduce_scatterv", "counts");
          world_->check_reduce_dtype("group.reduce_scatterv");
        },
        [&] {
          int64_t off = 0;
          for (int r = 0; r < rank_; ++r) off += counts[static_cast<size_t>(r)];
          const int64_t n = counts[static_cast<size_t>(rank_)];
          for (int64_t i = 0; i < n; ++i) {
            float acc = 0.0f;
            for (int r = 0; r < size(); ++r) acc += load_elem(world_->posted[static_cast<size_t>(r)].send, off + i, dtype);
            store_elem(recv, i, dtype, acc);
          }
        });
  }

  void all_to_allv(const void* send, const std::vector<int64_t>& send_bytes, void* recv, const std::vector<int64_t>& recv_bytes,
                   Stream) override {
    Posted p;
    p.send = send;
    p.send_sizes = &send_bytes;
    p.recv_sizes = &recv_bytes;
    world_->collective(
        rank_, "group.all_to_allv", p,
        [&] { world_->check_all_to_allv("group.all_to_allv"); },
        [&] {
          int64_t off = 0;
          for (int s = 0; s < size(); ++s) {
            const Posted& q = world_->posted[static_cast<size_t>(s)];
            int64_t src_off = 0;
            for (int d = 0; d < rank_; ++d) src_off += (*q.send_sizes)[static_cast<size_t>(d)];
            const int64_t n = recv_bytes[static_cast<size_t>(s)];
            if (n > 0) std::memcpy(static_cast<char*>(recv) + off, static_cast<const char*>(q.send) + src_off, static_cast<size_t>(n));
            off += n;
          }
        });
  }

  SymmetricBuffer alloc_symmetric(int64_t bytes) override {
    require_arg("group.alloc_symmetric", "bytes", bytes, bytes >= 0, "must be >= 0");
    const size_t sz = static_cast<size_t>((std::max<int64_t>(bytes, 1) + 63) / 64 * 64);
    void* mem = std::aligned_alloc(64, sz);
    if (!mem) throw Error("group.alloc_symmetric: cannot allocate " + std::to_string(bytes) + " bytes on cpu");
    std::memset(mem, 0, sz);
    std::shared_ptr<void> mine(mem, [](void* q) { std::free(q); });
    return world_->share_symmetric(rank_, "group.alloc_symmetric", bytes, std::move(mine));
  }

  std::shared_ptr<World> world_;
  int rank_;
  int ranks_per_node_ = 0;  ///< 0: one node (the default layout)
};

}  // namespace

std::vector<std::shared_ptr<Group>> make_cpu_groups(int num_ranks, double timeout_s) {
  require_arg("make_cpu_groups", "num_ranks", num_ranks, num_ranks >= 1, "must be >= 1");
  require_timeout("make_cpu_groups", "timeout_s", timeout_s);
  auto world = std::make_shared<World>(num_ranks, timeout_s);
  std::vector<std::shared_ptr<Group>> groups;
  groups.reserve(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) groups.push_back(std::make_shared<CpuGroup>(world, r));
  return groups;
}

std::vector<std::shared_ptr<Group>> make_cpu_groups(int num_ranks, double timeout_s, int ranks_per_node) {
  require_arg("make_cpu_groups", "ranks_per_node", ranks_per_node, ranks_per_node >= 1 && num_ranks % ranks_per_node == 0,
              "must be >= 1 and divide num_ranks = " + std::to_string(num_ranks));
  std::vector<std::shared_ptr<Group>> groups = make_cpu_groups(num_ranks, timeout_s);
  for (int r = 0; r < num_ranks; ++r) {
    auto* g = static_cast<CpuGroup*>(groups[static_cast<size_t>(r)].get());
    groups[static_cast<size_t>(r)] = std::make_shared<CpuGroup>(g->world_ptr(), r, ranks_per_node);
  }
  return groups;
}

void run_ranks(const std::vector<std::shared_ptr<Group>>& groups, const std::function<void(int rank)>& fn) {
  std::mutex mu;
  std::exception_ptr first;
  auto fail = [&](int rank, std::exception_ptr e, const std::string& what) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!first) first = e;
    }
    if (auto* g = dynamic_cast<comm::ThreadWorldGroup*>(groups[static_cast<size_t>(rank)].get()))
      g->world().abort("rank " + std::to_string(rank) + " threw: " + what);
  };
  std::vector<std::thread> threads;
  threads.reserve(groups.size());
  for (size_t r = 0; r < groups.size(); ++r) {
    threads.emplace_back([&, r] {
      const int rank = static_cast<int>(r);
      try {
        fn(rank);
      } catch (const std::exception& e) {
        fail(rank, std::current_exception(), e.what());
      } catch (...) {
        fail(rank, std::current_exception(), "unknown exception");
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

namespace comm {
int64_t cpu_world_live_count() { return World::live().load(); }
}  // namespace comm

}  // namespace epx
