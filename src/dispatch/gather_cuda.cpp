// dispatch/gather_cuda.cpp: "naive" and "allgather_reducescatter" on a CUDA group, the CUDA twins
// of gather_cpu.h / naive_cpu.cpp / agrs_cpu.cpp: the same gathered Flat layout (every token on
// every rank, ordered by source rank then token), the same fp32 rank-order reductions of the fp32
// (flat_combine partial_fp32) or bf16 (partial_bf16) partials, FinalizeArgs::addend joining before the
// one rounding (launch_finish_rows, as CpuPrepareFinalize::finish_rows), the same stats.
//
// prepare: plan + exchange (one host sync), encode this rank's rows, one all_gatherv of the rows,
// decode. A rank holding no expert gets N = 0 rows and contributes zeros in finalize.
// Padded form (use_worst_case_sizing; prepare_finalize_cuda.h): plan kernel -> this rank's record and
// C rows in one block -> one all_gather of R blocks -> unpack_padded_kernel; finalize: one collective of
// R * C rows (all-gather / all-reduce for naive, reduce-scatter of C rows per rank for agrs) -> finish.
// No host wait; graph-safe.
#include <cuda_runtime_api.h>

#include "cuda/check.h"
#include "dispatch/backends.h"
#include "dispatch/flat_cuda.h"
#include "dispatch/prepare_finalize_cuda.h"

namespace epx::dispatch {
namespace {

class GatherCuda : public CudaPrepareFinalize {
 public:
  using CudaPrepareFinalize::CudaPrepareFinalize;

  PrepareResult prepare(const DispatchArgs& args) override {
    cuda::DeviceGuard guard(device().index);
    if (padded_) return prepare_padded(args);
    const auto table = begin_prepare(args, /*rank_dedup=*/false);
    const int64_t rb = codec().row_bytes();
    tokens_per_rank_.assign(static_cast<size_t>(num_ranks_), 0);
    std::vector<int64_t> bytes(static_cast<size_t>(num_ranks_));
    for (int r = 0; r < num_ranks_; ++r) {
      tokens_per_rank_[static_cast<size_t>(r)] = table[static_cast<size_t>(r)][kPlanTokens];
      bytes[static_cast<size_t>(r)] = tokens_per_rank_[static_cast<size_t>(r)] * rb;
    }
    num_rows_ = src_row_offset_.back();
    token_offset_ = src_row_offset_[static_cast<size_t>(rank_)];
    encode_rows(args);
    uint8_t* all = static_cast<uint8_t*>(gathered_.ensure(num_rows_ * rb, device()));
    group_->all_gatherv(rows_.data(), all, bytes, args.stream);
    num_exposed_rows_ = num_local_ > 0 ? num_rows_ : 0;
    stats_.remote_bytes_dispatch = (num_ranks_ - 1) * args.x.shape[0] * rb;
    return decode_rows(all, num_exposed_rows_, args.stream);
  }

 protected:
  /// The padded form: this rank's record and C rows in one block, one all_gather of R blocks, decode.
  PrepareResult prepare_padded(const DispatchArgs& args) {
    const int R = num_ranks_;
    const int64_t C = padded_rows(), rb = codec().row_bytes();
    const int64_t hb = padded_header_bytes(R), bb = padded_block_bytes(R, C, rb);
    uint8_t* send = static_cast<uint8_t*>(send_block_.ensure(bb, device()));
    const LocalError err = padded_plan(args, reinterpret_cast<int64_t*>(send), /*rank_dedup=*/false);
    if (err.kind == LocalError::none) encode_rows(args, send + hb);
    uint8_t* all = static_cast<uint8_t*>(gathered_.ensure(R * bb, device()));
    group_->all_gather(send, all, bb, args.stream);
    tokens_per_rank_.assign(static_cast<size_t>(R), C);
    num_rows_ = R * C;
    token_offset_ = rank_ * C;
    num_exposed_rows_ = num_local_ > 0 ? num_rows_ : 0;
    stats_ = {};
    stats_.num_valid_selections = -1;  // on the device only
    stats_.num_rank_dedup_rows = -1;
    stats_.remote_bytes_dispatch = (R - 1) * bb;
    PrepareResult res = decode_padded(all, num_exposed_rows_, /*dest_counts=*/false, args.stream);
    if (err.kind != LocalError::none) {
      // The peers saw the record on the device and finalize next: their collectives need this rank's too.
      prepared_ = false;
      combine_collectives(nan_partials(num_rows_ * cfg_.hidden * dtype_size(partial_dtype()), args.stream), args.stream);
      if (err.kind == LocalError::unsupported) throw Unsupported(err.message);
      throw InvalidArgument(err.message);
    }
    prepared_ = true;
    prepared_tokens_ = args.x.shape[0];
    return res;
  }

