#include "dispatch/gather_cpu.h"

namespace epx::dispatch {

PrepareResult GatherCpu::prepare(const DispatchArgs& args) {
  Routing routing;
  const auto table = begin_prepare(args, routing, 0, [](const Routing&) { return std::vector<int64_t>{}; });
  const RowCodec c = codec();
  const int64_t rb = c.row_bytes();
  tokens_per_rank_.assign(static_cast<size_t>(num_ranks_), 0);
  std::vector<int64_t> bytes(static_cast<size_t>(num_ranks_));
  std::vector<int> src_rank;
  num_rows_ = 0;
  for (int r = 0; r < num_ranks_; ++r) {
    const int64_t T = table[static_cast<size_t>(r)][0];
    tokens_per_rank_[static_cast<size_t>(r)] = T;
    bytes[static_cast<size_t>(r)] = T * rb;
    if (r == rank_) token_offset_ = num_rows_;
    num_rows_ += T;
    src_rank.insert(src_rank.end(), static_cast<size_t>(T), r);
  }
  std::vector<uint8_t> mine, all(static_cast<size_t>(num_rows_ * rb));
  c.encode(args.x, routing, mine);
  group_->all_gatherv(mine.data(), all.data(), bytes);
  num_exposed_rows_ = num_local_ > 0 ? num_rows_ : 0;
  decode_flat(all.data(), num_exposed_rows_, src_rank, recv_);
  stats_.remote_bytes_dispatch = (num_ranks_ - 1) * routing.num_tokens * rb;
  if (padded_) {  // every rank's block has C rows: R * C Flat rows, the real ones at s * C + t
    stats_.remote_bytes_dispatch = (num_ranks_ - 1) * padded_block_bytes();
    if (num_local_ > 0) {
      recv_ = pad_flat(recv_, tokens_per_rank_, padded_row_);
      num_exposed_rows_ = recv_.x.size(0);
    }
  }
  return recv_.result();
}

const void* GatherCpu::partials(const FinalizeArgs& args) {
  if (padded_ && num_local_ > 0) return compact_partials(args.expert_out, padded_row_);
  if (num_exposed_rows_ == num_rows_) return args.expert_out.data;
  zeros_.assign(static_cast<size_t>(num_rows_ * cfg_.hidden), 0.0f);  // room for fp32 or bf16 zeros
  return zeros_.data();
}

}  // namespace epx::dispatch
