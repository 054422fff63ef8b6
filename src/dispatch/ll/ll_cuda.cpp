// dispatch/ll/ll_cuda.cpp: the host side of the LL CUDA backend (ll_cuda.h).
#include "dispatch/ll/ll_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include <cmath>
#include <cstring>

#include "comm/node_group.h"
#include "core/timeout.h"
#include "cuda/check.h"
#include "dispatch/backends.h"
#include "epx/config.h"
#include "epx/cuda.h"

namespace epx::dispatch {
namespace {

std::string seconds_text(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", s);
  return b;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

LlCuda::LlCuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const LlLaunch& launch)
    : PrepareFinalizeBase("ll", ActivationLayout::ExpertMajor, true, std::move(group), cfg), launch_(launch) {
  const std::string op = "ll.create";
  EPX_ASSERT(group_->device().is_cuda(), "group device = ", group_->device().str());
  cuda::ensure_runtime();
  cuda::DeviceGuard guard(group_->device().index);
  accepts_device_num_tokens_ = true;
  caps_.combine_addend = true;  // FinalizeArgs::addend joins each token's fp32 sum before its one rounding
  require_arg(op, "num_max_dispatch_tokens_per_rank", cfg.num_max_dispatch_tokens_per_rank, cfg.num_max_dispatch_tokens_per_rank > 0,
              "must be > 0 (LL buffers are sized by it)");
  require_arg(op, "num_ranks", num_ranks_, num_ranks_ <= kLlMaxRanks, "must be <= " + std::to_string(kLlMaxRanks) + " for the LL kernels");
  require_arg(op, "top_k", cfg.top_k, cfg.top_k <= kLlMaxTopK, "must be <= " + std::to_string(kLlMaxTopK) + " for the LL kernels");
  require_arg(op, "ll.warps_per_block", launch.warps_per_block, launch.warps_per_block >= 1 && launch.warps_per_block <= 32,
              "must be in [1, 32]");
  require_arg(op, "ll.num_blocks", launch.num_blocks, launch.num_blocks >= 0, "must be >= 0 (0 = one per SM)");
  require_timeout(op, "timeout_s", launch.timeout_s);
  require_arg(op, "debug_block0_delay_ns", launch.debug_block0_delay_ns, launch.debug_block0_delay_ns >= 0, "must be >= 0");
  layout_ = ll_layout(cfg_, num_ranks_);
  {  // the kernels index their work items in 32 bits (ll_cuda_kernels.cu: udiv)
    const int64_t items = static_cast<int64_t>(num_ranks_) * cfg.num_max_dispatch_tokens_per_rank * ((cfg.hidden + 255) / 256);
    require_arg(op, "num_max_dispatch_tokens_per_rank", cfg.num_max_dispatch_tokens_per_rank, items < (int64_t{1} << 31),
                "times num_ranks x ceil(hidden / 256) must be < 2^31 (the LL kernels' 32-bit work-item indices)");
  }

  threads_ = 32 * launch.warps_per_block;
  int sms = 0;
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, group_->device().index));
  // Ranks sharing this GPU (virtual ranks) each take their share of it: every rank's blocks wait on
  // peers, so all of them must be resident at once.
  const int sharing = std::max(1, group_->ranks_per_gpu());
  blocks_ = launch.num_blocks > 0 ? launch.num_blocks : std::max(1, sms / sharing);
  require_arg(op, "ll.num_blocks", blocks_, blocks_ <= LlLayout::kMaxSignalBlocks,
              "must be <= " + std::to_string(LlLayout::kMaxSignalBlocks) + " (one signal word per send block, ll_layout.h)");
  // The message expansion needs per-(id, token) bitmaps in shared memory: where they do not fit, the
  // expert expansion with block signals (same results) is used; every rank then uses it (the all-gather below).
  const bool want_message = launch.expand_message && ll_dispatch_smem_bytes(layout_, true, num_local_) <= 200 * 1024;
  const size_t dsmem = ll_dispatch_smem_bytes(layout_, want_message, num_local_), csmem = ll_combine_smem_bytes(num_local_, num_ranks_);
  require_arg(op, "num_max_dispatch_tokens_per_rank", cfg.num_max_dispatch_tokens_per_rank, dsmem <= 200 * 1024,
              "needs " + std::to_string(dsmem) + " bytes of shared memory per block with " + std::to_string(num_ranks_) +
                  " ranks (at most 204800): use a smaller capacity");
  const int resident = ll_max_resident_blocks(threads_, dsmem, csmem) / sharing;
  require_arg(op, "ll.num_blocks", blocks_, blocks_ <= resident,
              "must be <= " + std::to_string(resident) + " (blocks of " + std::to_string(threads_) + " threads that fit on the GPU at once" +
                  (sharing > 1 ? ", divided among the " + std::to_string(sharing) + " ranks sharing it" : std::string()) +
                  "; every LL block may wait on peers)");