  /// The finalize's collectives on `parts` [N, H] (N = num_rows_) into this backend's sums; no other work.
  virtual const void* combine_collectives(const void* parts, Stream stream) = 0;

  /// Padded finalize: local checks (no exchange; a refusing rank sends NaN partials and throws after the
  /// collectives), the collectives, launch_finish_rows over this rank's x.shape[0] rows.
  void finalize_padded(const FinalizeArgs& args) {
    const int64_t H = cfg_.hidden;
    const LocalError err = check_finalize(args, {num_exposed_rows_, H});
    const DType dt = partial_dtype();
    if (err.kind != LocalError::none) {
      combine_collectives(nan_partials(num_rows_ * H * dtype_size(dt), args.stream), args.stream);
      prepared_ = false;
      if (err.kind == LocalError::unsupported) throw Unsupported(err.message);
      throw InvalidArgument(err.message);
    }
    const void* sums = combine_collectives(partials(args), args.stream);
    FinishParams fp;
    fp.n = prepared_tokens_ * H;
    fp.addend = args.addend.defined() ? args.addend.ptr<const float>() : nullptr;
    fp.out = args.out.ptr<uint16_t>();
    fp.parts = sums;
    fp.parts_f32 = dt == DType::fp32;
    finish_shape(fp);
    launch_finish_rows(fp, args.stream);
    throw_padded_report();
  }
  /// The finish over this backend's sums: rank count and stride (naive's fp32 all-gather: R blocks).
  virtual void finish_shape(FinishParams& fp) const { (void)fp; }

  /// expert_out data to reduce: the caller's, or zeros [N, H] on a rank without experts.
  const void* partials(const FinalizeArgs& args) {
    if (num_exposed_rows_ == num_rows_) return args.expert_out.data;
    const int64_t bytes = num_rows_ * cfg_.hidden * dtype_size(partial_dtype());
    void* zeros = zeros_.ensure(bytes, device());
    if (bytes > 0) EPX_CUDA_CHECK(cudaMemsetAsync(zeros, 0, static_cast<size_t>(bytes), cuda::native(args.stream)));
    return zeros;
  }

  std::vector<int64_t> tokens_per_rank_;  ///< [R] T_r of the last prepare
  int64_t token_offset_ = 0;              ///< first row of this rank's tokens in the gathered rows
  int64_t num_rows_ = 0;                  ///< N gathered rows
  int64_t num_exposed_rows_ = 0;          ///< rows handed to the experts: N, or 0 on a rank without experts
  DeviceBuffer gathered_, zeros_, send_block_;
};

/// finalize = all-reduce (sum) of every rank's [N, H] partials, then this rank keeps its own T rows.
/// fp32 partials: an all-gather, then this rank's rows summed in rank order (the group's fp32
/// all-reduce is NCCL's ring, whose order differs from the CPU's); bf16: the group's all-reduce
/// (rank order). Combine bytes use ring all-reduce accounting: 2 (R-1)/R x N x H x (4 | 2).
class NaiveCuda final : public GatherCuda {
 public:
  NaiveCuda(std::shared_ptr<Group> group, const DispatchConfig& cfg) : GatherCuda("naive", std::move(group), cfg) {
    caps_.gathers_all_tokens = true;
    caps_.combine_addend = true;
  }

  /// expert_out [N, H] fp32 | bf16 (N = num_recv_tokens of the last prepare); out [T, H] bf16.
  void finalize(const FinalizeArgs& args) override {
    const int64_t H = cfg_.hidden;
    cuda::DeviceGuard guard(device().index);
    if (padded_) {
      finalize_padded(args);
      stats_.remote_bytes_combine = num_ranks_ > 1 ? 2 * (num_ranks_ - 1) * num_rows_ * H * dtype_size(partial_dtype()) / num_ranks_ : 0;
      return;
    }
    begin_finalize(args, {num_exposed_rows_, H}, args.stream);
    const DType dt = partial_dtype();
    const int64_t es = dtype_size(dt);
    const int64_t T = tokens_per_rank_[static_cast<size_t>(rank_)];
    FinishParams fp;
    fp.n = T * H;
    fp.addend = args.addend.defined() ? args.addend.ptr<const float>() : nullptr;
    fp.out = args.out.ptr<uint16_t>();
    if (dt == DType::fp32) {
      uint8_t* all = static_cast<uint8_t*>(reduced_.ensure(num_ranks_ * num_rows_ * H * es, device()));
      if (num_rows_ > 0) group_->all_gather(partials(args), all, num_rows_ * H * es, args.stream);
      fp.parts = all + token_offset_ * H * es;
      fp.parts_f32 = true;
      fp.num_ranks = num_ranks_;
      fp.rank_stride = num_rows_ * H;
    } else {
      uint8_t* reduced = static_cast<uint8_t*>(reduced_.ensure(num_rows_ * H * es, device()));
      group_->all_reduce_sum(partials(args), reduced, num_rows_ * H, DType::bf16, args.stream);
      fp.parts = reduced + token_offset_ * H * es;
    }
    launch_finish_rows(fp, args.stream);
    stats_.remote_bytes_combine = num_ranks_ > 1 ? 2 * (num_ranks_ - 1) * num_rows_ * H * es / num_ranks_ : 0;
  }

