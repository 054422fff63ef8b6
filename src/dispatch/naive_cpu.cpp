// dispatch/naive_cpu.cpp: "naive" backend. prepare = all-gather of tokens and routing (gather_cpu.h);
// finalize = all-reduce (sum) of every rank's [N, H] partial outputs, then this rank keeps its own
// T rows. Partials are fp32 (flat_combine partial_fp32; Experts Flat output written as fp32) or bf16
// (partial_bf16); the all-reduce sums them in fp32 in rank order, FinalizeArgs::addend joins, one
// rounding (gather_cpu.h). Reported combine bytes use ring all-reduce accounting:
// 2 (R-1)/R x N x H x (4 | 2).
#include <cstring>

#include "dispatch/backends.h"
#include "dispatch/gather_cpu.h"

namespace epx::dispatch {
namespace {

class NaiveCpu final : public GatherCpu {
 public:
  NaiveCpu(std::shared_ptr<Group> group, const DispatchConfig& cfg)
      : GatherCpu("naive", ActivationLayout::Flat, false, std::move(group), cfg) {
    caps_.gathers_all_tokens = true;
    caps_.combine_addend = true;
  }

  /// expert_out [N, H] fp32 | bf16 (N = num_recv_tokens of the last prepare); out [T, H] bf16.
  void finalize(const FinalizeArgs& args) override {
    const int64_t H = cfg_.hidden;
    begin_finalize(args, {num_exposed_rows_, H});
    const DType dt = partial_dtype();
    const int64_t es = dtype_size(dt);
    reduced_.resize(static_cast<size_t>(num_rows_ * H));  // fp32 words: room for either dtype
    group_->all_reduce_sum(partials(args), reduced_.data(), num_rows_ * H, dt);
    const int64_t T = tokens_per_rank_[static_cast<size_t>(rank_)];
    const uint8_t* mine = reinterpret_cast<const uint8_t*>(reduced_.data()) + token_offset_ * H * es;
    if (T > 0) finish_rows(mine, dt, args.addend.defined() ? args.addend.ptr<const float>() : nullptr, T * H, args.out.ptr<uint16_t>());
    const int64_t wire_rows = padded_ ? num_ranks_ * int64_t{cfg_.num_max_dispatch_tokens_per_rank} : num_rows_;
    stats_.remote_bytes_combine = num_ranks_ > 1 ? 2 * (num_ranks_ - 1) * wire_rows * H * es / num_ranks_ : 0;
  }

 private:
  std::vector<float> reduced_;
};

}  // namespace

std::unique_ptr<PrepareFinalize> make_naive_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<NaiveCpu>(std::move(group), cfg);
}

}  // namespace epx::dispatch
