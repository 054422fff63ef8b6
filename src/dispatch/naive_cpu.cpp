// dispatch/naive_cpu.cpp: "naive" backend. prepare = all-gather of tokens and routing (gather_cpu.h);
// finalize = all-reduce (sum) of every rank's [N, H] partial outputs, then this rank keeps its own
// T rows. Partials are bf16 (Experts Flat output); the all-reduce sums them in fp32 in rank order
// and rounds once. Reported combine bytes use ring all-reduce accounting: 2 (R-1)/R x N x H x 2.
#include <cstring>

#include "dispatch/backends.h"
#include "dispatch/gather_cpu.h"

namespace epx::dispatch {
namespace {

class NaiveCpu final : public GatherCpu {
 public:
  NaiveCpu(std::shared_ptr<Group> group, const DispatchConfig& cfg)
      : GatherCpu("naive", ActivationLayout::Flat, false, std::move(group), cfg) { caps_.gathers_all_tokens = true; }

  /// expert_out [N, H] bf16 (N = num_recv_tokens of the last prepare); out [T, H] bf16.
  void finalize(const FinalizeArgs& args) override {
    const int64_t H = cfg_.hidden;
    begin_finalize(args, {num_exposed_rows_, H});
    reduced_.resize(static_cast<size_t>(num_rows_ * H));
    group_->all_reduce_sum(partials(args), reduced_.data(), num_rows_ * H, DType::bf16);
    const int64_t T = tokens_per_rank_[static_cast<size_t>(rank_)];
    if (T > 0) std::memcpy(args.out.data, reduced_.data() + token_offset_ * H, static_cast<size_t>(T * H * 2));
    stats_.remote_bytes_combine = num_ranks_ > 1 ? 2 * (num_ranks_ - 1) * num_rows_ * H * 2 / num_ranks_ : 0;
  }

 private:
  std::vector<uint16_t> reduced_;
};

}  // namespace

std::unique_ptr<PrepareFinalize> make_naive_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<NaiveCpu>(std::move(group), cfg);
}

}  // namespace epx::dispatch
