// dispatch/ll/ll_layout.h: byte layout of the LL (low-latency) symmetric buffer, the one source of
// offsets for the CPU reference (ll_cpu.cpp) and the CUDA kernels (ll_cuda_kernels.cu), so they
// cannot drift apart.
//
// Every rank holds one buffer of ll_buffer_bytes(cfg, R) bytes (Group::alloc_symmetric). Calls are
// numbered n = 0, 1, 2, ... per object (every rank makes the same calls); call n uses the payload
// regions of parity p = n % 2, so a source may run one call ahead of a destination still reading
// (the proof is in ll_cuda.h). Signals are monotonic: nobody resets them, so CUDA-graph replays of
// any number of graphs stay consistent.
//
//   [0, signal_bytes)          signals, uint64 (8-byte aligned), one word per (source, send block) so
//                              no two senders ever touch one word (no contended remote atomics):
//                                dispatch_flag[R src][kMaxSignalBlocks]: block b of source s stores
//                                  n + 1 (release order) after its messages of call n; a destination
//                                  waits until all B_s flags of every source reached n + 1
//                                combine_flag[R][kMaxSignalBlocks]: the same for the combine rows
//                                  that expert rank s sent back here
//                                dispatch_count[2][R]: source s writes the number of messages it
//                                  sent here in call n at [n % 2][s] before block 0's flag
//                                expert_count[2][R src][num_ids] int32 (CUDA sender, ll.expand =
//                                  message): tokens source s sent here for local expert l in call n
//                                  at [n % 2][s][l], before its flag (the receiver's slot bases)
//                              ll.signal = rank: only the word of block 0 is used per source (the
//                                last of the source's blocks to finish stores it; see ll_cuda.h)
//                              ll.signal = chunk (with ll.expand = message): the counts carry a tag
//                                (count_tag: dispatch_count = tag << 32 | n, expert_count = tag << 30
//                                | n) and are stored before the payload, with
//                                slot_token[2][R src][max_T slots] uint64 = (n + 1 mod 2^32) << 32 | t:
//                                the source token in message slot j (the receiver finds the send
//                                blocks of its chunks from t), the call's full number as the tag (a
//                                slot's word can be many calls old; ll_cuda_kernels.cu slot_token_word);
//                                the block flags as in ll.signal = block
//   [dispatch_recv_offset, ..) messages: [2 parity][R src][max_T slots][msg_bytes]; slot j of source
//                                s is the j-th token s sent here in that call (source token order)
//   [combine_recv_offset, ..)  this rank as a source: [2 parity][max_T][K][H] bf16; row (t, k) holds
//                                the unweighted expert output for token t's selection in column k,
//                                where k is the first column naming that expert (duplicates share it)
//                              partial modes (LlCombine): [2 parity][max_T][R][H] fp32 | bf16; row
//                                (t, r) holds rank r's partial sum for token t
//
// One message (a token crosses to a destination rank once, whatever number of its experts live
// there; the destination expands it into per-expert slots):
//   [0, 16)                    header: int32 src_token_idx, int32 reserved[3]
//   [16, 16 + align16(4K))     topk ids int32 [K] as the source gave them (global ids; E = shared route)
//   [.., + align16(4K))        slot of the token within this source for each column's expert: the
//                              number of the source's tokens before it that select the same id
//                              (written by the CUDA sender with ll.expand = message; the CPU
//                              reference and the expert-mode receiver do not read it)
//   [.., + align16(4K))        partial combine modes only: topk weights fp32 [K] (the expert side
//                              weights its rows before it sums them)
//   [payload_offset, +P)       bf16 [H] (P = 2H) | fp8_e4m3 [H] (P = H)
//   [scales_offset, +H/128*4)  fp32 scales [H/128] (fp8 only), as quantized on the source
//   padded to 16 bytes
// All offsets are 64-bit (rows x hidden can pass 2^31).
#pragma once

