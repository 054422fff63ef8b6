// comm/group_cpu.cpp: epx::Group for CPU ranks (threads of one process sharing host memory).
//
// Protocol of every collective (two phases, one shared "world" per make_cpu_groups call):
//   1. each rank publishes a descriptor of its call (op name, pointers, sizes) in posted[rank] and
//      arrives at the world's phase barrier;
//   2. once all R ranks arrived, every rank checks the descriptors of all ranks (same op, consistent
//      sizes): the check is deterministic, so either every rank throws the same error or none does;
//   3. each rank moves its own share of the data, reading peers' buffers directly;
//   4. a second phase barrier, so no rank returns (and frees or reuses its buffers) while a peer
//      still reads them; a failed check is thrown after this barrier.
// Every wait is bounded by timeout_s: the waiting rank throws Timeout naming the operation and the
// ranks that did not arrive, and aborts the world; an aborted world makes every later or blocked
// wait throw CommError at once, so a dead or throwing rank never hangs the others.
#include "comm/group_cpu.h"

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

std::atomic<int64_t> g_live_worlds{0};
std::atomic<uint64_t> g_world_serial{0};

/// One rank's description of the collective it is in (valid from its phase-1 arrival until phase 2).
struct Posted {
  const char* op = "";
  const void* send = nullptr;
  void* recv = nullptr;
  const std::vector<int64_t>* send_sizes = nullptr;  // all_to_allv send_bytes
  const std::vector<int64_t>* recv_sizes = nullptr;  // all_gatherv recv_bytes, reduce_scatterv counts, all_to_allv recv_bytes
  int64_t n = 0;                                     // bytes or elements, per op
  DType dtype = DType::uint8;
  const std::shared_ptr<void>* owner = nullptr;      // alloc_symmetric
};

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

std::string seconds_text(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

class World {
 public:
  World(int num_ranks, double timeout_s)
      : posted(static_cast<size_t>(num_ranks)), num_ranks_(num_ranks), timeout_s_(timeout_s), here_(static_cast<size_t>(num_ranks), 0) {
    name_ = "epx-cpu-" + std::to_string(::getpid()) + "-" + std::to_string(g_world_serial.fetch_add(1));
    g_live_worlds.fetch_add(1);
  }
  ~World() { g_live_worlds.fetch_sub(1); }
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int size() const { return num_ranks_; }
  const std::string& name() const { return name_; }
  double timeout_s() const { return timeout_s_; }

  /// Returns once all ranks arrived at this phase. Throws Timeout (and aborts the world) after
  /// timeout_s, or CommError if the world is or becomes aborted before everyone arrived.
  void arrive_and_wait(int rank, const std::string& op) {
    std::unique_lock<std::mutex> lk(mu_);
    if (aborted_) throw CommError(op + ": group " + name_ + " was aborted: " + abort_reason_);
    const uint64_t gen = generation_;
    here_[static_cast<size_t>(rank)] = 1;
    if (++arrived_ == num_ranks_) {
      arrived_ = 0;
      std::fill(here_.begin(), here_.end(), 0);
      ++generation_;
      cv_.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s_));
    while (generation_ == gen && !aborted_) {
      if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && generation_ == gen && !aborted_) {
        std::vector<int> missing;
        for (int r = 0; r < num_ranks_; ++r)
          if (!here_[static_cast<size_t>(r)]) missing.push_back(r);
        const std::string msg = op + ": rank" + (missing.size() > 1 ? "s " : " ") + rank_list(missing) +
                                " did not arrive within timeout_s = " + seconds_text(timeout_s_) +
                                " (peer dead or not calling " + op + ")";
        abort_locked("rank " + std::to_string(rank) + " timed out: " + msg);
        throw Timeout(msg);
      }
    }
    if (generation_ == gen) throw CommError(op + ": group " + name_ + " was aborted: " + abort_reason_);
  }

  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lk(mu_);
    abort_locked(why);
  }

  /// Runs one collective: publish `p`, phase barrier, `check` (deterministic on every rank; may
  /// throw, then every rank throws alike), `move` (own share of the data), phase barrier.
  template <class Check, class Move>
  void collective(int rank, const char* op, Posted p, Check&& check, Move&& move) {
    p.op = op;
    posted[static_cast<size_t>(rank)] = p;
    arrive_and_wait(rank, op);
    for (int r = 0; r < num_ranks_; ++r) {
      if (std::strcmp(posted[static_cast<size_t>(r)].op, op) != 0) {
        // Ranks issued different collectives: the sequence is broken for good.
        std::string msg = std::string(op) + ": rank " + std::to_string(rank) + " called " + op + " but rank " + std::to_string(r) +
                          " called " + posted[static_cast<size_t>(r)].op + ": all ranks must issue the same collectives in the same order";
        abort(msg);
        throw CommError(msg);
      }
    }
    // A failed check is rethrown only after the second phase: peers may still be reading this
    // rank's descriptor (which points into its caller's frame) until then.
    std::exception_ptr failed;
    try {
      check();
    } catch (...) {
      failed = std::current_exception();
    }
    if (!failed) {
      try {
        move();
      } catch (...) {
        abort(std::string(op) + ": rank " + std::to_string(rank) + " failed while moving data");
        throw;
      }
    }
    arrive_and_wait(rank, std::string(op) + " (completion)");
    if (failed) std::rethrow_exception(failed);
  }

  std::vector<Posted> posted;  // slot r written only by rank r, read by all between the phases

 private:
  void abort_locked(const std::string& why) {
    if (!aborted_) {
      aborted_ = true;
      abort_reason_ = why;
    }
    cv_.notify_all();
  }

  int num_ranks_;
  double timeout_s_;
  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<char> here_;
  bool aborted_ = false;
  std::string abort_reason_;
};

