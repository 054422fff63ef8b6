// dispatch/agrs_cpu.cpp: "allgather_reducescatter" backend. prepare = all_gatherv of tokens and
// routing (gather_cpu.h); finalize = reduce_scatterv of the [N, H] partial outputs (fp32 with
// flat_combine partial_fp32, bf16 with partial_bf16): rank r receives the fp32 sum (rank order) of
// rows of its own tokens, FinalizeArgs::addend joins, one rounding.
// Reported combine bytes: the rows of other ranks' tokens this rank sends, (N - T) x H x (4 | 2).
#include "dispatch/backends.h"
#include "dispatch/gather_cpu.h"

namespace epx::dispatch {
namespace {

class AgrsCpu final : public GatherCpu {
 public:
  AgrsCpu(std::shared_ptr<Group> group, const DispatchConfig& cfg)
      : GatherCpu("allgather_reducescatter", ActivationLayout::Flat, false, std::move(group), cfg) {
    caps_.gathers_all_tokens = true;
    caps_.combine_addend = true;
  }

  /// expert_out [N, H] fp32 | bf16 (N = num_recv_tokens of the last prepare); out [T, H] bf16.
  void finalize(const FinalizeArgs& args) override {
    const int64_t H = cfg_.hidden;
    begin_finalize(args, {num_exposed_rows_, H});
    std::vector<int64_t> counts(static_cast<size_t>(num_ranks_));
    for (int r = 0; r < num_ranks_; ++r) counts[static_cast<size_t>(r)] = tokens_per_rank_[static_cast<size_t>(r)] * H;
    const DType dt = partial_dtype();
    const int64_t T = tokens_per_rank_[static_cast<size_t>(rank_)];
    if (dt == DType::bf16 && !args.addend.defined()) {
      group_->reduce_scatterv(partials(args), args.out.data, counts, DType::bf16);
    } else {
      sum_.resize(static_cast<size_t>(T * H));  // fp32 words: room for either dtype
      group_->reduce_scatterv(partials(args), sum_.data(), counts, dt);
      finish_rows(sum_.data(), dt, args.addend.defined() ? args.addend.ptr<const float>() : nullptr, T * H, args.out.ptr<uint16_t>());
    }
    stats_.remote_bytes_combine = padded_ ? (num_ranks_ - 1) * cfg_.num_max_dispatch_tokens_per_rank * H * dtype_size(dt)
                                          : (num_rows_ - T) * H * dtype_size(dt);
  }

 private:
  std::vector<float> sum_;
};

}  // namespace

std::unique_ptr<PrepareFinalize> make_agrs_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<AgrsCpu>(std::move(group), cfg);
}

}  // namespace epx::dispatch
