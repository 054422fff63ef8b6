// dispatch/hier/hier.cpp: the hierarchical ll / ht wrapper (hier.h): the node backend on the node group,
// the inter-node blocks over the global group, and the host (CPU group) twins of the CUDA kernels
// in hier_cuda.cu, which follow the same steps in the same order.
#include "dispatch/hier/hier.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/node_group.h"
#include "epx/error.h"
#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/check.h"
#include "dispatch/hier/hier_cuda.h"
#endif

namespace epx::dispatch {
namespace {

int64_t align16(int64_t v) { return (v + 15) / 16 * 16; }

constexpr int kMaxNodes = 32;  // one bit per node in a token's node mask; one warp per node in the pack kernel

[[noreturn]] void throw_local(const LocalError& e) {
  if (e.kind == LocalError::unsupported) throw Unsupported(e.message);
  throw InvalidArgument(e.message);
}

int64_t load_id(const TensorView& idx, int64_t i) {
  return idx.dtype == DType::int64 ? idx.ptr<const int64_t>()[i] : idx.ptr<const int32_t>()[i];
}

class HierPrepareFinalize final : public PrepareFinalizeBase {
 public:
  HierPrepareFinalize(const std::string& name, std::shared_ptr<Group> group, const DispatchConfig& cfg, NodeBackendFactory factory)
      : PrepareFinalizeBase(name, name == "ll" ? ActivationLayout::ExpertMajor : ActivationLayout::Flat, true, std::move(group), cfg) {
    const NodeLayout nl = group_->node_layout();
    lay_ = HierLayout::make(cfg_, nl.num_nodes, nl.node, nl.ranks_per_node());
    node_group_ = std::make_shared<comm::NodeGroup>(group_);
    DispatchConfig nc = cfg_;
    nc.num_experts = lay_.node_experts();
    nc.num_max_dispatch_tokens_per_rank = lay_.num_nodes * lay_.max_tokens;
    node_ = factory(node_group_, nc);
    // The node backend's device-found errors come through this wrapper (take_device_error, or thrown
    // after finalize's inter-node step): thrown inside node_->finalize they would skip that NCCL step,
    // which has no timeout, and leave the other nodes waiting.
    node_->defer_device_errors();
    caps_ = node_->capabilities();
    caps_.name = name;
    caps_.hierarchical = true;
    // FinalizeArgs::addend joins the source's fp32 sum of the nodes' partials, before its rounding (the
    // nodes' partials themselves arrive rounded to bf16: hier.h, "Numerics").
    caps_.combine_addend = true;
    cuda_ = group_->device().is_cuda();
    local_checks_only_ = cuda_ && caps_.graph_safe;
    accepts_device_num_tokens_ = cuda_;

    const Device dev = group_->device();
    const int64_t N = lay_.num_nodes, M = lay_.max_tokens, NM = N * M, H = lay_.hidden, K = lay_.top_k;
    send_ = Tensor::zeros({N * lay_.block_bytes}, DType::uint8, dev);
    recv_ = Tensor::zeros({N * lay_.block_bytes}, DType::uint8, dev);
    pos_ = Tensor::zeros({N, M}, DType::int32, dev);
    x_in_ = Tensor::zeros({NM, H}, DType::bf16, dev);
    idx_in_ = Tensor::zeros({NM, K}, DType::int32, dev);
    w_in_ = Tensor::zeros({NM, K}, DType::fp32, dev);
    out_in_ = Tensor::zeros({NM, H}, DType::bf16, dev);
    ret_ = Tensor::zeros({NM, H}, DType::bf16, dev);
    block_sizes_.assign(static_cast<size_t>(num_ranks_), 0);
    return_sizes_.assign(static_cast<size_t>(num_ranks_), 0);
    for (int m = 0; m < lay_.num_nodes; ++m) {
      const int peer = nl.ranks_of_node(m)[static_cast<size_t>(nl.local_rank)];  // the rail peer on node m
      block_sizes_[static_cast<size_t>(peer)] = lay_.block_bytes;
      return_sizes_[static_cast<size_t>(peer)] = M * H * 2;
    }
#ifdef EPX_WITH_CUDA
    if (cuda_) {
      tokens_ = Tensor::zeros({1}, DType::int32, dev);
      report_host_ = hier_report_alloc(dev.index, &report_dev_);
    }
#endif
  }

