// dispatch/dispatch_cuda_testing.h: what the dispatch CUDA tests share (dispatch_cuda_test.cpp,
// dispatch_hier_cuda_test.cpp, dispatch_padded_cuda_test.cpp): host snapshots of a rank's prepare / experts /
// finalize round, the cases and the CPU oracles, one backend's GPU rounds and their comparison, the node
// layouts (Nodes, Placement, run_placed, check_node_layout), and the ll / ht snapshots of both paths.
// Test-only; include after the CUDA headers, inside EPX_WITH_CUDA.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_ranks.h"
#include "test_util.h"
#include "dispatch/hier/hier.h"
#include "dispatch_harness.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "forked_ranks.h"

#include <cuda_runtime_api.h>

using namespace epx;
using namespace epx::test;

namespace {

using test::has_gpu;

const std::vector<std::string> kBackends = {"naive", "allgather_reducescatter", "all2allv"};
const std::vector<std::string> kNodeBackends = {"ll", "ht"};  // flat on one node, hierarchical across nodes

/// One rank's view of one prepare/experts/finalize round, as host bytes.
struct Snapshot {
  int64_t num_recv_tokens = -1;
  std::string layout;
  std::vector<uint8_t> x, x_scales, topk_idx, topk_weights, recv_count, out;
  DispatchStats stats;
};

inline void take_prepare(const PrepareResult& p, Snapshot& s) {
  s.num_recv_tokens = p.num_recv_tokens;
  s.layout = std::string(layout_name(p.layout)) + " x" + p.x.describe().substr(0, p.x.describe().rfind(' ')) +
             (p.x_scales.defined() ? " scales" + p.x_scales.describe().substr(0, p.x_scales.describe().rfind(' ')) : "");
  s.x = host_bytes(p.x);
  s.x_scales = host_bytes(p.x_scales);
  s.topk_idx = host_bytes(p.topk_idx);
  s.topk_weights = host_bytes(p.topk_weights);
  s.recv_count = host_bytes(p.recv_count);
}

inline std::vector<int> local_ids(const Case& c, int rank) {
  std::vector<int> ids;
  const ExpertRange range = expert_range(c.E, c.R, rank);
  for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
  if (c.shared) ids.push_back(c.E);
  return ids;
}

/// The experts step on host copies of a prepare's outputs: expert_out [N, H] (Flat contract), fp32 (the
/// unrounded partial, flat_combine partial_fp32) or bf16 (partial_bf16) as the case says.
inline Tensor experts_out(const Case& c, int rank, const Snapshot& s) {
  const int64_t N = s.num_recv_tokens, H = c.H, K = c.K;
  Tensor out = Tensor::empty({N, H}, c.expert_out_dtype(ActivationLayout::Flat));
  poison(out);
  const std::vector<int> ids = local_ids(c, rank);
  if (ids.empty() || N == 0) return out;
  const bool fp8 = c.dtype == DType::fp8_e4m3;
  Tensor x = Tensor::empty({N, H}, fp8 ? DType::fp8_e4m3 : DType::bf16), scales;
  std::memcpy(x.data(), s.x.data(), s.x.size());
  if (fp8) {
    scales = Tensor::empty({N, H / kFp8GroupSize}, DType::fp32);
    std::memcpy(scales.data(), s.x_scales.data(), s.x_scales.size());
  }
  Tensor idx = Tensor::empty({N, K}, DType::int32), w = Tensor::empty({N, K}, DType::fp32);
  Tensor counts = Tensor::empty({static_cast<int64_t>(ids.size())}, DType::int32);
  std::memcpy(idx.data(), s.topk_idx.data(), s.topk_idx.size());
  std::memcpy(w.data(), s.topk_weights.data(), s.topk_weights.size());
  std::memcpy(counts.data(), s.recv_count.data(), s.recv_count.size());
  TestExperts experts(ids, H);
  experts.apply({ActivationLayout::Flat, x, scales, counts, idx, w}, out, {});
  return out;
}

using Rounds = std::vector<std::vector<RankInput>>;  // [round][rank]

struct GpuCase {
  Case c;
  Rounds rounds;
  std::vector<std::vector<std::vector<Snapshot>>> want;  // [backend][round][rank] from the CPU backends
};

/// The case list for R ranks; round 2 reverses the token counts (and changes the seed), so buffers
/// are reused with other sizes. At R >= 4 the shapes are small (hidden 2048, T in {0, 1, 7, 128}).
inline std::vector<GpuCase> make_cases(int R) {
  struct Spec {
    int64_t H, H_small;  // hidden at R <= 2, and at R >= 4
    DType dtype;
    bool ue8m0;
    int E, K;
    std::vector<int64_t> T1, T2, Tn;  // tokens per rank for R = 1, R = 2, and R >= 4 (cycled over the ranks)
    bool shared, dups, idx64;
    double masked;
  };
  const std::vector<Spec> specs = {
      {7168, 2048, DType::fp8_e4m3, false, 16, 8, {37}, {37, 0}, {7, 0, 128, 1}, false, true, false, 0.2},
      // The bad-id cases use this one: the last rank has T > 0 at every R.
      {2048, 2048, DType::bf16, false, 8, 4, {64}, {5, 64}, {1, 128, 0, 7}, true, true, true, 0.15},
      {2048, 2048, DType::fp8_e4m3, true, 3, 2, {1}, {0, 1}, {0, 1}, false, false, false, 0.3},  // R >= 4: ranks without an expert
      {7168, 2048, DType::bf16, false, 1, 2, {16}, {16, 9}, {7, 128, 1, 0}, false, true, false, 0.1},  // only rank 0 holds an expert
      {2048, 2048, DType::bf16, false, 4, 2, {0}, {0, 0}, {0}, false, false, false, 0.0},
      {2048, 2048, DType::fp8_e4m3, false, 8, 4, {128}, {7, 128}, {128, 7, 1, 0}, false, true, false, 0.25},
  };
  std::vector<GpuCase> cases;
  uint64_t seed = 11;
  for (const Spec& sp : specs) {
    GpuCase g;
    Case& c = g.c;
    c.R = R;
    c.E = sp.E;
    c.K = sp.K;
    c.H = R <= 2 ? sp.H : sp.H_small;
    const std::vector<int64_t>& pattern = R == 1 ? sp.T1 : R == 2 ? sp.T2 : sp.Tn;
    for (int r = 0; r < R; ++r) c.T.push_back(pattern[static_cast<size_t>(r) % pattern.size()]);
    c.cap = static_cast<int>(std::max<int64_t>(64, *std::max_element(c.T.begin(), c.T.end())));
    c.dtype = sp.dtype;
    c.ue8m0 = sp.ue8m0;
    c.shared = sp.shared;
    c.dups = sp.dups;
    c.idx64 = sp.idx64;
    c.masked = sp.masked;
    c.seed = seed++;
    // DispatchConfig's default, one rounding: fp32 partials; the last spec keeps the two-roundings opt-in.
    c.flat_combine = &sp == &specs.back() ? FlatCombine::partial_bf16 : FlatCombine::partial_fp32;
    Case c2 = c;
    c2.T.assign(c.T.rbegin(), c.T.rend());
    c2.seed = c.seed + 1000;
    g.rounds = {make_inputs(c), make_inputs(c2)};
    cases.push_back(std::move(g));
  }
  return cases;
}

/// The CPU backend `name` on R CPU ranks over all rounds of one object: [round][rank].
inline std::vector<std::vector<Snapshot>> run_cpu(const std::string& name, const Case& c, const Rounds& rounds) {
  auto groups = make_cpu_groups(c.R, 30.0);
  std::vector<std::vector<Snapshot>> snaps(rounds.size(), std::vector<Snapshot>(static_cast<size_t>(c.R)));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], c.config());
    for (size_t i = 0; i < rounds.size(); ++i) {
      const RankInput& ri = rounds[i][static_cast<size_t>(r)];
      Snapshot& s = snaps[i][static_cast<size_t>(r)];
      take_prepare(pf->prepare({ri.x, ri.topk_idx, ri.topk_weights}), s);
      const Tensor eo = experts_out(c, r, s);
      Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      poison(out);
      pf->finalize({eo, out});
      s.out = host_bytes(out);
      s.stats = pf->stats();
    }
  });
  return snaps;
}