  // Every rank learns every rank's block count (the signal targets) and protocol modes; collective,
  // like the buffer. Bit 33: message expansion possible and asked for; bit 34: ll.combine_wait = data;
  // bits 40-45: warps per block (chunk signals: the receiver maps a source's send item to its block).
  const int64_t mine = static_cast<int64_t>(blocks_) | (want_message ? int64_t{1} << 33 : 0) | (launch.combine_data ? int64_t{1} << 34 : 0) |
                       (static_cast<int64_t>(launch.warps_per_block) << 40);
  const std::vector<int64_t> all_blocks = group_->all_gather_i64(mine);
  bool all_message = true;
  for (int r = 0; r < num_ranks_; ++r) {
    const int64_t v = all_blocks[static_cast<size_t>(r)];
    require_arg(op, "ll.combine_wait", launch.combine_data ? "data" : "flag", ((v >> 34) & 1) == (launch.combine_data ? 1 : 0),
                "must be the same on every rank (rank " + std::to_string(r) + " differs)");
    all_message = all_message && ((v >> 33) & 1) != 0;
  }
  common_.expand_message = all_message;
  common_.combine_data = launch.combine_data && layout_.partial();
  common_.debug_block0_delay_ns = launch.debug_block0_delay_ns;
  common_.debug_token_tag_mask = launch.debug_token_tag_mask;
  buffer_ = group_->alloc_symmetric(layout_.total_bytes());
  for (int r = 0; r < num_ranks_; ++r)
    if (buffer_.peers[static_cast<size_t>(r)] == nullptr)
      throw Unsupported(op + ": rank " + std::to_string(r) + " is not load/store accessible from rank " + std::to_string(rank_) +
                        " (no LSA peer pointer): the LL kernels need all ranks in one NVLink domain");

