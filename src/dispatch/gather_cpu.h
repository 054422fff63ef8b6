// dispatch/gather_cpu.h: the prepare shared by naive and allgather_reducescatter (vLLM's
// defaults over host collectives). Every rank receives every token:
//   x            [N, H] bf16 | fp8_e4m3, N = sum over ranks of T_r, rows ordered by source rank then token
//   x_scales     [N, H/128] fp32 (fp8 only), quantized once on the source rank
//   topk_idx     [N, K] int32: local expert index on this rank, -1 where the expert lives elsewhere
//   topk_weights [N, K] fp32
//   recv_count   [L] int32: rows selecting local expert l at least once
// finalize reduces the [N, H] partials (fp32 with flat_combine partial_fp32, bf16 with partial_bf16)
// over ranks in rank order in fp32; FinalizeArgs::addend joins each token's sum last, then one
// rounding to bf16 (partial_bf16: the bf16 reduction rounds, the addend's add rounds again).
// Rows without a local selection are still present (the experts write zeros for them). A rank
// holding no expert (E < R, no shared route) gets N = 0 rows: it has nothing to run, and its
// finalize contributes zeros.
// Padded form (DispatchConfig::use_worst_case_sizing): every rank's block has C =
// num_max_dispatch_tokens_per_rank rows, so N = R * C: row s * C + t is token t of rank s for t < T_s,
// the rest padding (x 0, topk_idx -1, weights 0; their partials are not read). T_s is x.shape[0] or
// DispatchArgs::num_tokens (a [1] int32 on the group's device). The sums are the unpadded form's.
#pragma once

#include "dispatch/prepare_finalize_cpu.h"

namespace epx::dispatch {

class GatherCpu : public CpuPrepareFinalize {
 public:
  using CpuPrepareFinalize::CpuPrepareFinalize;
  /// Collective: all_gather of T, then one all_gatherv of the encoded rows ([T_r, RowCodec::row_bytes]).
  PrepareResult prepare(const DispatchArgs& args) override;

 protected:
  std::vector<int64_t> tokens_per_rank_;  ///< [R] T_r of the last prepare
  int64_t token_offset_ = 0;              ///< first row of this rank's tokens in the gathered rows
  int64_t num_rows_ = 0;                  ///< N gathered rows
  int64_t num_exposed_rows_ = 0;          ///< rows handed to the experts: N, or 0 on a rank without experts
  /// expert_out data to reduce: the caller's, or zeros [N, H] (partial_dtype()) on a rank without experts.
  const void* partials(const FinalizeArgs& args);
  std::vector<float> zeros_;
  FlatRecv recv_;
  std::vector<int64_t> padded_row_;       ///< padded form: Flat row of each gathered row
};

}  // namespace epx::dispatch
