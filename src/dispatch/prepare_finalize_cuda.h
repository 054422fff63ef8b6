// dispatch/prepare_finalize_cuda.h: what the flat CUDA backends (naive, allgather_reducescatter,
// all2allv over a CUDA group) share: the plan + status exchange, the row encoder and the Flat
// decoder, around the kernels of flat_cuda.h. Same layouts, semantics, stats and error sentences as
// the CPU reference (prepare_finalize_cpu.h); tensors live on the group's GPU, every step is
// stream-ordered on DispatchArgs::stream / FinalizeArgs::stream.
//
// Host syncs: prepare waits once, for the all-gather of every rank's plan record (T, the rows for
// each destination, the id check), bounded by the group's timeout_s: the sizes of the following
// collectives depend on it (vLLM's naive/AG-RS/all2allv paths sync the same way). finalize waits
// once, for the status exchange of its arguments. Not graph-safe.
// Internal buffers are reused from call to call: successive calls on one object are assumed ordered
// on one stream (or ordered by the caller), as with DeepEP's and vLLM's buffers.
#pragma once

#include <memory>
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
  void encode_rows(const DispatchArgs& args);
  /// The Flat layout of `num_rows` received rows (the first of src_row_offset_ order).
  PrepareResult decode_rows(const uint8_t* rows, int64_t num_rows, Stream stream);
  Device device() const { return group_->device(); }
  /// The plan record of this rank's last prepare on the device (dest counts at kPlanDestCounts).
  const int64_t* device_record() const { return record_.ptr<int64_t>(); }

  std::vector<int64_t> src_row_offset_;  ///< [R + 1] host copy of the offsets begin_prepare uploaded
  DeviceBuffer record_;                  ///< [plan_record_fields(R)] int64
  DeviceBuffer send_pos_;                ///< [T, R] int32 (rank_dedup)
  DeviceBuffer rows_;                    ///< [T, row_bytes]

 private:
  DeviceBuffer src_row_offset_dev_, x_, x_scales_, topk_idx_, topk_weights_, recv_count_;
};

}  // namespace epx::dispatch
