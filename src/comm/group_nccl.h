// comm/group_nccl.h: the NCCL group (one process per GPU), for the CUDA kernels that need more than
// the Group interface: the communicator, the device communicator and the windows behind
// SymmetricBuffers (LL/HT dispatch kernels pass them to ncclGetLsaPointer / ncclLsaBarrierSession).
//
// Creation: make_nccl_group (epx/group.h). Host-only; includes no device code, so .cpp files may
// include it. The kernels it launches live in group_nccl_cuda.cu.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <nccl_device/core.h>
#include <nccl_device/impl/comm__types.h>

#include <map>
#include <memory>
#include <mutex>
#include <source_location>
#include <string>

#include "epx/group.h"

namespace epx::comm {

/// LSA barriers in the device communicator: indices [0, kNumLsaBarriers). Index kGroupBarrierIndex
/// belongs to NcclGroup::lsa_barrier; kernels take theirs from [kFirstKernelBarrierIndex, ...), one
/// per CTA that can run concurrently (NCCL-DEVICE-API.md §2.4: an index is never shared by two
/// CTAs or two overlapping kernels). Each costs (3 + lsaSize) * 4 bytes.
constexpr int kNumLsaBarriers = 512;
constexpr int kGroupBarrierIndex = 0;
constexpr int kFirstKernelBarrierIndex = 1;

/// The communicator and what hangs off it. Shared by the group and every SymmetricBuffer it made,
/// so buffers may outlive the group object and teardown still runs in a valid order.
struct NcclState {
  ncclComm_t comm = nullptr;       ///< the global communicator: host collectives over every rank
  /// The per-node communicator (ncclCommSplit by node) when the group spans nodes, else nullptr (the
  /// global one is the node's): device communicator and windows live on lsa_comm().
  ncclComm_t node_comm = nullptr;
  NodeLayout layout;               ///< found at creation (NodeLayout)
  int rank = 0, world = 0, device = 0;
  double timeout_s = 60.0;
  std::string name;
  bool aborted = false;        ///< after a timeout or a failure: every later call throws CommError
  bool has_dev_comm = false;
  ncclDevComm dev_comm{};
  std::string dev_comm_unsupported;  ///< why there is no device communicator (when !has_dev_comm)
  int lsa_rank = 0, lsa_size = 1;    ///< this rank's team of load/store-accessible peers
  cudaStream_t stream = nullptr;     ///< internal stream (barrier, staging)
  int* barrier_word = nullptr;       ///< device int for the host barrier's all-reduce
  std::mutex mu;                     ///< guards windows
  std::map<const void*, ncclWindow_t> windows;  ///< SymmetricBuffer::local -> its window

  ~NcclState();
  /// The communicator of this rank's node: node_comm, or comm on a single node.
  ncclComm_t lsa_comm() const { return layout.num_nodes > 1 ? node_comm : comm; }
  /// wait() for an operation of communicator `c` (comm or node_comm).
  void wait_on(ncclComm_t c, ncclResult_t r, const char* statement, std::string_view op,
               std::source_location loc = std::source_location::current());
  /// Checks an NCCL result and, for a non-blocking communicator, polls until the operation has left
  /// ncclInProgress; bounded by timeout_s (then the communicator is aborted and Timeout thrown).
  void wait(ncclResult_t r, const char* statement, std::string_view op,
            std::source_location loc = std::source_location::current());
  /// Waits until all work queued on `s` so far has finished, bounded by timeout_s; also watches the
  /// communicator's asynchronous error. Throws Timeout (and aborts the communicator) or CommError.
  void wait_stream(cudaStream_t s, std::string_view op);
  /// Throws CommError if the communicator was aborted earlier.
  void require_alive(std::string_view op) const;
  /// Aborts the communicators (no-op if already done).
  void abort() noexcept;
};

/// Not thread-safe: one host thread drives a group, as NCCL asks of one communicator.
class NcclGroup final : public Group {
 public:
  NcclGroup(const UniqueId& uid, int rank, int world, int device, double timeout_s);
  ~NcclGroup() override;

  int rank() const override { return state_->rank; }
  int size() const override { return state_->world; }
  Device device() const override { return Device::cuda(state_->device); }
  std::string name() const override { return state_->name; }

