// dispatch/all2allv_cuda.cpp: "all2allv" on a CUDA group, the CUDA twin of dedup_cpu.h: a token
// goes once to each destination rank holding >= 1 of its selections; rows ordered by source rank,
// then source token; the reverse all_to_allv brings each destination's weighted partial (fp32, or
// bf16 with flat_combine partial_bf16) back and the source sums them in fp32 in destination-rank
// order, then the addend, rounding once (zeros for a token that
// went nowhere). Stats as the CPU reference (deepep-ht accounting).
//
// prepare: plan (also each token's row in each destination block) + exchange (one host sync),
// encode rows once, scatter them into destination blocks, one all_to_allv, decode.
// Padded form (use_worst_case_sizing; prepare_finalize_cuda.h): every destination block has the plan
// record and C rows (row send_pos[t, d]), one all-to-all of equal blocks both ways (the group's grouped
// ncclSend/ncclRecv), the counts on the device: no host wait, graph-safe. Bytes: R x C rows per rank
// whatever the routing (the price of a fixed size; bench/NOTES.md).
#include <cuda_runtime_api.h>

#include "cuda/check.h"
#include "dispatch/backends.h"
#include "dispatch/prepare_finalize_cuda.h"

namespace epx::dispatch {
namespace {

class All2allvCuda final : public CudaPrepareFinalize {
 public:
  All2allvCuda(std::shared_ptr<Group> group, const DispatchConfig& cfg) : CudaPrepareFinalize("all2allv", std::move(group), cfg) {
    caps_.combine_addend = true;
  }

  PrepareResult prepare(const DispatchArgs& args) override {
    cuda::DeviceGuard guard(device().index);
    if (padded_) return prepare_padded(args);
    const auto table = begin_prepare(args, /*rank_dedup=*/true);
    const int R = num_ranks_;
    const int64_t rb = codec().row_bytes(), T = args.x.shape[0];
    count_matrix_.assign(static_cast<size_t>(R), std::vector<int64_t>(static_cast<size_t>(R)));
    for (int s = 0; s < R; ++s)
      for (int d = 0; d < R; ++d) count_matrix_[static_cast<size_t>(s)][static_cast<size_t>(d)] = table[static_cast<size_t>(s)][kPlanDestCounts + d];
    encode_rows(args);

    std::vector<int64_t> send_bytes(static_cast<size_t>(R)), recv_bytes(static_cast<size_t>(R));
    num_send_ = 0;
    stats_.remote_bytes_dispatch = 0;
    for (int d = 0; d < R; ++d) {
      const int64_t n = count_matrix_[static_cast<size_t>(rank_)][static_cast<size_t>(d)];
      num_send_ += n;
      send_bytes[static_cast<size_t>(d)] = n * rb;
      if (d != rank_) stats_.remote_bytes_dispatch += n * rb;
      recv_bytes[static_cast<size_t>(d)] = count_matrix_[static_cast<size_t>(d)][static_cast<size_t>(rank_)] * rb;
    }
    num_recv_ = src_row_offset_.back();
    ScatterParams sp;
    sp.rows = rows_.ptr<const uint8_t>();
    sp.num_tokens = T;
    sp.num_ranks = R;
    sp.row_bytes = rb;
    sp.send_pos = send_pos_.ptr<const int32_t>();
    sp.dest_counts = device_record() + kPlanDestCounts;
    sp.send = static_cast<uint8_t*>(send_.ensure(num_send_ * rb, device()));
    launch_scatter_rows(sp, args.stream);
    uint8_t* recv = static_cast<uint8_t*>(recv_.ensure(num_recv_ * rb, device()));
    group_->all_to_allv(sp.send, send_bytes, recv, recv_bytes, args.stream);
    return decode_rows(recv, num_recv_, args.stream);
  }

  /// expert_out [N_recv, H] fp32 | bf16 (row = this rank's weighted partial for that token, as
  /// flat_combine says); out [T, H] bf16; FinalizeArgs::addend joins before the one rounding.
  void finalize(const FinalizeArgs& args) override {
    const int64_t H = cfg_.hidden, row = dtype_size(partial_dtype()) * H;
    const int R = num_ranks_;
    cuda::DeviceGuard guard(device().index);
    if (padded_) return finalize_padded(args);
    begin_finalize(args, {num_recv_, H}, args.stream);
    std::vector<int64_t> send_bytes(static_cast<size_t>(R)), recv_bytes(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      send_bytes[static_cast<size_t>(r)] = count_matrix_[static_cast<size_t>(r)][static_cast<size_t>(rank_)] * row;
      recv_bytes[static_cast<size_t>(r)] = count_matrix_[static_cast<size_t>(rank_)][static_cast<size_t>(r)] * row;
      if (r != rank_) stats_.remote_bytes_combine += send_bytes[static_cast<size_t>(r)];
    }
    void* back = back_.ensure(num_send_ * row, device());
    group_->all_to_allv(args.expert_out.data, send_bytes, back, recv_bytes, args.stream);
    CombineParams cp;
    cp.back = back;
    cp.back_f32 = partial_dtype() == DType::fp32;
    cp.addend = args.addend.defined() ? args.addend.ptr<const float>() : nullptr;
    cp.num_tokens = prepared_tokens_;
    cp.hidden = H;
    cp.num_ranks = R;
    cp.send_pos = send_pos_.ptr<const int32_t>();
    cp.dest_counts = device_record() + kPlanDestCounts;
    cp.out = args.out.ptr<uint16_t>();
    launch_combine_rows(cp, args.stream);
  }

