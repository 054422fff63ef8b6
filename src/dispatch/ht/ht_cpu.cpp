#include "dispatch/ht/ht.h"

#include <algorithm>
#include <cstring>

#include "dispatch/backends.h"

namespace epx::dispatch {

PrepareResult HtCpu::prepare(const DispatchArgs& args) {
  PrepareResult res = DedupCpu::prepare(args);
  const int R = num_ranks_;
  handle_.num_ranks = R;
  handle_.rank_prefix_matrix.assign(static_cast<size_t>(R * R), 0);
  for (int d = 0; d < R; ++d) {
    int64_t acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += count_matrix_[static_cast<size_t>(s)][static_cast<size_t>(d)];
      handle_.rank_prefix_matrix[static_cast<size_t>(s * R + d)] = static_cast<int32_t>(acc);
    }
  }
  handle_.is_token_in_rank = is_token_in_rank_;
  handle_.recv_src_rank.assign(recv_src_rank_.begin(), recv_src_rank_.end());
  handle_.recv_src_idx = recv_.src_token;
  const int64_t align = cfg_.expert_alignment;
  int32_t* counts = recv_.recv_count.ptr<int32_t>();
  for (int l = 0; l < num_local_; ++l) counts[l] = static_cast<int32_t>((counts[l] + align - 1) / align * align);
  handle_.num_recv_tokens_per_expert.assign(counts, counts + num_local_);
  handle_.layout_cache_hits = layout_cache_hits_;
  if (cfg_.expert_contiguous) {
    // Expert-contiguous copy of the Flat rows (ht.h).
    const int64_t N = recv_.x.size(0), H = cfg_.hidden, K = cfg_.top_k, L = num_local_;
    const bool fp8 = cfg_.dispatch_dtype == DType::fp8_e4m3;
    const int64_t payload = fp8 ? H : 2 * H, G = fp8 ? H / kFp8GroupSize : 0;
    contig_offsets_ = Tensor::zeros({L + 1}, DType::int32);
    int32_t* off = contig_offsets_.ptr<int32_t>();
    for (int64_t l = 0; l < L; ++l) off[l + 1] = off[l] + counts[l];
    const int64_t M = off[L];
    contig_x_ = Tensor::zeros({M, H}, fp8 ? DType::fp8_e4m3 : DType::bf16);
    contig_scales_ = fp8 ? Tensor::zeros({M, G}, DType::fp32) : Tensor();
    contig_row_expert_ = Tensor::empty({M}, DType::int32);
    std::fill_n(contig_row_expert_.ptr<int32_t>(), M, -1);
    contig_pair_row_ = Tensor::empty({N, K}, DType::int32);
    int32_t* pair = contig_pair_row_.ptr<int32_t>();
    const int32_t* idx = recv_.topk_idx.ptr<const int32_t>();
    std::vector<int32_t> fill(static_cast<size_t>(L), 0);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[n * K + k];
        pair[n * K + k] = -1;
        if (e < 0) continue;
        int64_t j = 0;
        while (j < k && idx[n * K + j] != e) ++j;
        if (j < k) {  // a duplicate column shares the first one's row
          pair[n * K + k] = pair[n * K + j];
          continue;
        }
        const int64_t row = off[e] + fill[static_cast<size_t>(e)]++;
        pair[n * K + k] = static_cast<int32_t>(row);
        contig_row_expert_.ptr<int32_t>()[row] = e;
        std::memcpy(contig_x_.ptr<uint8_t>() + row * payload, recv_.x.ptr<const uint8_t>() + n * payload, static_cast<size_t>(payload));
        if (fp8) std::memcpy(contig_scales_.ptr<float>() + row * G, recv_.x_scales.ptr<const float>() + n * G, static_cast<size_t>(G * 4));
      }
    }
    res.contiguous.x = contig_x_;
    if (fp8) res.contiguous.x_scales = contig_scales_;
    res.contiguous.expert_offsets = contig_offsets_;
    res.contiguous.row_expert = contig_row_expert_;
    res.contiguous.pair_row = contig_pair_row_;
    res.contiguous.num_rows = M;
  }
  return res;
}

void HtCpu::finalize(const FinalizeArgs& args) {
  if (!cfg_.expert_contiguous) {
    DedupCpu::finalize(args);
    return;
  }
  // Each received row's partial from its (row, expert) outputs, then the Flat combine.
  const std::string& op = op_finalize_;
  const int64_t N = contig_pair_row_.defined() ? contig_pair_row_.size(0) : 0, H = cfg_.hidden, K = cfg_.top_k;
  const int64_t M = contig_x_.defined() ? contig_x_.size(0) : 0;
  LocalError err;
  try {
    if (!prepared_) throw InvalidArgument(op + ": no prepare to finalize: every rank calls prepare first (also with T = 0)");
    if (args.expert_out.device != group_->device()) throw Unsupported(wrong_device(op, "expert_out", args.expert_out.device));
    check_dtype(op, "expert_out", args.expert_out, {DType::bf16});
    check_shape(op, "expert_out", args.expert_out, {M, H});
    check_contiguous(op, "expert_out", args.expert_out);
    if (args.topk_weights.defined()) {
      if (args.topk_weights.device != group_->device()) throw Unsupported(wrong_device(op, "topk_weights", args.topk_weights.device));
      check_dtype(op, "topk_weights", args.topk_weights, {DType::fp32});
      check_shape(op, "topk_weights", args.topk_weights, {N, K});
      check_contiguous(op, "topk_weights", args.topk_weights);
    }
  } catch (const Unsupported& e) {
    err = {LocalError::unsupported, e.what()};
  } catch (const InvalidArgument& e) {
    err = {LocalError::invalid_argument, e.what()};
  }
  if (err.kind != LocalError::none) exchange_status(*group_, op, err, {});  // every rank throws
  // The partial of each received row: fp32 (flat_combine partial_fp32) or rounded to bf16 (partial_bf16).
  const bool fp32 = partial_dtype() == DType::fp32;
  Tensor partial = Tensor::empty({N, H}, partial_dtype());
  const int32_t* pair = contig_pair_row_.ptr<const int32_t>();
  const float* w = args.topk_weights.defined() ? args.topk_weights.ptr<const float>() : nullptr;
  const uint16_t* y = args.expert_out.ptr<const uint16_t>();
  std::vector<float> acc(static_cast<size_t>(H));
  for (int64_t n = 0; n < N; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t m = pair[n * K + k];
      if (m < 0) continue;
      const float wk = w ? w[n * K + k] : 1.0f;
      for (int64_t i = 0; i < H; ++i) {
        const volatile float prod = wk * bf16_bits_to_float(y[m * H + i]);  // rounded before the add (the CUDA kernel's order)
        acc[static_cast<size_t>(i)] += prod;
      }
    }
    if (fp32) std::copy(acc.begin(), acc.end(), partial.ptr<float>() + n * H);
    else
      for (int64_t i = 0; i < H; ++i) partial.ptr<uint16_t>()[n * H + i] = float_to_bf16_bits(acc[static_cast<size_t>(i)]);
  }
  FinalizeArgs flat = args;
  flat.expert_out = partial;
  flat.topk_weights = TensorView();
  DedupCpu::finalize(flat);
}

std::unique_ptr<PrepareFinalize> make_ht_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<HtCpu>(std::move(group), cfg);
}

}  // namespace epx::dispatch
