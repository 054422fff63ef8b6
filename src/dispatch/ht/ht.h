// dispatch/ht/ht.h: "ht" (high-throughput) backend and its layout handle.
//
// Output (DeepEP intranode dispatch, vLLM Standard format): rank-deduplicated flat
//   x [N_recv, H] bf16 | fp8_e4m3 ordered by source rank then source token, x_scales [N_recv, H/128],
//   topk_idx [N_recv, K] int32 local expert or -1, topk_weights [N_recv, K] fp32,
//   recv_count [L] int32 = rows selecting local expert l, rounded up to cfg.expert_alignment
//   (DeepEP num_recv_tokens_per_expert_list; the padding is for a later contiguous grouped-GEMM
//   permute, the flat rows themselves are not padded).
// The layout (who sends what where) is computed once per distinct routing and cached: a prepare
// whose topk_idx equals the previous call's reuses it (DeepEP's cached-handle dispatch).
// Optional expert-contiguous layout (DispatchConfig::expert_contiguous, epx::ExpertContiguousLayout):
// after the Flat rows, for each received row n in order and each k in order whose local expert e
// is not an earlier column's, the row is appended to e's segment (offsets = exclusive prefix sum
// of the aligned recv_count; padding rows zero, row_expert -1); pair_row[n, k] is that row (a
// duplicate column shares it). finalize then takes expert_out [M, H] (one unweighted row per pair)
// and forms each received row's partial as sum_k w[n,k] * expert_out[pair_row[n,k]] in fp32
// (w = FinalizeArgs::topk_weights, or 1), kept fp32 (flat_combine partial_fp32) or rounded to bf16
// (partial_bf16), before the usual return and rank-order sum.
// Data movement and combine as dispatch/dedup_cpu.h (the CPU reference moves rows with
// all_to_allv; the CUDA kernel may use worst-case static buffers, same layout).
#pragma once

#include "dispatch/dedup_cpu.h"

namespace epx::dispatch {

struct HtHandle {
  int num_ranks = 0;
  std::vector<int32_t> rank_prefix_matrix;          ///< [R src, R dst]: rows rank d receives from ranks 0..s (DeepEP)
  std::vector<uint8_t> is_token_in_rank;            ///< [T, R] does this rank's token t go to rank d
  std::vector<int32_t> recv_src_rank;               ///< [N_recv] source rank of each received row
  std::vector<int32_t> recv_src_idx;                ///< [N_recv] token index on the source rank (DeepEP recv_src_idx)
  std::vector<int32_t> num_recv_tokens_per_expert;  ///< [L] aligned counts (= recv_count)
  int64_t layout_cache_hits = 0;                    ///< prepares that reused the cached layout
};

class HtCpu final : public DedupCpu {
 public:
  HtCpu(std::shared_ptr<Group> group, const DispatchConfig& cfg) : DedupCpu("ht", std::move(group), cfg, /*cache_layout=*/true) {}
  PrepareResult prepare(const DispatchArgs& args) override;
  void finalize(const FinalizeArgs& args) override;
  /// The handle of the last prepare.
  const HtHandle& handle() const { return handle_; }

 private:
  HtHandle handle_;
  // expert-contiguous layout of the last prepare (cfg_.expert_contiguous)
  Tensor contig_x_, contig_scales_, contig_offsets_, contig_row_expert_, contig_pair_row_;
};

}  // namespace epx::dispatch