 private:
  /// Padded: the plan record heads each destination's block of C rows (row send_pos[t, d] of block d),
  /// one all-to-all of equal blocks (one grouped ncclSend/ncclRecv), decode.
  PrepareResult prepare_padded(const DispatchArgs& args) {
    const int R = num_ranks_;
    const int64_t C = padded_rows(), rb = codec().row_bytes();
    const int64_t hb = padded_header_bytes(R), bb = padded_block_bytes(R, C, rb);
    int64_t* record = static_cast<int64_t*>(record_.ensure(8 * plan_record_fields(R), device()));
    const LocalError err = padded_plan(args, record, /*rank_dedup=*/true);
    const bool ok = err.kind == LocalError::none;
    const int64_t T = ok ? args.x.shape[0] : 0;
    if (ok) encode_rows(args);
    ScatterParams sp;
    sp.rows = rows_.ptr<const uint8_t>();
    sp.num_tokens = T;
    sp.num_ranks = R;
    sp.row_bytes = rb;
    sp.send_pos = send_pos_.ptr<const int32_t>();
    sp.send = static_cast<uint8_t*>(send_.ensure(R * bb, device()));
    sp.block_bytes = bb;
    sp.header_bytes = hb;
    sp.record = record;
    sp.record_fields = plan_record_fields(R);
    launch_scatter_rows(sp, args.stream);
    uint8_t* recv = static_cast<uint8_t*>(recv_.ensure(R * bb, device()));
    const std::vector<int64_t> blocks(static_cast<size_t>(R), bb);
    group_->all_to_allv(sp.send, blocks, recv, blocks, args.stream);
    num_recv_ = num_local_ > 0 ? R * C : 0;  // a rank without experts exposes no rows (and sends zeros back)
    stats_ = {};
    stats_.num_valid_selections = -1;  // on the device only
    stats_.num_rank_dedup_rows = -1;
    stats_.remote_bytes_dispatch = (R - 1) * bb;
    PrepareResult res = decode_padded(recv, num_recv_, /*dest_counts=*/true, args.stream);
    if (!ok) {  // the peers' finalize runs the reverse all-to-all: this rank's part of it goes now (NaN)
      prepared_ = false;
      back_collective(nan_partials(R * C * dtype_size(partial_dtype()) * cfg_.hidden, args.stream), args.stream);
      if (err.kind == LocalError::unsupported) throw Unsupported(err.message);
      throw InvalidArgument(err.message);
    }
    prepared_ = true;
    prepared_tokens_ = args.x.shape[0];
    return res;
  }

  /// Padded: the reverse all-to-all of C partial rows per peer into back_ [R, C, H].
  void* back_collective(const void* expert_out, Stream stream) {
    const int64_t row = dtype_size(partial_dtype()) * cfg_.hidden, C = padded_rows();
    void* back = back_.ensure(num_ranks_ * C * row, device());
    const std::vector<int64_t> blocks(static_cast<size_t>(num_ranks_), C * row);
    group_->all_to_allv(expert_out, blocks, back, blocks, stream);
    return back;
  }

  void finalize_padded(const FinalizeArgs& args) {
    const int64_t H = cfg_.hidden;
    const LocalError err = check_finalize(args, {num_recv_, H});
    const int64_t all_rows = num_ranks_ * padded_rows(), row = dtype_size(partial_dtype()) * H;
    if (err.kind != LocalError::none) {
      back_collective(nan_partials(all_rows * row, args.stream), args.stream);
      prepared_ = false;
      if (err.kind == LocalError::unsupported) throw Unsupported(err.message);
      throw InvalidArgument(err.message);
    }
    CombineParams cp;
    const void* parts = args.expert_out.data;
    if (num_recv_ == 0) {  // no experts here: zeros back
      parts = zeros_.ensure(all_rows * row, device());
      EPX_CUDA_CHECK(cudaMemsetAsync(zeros_.data(), 0, static_cast<size_t>(all_rows * row), cuda::native(args.stream)));
    }
    cp.back = back_collective(parts, args.stream);
    cp.back_f32 = partial_dtype() == DType::fp32;
    cp.addend = args.addend.defined() ? args.addend.ptr<const float>() : nullptr;
    cp.num_tokens = prepared_tokens_;
    cp.hidden = H;
    cp.num_ranks = num_ranks_;
    cp.send_pos = send_pos_.ptr<const int32_t>();
    cp.out = args.out.ptr<uint16_t>();
    cp.rows_per_block = padded_rows();
    cp.call_bad = call_bad();
    launch_combine_rows(cp, args.stream);
    stats_.remote_bytes_combine = (num_ranks_ - 1) * padded_rows() * H * dtype_size(partial_dtype());
    throw_padded_report();
  }

  std::vector<std::vector<int64_t>> count_matrix_;  ///< [R src][R dst] rows, from the plan exchange
  int64_t num_send_ = 0, num_recv_ = 0;
  DeviceBuffer send_, recv_, back_, zeros_;
};

}  // namespace

std::unique_ptr<PrepareFinalize> make_all2allv_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<All2allvCuda>(std::move(group), cfg);
}

}  // namespace epx::dispatch