/// ||a - b|| / ||b|| over bf16 bytes.
inline double rel_l2_bf16(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i + 1 < a.size(); i += 2) {
    uint16_t x, y;
    std::memcpy(&x, a.data() + i, 2);
    std::memcpy(&y, b.data() + i, 2);
    const double d = static_cast<double>(bf16_bits_to_float(x)) - bf16_bits_to_float(y);
    num += d * d;
    den += static_cast<double>(bf16_bits_to_float(y)) * bf16_bits_to_float(y);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline std::string compare(const Snapshot& got, const Snapshot& want) {
  std::string d;
  if (got.num_recv_tokens != want.num_recv_tokens)
    d += "num_recv_tokens " + std::to_string(got.num_recv_tokens) + ", want " + std::to_string(want.num_recv_tokens) + "; ";
  if (got.layout != want.layout) d += "layout " + got.layout + ", want " + want.layout + "; ";
  d += first_diff("x", got.x, want.x);
  d += first_diff("x_scales", got.x_scales, want.x_scales);
  d += first_diff("topk_idx", got.topk_idx, want.topk_idx);
  d += first_diff("topk_weights", got.topk_weights, want.topk_weights);
  d += first_diff("recv_count", got.recv_count, want.recv_count);
  d += first_diff("out", got.out, want.out);
  const DispatchStats& a = got.stats;
  const DispatchStats& b = want.stats;
  if (a.num_valid_selections != b.num_valid_selections || a.num_rank_dedup_rows != b.num_rank_dedup_rows ||
      a.remote_bytes_dispatch != b.remote_bytes_dispatch || a.remote_bytes_combine != b.remote_bytes_combine)
    d += "stats {" + std::to_string(a.num_valid_selections) + ", " + std::to_string(a.num_rank_dedup_rows) + ", " +
         std::to_string(a.remote_bytes_dispatch) + ", " + std::to_string(a.remote_bytes_combine) + "}, want {" +
         std::to_string(b.num_valid_selections) + ", " + std::to_string(b.num_rank_dedup_rows) + ", " +
         std::to_string(b.remote_bytes_dispatch) + ", " + std::to_string(b.remote_bytes_combine) + "}; ";
  return d;
}

/// Backend `name` (naive, allgather_reducescatter, all2allv) on this rank's group over all rounds of
/// one object. Odd rounds run on the legacy default stream, also on virtual ranks (these backends
/// move data only through the group's collectives, which run a legacy-stream call on the rank's own
/// stream, and their kernels wait on no peer).
inline std::vector<Snapshot> run_gpu(const std::string& name, const Case& c, const Rounds& rounds, const std::shared_ptr<Group>& g,
                              cudaStream_t stream) {
  const int r = g->rank();
  const Device dev = g->device();
  auto pf = make_prepare_finalize(name, g, c.config());
  if (pf->capabilities().name != name) throw std::runtime_error("capabilities().name = " + pf->capabilities().name);
  std::vector<Snapshot> snaps(rounds.size());
  for (size_t i = 0; i < rounds.size(); ++i) {
    const RankInput& ri = rounds[i][static_cast<size_t>(r)];
    const int64_t T = ri.x.size(0);
    // Odd rounds: the legacy default stream, and x / out starting 2 bytes into their allocations
    // (rows neither 4- nor 16-byte aligned: the narrow copy, quantize and combine paths).
    const bool odd = i % 2 == 1;
    const cudaStream_t s = odd ? nullptr : stream;
    const Tensor x_store = Tensor::empty({T * c.H + 1}, DType::bf16, dev);
    const TensorView x(x_store.ptr<uint16_t>() + (odd ? 1 : 0), DType::bf16, {T, c.H}, dev);
    copy(x, ri.x);
    const Tensor idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
    if (pf->why_unsupported({x, idx, w, Stream{s}})) throw std::runtime_error(*pf->why_unsupported({x, idx, w}));
    const PrepareResult p = pf->prepare({x, idx, w, Stream{s}});
    cuda_ok(cudaStreamSynchronize(s), "sync after prepare");
    for (const TensorView* v : {&p.x, &p.topk_idx, &p.topk_weights, &p.recv_count})
      if (v->device != dev) throw std::runtime_error("prepare output on " + v->device.str() + ", want " + dev.str());
    Snapshot& snap = snaps[i];
    take_prepare(p, snap);
    const Tensor eo = experts_out(c, r, snap).to(dev);
    const Tensor out_store = Tensor::empty({T * c.H + 1}, DType::bf16, dev);
    test::poison_device(out_store.data(), static_cast<size_t>(out_store.nbytes()), "poison out");  // waits: s may be non-blocking
    const TensorView out(out_store.ptr<uint16_t>() + (odd ? 1 : 0), DType::bf16, {T, c.H}, dev);
    pf->finalize({eo, out, Stream{s}});
    cuda_ok(cudaStreamSynchronize(s), "sync after finalize");
    snap.out = host_bytes(out);
    snap.stats = pf->stats();
  }
  return snaps;
}

/// A bad id on the last rank: InvalidArgument on every rank (before any data moves); the object
/// stays usable.
inline void check_bad_id_throws_everywhere(const std::string& name, const GpuCase& gc, const std::shared_ptr<Group>& g,
                                    cudaStream_t stream, std::string& failures) {
  const Case& c = gc.c;
  const int r = g->rank();
  auto pf = make_prepare_finalize(name, g, c.config());
  const RankInput& ri = gc.rounds[0][static_cast<size_t>(r)];
  Tensor idx = ri.topk_idx;
  if (r == c.R - 1 && ri.x.size(0) > 0) {
    idx = Tensor::empty({ri.x.size(0), c.K}, ri.topk_idx.dtype());
    std::memcpy(idx.data(), ri.topk_idx.data(), static_cast<size_t>(idx.nbytes()));
    // E: out of range without shared_route; with it, the shared id in a routed column (the FHMoE rule).
    const int64_t bad = c.E;
    if (idx.dtype() == DType::int64) idx.ptr<int64_t>()[c.K * (ri.x.size(0) - 1)] = bad;
    else idx.ptr<int32_t>()[c.K * (ri.x.size(0) - 1)] = static_cast<int32_t>(bad);
  }
  const Device dev = g->device();
  const Tensor x = ri.x.to(dev), idx_d = idx.to(dev), w = ri.topk_weights.to(dev);
  std::string what;
  try {
    pf->prepare({x, idx_d, w, Stream{stream}});
  } catch (const InvalidArgument& e) {
    what = e.what();
  }
  const std::string want = "topk_idx[" + std::to_string(ri.x.size(0) - 1) + ", 0]";
  if (what.find("topk_idx[") == std::string::npos || (r == c.R - 1 && what.find(want) == std::string::npos) ||
      (r == c.R - 1 && c.shared && what.find("belongs in the last column") == std::string::npos) ||
      (r != c.R - 1 && what.find("rank " + std::to_string(c.R - 1)) == std::string::npos))
    failures += name + " bad id: rank " + std::to_string(r) + " threw '" + what + "'; ";
  const Tensor idx_ok = ri.topk_idx.to(dev);
  pf->prepare({x, idx_ok, w, Stream{stream}});  // usable afterwards
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  if (r == 0) std::printf("bad id: %s\n", what.c_str());
}

/// How the ranks see each other: one node (NCCL's single-node fast path; a virtual group of one
/// node), or several nodes: in the real form every GPU its own node, NCCL over its network (socket)
/// transport; on virtual ranks nodes of ranks_per_node consecutive ranks.
enum class Nodes { one_host, virtual_nodes };

/// Sets (virtual_nodes) or clears (one_host) the NCCL variables that make every GPU its own node, in
/// this (the gtest) process before the real form's ranks are forked: NCCL reads its environment once
/// per process, and a rank's thread must not set it. Restores the previous values when it goes.
class NodeEnv {
 public:
  explicit NodeEnv(Nodes nodes) : p2p_("NCCL_P2P_DISABLE", on(nodes)), shm_("NCCL_SHM_DISABLE", on(nodes)) {}

 private:
  static const char* on(Nodes nodes) { return nodes == Nodes::virtual_nodes ? "1" : nullptr; }
  test::ScopedEnv p2p_, shm_;
};

/// Where a test's R ranks run (run_cuda_ranks' choice) and the node layout their groups must report.
struct Placement {
  int R = 1;
  bool virt = false;  ///< virtual ranks on one GPU, else one forked process per GPU (NCCL)
  Nodes nodes = Nodes::one_host;
  int per_node = 1;   ///< ranks per node: R on one node; across nodes 1 in the real form, else the virtual layout's
  int num_nodes() const { return R / per_node; }
  /// ranks_per_node for run_cuda_ranks (used by virtual ranks only).
  int virtual_ranks_per_node() const { return virt && nodes == Nodes::virtual_nodes ? per_node : 0; }
  std::string describe() const {
    return std::to_string(R) + (virt ? " virtual ranks" : " ranks (one GPU each)") + ", " + std::to_string(num_nodes()) + " node(s) x " +
           std::to_string(per_node);
  }
};

/// R ranks on one node, or (virtual_nodes) on several: one rank per GPU-node in the real form, nodes of
/// virtual_per_node ranks on virtual ranks (it must divide R and be less than R).
inline Placement place(int R, Nodes nodes, int virtual_per_node = 1) {
  Placement p;
  p.R = R;
  p.virt = virtual_ranks_for(R);
  p.nodes = nodes;
  p.per_node = nodes == Nodes::one_host ? R : p.virt ? virtual_per_node : 1;
  return p;
}

/// run_cuda_ranks for placement p: the real form's NCCL variables are set here, before its ranks are
/// forked; virtual ranks get their node layout from ranks_per_node.
inline std::string run_placed(const Placement& p, double deadline_s, const std::function<void(int rank, const std::shared_ptr<Group>& g)>& fn,
                       double timeout_s = 60.0) {
  std::optional<NodeEnv> env;
  if (!p.virt) env.emplace(p.nodes);
  return run_cuda_ranks(p.R, deadline_s, fn, timeout_s, p.virtual_ranks_per_node());
}

/// "" when the group's node layout is the one p must give (and the LSA team is the node), else what
/// differs. Proves which path ran: one node = the single-node fast path (NCCL: device comm on the
/// global communicator), several = hierarchical ll / ht (NCCL: per-node communicators, host
/// collectives across nodes; virtual ranks: the node group of each virtual node).
inline std::string check_node_layout(const Group& g, const Placement& p) {
  const NodeLayout l = g.node_layout();
  const int P = p.per_node, N = p.num_nodes(), r = g.rank();
  std::string d;
  if (l.num_nodes != N || g.num_nodes() != N) d += "num_nodes " + std::to_string(l.num_nodes) + ", want " + std::to_string(N) + " (" + l.describe() + "); ";
  if (g.ranks_per_node() != P) d += "ranks_per_node " + std::to_string(g.ranks_per_node()) + ", want " + std::to_string(P) + "; ";
  if (g.node_id() != r / P) d += "node_id " + std::to_string(g.node_id()) + ", want " + std::to_string(r / P) + "; ";
  if (g.local_rank() != r % P) d += "local_rank " + std::to_string(g.local_rank()) + ", want " + std::to_string(r % P) + "; ";
  if (l.lsa_size != l.local_size)
    d += "the LSA team has " + std::to_string(l.lsa_size) + " ranks, the node " + std::to_string(l.local_size) + "; ";
  return d;
}

// ---- ll / ht (flat on one node, hierarchical across nodes: src/dispatch/hier/hier.h) ---------------------

/// One rank's prepare/experts/finalize round of ll or ht as host bytes; ExpertMajor keeps only the
/// valid rows [0, recv_count[l]) of each expert (the rest is stale by contract).
struct HierSnap {
  int64_t num_recv_tokens = -1;
  std::vector<int64_t> x_shape;
  std::vector<int32_t> recv_count;
  std::vector<uint8_t> x, x_scales, topk_idx, topk_weights, out;
};

inline Tensor to_host(const TensorView& v) {
  if (!v.defined() || v.numel() == 0) return {};
  std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  Tensor h = Tensor::empty(shape, v.dtype);
  copy(h, v);
  return h;
}

/// Snapshot of p, and the TestExperts output for it ([L, cap, H] or [N, H] bf16, host, poisoned first).
inline Tensor hier_take(const Case& c, int rank, const PrepareResult& p, HierSnap& s) {
  const Tensor x = to_host(p.x), scales = to_host(p.x_scales), counts = to_host(p.recv_count);
  const Tensor idx = to_host(p.topk_idx), w = to_host(p.topk_weights);
  s.num_recv_tokens = p.num_recv_tokens;
  s.x_shape.assign(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
  s.recv_count.assign(counts.ptr<int32_t>(), counts.ptr<int32_t>() + counts.numel());
  if (p.layout == ActivationLayout::ExpertMajor) {
    const int64_t cap = p.x.shape[1], row = x.nbytes() / std::max<int64_t>(1, p.x.shape[0] * cap);
    const int64_t srow = scales.defined() ? scales.nbytes() / std::max<int64_t>(1, p.x.shape[0] * cap) : 0;
    for (size_t l = 0; l < s.recv_count.size(); ++l) {
      const auto* xb = static_cast<const uint8_t*>(x.data()) + static_cast<int64_t>(l) * cap * row;
      s.x.insert(s.x.end(), xb, xb + s.recv_count[l] * row);
      if (srow > 0) {
        const auto* sb = static_cast<const uint8_t*>(scales.data()) + static_cast<int64_t>(l) * cap * srow;
        s.x_scales.insert(s.x_scales.end(), sb, sb + s.recv_count[l] * srow);
      }
    }
  } else {
    s.x = host_bytes(x);
    s.x_scales = host_bytes(scales);
    s.topk_idx = host_bytes(idx);
    s.topk_weights = host_bytes(w);
  }
  Tensor out = Tensor::empty(s.x_shape, c.expert_out_dtype(p.layout));
  poison(out);
  const std::vector<int> ids = local_ids(c, rank);
  if (!ids.empty() && !(p.layout == ActivationLayout::Flat && p.num_recv_tokens == 0)) {
    TestExperts experts(ids, c.H);
    experts.apply({p.layout, x, scales, counts, idx, w}, out, {});
  }
  return out;
}

/// ll / ht on CPU groups: hierarchical with ranks_per_node > 0 (the CPU twin), flat with 0.
inline std::vector<std::vector<HierSnap>> run_hier_cpu(const std::string& name, const Case& c, const Rounds& rounds, int ranks_per_node) {
  auto groups = ranks_per_node > 0 ? make_cpu_groups(c.R, 30.0, ranks_per_node) : make_cpu_groups(c.R, 30.0);
  std::vector<std::vector<HierSnap>> snaps(rounds.size(), std::vector<HierSnap>(static_cast<size_t>(c.R)));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], c.config());
    for (size_t i = 0; i < rounds.size(); ++i) {
      const RankInput& ri = rounds[i][static_cast<size_t>(r)];
      HierSnap& s = snaps[i][static_cast<size_t>(r)];
      const Tensor eo = hier_take(c, r, pf->prepare({ri.x, ri.topk_idx, ri.topk_weights}), s);
      Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      poison(out);
      pf->finalize({eo, out});
      s.out = host_bytes(out);
    }
  });
  return snaps;
}

