// dispatch/dispatch_cuda_test.cpp: every dispatch backend on CUDA groups against the CPU backends run
// on the same inputs, through tests/cuda_ranks.h (one forked process per GPU with an NCCL group where
// the machine has R GPUs, else R virtual ranks as threads on one GPU), at R = 1, 2, 4 and 8:
//   - naive, allgather_reducescatter and all2allv: every prepare output (x, x_scales, local topk_idx,
//     topk_weights, recv_count) and every finalize output bit for bit, and the same DispatchStats;
//   - naive, allgather_reducescatter and all2allv in their padded form (use_worst_case_sizing: C rows
//     per rank's block, counts on the device) against the CPU padded form, bit for bit, also with a
//     device token count; a count above the bound and a bad device count refused on every rank;
//   - ll and ht on one node (their flat path): the valid rows of every prepare output and every
//     finalize output bit for bit against LlCpu / HtCpu;
//   - ll and ht across nodes (the hierarchical path, src/dispatch/hier/hier.h): in the real form every GPU
//     is its own node (NCCL's variables, NodeEnv), on virtual ranks the group reports nodes of
//     ranks_per_node ranks (2 nodes of 1, 2 and 4 ranks at R = 2, 4 and 8); bit for bit against the
//     CPU twin of the hierarchical path, and against the flat CPU backends (rows bit for bit with one
//     rank per node, the combine within bf16 noise);
//   - the node layout every group reports and the path (flat or hierarchical) ll and ht take on it;
//   - a bad id or bad arguments on one rank (InvalidArgument on every rank, the object usable after),
//     and a rank that stops taking part (its peers get Timeout naming it, naive / agrs / all2allv).
//
// Inputs are fresh random tokens (never zeros) with uneven T per rank (0, 1, 7 and 128 included), -1
// selections, duplicate experts, the shared route, int32 and int64 ids, bf16 and fp8 (incl. UE8M0)
// dispatch, hidden 7168 and 2048 (2048 only at R >= 4), ranks holding no expert; two rounds per
// backend object with different shapes (the second on the legacy default stream, or on virtual ranks
// for ll / ht, whose kernels wait on peers, a second stream of the rank's own; x and out 2 bytes off
// alignment, except for flat ll, which needs them 16-byte aligned), and device outputs poisoned (NaN)
// before each call. The experts step is the harness's
// deterministic TestExperts run on the host on copies of the prepare outputs, so this test does not
// depend on the CUDA experts. The CPU oracles run in the gtest process before the ranks are forked;
// every rank reads them (shared read-only by the threads of virtual ranks).
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

using namespace epx;
using namespace epx::test;

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

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

void take_prepare(const PrepareResult& p, Snapshot& s) {
  s.num_recv_tokens = p.num_recv_tokens;
  s.layout = std::string(layout_name(p.layout)) + " x" + p.x.describe().substr(0, p.x.describe().rfind(' ')) +
             (p.x_scales.defined() ? " scales" + p.x_scales.describe().substr(0, p.x_scales.describe().rfind(' ')) : "");
  s.x = host_bytes(p.x);
  s.x_scales = host_bytes(p.x_scales);
  s.topk_idx = host_bytes(p.topk_idx);
  s.topk_weights = host_bytes(p.topk_weights);
  s.recv_count = host_bytes(p.recv_count);
}

std::vector<int> local_ids(const Case& c, int rank) {
  std::vector<int> ids;
  const ExpertRange range = expert_range(c.E, c.R, rank);
  for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
  if (c.shared) ids.push_back(c.E);
  return ids;
}

