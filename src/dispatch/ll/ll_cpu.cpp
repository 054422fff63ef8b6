#include <cstring>

#include "dispatch/backends.h"
#include "dispatch/ll/ll.h"
#include "epx/quant.h"

namespace epx::dispatch {
namespace {

uint8_t* at(void* base, int64_t offset) { return static_cast<uint8_t*>(base) + offset; }
uint64_t* signal(void* base, int64_t offset) { return reinterpret_cast<uint64_t*>(at(base, offset)); }

}  // namespace

LlCpu::LlCpu(std::shared_ptr<Group> group, const DispatchConfig& cfg)
    : CpuPrepareFinalize("ll", ActivationLayout::ExpertMajor, true, std::move(group), cfg) {
  caps_.combine_addend = true;
  require_arg("ll.create", "num_max_dispatch_tokens_per_rank", cfg.num_max_dispatch_tokens_per_rank,
              cfg.num_max_dispatch_tokens_per_rank > 0, "must be > 0 (LL buffers are sized by it)");
  layout_ = ll_layout(cfg_, num_ranks_);
  buffer_ = group_->alloc_symmetric(layout_.total_bytes());
  const int64_t L = num_local_, cap = static_cast<int64_t>(num_ranks_) * cfg.num_max_dispatch_tokens_per_rank, H = cfg.hidden;
  x_ = Tensor::zeros({L, cap, H}, layout_.use_fp8 ? DType::fp8_e4m3 : DType::bf16);
  if (layout_.use_fp8) x_scales_ = Tensor::zeros({L, cap, H / kFp8GroupSize}, DType::fp32);
  recv_count_ = Tensor::zeros({L}, DType::int32);
  handle_.src_rank = Tensor::zeros({L, cap}, DType::int32);
  handle_.src_token = Tensor::zeros({L, cap}, DType::int32);
  handle_.topk_column = Tensor::zeros({L, cap}, DType::int32);
  handle_.layout_range = Tensor::zeros({L, num_ranks_}, DType::int64);
  const int64_t R = num_ranks_, max_t = cfg.num_max_dispatch_tokens_per_rank, K = cfg.top_k;
  handle_.msg_count = Tensor::zeros({R}, DType::int32);
  handle_.msg_src_token = Tensor::zeros({R, max_t}, DType::int32);
  handle_.msg_rows = Tensor::zeros({R, max_t, K}, DType::int32);
  handle_.msg_weights = Tensor::zeros({R, max_t, K}, DType::fp32);
}

PrepareResult LlCpu::prepare(const DispatchArgs& args) {
  Routing routing;
  // The status exchange also orders this call after every peer finished reading the buffers of
  // the previous call.
  begin_prepare(args, routing, 0, [](const Routing&) { return std::vector<int64_t>{}; });
  const LlLayout& lay = layout_;
  const int64_t T = routing.num_tokens, H = lay.hidden, msg = lay.msg_bytes();
  const int K = lay.top_k;
  const int parity = static_cast<int>(dispatch_calls_ % 2);
  idx_ = routing.idx;
  weights_.assign(routing.weights, routing.weights + T * K);
  first_col_.assign(static_cast<size_t>(T * K), -1);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int32_t id = routing.at(t, k);
      if (id < 0) continue;
      int first = k;
      for (int c = 0; c < k; ++c)
        if (routing.at(t, c) == id) { first = c; break; }
      first_col_[static_cast<size_t>(t * K + k)] = first;
    }

