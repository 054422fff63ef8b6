// epx/group.h: a group of R ranks (the EP group) and its collectives.
//
// CPU: ranks are threads of one process sharing host memory (make_cpu_groups); this is the
// reference and the embedded default with no GPU. CUDA: one process per GPU over NCCL
// (make_nccl_group), or R "virtual ranks" as threads of one process on one GPU
// (make_virtual_cuda_groups), so every multi-rank CUDA path runs on a machine with fewer GPUs.
// All collectives are blocking on the CPU, stream-ordered on CUDA, and every wait on a peer is
// bounded by Config::timeout_s (Timeout naming the peer and the operation). Every timeout_s argument
// below must be finite, > 0 and at most 1e9 s (deadlines are int64 nanoseconds), else InvalidArgument.
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

/// Which ranks of a group share one NVLink (LSA) domain, a "node", as found at group creation.
///
/// Nodes are numbered by their lowest rank; a node's ranks keep their group order (local rank =
/// position among them). NCCL groups detect it from NCCL's own rules (node_key_from_env: one key per
/// host, NCCL_HOSTID overriding the host, and every rank its own node when NCCL_P2P_DISABLE and
/// NCCL_SHM_DISABLE are both set, as NCCL then has no intra-node transport; NCCL-DEVICE-API.md
/// §1.4) and then check it against NCCL: lsa_size is the LSA team size NCCL reports for the
/// per-node device communicator. CPU groups are one node (threads of one process share memory).
struct NodeLayout {
  int num_nodes = 1;
  int node = 0;        ///< this rank's node id, in [0, num_nodes)
  int local_rank = 0;  ///< this rank's position among its node's ranks
  int local_size = 1;  ///< ranks on this rank's node
  std::vector<int> node_of_rank;  ///< [R]: the node of every rank
  /// NCCL's LSA team size on this rank's node communicator (0: no device communicator; the reason is
  /// in NcclGroup::dev_comm's Unsupported). Equal to local_size when NCCL agrees with the layout.
  int lsa_size = 0;

  /// Layout of R ranks from one key per rank (equal keys = one node). Throws InvalidArgument when
  /// rank is not in [0, keys.size()).
  static NodeLayout from_keys(const std::vector<int64_t>& keys, int rank);
  /// Every node's rank count when all nodes have the same, else 0.
  int ranks_per_node() const;
  /// True when every node's ranks are consecutive group ranks (NCCL's LSA teams assume it).
  bool contiguous() const;
  /// Ranks of node n in group order. Throws InvalidArgument for n outside [0, num_nodes).
  std::vector<int> ranks_of_node(int n) const;
  /// "2 nodes x 1 rank", "1 node x 2 ranks", or "3 nodes of 2+2+1 ranks" when uneven.
  std::string describe() const;
};

/// This process's node key for NodeLayout::from_keys, from NCCL's rules (NCCL-DEVICE-API.md §1.4):
/// a hash of NCCL_HOSTID when set, else of the host name and boot id; when NCCL_P2P_DISABLE and
/// NCCL_SHM_DISABLE are both set to a non-zero integer, `rank` is mixed in, so every rank is its own
/// node (NCCL then connects even the GPUs of one host through its network transport).
int64_t node_key_from_env(int rank);

class Group {
 public:
  virtual ~Group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;
  /// Name unique to this group (two groups on one node never share names or buffers).
  virtual std::string name() const = 0;
  /// The bound on every wait of this group [s] (host waits; the device-side waits of the ll, ht and
  /// hier kernels use it too).
  virtual double timeout_s() const = 0;
  /// Ranks of this group that share this rank's GPU: 1 for NCCL groups (one process per GPU) and CPU
  /// groups; R for virtual ranks (make_virtual_cuda_groups). Kernels whose blocks wait on peers take
  /// at most 1 / ranks_per_gpu() of the device, so every rank's grid is resident at once.
  virtual int ranks_per_gpu() const { return 1; }

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
  /// Which ranks share an NVLink domain (found at creation; see NodeLayout). Default: one node of
  /// every rank (CPU groups).
  virtual NodeLayout node_layout() const;
  /// node_layout().node: this rank's node id in [0, num_nodes()).
  int node_id() const { return node_layout().node; }
  /// node_layout().local_rank: this rank's position among the ranks of its node.
  int local_rank() const { return node_layout().local_rank; }
  /// node_layout().ranks_per_node(): ranks on every node (0 when nodes differ in size).
  int ranks_per_node() const { return node_layout().ranks_per_node(); }
  /// node_layout().num_nodes: NVLink domains the group spans (1: the single-node fast path).
  int num_nodes() const { return node_layout().num_nodes; }

  /// Collective configuration check (BEHAVIOUR.md): every rank passes the same field names; throws
  /// CommError "<op>: <field> = <v0> on rank 0 but <v> on rank r: all ranks must agree" on every rank.
  /// `show(i, v)`, when given, writes value v of fields[i] as the caller knows it (a name for an enum or
  /// an index); empty text = the number.
  void check_agreement(const std::string& op, const std::vector<std::pair<std::string, int64_t>>& fields,
                       const std::function<std::string(size_t field, int64_t value)>& show = nullptr);
  /// all_gather of one int64 per rank.
  std::vector<int64_t> all_gather_i64(int64_t value);
};

