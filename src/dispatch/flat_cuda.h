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
  kPlanStatus = 0,      ///< LocalError::Kind, or kPlanBadNumTokens (the kernel); the host writes its own failures
  kPlanBadIndex = 1,    ///< flat index t * K + k of the first topk_idx entry out of range, -1 if none
  kPlanTokens = 2,      ///< T (the rows that take part: DispatchArgs::num_tokens when given)
  kPlanValid = 3,       ///< valid (token, expert) selections (DispatchStats::num_valid_selections)
  kPlanDedupRows = 4,   ///< rank-deduplicated rows, incl. to self (DispatchStats::num_rank_dedup_rows)
  kPlanBadValue = 5,    ///< the bad topk_idx value at kPlanBadIndex, or the bad num_tokens value
  kPlanDestCounts = 6,  ///< [R] rows this rank sends to rank d (rank-deduplicated)
};
/// kPlanStatus of a record whose DispatchArgs::num_tokens (read on the device) is outside [0, x.shape[0]].
constexpr int64_t kPlanBadNumTokens = 3;
constexpr int plan_record_fields(int num_ranks) { return kPlanDestCounts + num_ranks; }

/// The padded forms (use_worst_case_sizing): each source's block on the wire is its plan record
/// (padded_header_bytes) followed by C rows, the whole rounded to 16 bytes, so the record's int64
/// fields and the rows stay aligned in a gathered [R] array of blocks.
constexpr int64_t padded_header_bytes(int num_ranks) { return (8 * static_cast<int64_t>(plan_record_fields(num_ranks)) + 15) / 16 * 16; }
constexpr int64_t padded_block_bytes(int num_ranks, int64_t rows, int64_t row_bytes) {
  return (padded_header_bytes(num_ranks) + rows * row_bytes + 15) / 16 * 16;
}

/// Host-mapped report of a padded prepare that moved nothing because a rank's record was bad
/// (written by the unpack kernel of every rank; the host reads it without a sync).
struct PaddedReport {
  int64_t epoch = 0;      ///< +1 per bad call seen on the device (written last)
  int64_t bad_rank = -1;  ///< the lowest rank with a bad record
  int64_t status = 0;     ///< its kPlanStatus
  int64_t bad_index = -1; ///< its kPlanBadIndex
  int64_t value = 0;      ///< its kPlanBadValue
};

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
  /// Optional [1] int32 on the device: only tokens [0, value) take part (value outside [0, num_tokens]:
  /// none, status kPlanBadNumTokens); send_pos is -1 for the others.
  const int32_t* num_tokens_dev = nullptr;
  /// != 0: the host rejected this rank's arguments (LocalError::Kind): a record of that status, no token.
  int64_t forced_status = 0;
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
  /// Padded form: destination d's block starts at send + d * block_bytes, its record (copied from
  /// `record`, record_fields int64) first, its rows header_bytes later; block_bytes 0 = compact blocks.
  int64_t block_bytes = 0;
  int64_t header_bytes = 0;
  const int64_t* record = nullptr;
  int record_fields = 0;
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
  /// Padded form (rows_per_block > 0): rows holds R blocks of block_bytes, each the source's record then
  /// rows_per_block rows; Flat row n = s * rows_per_block + i is row i of block s when i < the source's
  /// count (kPlanTokens, or kPlanDestCounts + dst_rank with dest_counts) and no record is bad; else
  /// padding (x 0, scales 0, topk_idx -1, weights 0). src_row_offset is unused then.
  int64_t rows_per_block = 0;
  int64_t block_bytes = 0;
  int64_t header_bytes = 0;
  bool dest_counts = false;
  int32_t* call_bad = nullptr;            ///< padded: [1] device, 1 when a record was bad (read by the combine)
  PaddedReport* report = nullptr;         ///< padded: host-mapped, written when a record was bad
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
  /// Padded form: destination d's block starts at row d * rows_per_block of back (dest_counts unused),
  /// and *call_bad != 0 (a bad record in that prepare) drops every partial.
  int64_t rows_per_block = 0;
  const int32_t* call_bad = nullptr;
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
