// dispatch/hier/hier.h: hierarchical ll and ht for groups that span nodes (issue 11; docs/scale.md §4).
//
// make_prepare_finalize builds this wrapper for "ll" and "ht" when Group::num_nodes() > 1 (NCCL
// groups across hosts or virtual nodes; CPU groups from make_cpu_groups(R, timeout, ranks_per_node)),
// never on one node, where the flat backend (the single-node fast path) runs.
// Capabilities::hierarchical says which one a caller got.
//
// Two stages. M = num_max_dispatch_tokens_per_rank, N nodes of P ranks (equal, consecutive ranks),
// rank (n, p) = local rank p of node n; its "rail peers" are the ranks (m, p) of every node m.
//   dispatch 1 (inter-node, Group::all_to_allv on the global group: grouped ncclSend/ncclRecv over
//     NCCL's network transport): a token goes once to every node holding one of its top-k experts
//     (node de-duplication: once per node, however many of its experts live there; the shared route
//     id E counts for the source's own node), to the rail peer there, as one row of a fixed
//     worst-case block per destination node (HierLayout: count word, source token, the K global ids,
//     the K weights, the bf16 row; always M rows' worth of bytes, so the sizes are static and the
//     call can be captured in a CUDA graph). The own node's block is a local copy.
//   dispatch 2 (intra-node): the N received blocks become the N * M "tokens" of the node backend (ll
//     or ht on the per-node group, comm/node_group.h: the existing LSA kernels on the per-node
//     communicator), token n * M + j = row j of node n's block; rows beyond a block's count and
//     every id outside this node become -1 (no selection); ids are renumbered to the node's experts
//     (E_node = the node's routed experts, id - first id of the node); the shared route id stays the
//     shared expert for tokens of this rank's own node and is -1 for the others. The node backend's
//     num_max_dispatch_tokens_per_rank is N * M, so its layout has P * N * M = R * M rows per
//     expert, as the flat backend's. Its PrepareResult is returned as it is.
//   combine: the node backend's finalize reduces, per forwarded token, the node's experts into one
//     bf16 row (its own combine: fp32, one rounding) in its out [N * M, H]; rows [n * M, (n+1) * M)
//     go back to node n's rail peer (fixed size again); the source adds the partials of the nodes
//     that hold one of the token's experts, in node order, in fp32, then FinalizeArgs::addend
//     (Capabilities::combine_addend: ModularMoE's separate shared expert), and rounds once to bf16.
//
// Numerics against the flat backends (LlCpu / HtCpu, the CPU reference): prepare outputs hold the
// same rows (same bf16 values; fp8 quantized from the same bf16 row, so the same codes and scales);
// with one rank per node (P = 1) in the same slot order (source rank, then token), bit for bit;
// with P > 1 the node backend orders a source node's rows by rail (local rank), then node, then
// token. combine rounds twice when a token's experts span nodes (the node's bf16 partial, then the
// sum): within bf16 noise of the flat result (|rel L2| ~ 2^-9), exact when one node holds all its
// experts. The addend joins that last sum, so a separate shared expert adds no rounding of its own;
// with an addend a token rounds twice even when one node holds all its experts (its node partial,
// then partial + addend), where the flat backends round once: one rounding there would need the
// addend in the node backend's combine of the source's own-node row ([N * M, H] fp32 more scratch). DispatchStats: the node backend's, plus the inter-node bytes this rank sends (the fixed
// blocks to the N - 1 remote rail peers: (N - 1) * block_bytes in dispatch, (N - 1) * M * 2H in
// combine).
//
// FP8: the inter-node stage carries bf16 rows; the node backend quantizes (2x the bytes of an FP8
// wire; a pre-quantized input path of the node backends would halve them). GIN (device-initiated
// sends with device-side sizes) would replace stage 1 behind the same interface; our machines have
// no RDMA NIC, so it is not built.
//
// Synchronization: CUDA: no host sync in prepare or finalize beyond the node backend's own (ll:
// none; ht: one host read of N_recv unless use_worst_case_sizing), so hierarchical ll is
// graph-safe. Bad arguments: as the node backend: graph-safe backends check on this rank only;
// the others exchange the verdict over the global group, so every rank throws. A bad topk id on
// CUDA is not sent (treated as -1) and reported by a later finalize on that rank (InvalidArgument),
// thrown after that finalize has enqueued all its work: the inter-node steps are NCCL send/recv,
// which have no timeout, so no rank may skip one its peers have posted. The node backend's own
// device-found errors come the same way (it is always created deferred: thrown inside its finalize they
// would skip the inter-node step). Under ModularMoE (defer_device_errors) both are left to
// take_device_error instead: the layer's next call throws them on every rank.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "dispatch/placement.h"
#include "dispatch/prepare_finalize_base.h"

