// dispatch/placement.h: expert placement arithmetic, shared by the public placement functions
// (registry.cpp), the CPU backends and the CUDA kernels, so host and device cannot disagree on where
// an expert lives (STYLE.md §2: one layout source, EPX_HOST_DEVICE).
//
// E routed experts are split over R ranks into contiguous ranges whose sizes differ by at most one:
// the first E % R ranks hold one more. With shared_route, id E means "the shared expert replica on
// the token's own rank", local expert num_local(rank) - 1 there. No argument checks here: callers
// validate ids first (a negative id never reaches rank_of).
#pragma once

#include <cstdint>

#include "epx/dtype.h"  // EPX_HOST_DEVICE

namespace epx::dispatch {

struct Placement {
  int num_experts = 0;  ///< E (routed)
  int num_ranks = 1;    ///< R
  bool shared_route = false;

  /// First routed expert of `rank`.
  EPX_HOST_DEVICE int range_begin(int rank) const {
    const int base = num_experts / num_ranks, extra = num_experts % num_ranks;
    return rank * base + (rank < extra ? rank : extra);
  }
  /// One past the last routed expert of `rank`.
  EPX_HOST_DEVICE int range_end(int rank) const {
    const int base = num_experts / num_ranks, extra = num_experts % num_ranks;
    return range_begin(rank) + base + (rank < extra ? 1 : 0);
  }
  /// Rank holding routed expert e, 0 <= e < E.
  EPX_HOST_DEVICE int rank_of(int e) const {
    const int base = num_experts / num_ranks, extra = num_experts % num_ranks;
    const int big = extra * (base + 1);  // experts held by the ranks with one more
    return e < big ? e / (base + 1) : extra + (e - big) / base;
  }
  /// L of `rank`: its routed range, plus the shared replica.
  EPX_HOST_DEVICE int num_local(int rank) const { return range_end(rank) - range_begin(rank) + (shared_route ? 1 : 0); }
  /// Rank that processes selection `id` of a token from `src_rank`; -1 for no selection (id < 0).
  EPX_HOST_DEVICE int dest_rank(int32_t id, int src_rank) const {
    if (id < 0) return -1;
    if (id == num_experts) return src_rank;
    return rank_of(id);
  }
  /// Local expert index of `id` (from `src_rank`) on `dst_rank`, or -1 if it is not processed there.
  EPX_HOST_DEVICE int local_index(int32_t id, int src_rank, int dst_rank) const {
    if (id < 0) return -1;
    if (id == num_experts) return src_rank == dst_rank ? num_local(dst_rank) - 1 : -1;
    const int begin = range_begin(dst_rank);
    return id >= begin && id < range_end(dst_rank) ? id - begin : -1;
  }
  /// Largest valid id: E with the shared route, else E - 1.
  EPX_HOST_DEVICE int max_id() const { return shared_route ? num_experts : num_experts - 1; }
  /// Whether `id` may stand in column k of a [T, K] topk_idx (the one rule of every backend, CPU and
  /// CUDA): -1 (no selection) anywhere; without shared_route an id in [0, E); with shared_route the
  /// FHMoE layout of issue 6 (K-1 routed columns, then the shared route): columns k < K-1 hold ids in
  /// [0, E), the last column (k = K-1) holds E (fused) or -1 (the shared expert runs separately).
  EPX_HOST_DEVICE bool valid_id(int64_t id, int64_t k, int64_t K) const {
    if (id == -1) return true;
    if (shared_route && k == K - 1) return id == num_experts;
    return id >= 0 && id < num_experts;
  }
};

}  // namespace epx::dispatch