float load_elem(const void* base, int64_t i, DType dt) {
  if (dt == DType::fp32) return static_cast<const float*>(base)[i];
  return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
}
void store_elem(void* base, int64_t i, DType dt, float v) {
  if (dt == DType::fp32) static_cast<float*>(base)[i] = v;
  else static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(v);
}

class CpuGroup final : public Group {
 public:
  CpuGroup(std::shared_ptr<World> world, int rank, int ranks_per_node = 0)
      : world_(std::move(world)), rank_(rank), ranks_per_node_(ranks_per_node) {}

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  Device device() const override { return Device::cpu(); }
  std::string name() const override { return world_->name(); }
  World& world() { return *world_; }
  const std::shared_ptr<World>& world_ptr() const { return world_; }
  NodeLayout node_layout() const override {
    if (ranks_per_node_ <= 0) return Group::node_layout();
    std::vector<int64_t> keys(static_cast<size_t>(size()));
    for (int r = 0; r < size(); ++r) keys[static_cast<size_t>(r)] = r / ranks_per_node_;
    NodeLayout l = NodeLayout::from_keys(keys, rank_);
    l.lsa_size = l.local_size;  // shared memory: every rank of a (virtual) node is load/store accessible
    return l;
  }

  void barrier() override {
    world_->collective(rank_, "group.barrier", {}, [] {}, [] {});
  }