#include <cstdint>

#include "epx/dispatch.h"
#include "epx/dtype.h"

namespace epx::dispatch {

EPX_HOST_DEVICE int64_t ll_align_up(int64_t value, int64_t align) { return (value + align - 1) / align * align; }

struct LlLayout {
  int64_t hidden = 0;   ///< H
  int num_ranks = 0;    ///< R
  int max_tokens = 0;   ///< num_max_dispatch_tokens_per_rank
  int top_k = 0;        ///< K
  bool use_fp8 = false; ///< fp8_e4m3 payload + fp32 1x128 scales
  int combine = 0;      ///< LlCombine: 0 column, 1 partial_fp32, 2 partial_bf16
  int num_ids = 1;      ///< E + 1: routed ids and the shared route (stride of expert_count)

  static constexpr int64_t kMsgAlignBytes = 16;     ///< one 128-bit vector store
  static constexpr int64_t kRegionAlignBytes = 128; ///< regions start on their own cache lines
  static constexpr int64_t kHeaderBytes = 16;
  static constexpr int64_t kScaleGroup = 128;

  // ---- one message ----
  EPX_HOST_DEVICE int64_t payload_bytes() const { return use_fp8 ? hidden : 2 * hidden; }
  EPX_HOST_DEVICE int64_t scale_bytes() const { return use_fp8 ? hidden / kScaleGroup * 4 : 0; }
  EPX_HOST_DEVICE bool partial() const { return combine != 0; }
  EPX_HOST_DEVICE int64_t msg_topk_offset() const { return kHeaderBytes; }
  EPX_HOST_DEVICE int64_t msg_slots_offset() const { return kHeaderBytes + ll_align_up(4 * static_cast<int64_t>(top_k), kMsgAlignBytes); }
  EPX_HOST_DEVICE int64_t msg_weights_offset() const { return kHeaderBytes + 2 * ll_align_up(4 * static_cast<int64_t>(top_k), kMsgAlignBytes); }
  EPX_HOST_DEVICE int64_t msg_payload_offset() const {
    return kHeaderBytes + (partial() ? 3 : 2) * ll_align_up(4 * static_cast<int64_t>(top_k), kMsgAlignBytes);
  }
  EPX_HOST_DEVICE int64_t msg_scales_offset() const { return msg_payload_offset() + payload_bytes(); }
  EPX_HOST_DEVICE int64_t msg_bytes() const { return ll_align_up(msg_scales_offset() + scale_bytes(), kMsgAlignBytes); }

