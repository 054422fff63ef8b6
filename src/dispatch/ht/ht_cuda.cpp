// dispatch/ht/ht_cuda.cpp: the ht backend object on a CUDA group (contract: ht_cuda.h): argument
// checks, the symmetric buffer, the host-mapped record, and the host side of prepare / finalize.
//
// Host waits: none in worst-case mode (use_worst_case_sizing; graph-safe). Otherwise prepare reads
// N_recv once: it launches the layout and dispatch kernels back to back and then polls the
// host-mapped record that the layout kernel writes (not the stream), bounded by timeout_s, so the
// dispatch kernel is already running while the host reads. finalize never waits.
// Errors: argument errors found on the host are published to the peers through the count exchange
// (status word) before this rank throws, so every rank of a prepare throws InvalidArgument and
// nothing moves; a bad topk_idx found by the layout kernel does the same (in worst-case mode that
// dispatch moves nothing, N_recv = 0, and a later finalize throws it after its launch, or
// take_device_error takes it). A finalize argument error throws on this rank only (the peers' waits
// then expire with Timeout naming it).
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <thread>
#include <algorithm>

#include "cuda/check.h"
#include "dispatch/backends.h"
#include "dispatch/ht/ht_cuda.h"
#include "epx/config.h"
#include "epx/cuda.h"

namespace epx::dispatch {
namespace {

const char* op_name(int32_t op) { return op == 2 ? "finalize (combine)" : op == 1 ? "prepare (dispatch rows)" : "prepare (layout)"; }

std::string seconds(double s) {
  std::string t = std::to_string(s);
  while (!t.empty() && t.back() == '0') t.pop_back();
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t;
}

}  // namespace

HtCuda::HtCuda(std::shared_ptr<Group> group, const DispatchConfig& cfg) : HtCuda(std::move(group), cfg, Config::load()) {}

HtCuda::HtCuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const Config& config)
    : PrepareFinalizeBase("ht", ActivationLayout::Flat, true, std::move(group), cfg) {
  const std::string op = "ht.create";
  if (!group_->device().is_cuda()) throw Unsupported(op + ": group " + group_->name() + " is not a CUDA group: ht on CUDA needs symmetric memory");
  caps_.graph_safe = cfg_.use_worst_case_sizing;
  caps_.combine_addend = true;
  accepts_device_num_tokens_ = true;
  require_arg(op, "num_ranks", num_ranks_, num_ranks_ <= kHtMaxRanks,
              "must be <= " + std::to_string(kHtMaxRanks) + " for ht on CUDA (one NVLink domain; peer pointers ride in the kernel parameters)");
  require_arg(op, "num_max_dispatch_tokens_per_rank", cfg_.num_max_dispatch_tokens_per_rank, cfg_.num_max_dispatch_tokens_per_rank >= 1,
              "must be >= 1 for ht on CUDA (its buffers are sized for R * num_max_dispatch_tokens_per_rank rows at create)");
  require_arg(op, "hidden", cfg_.hidden, cfg_.dispatch_dtype == DType::fp8_e4m3 || cfg_.hidden % 8 == 0, "must be a multiple of 8");
  timeout_s_ = group_->timeout_s();
  cuda::DeviceGuard guard(group_->device().index);
  int sms = 0;
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, group_->device().index));
  require_arg(op, "ht_num_sms", config.ht_num_sms, config.ht_num_sms >= 1 && config.ht_num_sms <= sms,
              "must be in [1, SMs of " + group_->device().str() + " = " + std::to_string(sms) + "] (Config / EPX_HT_NUM_SMS)");
  require_arg(op, "ht_warps_per_block", config.ht_warps_per_block, config.ht_warps_per_block >= 1 && config.ht_warps_per_block <= 16,
              "must be in [1, 16] for ht on CUDA (512-thread CTAs keep 128 registers per thread; Config / EPX_HT_WARPS_PER_BLOCK)");
  // Ranks sharing this GPU (virtual ranks) each take at most their share of its SMs: the combine's
  // CTAs wait on peers, so every rank's grid must be resident at once.
  // The share counts the one-CTA layout kernel, which runs beside the dispatch CTAs (programmatic
  // dependent launch) and waits on peers too.
  const int sharing = std::max(1, group_->ranks_per_gpu());
  num_sms_ = std::min(config.ht_num_sms, sharing > 1 ? sms / sharing - 1 : sms);
  require_arg(op, "ranks_per_gpu", sharing, num_sms_ >= 1,
              "must be <= the SMs of " + group_->device().str() + " = " + std::to_string(sms) + " (each rank's ht grid needs one SM)");
  warps_ = config.ht_warps_per_block;
  chunk_rows_ = config.ht_chunk_rows;
  pdl_ = config.ht_pdl != 0;
  // 7 steps (28 groups) when the row is a whole number of them (H = 7168: two rounds), else 4.
  fp8_unroll_ = cfg_.hidden % (128 * 28) == 0 ? 7 : 4;

  layout_ = HtLayout::make(cfg_, num_ranks_, rank_);
  arrays_ = HtDeviceArrays::make(layout_);
  symmetric_ = group_->alloc_symmetric(layout_.symmetric_bytes);  // collective, zero-filled
  for (int r = 0; r < num_ranks_; ++r)
    if (symmetric_.peers[static_cast<size_t>(r)] == nullptr)
      throw Unsupported(op + ": rank " + std::to_string(r) + " is not load/store-accessible from rank " + std::to_string(rank_) +
                        ": ht on CUDA needs every rank in one NVLink (LSA) domain");
  state_ = Tensor::zeros({arrays_.bytes}, DType::uint8, group_->device());
  if (cfg_.expert_contiguous) {
    // Worst case: every received row selects min(K, L) distinct local experts, plus the padding.
    const int64_t L = num_local_, K = cfg_.top_k;
    contig_cap_ = layout_.rows() * std::min(K, L) + L * (cfg_.expert_alignment - 1);
    const Device dev = group_->device();
    contig_x_ = Tensor::empty({std::max<int64_t>(contig_cap_, 1), layout_.payload_bytes()}, DType::uint8, dev);
    if (layout_.use_fp8) contig_scales_ = Tensor::empty({std::max<int64_t>(contig_cap_, 1), layout_.groups()}, DType::fp32, dev);
    contig_offsets_ = Tensor::zeros({L + 1}, DType::int32, dev);
    contig_row_expert_ = Tensor::empty({std::max<int64_t>(contig_cap_, 1)}, DType::int32, dev);
    contig_src_ = Tensor::empty({std::max<int64_t>(contig_cap_, 1)}, DType::int32, dev);
    contig_pair_row_ = Tensor::empty({layout_.rows(), K}, DType::int32, dev);
  }
  void* host = nullptr;
  EPX_CUDA_CHECK(cudaHostAlloc(&host, sizeof(HtHostRecord), cudaHostAllocMapped));
  record_host_ = new (host) HtHostRecord();
  void* dev = nullptr;
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
  record_dev_ = static_cast<HtHostRecord*>(dev);
  // Every rank has zeroed its buffer before anyone's first prepare can publish into it.
  group_->barrier();
}