  void all_gather(const void* send, void* recv, int64_t bytes_per_rank, Stream) override {
    Posted p;
    p.send = send;
    p.n = bytes_per_rank;
    world_->collective(
        rank_, "group.all_gather", p, [&] { check_same_n("group.all_gather", "bytes_per_rank"); },
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
        rank_, "group.all_gatherv", p, [&] { check_same_sizes("group.all_gatherv", "recv_bytes"); },
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
          check_same_n("group.all_reduce_sum", "n");
          check_reduce_dtype("group.all_reduce_sum");
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
          check_same_sizes("group.reduce_scatterv", "counts");
          check_reduce_dtype("group.reduce_scatterv");
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
        [&] {
          const int R = size();
          for (int r = 0; r < R; ++r) {
            const Posted& q = world_->posted[static_cast<size_t>(r)];
            check_vector_size("group.all_to_allv", "send_bytes", r, *q.send_sizes);
            check_vector_size("group.all_to_allv", "recv_bytes", r, *q.recv_sizes);
          }
          for (int s = 0; s < R; ++s)
            for (int d = 0; d < R; ++d) {
              const int64_t sent = (*world_->posted[static_cast<size_t>(s)].send_sizes)[static_cast<size_t>(d)];
              const int64_t got = (*world_->posted[static_cast<size_t>(d)].recv_sizes)[static_cast<size_t>(s)];
              if (sent != got || sent < 0)
                throw CommError("group.all_to_allv: send_bytes[" + std::to_string(d) + "] = " + std::to_string(sent) + " on rank " +
                                std::to_string(s) + " but recv_bytes[" + std::to_string(s) + "] = " + std::to_string(got) +
                                " on rank " + std::to_string(d) + ": must match and be >= 0");
            }
        },
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
    auto owners = std::make_shared<std::vector<std::shared_ptr<void>>>(static_cast<size_t>(size()));
    SymmetricBuffer buf;
    buf.local = mem;
    buf.bytes = bytes;
    buf.peers.resize(static_cast<size_t>(size()));
    Posted p;
    p.n = bytes;
    p.owner = &mine;
    world_->collective(
        rank_, "group.alloc_symmetric", p, [&] { check_same_n("group.alloc_symmetric", "bytes"); },
        [&] {
          // Every rank co-owns every piece, so the buffer outlives any destruction order of the groups.
          for (int r = 0; r < size(); ++r) {
            (*owners)[static_cast<size_t>(r)] = *world_->posted[static_cast<size_t>(r)].owner;
            buf.peers[static_cast<size_t>(r)] = (*owners)[static_cast<size_t>(r)].get();
          }
        });
    buf.owner = owners;
    return buf;
  }

 private:
  void check_same_n(const char* op, const char* arg) const {
    const int64_t n0 = world_->posted[0].n;
    for (int r = 0; r < size(); ++r) {
      const int64_t n = world_->posted[static_cast<size_t>(r)].n;
      if (n < 0) throw InvalidArgument(arg_message(op, arg, n, "must be >= 0 (rank " + std::to_string(r) + ")"));
      if (n != n0)
        throw CommError(std::string(op) + ": " + arg + " = " + std::to_string(n0) + " on rank 0 but " + std::to_string(n) + " on rank " +
                        std::to_string(r) + ": all ranks must agree");
    }
  }
  void check_vector_size(const char* op, const char* arg, int r, const std::vector<int64_t>& v) const {
    if (static_cast<int>(v.size()) != size())
      throw InvalidArgument(arg_message(op, std::string(arg) + ".size()", v.size(),
                                        "must be the group size " + std::to_string(size()) + " (rank " + std::to_string(r) + ")"));
  }
  void check_same_sizes(const char* op, const char* arg) const {
    const std::vector<int64_t>& v0 = *world_->posted[0].recv_sizes;
    for (int r = 0; r < size(); ++r) {
      const std::vector<int64_t>& v = *world_->posted[static_cast<size_t>(r)].recv_sizes;
      check_vector_size(op, arg, r, v);
      for (int i = 0; i < size(); ++i) {
        if (v[static_cast<size_t>(i)] < 0)
          throw InvalidArgument(arg_message(op, std::string(arg) + "[" + std::to_string(i) + "]", v[static_cast<size_t>(i)],
                                            "must be >= 0 (rank " + std::to_string(r) + ")"));
        if (v[static_cast<size_t>(i)] != v0[static_cast<size_t>(i)])
          throw CommError(std::string(op) + ": " + arg + "[" + std::to_string(i) + "] = " + std::to_string(v0[static_cast<size_t>(i)]) +
                          " on rank 0 but " + std::to_string(v[static_cast<size_t>(i)]) + " on rank " + std::to_string(r) +
                          ": all ranks must agree");
      }
    }
  }
  void check_reduce_dtype(const char* op) const {
    for (int r = 0; r < size(); ++r) {
      const DType dt = world_->posted[static_cast<size_t>(r)].dtype;
      if (dt != DType::fp32 && dt != DType::bf16)
        throw InvalidArgument(arg_message(op, "dtype", dtype_name(dt), "must be fp32 or bf16 (rank " + std::to_string(r) + ")"));
      if (dt != world_->posted[0].dtype)
        throw CommError(std::string(op) + ": dtype = " + std::string(dtype_name(world_->posted[0].dtype)) + " on rank 0 but " +
                        std::string(dtype_name(dt)) + " on rank " + std::to_string(r) + ": all ranks must agree");
    }
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
    if (auto* g = dynamic_cast<CpuGroup*>(groups[static_cast<size_t>(rank)].get()))
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
int64_t cpu_world_live_count() { return g_live_worlds.load(); }
}  // namespace comm

}  // namespace epx
