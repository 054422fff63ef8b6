// dispatch/flat_cuda.h: the kernels of the flat CUDA backends (naive, allgather_reducescatter,
// all2allv), as host launchers with one params struct each. Device code: flat_kernels.cuh;
// launchers: flat_cuda.cu. Free of CUDA headers: the backends (prepare_finalize_cuda.h) call these
// around the NCCL collectives of their Group, all stream-ordered on the caller's stream.
//
// Row format and placement are the CPU reference's (row_codec.h, placement.h), so the rows on the
// wire, the Flat layout and the byte accounting are the same bytes as the CPU backends'.
#pragma once

#include <cstdint>

#include "dispatch/placement.h"
#include "dispatch/row_codec.h"
#include "epx/tensor.h"

namespace epx::dispatch {

/// Fields of the per-rank plan record, int64 each; the record is all-gathered as the status exchange.
enum PlanField : int {
  kPlanStatus = 0,      ///< LocalError::Kind (the kernel writes none; the host writes its own failures)
  kPlanBadIndex = 1,    ///< flat index t * K + k of the first topk_idx entry out of range, -1 if none
  kPlanTokens = 2,      ///< T
  kPlanValid = 3,       ///< valid (token, expert) selections (DispatchStats::num_valid_selections)
  kPlanDedupRows = 4,   ///< rank-deduplicated rows, incl. to self (DispatchStats::num_rank_dedup_rows)
  kPlanDestCounts = 5,  ///< [R] rows this rank sends to rank d (rank-deduplicated)
};
constexpr int plan_record_fields(int num_ranks) { return kPlanDestCounts + num_ranks; }

/// One CTA scans this rank's routing once: validates every id, counts selections and
/// rank-deduplicated rows, and gives each (token, destination rank) pair its row in that
/// destination's block (tokens in order), as DedupCpu::plan does.
struct PlanParams {
  const void* topk_idx = nullptr;  ///< [T, K] int32 | int64, contiguous
  bool idx_is_i64 = false;
  int64_t num_tokens = 0;
  int top_k = 0;
  Placement placement;
  int src_rank = 0;                ///< this rank
  int32_t* send_pos = nullptr;     ///< [T, R] row of token t in destination d's block, -1 if not sent; may be null
  int64_t* record = nullptr;       ///< [plan_record_fields(R)], written whole
};
void launch_plan(const PlanParams& p, Stream stream);

/// rows [T, row_bytes]: everything of a row but the fp8 payload and scales (quantize_fp8_per_token_group
/// writes those straight into the rows): the bf16 payload, ids (int32), weights, source token index.
struct PackParams {
  const uint16_t* x = nullptr;     ///< [T, H] bf16, contiguous
  const void* topk_idx = nullptr;  ///< [T, K] int32 | int64
  bool idx_is_i64 = false;
  const float* topk_weights = nullptr;  ///< [T, K]
  int64_t num_tokens = 0;
  RowCodec codec;
  uint8_t* rows = nullptr;
};
void launch_pack_rows(const PackParams& p, Stream stream);

/// send [sum of dest counts, row_bytes] = for each destination d in rank order, the rows of the
/// tokens sent to d in token order (send_pos from launch_plan).
struct ScatterParams {
  const uint8_t* rows = nullptr;       ///< [T, row_bytes]
  int64_t num_tokens = 0;
  int num_ranks = 1;
  int64_t row_bytes = 0;
  const int32_t* send_pos = nullptr;   ///< [T, R]
  const int64_t* dest_counts = nullptr;  ///< [R] (the plan record's kPlanDestCounts)
  uint8_t* send = nullptr;
};
void launch_scatter_rows(const ScatterParams& p, Stream stream);

/// Received rows -> the Flat layout of this rank (CpuPrepareFinalize::decode_flat): x, x_scales,
/// local topk_idx (-1 where the selection is elsewhere), topk_weights, and recv_count [L] (+1 per row
/// and distinct local expert; zeroed by the launcher first).
struct UnpackParams {
  const uint8_t* rows = nullptr;          ///< [N, row_bytes]
  int64_t num_rows = 0;
  RowCodec codec;
  Placement placement;
  int dst_rank = 0;                       ///< this rank
  int num_src_ranks = 1;
  const int64_t* src_row_offset = nullptr;  ///< [R + 1] device: rows [off[s], off[s+1]) came from rank s
  uint8_t* x = nullptr;                   ///< [N, H] bf16 | fp8
  float* x_scales = nullptr;              ///< fp8: [N, H/128]
  int32_t* topk_idx = nullptr;            ///< [N, K]
  float* topk_weights = nullptr;          ///< [N, K]
  int32_t* recv_count = nullptr;          ///< [L]
  int num_local = 0;                      ///< L
};
void launch_unpack_rows(const UnpackParams& p, Stream stream);

/// out[t] = round_bf16(sum over destinations d in rank order that token t went to of back[row of
/// (t, d)] + addend[t]), fp32, zeros (or the addend) for a token sent nowhere (DedupCpu::finalize).
/// bf16 back (flat_combine partial_bf16): the sum of the partials is rounded before the addend joins
/// and rounded again, as the CPU does.
struct CombineParams {
  const void* back = nullptr;            ///< [sum of dest counts, H] fp32 | bf16, blocks per destination as sent
  bool back_f32 = false;                 ///< back holds fp32 partials (flat_combine partial_fp32)
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int num_ranks = 1;
  const int32_t* send_pos = nullptr;     ///< [T, R]
  const int64_t* dest_counts = nullptr;  ///< [R]
  const float* addend = nullptr;         ///< [T, H] fp32 (FinalizeArgs::addend), or null
  uint16_t* out = nullptr;               ///< [T, H] bf16, contiguous
};
void launch_combine_rows(const CombineParams& p, Stream stream);

/// out[i] = round_bf16(sum over r < num_ranks in rank order of parts[r * rank_stride + i], from 0.0f,
/// then + addend[i]) for i < n: the last step of naive (the all-gathered fp32 partials, or the bf16
/// all-reduce result with num_ranks = 1) and of allgather_reducescatter (its reduce_scatterv result,
/// num_ranks = 1) on CUDA, as CpuPrepareFinalize::finish_rows and the CPU group's rank-order sums.
struct FinishParams {
  const void* parts = nullptr;   ///< fp32 | bf16
  bool parts_f32 = false;
  int num_ranks = 1;
  int64_t rank_stride = 0;       ///< elements between rank r's block and rank r + 1's
  int64_t n = 0;
  const float* addend = nullptr; ///< [n] fp32, or null
  uint16_t* out = nullptr;       ///< [n] bf16
};
void launch_finish_rows(const FinishParams& p, Stream stream);

}  // namespace epx::dispatch