HtCuda::~HtCuda() {
  if (record_host_) (void)cudaFreeHost(record_host_);
}

std::optional<std::string> HtCuda::take_bad_layout(const std::string& op, bool own_only) {
  const volatile HtHostRecord* rec = record_host_;
  if (!cfg_.use_worst_case_sizing) return std::nullopt;
  const uint64_t epoch = rec->bad_epoch;  // the last bad layout's epoch, written after its details
  std::atomic_thread_fence(std::memory_order_acquire);
  if (epoch == 0 || epoch <= reported_bad_epoch_) return std::nullopt;
  // Worst-case mode never waits in prepare: a bad argument found by the layout kernel surfaces here.
  reported_bad_epoch_ = epoch;
  const int bad_rank = rec->bad_rank;
  const int64_t bad_index = rec->bad_index;
  if (rec->bad_num_tokens)
    return op + ": an earlier prepare was rejected: its num_tokens = " + std::to_string(rec->bad_num_tokens_value) +
           " (read on the device) was outside [0, x.shape[0]]: it moved nothing (N_recv = 0, every topk_idx -1)";
  if (own_only && bad_index < 0) return std::nullopt;  // another rank's finding: that rank reports it
  return op + ": an earlier prepare was rejected by rank " + std::to_string(bad_rank) +
         (bad_rank == rank_ && bad_index >= 0
              ? " (this rank: topk_idx[" + std::to_string(bad_index / cfg_.top_k) + ", " + std::to_string(bad_index % cfg_.top_k) +
                    "] out of range)"
              : std::string()) +
         ": it moved nothing (N_recv = 0, every topk_idx -1)";
}