  // 1. Send: build each token's message once (one quantization), copy it to every destination rank.
  std::vector<uint8_t> staging(static_cast<size_t>(msg), 0);
  std::vector<float> row_f32(lay.use_fp8 ? static_cast<size_t>(H) : 0);
  std::vector<int32_t> num_sent(static_cast<size_t>(num_ranks_), 0);
  std::vector<uint8_t> in_rank;
  dest_mask_.assign(static_cast<size_t>(T), 0);
  const uint16_t* xb = args.x.ptr<const uint16_t>();
  for (int64_t t = 0; t < T; ++t) {
    token_dest_ranks(routing, t, in_rank);
    const int32_t header[4] = {static_cast<int32_t>(t), 0, 0, 0};
    std::memcpy(staging.data(), header, sizeof(header));
    std::memcpy(staging.data() + lay.msg_topk_offset(), routing.idx.data() + t * K, 4 * static_cast<size_t>(K));
    if (lay.partial()) std::memcpy(staging.data() + lay.msg_weights_offset(), routing.weights + t * K, 4 * static_cast<size_t>(K));
    if (lay.use_fp8) {
      for (int64_t i = 0; i < H; ++i) row_f32[static_cast<size_t>(i)] = bf16_bits_to_float(xb[t * H + i]);
      quantize_fp8_row(row_f32.data(), H, staging.data() + lay.msg_payload_offset(),
                       reinterpret_cast<float*>(staging.data() + lay.msg_scales_offset()), kFp8GroupSize, cfg_.use_ue8m0);
    } else {
      std::memcpy(staging.data() + lay.msg_payload_offset(), xb + t * H, static_cast<size_t>(2 * H));
    }
    uint32_t mask = 0;
    for (int d = 0; d < num_ranks_; ++d) {
      if (!in_rank[static_cast<size_t>(d)]) continue;
      mask |= 1u << d;
      const int slot = num_sent[static_cast<size_t>(d)]++;
      std::memcpy(at(buffer_.peers[static_cast<size_t>(d)], lay.dispatch_msg_offset(parity, rank_, slot)), staging.data(), static_cast<size_t>(msg));
      if (d != rank_) stats_.remote_bytes_dispatch += msg;
    }
    dest_mask_[static_cast<size_t>(t)] = mask;
  }
  // The count, then the flag of the one "send block" of the CPU (the CUDA kernels' protocol).
  for (int d = 0; d < num_ranks_; ++d) {
    void* peer = buffer_.peers[static_cast<size_t>(d)];
    *signal(peer, lay.dispatch_count_offset(parity, rank_)) = static_cast<uint64_t>(num_sent[static_cast<size_t>(d)]);
    *signal(peer, lay.dispatch_flag_offset(rank_, 0)) = dispatch_calls_ + 1;
  }
  group_->barrier();
  ++dispatch_calls_;