namespace epx::dispatch {

/// Where things live in one inter-node block, and the expert-to-node arithmetic. Host and device.
struct HierLayout {
  int num_nodes = 1;       ///< N
  int node = 0;            ///< this rank's node
  int ranks_per_node = 1;  ///< P
  int num_ranks = 1;       ///< R = N * P
  int num_experts = 0;     ///< E (global, routed)
  bool shared_route = false;
  int top_k = 0;           ///< K
  int64_t hidden = 0;      ///< H
  int max_tokens = 0;      ///< M
  int node_begin = 0, node_end = 0;  ///< this node's routed experts [node_begin, node_end)
  // One block: int32 count (16 B), int32 src_token [M], int32 ids [M, K], fp32 weights [M, K], bf16 x [M, H].
  int64_t off_src = 16, off_idx = 0, off_w = 0, off_x = 0, block_bytes = 0;

  static HierLayout make(const DispatchConfig& cfg, int num_nodes, int node, int ranks_per_node);
  /// The node backend's experts: this node's routed range (+1 shared replica with shared_route on its ranks).
  EPX_HOST_DEVICE int node_experts() const { return node_end - node_begin; }

  EPX_HOST_DEVICE int max_id() const { return shared_route ? num_experts : num_experts - 1; }
  /// Placement::valid_id for column k of this layout's top_k columns (the shared route last).
  EPX_HOST_DEVICE bool valid_id(int64_t id, int64_t k) const {
    return Placement{num_experts, num_ranks, shared_route}.valid_id(id, k, top_k);
  }
  /// Node that processes selection `id` of a token of this rank (-1: none). Valid ids only.
  EPX_HOST_DEVICE int node_of(int32_t id) const {
    if (id < 0) return -1;
    if (shared_route && id == num_experts) return node;
    return Placement{num_experts, num_ranks, false}.rank_of(id) / ranks_per_node;
  }
  /// The node backend's id for global `id` of a token from node `src_node`, received here (-1: not here).
  EPX_HOST_DEVICE int32_t node_id(int32_t id, int src_node) const {
    if (id < 0) return -1;
    if (shared_route && id == num_experts) return src_node == node ? node_experts() : -1;
    return id >= node_begin && id < node_end ? id - node_begin : -1;
  }
};

/// Factory of a node backend (a registry entry's CPU or CUDA factory, with the caller's Config bound
/// where the backend takes one).
using NodeBackendFactory = std::function<std::unique_ptr<PrepareFinalize>(std::shared_ptr<Group>, const DispatchConfig&)>;

/// Why `group` (num_nodes > 1) cannot run the hierarchical `name`, or nullopt. Same answer on every
/// rank (it reads only the layout and the config).
std::optional<std::string> why_no_hierarchical(const std::string& name, const Group& group, const DispatchConfig& cfg);

/// Collective over `group`: the node group, the node backend (node_factory on it), the buffers.
/// Throws Unsupported (why_no_hierarchical) on every rank, or what the node backend throws.
std::unique_ptr<PrepareFinalize> make_hierarchical(const std::string& name, std::shared_ptr<Group> group, const DispatchConfig& cfg,
                                                   NodeBackendFactory node_factory);

/// The node backend of a hierarchical object (for tests and diagnostics), else nullptr.
const PrepareFinalize* hierarchical_node_backend(const PrepareFinalize& pf);

}  // namespace epx::dispatch