  ~HierPrepareFinalize() override {
#ifdef EPX_WITH_CUDA
    if (report_host_) hier_report_free(report_host_);
#endif
  }

  const PrepareFinalize& node_backend() const { return *node_; }

  /// True when this call's argument verdict stays on this rank: a graph capture on a graph-safe CUDA
  /// node backend (nothing runs during a capture, and no host collective may be recorded). Eager
  /// calls share the verdict over the whole group first, so a bad argument on one rank makes every
  /// rank throw instead of leaving the others in the inter-node ncclSend/ncclRecv, which has no timeout.
  bool local_checks_only(Stream stream) const {
    if (!local_checks_only_) return false;
#ifdef EPX_WITH_CUDA
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    EPX_CUDA_CHECK(cudaStreamIsCapturing(cuda::native(stream), &capture));
    return capture != cudaStreamCaptureStatusNone;
#else
    (void)stream;
    return true;
#endif
  }

  PrepareResult prepare(const DispatchArgs& args) override {
    const std::string& op = op_prepare_;
    LocalError err = check_args(args);
    if (err.kind == LocalError::none && args.num_tokens.defined()) {
      try {
        check_dtype(op, "num_tokens", args.num_tokens, {DType::int32});
        require_arg(op, "num_tokens.numel()", args.num_tokens.numel(), args.num_tokens.numel() == 1, "must be 1 ([1] int32 on the group's GPU)");
        if (args.num_tokens.device != group_->device()) err = {LocalError::unsupported, wrong_device(op, "num_tokens", args.num_tokens.device)};
      } catch (const InvalidArgument& e) {
        err = {LocalError::invalid_argument, e.what()};
      }
    }
    if (err.kind == LocalError::none && !cuda_) err = check_ids_host(args);
    if (local_checks_only(args.stream)) {
      if (err.kind != LocalError::none) throw_local(err);
    } else {
      exchange_status(*group_, op, err, {}, args.stream);  // every rank throws if one rank's arguments are bad
    }
    const int64_t T = args.x.shape[0];
    prepared_ = true;
    prepared_tokens_ = T;
    if (cuda_) pack_cuda(args, T);
    else pack_host(args, T);
    group_->all_to_allv(send_.data(), block_sizes_, recv_.data(), block_sizes_, args.stream);
    if (cuda_) unpack_cuda(args.stream);
    else unpack_host();
    PrepareResult r = node_->prepare({x_in_, idx_in_, w_in_, args.stream});
    expert_out_shape_.assign(r.x.shape.begin(), r.x.shape.begin() + r.x.ndim);
    if (cfg_.expert_contiguous) expert_out_shape_ = {r.contiguous.num_rows, cfg_.hidden};
    combine_weights_shape_ = {r.topk_weights.defined() ? r.topk_weights.shape[0] : 0, cfg_.top_k};  // the node backend's [N_recv, K]
    const int64_t valid = stats_.num_valid_selections;
    stats_ = node_->stats();
    if (!cuda_) stats_.num_valid_selections = valid;  // this rank's own selections (counted on the host)
    stats_.remote_bytes_dispatch += static_cast<int64_t>(lay_.num_nodes - 1) * lay_.block_bytes;
    return r;
  }