/// R CPU groups sharing one in-process world; element r is rank r. timeout_s bounds every wait.
std::vector<std::shared_ptr<Group>> make_cpu_groups(int num_ranks, double timeout_s = 60.0);
/// As above, but the ranks report a node layout of num_ranks / ranks_per_node nodes of consecutive
/// ranks (Group::node_layout), as NCCL groups spanning hosts do: the CPU twin of a multi-node group,
/// on which ll and ht take their hierarchical path (src/dispatch/hier/hier.h). Memory is still shared.
/// Throws InvalidArgument unless ranks_per_node >= 1 divides num_ranks.
std::vector<std::shared_ptr<Group>> make_cpu_groups(int num_ranks, double timeout_s, int ranks_per_node);

/// Runs fn(rank) on R threads, one per rank of `groups`. If any rank throws, the world is aborted
/// (peers blocked in a collective throw CommError instead of hanging) and the first exception is
/// rethrown here after all threads joined.
void run_ranks(const std::vector<std::shared_ptr<Group>>& groups, const std::function<void(int rank)>& fn);

// ---- virtual ranks: R ranks as threads of one process on one CUDA device --------------------------

/// R groups whose ranks are threads of this process on CUDA device `device` ("virtual ranks"),
/// for machines with fewer GPUs than ranks; element r is rank r; drive them with run_ranks.
///
/// Semantics are the NCCL group's: every collective is stream-ordered on the Stream given (the
/// legacy default stream, Stream{}, makes the call synchronous), host pointers are staged and make
/// the call synchronous, fp32 / bf16 sums are in fp32 in rank order with one rounding (bit-identical
/// to the CPU group), and alloc_symmetric returns per-rank cudaMalloc allocations, zero-filled, with
/// peers[r] = rank r's allocation (same device, so directly addressable): the ll / ht / hier kernels
/// run on it unchanged. A collective's host side meets its peers through the CPU group's two-phase
/// protocol (a rank that never calls gives the others a Timeout naming it); its device side is a
/// one-block barrier kernel before and after the copies, bounded by timeout_s on the device (a peer
/// whose stream never gets there is named in the Timeout of the next call). CUDA graphs: each rank
/// captures and replays on its own stream (capture mode ThreadLocal), as on separate GPUs.
///
/// Each rank must run its work on its own stream created with cudaStreamNonBlocking: the legacy
/// default stream would serialise the ranks' kernels, and kernels that wait on peers would wait on
/// work queued behind them. ranks_per_gpu() = num_ranks: kernels that wait on peers (ll, ht) take
/// at most their share of the SMs, and a launch configuration that cannot fit is refused by name at
/// create. While virtual ranks are live, freed CUDA Tensor memory is released at the next barrier()
/// (or when the last group goes): cudaFree waits for the whole device, which a rank must not do while
/// a peer's kernel may wait for it. Timings on virtual ranks measure one GPU's memory, not NVLink.
/// More than one rank needs eager kernel loading (CUDA_MODULE_LOADING=EAGER set before CUDA starts;
/// CUDA's default is LAZY, where a kernel's first launch may wait for the whole device while a peer's
/// kernel waits for it): with lazy loading num_ranks > 1 throws Unsupported naming CUDA_MODULE_LOADING.
///
/// ranks_per_node > 0 reports num_ranks / ranks_per_node virtual nodes of consecutive ranks (as
/// make_cpu_groups does), on which ll and ht take their hierarchical path. Throws InvalidArgument
/// (num_ranks outside [1, 64], bad device, timeout_s or ranks_per_node), CudaError; Unsupported in
/// a CPU-only build.
std::vector<std::shared_ptr<Group>> make_virtual_cuda_groups(int num_ranks, int device = 0, double timeout_s = 60.0,
                                                             int ranks_per_node = 0);

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
/// Rendezvous over TCP, for ranks on several hosts: rank 0 listens on `port` (every interface),
/// waits until the other world - 1 ranks have connected and said hello (rank, world), then sends
/// each the id (`*id` when given, else UniqueId::create()) and returns it; the others connect to
/// host:port (retrying until rank 0 listens) and read it. Every wait is bounded by timeout_s.
/// Throws InvalidArgument (bad host, port, rank or world), Timeout naming the ranks that never
/// connected (rank 0) or the address that never answered (others), CommError for a port already in
/// use, a peer with another world size, a duplicate rank, or a malformed reply.
UniqueId exchange_unique_id_tcp(const std::string& host, int port, int rank, int world, double timeout_s = 60.0,
                                const UniqueId* id = nullptr);

/// Where ranks meet (EPX_RENDEZVOUS): "tcp://host:port" (exchange_unique_id_tcp) or a file path
/// (exchange_unique_id).
struct RendezvousAddress {
  bool tcp = false;
  std::string path;  ///< file rendezvous
  std::string host;  ///< tcp: rank 0's host name or address
  int port = 0;      ///< tcp: in [1, 65535]
  /// Throws InvalidArgument naming the text and the rule ("tcp://host:port", port in [1, 65535]).
  static RendezvousAddress parse(std::string_view text);
  /// The id of this group through the address (file or TCP), bounded by timeout_s.
  UniqueId exchange(int rank, int world, double timeout_s) const;
};

/// exchange through `rendezvous` ("tcp://host:port" or a file path, RendezvousAddress) then
/// make_nccl_group; with a file, rank 0 removes it once every rank has joined.
std::shared_ptr<Group> make_nccl_group(const std::string& rendezvous, int rank, int world, int device,
                                       double timeout_s = 60.0);
/// From the environment a launcher sets: EPX_RANK, EPX_WORLD_SIZE, EPX_RENDEZVOUS (a file path or
/// tcp://host:port), and EPX_LOCAL_RANK (the device; default EPX_RANK modulo the visible devices).
/// Throws InvalidArgument naming a missing or malformed variable.
std::shared_ptr<Group> make_nccl_group_from_env(double timeout_s = 60.0);

}  // namespace epx