  // 2. Receive: expand each message into one slot per distinct local expert, sources in rank order.
  int32_t* counts = recv_count_.ptr<int32_t>();
  std::memset(counts, 0, sizeof(int32_t) * static_cast<size_t>(num_local_));
  const int64_t cap = x_.size(1), scale_groups = H / kFp8GroupSize;
  int64_t* range = handle_.layout_range.ptr<int64_t>();
  std::vector<int32_t> ids(static_cast<size_t>(K));
  for (int s = 0; s < num_ranks_; ++s) {
    EPX_ASSERT(*signal(buffer_.local, lay.dispatch_flag_offset(s, 0)) == dispatch_calls_, "ll.prepare: dispatch_flag from rank ", s,
               " = ", *signal(buffer_.local, lay.dispatch_flag_offset(s, 0)), " after ", dispatch_calls_, " calls");
    const int64_t n = static_cast<int64_t>(*signal(buffer_.local, lay.dispatch_count_offset(parity, s)));
    EPX_ASSERT(n >= 0 && n <= lay.max_tokens, "ll.prepare: dispatch_count from rank ", s, " = ", n);
    std::vector<int32_t> begin(counts, counts + num_local_);
    if (lay.partial()) handle_.msg_count.ptr<int32_t>()[s] = static_cast<int32_t>(n);
    for (int j = 0; j < n; ++j) {
      const uint8_t* m = at(buffer_.local, lay.dispatch_msg_offset(parity, s, j));
      int32_t src_token = 0;
      std::memcpy(&src_token, m, 4);
      std::memcpy(ids.data(), m + lay.msg_topk_offset(), 4 * static_cast<size_t>(K));
      const int64_t mi = (static_cast<int64_t>(s) * lay.max_tokens + j) * K;  // partial modes' handle
      if (lay.partial()) {
        handle_.msg_src_token.ptr<int32_t>()[static_cast<int64_t>(s) * lay.max_tokens + j] = src_token;
        std::memcpy(handle_.msg_weights.ptr<float>() + mi, m + lay.msg_weights_offset(), 4 * static_cast<size_t>(K));
        for (int k = 0; k < K; ++k) handle_.msg_rows.ptr<int32_t>()[mi + k] = -1;
      }
      for (int k = 0; k < K; ++k) {
        const int l = local_index(ids[static_cast<size_t>(k)], s, rank_);
        if (l < 0) continue;
        int first = k;
        for (int c = 0; c < k && first == k; ++c)
          if (ids[static_cast<size_t>(c)] == ids[static_cast<size_t>(k)]) first = c;
        if (first != k) {  // a duplicate: its column shares the first column's row
          if (lay.partial()) handle_.msg_rows.ptr<int32_t>()[mi + k] = handle_.msg_rows.ptr<int32_t>()[mi + first];
          continue;
        }
        const int64_t slot = counts[l]++;
        const int64_t row = l * cap + slot;
        if (lay.partial()) handle_.msg_rows.ptr<int32_t>()[mi + k] = static_cast<int32_t>(row);
        std::memcpy(at(x_.data(), row * lay.payload_bytes()), m + lay.msg_payload_offset(), static_cast<size_t>(lay.payload_bytes()));
        if (lay.use_fp8)
          std::memcpy(x_scales_.ptr<float>() + row * scale_groups, m + lay.msg_scales_offset(), static_cast<size_t>(lay.scale_bytes()));
        handle_.src_rank.ptr<int32_t>()[row] = s;
        handle_.src_token.ptr<int32_t>()[row] = src_token;
        handle_.topk_column.ptr<int32_t>()[row] = k;
      }
    }
    for (int l = 0; l < num_local_; ++l)
      range[l * num_ranks_ + s] = (static_cast<int64_t>(begin[static_cast<size_t>(l)]) << 32) | (counts[l] - begin[static_cast<size_t>(l)]);
  }

  PrepareResult res;
  res.layout = ActivationLayout::ExpertMajor;
  res.x = x_.view();
  res.x_scales = x_scales_.view();
  res.recv_count = recv_count_.view();
  for (int l = 0; l < num_local_; ++l) res.num_recv_tokens += counts[l];
  return res;
}