/// The experts step on host copies of a prepare's outputs: expert_out [N, H] (Flat contract), fp32 (the
/// unrounded partial, flat_combine partial_fp32) or bf16 (partial_bf16) as the case says.
Tensor experts_out(const Case& c, int rank, const Snapshot& s) {
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
std::vector<GpuCase> make_cases(int R) {
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
std::vector<std::vector<Snapshot>> run_cpu(const std::string& name, const Case& c, const Rounds& rounds) {
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
double rel_l2_bf16(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
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

std::string compare(const Snapshot& got, const Snapshot& want) {
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
std::vector<Snapshot> run_gpu(const std::string& name, const Case& c, const Rounds& rounds, const std::shared_ptr<Group>& g,
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
void check_bad_id_throws_everywhere(const std::string& name, const GpuCase& gc, const std::shared_ptr<Group>& g,
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
Placement place(int R, Nodes nodes, int virtual_per_node = 1) {
  Placement p;
  p.R = R;
  p.virt = virtual_ranks_for(R);
  p.nodes = nodes;
  p.per_node = nodes == Nodes::one_host ? R : p.virt ? virtual_per_node : 1;
  return p;
}

/// run_cuda_ranks for placement p: the real form's NCCL variables are set here, before its ranks are
/// forked; virtual ranks get their node layout from ranks_per_node.
std::string run_placed(const Placement& p, double deadline_s, const std::function<void(int rank, const std::shared_ptr<Group>& g)>& fn,
                       double timeout_s = 60.0) {
  std::optional<NodeEnv> env;
  if (!p.virt) env.emplace(p.nodes);
  return run_cuda_ranks(p.R, deadline_s, fn, timeout_s, p.virtual_ranks_per_node());
}

/// "" when the group's node layout is the one p must give (and the LSA team is the node), else what
/// differs. Proves which path ran: one node = the single-node fast path (NCCL: device comm on the
/// global communicator), several = hierarchical ll / ht (NCCL: per-node communicators, host
/// collectives across nodes; virtual ranks: the node group of each virtual node).
std::string check_node_layout(const Group& g, const Placement& p) {
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

Tensor to_host(const TensorView& v) {
  if (!v.defined() || v.numel() == 0) return {};
  std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  Tensor h = Tensor::empty(shape, v.dtype);
  copy(h, v);
  return h;
}

/// Snapshot of p, and the TestExperts output for it ([L, cap, H] or [N, H] bf16, host, poisoned first).
Tensor hier_take(const Case& c, int rank, const PrepareResult& p, HierSnap& s) {
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
std::vector<std::vector<HierSnap>> run_hier_cpu(const std::string& name, const Case& c, const Rounds& rounds, int ranks_per_node) {
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
std::vector<HierSnap> run_node_gpu(const std::string& name, const Case& c, const Rounds& rounds, const std::shared_ptr<Group>& g,
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

std::string compare_hier(const HierSnap& got, const HierSnap& want) {
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

/// Runs every backend on every case on the ranks of placement p and compares with the CPU snapshots:
/// naive / agrs / all2allv always; ll and ht against LlCpu / HtCpu when p is one node (across nodes
/// they take the hierarchical path, which run_hier_world checks; here only the path is checked).
void run_world(const Placement& pl) {
  const int R = pl.R;
  const bool one_node = pl.num_nodes() == 1;
  std::vector<GpuCase> cases = make_cases(R);
  for (GpuCase& gc : cases)
    for (const std::string& name : kBackends) gc.want.push_back(run_cpu(name, gc.c, gc.rounds));
  std::vector<std::vector<std::vector<std::vector<HierSnap>>>> node_want(cases.size());  // [case][ll, ht][round][rank]
  if (one_node)
    for (size_t i = 0; i < cases.size(); ++i)
      for (const std::string& name : kNodeBackends) node_want[i].push_back(run_hier_cpu(name, cases[i].c, cases[i].rounds, 0));
  std::printf("%s\n", pl.describe().c_str());
  const std::string failed = run_placed(pl, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    cudaStream_t stream = nullptr, odd_stream = nullptr;  // odd_stream: see run_node_gpu
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    if (pl.virt) cuda_ok(cudaStreamCreateWithFlags(&odd_stream, cudaStreamNonBlocking), "stream");
    std::string failures = check_node_layout(*g, pl);
    if (rank == 0)
      std::printf("node layout: %s (LSA team %d)%s\n", g->node_layout().describe().c_str(), g->node_layout().lsa_size,
                  failures.empty() ? "" : (" WRONG: " + failures).c_str());
    // Which path ll and ht take: hierarchical across nodes, the flat backend (the single-node fast
    // path) on one node. Proven by the object's capabilities and its node backend.
    for (const std::string& name : kNodeBackends) {
      auto pf = make_prepare_finalize(name, g, cases[0].c.config());
      const bool hier = pf->capabilities().hierarchical, inner = dispatch::hierarchical_node_backend(*pf) != nullptr;
      const bool want = !one_node;
      if (hier != want || inner != want)
        failures += name + ": hierarchical = " + (hier ? "true" : "false") + ", want " + (want ? "true" : "false") + "; ";
      else if (rank == 0)
        std::printf("%s on %s: %s path\n", name.c_str(), g->node_layout().describe().c_str(), hier ? "hierarchical" : "single-node (flat)");
    }
    int checked = 0;
    for (const GpuCase& gc : cases) {
      for (size_t b = 0; b < kBackends.size(); ++b) {
        const auto got = run_gpu(kBackends[b], gc.c, gc.rounds, g, stream);
        for (size_t i = 0; i < got.size(); ++i) {
          const Snapshot& want = gc.want[b][i][static_cast<size_t>(rank)];
          const std::string d = compare(got[i], want);
          if (!d.empty()) failures += kBackends[b] + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + gc.c.describe() + ": " + d + "\n";
          ++checked;
          if (rank == 0 && i + 1 == got.size())
            std::printf("%-24s %s: N=%lld %s, prepare + finalize %s vs CPU (out rel_l2 %.1e)\n", kBackends[b].c_str(),
                        gc.c.describe().c_str(), static_cast<long long>(got[i].num_recv_tokens), got[i].layout.c_str(),
                        d.empty() ? "bit-exact" : "DIFFER", rel_l2_bf16(got[i].out, want.out));
        }
      }
    }
    // ll and ht on one node against LlCpu / HtCpu (their protocols in depth: ll_cuda_test.cpp, ht_cuda_test.cpp).
    if (one_node) {
      for (size_t ci = 0; ci < cases.size(); ++ci) {
        const GpuCase& gc = cases[ci];
        for (size_t b = 0; b < kNodeBackends.size(); ++b) {
          const auto got = run_node_gpu(kNodeBackends[b], gc.c, gc.rounds, g, stream, odd_stream, false);
          for (size_t i = 0; i < got.size(); ++i) {
            const std::string d = compare_hier(got[i], node_want[ci][b][i][static_cast<size_t>(rank)]);
            if (!d.empty()) failures += kNodeBackends[b] + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + gc.c.describe() + ": " + d + "\n";
            ++checked;
            if (rank == 0 && i + 1 == got.size())
              std::printf("%-24s %s: prepare + finalize %s vs %s\n", kNodeBackends[b].c_str(), gc.c.describe().c_str(),
                          d.empty() ? "bit-exact" : "DIFFER", kNodeBackends[b] == "ll" ? "LlCpu" : "HtCpu");
          }
        }
      }
    }
    for (const std::string& name : kBackends) check_bad_id_throws_everywhere(name, cases[1], g, stream, failures);
    g->barrier();
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (odd_stream) cuda_ok(cudaStreamDestroy(odd_stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("mismatches:\n" + failures);
    if (rank == 0) std::printf("dispatch CUDA OK on %s: %d rounds bit-exact vs the CPU backends\n", pl.describe().c_str(), checked);
  });
  EXPECT_EQ(failed, "") << pl.describe();
}

/// ll and ht across the nodes of placement pl (real form: one GPU per node, NCCL over sockets;
/// virtual ranks: nodes of pl.per_node ranks) against (a) the CPU twin of the hierarchical path (CPU
/// groups of the same node layout), bit for bit, and (b) the flat CPU backends (LlCpu / HtCpu): with
/// one rank per node the same rows bit for bit (it keeps the slot order), and the combine within bf16
/// noise (one extra rounding of each node's partial, hier.h).
void run_hier_world(const Placement& pl) {
  const int R = pl.R, P = pl.per_node;
  struct HierCase {
    std::string name;
    GpuCase g;
    std::vector<std::vector<HierSnap>> twin, flat;  // [round][rank]
    bool unsupported = false;                     // a node holds no routed expert
  };
  std::vector<HierCase> hcs;
  for (const std::string& name : kNodeBackends) {
    std::vector<GpuCase> cases = make_cases(R);
    for (size_t i = 0; i < cases.size(); ++i) {
      HierCase h{name, cases[i], {}, {}, false};
      h.unsupported = dispatch::why_no_hierarchical(name, *make_cpu_groups(R, 30.0, P)[0], h.g.c.config()).has_value();
      hcs.push_back(std::move(h));
      if (name == "ll" && i == 0) {  // the default combine mode too
        HierCase p{name, cases[i], {}, {}, false};
        p.g.c.ll_combine = LlCombine::partial_fp32;
        hcs.push_back(std::move(p));
      }
    }
  }
  for (HierCase& h : hcs) {
    if (h.unsupported) continue;
    h.twin = run_hier_cpu(h.name, h.g.c, h.g.rounds, P);
    h.flat = run_hier_cpu(h.name, h.g.c, h.g.rounds, 0);
  }
  std::printf("%s\n", pl.describe().c_str());
  const std::string failed = run_placed(pl, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    cudaStream_t stream = nullptr, odd_stream = nullptr;  // odd_stream: see run_node_gpu
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    if (pl.virt) cuda_ok(cudaStreamCreateWithFlags(&odd_stream, cudaStreamNonBlocking), "stream");
    std::string failures = check_node_layout(*g, pl);
    if (rank == 0) std::printf("node layout: %s (LSA team %d)\n", g->node_layout().describe().c_str(), g->node_layout().lsa_size);
    int checked = 0;
    for (const HierCase& h : hcs) {
      const Case& c = h.g.c;
      const std::string what = h.name + (c.ll_combine != LlCombine::column && h.name == "ll" ? std::string("/") + ll_combine_name(c.ll_combine) : "") +
                               " " + c.describe();
      if (h.unsupported) {
        std::string msg;
        try {
          make_prepare_finalize(h.name, g, c.config());
        } catch (const Unsupported& e) {
          msg = e.what();
        }
        if (msg.find("node layout = " + g->node_layout().describe()) == std::string::npos)
          failures += what + ": want Unsupported naming the node layout, got '" + msg + "'\n";
        else if (rank == 0)
          std::printf("%s: Unsupported as expected: %s\n", what.c_str(), msg.c_str());
        continue;
      }
      const auto got = run_node_gpu(h.name, c, h.g.rounds, g, stream, odd_stream, true);
      for (size_t i = 0; i < got.size(); ++i) {
        const HierSnap& twin = h.twin[i][static_cast<size_t>(rank)];
        const HierSnap& flat = h.flat[i][static_cast<size_t>(rank)];
        const std::string d = compare_hier(got[i], twin);
        // Rows against the flat backend: with one rank per node only (several reorder the slots).
        HierSnap flat_rows = flat, got_rows = got[i];
        flat_rows.out.clear();
        got_rows.out.clear();
        const std::string df = P == 1 ? compare_hier(got_rows, flat_rows) : "";
        const double rel = rel_l2_bf16(got[i].out, flat.out);
        const int64_t T = h.g.rounds[i][static_cast<size_t>(rank)].x.size(0);
        if (!d.empty()) failures += what + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " vs CPU twin: " + d + "\n";
        if (!df.empty()) failures += what + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " rows vs flat CPU: " + df + "\n";
        if (T > 0 && !(rel < 1e-2)) failures += what + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " out vs flat CPU rel_l2 " + std::to_string(rel) + "\n";
        ++checked;
        if (rank == 0 && i + 1 == got.size())
          std::printf("%-28s: prepare + finalize %s vs the CPU twin; rows %s vs flat %s, out rel_l2 %.1e\n", what.c_str(),
                      d.empty() ? "bit-exact" : "DIFFER", P != 1 ? "not compared" : df.empty() ? "bit-exact" : "DIFFER",
                      h.name == "ll" ? "LlCpu" : "HtCpu", rel);
      }
    }
    // A bad id on the last rank of graph-safe hierarchical ll: the device sends nothing for it and that
    // rank's finalize reports it after enqueuing all its work, so the other ranks' rounds complete
    // (no rank is left in an inter-node step), and the object stays usable.
    {
      const GpuCase& gc = hcs[2].g;  // ll, bf16, shared route, int64 ids, T > 0 on the last rank
      const Case& c = gc.c;
      if (hcs[2].name != "ll" || !c.idx64 || c.tokens(R - 1) < 1) throw std::runtime_error("bad-id case: " + hcs[2].name + " " + c.describe());
      const RankInput& ri = gc.rounds[0][static_cast<size_t>(rank)];
      const Device dev = g->device();
      auto pf = make_prepare_finalize("ll", g, c.config());
      Tensor idx = Tensor::empty({ri.x.size(0), c.K}, DType::int64);
      std::memcpy(idx.data(), ri.topk_idx.data(), static_cast<size_t>(idx.nbytes()));
      if (rank == R - 1) idx.ptr<int64_t>()[0] = c.E + 1;
      const Tensor x = ri.x.to(dev), idx_d = idx.to(dev), w = ri.topk_weights.to(dev);
      const Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16, dev);
      auto round = [&](const Tensor& ids) {
        const PrepareResult p = pf->prepare({x, ids, w, Stream{stream}});
        cuda_ok(cudaStreamSynchronize(stream), "sync after prepare");
        Tensor eo = Tensor::zeros(std::vector<int64_t>(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim), DType::bf16, dev);
        std::string what;
        try {
          pf->finalize({eo, out, Stream{stream}});
        } catch (const InvalidArgument& e) {
          what = e.what();
        }
        cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
        return what;
      };
      const std::string what = round(idx_d);
      const bool want = rank == R - 1;
      if (want != (what.find("topk_idx[0, 0]") != std::string::npos) || (!want && !what.empty()))
        failures += "hierarchical ll bad id: rank " + std::to_string(rank) + " got '" + what + "'\n";
      else if (want)
        std::printf("hierarchical ll bad id on rank %d: %s\n", rank, what.c_str());
      const std::string again = round(ri.topk_idx.to(dev));
      if (!again.empty()) failures += "hierarchical ll after a bad id: rank " + std::to_string(rank) + " threw '" + again + "'\n";
    }
    g->barrier();
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (odd_stream) cuda_ok(cudaStreamDestroy(odd_stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("mismatches:\n" + failures);
    if (rank == 0) std::printf("hierarchical ll/ht OK on %s: %d rounds checked\n", pl.describe().c_str(), checked);
  });
  EXPECT_EQ(failed, "") << pl.describe();
}

/// Bad arguments on ONE rank of an eager hierarchical call across the nodes of pl: every rank throws
/// InvalidArgument quickly (the verdict is shared over the whole group before the inter-node
/// ncclSend/ncclRecv, hier.cpp), none is left waiting; the object stays usable and its next rounds
/// equal the CPU twin bit for bit. Per backend (ll, ht): (1) prepare with T = cap + 1 on the last rank,
/// (2) finalize with out [T + 1, H] on the last rank, then the same finalize with the right out.
/// The group's timeout is short (10 s) and every throwing call must return within 5 s, so a hang
/// fails the test (or the ranks' 120 s deadline) instead of stalling the run.
void run_hier_bad_args(const Placement& pl) {
  const int R = pl.R;
  Case c;
  c.R = R;
  c.E = 8;
  c.K = 3;
  c.H = 2048;
  c.cap = 16;
  c.dtype = DType::bf16;
  c.dups = true;
  c.masked = 0.1;
  c.seed = 77;
  const Rounds good = {make_inputs(c)};  // T = cap/2 + r
  Case big = c;
  big.T.assign(static_cast<size_t>(R), 0);
  for (int r = 0; r < R; ++r) big.T[static_cast<size_t>(r)] = r == R - 1 ? c.cap + 1 : c.tokens(r);
  big.seed = 78;
  const std::vector<RankInput> too_many = make_inputs(big);
  const std::vector<std::string> names = {"ll", "ht"};
  std::vector<std::vector<std::vector<HierSnap>>> twin;  // [backend][round][rank]
  for (const std::string& name : names) twin.push_back(run_hier_cpu(name, c, good, pl.per_node));
  const double kGroupTimeoutS = 10.0, kMaxThrowS = 5.0;
  std::printf("%s\n", pl.describe().c_str());
  const std::string failed = run_placed(pl, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    std::string failures = check_node_layout(*g, pl);
    const Device dev = g->device();
    const bool bad_rank = rank == R - 1;
    const RankInput& ri = good[0][static_cast<size_t>(rank)];
    const int64_t T = ri.x.size(0);
    const Tensor x = ri.x.to(dev), idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
    const RankInput& rb = too_many[static_cast<size_t>(rank)];
    const Tensor xb = rb.x.to(dev), idxb = rb.topk_idx.to(dev), wb = rb.topk_weights.to(dev);
    using clock = std::chrono::steady_clock;
    // Runs f, which must throw InvalidArgument naming `want` (this rank's own sentence on the bad rank,
    // "rank R-1 rejected its arguments" elsewhere) within kMaxThrowS.
    auto expect_throw = [&](const std::string& what, const std::string& want, const std::function<void()>& f) {
      const auto t0 = clock::now();
      std::string msg;
      bool threw = false;
      try {
        f();
      } catch (const InvalidArgument& e) {
        threw = true;
        msg = e.what();
      } catch (const Error& e) {
        msg = std::string("wrong type: ") + e.what();
      }
      const double s = std::chrono::duration<double>(clock::now() - t0).count();
      const std::string need = bad_rank ? want : "rank " + std::to_string(R - 1) + " rejected its arguments";
      if (!threw || msg.find(need) == std::string::npos || s > kMaxThrowS)
        failures += what + ": rank " + std::to_string(rank) + (threw ? " threw" : " did not throw InvalidArgument") + " after " +
                    std::to_string(s) + " s: '" + msg + "' (want '" + need + "')\n";
      else
        std::printf("rank %d %s: InvalidArgument after %.3f s: %s\n", rank, what.c_str(), s, msg.c_str());
    };
    for (size_t b = 0; b < names.size(); ++b) {
      const std::string& name = names[b];
      auto pf = make_prepare_finalize(name, g, c.config());
      if (!pf->capabilities().hierarchical) {
        failures += name + " did not take the hierarchical path\n";
        continue;
      }
      const HierSnap& want = twin[b][0][static_cast<size_t>(rank)];
      // One good round; its output must equal the CPU twin's. bad_out: finalize first with out
      // [T + 1, H] on the last rank (error (2)), then with the right out.
      auto round = [&](const std::string& what, bool bad_out) {
        HierSnap s;
        const PrepareResult p = pf->prepare({x, idx, w, Stream{stream}});
        cuda_ok(cudaStreamSynchronize(stream), "sync after prepare");
        const Tensor eo = hier_take(c, rank, p, s).to(dev);
        if (bad_out) {
          const Tensor wrong = Tensor::empty({T + 1, c.H}, DType::bf16, dev);
          const Tensor right = Tensor::empty({T, c.H}, DType::bf16, dev);
          const TensorView o = bad_rank ? wrong.view() : right.view();
          expect_throw(name + " finalize, out [T + 1, H] on rank " + std::to_string(R - 1), ": out = ",
                       [&] { pf->finalize({eo, o, Stream{stream}}); });
        }
        const Tensor out = Tensor::empty({T, c.H}, DType::bf16, dev);
        test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison out");
        pf->finalize({eo, out, Stream{stream}});
        cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
        s.out = host_bytes(out);
        const std::string d = compare_hier(s, want);
        if (!d.empty()) failures += name + " " + what + ": rank " + std::to_string(rank) + " vs the CPU twin: " + d + "\n";
      };
      round("round before the errors", false);
      expect_throw(name + " prepare, T = cap + 1 on rank " + std::to_string(R - 1), "num_max_dispatch_tokens_per_rank",
                   [&] { pf->prepare({xb, idxb, wb, Stream{stream}}); });
      round("round after a bad prepare (its finalize first given a bad out)", true);
      round("round after a bad finalize", false);
    }
    g->barrier();
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("failures:\n" + failures);
    if (rank == 0) std::printf("hierarchical ll/ht on %s: bad arguments on one rank throw on every rank\n", pl.describe().c_str());
  }, kGroupTimeoutS);
  EXPECT_EQ(failed, "") << pl.describe();
}

/// True when `msg` names rank r ("rank r" not followed by another digit).
bool names_rank(const std::string& msg, int r) {
  const std::string key = "rank " + std::to_string(r);
  for (size_t at = msg.find(key); at != std::string::npos; at = msg.find(key, at + 1)) {
    const size_t end = at + key.size();
    if (end == msg.size() || msg[end] < '0' || msg[end] > '9') return true;
  }
  return false;
}

/// Rank `stopped` of R stops taking part in backend `name` after create (its body returns before
/// prepare): every other rank's prepare throws within about the group's timeout (3 s), and the next
/// call throws CommError. On virtual ranks the error names the stopped rank: Timeout ("rank S did not
/// arrive"), or CommError where a peer's Timeout aborted the group first (its reason names rank S
/// too). NCCL cannot tell which peer of a collective is missing, so the real form checks the kind
/// and the time only; there the stopped rank stays alive (a silent peer, not a dead process) until
/// its peers are done, and the group and backend are leaked (no teardown that could wait on a peer).
void run_stopped_rank(int R, const std::string& name, int stopped) {
  Case c;
  c.R = R;
  c.E = 2 * R;
  c.K = 2;
  c.H = 256;
  c.cap = 16;
  c.seed = 91;
  const std::vector<RankInput> in = make_inputs(c);  // T = cap/2 + r
  const bool virt = virtual_ranks_for(R);
  const double kGroupTimeoutS = 3.0, kMaxS = 20.0;
  const std::string failed = run_cuda_ranks(
      R, 120.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        auto pf = make_prepare_finalize(name, g, c.config());
        if (rank == stopped) {
          if (!virt) {
            static_cast<void>(new std::shared_ptr<Group>(g));
            static_cast<void>(pf.release());
            std::this_thread::sleep_for(std::chrono::duration<double>(3 * kGroupTimeoutS));
          }
          return;
        }
        cudaStream_t stream = nullptr;
        cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
        const Device dev = g->device();
        const RankInput& ri = in[static_cast<size_t>(rank)];
        const Tensor x = ri.x.to(dev), idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
        auto call = [&](std::string& what) {
          try {
            pf->prepare({x, idx, w, Stream{stream}});
          } catch (const Timeout& e) {
            what = e.what();
            return std::string("Timeout");
          } catch (const CommError& e) {
            what = e.what();
            return std::string("CommError");
          }
          return std::string("no error");
        };
        const auto t0 = std::chrono::steady_clock::now();
        std::string what, again;
        const std::string kind = call(what);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const std::string kind_again = call(again);
        std::string failures;
        const bool kind_ok = kind == "Timeout" || (kind == "CommError" && (!virt || what.find("timed out") != std::string::npos));
        if (!kind_ok || s > kMaxS || (virt && !names_rank(what, stopped)))
          failures += name + ": rank " + std::to_string(rank) + " got " + kind + " after " + std::to_string(s) + " s: '" + what +
                      "' (want Timeout naming rank " + std::to_string(stopped) + " within " + std::to_string(kMaxS) + " s); ";
        if (kind_again != "CommError") failures += name + ": the call after the timeout gave " + kind_again + " '" + again + "', want CommError; ";
        if (failures.empty())
          std::printf("%s, rank %d stopped: rank %d got %s after %.1f s: %s\n", name.c_str(), stopped, rank, kind.c_str(), s, what.c_str());
        if (virt) {
          cuda_ok(cudaStreamDestroy(stream), "stream destroy");
        } else {
          static_cast<void>(new std::shared_ptr<Group>(g));
          static_cast<void>(pf.release());
        }
        if (!failures.empty()) throw std::runtime_error(failures);
      },
      kGroupTimeoutS);
  EXPECT_EQ(failed, "") << name << ", R = " << R << ", rank " << stopped << " stopped";
}

// ---- the padded form (DispatchConfig::use_worst_case_sizing) of naive, agrs and all2allv -----------
//
// Every rank's block has C = num_max_dispatch_tokens_per_rank rows behind its plan record, in one
// collective; the counts stay on the device (no host wait, Capabilities::graph_safe). Checked against
// the CPU backends in their padded form (prepare_finalize_cpu.h pad_flat) bit for bit: every prepare
// output incl. the padding rows (x 0, scales 0, topk_idx -1, weights 0), every finalize output, the
// bytes (the CUDA form reports num_valid_selections and num_rank_dedup_rows as -1: only the device
// knows them). Ranks have different real counts (0, 1, 7 and 128 at C = 128), -1 selections,
// duplicates, the shared route, int64 ids, bf16 and FP8, both flat_combine modes, ranks without an
// expert, and a device token count (DispatchArgs::num_tokens) below x.shape[0]; two rounds per object.

DispatchConfig padded_config(const Case& c) {
  DispatchConfig cfg = c.config();
  cfg.use_worst_case_sizing = true;
  return cfg;
}

struct PaddedCase {
  Case c;
  Rounds rounds;
  std::vector<std::vector<int64_t>> counts;  ///< [round][rank] DispatchArgs::num_tokens, -1 = none (all x rows)
  std::vector<std::vector<std::vector<Snapshot>>> want;  ///< [backend][round][rank] from the CPU padded form
};

/// Rows of out a round defines: the device count, else every row of x.
int64_t defined_rows(const PaddedCase& pc, size_t round, int rank) {
  const int64_t n = pc.counts[round][static_cast<size_t>(rank)];
  return n >= 0 ? n : pc.rounds[round][static_cast<size_t>(rank)].x.size(0);
}

std::vector<PaddedCase> make_padded_cases(int R) {
  struct Spec {
    DType dtype;
    int E, K;
    std::vector<int64_t> T;  ///< tokens per rank (cycled); round 2 reverses them
    bool shared, idx64, with_counts;
    FlatCombine combine;
  };
  constexpr int kC = 128;
  const std::vector<Spec> specs = {
      {DType::bf16, 16, 4, {0, 1, 7, 128}, false, false, false, FlatCombine::partial_fp32},
      {DType::fp8_e4m3, 8, 4, {128, 7, 0, 1}, true, true, false, FlatCombine::partial_fp32},
      // E = 3: at R >= 4 ranks without an expert (N = 0 there, zeros back).
      {DType::bf16, 3, 2, {1, 0, 128, 7}, false, false, false, FlatCombine::partial_bf16},
      // x has C rows on every rank; the device count picks T (0, 1, 7, 128) of them.
      {DType::fp8_e4m3, 8, 3, {7, 128, 1, 0}, false, false, true, FlatCombine::partial_fp32},
  };
  std::vector<PaddedCase> cases;
  uint64_t seed = 301;
  for (const Spec& sp : specs) {
    PaddedCase pc;
    Case& c = pc.c;
    c.R = R;
    c.E = sp.E;
    c.K = sp.K;
    c.H = 2048;
    c.cap = kC;
    c.dtype = sp.dtype;
    c.shared = sp.shared;
    c.dups = true;
    c.idx64 = sp.idx64;
    c.masked = 0.2;
    c.flat_combine = sp.combine;
    c.seed = seed++;
    const std::vector<int64_t> real = per_rank(R, sp.T);
    std::vector<int64_t> real2(real.rbegin(), real.rend());
    c.T = sp.with_counts ? std::vector<int64_t>(static_cast<size_t>(R), kC) : real;
    Case c2 = c;
    if (!sp.with_counts) c2.T = real2;
    c2.seed = c.seed + 1000;
    pc.rounds = {make_inputs(c), make_inputs(c2)};
    if (sp.with_counts) {
      pc.counts = {real, real2};
    } else {
      pc.counts.assign(2, std::vector<int64_t>(static_cast<size_t>(R), -1));
    }
    cases.push_back(std::move(pc));
  }
  return cases;
}

/// The CPU backend `name` in its padded form over every round of one object: [round][rank]. out holds
/// the defined rows only (the CPU leaves rows past a device count as they were).
std::vector<std::vector<Snapshot>> run_cpu_padded(const std::string& name, const PaddedCase& pc) {
  const Case& c = pc.c;
  auto groups = make_cpu_groups(c.R, 30.0);
  std::vector<std::vector<Snapshot>> snaps(pc.rounds.size(), std::vector<Snapshot>(static_cast<size_t>(c.R)));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], padded_config(c));
    for (size_t i = 0; i < pc.rounds.size(); ++i) {
      const RankInput& ri = pc.rounds[i][static_cast<size_t>(r)];
      Snapshot& s = snaps[i][static_cast<size_t>(r)];
      DispatchArgs a{ri.x, ri.topk_idx, ri.topk_weights};
      Tensor count = Tensor::empty({1}, DType::int32);
      if (pc.counts[i][static_cast<size_t>(r)] >= 0) {
        count.ptr<int32_t>()[0] = static_cast<int32_t>(pc.counts[i][static_cast<size_t>(r)]);
        a.num_tokens = count.view();
      }
      take_prepare(pf->prepare(a), s);
      const Tensor eo = experts_out(c, r, s);
      Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      poison(out);
      pf->finalize({eo, out});
      s.out = host_bytes(out.view().slice_rows(0, defined_rows(pc, i, r)));
      s.stats = pf->stats();
      s.stats.num_valid_selections = -1;  // the CUDA form knows these on the device only
      s.stats.num_rank_dedup_rows = -1;
    }
  });
  return snaps;
}

/// Backend `name` in its padded form on this rank's group over every round of one object (odd rounds on
/// the legacy default stream with x and out 2 bytes off alignment, as run_gpu).
std::vector<Snapshot> run_gpu_padded(const std::string& name, const PaddedCase& pc, const std::shared_ptr<Group>& g, cudaStream_t stream) {
  const Case& c = pc.c;
  const int r = g->rank();
  const Device dev = g->device();
  auto pf = make_prepare_finalize(name, g, padded_config(c));
  if (!pf->capabilities().graph_safe) throw std::runtime_error(name + " padded: capabilities().graph_safe is false");
  std::vector<Snapshot> snaps(pc.rounds.size());
  for (size_t i = 0; i < pc.rounds.size(); ++i) {
    const RankInput& ri = pc.rounds[i][static_cast<size_t>(r)];
    const int64_t T = ri.x.size(0);
    const bool odd = i % 2 == 1;
    const cudaStream_t s = odd ? nullptr : stream;
    const Tensor x_store = Tensor::empty({T * c.H + 1}, DType::bf16, dev);
    const TensorView x(x_store.ptr<uint16_t>() + (odd ? 1 : 0), DType::bf16, {T, c.H}, dev);
    copy(x, ri.x);
    const Tensor idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
    DispatchArgs a{x, idx, w, Stream{s}};
    Tensor count_host = Tensor::empty({1}, DType::int32), count;
    if (pc.counts[i][static_cast<size_t>(r)] >= 0) {
      count_host.ptr<int32_t>()[0] = static_cast<int32_t>(pc.counts[i][static_cast<size_t>(r)]);
      count = count_host.to(dev);
      a.num_tokens = count.view();
    }
    if (auto why = pf->why_unsupported(a)) throw std::runtime_error(name + " padded: " + *why);
    const PrepareResult p = pf->prepare(a);
    cuda_ok(cudaStreamSynchronize(s), "sync after prepare");
    Snapshot& snap = snaps[i];
    take_prepare(p, snap);
    const Tensor eo = experts_out(c, r, snap).to(dev);
    const Tensor out_store = Tensor::empty({T * c.H + 1}, DType::bf16, dev);
    test::poison_device(out_store.data(), static_cast<size_t>(out_store.nbytes()), "poison out");
    const TensorView out(out_store.ptr<uint16_t>() + (odd ? 1 : 0), DType::bf16, {T, c.H}, dev);
    pf->finalize({eo, out, Stream{s}});
    cuda_ok(cudaStreamSynchronize(s), "sync after finalize");
    snap.out = host_bytes(out.slice_rows(0, defined_rows(pc, i, r)));
    snap.stats = pf->stats();
  }
  return snaps;
}

/// A bad call in the padded form, on every backend: (1) rank 1 passes x with C + 1 rows: its host
/// refuses it (InvalidArgument naming num_max_dispatch_tokens_per_rank) after sending its record and its
/// share of the finalize's collectives; the peers' prepare moves nothing (every row padding) and their
/// finalize throws InvalidArgument naming rank 1, after its launch. (2) The last rank's device count is
/// above its x.shape[0]: every rank's finalize throws InvalidArgument naming num_tokens and that rank.
/// After each, the object runs a good round bit for bit against the CPU padded form.
void check_padded_bad_calls(const std::string& name, const PaddedCase& good, size_t backend, const std::shared_ptr<Group>& g,
                            cudaStream_t stream, std::string& failures) {
  const Case& c = good.c;
  const int r = g->rank(), R = c.R;
  const Device dev = g->device();
  auto pf = make_prepare_finalize(name, g, padded_config(c));
  const RankInput& ri = good.rounds[0][static_cast<size_t>(r)];
  const int64_t T = ri.x.size(0);
  const std::string where = name + " padded rank " + std::to_string(r) + ": ";
  // One call on device copies of rows [0, rows) (rows > T: the last row repeated), device count `count` (-1: none).
  auto call = [&](int64_t rows, int64_t count, std::string& prepare_what, std::string& finalize_what) {
    Tensor xh = Tensor::empty({rows, c.H}, DType::bf16), ih = Tensor::empty({rows, c.K}, ri.topk_idx.dtype());
    Tensor wh = Tensor::empty({rows, c.K}, DType::fp32);
    const int64_t ib = dtype_size(ri.topk_idx.dtype()) * c.K;
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t src = T == 0 ? -1 : std::min(t, T - 1);
      if (src < 0) {  // no rows to copy: a fresh token, no selection
        std::fill_n(xh.ptr<uint16_t>() + t * c.H, c.H, float_to_bf16_bits(0.5f));
        std::memset(static_cast<uint8_t*>(ih.data()) + t * ib, 0xff, static_cast<size_t>(ib));
        std::fill_n(wh.ptr<float>() + t * c.K, c.K, 0.0f);
        continue;
      }
      std::memcpy(xh.ptr<uint16_t>() + t * c.H, ri.x.ptr<uint16_t>() + src * c.H, static_cast<size_t>(2 * c.H));
      std::memcpy(static_cast<uint8_t*>(ih.data()) + t * ib, static_cast<const uint8_t*>(ri.topk_idx.data()) + src * ib, static_cast<size_t>(ib));
      std::memcpy(wh.ptr<float>() + t * c.K, ri.topk_weights.ptr<float>() + src * c.K, static_cast<size_t>(4 * c.K));
    }
    const Tensor x = xh.to(dev), idx = ih.to(dev), w = wh.to(dev);
    DispatchArgs a{x, idx, w, Stream{stream}};
    Tensor n_host = Tensor::empty({1}, DType::int32), n_dev;
    if (count >= 0) {
      n_host.ptr<int32_t>()[0] = static_cast<int32_t>(count);
      n_dev = n_host.to(dev);
      a.num_tokens = n_dev.view();
    }
    PrepareResult p;
    bool prepared = false;
    try {
      p = pf->prepare(a);
      prepared = true;
    } catch (const InvalidArgument& e) {
      prepare_what = e.what();
    }
    // The device report of a bad record is written by the prepare's unpack kernel: finalize reads it
    // (host-mapped, no sync of its own) once the stream has passed that kernel.
    cuda_ok(cudaStreamSynchronize(stream), "sync after prepare");
    if (!prepared) return;
    const Tensor eo = Tensor::zeros({p.num_recv_tokens, c.H}, c.expert_out_dtype(ActivationLayout::Flat), dev);
    const Tensor out = Tensor::empty({rows, c.H}, DType::bf16, dev);
    try {
      pf->finalize({eo, out, Stream{stream}});
    } catch (const InvalidArgument& e) {
      finalize_what = e.what();
    }
    cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
  };
  auto good_round = [&](const char* after) {
    const RankInput& gi = good.rounds[0][static_cast<size_t>(r)];
    const Tensor x = gi.x.to(dev), idx = gi.topk_idx.to(dev), w = gi.topk_weights.to(dev);
    Snapshot snap;
    take_prepare(pf->prepare({x, idx, w, Stream{stream}}), snap);
    cuda_ok(cudaStreamSynchronize(stream), "sync after prepare");
    const Tensor eo = experts_out(c, r, snap).to(dev);
    const Tensor out = Tensor::empty({gi.x.size(0), c.H}, DType::bf16, dev);
    test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison out");
    pf->finalize({eo, out, Stream{stream}});
    cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
    snap.out = host_bytes(out);
    snap.stats = pf->stats();
    const std::string d = compare(snap, good.want[backend][0][static_cast<size_t>(r)]);
    if (!d.empty()) failures += where + "the round after " + after + ": " + d + "\n";
  };

  // (1) A count above the bound on rank 1.
  std::string pw, fw;
  call(r == 1 ? c.cap + 1 : std::min<int64_t>(T, c.cap), -1, pw, fw);
  if (r == 1) {
    if (pw.find("num_max_dispatch_tokens_per_rank = " + std::to_string(c.cap)) == std::string::npos)
      failures += where + "x with C + 1 rows: prepare threw '" + pw + "'; ";
  } else if (!pw.empty() || !names_rank(fw, 1) || fw.find("rejected its arguments") == std::string::npos) {
    failures += where + "rank 1 above the bound: prepare threw '" + pw + "', finalize '" + fw + "' (want finalize naming rank 1); ";
  }
  if (r == 0) std::printf("%s padded, rank 1 above the bound: rank 0's finalize threw: %s\n", name.c_str(), fw.c_str());
  good_round("a count above the bound");

  // (2) The last rank's device count above its x.shape[0] (4 rows, count 5; the others 3 of 4).
  pw.clear();
  fw.clear();
  call(4, r == R - 1 ? 5 : 3, pw, fw);
  if (!pw.empty() || fw.find("num_tokens = 5") == std::string::npos || !names_rank(fw, R - 1))
    failures += where + "device count 5 > x.shape[0] = 4 on rank " + std::to_string(R - 1) + ": prepare threw '" + pw + "', finalize '" + fw + "'; ";
  if (r == 0) std::printf("%s padded, a device count above x.shape[0]: rank 0's finalize threw: %s\n", name.c_str(), fw.c_str());
  good_round("a device count above x.shape[0]");
}

/// The padded form of every backend on every case at R ranks (run_cuda_ranks: one GPU per rank where
/// the machine has R, else virtual ranks), then the bad calls.
void run_padded_world(int R) {
  std::vector<PaddedCase> cases = make_padded_cases(R);
  for (PaddedCase& pc : cases)
    for (const std::string& name : kBackends) pc.want.push_back(run_cpu_padded(name, pc));
  say_where(R);
  const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    std::string failures;
    int checked = 0;
    for (const PaddedCase& pc : cases) {
      for (size_t b = 0; b < kBackends.size(); ++b) {
        const auto got = run_gpu_padded(kBackends[b], pc, g, rs.s);
        for (size_t i = 0; i < got.size(); ++i) {
          const Snapshot& want = pc.want[b][i][static_cast<size_t>(rank)];
          const std::string d = compare(got[i], want);
          if (!d.empty())
            failures += kBackends[b] + " padded round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + pc.c.describe() + ": " + d + "\n";
          ++checked;
          if (rank == 0 && i + 1 == got.size())
            std::printf("%-24s padded %s%s: N=%lld %s, prepare + finalize %s vs CPU\n", kBackends[b].c_str(), pc.c.describe().c_str(),
                        pc.counts[i][0] >= 0 ? " (device counts)" : "", static_cast<long long>(got[i].num_recv_tokens),
                        got[i].layout.c_str(), d.empty() ? "bit-exact" : "DIFFER");
        }
      }
    }
    for (size_t b = 0; b < kBackends.size(); ++b) check_padded_bad_calls(kBackends[b], cases[0], b, g, rs.s, failures);
    g->barrier();
    if (rank == 0 && failures.empty()) std::printf("padded form OK at R = %d: %d rounds bit-exact vs the CPU padded form\n", R, checked);
    test::throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "") << "padded form, R = " << R;
}

// ---- the tests: every multi-rank case at R = 2, 4 and 8 (virtual ranks where GPUs are short) ----

TEST(DispatchCuda, FlatBackendsMatchCpuOneRank) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU";
  run_world(place(1, Nodes::one_host));
}

TEST(DispatchCuda, FlatBackendsMatchCpuTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(2, Nodes::one_host));
}

TEST(DispatchCuda, FlatBackendsMatchCpuFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(4, Nodes::one_host));
}

TEST(DispatchCuda, FlatBackendsMatchCpuEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(8, Nodes::one_host));
}

// The same backends across nodes: in the real form every GPU its own node (NCCL_P2P_DISABLE=1
// NCCL_SHM_DISABLE=1: NCCL's socket transport between the GPUs; per-node communicators, host
// collectives across), on virtual ranks 2 nodes of R / 2 ranks.
TEST(DispatchCuda, FlatBackendsMatchCpuTwoVirtualNodes) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(2, Nodes::virtual_nodes, 1));
}

