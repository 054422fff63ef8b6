#include "dispatch/prepare_finalize_cpu.h"

#include <algorithm>
#include <cstring>

#include "epx/quant.h"

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

// ---- RowCodec -----------------------------------------------------------------------------------

void RowCodec::encode(const TensorView& x, const Routing& routing, std::vector<uint8_t>& rows) const {
  const int64_t T = routing.num_tokens, rb = row_bytes();
  rows.resize(static_cast<size_t>(T * rb));
  std::vector<float> row_f32(use_fp8 ? static_cast<size_t>(hidden) : 0);
  const uint16_t* xb = x.ptr<const uint16_t>();
  for (int64_t t = 0; t < T; ++t) {
    uint8_t* dst = rows.data() + t * rb;
    const uint16_t* src = xb + t * hidden;
    if (use_fp8) {
      for (int64_t i = 0; i < hidden; ++i) row_f32[static_cast<size_t>(i)] = bf16_bits_to_float(src[i]);
      quantize_fp8_row(row_f32.data(), hidden, dst, reinterpret_cast<float*>(dst + payload_bytes()), kFp8GroupSize, use_ue8m0);
    } else {
      std::memcpy(dst, src, static_cast<size_t>(2 * hidden));
    }
    uint8_t* tail = dst + payload_bytes() + scale_bytes();
    std::memcpy(tail, routing.idx.data() + t * top_k, 4 * static_cast<size_t>(top_k));
    std::memcpy(tail + 4 * top_k, routing.weights + t * top_k, 4 * static_cast<size_t>(top_k));
    const int32_t token = static_cast<int32_t>(t);
    std::memcpy(tail + 8 * top_k, &token, 4);
  }
}

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

std::vector<std::vector<int64_t>> exchange_status(Group& group, const std::string& op, const LocalError& local,
                                                  const std::vector<int64_t>& fields) {
  const int R = group.size();
  const size_t n = 2 + fields.size();
  std::vector<int64_t> mine(n, 0), all(n * static_cast<size_t>(R));
  mine[0] = local.kind;
  mine[1] = static_cast<int64_t>(local.message.size());
  std::copy(fields.begin(), fields.end(), mine.begin() + 2);
  group.all_gather(mine.data(), all.data(), static_cast<int64_t>(n * sizeof(int64_t)));

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
    group.all_gatherv(local.message.data(), text.data(), lens);
    if (local.kind != LocalError::none) throw_kind(local.kind, local.message);
    const auto kind = static_cast<LocalError::Kind>(all[static_cast<size_t>(first_bad) * n]);
    throw_kind(kind, op + ": rank " + std::to_string(first_bad) + " rejected its arguments: " +
                         text.substr(static_cast<size_t>(offset), static_cast<size_t>(lens[static_cast<size_t>(first_bad)])));
  }
  std::vector<std::vector<int64_t>> table(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r)
    table[static_cast<size_t>(r)].assign(all.begin() + static_cast<int64_t>(r * n + 2), all.begin() + static_cast<int64_t>((r + 1) * n));
  return table;
}

// ---- config -------------------------------------------------------------------------------------

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
  require_arg(op, "num_ranks", num_ranks, num_ranks >= 1, "must be >= 1");
}

// ---- CpuPrepareFinalize -------------------------------------------------------------------------

CpuPrepareFinalize::CpuPrepareFinalize(const std::string& name, ActivationLayout layout, bool static_buffers,
                                       std::shared_ptr<Group> group, const DispatchConfig& cfg)
    : group_(std::move(group)), cfg_(cfg) {
  caps_.name = name;
  caps_.layout = layout;
  caps_.graph_safe = static_buffers;
  caps_.supports_fp8_dispatch = true;
  caps_.static_buffers = static_buffers;
  num_ranks_ = group_->size();
  rank_ = group_->rank();
  num_local_ = num_local_experts(cfg_, num_ranks_, rank_);
  op_prepare_ = name + ".prepare";
  op_finalize_ = name + ".finalize";
}

