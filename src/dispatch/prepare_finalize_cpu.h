// dispatch/prepare_finalize_cpu.h: what the five CPU PrepareFinalize backends share.
//
//   - argument checks at the API boundary and the per-call status exchange: every rank publishes
//     "my arguments are fine / not, and why" with one all_gather before any data moves, so a bad
//     input on one rank makes every rank throw (never a hang, never a partial write);
//   - expert placement as seen from a source rank (routed experts by range, the shared route E to
//     the source's own replica);
//   - the wire format of one token row (RowCodec) and the byte accounting (DispatchStats).
// The CPU backends are the reference for the CUDA ones: same layouts, same semantics, same bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/quant.h"

namespace epx::dispatch {

/// This rank's routing after validation.
struct Routing {
  int64_t num_tokens = 0;          ///< T
  int top_k = 0;                   ///< K
  std::vector<int32_t> idx;        ///< [T, K] global expert ids; -1 = none; E = shared route (cfg.shared_route)
  const float* weights = nullptr;  ///< [T, K] fp32, the caller's topk_weights
  int32_t at(int64_t t, int k) const { return idx[static_cast<size_t>(t * top_k + k)]; }
  float weight(int64_t t, int k) const { return weights[t * top_k + k]; }
};

/// Wire format of one token row, used by the flat backends (naive, agrs, all2allv, ht):
///   [payload: bf16 [H] | fp8_e4m3 [H]] [fp8 only: scales fp32 [H/128]] [topk ids int32 [K]] [topk weights fp32 [K]]
///   [source token index int32]
/// Every part is a multiple of 4 bytes (H % 8 == 0; fp8 H % 128 == 0). A token is quantized once
/// on its source rank; its scales travel with it unchanged (BEHAVIOUR.md).
struct RowCodec {
  int64_t hidden = 0;
  int top_k = 0;
  bool use_fp8 = false;
  bool use_ue8m0 = false;

  int64_t payload_bytes() const { return use_fp8 ? hidden : 2 * hidden; }
  int64_t scale_bytes() const { return use_fp8 ? hidden / kFp8GroupSize * 4 : 0; }
  int64_t row_bytes() const { return payload_bytes() + scale_bytes() + 8 * static_cast<int64_t>(top_k) + 4; }

  /// rows [T][row_bytes] from x [T, H] bf16 and the routing (global ids).
  void encode(const TensorView& x, const Routing& routing, std::vector<uint8_t>& rows) const;
};

/// The Flat-layout result of a rank-deduplicated or gathered dispatch, owned by the backend.
struct FlatRecv {
  Tensor x;             ///< [N, H] bf16 | fp8_e4m3
  Tensor x_scales;      ///< fp8: [N, H/128] fp32
  Tensor topk_idx;      ///< [N, K] int32 local expert index or -1
  Tensor topk_weights;  ///< [N, K] fp32
  Tensor recv_count;    ///< [L] int32: rows that select local expert l at least once
  std::vector<int32_t> src_token;  ///< [N] token index on the source rank
  PrepareResult result() const;
};

/// A local failure to report through the status exchange.
struct LocalError {
  enum Kind : int64_t { none = 0, invalid_argument = 1, unsupported = 2 };
  Kind kind = none;
  std::string message;
};

/// Collective: all-gathers [status, message length, fields...] of every rank (fields: same count on
/// every rank). If any rank failed, every rank throws: a failing rank its own error, the others the
/// same type with "<op>: rank r rejected its arguments: <message of the lowest failing rank>".
/// Returns the table [R][fields.size()] of everyone's fields.
std::vector<std::vector<int64_t>> exchange_status(Group& group, const std::string& op, const LocalError& local,
                                                  const std::vector<int64_t>& fields);

/// Base of the CPU backends: config, capabilities, placement, checks, stats.
class CpuPrepareFinalize : public PrepareFinalize {
 public:
  CpuPrepareFinalize(const std::string& name, ActivationLayout layout, bool static_buffers, std::shared_ptr<Group> group,
                     const DispatchConfig& cfg);
  const Capabilities& capabilities() const override { return caps_; }
  const DispatchConfig& config() const override { return cfg_; }
  const DispatchStats& stats() const override { return stats_; }
  /// The one capability gap of the CPU backends: tensors on a device other than the group's.
  std::optional<std::string> why_unsupported(const DispatchArgs& args) const override;

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
    prepared_tokens_ = routing.num_tokens;
    return table;
  }
  /// Checks out [T of the last prepare, H] bf16 and expert_out (`expert_out_shape`, bf16), then
  /// exchanges status so every rank throws if one rank's arguments are bad.
  void begin_finalize(const FinalizeArgs& args, const std::vector<int64_t>& expert_out_shape);

  /// Rank that processes selection `id` of a token from `src_rank` (-1 for no selection).
  int dest_rank(int32_t id, int src_rank) const;
  /// Local expert index of `id` (from `src_rank`) on `dst_rank`, or -1 if it is not processed there.
  int local_index(int32_t id, int src_rank, int dst_rank) const;
  /// [R] flags: does token t of this rank go to rank d (rank de-duplication).
  void token_dest_ranks(const Routing& routing, int64_t t, std::vector<uint8_t>& is_in_rank) const;
  RowCodec codec() const { return {cfg_.hidden, cfg_.top_k, cfg_.dispatch_dtype == DType::fp8_e4m3, cfg_.use_ue8m0}; }
  /// Decodes N rows (source rank of row n = src_rank[n]) into the Flat layout for this rank.
  void decode_flat(const uint8_t* rows, int64_t num_rows, const std::vector<int>& src_rank, FlatRecv& out) const;
  /// out[t] = round_bf16(sum over partials p of p[t]) in the order given, fp32; partial = nullptr skipped.
  static void sum_partials_bf16(const std::vector<const uint16_t*>& partials, int64_t hidden, uint16_t* out);

  std::shared_ptr<Group> group_;
  DispatchConfig cfg_;
  Capabilities caps_;
  DispatchStats stats_;
  int num_ranks_ = 1;
  int rank_ = 0;
  int num_local_ = 0;  ///< L of this rank (routed range + shared replica)
  std::string op_prepare_, op_finalize_;
  bool prepared_ = false;
  int64_t prepared_tokens_ = 0;

 private:
  LocalError check_prepare(const DispatchArgs& args, Routing& routing) const;
  void count_selections(const Routing& routing);
};

/// Validates a DispatchConfig for `backend` (InvalidArgument naming the field) after the group
/// agreed on it.
void validate_config(const std::string& backend, const DispatchConfig& cfg, int num_ranks);

}  // namespace epx::dispatch
