#include "dispatch/dedup_cpu.h"

#include <cstring>

namespace epx::dispatch {

void DedupCpu::plan(const Routing& routing) {
  const int64_t T = routing.num_tokens;
  if (cache_layout_ && planned_tokens_ == T && planned_idx_ == routing.idx) {
    ++layout_cache_hits_;
    return;
  }
  send_tokens_.assign(static_cast<size_t>(num_ranks_), {});
  is_token_in_rank_.assign(static_cast<size_t>(T * num_ranks_), 0);
  std::vector<uint8_t> in_rank;
  for (int64_t t = 0; t < T; ++t) {
    token_dest_ranks(routing, t, in_rank);
    for (int d = 0; d < num_ranks_; ++d) {
      if (!in_rank[static_cast<size_t>(d)]) continue;
      send_tokens_[static_cast<size_t>(d)].push_back(static_cast<int32_t>(t));
      is_token_in_rank_[static_cast<size_t>(t * num_ranks_ + d)] = 1;
    }
  }
  planned_tokens_ = T;
  planned_idx_ = routing.idx;
}

PrepareResult DedupCpu::prepare(const DispatchArgs& args) {
  Routing routing;
  const auto table = begin_prepare(args, routing, num_ranks_, [&](const Routing& r) {
    plan(r);
    std::vector<int64_t> counts(static_cast<size_t>(num_ranks_));
    for (int d = 0; d < num_ranks_; ++d) counts[static_cast<size_t>(d)] = static_cast<int64_t>(send_tokens_[static_cast<size_t>(d)].size());
    return counts;
  });
  const RowCodec c = codec();
  const int64_t rb = c.row_bytes();
  count_matrix_.assign(static_cast<size_t>(num_ranks_), std::vector<int64_t>(static_cast<size_t>(num_ranks_)));
  for (int s = 0; s < num_ranks_; ++s)
    for (int d = 0; d < num_ranks_; ++d) count_matrix_[static_cast<size_t>(s)][static_cast<size_t>(d)] = table[static_cast<size_t>(s)][static_cast<size_t>(1 + d)];

  // Encode each token once (one quantization), then copy it into every destination's block.
  std::vector<uint8_t> rows, send;
  c.encode(args.x, routing, rows);
  std::vector<int64_t> send_bytes(static_cast<size_t>(num_ranks_)), recv_bytes(static_cast<size_t>(num_ranks_));
  int64_t num_send = 0, num_recv = 0;
  for (int d = 0; d < num_ranks_; ++d) num_send += static_cast<int64_t>(send_tokens_[static_cast<size_t>(d)].size());
  send.resize(static_cast<size_t>(num_send * rb));
  uint8_t* dst = send.data();
  stats_.remote_bytes_dispatch = 0;
  for (int d = 0; d < num_ranks_; ++d) {
    for (int32_t t : send_tokens_[static_cast<size_t>(d)]) {
      std::memcpy(dst, rows.data() + t * rb, static_cast<size_t>(rb));
      dst += rb;
    }
    send_bytes[static_cast<size_t>(d)] = static_cast<int64_t>(send_tokens_[static_cast<size_t>(d)].size()) * rb;
    if (d != rank_) stats_.remote_bytes_dispatch += send_bytes[static_cast<size_t>(d)];
  }
  recv_src_rank_.clear();
  for (int s = 0; s < num_ranks_; ++s) {
    const int64_t n = count_matrix_[static_cast<size_t>(s)][static_cast<size_t>(rank_)];
    recv_bytes[static_cast<size_t>(s)] = n * rb;
    recv_src_rank_.insert(recv_src_rank_.end(), static_cast<size_t>(n), s);
    num_recv += n;
  }
  std::vector<uint8_t> recv(static_cast<size_t>(num_recv * rb));
  group_->all_to_allv(send.data(), send_bytes, recv.data(), recv_bytes);
  decode_flat(recv.data(), num_recv, recv_src_rank_, recv_);
  if (padded_ && num_local_ > 0) {  // all2allv's padded form: C rows from every source, the real ones first in each block
    std::vector<int64_t> from(static_cast<size_t>(num_ranks_));
    for (int s = 0; s < num_ranks_; ++s) from[static_cast<size_t>(s)] = count_matrix_[static_cast<size_t>(s)][static_cast<size_t>(rank_)];
    recv_ = pad_flat(recv_, from, padded_row_);
    stats_.remote_bytes_dispatch = (num_ranks_ - 1) * padded_block_bytes();
  }
  return recv_.result();
}

void DedupCpu::finalize(const FinalizeArgs& args) {
  const int64_t H = cfg_.hidden;
  const DType dt = partial_dtype();
  const int64_t row = dtype_size(dt) * H;
  const int64_t num_recv = static_cast<int64_t>(recv_src_rank_.size());
  const bool padded_rows = padded_ && num_local_ > 0;
  begin_finalize(args, {padded_rows ? recv_.x.size(0) : num_recv, H});
  const void* expert_out = padded_rows ? compact_partials(args.expert_out, padded_row_) : args.expert_out.data;
  std::vector<int64_t> send_bytes(static_cast<size_t>(num_ranks_)), recv_bytes(static_cast<size_t>(num_ranks_));
  std::vector<int64_t> block_row(static_cast<size_t>(num_ranks_));  // first returned row from rank d
  int64_t num_back = 0;
  for (int r = 0; r < num_ranks_; ++r) {
    send_bytes[static_cast<size_t>(r)] = count_matrix_[static_cast<size_t>(r)][static_cast<size_t>(rank_)] * row;
    block_row[static_cast<size_t>(r)] = num_back;
    num_back += static_cast<int64_t>(send_tokens_[static_cast<size_t>(r)].size());
    recv_bytes[static_cast<size_t>(r)] = static_cast<int64_t>(send_tokens_[static_cast<size_t>(r)].size()) * row;
    if (r != rank_) stats_.remote_bytes_combine += send_bytes[static_cast<size_t>(r)];
  }
  std::vector<uint8_t> back(static_cast<size_t>(num_back * row));
  group_->all_to_allv(expert_out, send_bytes, back.data(), recv_bytes);
  if (padded_) {
    stats_.remote_bytes_combine = (num_ranks_ - 1) * cfg_.num_max_dispatch_tokens_per_rank * row;
    stats_.remote_bytes_dispatch = (num_ranks_ - 1) * padded_block_bytes();
  }

  // Returned rows come in the order tokens were sent: walk each destination's list once.
  const int64_t T = routed_tokens_;  // padded form with num_tokens: rows past it of out are left as they are
  std::vector<const uint8_t*> partials(static_cast<size_t>(T * num_ranks_), nullptr);
  for (int d = 0; d < num_ranks_; ++d) {
    const auto& tokens = send_tokens_[static_cast<size_t>(d)];
    for (size_t j = 0; j < tokens.size(); ++j)
      partials[static_cast<size_t>(tokens[j] * num_ranks_ + d)] = back.data() + (block_row[static_cast<size_t>(d)] + static_cast<int64_t>(j)) * row;
  }
  const float* addend = args.addend.defined() ? args.addend.ptr<const float>() : nullptr;
  if (dt == DType::fp32) {
    std::vector<const float*> mine(static_cast<size_t>(num_ranks_));
    for (int64_t t = 0; t < T; ++t) {
      for (int d = 0; d < num_ranks_; ++d)
        mine[static_cast<size_t>(d)] = reinterpret_cast<const float*>(partials[static_cast<size_t>(t * num_ranks_ + d)]);
      sum_partials_fp32(mine, addend ? addend + t * H : nullptr, H, args.out.ptr<uint16_t>() + t * H);
    }
    return;
  }
  std::vector<const uint16_t*> mine(static_cast<size_t>(num_ranks_));
  for (int64_t t = 0; t < T; ++t) {
    for (int d = 0; d < num_ranks_; ++d)
      mine[static_cast<size_t>(d)] = reinterpret_cast<const uint16_t*>(partials[static_cast<size_t>(t * num_ranks_ + d)]);
    sum_partials_bf16(mine, H, args.out.ptr<uint16_t>() + t * H);
  }
  // partial_bf16: the addend's add rounds once more (three roundings with the experts' own).
  if (addend) finish_rows(args.out.data, DType::bf16, addend, T * H, args.out.ptr<uint16_t>());
}

}  // namespace epx::dispatch
