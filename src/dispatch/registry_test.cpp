// Unit tests of expert placement and of the LL buffer layout (the offsets the CUDA kernels share).
#include <gtest/gtest.h>

#include "dispatch/ll/ll_layout.h"
#include "epx/dispatch.h"
#include "epx/error.h"

using namespace epx;

TEST(ExpertPlacement, RangesCoverAllExpertsAndDifferByAtMostOne) {
  for (int R = 1; R <= 9; ++R)
    for (int E : {1, 2, 3, 7, 8, 16, 255, 256, 288}) {
      int next = 0, min_size = E, max_size = 0;
      for (int r = 0; r < R; ++r) {
        const ExpertRange range = expert_range(E, R, r);
        EXPECT_EQ(range.begin, next) << "E=" << E << " R=" << R << " r=" << r;
        next = range.end;
        min_size = std::min(min_size, range.size());
        max_size = std::max(max_size, range.size());
        for (int e = range.begin; e < range.end; ++e) EXPECT_EQ(expert_rank(E, R, e), r) << "E=" << E << " R=" << R << " e=" << e;
      }
      EXPECT_EQ(next, E);
      EXPECT_LE(max_size - min_size, 1);
    }
  EXPECT_EQ(expert_range(7, 3, 0).size(), 3);  // the first E % R ranks hold one more
  EXPECT_EQ(expert_range(7, 3, 2).size(), 2);
  EXPECT_THROW(expert_rank(8, 2, 8), InvalidArgument);
  EXPECT_THROW(expert_rank(8, 2, -1), InvalidArgument);
  EXPECT_THROW(expert_range(8, 2, 2), InvalidArgument);
  DispatchConfig cfg;
  cfg.num_experts = 7;
  EXPECT_EQ(num_local_experts(cfg, 3, 1), 2);
  cfg.shared_route = true;
  EXPECT_EQ(num_local_experts(cfg, 3, 1), 3);  // + the shared replica, last local index
}

TEST(LlLayout, DeepSeekV3DecodeNumbers) {
  DispatchConfig cfg;
  cfg.hidden = 7168;
  cfg.num_experts = 256;
  cfg.top_k = 8;
  cfg.num_max_dispatch_tokens_per_rank = 128;
  cfg.dispatch_dtype = DType::fp8_e4m3;
  cfg.ll_combine = LlCombine::column;
  const dispatch::LlLayout lay = dispatch::ll_layout(cfg, 2);
  EXPECT_EQ(lay.deepep_dispatch_bytes_per_selection(), 7408);  // ANCHORS.md: H + H/128*4 + 16
  EXPECT_EQ(lay.deepep_combine_bytes_per_selection(), 14336);
  // message = 16 header + 32 topk ids + 32 per-column slots + 7168 fp8 + 224 scales
  EXPECT_EQ(lay.msg_slots_offset(), 48);
  EXPECT_EQ(lay.msg_bytes(), 16 + 32 + 32 + 7168 + 224);
  EXPECT_EQ(lay.msg_payload_offset(), 80);
  EXPECT_EQ(lay.msg_scales_offset(), 80 + 7168);
  EXPECT_EQ(dispatch::ll_buffer_bytes(cfg, 2), lay.total_bytes());
  // 8 * (2 R 256 + 2 R) = 8224 of flags and counts, 4 * 2 R (E + 1) = 4112 of expert counts, then the
  // slot tokens (chunk signals, uint64 words) 8 * 2 R max_T = 4096 from 12336 (8-byte aligned), 128-byte aligned end
  EXPECT_EQ(lay.expert_count_offset(0, 0, 0), 8224);
  EXPECT_EQ(lay.slot_token_offset(0, 0, 0), 12336);
  EXPECT_EQ(lay.slot_token_offset(0, 0, 0) % 8, 0);
  EXPECT_EQ(lay.slot_token_offset(1, 1, 127), 12336 + 4096 - 8);
  EXPECT_EQ(lay.signal_bytes(), 16512);
  EXPECT_EQ(lay.total_bytes(), lay.signal_bytes() + 2 * (2 * 128 * 7472) + 2 * (128 * 8 * 7168 * 2));
  // partial_fp32 (the default): the message carries the K weights too; the combine region holds one
  // fp32 row per (token, rank)
  cfg.ll_combine = LlCombine::partial_fp32;
  const dispatch::LlLayout part = dispatch::ll_layout(cfg, 2);
  EXPECT_EQ(part.msg_weights_offset(), 80);
  EXPECT_EQ(part.msg_payload_offset(), 112);
  EXPECT_EQ(part.msg_bytes(), 16 + 32 + 32 + 32 + 7168 + 224);
  EXPECT_EQ(part.total_bytes(), part.signal_bytes() + 2 * (2 * 128 * 7504) + 2 * (128 * 2 * 7168 * 4));
  EXPECT_EQ(dispatch::ll_buffer_bytes(cfg, 2), part.total_bytes());
  cfg.ll_combine = LlCombine::partial_bf16;
  EXPECT_EQ(dispatch::ll_layout(cfg, 2).total_bytes(), part.signal_bytes() + 2 * (2 * 128 * 7504) + 2 * (128 * 2 * 7168 * 2));
}

