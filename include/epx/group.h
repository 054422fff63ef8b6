// epx/group.h: a group of R ranks (the EP group) and its collectives.
//
// CPU: ranks are threads of one process sharing host memory (make_cpu_groups); this is the
// reference and the embedded default with no GPU. CUDA (later): one process per GPU over NCCL.
// All collectives are blocking on the CPU, stream-ordered on CUDA, and every wait on a peer is
// bounded by Config::timeout_s (Timeout naming the peer and the operation).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
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

// ---- groups over NCCL: one process per GPU (CUDA builds; CPU-only builds throw Unsupported) -------

/// The 128-byte NCCL unique id (ncclUniqueId) that names one group; rank 0 creates it and the
/// caller hands it to every rank (a file, a store, MPI, a launcher's argv), as with NCCL itself.
struct UniqueId {
  static constexpr int kBytes = 128;
  std::array<uint8_t, kBytes> bytes{};

  /// A fresh id (ncclGetUniqueId; opens rank 0's bootstrap socket). Throws CudaError; Unsupported
  /// in a CPU-only build.
  static UniqueId create();
  /// 256 lowercase hex digits.
  std::string hex() const;
  /// Inverse of hex(). Throws InvalidArgument naming the bad length or character.
  static UniqueId parse(std::string_view hex);
  bool operator==(const UniqueId&) const = default;
};

/// Rendezvous through a shared file: rank 0 creates an id and writes it to `path` atomically
/// (temp file + rename); the other ranks poll for the file. The path must be fresh for each group
/// (a stale file from an earlier run would send ranks to a dead bootstrap). Throws Timeout when the
/// file does not appear within timeout_s, InvalidArgument for a malformed file.
UniqueId exchange_unique_id(const std::string& path, int rank, double timeout_s = 60.0);

/// The NCCL group of rank `rank` of `world` on CUDA device `device`: one ncclComm (non-blocking
/// init, every wait bounded by timeout_s), a device communicator with LSA barriers where all ranks
/// share one NVLink domain, and symmetric memory through ncclMemAlloc + ncclCommWindowRegister.
/// Collectives run on device memory and are stream-ordered on the Stream given; host pointers are
/// staged through device memory and make that call synchronous. Collective: all ranks must call it.
/// Throws Timeout (a rank did not join within timeout_s), CommError, CudaError; Unsupported in a
/// CPU-only build.
std::shared_ptr<Group> make_nccl_group(const UniqueId& uid, int rank, int world, int device, double timeout_s = 60.0);
/// exchange_unique_id(rendezvous_path, ...) then make_nccl_group; rank 0 removes the file once
/// every rank has joined.
std::shared_ptr<Group> make_nccl_group(const std::string& rendezvous_path, int rank, int world, int device,
                                       double timeout_s = 60.0);
/// From the environment a launcher sets: EPX_RANK, EPX_WORLD_SIZE, EPX_RENDEZVOUS (a file path),
/// and EPX_LOCAL_RANK (the device; default EPX_RANK modulo the visible devices).
/// Throws InvalidArgument naming a missing or malformed variable.
std::shared_ptr<Group> make_nccl_group_from_env(double timeout_s = 60.0);

}  // namespace epx
