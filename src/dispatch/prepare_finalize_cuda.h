// dispatch/prepare_finalize_cuda.h: what the flat CUDA backends (naive, allgather_reducescatter,
// all2allv over a CUDA group) share: the plan + status exchange, the row encoder and the Flat
// decoder, around the kernels of flat_cuda.h. Same layouts, semantics, stats and error sentences as
// the CPU reference (prepare_finalize_cpu.h); tensors live on the group's GPU, every step is
// stream-ordered on DispatchArgs::stream / FinalizeArgs::stream.
//
// Padded form (DispatchConfig::use_worst_case_sizing; graph-safe): no host wait at all. Each rank's
// block has C = num_max_dispatch_tokens_per_rank rows behind its plan record (count, status, bad id),
// all in one collective; the unpack kernel reads every record on the device, masks rows past each
// source's count, and turns a call with a bad record into padding on every rank (reported through a
// host-mapped record: finalize throws it after its launch, or take_device_error). A rank whose host
// rejects its arguments still sends its record (and the finalize's collectives, NaN) before it throws,
// so the peers' collectives complete.
// Host syncs (dynamic form): prepare waits once, for the all-gather of every rank's plan record (T, the rows for
// each destination, the id check), bounded by the group's timeout_s: the sizes of the following
// collectives depend on it (vLLM's naive/AG-RS/all2allv paths sync the same way). finalize waits
// once, for the status exchange of its arguments. Not graph-safe.
// Internal buffers are reused from call to call: successive calls on one object are assumed ordered
// on one stream (or ordered by the caller), as with DeepEP's and vLLM's buffers.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dispatch/flat_cuda.h"
#include "dispatch/prepare_finalize_base.h"

namespace epx::dispatch {

/// Device memory reused across calls; grows (x1.5) when a call needs more. Views handed out stay
/// valid until the next ensure().
class DeviceBuffer {
 public:
  /// At least `bytes` (>= 0) on `device`; nullptr for 0 bytes before any allocation.
  void* ensure(int64_t bytes, Device device);
  void* data() const { return storage_.data(); }
  template <class T> T* ptr() const { return static_cast<T*>(storage_.data()); }

 private:
  Tensor storage_;
  int64_t capacity_ = 0;
};

class CudaPrepareFinalize : public PrepareFinalizeBase {
 public:
  /// group: a CUDA group (NCCL or virtual ranks; device cuda:i).
  CudaPrepareFinalize(const std::string& name, std::shared_ptr<Group> group, const DispatchConfig& cfg);

 protected:
  /// Checks args (host side), runs the plan kernel, all-gathers every rank's plan record (the one host
  /// sync of a prepare) and throws on every rank if any rank's arguments are bad, ids included.
  /// Returns the table [R][plan_record_fields(R)] (flat_cuda.h PlanField), sets the selection stats
  /// and uploads the row offsets of each source rank in what this rank receives: T_s (gathered) or
  /// the rows s sends to this rank (rank_dedup, which also fills send_pos_ [T, R]).
  std::vector<std::vector<int64_t>> begin_prepare(const DispatchArgs& args, bool rank_dedup);
  /// rows_ [T, row_bytes] = this rank's tokens as the wire carries them (fp8: quantized once by
  /// quantize_fp8_per_token_group straight into the rows).
  void encode_rows(const DispatchArgs& args, uint8_t* rows = nullptr);  ///< rows: default rows_
  /// The Flat layout of `num_rows` received rows (the first of src_row_offset_ order).
  PrepareResult decode_rows(const uint8_t* rows, int64_t num_rows, Stream stream);
  Device device() const { return group_->device(); }
  /// The plan record of this rank's last prepare on the device (dest counts at kPlanDestCounts).
  const int64_t* device_record() const { return record_.ptr<int64_t>(); }

  // ---- the padded form (use_worst_case_sizing): no host wait, no status exchange ----
  /// Host checks of args (no exchange), then the plan kernel writes this rank's record to `record` (the
  /// count from DispatchArgs::num_tokens when given; a host-rejected call gets a record of its status
  /// and no token, so the peers see it on the device). Returns the host verdict.
  LocalError padded_plan(const DispatchArgs& args, int64_t* record, bool rank_dedup);
  /// The Flat layout of `num_rows` (R * C, or 0) padded rows from R blocks at `blocks` (unpack_padded_kernel).
  PrepareResult decode_padded(const uint8_t* blocks, int64_t num_rows, bool dest_counts, Stream stream);
  /// [n] bytes of 0xff (NaN in fp32 and bf16) on the device: what a rank that refused its finalize sends.
  const void* nan_partials(int64_t bytes, Stream stream);
  /// The sentence of a bad padded call the device reported since the last look (every rank sees it;
  /// a host rejection is not repeated on the rank that threw it), taken; else nullopt.
  std::optional<std::string> take_padded_report();
  /// After a launch: throws take_padded_report()'s error unless defer_device_errors() was called.
  void throw_padded_report();
  std::optional<std::string> take_device_error() override { return padded_ ? take_padded_report() : std::nullopt; }
  void defer_device_errors() override { defer_errors_ = true; }
  int64_t padded_rows() const { return cfg_.num_max_dispatch_tokens_per_rank; }
  const int32_t* call_bad() const { return call_bad_.ptr<const int32_t>(); }

  std::vector<int64_t> src_row_offset_;  ///< [R + 1] host copy of the offsets begin_prepare uploaded
  DeviceBuffer record_;                  ///< [plan_record_fields(R)] int64
  DeviceBuffer send_pos_;                ///< [T, R] int32 (rank_dedup)
  DeviceBuffer rows_;                    ///< [T, row_bytes]

 private:
  DeviceBuffer src_row_offset_dev_, x_, x_scales_, topk_idx_, topk_weights_, recv_count_, call_bad_, nan_;
  std::shared_ptr<PaddedReport> report_;  ///< host-mapped (padded form)
  PaddedReport* report_dev_ = nullptr;
  int64_t seen_epoch_ = 0;
  bool defer_errors_ = false;

 public:
  ~CudaPrepareFinalize() override;
};

}  // namespace epx::dispatch