  void finalize(const FinalizeArgs& args) override {
    const std::string& op = op_finalize_;
    LocalError err;
    try {
      if (!prepared_) throw InvalidArgument(op + ": no prepare to finalize: every rank calls prepare first (also with T = 0)");
      for (const auto& [arg, t] : {std::pair<const char*, const TensorView*>{"expert_out", &args.expert_out}, {"out", &args.out}})
        if (t->device != group_->device()) throw Unsupported(wrong_device(op, arg, t->device));
      // The node backend's expert_out dtype: Flat (ht) partials as DispatchConfig::flat_combine says.
      const bool fp32 = caps_.layout == ActivationLayout::Flat && !cfg_.expert_contiguous && cfg_.flat_combine == FlatCombine::partial_fp32;
      check_dtype(op, "expert_out", args.expert_out, {fp32 ? DType::fp32 : DType::bf16});
      check_shape_vec(op, "expert_out", args.expert_out, expert_out_shape_);
      check_contiguous(op, "expert_out", args.expert_out);
      check_dtype(op, "out", args.out, {DType::bf16});
      check_shape_vec(op, "out", args.out, {prepared_tokens_, cfg_.hidden});
      check_contiguous(op, "out", args.out);
      if (args.addend.defined()) {
        if (args.addend.device != group_->device()) throw Unsupported(wrong_device(op, "addend", args.addend.device));
        check_dtype(op, "addend", args.addend, {DType::fp32});
        check_shape_vec(op, "addend", args.addend, {prepared_tokens_, cfg_.hidden});
        check_contiguous(op, "addend", args.addend);
      }
      if (args.topk_weights.defined() && !cfg_.expert_contiguous)
        require_arg(op, "topk_weights", args.topk_weights.describe(), false,
                    "must be empty for backend " + caps_.name + " (combine weights apply to ht's expert-contiguous layout)");
      // The node backend checks the combine weights too, but among its node's ranks only: a bad one
      // on one rank would stop that node while the other nodes went on into the inter-node step.
      // Checked here, so the verdict goes over the whole group like every other argument's.
      if (args.topk_weights.defined() && cfg_.expert_contiguous) {
        if (args.topk_weights.device != group_->device()) throw Unsupported(wrong_device(op, "topk_weights", args.topk_weights.device));
        check_dtype(op, "topk_weights", args.topk_weights, {DType::fp32});
        check_shape_vec(op, "topk_weights", args.topk_weights, combine_weights_shape_);
        check_contiguous(op, "topk_weights", args.topk_weights);
      }
    } catch (const Unsupported& e) {
      err = {LocalError::unsupported, e.what()};
    } catch (const InvalidArgument& e) {
      err = {LocalError::invalid_argument, e.what()};
    }
    if (local_checks_only(args.stream)) {
      if (err.kind != LocalError::none) throw_local(err);
    } else {
      exchange_status(*group_, op, err, {}, args.stream);
    }
    FinalizeArgs inner{args.expert_out, out_in_, args.stream, args.topk_weights, {}};
    node_->finalize(inner);
    group_->all_to_allv(out_in_.data(), return_sizes_, ret_.data(), return_sizes_, args.stream);
    if (cuda_) sum_cuda(args);
    else sum_host(args);
    const DispatchStats& ns = node_->stats();
    stats_.remote_bytes_combine = ns.remote_bytes_combine + static_cast<int64_t>(lay_.num_nodes - 1) * lay_.max_tokens * lay_.hidden * 2;
    // A bad id a prepare refused on the device (it sent nothing for it). Thrown only here, after
    // this round's work is enqueued on every path, so no peer is left waiting in an NCCL step
    // (NCCL send/recv have no timeout): the peers' rounds complete, this rank learns of it.
    // Deferred (ModularMoE): take_device_error reports it at the next call, on every rank.
    if (!defer_errors_) {
      if (auto bad = take_bad_id()) throw InvalidArgument(*bad);
      if (auto bad = node_->take_device_error()) throw InvalidArgument(*bad);
    }
  }

  std::optional<std::string> take_device_error() override {
    if (auto bad = take_bad_id()) return bad;
    return node_->take_device_error();
  }
  void defer_device_errors() override { defer_errors_ = true; }

