// comm/world.h: the shared host state of R ranks that are threads of one process (CPU groups and
// the virtual CUDA ranks of group_virtual_cuda.cpp): a phase barrier bounded by timeout_s that
// names the ranks that did not arrive, the two-phase collective protocol, and abort.
//
// Protocol of every collective (two phases, one shared "world" per make_*_groups call):
//   1. each rank publishes a descriptor of its call (op name, pointers, sizes) in posted[rank] and
//      arrives at the world's phase barrier;
//   2. once all R ranks arrived, every rank checks the descriptors of all ranks (same op, consistent
//      sizes): the check is deterministic, so either every rank throws the same error or none does;
//   3. each rank moves its own share of the data, reading peers' buffers directly (CPU) or enqueues
//      the device work that does (CUDA);
//   4. a second phase barrier, so no rank returns (and frees or reuses its buffers) while a peer
//      still reads them (CPU) or has not yet enqueued its reads (CUDA); a failed check is thrown
//      after this barrier.
// Every wait is bounded by timeout_s: the waiting rank throws Timeout naming the operation and the
// ranks that did not arrive, and aborts the world; an aborted world makes every later or blocked
// wait throw CommError at once, so a dead or throwing rank never hangs the others.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/group.h"

namespace epx::comm {



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

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

inline std::string seconds_text(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

class World {
 public:
  /// `kind` prefixes the name: "epx-<kind>-<pid>-<serial>".
  World(int num_ranks, double timeout_s, const std::string& kind = "cpu")
      : posted(static_cast<size_t>(num_ranks)), num_ranks_(num_ranks), timeout_s_(timeout_s), here_(static_cast<size_t>(num_ranks), 0) {
    name_ = "epx-" + kind + "-" + std::to_string(::getpid()) + "-" + std::to_string(serial().fetch_add(1));
    live().fetch_add(1);
  }
  ~World() { live().fetch_sub(1); }
  /// Worlds alive in this process (leak tests).
  static std::atomic<int64_t>& live() {
    static std::atomic<int64_t> n{0};
    return n;
  }
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
        const std::string msg = op + (missing.size() > 1 ? ": ranks " + rank_list(missing) : ": rank " + std::to_string(missing.at(0))) +
                                " did not arrive within timeout_s = " + seconds_text(timeout_s_) +
                                " (peer dead or not calling " + op + ")";
        abort_locked("rank " + std::to_string(rank) + " timed out: " + msg);
        throw Timeout(msg);
      }
    }
    if (generation_ == gen) throw CommError(op + ": group " + name_ + " was aborted: " + abort_reason_);
  }

  bool aborted() {
    std::lock_guard<std::mutex> lk(mu_);
    return aborted_;
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

  // ---- deterministic checks of the posted descriptors (step 2; every rank throws alike) ----
  void check_same_n(const char* op, const char* arg) const {
    const int64_t n0 = posted[0].n;
    for (int r = 0; r < num_ranks_; ++r) {
      const int64_t n = posted[static_cast<size_t>(r)].n;
      if (n < 0) throw InvalidArgument(arg_message(op, arg, n, "must be >= 0 (rank " + std::to_string(r) + ")"));
      if (n != n0)
        throw CommError(std::string(op) + ": " + arg + " = " + std::to_string(n0) + " on rank 0 but " + std::to_string(n) + " on rank " +
                        std::to_string(r) + ": all ranks must agree");
    }
  }
  void check_vector_size(const char* op, const char* arg, int r, const std::vector<int64_t>& v) const {
    if (static_cast<int>(v.size()) != num_ranks_)
      throw InvalidArgument(arg_message(op, std::string(arg) + ".size()", v.size(),
                                        "must be the group size " + std::to_string(num_ranks_) + " (rank " + std::to_string(r) + ")"));
  }
  void check_same_sizes(const char* op, const char* arg) const {
    const std::vector<int64_t>& v0 = *posted[0].recv_sizes;
    for (int r = 0; r < num_ranks_; ++r) {
      const std::vector<int64_t>& v = *posted[static_cast<size_t>(r)].recv_sizes;
      check_vector_size(op, arg, r, v);
      for (int i = 0; i < num_ranks_; ++i) {
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
    for (int r = 0; r < num_ranks_; ++r) {
      const DType dt = posted[static_cast<size_t>(r)].dtype;
      if (dt != DType::fp32 && dt != DType::bf16)
        throw InvalidArgument(arg_message(op, "dtype", dtype_name(dt), "must be fp32 or bf16 (rank " + std::to_string(r) + ")"));
      if (dt != posted[0].dtype)
        throw CommError(std::string(op) + ": dtype = " + std::string(dtype_name(posted[0].dtype)) + " on rank 0 but " +
                        std::string(dtype_name(dt)) + " on rank " + std::to_string(r) + ": all ranks must agree");
    }
  }

  /// all_to_allv: every rank's send_bytes / recv_bytes have R entries, and what s sends d is what d
  /// receives from s (>= 0).
  void check_all_to_allv(const char* op) const {
    const int R = num_ranks_;
    for (int r = 0; r < R; ++r) {
      const Posted& q = posted[static_cast<size_t>(r)];
      check_vector_size(op, "send_bytes", r, *q.send_sizes);
      check_vector_size(op, "recv_bytes", r, *q.recv_sizes);
    }
    for (int s = 0; s < R; ++s)
      for (int d = 0; d < R; ++d) {
        const int64_t sent = (*posted[static_cast<size_t>(s)].send_sizes)[static_cast<size_t>(d)];
        const int64_t got = (*posted[static_cast<size_t>(d)].recv_sizes)[static_cast<size_t>(s)];
        if (sent != got || sent < 0)
          throw CommError(std::string(op) + ": send_bytes[" + std::to_string(d) + "] = " + std::to_string(sent) + " on rank " +
                          std::to_string(s) + " but recv_bytes[" + std::to_string(s) + "] = " + std::to_string(got) + " on rank " +
                          std::to_string(d) + ": must match and be >= 0");
      }
  }

  /// alloc_symmetric's exchange: rank `rank` posts its allocation `mine` of `bytes` (all ranks must
  /// agree on bytes) and gets the buffer whose peers[r] is rank r's. Every rank co-owns every piece,
  /// so the buffer outlives any destruction order of the groups.
  SymmetricBuffer share_symmetric(int rank, const char* op, int64_t bytes, std::shared_ptr<void> mine) {
    auto owners = std::make_shared<std::vector<std::shared_ptr<void>>>(static_cast<size_t>(num_ranks_));
    SymmetricBuffer buf;
    buf.local = mine.get();
    buf.bytes = bytes;
    buf.peers.resize(static_cast<size_t>(num_ranks_));
    Posted p;
    p.n = bytes;
    p.owner = &mine;
    collective(rank, op, p, [&] { check_same_n(op, "bytes"); },
               [&] {
                 for (int r = 0; r < num_ranks_; ++r) {
                   (*owners)[static_cast<size_t>(r)] = *posted[static_cast<size_t>(r)].owner;
                   buf.peers[static_cast<size_t>(r)] = (*owners)[static_cast<size_t>(r)].get();
                 }
               });
    buf.owner = owners;
    return buf;
  }

  std::vector<Posted> posted;  // slot r written only by rank r, read by all between the phases

 private:
  static std::atomic<uint64_t>& serial() {
    static std::atomic<uint64_t> n{0};
    return n;
  }
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

/// The node layout of rank `rank` of R thread ranks: one node (ranks_per_node <= 0), or R /
/// ranks_per_node nodes of consecutive ranks; every rank of a node is load/store accessible (one
/// process: shared host memory, or one device).
inline NodeLayout thread_node_layout(int num_ranks, int ranks_per_node, int rank) {
  std::vector<int64_t> keys(static_cast<size_t>(num_ranks), 0);
  if (ranks_per_node > 0)
    for (int r = 0; r < num_ranks; ++r) keys[static_cast<size_t>(r)] = r / ranks_per_node;
  NodeLayout l = NodeLayout::from_keys(keys, rank);
  l.lsa_size = l.local_size;
  return l;
}

/// A Group whose ranks are threads sharing one World (run_ranks aborts it when a rank throws).
class ThreadWorldGroup : public Group {
 public:
  virtual World& world() = 0;
};

}  // namespace epx::comm