/// ll or ht on this rank's group over all rounds of one object; `hierarchical`: the path it must take.
/// Odd rounds run on odd_stream (the legacy default stream when null; on virtual ranks a second
/// cudaStreamNonBlocking stream of the rank: the legacy stream would queue a peer's kernel behind this
/// rank's, which waits for it) with x / out 2 bytes off alignment, except for flat ll (its kernels move
/// 16-byte vectors: x and out must be 16-byte aligned).
inline std::vector<HierSnap> run_node_gpu(const std::string& name, const Case& c, const Rounds& rounds, const std::shared_ptr<Group>& g,
                                   cudaStream_t stream, cudaStream_t odd_stream, bool hierarchical) {
  const int r = g->rank();
  const Device dev = g->device();
  auto pf = make_prepare_finalize(name, g, c.config());
  if (pf->capabilities().hierarchical != hierarchical)
    throw std::runtime_error(name + (hierarchical ? " did not take the hierarchical path" : " took the hierarchical path on one node"));
  if (pf->capabilities().name != name) throw std::runtime_error("capabilities().name = " + pf->capabilities().name);
  const bool misalign = hierarchical || name != "ll";
  std::vector<HierSnap> snaps(rounds.size());
  for (size_t i = 0; i < rounds.size(); ++i) {
    const RankInput& ri = rounds[i][static_cast<size_t>(r)];
    const int64_t T = ri.x.size(0);
    const bool odd = i % 2 == 1;
    const cudaStream_t s = odd ? odd_stream : stream;
    const int64_t off = odd && misalign ? 1 : 0;
    const Tensor x_store = Tensor::empty({T * c.H + 8}, DType::bf16, dev);
    const TensorView x(x_store.ptr<uint16_t>() + off, DType::bf16, {T, c.H}, dev);
    copy(x, ri.x);
    const Tensor idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
    const PrepareResult p = pf->prepare({x, idx, w, Stream{s}});
    cuda_ok(cudaStreamSynchronize(s), "sync after prepare");
    const Tensor eo = hier_take(c, r, p, snaps[i]).to(dev);
    const Tensor out_store = Tensor::empty({T * c.H + 8}, DType::bf16, dev);
    test::poison_device(out_store.data(), static_cast<size_t>(out_store.nbytes()), "poison out");  // waits: s may be non-blocking
    const TensorView out(out_store.ptr<uint16_t>() + off, DType::bf16, {T, c.H}, dev);
    pf->finalize({eo, out, Stream{s}});
    cuda_ok(cudaStreamSynchronize(s), "sync after finalize");
    snaps[i].out = host_bytes(out);
  }
  return snaps;
}