 private:
  /// The bad id a CUDA prepare found on this rank (HierErrorReport), taken, as a message; else nullopt.
  std::optional<std::string> take_bad_id() {
#ifdef EPX_WITH_CUDA
    if (cuda_ && report_host_->bad_count > 0) {
      const HierErrorReport rep = *report_host_;
      report_host_->bad_count = 0;
      return std::string(bad_topk_id(op_prepare_, cfg_, rep.bad_token, rep.bad_column, rep.bad_value).what()) +
             " (found on the device by a prepare, which sent nothing for it)";
    }
#endif
    return std::nullopt;
  }

  static void check_shape_vec(const std::string& op, const char* arg, const TensorView& t, const std::vector<int64_t>& want) {
    bool ok = t.ndim == static_cast<int>(want.size());
    for (int d = 0; ok && d < t.ndim; ++d) ok = t.shape[d] == want[static_cast<size_t>(d)];
    if (!ok) {
      std::string w = "[";
      for (size_t d = 0; d < want.size(); ++d) w += (d ? ", " : "") + std::to_string(want[d]);
      throw InvalidArgument(arg_message(op, arg, t.describe(), "must have shape " + w + "]"));
    }
  }

  LocalError check_ids_host(const DispatchArgs& a) {
    const int64_t T = a.x.shape[0], K = cfg_.top_k;
    int64_t valid = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t v = load_id(a.topk_idx, t * K + k);
        if (!lay_.valid_id(v, k)) return {LocalError::invalid_argument, bad_topk_id(op_prepare_, cfg_, t, k, v).what()};
        valid += v >= 0;
      }
    stats_.num_valid_selections = valid;
    return {};
  }

  // ---- host twins of hier_cuda.cu ----

  void pack_host(const DispatchArgs& a, int64_t T) {
    const int N = lay_.num_nodes, K = lay_.top_k;
    const int64_t M = lay_.max_tokens, H = lay_.hidden;
    std::vector<int32_t> count(static_cast<size_t>(N), 0);
    int32_t* pos = pos_.ptr<int32_t>();
    std::fill(pos, pos + N * M, -1);
    uint8_t* send = send_.ptr<uint8_t>();
    const uint16_t* x = a.x.ptr<const uint16_t>();
    const float* w = a.topk_weights.ptr<const float>();
    for (int64_t t = 0; t < T; ++t) {
      uint32_t mask = 0;
      for (int k = 0; k < K; ++k) {
        const int n = lay_.node_of(static_cast<int32_t>(load_id(a.topk_idx, t * K + k)));
        if (n >= 0) mask |= 1u << n;
      }
      for (int n = 0; n < N; ++n) {
        if (!(mask >> n & 1u)) continue;
        const int32_t j = count[static_cast<size_t>(n)]++;
        pos[n * M + t] = j;
        uint8_t* b = send + n * lay_.block_bytes;
        reinterpret_cast<int32_t*>(b + lay_.off_src)[j] = static_cast<int32_t>(t);
        for (int k = 0; k < K; ++k) {
          reinterpret_cast<int32_t*>(b + lay_.off_idx)[j * K + k] = static_cast<int32_t>(load_id(a.topk_idx, t * K + k));
          reinterpret_cast<float*>(b + lay_.off_w)[j * K + k] = w[t * K + k];
        }
        std::memcpy(b + lay_.off_x + j * H * 2, x + t * H, static_cast<size_t>(H * 2));
      }
    }
    for (int n = 0; n < N; ++n) std::memcpy(send + n * lay_.block_bytes, &count[static_cast<size_t>(n)], 4);
  }

