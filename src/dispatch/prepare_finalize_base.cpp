#include "dispatch/prepare_finalize_base.h"

#include <algorithm>
#include <limits>

#include "core/binding_error.h"
#include "core/topk_message.h"

namespace epx::dispatch {
namespace {

[[noreturn]] void throw_kind(LocalError::Kind kind, const std::string& message) {
  if (kind == LocalError::unsupported) throw Unsupported(message);
  throw InvalidArgument(message);
}

void check_shape_vec(const std::string& op, const std::string& arg, const TensorView& t, const std::vector<int64_t>& want) {
  bool ok = t.ndim == static_cast<int>(want.size());
  std::string text = "[";
  for (size_t i = 0; i < want.size(); ++i) {
    if (ok && t.shape[i] != want[i]) ok = false;
    text += (i ? ", " : "") + std::to_string(want[i]);
  }
  if (!ok) {
    const std::string got = t.describe();
    throw InvalidArgument(arg_message(op, arg + ".shape", got.substr(0, got.find(']') + 1), "must be " + text + "]"));
  }
}

}  // namespace

PrepareResult FlatRecv::result() const {
  PrepareResult r;
  r.layout = ActivationLayout::Flat;
  r.x = x.view();
  r.x_scales = x_scales.view();
  r.recv_count = recv_count.view();
  r.topk_idx = topk_idx.view();
  r.topk_weights = topk_weights.view();
  r.num_recv_tokens = x.size(0);
  return r;
}

// ---- status exchange ----------------------------------------------------------------------------

namespace {

/// The call a status exchange belongs to, as one word every rank compares (FNV-1a of the op name).
int64_t call_tag(const std::string& op) {
  uint64_t h = 1469598103934665603ull;
  for (const char ch : op) h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
  return static_cast<int64_t>(h);
}

}  // namespace

std::vector<std::vector<int64_t>> exchange_status(Group& group, const std::string& op, const LocalError& local,
                                                  const std::vector<int64_t>& fields, Stream stream) {
  const int R = group.size();
  // A binding's own argument error (core/binding_error.h) is the sentence the other ranks read, not
  // the rejection of the placeholder it passed in the bad argument's place.
  const detail::BindingError* binding = local.kind != LocalError::none ? detail::pending_binding_error() : nullptr;
  const std::string& published = binding ? binding->message : local.message;
  // The header [status, message length, call tag, field count] has one size in every call, so ranks that are
  // in different calls (one finalizes twice while a peer moves on to its next prepare) meet in it and say so,
  // instead of a collective's size mismatch (or a hang); the fields follow in a second all-gather.
  constexpr size_t n = 4;
  std::vector<int64_t> mine(n, 0), all(n * static_cast<size_t>(R));
  mine[0] = binding ? (binding->unsupported ? LocalError::unsupported : LocalError::invalid_argument) : local.kind;
  mine[1] = static_cast<int64_t>(published.size());
  mine[2] = call_tag(op);
  mine[3] = static_cast<int64_t>(fields.size());
  group.all_gather(mine.data(), all.data(), static_cast<int64_t>(n * sizeof(int64_t)), stream);
  for (int r = 1; r < R; ++r) {
    if (all[static_cast<size_t>(r) * n + 2] == all[2]) continue;
    // Name both calls where this rank can: the calls of one object share the op's prefix ("ll.").
    const std::string prefix = op.substr(0, op.rfind('.') + 1);
    auto name_of = [&](int q) {
      const int64_t t = all[static_cast<size_t>(q) * n + 2];
      for (const std::string& cand : {op, prefix + "prepare", prefix + "finalize"})
        if (call_tag(cand) == t) return cand;
      return std::string("another call");
    };
    throw InvalidArgument(op + ": the ranks are in different calls (" + name_of(0) + " on rank 0, " + name_of(r) + " on rank " +
                          std::to_string(r) + "): every rank makes the same sequence of calls on its object (each prepare, "
                          "then its finalize; also with T = 0)");
  }
  for (int r = 0; r < R; ++r)
    EPX_ASSERT(all[static_cast<size_t>(r) * n + 3] == mine[3], "exchange_status fields: ", all[static_cast<size_t>(r) * n + 3], " on rank ", r,
               " but ", mine[3], " here (", op, ")");

  int first_bad = -1;
  for (int r = 0; r < R && first_bad < 0; ++r)
    if (all[static_cast<size_t>(r) * n] != LocalError::none) first_bad = r;
  if (first_bad >= 0) {
    // Everyone learns the first failing rank's sentence, so every rank throws something useful.
    std::vector<int64_t> lens(static_cast<size_t>(R));
    int64_t total = 0, offset = 0;
    for (int r = 0; r < R; ++r) {
      lens[static_cast<size_t>(r)] = all[static_cast<size_t>(r) * n + 1];
      if (r < first_bad) offset += lens[static_cast<size_t>(r)];
      total += lens[static_cast<size_t>(r)];
    }
    std::string text(static_cast<size_t>(total), '\0');
    group.all_gatherv(published.data(), text.data(), lens, stream);
    if (local.kind != LocalError::none) throw_kind(local.kind, local.message);
    const auto kind = static_cast<LocalError::Kind>(all[static_cast<size_t>(first_bad) * n]);
    throw_kind(kind, op + ": rank " + std::to_string(first_bad) + " rejected its arguments: " +
                         text.substr(static_cast<size_t>(offset), static_cast<size_t>(lens[static_cast<size_t>(first_bad)])));
  }
  std::vector<std::vector<int64_t>> table(static_cast<size_t>(R));
  if (fields.empty()) return table;
  std::vector<int64_t> fall(fields.size() * static_cast<size_t>(R));
  group.all_gather(fields.data(), fall.data(), static_cast<int64_t>(fields.size() * sizeof(int64_t)), stream);
  for (int r = 0; r < R; ++r)
    table[static_cast<size_t>(r)].assign(fall.begin() + static_cast<int64_t>(static_cast<size_t>(r) * fields.size()),
                                         fall.begin() + static_cast<int64_t>(static_cast<size_t>(r + 1) * fields.size()));
  return table;
}

// ---- config -------------------------------------------------------------------------------------

bool uses_padded_blocks(const std::string& backend) {
  return backend == "naive" || backend == "allgather_reducescatter" || backend == "all2allv";
}

void validate_config(const std::string& backend, const DispatchConfig& cfg, int num_ranks) {
  const std::string op = backend + ".create";
  require_arg(op, "hidden", cfg.hidden, cfg.hidden > 0 && cfg.hidden % 8 == 0, "must be a positive multiple of 8 (16 bytes of bf16)");
  require_arg(op, "dispatch_dtype", dtype_name(cfg.dispatch_dtype),
              cfg.dispatch_dtype == DType::bf16 || cfg.dispatch_dtype == DType::fp8_e4m3, "must be bf16 or fp8_e4m3");
  if (cfg.dispatch_dtype == DType::fp8_e4m3)
    require_arg(op, "hidden", cfg.hidden, cfg.hidden % kFp8GroupSize == 0,
                "must be a multiple of 128 for fp8_e4m3 dispatch (one fp32 scale per 1x128 group)");
  require_arg(op, "num_experts", cfg.num_experts, cfg.num_experts >= 1, "must be >= 1");
  require_arg(op, "top_k", cfg.top_k, cfg.top_k >= 1, "must be >= 1");
  require_arg(op, "num_max_dispatch_tokens_per_rank", cfg.num_max_dispatch_tokens_per_rank, cfg.num_max_dispatch_tokens_per_rank >= 0,
              "must be >= 0 (0 = no limit, dynamic backends only)");
  require_arg(op, "expert_alignment", cfg.expert_alignment, cfg.expert_alignment >= 1, "must be >= 1");
  const auto mode = static_cast<int64_t>(cfg.ll_combine);
  require_arg(op, "ll_combine", mode, mode >= 0 && mode <= 2, "must be an LlCombine (0 column, 1 partial_fp32, 2 partial_bf16)");
  const auto flat = static_cast<int64_t>(cfg.flat_combine);
  require_arg(op, "flat_combine", flat, flat >= 0 && flat <= 1, "must be a FlatCombine (0 partial_fp32, 1 partial_bf16)");
  require_arg(op, "num_ranks", num_ranks, num_ranks >= 1, "must be >= 1");
  if (cfg.expert_contiguous)
    require_arg(op, "expert_contiguous", "true", backend == "ht", "is an ht option (the expert-contiguous layout of its Flat rows)");
  if (cfg.use_worst_case_sizing && uses_padded_blocks(backend))
    require_arg(op, "num_max_dispatch_tokens_per_rank", cfg.num_max_dispatch_tokens_per_rank, cfg.num_max_dispatch_tokens_per_rank >= 1,
                "must be >= 1 with use_worst_case_sizing (every rank's block has that many rows)");
  if (backend == "ht" && num_ranks >= 1 && cfg.num_experts >= 1 && cfg.top_k >= 1) {
    // ht's aligned per-expert counts (recv_count) and its expert-contiguous offsets are int32: the worst case
    // (what ht on CUDA sizes its layout for) must fit, or they wrap (2^30 over 4 experts wrote past the layout).
    // Without a capacity (0, CPU) the rows are unbounded here; the padding alone is still bounded.
    const int64_t L = (cfg.num_experts + num_ranks - 1) / num_ranks + (cfg.shared_route ? 1 : 0);
    int64_t rows = 0, pad = 0, worst = 0;
    const bool wraps = __builtin_mul_overflow(static_cast<int64_t>(num_ranks) * cfg.num_max_dispatch_tokens_per_rank,
                                              std::min<int64_t>(cfg.top_k, L), &rows) ||
                       __builtin_mul_overflow(L, static_cast<int64_t>(cfg.expert_alignment) - 1, &pad) ||
                       __builtin_add_overflow(rows, pad, &worst);
    if (wraps) worst = std::numeric_limits<int64_t>::max();
    require_arg(op, "expert_alignment", cfg.expert_alignment, worst <= std::numeric_limits<int32_t>::max(),
                "must keep the aligned rows R * num_max_dispatch_tokens_per_rank * min(top_k, L) + L * (expert_alignment - 1) = " +
                    std::to_string(worst) + " within int32 (L = " + std::to_string(L) +
                    " local experts; recv_count and the expert-contiguous offsets are int32)");
  }
}

InvalidArgument bad_topk_id(const std::string& op, const DispatchConfig& cfg, int64_t t, int64_t k, int64_t value) {
  const std::string E = std::to_string(cfg.num_experts), K = std::to_string(cfg.top_k), last = std::to_string(cfg.top_k - 1);
  std::string rule;
  if (!cfg.shared_route) {
    rule = detail::topk_id_rule(cfg.num_experts);
  } else if (k == cfg.top_k - 1) {
    rule = "must be num_experts = " + E + " (the shared route) or -1 (shared expert not fused): with shared_route the last of the top_k = " +
           K + " columns is the shared expert's" + (value >= 0 && value < cfg.num_experts ? ", not a routed expert's" : "");
  } else {
    rule = "must be -1 (no selection) or a routed expert id in [0, num_experts = " + E + "): with shared_route, num_experts = " + E +
           " (the shared route) belongs in the last column (k = " + last + ") only";
  }
  return InvalidArgument(arg_message(op, detail::topk_elem("topk_idx", t, k), value, rule));
}

// ---- PrepareFinalizeBase ------------------------------------------------------------------------

PrepareFinalizeBase::PrepareFinalizeBase(const std::string& name, ActivationLayout layout, bool static_buffers,
                                         std::shared_ptr<Group> group, const DispatchConfig& cfg)
    : group_(std::move(group)), cfg_(cfg) {
  caps_.name = name;
  caps_.layout = layout;
  caps_.graph_safe = static_buffers;
  caps_.supports_fp8_dispatch = true;
  caps_.static_buffers = static_buffers;
  num_ranks_ = group_->size();
  rank_ = group_->rank();
  placement_ = {cfg_.num_experts, num_ranks_, cfg_.shared_route};
  num_local_ = num_local_experts(cfg_, num_ranks_, rank_);
  op_prepare_ = name + ".prepare";
  op_finalize_ = name + ".finalize";
  padded_ = cfg_.use_worst_case_sizing && uses_padded_blocks(name);
  if (padded_) {
    caps_.graph_safe = true;
    accepts_device_num_tokens_ = true;
  }
}

std::string PrepareFinalizeBase::wrong_device(const std::string& op, const std::string& arg, Device device) const {
  const Device dev = group_->device();
  return op + ": " + arg + " is on " + device.str() + " but the group runs on " + dev.str() + ": " +
         (dev.is_cpu() ? "the CPU backends move host memory only" : "the CUDA backends move memory of the group's GPU only");
}

std::optional<std::string> PrepareFinalizeBase::why_unsupported(const DispatchArgs& args) const {
  const Device dev = group_->device();
  for (const auto& [arg, t] : {std::pair<const char*, const TensorView*>{"x", &args.x}, {"topk_idx", &args.topk_idx},
                               {"topk_weights", &args.topk_weights}}) {
    if (t->device != dev) return wrong_device(op_prepare_, arg, t->device);
  }
  return std::nullopt;
}

LocalError PrepareFinalizeBase::check_args(const DispatchArgs& a) const {
  if (auto why = why_unsupported(a)) return {LocalError::unsupported, *why};
  const std::string& op = op_prepare_;
  try {
    check_dtype(op, "x", a.x, {DType::bf16});
    require_arg(op, "x.ndim", a.x.ndim, a.x.ndim == 2, "must be 2 ([T, H])");
    require_arg(op, "x.shape[1]", a.x.shape[1], a.x.shape[1] == cfg_.hidden, "must equal hidden = " + std::to_string(cfg_.hidden));
    check_contiguous(op, "x", a.x);
    const int64_t T = a.x.shape[0];
    const int cap = cfg_.num_max_dispatch_tokens_per_rank;
    if (cap > 0)
      require_arg(op, "num_tokens", T, T <= cap,
                  "must be <= num_max_dispatch_tokens_per_rank = " + std::to_string(cap) + " (fixed at create; split the batch)");
    const int K = cfg_.top_k;
    check_dtype(op, "topk_idx", a.topk_idx, {DType::int32, DType::int64});
    if (cfg_.shared_route) {
      // FHMoE routes: exactly K+1 = top_k columns, the shared route last (issue 6); the values are
      // checked per column by Placement::valid_id (bad_topk_id names the rule).
      for (const auto& [arg, t] : {std::pair<const char*, const TensorView*>{"topk_idx", &a.topk_idx}, {"topk_weights", &a.topk_weights}}) {
        if (t->ndim == 2)
          require_arg(op, std::string(arg) + ".shape[1]", t->shape[1], t->shape[1] == K,
                      "must equal top_k = " + std::to_string(K) + " with shared_route: " + std::to_string(K - 1) +
                          " routed columns, then the shared route column (id num_experts = " + std::to_string(cfg_.num_experts) + ")");
      }
    }
    check_shape_vec(op, "topk_idx", a.topk_idx, {T, K});
    check_contiguous(op, "topk_idx", a.topk_idx);
    check_dtype(op, "topk_weights", a.topk_weights, {DType::fp32});
    check_shape_vec(op, "topk_weights", a.topk_weights, {T, K});
    check_contiguous(op, "topk_weights", a.topk_weights);
    if (a.num_tokens.defined()) {
      require_arg(op, "num_tokens", a.num_tokens.describe(), accepts_device_num_tokens_,
                  "must be empty for backend " + caps_.name + " on " + group_->device().str() +
                      " (a token count on the device is read by ll and ht on CUDA and by the padded naive, "
                      "allgather_reducescatter and all2allv (use_worst_case_sizing); pass x with T rows)");
      if (padded_) {
        if (a.num_tokens.device != group_->device()) throw Unsupported(wrong_device(op, "num_tokens", a.num_tokens.device));
        check_dtype(op, "num_tokens", a.num_tokens, {DType::int32});
        require_arg(op, "num_tokens.numel", a.num_tokens.numel(), a.num_tokens.numel() == 1, "must be 1 ([1] int32 on the group's device)");
      }
    }
  } catch (const Unsupported& e) {
    return {LocalError::unsupported, e.what()};
  } catch (const InvalidArgument& e) {
    return {LocalError::invalid_argument, e.what()};
  }
  return {};
}

void PrepareFinalizeBase::begin_finalize(const FinalizeArgs& a, const std::vector<int64_t>& expert_out_shape, Stream stream) {
  const LocalError err = check_finalize(a, expert_out_shape);
  exchange_status(*group_, op_finalize_, err, {}, stream);
  stats_.remote_bytes_combine = 0;
}

LocalError PrepareFinalizeBase::check_finalize(const FinalizeArgs& a, const std::vector<int64_t>& expert_out_shape) const {
  LocalError err;
  const std::string& op = op_finalize_;
  try {
    if (!prepared_) throw InvalidArgument(op + ": no prepare to finalize: every rank calls prepare first (also with T = 0)");
    for (const auto& [arg, t] : {std::pair<const char*, const TensorView*>{"expert_out", &a.expert_out}, {"out", &a.out}}) {
      if (t->device != group_->device()) throw Unsupported(wrong_device(op, arg, t->device));
    }
    const DType partial = caps_.layout == ActivationLayout::Flat ? partial_dtype() : DType::bf16;
    if (a.expert_out.dtype != partial)
      require_arg(op, "expert_out.dtype", dtype_name(a.expert_out.dtype), false,
                  "must be " + std::string(dtype_name(partial)) +
                      (caps_.layout == ActivationLayout::Flat
                           ? std::string(" (flat_combine = ") + flat_combine_name(cfg_.flat_combine) + ")"
                           : std::string(" (the experts' unweighted rows)")));
    check_shape_vec(op, "expert_out", a.expert_out, expert_out_shape);
    check_contiguous(op, "expert_out", a.expert_out);
    check_dtype(op, "out", a.out, {DType::bf16});
    check_shape_vec(op, "out", a.out, {prepared_tokens_, cfg_.hidden});
    check_contiguous(op, "out", a.out);
    if (a.addend.defined()) {
      require_arg(op, "addend", a.addend.describe(), caps_.combine_addend,
                  "must be empty for backend " + caps_.name + " (Capabilities::combine_addend = false)");
      if (a.addend.device != group_->device()) throw Unsupported(wrong_device(op, "addend", a.addend.device));
      check_dtype(op, "addend", a.addend, {DType::fp32});
      check_shape_vec(op, "addend", a.addend, {prepared_tokens_, cfg_.hidden});
      check_contiguous(op, "addend", a.addend);
    }
    if (a.topk_weights.defined())
      require_arg(op, "topk_weights", a.topk_weights.describe(), false,
                  "must be empty for backend " + caps_.name +
                      " (combine weights apply to ht's expert-contiguous layout; here Experts::apply weights the rows)");
  } catch (const Unsupported& e) {
    err = {LocalError::unsupported, e.what()};
  } catch (const InvalidArgument& e) {
    err = {LocalError::invalid_argument, e.what()};
  }
  return err;
}

}  // namespace epx::dispatch