  /// All work issued on this device before the call has finished, and every rank has called
  /// barrier(), when it returns (device synchronize + a one-int all-reduce, bounded by timeout_s).
  void barrier() override;
  void all_gather(const void* send, void* recv, int64_t bytes_per_rank, Stream s = {}) override;
  void all_gatherv(const void* send, void* recv, const std::vector<int64_t>& recv_bytes, Stream s = {}) override;
  /// fp32: ncclAllReduce (for R > 2 the summation order is NCCL's, not rank order).
  /// bf16: all-gather, then each element summed in fp32 in rank order and rounded once.
  void all_reduce_sum(const void* send, void* recv, int64_t n, DType dtype, Stream s = {}) override;
  /// Each rank receives its block from every rank (grouped ncclSend/ncclRecv, the bytes of an ideal
  /// reduce-scatter), then sums the R blocks in fp32 in rank order and rounds once: bit-identical to
  /// the CPU group whatever R.
  void reduce_scatterv(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype,
                       Stream s = {}) override;
  void all_to_allv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                   const std::vector<int64_t>& recv_bytes, Stream s = {}) override;
  /// ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_DEFAULT), zero-filled; peers[r] is rank r's
  /// buffer mapped into this GPU (LSA pointer; nullptr for ranks outside this rank's LSA team),
  /// peers[rank()] == local. Freeing (last owner copy dropped) deregisters locally: every rank must
  /// be quiescent on the buffer first (NCCL-DEVICE-API.md §1.5).
  SymmetricBuffer alloc_symmetric(int64_t bytes) override;
  /// Node structure found at creation: the node key of every rank (node_key_from_env, NCCL's rules)
  /// gathered over the global communicator; lsa_size is the LSA team size NCCL reports for the
  /// per-node device communicator (0 without one). Single node: the device communicator and windows
  /// are on the global communicator (the fast path); several: on a per-node ncclCommSplit.
  NodeLayout node_layout() const override { return state_->layout; }

  // ---- for CUDA kernels ----
  /// The global communicator (every rank; host collectives).
  ncclComm_t comm() const { return state_->comm; }
  /// This rank's node communicator (the ranks of node_layout().node; == comm() on one node).
  ncclComm_t node_comm() const { return state_->lsa_comm(); }
  /// The device communicator of node_comm() (lsaBarrierCount = kNumLsaBarriers): its lsaRank and
  /// lsaSize count node ranks. Throws Unsupported with NCCL's reason where there is none (no
  /// symmetric-memory support).
  const ncclDevComm& dev_comm() const;
  int lsa_rank() const { return state_->lsa_rank; }
  /// The bound on every wait of this group [s] (device-side waits of the LL and HT kernels use it too).
  double timeout_s() const override { return state_->timeout_s; }
  int lsa_size() const { return state_->lsa_size; }
  /// The window behind a buffer from alloc_symmetric of this group. Throws InvalidArgument otherwise.
  ncclWindow_t window(const SymmetricBuffer& buffer) const;
  /// Stream-ordered barrier over the LSA team with acquire-release order (one CTA, LSA barrier
  /// index kGroupBarrierIndex): stores any rank issued on its stream before the barrier are visible
  /// to every rank's work after it on theirs.
  void lsa_barrier(Stream s);

 private:
  std::shared_ptr<NcclState> state_;
};

// ---- kernels of group_nccl_cuda.cu (host launchers) ----

/// out[p] = ncclGetLsaPointer(window, 0, p) for p in [0, lsa_size); `out` is device memory.
void launch_lsa_peer_pointers(ncclWindow_t window, int lsa_size, void** out, cudaStream_t stream);
/// One-CTA kernel: ncclLsaBarrierSession(index).sync(acq_rel) over the LSA team.
void launch_lsa_barrier(const ncclDevComm& dev_comm, int index, cudaStream_t stream);
/// out[i] = round(sum over r in rank order of float(in[r * n + i])), fp32 accumulation, one
/// rounding to `dtype` (fp32 or bf16; in and out have that dtype).
void launch_sum_ranks(const void* in, int num_ranks, int64_t n, DType dtype, void* out, cudaStream_t stream);


// ---- test and diagnostic kernels (a rank writes a known pattern into a peer's window) ----

/// The word launch_fill_pattern writes at index i: a hash of (seed, i), the same on host and device.
EPX_HOST_DEVICE constexpr uint32_t pattern_word(uint32_t seed, uint64_t i) {
  uint64_t x = (static_cast<uint64_t>(seed) << 32) ^ (i * 0x9e3779b97f4a7c15ull);
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  return static_cast<uint32_t>(x ^ (x >> 32));
}
/// dst[i] = pattern_word(seed, i) for i < num_words (dst may be a peer's LSA pointer).
void launch_fill_pattern(uint32_t* dst, int64_t num_words, uint32_t seed, cudaStream_t stream);
/// *mismatches += number of i < num_words with src[i] != pattern_word(seed, i).
void launch_count_pattern_mismatches(const uint32_t* src, int64_t num_words, uint32_t seed, int* mismatches,
                                     cudaStream_t stream);

}  // namespace epx::comm