inline std::string compare_hier(const HierSnap& got, const HierSnap& want) {
  std::string d;
  if (got.num_recv_tokens != want.num_recv_tokens && want.num_recv_tokens >= 0 && got.num_recv_tokens >= 0)
    d += "num_recv_tokens " + std::to_string(got.num_recv_tokens) + ", want " + std::to_string(want.num_recv_tokens) + "; ";
  if (got.x_shape != want.x_shape) d += "x shape differs; ";
  if (got.recv_count != want.recv_count) d += "recv_count differs; ";
  d += first_diff("x", got.x, want.x);
  d += first_diff("x_scales", got.x_scales, want.x_scales);
  d += first_diff("topk_idx", got.topk_idx, want.topk_idx);
  d += first_diff("topk_weights", got.topk_weights, want.topk_weights);
  d += first_diff("out", got.out, want.out);
  return d;
}

/// True when `msg` names rank r ("rank r" not followed by another digit).
inline bool names_rank(const std::string& msg, int r) {
  const std::string key = "rank " + std::to_string(r);
  for (size_t at = msg.find(key); at != std::string::npos; at = msg.find(key, at + 1)) {
    const size_t end = at + key.size();
    if (end == msg.size() || msg[end] < '0' || msg[end] > '9') return true;
  }
  return false;
}

}  // namespace