void LlCpu::finalize(const FinalizeArgs& args) {
  const LlLayout& lay = layout_;
  const int64_t H = lay.hidden, cap = x_.size(1);
  const int K = lay.top_k;
  begin_finalize(args, {num_local_, cap, H});
  const int parity = static_cast<int>(combine_calls_ % 2);
  const uint16_t* y = args.expert_out.ptr<const uint16_t>();
  const int64_t T = prepared_tokens_;
  uint16_t* out = args.out.ptr<uint16_t>();
  const float* addend = args.addend.defined() ? args.addend.ptr<const float>() : nullptr;  // joins before the rounding
  std::vector<float> acc(static_cast<size_t>(H));

  if (lay.partial()) {
    // 1. Per received message: this rank's experts' weighted rows summed in column order (fp32), one
    //    row per (token, this rank) to the source; bf16 partials are rounded here.
    const int32_t* rows = handle_.msg_rows.ptr<const int32_t>();
    const float* w = handle_.msg_weights.ptr<const float>();
    for (int s = 0; s < num_ranks_ && num_local_ > 0; ++s) {
      const int n = handle_.msg_count.ptr<const int32_t>()[s];
      for (int j = 0; j < n; ++j) {
        const int64_t mi = (static_cast<int64_t>(s) * lay.max_tokens + j) * K;
        const int t = handle_.msg_src_token.ptr<const int32_t>()[static_cast<int64_t>(s) * lay.max_tokens + j];
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int k = 0; k < K; ++k) {
          const int32_t row = rows[mi + k];
          if (row < 0) continue;
          for (int64_t i = 0; i < H; ++i) acc[static_cast<size_t>(i)] += w[mi + k] * bf16_bits_to_float(y[row * H + i]);
        }
        uint8_t* dst = at(buffer_.peers[static_cast<size_t>(s)], lay.combine_partial_offset(parity, t, rank_));
        if (lay.combine == static_cast<int>(LlCombine::partial_fp32)) {
          std::memcpy(dst, acc.data(), static_cast<size_t>(4 * H));
        } else {
          for (int64_t i = 0; i < H; ++i) reinterpret_cast<uint16_t*>(dst)[i] = float_to_bf16_bits(acc[static_cast<size_t>(i)]);
        }
        if (s != rank_) stats_.remote_bytes_combine += lay.partial_row_bytes();
      }
    }
    for (int d = 0; d < num_ranks_; ++d) *signal(buffer_.peers[static_cast<size_t>(d)], lay.combine_flag_offset(rank_, 0)) = combine_calls_ + 1;
    group_->barrier();
    ++combine_calls_;
    // 2. The ranks' partials in rank order, fp32, one rounding.
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int r = 0; r < num_ranks_; ++r) {
        if (!((dest_mask_[static_cast<size_t>(t)] >> r) & 1u)) continue;
        const uint8_t* src = at(buffer_.local, lay.combine_partial_offset(parity, static_cast<int>(t), r));
        for (int64_t i = 0; i < H; ++i) {
          const float v = lay.combine == static_cast<int>(LlCombine::partial_fp32) ? reinterpret_cast<const float*>(src)[i]
                                                                                 : bf16_bits_to_float(reinterpret_cast<const uint16_t*>(src)[i]);
          acc[static_cast<size_t>(i)] += v;
        }
      }
      if (addend)
        for (int64_t i = 0; i < H; ++i) acc[static_cast<size_t>(i)] += addend[t * H + i];
      for (int64_t i = 0; i < H; ++i) out[t * H + i] = float_to_bf16_bits(acc[static_cast<size_t>(i)]);
    }
    return;
  }

  // 1. Every slot's (unweighted) expert output goes back to its source's combine region.
  const int32_t* counts = recv_count_.ptr<const int32_t>();
  for (int l = 0; l < num_local_; ++l)
    for (int64_t j = 0; j < counts[l]; ++j) {
      const int64_t row = l * cap + j;
      const int s = handle_.src_rank.ptr<const int32_t>()[row];
      const int t = handle_.src_token.ptr<const int32_t>()[row];
      const int k = handle_.topk_column.ptr<const int32_t>()[row];
      std::memcpy(at(buffer_.peers[static_cast<size_t>(s)], lay.combine_row_offset(parity, t, k)), y + row * H, static_cast<size_t>(2 * H));
      if (s != rank_) stats_.remote_bytes_combine += 2 * H;
    }
  for (int d = 0; d < num_ranks_; ++d) *signal(buffer_.peers[static_cast<size_t>(d)], lay.combine_flag_offset(rank_, 0)) = combine_calls_ + 1;
  group_->barrier();
  ++combine_calls_;

  // 2. Weighted sum in column order, fp32, one rounding (select, not multiply: -1 columns are skipped).
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      const int first = first_col_[static_cast<size_t>(t * K + k)];
      if (first < 0) continue;
      const float w = weights_[static_cast<size_t>(t * K + k)];
      const uint16_t* row = reinterpret_cast<const uint16_t*>(at(buffer_.local, lay.combine_row_offset(parity, static_cast<int>(t), first)));
      for (int64_t i = 0; i < H; ++i) acc[static_cast<size_t>(i)] += w * bf16_bits_to_float(row[i]);
    }
    if (addend)
      for (int64_t i = 0; i < H; ++i) acc[static_cast<size_t>(i)] += addend[t * H + i];
    for (int64_t i = 0; i < H; ++i) out[t * H + i] = float_to_bf16_bits(acc[static_cast<size_t>(i)]);
  }
}

std::unique_ptr<PrepareFinalize> make_ll_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<LlCpu>(std::move(group), cfg);
}

}  // namespace epx::dispatch
