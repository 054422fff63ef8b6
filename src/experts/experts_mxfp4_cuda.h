// experts/experts_mxfp4_cuda.h: the tensor-core grouped GEMMs for MXFP4 experts on sm_90a, which
// also run fp8_block experts in the same launch (FHMoE: an FP8 shared expert next to MXFP4 routed
// experts, one grouped launch per GEMM). Used by experts_cuda.cu for objects whose experts are all
// fp8_block or mxfp4, fed FP8 activations. Host-side declarations; the kernels are in
// experts_mxfp4_cuda.cu. Layout and precision rules: epx/experts.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "experts/experts_cuda_types.h"
#include "experts/experts_fp8_cuda.h"

namespace epx::experts_cuda {

/// Arguments of one mixed-format GEMM launch (gate_up or down) over the device-side tile list.
/// Row space: as Tile (experts_cuda_types.h). Tiles hold at most kTileRows (64) rows.
struct MixedGemmParams {
  const ExpertDesc* experts;  ///< [L]; fp8_block and mxfp4 experts are computed, bf16 ones skipped
  const Tile* tiles;          ///< device tile list (schedule kernels)
  const int32_t* num_tiles;   ///< [1] on the device
  int32_t max_weight_tiles;   ///< weight tiles per row tile, upper bound over experts
  int64_t hidden;             ///< H (multiple of 128)
  // gate_up input: x rows (FP8 e4m3 [*, H]) + scales [*, H/128]; gather = row space -> x row (Flat) or null
  const uint8_t* x;
  const float* x_scales;
  const int32_t* gather;
  // h of fp8_block experts: FP8 e4m3 [row space, h_stride] bytes + fp32 scales [row space, hs_stride]
  uint8_t* hq;
  float* hs;
  int64_t h_stride;
  int64_t hs_stride;
  // h of mxfp4 experts: bf16 [row space, hb_stride] (elements; multiple of 128)
  uint16_t* hb;
  int64_t hb_stride;
  // down output: bf16 [row space, H]
  uint16_t* out;
  /// Tiles of <= 16 rows of mxfp4 experts run on the mma.sync decode path (experts_mxfp4_kernels.cuh:
  /// weights streamed from HBM through shared memory into mma.sync's registers, no shared-memory
  /// expansion): flag 1 the path itself (9..16 rows decode_item_ring, <= 8 decode_item_ring2), flag 2
  /// decode_item_bulk for <= 8 rows where its shapes allow (mx_maps, K % 512 == 0, K <= 8192 gate_up /
  /// 4096 down); without mx_maps flag 2's items take decode_item_ring2. 0: the BN 16 wgmma kernel. The
  /// library always passes 1 | 2. Same results within fp32 summation order.
  int decode = 1 | 2;
  /// [L][4] TMA maps of the mxfp4 experts (mxfp4_decode_maps; other experts' entries zero), or null:
  /// decode_item_bulk (flag 2) needs them.
  const Fp8TmaMap* mx_maps = nullptr;
};

/// True when fp8_tensor_cores_available(device) and the mixed kernels' shared-memory limit is
/// raised on `device` (first call per device; call before launching, outside graph capture).
bool mxfp4_tensor_cores_available(int device);

/// Debug instrumentation of the mixed kernels (the bench's --stamps; never set by the library).
/// Phases of one K-loop stage, in order, then per-item and per-CTA parts; the buffer holds
/// unsigned long long [2 GEMMs (gate_up, down)][kMixedDebugWarps][kMixedDebugPhases] of clock64
/// cycles summed over the CTAs (lane 0 of each warp adds its own sums), zeroed by the caller.
enum MixedDebugPhase : int {
  kDbgIssue = 0,      ///< wgmma fence + issue + commit of stage kb
  kDbgLoadWait = 1,   ///< cp.async.wait_group for stage kb + 1
  kDbgConvert = 2,    ///< the e2m1 expansion of stage kb + 1
  kDbgMmaWait = 3,    ///< wgmma.wait_group of stage kb
  kDbgPromote = 4,    ///< the per-K-block promotion (gate_up)
  kDbgFence = 5,      ///< fence.proxy.async
  kDbgBarrier = 6,    ///< __syncthreads of the stage
  kDbgLoadIssue = 7,  ///< cp.async of stage kb + S and the commit
  kDbgPrologue = 8,   ///< item set-up (rows, tile) + the ring prologue
  kDbgEpilogue = 9,   ///< after the K loop to the end of the item (SiLU, staging, stores)
  kDbgStages = 10,    ///< count: K-loop stages
  kDbgMxItems = 11,   ///< count: mxfp4 items
  kDbgFp8Items = 12,  ///< count: fp8_block items
  kDbgKernel = 13,    ///< cycles from kernel start to end
  kDbgCtas = 14,      ///< count: CTAs
  kMixedDebugPhases = 16,
};
constexpr int kMixedDebugWarps = 16;  ///< warp slots per CTA in the debug buffer (the kernels use 8; unused slots stay 0)
constexpr int kMixedDebugWords = 2 * kMixedDebugWarps * kMixedDebugPhases;
/// mode 0: the normal kernels (default); 1: stamped kernels writing into `buffer` (device memory of
/// kMixedDebugWords words); 2: stamped, the expansion skipped (wrong results: an ablation for timing
/// only); 3: stamped, the raw weight / scale loads with the .L2::256B prefetch hint (same results as
/// 1: an A/B of the DRAM access size). The debug kernels compute mxfp4 items of <= 16 rows only (decode at 8 rows per expert);
/// other items are skipped. With the decode path on (MixedGemmParams::decode), modes 1 and 2 run it
/// (decode_item_ring: load_wait = the ring wait, load_issue = the next window's copies, convert = the
/// window body; mode 2 skips the body), mode 3 the BN 16 wgmma kernel. Process-wide; not thread-safe.
void set_mixed_debug(unsigned long long* buffer, int mode);

/// gate_up of every tile: fp8_block experts write FP8 1x128 h (hq, hs) as launch_fp8_gate_up;
/// mxfp4 experts (intermediate % 128 == 0) write h rounded to bf16 (hb).
/// epi (non-null: [L] ExpertEpi on the device): the experts' biases and activations (mixed_gemm_epi_kernel, every
/// item on the wgmma path: MixedGemmParams::decode and set_mixed_debug do not apply).
void launch_mixed_gate_up(const MixedGemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi = nullptr);
/// down of every tile: out = bf16(h W_down^T) for the fp8_block and mxfp4 experts (+ b2 with epi).
void launch_mixed_down(const MixedGemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi = nullptr);

}  // namespace epx::experts_cuda
