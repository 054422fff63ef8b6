#include "dispatch/prepare_finalize_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>

#include "cuda/check.h"
#include "epx/cuda.h"
#include "epx/quant.h"

namespace epx::dispatch {

void* DeviceBuffer::ensure(int64_t bytes, Device device) {
  EPX_ASSERT(bytes >= 0 && device.is_cuda(), "bytes=", bytes, " device=", device.str());
  if (bytes > capacity_ || (storage_.defined() && storage_.device() != device)) {
    const int64_t grown = std::max<int64_t>(bytes, capacity_ + capacity_ / 2);
    storage_ = Tensor();  // free first: the old and the new buffer need not fit together
    storage_ = Tensor::empty({grown}, DType::uint8, device);
    capacity_ = grown;
  }
  return storage_.data();
}

CudaPrepareFinalize::CudaPrepareFinalize(const std::string& name, std::shared_ptr<Group> group, const DispatchConfig& cfg)
    : PrepareFinalizeBase(name, ActivationLayout::Flat, false, std::move(group), cfg) {
  EPX_ASSERT(group_->device().is_cuda(), "group device = ", group_->device().str());
  cuda::ensure_runtime();
}

std::vector<std::vector<int64_t>> CudaPrepareFinalize::begin_prepare(const DispatchArgs& args, bool rank_dedup) {
  const int R = num_ranks_, nf = plan_record_fields(R);
  const Stream stream = args.stream;
  cuda::DeviceGuard guard(device().index);
  LocalError err = check_args(args);
  std::vector<int64_t> all(static_cast<size_t>(nf) * static_cast<size_t>(R));
  if (err.kind == LocalError::none) {
    PlanParams p;
    p.topk_idx = args.topk_idx.data;
    p.idx_is_i64 = args.topk_idx.dtype == DType::int64;
    p.num_tokens = args.x.shape[0];
    p.top_k = cfg_.top_k;
    p.placement = placement_;
    p.src_rank = rank_;
    p.send_pos = rank_dedup ? static_cast<int32_t*>(send_pos_.ensure(p.num_tokens * R * 4, device())) : nullptr;
    p.record = static_cast<int64_t*>(record_.ensure(nf * 8, device()));
    launch_plan(p, stream);
    // Device record in, host table out: the group stages the output and waits, bounded by timeout_s.
    group_->all_gather(p.record, all.data(), nf * 8, stream);
  } else {
    std::vector<int64_t> mine(static_cast<size_t>(nf), 0);
    mine[kPlanStatus] = err.kind;
    mine[kPlanBadIndex] = -1;
    group_->all_gather(mine.data(), all.data(), nf * 8, stream);
  }
  auto field = [&](int r, int f) { return all[static_cast<size_t>(r) * nf + f]; };
  bool any_bad = false;
  for (int r = 0; r < R; ++r) any_bad = any_bad || field(r, kPlanStatus) != LocalError::none || field(r, kPlanBadIndex) >= 0;
  if (any_bad) {
    const int64_t bad = field(rank_, kPlanBadIndex);
    if (err.kind == LocalError::none && bad >= 0) {
      // The sentence of the CPU reference, for the first bad entry in row-major order.
      int64_t value = 0;
      const bool i64 = args.topk_idx.dtype == DType::int64;
      if (i64) {
        EPX_CUDA_CHECK(cudaMemcpy(&value, args.topk_idx.ptr<const int64_t>() + bad, 8, cudaMemcpyDeviceToHost));
      } else {
        int32_t v32 = 0;
        EPX_CUDA_CHECK(cudaMemcpy(&v32, args.topk_idx.ptr<const int32_t>() + bad, 4, cudaMemcpyDeviceToHost));
        value = v32;
      }
      err = {LocalError::invalid_argument, bad_topk_id(op_prepare_, cfg_, bad / cfg_.top_k, bad % cfg_.top_k, value).what()};
    }
    exchange_status(*group_, op_prepare_, err, {}, stream);  // throws on every rank
    EPX_ASSERT(false, "exchange_status returned although a rank reported a failure");
  }

  std::vector<std::vector<int64_t>> table(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) table[static_cast<size_t>(r)].assign(all.begin() + static_cast<int64_t>(r) * nf, all.begin() + static_cast<int64_t>(r + 1) * nf);
  stats_ = {};
  stats_.num_valid_selections = field(rank_, kPlanValid);
  stats_.num_rank_dedup_rows = field(rank_, kPlanDedupRows);
  prepared_ = true;
  prepared_tokens_ = args.x.shape[0];

  src_row_offset_.assign(static_cast<size_t>(R) + 1, 0);
  for (int s = 0; s < R; ++s)
    src_row_offset_[static_cast<size_t>(s) + 1] =
        src_row_offset_[static_cast<size_t>(s)] + (rank_dedup ? field(s, kPlanDestCounts + rank_) : field(s, kPlanTokens));
  // The stream has just drained (the exchange waited on it), so this small pageable copy cannot wait
  // on a collective.
  void* dev = src_row_offset_dev_.ensure(8 * (R + 1), device());
  EPX_CUDA_CHECK(cudaMemcpyAsync(dev, src_row_offset_.data(), 8 * static_cast<size_t>(R + 1), cudaMemcpyHostToDevice, cuda::native(stream)));
  return table;
}

void CudaPrepareFinalize::encode_rows(const DispatchArgs& args, uint8_t* rows) {
  cuda::DeviceGuard guard(device().index);
  const RowCodec c = codec();
  const int64_t T = args.x.shape[0], H = c.hidden, rb = c.row_bytes();
  if (rows == nullptr) rows = static_cast<uint8_t*>(rows_.ensure(T * rb, device()));
  if (T == 0) return;
  if (c.use_fp8) {
    TensorView q(rows, DType::fp8_e4m3, {T, H}, device());
    q.strides[0] = rb;
    TensorView scales(rows + c.payload_bytes(), DType::fp32, {T, H / kFp8GroupSize}, device());
    scales.strides[0] = rb / 4;
    quantize_fp8_per_token_group(args.x, q, scales, kFp8GroupSize, c.use_ue8m0, args.stream);
  }
  PackParams p;
  p.x = args.x.ptr<const uint16_t>();
  p.topk_idx = args.topk_idx.data;
  p.idx_is_i64 = args.topk_idx.dtype == DType::int64;
  p.topk_weights = args.topk_weights.ptr<const float>();
  p.num_tokens = T;
  p.codec = c;
  p.rows = rows;
  launch_pack_rows(p, args.stream);
}

CudaPrepareFinalize::~CudaPrepareFinalize() = default;

LocalError CudaPrepareFinalize::padded_plan(const DispatchArgs& args, int64_t* record, bool rank_dedup) {
  cuda::DeviceGuard guard(device().index);
  if (!report_) {  // the host-mapped report, once
    void* host = nullptr;
    EPX_CUDA_CHECK(cudaHostAlloc(&host, sizeof(PaddedReport), cudaHostAllocMapped));
    report_ = std::shared_ptr<PaddedReport>(new (host) PaddedReport(), [](PaddedReport* r) { (void)cudaFreeHost(r); });
    void* dev = nullptr;
    EPX_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
    report_dev_ = static_cast<PaddedReport*>(dev);
    call_bad_.ensure(4, device());
  }
  const LocalError err = check_args(args);
  const bool ok = err.kind == LocalError::none;
  PlanParams p;
  p.topk_idx = ok ? args.topk_idx.data : nullptr;
  p.idx_is_i64 = ok && args.topk_idx.dtype == DType::int64;
  p.num_tokens = ok ? args.x.shape[0] : 0;
  p.top_k = cfg_.top_k;
  p.placement = placement_;
  p.src_rank = rank_;
  p.num_tokens_dev = ok && args.num_tokens.defined() ? args.num_tokens.ptr<const int32_t>() : nullptr;
  p.forced_status = ok ? 0 : static_cast<int64_t>(err.kind);
  p.send_pos = rank_dedup ? static_cast<int32_t*>(send_pos_.ensure(std::max<int64_t>(p.num_tokens, 1) * num_ranks_ * 4, device())) : nullptr;
  p.record = record;
  launch_plan(p, args.stream);
  return err;
}

PrepareResult CudaPrepareFinalize::decode_padded(const uint8_t* blocks, int64_t num_rows, bool dest_counts, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const RowCodec c = codec();
  const int64_t N = num_rows, H = c.hidden, K = c.top_k, L = num_local_;
  const Device dev = device();
  UnpackParams p;
  p.rows = blocks;
  p.num_rows = N;
  p.codec = c;
  p.placement = placement_;
  p.dst_rank = rank_;
  p.num_src_ranks = num_ranks_;
  p.x = static_cast<uint8_t*>(x_.ensure(N * c.payload_bytes(), dev));
  p.x_scales = c.use_fp8 ? static_cast<float*>(x_scales_.ensure(N * c.scale_bytes(), dev)) : nullptr;
  p.topk_idx = static_cast<int32_t*>(topk_idx_.ensure(N * K * 4, dev));
  p.topk_weights = static_cast<float*>(topk_weights_.ensure(N * K * 4, dev));
  p.recv_count = static_cast<int32_t*>(recv_count_.ensure(L * 4, dev));
  p.num_local = static_cast<int>(L);
  p.rows_per_block = padded_rows();
  p.header_bytes = padded_header_bytes(num_ranks_);
  p.block_bytes = padded_block_bytes(num_ranks_, padded_rows(), c.row_bytes());
  p.dest_counts = dest_counts;
  p.call_bad = call_bad_.ptr<int32_t>();
  p.report = report_dev_;
  launch_unpack_rows(p, stream);

  PrepareResult r;
  r.layout = ActivationLayout::Flat;
  r.x = TensorView(p.x, c.use_fp8 ? DType::fp8_e4m3 : DType::bf16, {N, H}, dev);
  if (c.use_fp8) r.x_scales = TensorView(p.x_scales, DType::fp32, {N, H / kFp8GroupSize}, dev);
  r.recv_count = TensorView(p.recv_count, DType::int32, {L}, dev);
  r.topk_idx = TensorView(p.topk_idx, DType::int32, {N, K}, dev);
  r.topk_weights = TensorView(p.topk_weights, DType::fp32, {N, K}, dev);
  r.num_recv_tokens = N;
  return r;
}

const void* CudaPrepareFinalize::nan_partials(int64_t bytes, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  void* p = nan_.ensure(std::max<int64_t>(bytes, 1), device());
  EPX_CUDA_CHECK(cudaMemsetAsync(p, 0xff, static_cast<size_t>(std::max<int64_t>(bytes, 1)), cuda::native(stream)));
  return p;
}

std::optional<std::string> CudaPrepareFinalize::take_padded_report() {
  if (!report_) return std::nullopt;
  const volatile PaddedReport* r = report_.get();
  const int64_t epoch = r->epoch;
  if (epoch == seen_epoch_) return std::nullopt;
  std::atomic_thread_fence(std::memory_order_acquire);
  seen_epoch_ = epoch;
  const int64_t bad = r->bad_rank, status = r->status, index = r->bad_index, value = r->value;
  const std::string after = " (read on the device): that prepare moved nothing on any rank (every Flat row padding)";
  if (status == kPlanBadNumTokens)
    return arg_message(op_prepare_, "num_tokens", value, "must be in [0, x.shape[0]] (rank " + std::to_string(bad) + ")" + after);
  if (index >= 0)
    return std::string(bad_topk_id(op_prepare_, cfg_, index / cfg_.top_k, index % cfg_.top_k, value).what()) + " (rank " +
           std::to_string(bad) + ")" + after;
  if (bad == rank_) return std::nullopt;  // this rank's host threw its own rejection already
  return op_prepare_ + ": rank " + std::to_string(bad) + " rejected its arguments (see that rank's error)" + after;
}

void CudaPrepareFinalize::throw_padded_report() {
  if (defer_errors_) return;
  if (auto e = take_padded_report()) throw InvalidArgument(*e);
}

PrepareResult CudaPrepareFinalize::decode_rows(const uint8_t* rows, int64_t num_rows, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const RowCodec c = codec();
  const int64_t N = num_rows, H = c.hidden, K = c.top_k, L = num_local_;
  const Device dev = device();
  UnpackParams p;
  p.rows = rows;
  p.num_rows = N;
  p.codec = c;
  p.placement = placement_;
  p.dst_rank = rank_;
  p.num_src_ranks = num_ranks_;
  p.src_row_offset = src_row_offset_dev_.ptr<const int64_t>();
  p.x = static_cast<uint8_t*>(x_.ensure(N * c.payload_bytes(), dev));
  p.x_scales = c.use_fp8 ? static_cast<float*>(x_scales_.ensure(N * c.scale_bytes(), dev)) : nullptr;
  p.topk_idx = static_cast<int32_t*>(topk_idx_.ensure(N * K * 4, dev));
  p.topk_weights = static_cast<float*>(topk_weights_.ensure(N * K * 4, dev));
  p.recv_count = static_cast<int32_t*>(recv_count_.ensure(L * 4, dev));
  p.num_local = static_cast<int>(L);
  launch_unpack_rows(p, stream);

  PrepareResult r;
  r.layout = ActivationLayout::Flat;
  r.x = TensorView(p.x, c.use_fp8 ? DType::fp8_e4m3 : DType::bf16, {N, H}, dev);
  if (c.use_fp8) r.x_scales = TensorView(p.x_scales, DType::fp32, {N, H / kFp8GroupSize}, dev);
  r.recv_count = TensorView(p.recv_count, DType::int32, {L}, dev);
  r.topk_idx = TensorView(p.topk_idx, DType::int32, {N, K}, dev);
  r.topk_weights = TensorView(p.topk_weights, DType::fp32, {N, K}, dev);
  r.num_recv_tokens = N;
  return r;
}

}  // namespace epx::dispatch
