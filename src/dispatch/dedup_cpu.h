// dispatch/dedup_cpu.h: rank-deduplicated all-to-all(v) dispatch and combine, shared by the
// "all2allv" and "ht" backends.
//
// prepare: a token goes once to each destination rank that holds >= 1 of its selections (the
// shared route counts as the source rank itself), however many of its experts live there. The
// per-destination row counts ride on the status all_gather, then one all_to_allv moves the
// encoded rows (RowCodec). This rank receives the Flat layout
//   x            [N_recv, H] bf16 | fp8_e4m3, rows ordered by source rank, then source token index
//   x_scales     [N_recv, H/128] fp32 (fp8 only), as quantized on the source rank
//   topk_idx     [N_recv, K] int32 local expert index, -1 where the selection is not on this rank
//   topk_weights [N_recv, K] fp32
//   recv_count   [L] int32 rows selecting local expert l at least once (ht: rounded up to expert_alignment)
// finalize: expert_out [N_recv, H] (each row = this rank's weighted partial sum for that token; fp32
// with flat_combine partial_fp32, bf16 with partial_bf16) goes back by the reverse all_to_allv; the
// source sums the partials of each token in fp32 in destination-rank order, then
// FinalizeArgs::addend, and rounds once. A token with no valid selection gets a zero row (or the addend).
// all2allv's padded form (DispatchConfig::use_worst_case_sizing): every source's block has C =
// num_max_dispatch_tokens_per_rank rows, so N_recv = R * C: row s * C + i is the i-th row from source s
// while i < its count, the rest padding (x 0, topk_idx -1, weights 0); bytes are those blocks'.
// Bytes reported (ANCHORS.md, deepep-ht): num_rank_dedup_rows rows, incl. to self; remote bytes =
// rows to / from other ranks x RowCodec::row_bytes (dispatch) and x H x (4 | 2) (combine).
#pragma once

#include "dispatch/prepare_finalize_cpu.h"

namespace epx::dispatch {

class DedupCpu : public CpuPrepareFinalize {
 public:
  DedupCpu(const std::string& name, std::shared_ptr<Group> group, const DispatchConfig& cfg, bool cache_layout)
      : CpuPrepareFinalize(name, ActivationLayout::Flat, false, std::move(group), cfg), cache_layout_(cache_layout) {
    caps_.combine_addend = true;
  }
  PrepareResult prepare(const DispatchArgs& args) override;
  void finalize(const FinalizeArgs& args) override;

 protected:
  /// Fills send_tokens_ for `routing` (or keeps it: same routing as last call and caching on).
  void plan(const Routing& routing);

  bool cache_layout_ = false;
  int64_t layout_cache_hits_ = 0;
  std::vector<int32_t> planned_idx_;                  ///< routing the plan was made for (cache key)
  int64_t planned_tokens_ = -1;
  std::vector<std::vector<int32_t>> send_tokens_;     ///< [R] source token indices sent to rank d, in order
  std::vector<uint8_t> is_token_in_rank_;             ///< [T, R]
  std::vector<std::vector<int64_t>> count_matrix_;    ///< [R src][R dst] rows, from the status exchange
  std::vector<int> recv_src_rank_;                    ///< [N_recv]
  std::vector<int64_t> padded_row_;                   ///< all2allv's padded form: Flat row of each received row
  FlatRecv recv_;
};

}  // namespace epx::dispatch