  const Device dev = group_->device();
  state_ = Tensor::zeros({static_cast<int64_t>(sizeof(LlDeviceState))}, DType::uint8, dev);
  void* host = nullptr;
  EPX_CUDA_CHECK(cudaHostAlloc(&host, sizeof(LlErrorReport), cudaHostAllocMapped));
  std::memset(host, 0, sizeof(LlErrorReport));
  report_host_ = static_cast<LlErrorReport*>(host);
  void* report_dev = nullptr;
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(&report_dev, host, 0));

  common_.lay = layout_;
  common_.placement = placement_;
  common_.rank = rank_;
  common_.num_local = num_local_;
  common_.local = static_cast<uint8_t*>(buffer_.local);
  for (int r = 0; r < num_ranks_; ++r) {
    common_.peers[r] = static_cast<uint8_t*>(buffer_.peers[static_cast<size_t>(r)]);
    common_.src_blocks[r] = static_cast<int32_t>(all_blocks[static_cast<size_t>(r)] & 0xffffffff);
    common_.src_warps[r] = static_cast<int32_t>((all_blocks[static_cast<size_t>(r)] >> 40) & 63);
  }
  common_.state = state_.ptr<LlDeviceState>();
  common_.error = static_cast<LlErrorReport*>(report_dev);
  common_.timeout_ns = static_cast<long long>(std::llround(launch.timeout_s * 1e9));

  const int64_t L = num_local_, cap = static_cast<int64_t>(num_ranks_) * cfg.num_max_dispatch_tokens_per_rank, H = cfg.hidden;
  const int64_t max_t = cfg.num_max_dispatch_tokens_per_rank, K = cfg.top_k;
  x_ = Tensor::zeros({L, cap, H}, layout_.use_fp8 ? DType::fp8_e4m3 : DType::bf16, dev);
  if (layout_.use_fp8) x_scales_ = Tensor::zeros({L, cap, H / kFp8GroupSize}, DType::fp32, dev);
  recv_count_ = Tensor::zeros({L}, DType::int32, dev);
  handle_.src_rank = Tensor::zeros({L, cap}, DType::int32, dev);
  handle_.src_token = Tensor::zeros({L, cap}, DType::int32, dev);
  handle_.topk_column = Tensor::zeros({L, cap}, DType::int32, dev);
  handle_.layout_range = Tensor::zeros({L, num_ranks_}, DType::int64, dev);
  first_col_ = Tensor::zeros({max_t, K}, DType::int32, dev);
  weights_ = Tensor::zeros({max_t, K}, DType::fp32, dev);
  dest_mask_ = Tensor::zeros({max_t}, DType::int32, dev);
  const int64_t R = num_ranks_;
  handle_.msg_count = Tensor::zeros({R}, DType::int32, dev);
  handle_.msg_src_token = Tensor::zeros({R, max_t}, DType::int32, dev);
  handle_.msg_rows = Tensor::zeros({R, max_t, K}, DType::int32, dev);
  handle_.msg_weights = Tensor::zeros({R, max_t, K}, DType::fp32, dev);
  if (common_.combine_data)  // ll.combine_wait = data: no partial row pending in either parity (kLlPoison)
    EPX_CUDA_CHECK(cudaMemset(common_.local + layout_.combine_recv_offset(), 0xff, static_cast<size_t>(2 * layout_.combine_region_bytes())));
  EPX_CUDA_CHECK(cudaDeviceSynchronize());  // zero fills done before any peer can signal
  group_->barrier();
}

LlCuda::~LlCuda() {
  // Quiesce this GPU's kernels (each bounded by timeout_s) before the buffers go.
  (void)cudaSetDevice(group_->device().index);
  (void)cudaDeviceSynchronize();
  if (report_host_) (void)cudaFreeHost(report_host_);
}

std::optional<std::string> LlCuda::why_unsupported(const DispatchArgs& args) const {
  if (auto why = PrepareFinalizeBase::why_unsupported(args)) return why;
  if (args.num_tokens.defined() && args.num_tokens.device != group_->device())
    return wrong_device(op_prepare_, "num_tokens", args.num_tokens.device);
  return std::nullopt;
}

void LlCuda::throw_reported(bool argument_errors) {
  if (broken_) throw Timeout(broken_message_);
  const volatile LlErrorReport* r = report_host_;
  const int32_t kind = r->kind;
  if (kind == LlErrorReport::none || (kind != LlErrorReport::timeout && !argument_errors)) return;
  const int peer = r->peer;
  const std::string op = r->op == LlErrorReport::dispatch ? "ll.prepare (dispatch)" : "ll.finalize (combine)";
  const long long value = r->value, index = r->index;
  if (kind == LlErrorReport::peer_rejected) {  // an argument error too: the sequence stayed consistent
    const_cast<LlErrorReport*>(report_host_)->kind = LlErrorReport::none;
    EPX_CUDA_CHECK(cudaMemset(&state_.ptr<LlDeviceState>()->error_claim, 0, sizeof(int32_t)));
    EPX_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    throw InvalidArgument(op_finalize_ + ": rank " + std::to_string(peer) + " refused its finalize arguments in combine call " +
                          std::to_string(value) + " of this object (it threw there; read on the device): this rank's out of that "
                          "call holds NaN, not the combine");
  }
  if (kind == LlErrorReport::timeout) {
    broken_ = true;
    broken_message_ = op + ": rank " + std::to_string(rank_) + " waited more than timeout_s = " + seconds_text(launch_.timeout_s) +
                      " s for rank " + std::to_string(peer) + " (call " + std::to_string(value) +
                      " of this object): the peer did not make the same call, crashed, or its GPU is blocked; this object "
                      "is unusable now (recreate the group)";
    throw Timeout(broken_message_);
  }
  // A device-side argument error: the call sent nothing for it and the sequence stayed consistent,
  // so the object stays usable once the report is cleared.
  const_cast<LlErrorReport*>(report_host_)->kind = LlErrorReport::none;
  EPX_CUDA_CHECK(cudaMemset(&state_.ptr<LlDeviceState>()->error_claim, 0, sizeof(int32_t)));
  // Landed before the next call's kernels on the caller's (maybe non-blocking) stream: a claim still
  // set there would drop that call's report, and a late reset would lose a fresh one.
  EPX_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  if (kind == LlErrorReport::bad_num_tokens)
    throw InvalidArgument(arg_message(op_prepare_, "num_tokens", value,
                                      "must be in [0, x.shape[0] = " + std::to_string(index) +
                                          "] (read on the device; that call sent no tokens)"));
  throw InvalidArgument(bad_topk_id(op_prepare_, cfg_, index / cfg_.top_k, index % cfg_.top_k, value).what() +
                        std::string(" (read on the device; that selection was dropped)"));
}