std::optional<std::string> CpuPrepareFinalize::why_unsupported(const DispatchArgs& args) const {
  const Device dev = group_->device();
  for (const auto& [arg, t] : {std::pair<const char*, const TensorView*>{"x", &args.x}, {"topk_idx", &args.topk_idx},
                               {"topk_weights", &args.topk_weights}}) {
    if (t->device != dev)
      return op_prepare_ + ": " + arg + " is on " + t->device.str() + " but the group runs on " + dev.str() +
             ": the CPU backends move host memory only";
  }
  return std::nullopt;
}

LocalError CpuPrepareFinalize::check_prepare(const DispatchArgs& a, Routing& routing) const {
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
    check_shape_vec(op, "topk_idx", a.topk_idx, {T, K});
    check_contiguous(op, "topk_idx", a.topk_idx);
    check_dtype(op, "topk_weights", a.topk_weights, {DType::fp32});
    check_shape_vec(op, "topk_weights", a.topk_weights, {T, K});
    check_contiguous(op, "topk_weights", a.topk_weights);

    const int64_t max_id = cfg_.shared_route ? cfg_.num_experts : cfg_.num_experts - 1;
    routing.num_tokens = T;
    routing.top_k = K;
    routing.idx.resize(static_cast<size_t>(T * K));
    routing.weights = a.topk_weights.ptr<const float>();
    const bool is_i64 = a.topk_idx.dtype == DType::int64;
    for (int64_t i = 0; i < T * K; ++i) {
      const int64_t v = is_i64 ? a.topk_idx.ptr<const int64_t>()[i] : a.topk_idx.ptr<const int32_t>()[i];
      if (v < -1 || v > max_id) {
        const std::string rule = cfg_.shared_route
                                     ? "must be -1 (no selection), an expert id in [0, num_experts) or num_experts = " +
                                           std::to_string(cfg_.num_experts) + " (shared route)"
                                     : "must be -1 (no selection) or an expert id in [0, num_experts = " + std::to_string(cfg_.num_experts) + ")";
        throw InvalidArgument(arg_message(op, "topk_idx[" + std::to_string(i / K) + ", " + std::to_string(i % K) + "]", v, rule));
      }
      routing.idx[static_cast<size_t>(i)] = static_cast<int32_t>(v);
    }
  } catch (const InvalidArgument& e) {
    return {LocalError::invalid_argument, e.what()};
  }
  return {};
}

void CpuPrepareFinalize::begin_finalize(const FinalizeArgs& a, const std::vector<int64_t>& expert_out_shape) {
  LocalError err;
  const std::string& op = op_finalize_;
  try {
    if (!prepared_) throw InvalidArgument(op + ": no prepare to finalize: every rank calls prepare first (also with T = 0)");
    for (const auto& [arg, t] : {std::pair<const char*, const TensorView*>{"expert_out", &a.expert_out}, {"out", &a.out}}) {
      if (t->device != group_->device())
        throw Unsupported(op + ": " + arg + " is on " + t->device.str() + " but the group runs on " + group_->device().str() +
                          ": the CPU backends move host memory only");
    }
    check_dtype(op, "expert_out", a.expert_out, {DType::bf16});
    check_shape_vec(op, "expert_out", a.expert_out, expert_out_shape);
    check_contiguous(op, "expert_out", a.expert_out);
    check_dtype(op, "out", a.out, {DType::bf16});
    check_shape_vec(op, "out", a.out, {prepared_tokens_, cfg_.hidden});
    check_contiguous(op, "out", a.out);
  } catch (const Unsupported& e) {
    err = {LocalError::unsupported, e.what()};
  } catch (const InvalidArgument& e) {
    err = {LocalError::invalid_argument, e.what()};
  }
  exchange_status(*group_, op, err, {});
  stats_.remote_bytes_combine = 0;
}

int CpuPrepareFinalize::dest_rank(int32_t id, int src_rank) const {
  if (id < 0) return -1;
  if (id == cfg_.num_experts) return src_rank;  // shared route: the source's own replica
  return expert_rank(cfg_.num_experts, num_ranks_, id);
}

