// epx/group.h: a group of R ranks (the EP group) and its collectives.
//
// CPU: ranks are threads of one process sharing host memory (make_cpu_groups); this is the
// reference and the embedded default with no GPU. CUDA (later): one process per GPU over NCCL.
// All collectives are blocking on the CPU, stream-ordered on CUDA, and every wait on a peer is
// bounded by Config::timeout_s (Timeout naming the peer and the operation).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "epx/tensor.h"

namespace epx {

/// Memory of the same size on every rank of a group; `peers[r]` is rank r's copy, addressable
/// from this rank (host memory for CPU groups; LSA pointers for NCCL windows).
struct SymmetricBuffer {
  void* local = nullptr;
  std::vector<void*> peers;
  int64_t bytes = 0;
  std::shared_ptr<void> owner;  ///< keeps the allocation alive
};

class Group {
 public:
  virtual ~Group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;
  /// Name unique to this group (two groups on one node never share names or buffers).
  virtual std::string name() const = 0;

  virtual void barrier() = 0;
  /// recv [R * bytes_per_rank] = concat over ranks of send [bytes_per_rank].
  virtual void all_gather(const void* send, void* recv, int64_t bytes_per_rank, Stream s = {}) = 0;
  /// recv = concat over ranks r of send_r [recv_bytes[r]]; send_bytes == recv_bytes[rank()].
  virtual void all_gatherv(const void* send, void* recv, const std::vector<int64_t>& recv_bytes, Stream s = {}) = 0;
  /// Element-wise sum over ranks of send [n] into recv [n]; fp32 or bf16 (bf16 summed in fp32 in
  /// rank order, rounded once).
  virtual void all_reduce_sum(const void* send, void* recv, int64_t n, DType dtype, Stream s = {}) = 0;
  /// send [sum(counts)] elements on every rank; recv [counts[rank()]] = sum over ranks of the
  /// rank()-th block of their send (rank order, fp32 accumulation, one rounding).
  virtual void reduce_scatterv(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype, Stream s = {}) = 0;
  /// send holds blocks for ranks 0..R-1 back to back (send_bytes[r] each); recv gets the blocks
  /// from ranks 0..R-1 back to back (recv_bytes[r] each).
  virtual void all_to_allv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                           const std::vector<int64_t>& recv_bytes, Stream s = {}) = 0;
  /// Collective: `bytes` on every rank, zero-filled; all ranks must pass the same size.
  virtual SymmetricBuffer alloc_symmetric(int64_t bytes) = 0;

  /// Collective configuration check (BEHAVIOUR.md): every rank passes the same field names; throws
  /// CommError "<op>: <field> = <v0> on rank 0 but <v> on rank r: all ranks must agree" on every rank.
  void check_agreement(const std::string& op, const std::vector<std::pair<std::string, int64_t>>& fields);
  /// all_gather of one int64 per rank.
  std::vector<int64_t> all_gather_i64(int64_t value);
};

/// R CPU groups sharing one in-process world; element r is rank r. timeout_s bounds every wait.
std::vector<std::shared_ptr<Group>> make_cpu_groups(int num_ranks, double timeout_s = 60.0);

/// Runs fn(rank) on R threads, one per rank of `groups`. If any rank throws, the world is aborted
/// (peers blocked in a collective throw CommError instead of hanging) and the first exception is
/// rethrown here after all threads joined.
void run_ranks(const std::vector<std::shared_ptr<Group>>& groups, const std::function<void(int rank)>& fn);

}  // namespace epx