std::optional<std::string> LlCuda::take_device_error() {
  cuda::DeviceGuard guard(group_->device().index);
  try {
    throw_reported(true);  // a timeout still throws: this object is broken then
  } catch (const InvalidArgument& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

void LlCuda::check(Stream stream) {
  cuda::DeviceGuard guard(group_->device().index);
  EPX_CUDA_CHECK(cudaStreamSynchronize(cuda::native(stream)));
  throw_reported(true);
}

void LlCuda::check_prepare_args(const DispatchArgs& args) {
  // Timeouts only: a device-found argument error thrown here, before this call's launch, would leave the
  // peers' dispatch waiting for this rank; finalize throws it after its launch (or check / take_device_error).
  throw_reported(false);
  LocalError err = check_args(args);
  if (err.kind == LocalError::unsupported) throw Unsupported(err.message);
  if (err.kind != LocalError::none) throw InvalidArgument(err.message);
  if (auto why = why_unsupported(args)) throw Unsupported(*why);
  const std::string& op = op_prepare_;
  require_arg(op, "x.data", args.x.describe(), args.x.shape[0] == 0 || aligned16(args.x.data),
              "must be 16-byte aligned (the LL kernels move 16-byte vectors)");
  if (args.num_tokens.defined()) {
    check_dtype(op, "num_tokens", args.num_tokens, {DType::int32});
    require_arg(op, "num_tokens.numel", args.num_tokens.numel(), args.num_tokens.numel() == 1, "must be 1 ([1] int32 on the GPU)");
  }
}

LlDispatchParams LlCuda::dispatch_params(const DispatchArgs& args, bool send, bool recv) {
  LlDispatchParams p;
  p.c = common_;
  p.send = send;
  p.recv = recv;
  p.ue8m0 = cfg_.use_ue8m0;
  if (send) {
    p.x = args.x.ptr<const uint16_t>();
    p.x_rows = args.x.shape[0];
    p.topk_idx = args.topk_idx.data;
    p.idx64 = args.topk_idx.dtype == DType::int64;
    p.topk_weights = args.topk_weights.ptr<const float>();
    p.num_tokens = args.num_tokens.defined() ? args.num_tokens.ptr<const int32_t>() : nullptr;
  }
  p.out_x = static_cast<uint8_t*>(x_.data());
  p.out_scales = layout_.use_fp8 ? x_scales_.ptr<float>() : nullptr;
  p.recv_count = recv_count_.ptr<int32_t>();
  p.src_rank = handle_.src_rank.ptr<int32_t>();
  p.src_token = handle_.src_token.ptr<int32_t>();
  p.topk_column = handle_.topk_column.ptr<int32_t>();
  p.layout_range = handle_.layout_range.ptr<int64_t>();
  p.first_col = first_col_.ptr<int32_t>();
  p.weights = weights_.ptr<float>();
  p.dest_mask = dest_mask_.ptr<uint32_t>();
  p.msg_count = handle_.msg_count.ptr<int32_t>();
  p.msg_src_token = handle_.msg_src_token.ptr<int32_t>();
  p.msg_rows = handle_.msg_rows.ptr<int32_t>();
  p.msg_weights = handle_.msg_weights.ptr<float>();
  return p;
}

PrepareResult LlCuda::result() const {
  PrepareResult res;
  res.layout = ActivationLayout::ExpertMajor;
  res.x = x_.view();
  res.x_scales = x_scales_.view();
  res.recv_count = recv_count_.view();
  res.num_recv_tokens = num_local_ == 0 ? 0 : -1;
  return res;
}

PrepareResult LlCuda::prepare(const DispatchArgs& args) {
  cuda::DeviceGuard guard(group_->device().index);
  check_prepare_args(args);
  stats_ = {};
  launch_ll_dispatch(dispatch_params(args, true, true), blocks_, threads_, cuda::native(args.stream));
  prepared_ = true;
  prepared_tokens_ = args.x.shape[0];
  return result();
}

PrepareResult LlCuda::prepare_send(const DispatchArgs& args) {
  cuda::DeviceGuard guard(group_->device().index);
  check_prepare_args(args);
  stats_ = {};
  launch_ll_dispatch(dispatch_params(args, true, false), blocks_, threads_, cuda::native(args.stream));
  prepared_ = true;
  prepared_tokens_ = args.x.shape[0];
  return result();
}

void LlCuda::prepare_recv(Stream stream) {
  cuda::DeviceGuard guard(group_->device().index);
  throw_reported(false);
  require_arg(op_prepare_, "prepare_recv", "called", prepared_, "needs a prepare_send first");
  launch_ll_dispatch(dispatch_params(DispatchArgs{}, false, true), blocks_, threads_, cuda::native(stream));
}

void LlCuda::check_finalize_args(const FinalizeArgs& args) {
  throw_reported(false);  // a device-side argument error: thrown after this finalize's launch
  if (!prepared_) throw InvalidArgument(op_finalize_ + ": no prepare to finalize: every rank calls prepare first (also with T = 0)");
  try {
    check_finalize_tensors(args);
  } catch (const Error&) {
    // The peers' combines of this call already wait for this rank's flags: release them marked
    // (kLlFlagRejected), so they end at once and report it instead of timing out; then throw here.
    launch_rejected_combine(args.stream);
    throw;
  }
}

void LlCuda::launch_rejected_combine(Stream stream) {
  // The refused finalize is this prepare's finalize (ll_cuda.h): a retry is refused on the host ("no prepare
  // to finalize") instead of launching a second combine for one dispatch, which would put this rank's call
  // numbers one ahead of its peers' until a timeout.
  prepared_ = false;
  if (common_.combine_data) return;  // ll.combine_wait = data has no flags: the peers time out (documented)
  try {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    EPX_CUDA_CHECK(cudaStreamIsCapturing(cuda::native(stream), &capturing));
    if (capturing != cudaStreamCaptureStatusNone) return;  // not into the caller's graph
    LlCombineParams p;
    p.c = common_;
    p.rejected = true;
    p.recv_count = recv_count_.ptr<const int32_t>();
    p.first_col = first_col_.ptr<const int32_t>();
    p.weights = weights_.ptr<const float>();
    set_partial(p);
    launch_ll_combine(p, blocks_, threads_, cuda::native(stream));
  } catch (const Error&) {
    // the caller's own error is the one to report (a stream that cannot take the launch: the peers time out)
  }
}

void LlCuda::check_finalize_tensors(const FinalizeArgs& args) {
  const std::string& op = op_finalize_;
  for (const auto& [arg, t] : {std::pair<const char*, const TensorView*>{"expert_out", &args.expert_out}, {"out", &args.out}})
    if (t->device != group_->device()) throw Unsupported(wrong_device(op, arg, t->device));
  if (args.topk_weights.defined())  // FinalizeArgs::topk_weights is ht's expert-contiguous option
    require_arg(op, "topk_weights", args.topk_weights.describe(), false,
                "must be empty for ll (its combine weights the slots with the prepare's topk_weights itself)");
  const int64_t cap = static_cast<int64_t>(num_ranks_) * cfg_.num_max_dispatch_tokens_per_rank;
  check_dtype(op, "expert_out", args.expert_out, {DType::bf16});
  require_arg(op, "expert_out.shape", args.expert_out.describe(),
              args.expert_out.ndim == 3 && args.expert_out.shape[0] == num_local_ && args.expert_out.shape[1] == cap &&
                  args.expert_out.shape[2] == cfg_.hidden,
              "must be [" + std::to_string(num_local_) + ", " + std::to_string(cap) + ", " + std::to_string(cfg_.hidden) + "]");
  check_contiguous(op, "expert_out", args.expert_out);
  if (args.addend.defined()) {
    if (args.addend.device != group_->device()) throw Unsupported(wrong_device(op, "addend", args.addend.device));
    check_dtype(op, "addend", args.addend, {DType::fp32});
    check_shape(op, "addend", args.addend, {prepared_tokens_, cfg_.hidden});
    check_contiguous(op, "addend", args.addend);
  }
  check_dtype(op, "out", args.out, {DType::bf16});
  require_arg(op, "out.shape", args.out.describe(),
              args.out.ndim == 2 && args.out.shape[0] == prepared_tokens_ && args.out.shape[1] == cfg_.hidden,
              "must be [" + std::to_string(prepared_tokens_) + ", " + std::to_string(cfg_.hidden) + "] (T of the last prepare)");
  check_contiguous(op, "out", args.out);
  require_arg(op, "out.data", args.out.describe(), prepared_tokens_ == 0 || aligned16(args.out.data), "must be 16-byte aligned");
  require_arg(op, "expert_out.data", args.expert_out.describe(), num_local_ == 0 || aligned16(args.expert_out.data),
              "must be 16-byte aligned");
}

void LlCuda::finalize(const FinalizeArgs& args) {
  cuda::DeviceGuard guard(group_->device().index);
  check_finalize_args(args);
  LlCombineParams p;
  p.c = common_;
  p.expert_out = args.expert_out.ptr<const uint16_t>();
  p.out = args.out.ptr<uint16_t>();
  p.addend = args.addend.defined() ? args.addend.ptr<const float>() : nullptr;
  p.recv_count = recv_count_.ptr<const int32_t>();
  p.src_rank = handle_.src_rank.ptr<const int32_t>();
  p.src_token = handle_.src_token.ptr<const int32_t>();
  p.topk_column = handle_.topk_column.ptr<const int32_t>();
  p.first_col = first_col_.ptr<const int32_t>();
  p.weights = weights_.ptr<const float>();
  set_partial(p);
  launch_ll_combine(p, blocks_, threads_, cuda::native(args.stream));
  throw_launched_errors();
}

void LlCuda::throw_launched_errors() {
  // A device-found argument error (a bad id or num_tokens of a prepare, a peer's refused finalize) that the
  // host sees by now: thrown after this call's combine is launched, so every rank's call sequence stays
  // whole (a throw before a launch leaves the peers' kernels waiting for this rank). Deferred
  // (ModularMoE): left to take_device_error, which the layer folds into its all-gather.
  if (!defer_errors_) throw_reported(true);
}

void LlCuda::finalize_send(const FinalizeArgs& args) {
  cuda::DeviceGuard guard(group_->device().index);
  check_finalize_args(args);
  LlCombineParams p;
  p.c = common_;
  p.recv = false;
  p.expert_out = args.expert_out.ptr<const uint16_t>();
  p.recv_count = recv_count_.ptr<const int32_t>();
  p.src_rank = handle_.src_rank.ptr<const int32_t>();
  p.src_token = handle_.src_token.ptr<const int32_t>();
  p.topk_column = handle_.topk_column.ptr<const int32_t>();
  set_partial(p);
  launch_ll_combine(p, blocks_, threads_, cuda::native(args.stream));
  pending_out_ = args.out;
  pending_addend_ = args.addend;
}

void LlCuda::finalize_recv(Stream stream) {
  cuda::DeviceGuard guard(group_->device().index);
  throw_reported(false);
  require_arg(op_finalize_, "finalize_recv", "called", pending_out_.defined(), "needs a finalize_send first");
  LlCombineParams p;
  p.c = common_;
  p.send = false;
  p.out = pending_out_.ptr<uint16_t>();
  p.addend = pending_addend_.defined() ? pending_addend_.ptr<const float>() : nullptr;
  p.first_col = first_col_.ptr<const int32_t>();
  p.weights = weights_.ptr<const float>();
  set_partial(p);
  launch_ll_combine(p, blocks_, threads_, cuda::native(stream));
  pending_out_ = TensorView();
  pending_addend_ = TensorView();
  throw_launched_errors();
}

void LlCuda::set_partial(LlCombineParams& p) const {
  p.dest_mask = dest_mask_.ptr<const uint32_t>();
  p.msg_count = handle_.msg_count.ptr<const int32_t>();
  p.msg_src_token = handle_.msg_src_token.ptr<const int32_t>();
  p.msg_rows = handle_.msg_rows.ptr<const int32_t>();
  p.msg_weights = handle_.msg_weights.ptr<const float>();
}

std::vector<double> LlCuda::trace() {
  cuda::DeviceGuard guard(group_->device().index);
  LlDeviceState st{};
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  EPX_CUDA_CHECK(cudaMemcpy(&st, state_.data(), sizeof st, cudaMemcpyDeviceToHost));
  std::vector<double> out;
  for (int base : {0, 4})
    for (int i = 1; i < 4; ++i)
      out.push_back((static_cast<double>(st.trace[base + i]) - static_cast<double>(st.trace[base])) * 1e-3);
  out.push_back((static_cast<double>(st.trace[8]) - static_cast<double>(st.trace[0])) * 1e-3);
  out.push_back((static_cast<double>(st.trace[9]) - static_cast<double>(st.trace[4])) * 1e-3);
  out.push_back((static_cast<double>(st.trace[10]) - static_cast<double>(st.trace[0])) * 1e-3);
  out.push_back((static_cast<double>(st.trace[11]) - static_cast<double>(st.trace[4])) * 1e-3);
  return out;
}

std::vector<std::pair<std::string, double>> LlCuda::trace_named() {
  cuda::DeviceGuard guard(group_->device().index);
  LlDeviceState st{};
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  EPX_CUDA_CHECK(cudaMemcpy(&st, state_.data(), sizeof st, cudaMemcpyDeviceToHost));
  std::vector<std::pair<std::string, double>> out;
  for (int i = 0; i < kTrSlots; ++i) {
    const char* name = ll_trace_name(i);
    if (!name || st.trace[i] == 0) continue;
    const int base = ll_trace_is_combine(i) ? kTrCombStart : kTrDispStart;
    if (i == base || st.trace[base] == 0) continue;
    out.emplace_back(name, (static_cast<double>(st.trace[i]) - static_cast<double>(st.trace[base])) * 1e-3);
  }
  return out;
}

void LlCuda::stamp(int slot, Stream stream) {
  cuda::DeviceGuard guard(group_->device().index);
  require_arg("ll.stamp", "slot", slot, slot >= 0 && slot < kTrSlots, "must be in [0, " + std::to_string(kTrSlots) + ")");
  launch_gpu_stamp(&state_.ptr<LlDeviceState>()->trace[slot], cuda::native(stream));
}

void LlCuda::launch_empty(Stream stream) {
  cuda::DeviceGuard guard(group_->device().index);
  launch_ll_empty(ll_dispatch_smem_bytes(layout_, common_.expand_message, num_local_), blocks_, threads_, cuda::native(stream));
}

std::unique_ptr<PrepareFinalize> make_ll_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const LlLaunch& launch) {
  return std::make_unique<LlCuda>(std::move(group), cfg, launch);
}

std::unique_ptr<PrepareFinalize> make_ll_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return make_ll_cuda(std::move(group), cfg, Config::load());
}

std::unique_ptr<PrepareFinalize> make_ll_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const Config& config) {
  LlLaunch launch;
  launch.warps_per_block = config.ll_warps_per_block;
  launch.num_blocks = config.ll_num_blocks;
  launch.timeout_s = config.timeout_s;
  launch.combine_data = config.ll_combine_wait == "data";  // bench/NOTES.md, 'LL combine, the rows as the signal'
  launch.timeout_s = group->timeout_s();
  return make_ll_cuda(std::move(group), cfg, launch);
}

}  // namespace epx::dispatch