  void unpack_host() {
    const int N = lay_.num_nodes, K = lay_.top_k;
    const int64_t M = lay_.max_tokens, H = lay_.hidden;
    const uint8_t* recv = recv_.ptr<const uint8_t>();
    uint16_t* x = x_in_.ptr<uint16_t>();
    int32_t* idx = idx_in_.ptr<int32_t>();
    float* w = w_in_.ptr<float>();
    for (int n = 0; n < N; ++n) {
      const uint8_t* b = recv + n * lay_.block_bytes;
      int32_t count = 0;
      std::memcpy(&count, b, 4);
      for (int64_t j = 0; j < M; ++j) {
        const int64_t r = n * M + j;
        for (int k = 0; k < K; ++k) {
          const bool live = j < count;
          idx[r * K + k] = live ? lay_.node_id(reinterpret_cast<const int32_t*>(b + lay_.off_idx)[j * K + k], n) : -1;
          w[r * K + k] = live ? reinterpret_cast<const float*>(b + lay_.off_w)[j * K + k] : 0.0f;
        }
        if (j < count) std::memcpy(x + r * H, b + lay_.off_x + j * H * 2, static_cast<size_t>(H * 2));
      }
    }
  }

  void sum_host(const FinalizeArgs& a) {
    const int N = lay_.num_nodes;
    const int64_t M = lay_.max_tokens, H = lay_.hidden, T = prepared_tokens_;
    const int32_t* pos = pos_.ptr<const int32_t>();
    const uint16_t* ret = ret_.ptr<const uint16_t>();
    uint16_t* out = a.out.ptr<uint16_t>();
    const float* addend = a.addend.defined() ? a.addend.ptr<const float>() : nullptr;
    std::vector<float> acc(static_cast<size_t>(H));
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int n = 0; n < N; ++n) {
        const int32_t j = pos[n * M + t];
        if (j < 0) continue;
        const uint16_t* row = ret + (n * M + j) * H;
        for (int64_t i = 0; i < H; ++i) acc[static_cast<size_t>(i)] += bf16_bits_to_float(row[i]);
      }
      if (addend)
        for (int64_t i = 0; i < H; ++i) acc[static_cast<size_t>(i)] += addend[t * H + i];
      for (int64_t i = 0; i < H; ++i) out[t * H + i] = float_to_bf16_bits(acc[static_cast<size_t>(i)]);
    }
  }

  // ---- CUDA ----

  void pack_cuda(const DispatchArgs& a, int64_t T) {
#ifdef EPX_WITH_CUDA
    HierPackParams p;
    p.device = group_->device().index;
    p.lay = lay_;
    p.x = a.x.ptr<const uint16_t>();
    p.idx = a.topk_idx.data;
    p.idx64 = a.topk_idx.dtype == DType::int64;
    p.weights = a.topk_weights.ptr<const float>();
    p.num_tokens_host = T;
    p.num_tokens_dev = a.num_tokens.defined() ? a.num_tokens.ptr<const int32_t>() : nullptr;
    p.num_tokens_out = tokens_.ptr<int32_t>();
    p.pos = pos_.ptr<int32_t>();
    p.send = send_.ptr<uint8_t>();
    p.report = report_dev_;
    launch_hier_pack(p, a.stream.handle);
#else
    (void)a;
    (void)T;
    throw Unsupported(op_prepare_ + ": CPU-only build");
#endif
  }

  void unpack_cuda(Stream s) {
#ifdef EPX_WITH_CUDA
    launch_hier_unpack(group_->device().index, lay_, recv_.ptr<const uint8_t>(), x_in_.ptr<uint16_t>(), idx_in_.ptr<int32_t>(),
                       w_in_.ptr<float>(), s.handle);
#else
    (void)s;
#endif
  }

  void sum_cuda(const FinalizeArgs& a) {
#ifdef EPX_WITH_CUDA
    launch_hier_sum(group_->device().index, lay_, ret_.ptr<const uint16_t>(), pos_.ptr<const int32_t>(), tokens_.ptr<const int32_t>(),
                    a.addend.defined() ? a.addend.ptr<const float>() : nullptr, a.out.ptr<uint16_t>(), a.stream.handle);
#else
    (void)a;
#endif
  }

  HierLayout lay_;
  std::shared_ptr<Group> node_group_;
  std::unique_ptr<PrepareFinalize> node_;
  bool cuda_ = false;
  bool local_checks_only_ = false;  ///< graph-safe CUDA node backend: no host collective while capturing
  Tensor send_, recv_, pos_, x_in_, idx_in_, w_in_, out_in_, ret_, tokens_;
  std::vector<int64_t> block_sizes_, return_sizes_;  ///< [R] bytes to / from each rank (rail peers only)
  std::vector<int64_t> expert_out_shape_;
  std::vector<int64_t> combine_weights_shape_;  ///< FinalizeArgs::topk_weights with expert_contiguous: [N_recv of the node backend, K]
  bool defer_errors_ = false;  ///< defer_device_errors(): bad ids only through take_device_error
