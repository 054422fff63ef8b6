#include "dispatch/ht.h"

#include "dispatch/backends.h"

namespace epx::dispatch {

PrepareResult HtCpu::prepare(const DispatchArgs& args) {
  PrepareResult res = DedupCpu::prepare(args);
  const int R = num_ranks_;
  handle_.num_ranks = R;
  handle_.rank_prefix_matrix.assign(static_cast<size_t>(R * R), 0);
  for (int d = 0; d < R; ++d) {
    int64_t acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += count_matrix_[static_cast<size_t>(s)][static_cast<size_t>(d)];
      handle_.rank_prefix_matrix[static_cast<size_t>(s * R + d)] = static_cast<int32_t>(acc);
    }
  }
  handle_.is_token_in_rank = is_token_in_rank_;
  handle_.recv_src_rank.assign(recv_src_rank_.begin(), recv_src_rank_.end());
  handle_.recv_src_idx = recv_.src_token;
  const int64_t align = cfg_.expert_alignment;
  int32_t* counts = recv_.recv_count.ptr<int32_t>();
  for (int l = 0; l < num_local_; ++l) counts[l] = static_cast<int32_t>((counts[l] + align - 1) / align * align);
  handle_.num_recv_tokens_per_expert.assign(counts, counts + num_local_);
  handle_.layout_cache_hits = layout_cache_hits_;
  return res;
}

std::unique_ptr<PrepareFinalize> make_ht_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<HtCpu>(std::move(group), cfg);
}

}  // namespace epx::dispatch