std::optional<std::string> HtCuda::take_device_error() {
  if (dead_) return std::nullopt;  // the next call throws CommError
  return take_bad_layout(op_prepare_, true);
}

void HtCuda::throw_sticky_error(const std::string& op) {
  if (dead_) throw CommError(op + ": this ht object timed out earlier: create a new one (all ranks)");
  const volatile HtHostRecord* rec = record_host_;
  // (Worst-case mode's bad-argument verdict of an earlier prepare is not thrown here, before a launch: a
  // rank whose host saw it first would stop alone while its peers' kernels wait; finalize throws it after
  // its launch, or take_device_error takes it.)
  if (rec->error_code != 0) {
    dead_ = true;
    throw Timeout(op + ": no signal from rank " + std::to_string(rec->error_peer) + " within timeout_s = " + seconds(timeout_s_) +
                  " during " + op_name(rec->error_op) + ": peer dead or not calling the same prepare/finalize sequence");
  }
}

void HtCuda::wait_layout(const std::string& op) {
  const volatile HtHostRecord* rec = record_host_;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_ + 10.0);
  int spins = 0;
  while (rec->layout_epoch < host_epoch_) {
    if (std::chrono::steady_clock::now() > deadline) {
      dead_ = true;
      throw Timeout(op + ": the layout kernel did not finish within timeout_s = " + seconds(timeout_s_) +
                    " + 10 s (the stream is blocked by earlier work)");
    }
    if (++spins > 4096) std::this_thread::yield();
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  throw_sticky_error(op);
}