TEST(LlLayout, RegionsAreAlignedAndDisjoint) {
  for (int R : {1, 2, 3, 8})
    for (int K : {1, 3, 8, 9})
      for (int64_t H : {8, 128, 7168})
        for (bool fp8 : {false, true})
        for (int mode : {0, 1, 2}) {
          if (fp8 && H % 128) continue;
          const dispatch::LlLayout lay{H, R, 5, K, fp8, mode, 7};
          EXPECT_GE(lay.msg_slots_offset(), 16 + 4 * K);
          EXPECT_GE(lay.msg_payload_offset(), lay.msg_slots_offset() + 4 * K);
          if (lay.partial()) {
            EXPECT_GE(lay.msg_weights_offset(), lay.msg_slots_offset() + 4 * K);
            EXPECT_GE(lay.msg_payload_offset(), lay.msg_weights_offset() + 4 * K);
            EXPECT_GE(lay.combine_partial_offset(1, 0, 0), lay.combine_partial_offset(0, 4, R - 1) + lay.partial_row_bytes());
            EXPECT_GE(lay.combine_partial_offset(0, 0, 0), lay.dispatch_msg_offset(1, R - 1, 4) + lay.msg_bytes());
            EXPECT_GE(lay.total_bytes(), lay.combine_partial_offset(1, 4, R - 1) + lay.partial_row_bytes());
            EXPECT_EQ(lay.combine_partial_offset(0, 0, 0) % 16, 0);
          }
          EXPECT_EQ(lay.msg_bytes() % 16, 0);
          EXPECT_EQ(lay.msg_payload_offset() % 16, 0);
          EXPECT_GE(lay.msg_payload_offset(), 16 + 4 * K);
          EXPECT_GE(lay.msg_bytes(), lay.msg_scales_offset() + lay.scale_bytes());
          const int nb = dispatch::LlLayout::kMaxSignalBlocks;
          EXPECT_GE(lay.combine_flag_offset(0, 0), lay.dispatch_flag_offset(R - 1, nb - 1) + 8);
          EXPECT_GE(lay.dispatch_count_offset(0, 0), lay.combine_flag_offset(R - 1, nb - 1) + 8);
          EXPECT_GE(lay.dispatch_count_offset(1, 0), lay.dispatch_count_offset(0, R - 1) + 8);
          EXPECT_GE(lay.expert_count_offset(0, 0, 0), lay.dispatch_count_offset(1, R - 1) + 8);
          EXPECT_EQ(lay.expert_count_offset(1, 0, 0), lay.expert_count_offset(0, R - 1, 6) + 4);
          EXPECT_GE(lay.slot_token_offset(0, 0, 0), lay.expert_count_offset(1, R - 1, 6) + 4);
          EXPECT_GE(lay.signal_bytes(), lay.slot_token_offset(1, R - 1, 4) + 8);
          EXPECT_EQ(lay.slot_token_offset(0, 0, 0) % 8, 0);  // uint64 words (chunk signals)
          EXPECT_EQ(lay.dispatch_recv_offset() % 128, 0);
          EXPECT_EQ(lay.combine_recv_offset() % 128, 0);
          EXPECT_GE(lay.dispatch_msg_offset(1, 0, 0), lay.dispatch_msg_offset(0, R - 1, 4) + lay.msg_bytes());
          EXPECT_GE(lay.combine_recv_offset(), lay.dispatch_msg_offset(1, R - 1, 4) + lay.msg_bytes());
          if (!lay.partial()) {  // column mode's rows (the partial modes' rows are checked above)
            EXPECT_GE(lay.combine_row_offset(1, 0, 0), lay.combine_row_offset(0, 4, K - 1) + 2 * H);
            EXPECT_GE(lay.total_bytes(), lay.combine_row_offset(1, 4, K - 1) + 2 * H);
          }
          EXPECT_EQ(lay.total_bytes() % 128, 0);
        }
}