 protected:
  /// fp32: all-gather of every rank's [N, H] partials (summed in rank order by the finish); bf16: the
  /// group's all-reduce. Returns this rank's first row of the result.
  const void* combine_collectives(const void* parts, Stream stream) override {
    const int64_t H = cfg_.hidden, es = dtype_size(partial_dtype());
    if (partial_dtype() == DType::fp32) {
      uint8_t* all = static_cast<uint8_t*>(reduced_.ensure(num_ranks_ * num_rows_ * H * es, device()));
      if (num_rows_ > 0) group_->all_gather(parts, all, num_rows_ * H * es, stream);
      return all + token_offset_ * H * es;
    }
    uint8_t* reduced = static_cast<uint8_t*>(reduced_.ensure(num_rows_ * H * es, device()));
    group_->all_reduce_sum(parts, reduced, num_rows_ * H, DType::bf16, stream);
    return reduced + token_offset_ * H * es;
  }
  void finish_shape(FinishParams& fp) const override {
    if (!fp.parts_f32) return;
    fp.num_ranks = num_ranks_;
    fp.rank_stride = num_rows_ * cfg_.hidden;
  }

 private:
  DeviceBuffer reduced_;
};

/// finalize = reduce_scatterv (rank order) of the [N, H] partials: bf16 without an addend straight
/// into out, else into fp32 / bf16 sums that launch_finish_rows adds the addend to and rounds.
/// Combine bytes: the rows of other ranks' tokens this rank sends, (N - T) x H x (4 | 2).
class AgrsCuda final : public GatherCuda {
 public:
  AgrsCuda(std::shared_ptr<Group> group, const DispatchConfig& cfg) : GatherCuda("allgather_reducescatter", std::move(group), cfg) {
    caps_.gathers_all_tokens = true;
    caps_.combine_addend = true;
  }

  void finalize(const FinalizeArgs& args) override {
    const int64_t H = cfg_.hidden;
    cuda::DeviceGuard guard(device().index);
    if (padded_) {
      finalize_padded(args);
      stats_.remote_bytes_combine = (num_ranks_ - 1) * padded_rows() * H * dtype_size(partial_dtype());
      return;
    }
    begin_finalize(args, {num_exposed_rows_, H}, args.stream);
    std::vector<int64_t> counts(static_cast<size_t>(num_ranks_));
    for (int r = 0; r < num_ranks_; ++r) counts[static_cast<size_t>(r)] = tokens_per_rank_[static_cast<size_t>(r)] * H;
    const DType dt = partial_dtype();
    const int64_t T = tokens_per_rank_[static_cast<size_t>(rank_)];
    if (dt == DType::bf16 && !args.addend.defined()) {
      group_->reduce_scatterv(partials(args), args.out.data, counts, DType::bf16, args.stream);
    } else {
      void* sum = sum_.ensure(T * H * dtype_size(dt), device());
      group_->reduce_scatterv(partials(args), sum, counts, dt, args.stream);
      FinishParams fp;
      fp.parts = sum;
      fp.parts_f32 = dt == DType::fp32;
      fp.n = T * H;
      fp.addend = args.addend.defined() ? args.addend.ptr<const float>() : nullptr;
      fp.out = args.out.ptr<uint16_t>();
      launch_finish_rows(fp, args.stream);
    }
    stats_.remote_bytes_combine = (num_rows_ - T) * H * dtype_size(dt);
  }

 protected:
  /// Padded: reduce-scatter of C rows per rank (rank order) into this rank's [C, H] sums.
  const void* combine_collectives(const void* parts, Stream stream) override {
    const int64_t H = cfg_.hidden, C = padded_rows();
    const DType dt = partial_dtype();
    void* sum = sum_.ensure(C * H * dtype_size(dt), device());
    group_->reduce_scatterv(parts, sum, std::vector<int64_t>(static_cast<size_t>(num_ranks_), C * H), dt, stream);
    return sum;
  }

 private:
  DeviceBuffer sum_;
};

}  // namespace

std::unique_ptr<PrepareFinalize> make_naive_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<NaiveCuda>(std::move(group), cfg);
}

std::unique_ptr<PrepareFinalize> make_agrs_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<AgrsCuda>(std::move(group), cfg);
}

}  // namespace epx::dispatch