TEST(DispatchCuda, FlatBackendsMatchCpuVirtualNodesFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(4, Nodes::virtual_nodes, 2));
}

TEST(DispatchCuda, FlatBackendsMatchCpuVirtualNodesEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(8, Nodes::virtual_nodes, 4));
}

TEST(DispatchCuda, HierarchicalLlHtMatchCpuTwoVirtualNodes) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_world(place(2, Nodes::virtual_nodes, 1));
}

TEST(DispatchCuda, HierarchicalLlHtMatchCpuVirtualNodesFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_world(place(4, Nodes::virtual_nodes, 2));
}

TEST(DispatchCuda, HierarchicalLlHtMatchCpuVirtualNodesEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_world(place(8, Nodes::virtual_nodes, 4));
}

TEST(DispatchCuda, HierarchicalBadArgsThrowOnEveryRankTwoVirtualNodes) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_bad_args(place(2, Nodes::virtual_nodes, 1));
}

TEST(DispatchCuda, HierarchicalBadArgsThrowOnEveryRankVirtualNodesFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_bad_args(place(4, Nodes::virtual_nodes, 2));
}

TEST(DispatchCuda, HierarchicalBadArgsThrowOnEveryRankVirtualNodesEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_bad_args(place(8, Nodes::virtual_nodes, 4));
}

// The padded form (use_worst_case_sizing) of naive / allgather_reducescatter / all2allv.
TEST(DispatchCuda, PaddedFormMatchesCpuTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_padded_world(2);
}

TEST(DispatchCuda, PaddedFormMatchesCpuFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_padded_world(4);
}

TEST(DispatchCuda, PaddedFormMatchesCpuEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_padded_world(8);
}

// One rank stops taking part: naive stops the last rank, allgather_reducescatter rank 0, all2allv
// rank R / 2.
void run_stopped_ranks(int R) {
  run_stopped_rank(R, "naive", R - 1);
  run_stopped_rank(R, "allgather_reducescatter", 0);
  run_stopped_rank(R, "all2allv", R / 2);
}

TEST(DispatchCuda, StoppedRankTimesOutTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_ranks(2);
}

TEST(DispatchCuda, StoppedRankTimesOutFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_ranks(4);
}

TEST(DispatchCuda, StoppedRankTimesOutEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_ranks(8);
}

}  // namespace

#else

TEST(DispatchCuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif  // EPX_WITH_CUDA