#ifdef EPX_WITH_CUDA
  HierErrorReport* report_host_ = nullptr;
  HierErrorReport* report_dev_ = nullptr;
#endif
};

}  // namespace

HierLayout HierLayout::make(const DispatchConfig& cfg, int num_nodes, int node, int ranks_per_node) {
  HierLayout l;
  l.num_nodes = num_nodes;
  l.node = node;
  l.ranks_per_node = ranks_per_node;
  l.num_ranks = num_nodes * ranks_per_node;
  l.num_experts = cfg.num_experts;
  l.shared_route = cfg.shared_route;
  l.top_k = cfg.top_k;
  l.hidden = cfg.hidden;
  l.max_tokens = cfg.num_max_dispatch_tokens_per_rank;
  const Placement pl{cfg.num_experts, l.num_ranks, false};
  l.node_begin = pl.range_begin(node * ranks_per_node);
  l.node_end = pl.range_end(node * ranks_per_node + ranks_per_node - 1);
  const int64_t M = l.max_tokens, K = l.top_k;
  l.off_src = 16;
  l.off_idx = align16(l.off_src + 4 * M);
  l.off_w = align16(l.off_idx + 4 * M * K);
  l.off_x = align16(l.off_w + 4 * M * K);
  l.block_bytes = align16(l.off_x + 2 * M * l.hidden);
  return l;
}

std::optional<std::string> why_no_hierarchical(const std::string& name, const Group& group, const DispatchConfig& cfg) {
  const NodeLayout l = group.node_layout();
  const std::string head = "node layout = " + l.describe() + ": hierarchical " + name + " ";
  if (l.ranks_per_node() == 0) return head + "needs nodes of equal size";
  if (!l.contiguous()) return head + "needs each node's ranks to be consecutive group ranks";
  if (l.num_nodes > kMaxNodes) return head + "supports at most " + std::to_string(kMaxNodes) + " nodes";
  if (cfg.num_max_dispatch_tokens_per_rank < 1)
    return head + "needs num_max_dispatch_tokens_per_rank >= 1 (its inter-node blocks are sized by it)";
  for (int n = 0; n < l.num_nodes; ++n)
    if (HierLayout::make(cfg, l.num_nodes, n, l.ranks_per_node()).node_experts() == 0)
      return head + "needs every node to hold a routed expert, but node " + std::to_string(n) + " holds none (num_experts = " +
             std::to_string(cfg.num_experts) + " over " + std::to_string(group.size()) + " ranks)";
  return std::nullopt;
}

std::unique_ptr<PrepareFinalize> make_hierarchical(const std::string& name, std::shared_ptr<Group> group, const DispatchConfig& cfg,
                                                   NodeBackendFactory node_factory) {
  if (auto why = why_no_hierarchical(name, *group, cfg)) throw Unsupported(name + ".create: " + *why);
  return std::make_unique<HierPrepareFinalize>(name, std::move(group), cfg, node_factory);
}

const PrepareFinalize* hierarchical_node_backend(const PrepareFinalize& pf) {
  const auto* h = dynamic_cast<const HierPrepareFinalize*>(&pf);
  return h ? &h->node_backend() : nullptr;
}

}  // namespace epx::dispatch
