// comm/node_group.cpp: NodeGroup, one node of a group as a group (node_group.h).
#include "comm/node_group.h"

#include <algorithm>
#include <cstring>

#include "epx/error.h"

namespace epx::comm {

NodeGroup::NodeGroup(std::shared_ptr<Group> parent) : parent_(std::move(parent)) {
  require_arg("node_group", "parent", "null", parent_ != nullptr, "must be a group");
  layout_ = parent_->node_layout();
  node_ranks_ = layout_.ranks_of_node(layout_.node);
}

void NodeGroup::barrier() { parent_->barrier(); }

std::vector<std::vector<char>> NodeGroup::gather_node(const void* send, int64_t bytes, Stream s) {
  const std::vector<int64_t> sizes = parent_->all_gather_i64(bytes);
  std::vector<char> all(static_cast<size_t>(std::max<int64_t>(1, [&] {
    int64_t t = 0;
    for (int64_t v : sizes) t += v;
    return t;
  }())));
  parent_->all_gatherv(send, all.data(), sizes, s);
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t r = 0; r < sizes.size(); ++r) off[r + 1] = off[r] + sizes[r];
  std::vector<std::vector<char>> out;
  for (int g : node_ranks_) {
    const size_t gi = static_cast<size_t>(g);
    out.emplace_back(all.begin() + off[gi], all.begin() + off[gi + 1]);
  }
  return out;
}

void NodeGroup::all_gather(const void* send, void* recv, int64_t bytes_per_rank, Stream s) {
  require_arg("node_group.all_gather", "bytes_per_rank", bytes_per_rank, bytes_per_rank >= 0, "must be >= 0");
  const auto parts = gather_node(send, bytes_per_rank, s);
  for (size_t q = 0; q < parts.size(); ++q) {
    if (static_cast<int64_t>(parts[q].size()) != bytes_per_rank)
      throw CommError("node_group.all_gather: bytes_per_rank = " + std::to_string(bytes_per_rank) + " here but " +
                      std::to_string(parts[q].size()) + " on local rank " + std::to_string(q) + ": all ranks must agree");
    if (bytes_per_rank > 0) std::memcpy(static_cast<char*>(recv) + static_cast<int64_t>(q) * bytes_per_rank, parts[q].data(), parts[q].size());
  }
}

void NodeGroup::all_gatherv(const void* send, void* recv, const std::vector<int64_t>& recv_bytes, Stream s) {
  require_arg("node_group.all_gatherv", "recv_bytes.size()", recv_bytes.size(), static_cast<int>(recv_bytes.size()) == size(),
              "must equal the node's ranks = " + std::to_string(size()));
  const auto parts = gather_node(send, recv_bytes[static_cast<size_t>(rank())], s);
  int64_t off = 0;
  for (size_t q = 0; q < parts.size(); ++q) {
    if (static_cast<int64_t>(parts[q].size()) != recv_bytes[q])
      throw CommError("node_group.all_gatherv: local rank " + std::to_string(q) + " sent " + std::to_string(parts[q].size()) +
                      " bytes, recv_bytes says " + std::to_string(recv_bytes[q]));
    if (!parts[q].empty()) std::memcpy(static_cast<char*>(recv) + off, parts[q].data(), parts[q].size());
    off += recv_bytes[q];
  }
}

namespace {
float load(const char* p, int64_t i, DType dt) {
  if (dt == DType::fp32) {
    float f;
    std::memcpy(&f, p + i * 4, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, p + i * 2, 2);
  return bf16_bits_to_float(b);
}
void store(void* p, int64_t i, DType dt, float v) {
  if (dt == DType::fp32) std::memcpy(static_cast<char*>(p) + i * 4, &v, 4);
  else {
    const uint16_t b = float_to_bf16_bits(v);
    std::memcpy(static_cast<char*>(p) + i * 2, &b, 2);
  }
}
void require_reduce_dtype(const char* op, DType dt) {
  require_arg(op, "dtype", dtype_name(dt), dt == DType::fp32 || dt == DType::bf16, "must be fp32 or bf16");
}
}  // namespace

void NodeGroup::all_reduce_sum(const void* send, void* recv, int64_t n, DType dtype, Stream s) {
  require_reduce_dtype("node_group.all_reduce_sum", dtype);
  const auto parts = gather_node(send, n * dtype_size(dtype), s);
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0.0f;
    for (const auto& p : parts) acc += load(p.data(), i, dtype);
    store(recv, i, dtype, acc);
  }
}

void NodeGroup::reduce_scatterv(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype, Stream s) {
  require_reduce_dtype("node_group.reduce_scatterv", dtype);
  require_arg("node_group.reduce_scatterv", "counts.size()", counts.size(), static_cast<int>(counts.size()) == size(),
              "must equal the node's ranks = " + std::to_string(size()));
  int64_t total = 0, begin = 0;
  for (int q = 0; q < size(); ++q) {
    if (q == rank()) begin = total;
    total += counts[static_cast<size_t>(q)];
  }
  const auto parts = gather_node(send, total * dtype_size(dtype), s);
  for (int64_t i = 0; i < counts[static_cast<size_t>(rank())]; ++i) {
    float acc = 0.0f;
    for (const auto& p : parts) acc += load(p.data(), begin + i, dtype);
    store(recv, i, dtype, acc);
  }
}

void NodeGroup::all_to_allv(const void* send, const std::vector<int64_t>& send_bytes, void* recv, const std::vector<int64_t>& recv_bytes,
                            Stream s) {
  constexpr const char* op = "node_group.all_to_allv";
  require_arg(op, "send_bytes.size()", send_bytes.size(), static_cast<int>(send_bytes.size()) == size(),
              "must equal the node's ranks = " + std::to_string(size()));
  require_arg(op, "recv_bytes.size()", recv_bytes.size(), static_cast<int>(recv_bytes.size()) == size(),
              "must equal the node's ranks = " + std::to_string(size()));
  std::vector<int64_t> gs(static_cast<size_t>(parent_->size()), 0), gr(gs.size(), 0);
  for (int q = 0; q < size(); ++q) {
    gs[static_cast<size_t>(global_rank(q))] = send_bytes[static_cast<size_t>(q)];
    gr[static_cast<size_t>(global_rank(q))] = recv_bytes[static_cast<size_t>(q)];
  }
  parent_->all_to_allv(send, gs, recv, gr, s);
}

SymmetricBuffer NodeGroup::alloc_symmetric(int64_t bytes) {
  require_arg("node_group.alloc_symmetric", "bytes", bytes, bytes >= 0, "must be >= 0");
  int64_t most = 0;
  for (int64_t b : parent_->all_gather_i64(bytes)) most = std::max(most, b);
  SymmetricBuffer all = parent_->alloc_symmetric(most);
  SymmetricBuffer mine;
  mine.local = all.local;
  mine.bytes = bytes;
  mine.owner = all.owner;
  for (int q = 0; q < size(); ++q) mine.peers.push_back(all.peers[static_cast<size_t>(global_rank(q))]);
  return mine;
}

const Group& root_group(const Group& g) {
  if (const auto* n = dynamic_cast<const NodeGroup*>(&g)) return root_group(*n->parent());
  return g;
}

}  // namespace epx::comm
