// dispatch/ll/ll.h: "ll" (low-latency) backend, CPU reference of the DeepEP-LL-compatible kernels.
//
/// prepare (DeepEP low_latency_dispatch; vLLM BatchedExperts format):
///   x            [T, H] bf16, T <= num_max_dispatch_tokens_per_rank (max_T), H % 8 == 0 (fp8: % 128)
///   topk_idx     [T, K] int32 | int64; -1 = no selection (no traffic, no work); E = shared route
///   returns      x [L, R*max_T, H] bf16 | fp8_e4m3, expert-major and packed: expert l's valid rows
///                  are [0, recv_count[l]), grouped by source rank in rank order (the block of source
///                  s is layout_range[l, s]), tokens of one source in source token order; rows
///                  >= recv_count[l] are stale or zero, never read by the experts
///                x_scales [L, R*max_T, H/128] fp32 (fp8 only); recv_count [L] int32
///   A token crosses to a destination rank once (one message, ll_layout.h) and the destination
///   expands it into one slot per distinct local expert it selects (a duplicate expert gets one
///   slot; its columns' weights both apply in finalize).
/// finalize (DeepEP low_latency_combine): expert_out [L, R*max_T, H] bf16 unweighted.
///   LlCombine::column: every slot goes back to its source's combine region at (token,
///   first column of that expert); the source computes out[t] = round_bf16(sum over valid k in
///   column order of w[t,k] * y[t,k]) in fp32, exactly the no-EP reference's arithmetic.
///   LlCombine::partial_fp32 (the default, DispatchConfig::ll_combine): each rank r computes, per received token, p_r = sum in fp32 over the
///   token's columns k (column order) whose expert is local to r of w[t,k] * y[t,k], and sends p_r
///   (fp32 [H]) to the source, which computes out[t] = round_bf16(sum over ranks r in rank order that
///   hold one of t's experts of p_r). partial_bf16: p_r is rounded to bf16 before it is sent.
/// Static buffers: one symmetric buffer of ll_buffer_bytes(cfg, R) and fixed output tensors,
/// allocated at create; views in a PrepareResult stay valid until the next prepare.
/// Bytes reported: num_valid_selections for the deepep-ll accounting (LlLayout); remote bytes are
/// messages to other ranks x msg_bytes (dispatch) and slots of other ranks' tokens x 2H (combine;
/// partial modes: partial rows to other ranks x 4H or 2H).
/// Throws InvalidArgument (every rank, before any write), Timeout, CommError.
#pragma once

#include "dispatch/ll/ll_layout.h"
#include "dispatch/prepare_finalize_cpu.h"

namespace epx::dispatch {

/// Where each expert slot came from (DeepEP packed_recv_src_info / packed_recv_layout_range).
struct LlHandle {
  Tensor src_rank;       ///< [L, R*max_T] int32 source rank of slot (l, j)
  Tensor src_token;      ///< [L, R*max_T] int32 token index on the source rank (DeepEP packed_recv_src_info)
  Tensor topk_column;    ///< [L, R*max_T] int32 first column of the token's topk naming expert l
  Tensor layout_range;   ///< [L, R] int64 (begin << 32) | count of source rank s's block in expert l
  // Partial combine modes only (LlCombine::partial_*): per received message, i.e. the j-th token
  // that source s sent here (j < msg_count[s]), where its selections live on this rank.
  Tensor msg_count;      ///< [R] int32 messages received from each source
  Tensor msg_src_token;  ///< [R, max_T] int32 the message's token index on its source
  Tensor msg_rows;       ///< [R, max_T, K] int32 column k's row l * R*max_T + slot in x, or -1 (not local / -1)
  Tensor msg_weights;    ///< [R, max_T, K] fp32 the token's topk_weights (as sent)
};

class LlCpu final : public CpuPrepareFinalize {
 public:
  /// Collective: allocates the symmetric buffer. Throws InvalidArgument when
  /// num_max_dispatch_tokens_per_rank is 0 (LL buffers are sized by it).
  LlCpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);
  PrepareResult prepare(const DispatchArgs& args) override;
  void finalize(const FinalizeArgs& args) override;
  const LlHandle& handle() const { return handle_; }
  const LlLayout& layout() const { return layout_; }

 private:
  LlLayout layout_;
  SymmetricBuffer buffer_;
  Tensor x_, x_scales_, recv_count_;
  LlHandle handle_;
  std::vector<int32_t> idx_;       ///< [T, K] routing of the last prepare
  std::vector<float> weights_;     ///< [T, K]
  std::vector<int32_t> first_col_; ///< [T, K] first column with the same id (combine row), -1 for -1
  std::vector<uint32_t> dest_mask_; ///< [T] ranks holding one of the token's experts (partial modes)
  uint64_t dispatch_calls_ = 0, combine_calls_ = 0;  ///< call numbers n (parity n % 2, ll_layout.h)
};

}  // namespace epx::dispatch
