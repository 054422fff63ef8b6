// dispatch/agrs_cpu.cpp: "allgather_reducescatter" backend. prepare = all_gatherv of tokens and
// routing (gather_cpu.h); finalize = reduce_scatterv of the [N, H] bf16 partial outputs straight
// into out: rank r receives the fp32 sum (rank order, one rounding) of rows of its own tokens.
// Reported combine bytes: the rows of other ranks' tokens this rank sends, (N - T) x H x 2.
#include "dispatch/backends.h"
#include "dispatch/gather_cpu.h"

namespace epx::dispatch {
namespace {

class AgrsCpu final : public GatherCpu {
 public:
  AgrsCpu(std::shared_ptr<Group> group, const DispatchConfig& cfg)
      : GatherCpu("allgather_reducescatter", ActivationLayout::Flat, false, std::move(group), cfg) { caps_.gathers_all_tokens = true; }

  /// expert_out [N, H] bf16 (N = num_recv_tokens of the last prepare); out [T, H] bf16.
  void finalize(const FinalizeArgs& args) override {
    const int64_t H = cfg_.hidden;
    begin_finalize(args, {num_exposed_rows_, H});
    std::vector<int64_t> counts(static_cast<size_t>(num_ranks_));
    for (int r = 0; r < num_ranks_; ++r) counts[static_cast<size_t>(r)] = tokens_per_rank_[static_cast<size_t>(r)] * H;
    group_->reduce_scatterv(partials(args), args.out.data, counts, DType::bf16);
    stats_.remote_bytes_combine = (num_rows_ - tokens_per_rank_[static_cast<size_t>(rank_)]) * H * 2;
  }
};

}  // namespace

std::unique_ptr<PrepareFinalize> make_agrs_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<AgrsCpu>(std::move(group), cfg);
}

}  // namespace epx::dispatch