  // ---- the buffer ----
  static constexpr int kMaxSignalBlocks = 256;  ///< send blocks per rank (B <= this)
  EPX_HOST_DEVICE int64_t dispatch_flag_offset(int src_rank, int block) const {
    return 8 * (static_cast<int64_t>(src_rank) * kMaxSignalBlocks + block);
  }
  EPX_HOST_DEVICE int64_t combine_flag_offset(int src_rank, int block) const {
    return 8 * ((static_cast<int64_t>(num_ranks) + src_rank) * kMaxSignalBlocks + block);
  }
  EPX_HOST_DEVICE int64_t dispatch_count_offset(int parity, int src_rank) const {
    return 8 * (2 * static_cast<int64_t>(num_ranks) * kMaxSignalBlocks + static_cast<int64_t>(num_ranks) * parity + src_rank);
  }
  /// int32 count of tokens source `src_rank` sent for local expert `local` of this rank (message expansion).
  EPX_HOST_DEVICE int64_t expert_count_offset(int parity, int src_rank, int local) const {
    return 8 * (2 * static_cast<int64_t>(num_ranks) * kMaxSignalBlocks + 2 * static_cast<int64_t>(num_ranks)) +
           4 * ((static_cast<int64_t>(parity) * num_ranks + src_rank) * num_ids + local);
  }
  /// ll.signal = chunk: the uint64 word naming the source token of message slot `slot` from `src_rank`
  /// (parity p) and the call that stored it (8-byte aligned: the regions before it are whole 8-byte words).
  EPX_HOST_DEVICE int64_t slot_token_offset(int parity, int src_rank, int slot) const {
    return expert_count_offset(2, 0, 0) + 8 * ((static_cast<int64_t>(parity) * num_ranks + src_rank) * max_tokens + slot);
  }
  EPX_HOST_DEVICE int64_t signal_bytes() const { return ll_align_up(slot_token_offset(2, 0, 0), kRegionAlignBytes); }
  EPX_HOST_DEVICE int64_t dispatch_recv_offset() const { return signal_bytes(); }
  EPX_HOST_DEVICE int64_t dispatch_region_bytes() const { return static_cast<int64_t>(num_ranks) * max_tokens * msg_bytes(); }
  EPX_HOST_DEVICE int64_t dispatch_msg_offset(int parity, int src_rank, int slot) const {
    return dispatch_recv_offset() + parity * dispatch_region_bytes() + (static_cast<int64_t>(src_rank) * max_tokens + slot) * msg_bytes();
  }
  EPX_HOST_DEVICE int64_t combine_recv_offset() const {
    return ll_align_up(dispatch_recv_offset() + 2 * dispatch_region_bytes(), kRegionAlignBytes);
  }
  /// Bytes of one partial row (partial modes): fp32 or bf16 [H].
  EPX_HOST_DEVICE int64_t partial_row_bytes() const { return (combine == 1 ? 4 : 2) * hidden; }
  EPX_HOST_DEVICE int64_t combine_region_bytes() const {
    return partial() ? static_cast<int64_t>(max_tokens) * num_ranks * partial_row_bytes() : static_cast<int64_t>(max_tokens) * top_k * 2 * hidden;
  }
  /// Partial modes: where expert rank r's partial for token `token` lands on the source.
  EPX_HOST_DEVICE int64_t combine_partial_offset(int parity, int token, int r) const {
    return combine_recv_offset() + parity * combine_region_bytes() + (static_cast<int64_t>(token) * num_ranks + r) * partial_row_bytes();
  }
  EPX_HOST_DEVICE int64_t combine_row_offset(int parity, int token, int column) const {
    return combine_recv_offset() + parity * combine_region_bytes() + (static_cast<int64_t>(token) * top_k + column) * 2 * hidden;
  }
  EPX_HOST_DEVICE int64_t total_bytes() const {
    return ll_align_up(combine_recv_offset() + 2 * combine_region_bytes(), kRegionAlignBytes);
  }

  /// DeepEP LL accounting (ANCHORS.md): bytes per valid (token, expert) selection in dispatch,
  /// H + H/128*4 + 16 for fp8 (7408 at H = 7168), 2H + 16 for bf16; combine is 2H per selection.
  EPX_HOST_DEVICE int64_t deepep_dispatch_bytes_per_selection() const { return payload_bytes() + scale_bytes() + 16; }
  EPX_HOST_DEVICE int64_t deepep_combine_bytes_per_selection() const { return 2 * hidden; }
};

/// Layout for a config on R ranks (host).
inline LlLayout ll_layout(const DispatchConfig& cfg, int num_ranks) {
  return {cfg.hidden, num_ranks, cfg.num_max_dispatch_tokens_per_rank, cfg.top_k, cfg.dispatch_dtype == DType::fp8_e4m3,
          static_cast<int>(cfg.ll_combine), cfg.num_experts + 1};
}

/// Size hint (DeepEP get_low_latency_rdma_size_hint): bytes of the symmetric buffer each rank
/// allocates for the "ll" backend with `cfg` on `num_ranks` ranks.
inline int64_t ll_buffer_bytes(const DispatchConfig& cfg, int num_ranks) { return ll_layout(cfg, num_ranks).total_bytes(); }

}  // namespace epx::dispatch