PrepareResult HtCuda::prepare(const DispatchArgs& args) {
  const std::string& op = op_prepare_;
  throw_sticky_error(op);
  cuda::DeviceGuard guard(group_->device().index);
  LocalError err = check_args(args);
  if (err.kind == LocalError::none && args.num_tokens.defined()) {
    if (args.num_tokens.device != group_->device())
      err = {LocalError::unsupported, wrong_device(op, "num_tokens", args.num_tokens.device)};
    else if (args.num_tokens.dtype != DType::int32 || args.num_tokens.numel() != 1)
      err = {LocalError::invalid_argument, arg_message(op, "num_tokens", args.num_tokens.describe(), "must be [1] int32 on the GPU")};
  }
  HtParams p;
  p.l = layout_;
  p.a = arrays_;
  p.state = state_.ptr<uint8_t>();
  for (int r = 0; r < num_ranks_; ++r) p.peers[r] = static_cast<uint8_t*>(symmetric_.peers[static_cast<size_t>(r)]);
  p.record = record_dev_;
  p.timeout_ns = static_cast<uint64_t>(timeout_s_ * 1e9);
  p.worst_case = cfg_.use_worst_case_sizing;
  p.expert_alignment = cfg_.expert_alignment;
  p.fp8_unroll = fp8_unroll_;
  if (err.kind == LocalError::none) {
    p.x = args.x.ptr<const uint16_t>();
    p.x_aligned16 = reinterpret_cast<uintptr_t>(args.x.data) % 16 == 0;
    p.topk_idx = args.topk_idx.data;
    p.idx_is_i64 = args.topk_idx.dtype == DType::int64;
    p.topk_weights = args.topk_weights.ptr<const float>();
    p.num_tokens = args.x.shape[0];
    p.num_tokens_dev = args.num_tokens.defined() ? args.num_tokens.ptr<const int32_t>() : nullptr;
  } else {
    p.local_status = 2;
  }
  prepared_ = false;
  if (err.kind != LocalError::none) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    EPX_CUDA_CHECK(cudaStreamIsCapturing(cuda::native(args.stream), &capture));
    if (capture != cudaStreamCaptureStatusNone) {  // nothing runs during a capture: fail it here
      if (err.kind == LocalError::unsupported) throw Unsupported(err.message);
      throw InvalidArgument(err.message);
    }
  }
  launch_ht_layout(p, args.stream);
  ++host_epoch_;
  if (err.kind != LocalError::none) {
    // The peers learn through the status word; wait until it is published, then throw.
    wait_layout(op);
    reported_bad_epoch_ = record_host_->layout_epoch;  // this call's verdict: thrown here with its own message
    if (err.kind == LocalError::unsupported) throw Unsupported(err.message);
    throw InvalidArgument(err.message);
  }
  launch_ht_dispatch(p, num_sms_, warps_, pdl_, args.stream);
  if (cfg_.expert_contiguous) {
    p.contig_x = contig_x_.ptr<uint8_t>();
    p.contig_scales = layout_.use_fp8 ? contig_scales_.ptr<float>() : nullptr;
    p.contig_offsets = contig_offsets_.ptr<int32_t>();
    p.contig_row_expert = contig_row_expert_.ptr<int32_t>();
    p.contig_src = contig_src_.ptr<int32_t>();
    p.contig_pair_row = contig_pair_row_.ptr<int32_t>();
    p.contig_cap = contig_cap_;
    p.num_local = num_local_;
    launch_ht_contiguous(p, num_sms_, warps_, args.stream);
  }

  const int64_t T = p.num_tokens, H = cfg_.hidden, K = cfg_.top_k, L = num_local_;
  const Device dev = group_->device();
  int64_t N = layout_.rows();
  int64_t M = contig_cap_;
  if (!cfg_.use_worst_case_sizing) {
    wait_layout(op);
    const HtHostRecord rec = *const_cast<const HtHostRecord*>(record_host_);
    if (rec.any_bad) {
      if (rec.bad_num_tokens)
        throw InvalidArgument(arg_message(op, "num_tokens", rec.bad_num_tokens_value,
                                          "must be in [0, x.shape[0] = " + std::to_string(args.x.shape[0]) + "] (read on the device): nothing was moved"));
      if (rec.bad_index >= 0) {
        int64_t value = 0;
        if (p.idx_is_i64) {
          EPX_CUDA_CHECK(cudaMemcpy(&value, args.topk_idx.ptr<const int64_t>() + rec.bad_index, 8, cudaMemcpyDeviceToHost));
        } else {
          int32_t v32 = 0;
          EPX_CUDA_CHECK(cudaMemcpy(&v32, args.topk_idx.ptr<const int32_t>() + rec.bad_index, 4, cudaMemcpyDeviceToHost));
          value = v32;
        }
        throw bad_topk_id(op, cfg_, rec.bad_index / K, rec.bad_index % K, value);
      }
      throw InvalidArgument(op + ": rank " + std::to_string(rec.bad_rank) + " rejected its arguments (see its own error): nothing was moved");
    }
    N = rec.num_recv;
    M = rec.contig_rows;
    cache_hits_ += rec.cache_hit;
    stats_ = {};
    stats_.num_valid_selections = rec.valid_selections;
    stats_.num_rank_dedup_rows = rec.dedup_rows;
    stats_.remote_bytes_dispatch = (rec.dedup_rows - rec.rows_to_self) * codec().row_bytes();
  }
  num_recv_ = N;
  contig_rows_ = M;
  prepared_ = true;
  prepared_tokens_ = T;

  uint8_t* base = static_cast<uint8_t*>(symmetric_.local);
  uint8_t* state = state_.ptr<uint8_t>();
  PrepareResult r;
  r.layout = ActivationLayout::Flat;
  r.x = TensorView(base + layout_.off_x, layout_.use_fp8 ? DType::fp8_e4m3 : DType::bf16, {N, H}, dev);
  if (layout_.use_fp8) r.x_scales = TensorView(base + layout_.off_scales, DType::fp32, {N, layout_.groups()}, dev);
  r.recv_count = TensorView(state + arrays_.recv_count, DType::int32, {L}, dev);
  r.topk_idx = TensorView(base + layout_.off_idx, DType::int32, {N, K}, dev);
  r.topk_weights = TensorView(base + layout_.off_weights, DType::fp32, {N, K}, dev);
  r.num_recv_tokens = N;
  r.num_recv_tokens_device = TensorView(state + arrays_.num_recv_device, DType::int32, {1}, dev);
  if (cfg_.expert_contiguous) {
    ExpertContiguousLayout& c = r.contiguous;
    c.x = TensorView(contig_x_.data(), layout_.use_fp8 ? DType::fp8_e4m3 : DType::bf16, {M, H}, dev);
    if (layout_.use_fp8) c.x_scales = TensorView(contig_scales_.data(), DType::fp32, {M, layout_.groups()}, dev);
    c.expert_offsets = contig_offsets_;
    c.row_expert = TensorView(contig_row_expert_.data(), DType::int32, {M}, dev);
    c.pair_row = TensorView(contig_pair_row_.data(), DType::int32, {N, K}, dev);
    c.num_rows = M;
  }

  auto* st = reinterpret_cast<HtState*>(state);
  handle_.rank_prefix_matrix = TensorView(st->rank_prefix_matrix, DType::int32, {num_ranks_, num_ranks_}, dev);
  handle_.is_token_in_rank = TensorView(state + arrays_.is_token_in_rank, DType::uint8, {T, num_ranks_}, dev);
  handle_.send_pos = TensorView(state + arrays_.send_pos, DType::int32, {T, num_ranks_}, dev);
  handle_.recv_src_idx = TensorView(base + layout_.off_src_idx, DType::int32, {N}, dev);
  handle_.num_recv_tokens_per_expert = r.recv_count;
  handle_.layout_cache_hits = cache_hits_;
  return r;
}

