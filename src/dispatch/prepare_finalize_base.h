// dispatch/prepare_finalize_base.h: what every PrepareFinalize backend shares, CPU or CUDA.
//
//   - argument checks at the API boundary that need no read of tensor data, and the per-call status
//     exchange: every rank publishes "my arguments are fine / not, and why" with one all_gather
//     before any data moves, so a bad input on one rank makes every rank throw (never a hang, never
//     a partial write);
//   - expert placement as seen from a source rank (placement.h);
//   - the wire format of one token row (row_codec.h) and the byte accounting (DispatchStats).
// The CPU backends (prepare_finalize_cpu.h) are the reference for the CUDA ones
// (prepare_finalize_cuda.h): same layouts, same semantics, same bytes, same messages.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dispatch/placement.h"
#include "dispatch/row_codec.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/quant.h"

namespace epx::dispatch {

/// This rank's routing after validation (CPU backends).
struct Routing {
  int64_t num_tokens = 0;          ///< T
  int top_k = 0;                   ///< K
  std::vector<int32_t> idx;        ///< [T, K] global expert ids; -1 = none; E = shared route (cfg.shared_route)
  const float* weights = nullptr;  ///< [T, K] fp32, the caller's topk_weights
  int32_t at(int64_t t, int k) const { return idx[static_cast<size_t>(t * top_k + k)]; }
  float weight(int64_t t, int k) const { return weights[t * top_k + k]; }
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
/// Returns the table [R][fields.size()] of everyone's fields. Stream-ordered after the work queued
/// on `stream` (CUDA groups); returns when the exchange has finished.
std::vector<std::vector<int64_t>> exchange_status(Group& group, const std::string& op, const LocalError& local,
                                                  const std::vector<int64_t>& fields, Stream stream = {});

/// Validates a DispatchConfig for `backend` (InvalidArgument naming the field) after the group
/// agreed on it.
void validate_config(const std::string& backend, const DispatchConfig& cfg, int num_ranks);

/// naive, allgather_reducescatter, all2allv: the backends whose use_worst_case_sizing is the padded form
/// (every rank's block has num_max_dispatch_tokens_per_rank rows; see DispatchConfig::use_worst_case_sizing).
bool uses_padded_blocks(const std::string& backend);

/// The InvalidArgument a bad topk_idx[t, k] = value raises (the same sentence on every device).
InvalidArgument bad_topk_id(const std::string& op, const DispatchConfig& cfg, int64_t t, int64_t k, int64_t value);

/// Base of every backend: config, capabilities, placement, argument checks, stats.
class PrepareFinalizeBase : public PrepareFinalize {
 public:
  PrepareFinalizeBase(const std::string& name, ActivationLayout layout, bool static_buffers, std::shared_ptr<Group> group,
                      const DispatchConfig& cfg);
  const Capabilities& capabilities() const override { return caps_; }
  const DispatchConfig& config() const override { return cfg_; }
  const DispatchStats& stats() const override { return stats_; }
  /// The one capability gap these backends share: tensors on a device other than the group's.
  std::optional<std::string> why_unsupported(const DispatchArgs& args) const override;

 protected:
  /// Every check of `args` that reads no tensor data (devices, dtypes, shapes, contiguity, T <= capacity),
  /// as a LocalError (never thrown here). The ids themselves are checked by the backend.
  LocalError check_args(const DispatchArgs& args) const;
  /// Checks out [T of the last prepare, H] bf16, expert_out (`expert_out_shape`; bf16 for ExpertMajor,
  /// partial_dtype() for Flat) and addend ([T, H] fp32 where Capabilities::combine_addend, else empty),
  /// then exchanges status (on `stream`) so every rank throws if one rank's arguments are bad.
  void begin_finalize(const FinalizeArgs& args, const std::vector<int64_t>& expert_out_shape, Stream stream = {});
  /// begin_finalize's checks alone, as a LocalError (never thrown here), without the exchange.
  LocalError check_finalize(const FinalizeArgs& args, const std::vector<int64_t>& expert_out_shape) const;

  /// The dtype a rank's partial sum crosses ranks in (DispatchConfig::flat_combine): fp32 or bf16.
  DType partial_dtype() const { return cfg_.flat_combine == FlatCombine::partial_fp32 ? DType::fp32 : DType::bf16; }

  /// Rank that processes selection `id` of a token from `src_rank` (-1 for no selection).
  int dest_rank(int32_t id, int src_rank) const { return placement_.dest_rank(id, src_rank); }
  /// Local expert index of `id` (from `src_rank`) on `dst_rank`, or -1 if it is not processed there.
  int local_index(int32_t id, int src_rank, int dst_rank) const { return placement_.local_index(id, src_rank, dst_rank); }
  RowCodec codec() const { return {cfg_.hidden, cfg_.top_k, cfg_.dispatch_dtype == DType::fp8_e4m3, cfg_.use_ue8m0}; }
  /// "<op>: <arg> is on <device> but the group runs on <device>: <which memory these backends move>".
  std::string wrong_device(const std::string& op, const std::string& arg, Device device) const;

  std::shared_ptr<Group> group_;
  DispatchConfig cfg_;
  Capabilities caps_;
  DispatchStats stats_;
  Placement placement_;
  int num_ranks_ = 1;
  int rank_ = 0;
  int num_local_ = 0;  ///< L of this rank (routed range + shared replica)
  std::string op_prepare_, op_finalize_;
  bool prepared_ = false;
  int64_t prepared_tokens_ = 0;
  bool accepts_device_num_tokens_ = false;  ///< DispatchArgs::num_tokens (ll, ht on CUDA; padded forms); else InvalidArgument
  /// naive / allgather_reducescatter / all2allv with use_worst_case_sizing: every rank's block has
  /// C = num_max_dispatch_tokens_per_rank rows; the Flat layout has R * C rows, row s * C + i the i-th
  /// row from source rank s, rows past that source's real count padding (x 0, topk_idx -1, weights 0).
  bool padded_ = false;
};

}  // namespace epx::dispatch