int CpuPrepareFinalize::local_index(int32_t id, int src_rank, int dst_rank) const {
  if (id < 0) return -1;
  if (id == cfg_.num_experts) return src_rank == dst_rank ? num_local_experts(cfg_, num_ranks_, dst_rank) - 1 : -1;
  const ExpertRange range = expert_range(cfg_.num_experts, num_ranks_, dst_rank);
  return id >= range.begin && id < range.end ? id - range.begin : -1;
}

void CpuPrepareFinalize::token_dest_ranks(const Routing& routing, int64_t t, std::vector<uint8_t>& is_in_rank) const {
  is_in_rank.assign(static_cast<size_t>(num_ranks_), 0);
  for (int k = 0; k < routing.top_k; ++k) {
    const int d = dest_rank(routing.at(t, k), rank_);
    if (d >= 0) is_in_rank[static_cast<size_t>(d)] = 1;
  }
}

void CpuPrepareFinalize::count_selections(const Routing& routing) {
  stats_ = {};
  std::vector<uint8_t> in_rank;
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    for (int k = 0; k < routing.top_k; ++k) stats_.num_valid_selections += routing.at(t, k) >= 0;
    token_dest_ranks(routing, t, in_rank);
    for (uint8_t f : in_rank) stats_.num_rank_dedup_rows += f;
  }
}

void CpuPrepareFinalize::decode_flat(const uint8_t* rows, int64_t num_rows, const std::vector<int>& src_rank, FlatRecv& out) const {
  const RowCodec c = codec();
  const int64_t H = c.hidden, rb = c.row_bytes();
  const int K = c.top_k;
  out.x = Tensor::empty({num_rows, H}, c.use_fp8 ? DType::fp8_e4m3 : DType::bf16);
  out.x_scales = c.use_fp8 ? Tensor::empty({num_rows, H / kFp8GroupSize}, DType::fp32) : Tensor();
  out.topk_idx = Tensor::empty({num_rows, K}, DType::int32);
  out.topk_weights = Tensor::empty({num_rows, K}, DType::fp32);
  out.recv_count = Tensor::zeros({num_local_}, DType::int32);
  out.src_token.resize(static_cast<size_t>(num_rows));
  int32_t* counts = out.recv_count.ptr<int32_t>();
  std::vector<int64_t> last_row(static_cast<size_t>(num_local_), -1);  // a duplicate expert counts its row once
  for (int64_t n = 0; n < num_rows; ++n) {
    const uint8_t* row = rows + n * rb;
    std::memcpy(static_cast<uint8_t*>(out.x.data()) + n * c.payload_bytes(), row, static_cast<size_t>(c.payload_bytes()));
    if (c.use_fp8)
      std::memcpy(static_cast<uint8_t*>(out.x_scales.data()) + n * c.scale_bytes(), row + c.payload_bytes(),
                  static_cast<size_t>(c.scale_bytes()));
    const uint8_t* tail = row + c.payload_bytes() + c.scale_bytes();
    int32_t* idx = out.topk_idx.ptr<int32_t>() + n * K;
    std::memcpy(idx, tail, 4 * static_cast<size_t>(K));
    std::memcpy(out.topk_weights.ptr<float>() + n * K, tail + 4 * K, 4 * static_cast<size_t>(K));
    std::memcpy(&out.src_token[static_cast<size_t>(n)], tail + 8 * K, 4);
    for (int k = 0; k < K; ++k) {
      const int l = local_index(idx[k], src_rank[static_cast<size_t>(n)], rank_);
      idx[k] = l;
      if (l >= 0 && last_row[static_cast<size_t>(l)] != n) {
        last_row[static_cast<size_t>(l)] = n;
        ++counts[l];
      }
    }
  }
}

void CpuPrepareFinalize::sum_partials_bf16(const std::vector<const uint16_t*>& partials, int64_t hidden, uint16_t* out) {
  for (int64_t i = 0; i < hidden; ++i) {
    float acc = 0.0f;
    for (const uint16_t* p : partials)
      if (p) acc += bf16_bits_to_float(p[i]);
    out[i] = float_to_bf16_bits(acc);
  }
}

}  // namespace epx::dispatch
