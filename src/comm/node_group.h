// comm/node_group.h: the ranks of one node of a group, as a Group of their own (the "node group" of
// the hierarchical ll / ht, src/dispatch/hier/hier.h). A view, device-generic: every call goes through
// the parent group's collectives, so every rank of the parent (all nodes) must make the same
// sequence of calls, as the hierarchical backends do (each node builds and drives its own node
// backend in lockstep with the others).
//
//   rank() / size()      NodeLayout::local_rank / local_size of the parent
//   alloc_symmetric      the parent's (NCCL: windows on the per-node communicator, so peers are the
//                        node's LSA peers), with the size agreed as the maximum over all ranks of the
//                        parent (nodes may ask for different sizes); peers re-indexed by local rank
//   all_to_allv          the parent's, with zero bytes to and from other nodes (stream-ordered; any
//                        memory the parent accepts)
//   barrier              the parent's (all nodes)
//   all_gather(v), all_reduce_sum, reduce_scatterv: through the parent's all_gather(v) of host
//                        memory, reduced on the host in node-rank order (fp32, one rounding). Host
//                        pointers only (the node backends pass host memory: their create-time
//                        exchanges and status words); synchronous.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "epx/group.h"

namespace epx::comm {

class NodeGroup final : public Group {
 public:
  /// The node of `parent`'s calling rank. Throws InvalidArgument for a null parent.
  explicit NodeGroup(std::shared_ptr<Group> parent);

  int rank() const override { return layout_.local_rank; }
  int size() const override { return layout_.local_size; }
  Device device() const override { return parent_->device(); }
  std::string name() const override { return parent_->name() + "-node" + std::to_string(layout_.node); }
  double timeout_s() const override { return parent_->timeout_s(); }
  int ranks_per_gpu() const override { return parent_->ranks_per_gpu(); }

  void barrier() override;
  void all_gather(const void* send, void* recv, int64_t bytes_per_rank, Stream s = {}) override;
  void all_gatherv(const void* send, void* recv, const std::vector<int64_t>& recv_bytes, Stream s = {}) override;
  void all_reduce_sum(const void* send, void* recv, int64_t n, DType dtype, Stream s = {}) override;
  void reduce_scatterv(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype, Stream s = {}) override;
  void all_to_allv(const void* send, const std::vector<int64_t>& send_bytes, void* recv, const std::vector<int64_t>& recv_bytes,
                   Stream s = {}) override;
  SymmetricBuffer alloc_symmetric(int64_t bytes) override;

  const std::shared_ptr<Group>& parent() const { return parent_; }
  /// Global rank of local rank q of this node.
  int global_rank(int q) const { return node_ranks_[static_cast<size_t>(q)]; }

 private:
  /// Every node rank's `bytes` of `send` (host), in local-rank order, through the parent.
  std::vector<std::vector<char>> gather_node(const void* send, int64_t bytes, Stream s);

  std::shared_ptr<Group> parent_;
  NodeLayout layout_;
  std::vector<int> node_ranks_;
};

/// The group a node group views (recursively), or `g` itself: where an NCCL group's settings live.
const Group& root_group(const Group& g);

}  // namespace epx::comm