const DispatchStats& HtCuda::stats() const {
  if (cfg_.use_worst_case_sizing && record_host_) {
    // The record of the last completed layout (synchronize the stream first for the current call's).
    const HtHostRecord rec = *const_cast<const HtHostRecord*>(record_host_);
    stats_view_ = stats_;
    stats_view_.num_valid_selections = rec.valid_selections;
    stats_view_.num_rank_dedup_rows = rec.dedup_rows;
    stats_view_.remote_bytes_dispatch = (rec.dedup_rows - rec.rows_to_self) * codec().row_bytes();
    stats_view_.remote_bytes_combine = rec.rows_from_others * layout_.partial_bytes * cfg_.hidden;
    return stats_view_;
  }
  return stats_;
}

void HtCuda::finalize(const FinalizeArgs& args) {
  const std::string& op = op_finalize_;
  throw_sticky_error(op);
  if (!prepared_) throw InvalidArgument(op + ": no prepare to finalize: every rank calls prepare first (also with T = 0)");
  const int64_t H = cfg_.hidden;
  // expert_out: the Flat partials in flat_combine's dtype; with expert_contiguous the experts' unweighted bf16 rows.
  const DType partial = cfg_.expert_contiguous ? DType::bf16 : partial_dtype();
  for (const auto& [arg, t] : {std::pair<const char*, const TensorView*>{"expert_out", &args.expert_out}, {"out", &args.out}}) {
    if (t->device != group_->device()) throw Unsupported(wrong_device(op, arg, t->device));
    const DType want = t == &args.out ? DType::bf16 : partial;
    if (t->dtype != want)
      require_arg(op, std::string(arg) + ".dtype", dtype_name(t->dtype), false,
                  "must be " + std::string(dtype_name(want)) +
                      (t == &args.out ? std::string()
                       : cfg_.expert_contiguous ? std::string(" (the experts' unweighted rows, expert_contiguous)")
                                                : std::string(" (flat_combine = ") + flat_combine_name(cfg_.flat_combine) + ")"));
    check_contiguous(op, arg, *t);
    require_arg(op, std::string(arg) + ".ndim", t->ndim, t->ndim == 2, "must be 2");
  }
  if (args.addend.defined()) {  // joins each token's fp32 sum before the one rounding
    if (args.addend.device != group_->device()) throw Unsupported(wrong_device(op, "addend", args.addend.device));
    check_dtype(op, "addend", args.addend, {DType::fp32});
    check_shape(op, "addend", args.addend, {prepared_tokens_, cfg_.hidden});
    check_contiguous(op, "addend", args.addend);
  }
  if (cfg_.expert_contiguous) {
    require_arg(op, "expert_out.shape[0]", args.expert_out.shape[0], args.expert_out.shape[0] == contig_rows_,
                std::string("must equal ") + (cfg_.use_worst_case_sizing ? "the expert-contiguous capacity " : "M = ") +
                    std::to_string(contig_rows_) + " (expert_contiguous: one row per (received row, local expert) of the last prepare)");
    const bool aligned = (reinterpret_cast<uintptr_t>(args.expert_out.data) | reinterpret_cast<uintptr_t>(args.out.data)) % 16 == 0;
    require_arg(op, "expert_out.data", args.expert_out.describe(), aligned, "must be 16-byte aligned, and out too (expert_contiguous)");
    if (args.topk_weights.defined()) {
      if (args.topk_weights.device != group_->device()) throw Unsupported(wrong_device(op, "topk_weights", args.topk_weights.device));
      check_dtype(op, "topk_weights", args.topk_weights, {DType::fp32});
      check_shape(op, "topk_weights", args.topk_weights, {num_recv_, cfg_.top_k});
      check_contiguous(op, "topk_weights", args.topk_weights);
    }
  } else {
    require_arg(op, "expert_out.shape[0]", args.expert_out.shape[0], args.expert_out.shape[0] == num_recv_,
                std::string("must equal ") + (cfg_.use_worst_case_sizing ? "R * num_max_dispatch_tokens_per_rank = " : "N_recv = ") +
                    std::to_string(num_recv_) + " (the rows of the last prepare)");
    if (args.topk_weights.defined())
      require_arg(op, "topk_weights", args.topk_weights.describe(), false,
                  "must be empty without expert_contiguous (Flat rows come weighted from Experts::apply)");
  }
  require_arg(op, "expert_out.shape[1]", args.expert_out.shape[1], args.expert_out.shape[1] == H, "must equal hidden = " + std::to_string(H));
  require_arg(op, "out.shape[0]", args.out.shape[0], args.out.shape[0] == prepared_tokens_,
              "must equal T = " + std::to_string(prepared_tokens_) + " of the last prepare");
  require_arg(op, "out.shape[1]", args.out.shape[1], args.out.shape[1] == H, "must equal hidden = " + std::to_string(H));
  cuda::DeviceGuard guard(group_->device().index);
  HtParams p;
  p.l = layout_;
  p.a = arrays_;
  p.state = state_.ptr<uint8_t>();
  for (int r = 0; r < num_ranks_; ++r) p.peers[r] = static_cast<uint8_t*>(symmetric_.peers[static_cast<size_t>(r)]);
  p.record = record_dev_;
  p.timeout_ns = static_cast<uint64_t>(timeout_s_ * 1e9);
  p.worst_case = cfg_.use_worst_case_sizing;
  p.num_tokens = prepared_tokens_;
  p.expert_out = static_cast<const uint16_t*>(args.expert_out.data);
  p.partial_f32 = layout_.partial_bytes == 4;
  p.addend = args.addend.defined() ? args.addend.ptr<const float>() : nullptr;
  p.out = args.out.ptr<uint16_t>();
  p.io_aligned16 = H % 8 == 0 &&
                   (reinterpret_cast<uintptr_t>(args.expert_out.data) | reinterpret_cast<uintptr_t>(args.out.data) |
                    reinterpret_cast<uintptr_t>(args.addend.data) | (H * 2)) % 16 == 0;
  p.chunk_rows = chunk_rows_;
  if (cfg_.expert_contiguous) {
    p.pair_row = contig_pair_row_.ptr<const int32_t>();
    p.combine_weights = args.topk_weights.defined() ? args.topk_weights.ptr<const float>() : nullptr;
  }
  launch_ht_combine(p, num_sms_, warps_, args.stream);
  if (!cfg_.use_worst_case_sizing) stats_.remote_bytes_combine = record_host_->rows_from_others * layout_.partial_bytes * H;
  // Worst-case mode: an earlier prepare's bad argument that the host sees by now, thrown after this
  // combine's launch (every rank's sequence stays whole); deferred (ModularMoE): take_device_error.
  if (!defer_errors_)
    if (auto bad = take_bad_layout(op, false)) throw InvalidArgument(*bad);
}

std::vector<double> HtCuda::timeline_us() const {
  cuda::DeviceGuard guard(group_->device().index);
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  unsigned long long tl[kTlCount] = {};
  EPX_CUDA_CHECK(cudaMemcpy(tl, state_.ptr<uint8_t>() + offsetof(HtState, timeline), sizeof(tl), cudaMemcpyDeviceToHost));
  std::vector<double> us(kTlCount, 0.0);
  for (int i = 0; i < kTlCount; ++i) us[static_cast<size_t>(i)] = (static_cast<double>(tl[i]) - static_cast<double>(tl[kTlLayoutStart])) * 1e-3;
  return us;
}

std::unique_ptr<PrepareFinalize> make_ht_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<HtCuda>(std::move(group), cfg);
}

std::unique_ptr<PrepareFinalize> make_ht_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const Config& config) {
  return std::make_unique<HtCuda>(std::move(group), cfg, config);
}

}  // namespace epx::dispatch
