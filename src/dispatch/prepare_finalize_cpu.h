// dispatch/prepare_finalize_cpu.h: what the five CPU PrepareFinalize backends share on top of
// prepare_finalize_base.h: the host-side id check and routing table, rank de-duplication, the
// Flat-layout decoder and the fp32 sum of partial outputs.
// The CPU backends are the reference for the CUDA ones: same layouts, same semantics, same bytes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dispatch/prepare_finalize_base.h"

namespace epx::dispatch {

/// Base of the CPU backends: config, capabilities, placement, checks, stats.
class CpuPrepareFinalize : public PrepareFinalizeBase {
 public:
  using PrepareFinalizeBase::PrepareFinalizeBase;

 protected:
  /// Checks args locally (InvalidArgument / Unsupported kept as a LocalError, never thrown here),
  /// fills `routing`, then runs exchange_status with the fields `fields_of(routing)` adds after
  /// [T]. Returns the table [R][1 + extra]: column 0 is each rank's T. Sets stats' selection counts.
  template <class FieldsOf>
  std::vector<std::vector<int64_t>> begin_prepare(const DispatchArgs& args, Routing& routing, int num_extra, FieldsOf&& fields_of) {
    LocalError err = check_prepare(args, routing);
    std::vector<int64_t> fields(static_cast<size_t>(1 + num_extra), 0);
    if (err.kind == LocalError::none) {
      fields[0] = routing.num_tokens;
      std::vector<int64_t> extra = fields_of(routing);
      EPX_ASSERT(static_cast<int>(extra.size()) == num_extra, "extra=", extra.size(), " num_extra=", num_extra);
      std::copy(extra.begin(), extra.end(), fields.begin() + 1);
    }
    auto table = exchange_status(*group_, op_prepare_, err, fields);
    count_selections(routing);
    prepared_ = true;
    // Padded forms: out is [x.shape[0], H] (rows past num_tokens are left as they are); the combine covers
    // the routed rows.
    prepared_tokens_ = padded_ ? args.x.shape[0] : routing.num_tokens;
    routed_tokens_ = routing.num_tokens;
    return table;
  }

  /// [R] flags: does token t of this rank go to rank d (rank de-duplication).
  void token_dest_ranks(const Routing& routing, int64_t t, std::vector<uint8_t>& is_in_rank) const;
  /// Decodes N rows (source rank of row n = src_rank[n]) into the Flat layout for this rank.
  void decode_flat(const uint8_t* rows, int64_t num_rows, const std::vector<int>& src_rank, FlatRecv& out) const;
  /// out[t] = round_bf16(sum over partials p of p[t]) in the order given, fp32; partial = nullptr skipped.
  static void sum_partials_bf16(const std::vector<const uint16_t*>& partials, int64_t hidden, uint16_t* out);
  /// The same over fp32 partials, then + addend (nullptr: none) before the one rounding.
  static void sum_partials_fp32(const std::vector<const float*>& partials, const float* addend, int64_t hidden, uint16_t* out);
  /// out[i] = round_bf16(sum[i] + addend[i]) for i < n (addend nullptr: round_bf16(sum[i])): the last step of an
  /// fp32 reduction. sum is fp32 (`sum_dtype` fp32) or bf16 (partial_bf16: the reduction rounded already).
  static void finish_rows(const void* sum, DType sum_dtype, const float* addend, int64_t n, uint16_t* out);
  /// Padded forms: the compact Flat rows `in` (rows_per_source[s] rows from each source rank s, in
  /// source order) at rows s * C + i of an [R * C] layout, padding rows x 0, topk_idx -1, weights 0;
  /// padded_row[n] = where compact row n went.
  FlatRecv pad_flat(const FlatRecv& in, const std::vector<int64_t>& rows_per_source, std::vector<int64_t>& padded_row) const;
  /// Padded forms: expert_out's rows padded_row[n] back to compact order (what the unpadded combine reduces).
  const void* compact_partials(const TensorView& expert_out, const std::vector<int64_t>& padded_row);
  /// The padded form's bytes per source block on the wire: the CUDA form's header (the source's plan
  /// record, 16-byte aligned) and C rows, rounded to 16 bytes (the CPU moves the same counts).
  int64_t padded_block_bytes() const;

  int64_t routed_tokens_ = 0;  ///< rows of x that took part in the last prepare (num_tokens, else T)
  std::vector<uint8_t> compact_;

 private:
  LocalError check_prepare(const DispatchArgs& args, Routing& routing) const;
  void count_selections(const Routing& routing);
};

}  // namespace epx::dispatch
