// experts/experts_fp8_cuda.h: the tensor-core grouped GEMMs of the fp8_block experts on sm_90a
// (wgmma e4m3, fp32 accumulation, DeepSeek-V3 block-scale promotion), used by experts_cuda.cu for
// fp8_block experts fed FP8 activations. Host-side declarations; the kernels are in
// experts_fp8_cuda.cu. Layout and precision rules: epx/experts.h (fp8_block).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "experts/experts_cuda_types.h"

namespace epx::experts_cuda {

/// Arguments of one fp8 GEMM launch (gate_up or down) over the device-side tile list.
/// Row space: as Tile (experts_cuda_kernels.cuh). Tiles hold at most kTileRows (64) rows.
struct Fp8GemmParams {
  const ExpertDesc* experts;  ///< [L]; only fp8_block experts are computed, the others skipped
  const Tile* tiles;          ///< device tile list (schedule kernels)
  const int32_t* num_tiles;   ///< [1] on the device
  int32_t max_weight_tiles;   ///< weight tiles per row tile, upper bound over experts (work = tiles x this)
  int64_t hidden;             ///< H
  // gate_up input: x rows (FP8 e4m3 [*, H]) + scales [*, H/128]; gather = row space -> x row (Flat) or null
  const uint8_t* x;
  const float* x_scales;
  const int32_t* gather;
  // gate_up output / down input: h FP8 e4m3 [row space, h_stride] + scales [row space, hs_stride]
  uint8_t* hq;
  float* hs;
  int64_t h_stride;   ///< bytes per h row (>= max I over the fp8 experts, multiple of 128)
  int64_t hs_stride;  ///< floats per h-scale row (h_stride / 128)
  // down output: bf16 [row space, H]
  uint16_t* out;
  /// [1] on the device, or null. Non-null: the schedule split the tile list (ScheduleParams::
  /// big_rows): tiles [0, *num_small) hold <= kTileRows rows and run on launch_fp8_gate_up/down,
  /// tiles [*num_small, *num_tiles) hold <= kFp8PrefillRows rows and run on the prefill kernels.
  const int32_t* num_small;
  /// Prefill kernels' ring depth (stages of 48 KiB): 0 = their maximum (gate_up 4, down 3), else
  /// clamped to [2, maximum]. Same results for every depth.
  int32_t prefill_stages;
  /// TMA prefill kernels only: [2 L] TMA descriptors of the experts' weights on the device (w13 of
  /// expert l at 2 l, w2 at 2 l + 1; fp8_prefill_weight_maps); null there: cp.async loads.
  const void* w_maps;
  /// Rows of the row space (ExpertMajor L * cap, Flat N * K): the outer extent of the TMA prefill
  /// kernels' descriptors of x (ExpertMajor gate_up) and hq (down).
  int64_t row_space;
  /// TMA prefill kernels, Flat gate_up (gather non-null): the token rows of
  /// the prefill tiles in row-space order ([row space, H] FP8, row stride x_perm_stride bytes, written by
  /// launch_fp8_prefill_permute_x before the gate_up), loaded one TMA box per tile as ExpertMajor's x; null:
  /// the gather by cp.async. Same bits either way.
  uint8_t* x_perm;
  int64_t x_perm_stride;
  /// The launches set it (2: the cp.async kernels, 5: the TMA kernels); the TMA launch takes its 2-CTA
  /// clusters only with 5. The kernels do not read it.
  int32_t prefill_fast;
  /// TMA prefill kernels: 0 = one CTA per work item; 1 (the library's) = 2-CTA clusters: a cluster takes tile-list entries 2 j, 2 j + 1 (one
  /// 128-row tile each) at the same weight tile, both rings in lockstep (a stage is refilled when the consumers of
  /// both CTAs released it), and where both tiles are the same expert's each CTA's TMA loads one 128-row half of the
  /// 256-row weight tile multicast into both CTAs (L2 -> SM weight bytes halved); 2 = the same clusters and
  /// lockstep without the multicast (each CTA loads its whole weight tile; the lockstep's cost alone). Same bits as 0.
  int32_t prefill_cluster;
  /// Debug only (set_fp8_prefill_debug; null / 0 in the library's launches): the stamped kernels'
  /// buffer and ablation flags, filled in by the launch functions.
  uint32_t* debug;
  uint32_t debug_flags;
};

/// Debug instrumentation of the cp.async prefill kernels (the
/// bench's --stamps; never set by the library). While a buffer is set, launch_fp8_prefill_gate_up
/// / _down run a stamped instance of the same kernel: per CTA
/// (< kPfDbgCtas) and GEMM g (0 gate_up, 1 down), at word g * kPfDbgCtas * kPfDbgCtaWords +
/// cta * kPfDbgCtaWords of the buffer (uint32 words, device memory of kPfDbgWords words):
///   header [kPfDbgHeader]: 0/1 %globaltimer (ns, lo/hi) at the CTA's start, 2/3 at the consumers'
///     end (after the last bulk copy completed), 4/5 at the producer's end, 6 K blocks and 7 items
///     the consumers ran, 8 %clock at the start, 9 %clock at the consumers' end, 10 %smid;
///   trace [3 roles][kPfDbgWin K blocks][kPfDbgStamps]: %clock at the phase boundaries of this CTA's
///     K blocks kPfDbgWin0 .. kPfDbgWin0 + kPfDbgWin - 1 (counted over its whole walk), role 0 the
///     producer's warp 0 (0 before the wait on `empty`, 1 after it, 2 after the stage's copies are
///     issued and the `full` arrive), roles 1 / 2 warp 0 of consumer warpgroup 0 / 1 (0 before the
///     wait on `full`, 1 after it, then kblock's boundaries 2-9, experts_fp8_prefill.cuh);
///   items [kPfDbgItems][3]: consumer warp 0's %clock at item i's start, its epilogue's start and end.
/// flags (kPfDbg*) ablate a phase for timing (wrong results). Process-wide; not thread-safe.
constexpr uint32_t kPfDbgNoLoads = 1;    ///< the producer copies nothing (operands stay stale)
constexpr uint32_t kPfDbgNoPromote = 4;  ///< the consumers skip the promotions
constexpr uint32_t kPfDbgNoWeights = 8;  ///< the producer copies the tokens and scales, not the weight tile
constexpr int kPfDbgCtas = 160, kPfDbgWin0 = 128, kPfDbgWin = 128, kPfDbgStamps = 10, kPfDbgItems = 64, kPfDbgHeader = 16;
constexpr int kPfDbgCtaWords = kPfDbgHeader + 3 * kPfDbgWin * kPfDbgStamps + 3 * kPfDbgItems;
constexpr int kPfDbgWords = 2 * kPfDbgCtas * kPfDbgCtaWords;
/// True when this build carries the stamped kernels (CMake EPX_FP8_PREFILL_STAMPS=ON, the default of
/// tools/device/gpu-check.sh; OFF in CI). Without them set_fp8_prefill_debug throws.
bool fp8_prefill_stamps_built();
void set_fp8_prefill_debug(uint32_t* buffer, uint32_t flags);

/// One CUtensorMap (cuda.h), opaque here: 128 bytes, 128-byte aligned.
struct alignas(128) Fp8TmaMap {
  unsigned char bytes[128];
};

/// Host: the TMA descriptors of one fp8_block expert's device weights for the TMA prefill kernels:
/// w13 [2I, H] and w2 [H, I] FP8 codes as 2-D maps (K innermost), 128 x 128-byte boxes,
/// 128-byte swizzle (the layout of the wgmma descriptors, experts_fp8_wgmma.cuh smem_desc),
/// out-of-range rows zero-filled. Encoded with cuTensorMapEncodeTiled through
/// cudaGetDriverEntryPointByVersion (no libcuda link). Returns false (maps untouched) when the
/// driver lacks the entry point or the encoder rejects a map (then keep w_maps null).
bool fp8_prefill_weight_maps(const ExpertDesc& e, int64_t hidden, Fp8TmaMap& w13_map, Fp8TmaMap& w2_map);
/// Tests only: while `refuse` is set, fp8_prefill_weight_maps returns false as for a map the driver cannot
/// encode, so Experts objects made meanwhile run their prefill GEMMs on the cp.async kernels (the fallback).
/// Process-wide; not thread-safe.
void set_fp8_prefill_refuse_weight_maps(bool refuse);

/// Host: the TMA descriptors of one mxfp4 expert's device weights for the MXFP4 decode path
/// (decode_item_bulk, experts_mxfp4_kernels.cuh): maps[0] w13 codes [2I rows, H/2 bytes] and maps[2] w2
/// codes [H, I/2] in 16-row x 128-byte boxes (2 windows of 128 K), 128-byte swizzle; maps[1] w13 e8m0
/// [2I, H/32] and maps[3] w2 e8m0 [H, I/32] in 16-row x 16-byte boxes (4 windows), no swizzle. A GEMM whose
/// K (H for w13, I for w2) is not a multiple of 512 (16-byte e8m0 row pieces) keeps zeroed maps (its items
/// take decode_item_ring2). False when the driver lacks the encoder or rejects a map.
bool mxfp4_decode_maps(const ExpertDesc& e, int64_t hidden, Fp8TmaMap (&maps)[4]);

/// Weight rows per CTA tile: gate_up 128 gate + 128 up rows (128 h columns = one FP8 group);
/// down 256 output columns.
constexpr int kFp8TileWeightRows = 256;

/// Rows (tokens) per tile of the prefill kernels (wgmma N = 128).
constexpr int kFp8PrefillRows = 128;

/// True when this build carries the sm_90a kernels and `device` is a compute-capability 9.0 GPU
/// (probed once per device with a one-thread kernel; the first call on a device also raises the
/// GEMM kernels' shared-memory limit there, so call it before launching and outside graph capture).
bool fp8_tensor_cores_available(int device);

/// h = silu(x W_gate^T) * (x W_up^T), quantized to FP8 1x128 (hq, hs), for every tile of every
/// fp8_block expert. `grid` = number of persistent CTAs (>= 1). Stream-ordered, no host sync.
/// epi (non-null: [L] ExpertEpi on the device): the experts' biases and activations (fp8_gemm_epi_kernel).
void launch_fp8_gate_up(const Fp8GemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi = nullptr);
/// out = bf16(h W_down^T) for every tile of every fp8_block expert.
void launch_fp8_down(const Fp8GemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi = nullptr);

/// The prefill kernels (experts_fp8_prefill_cuda.cu): the same two GEMMs (same results up to the
/// fp32 summation order inside a K block) over tiles [*p.num_small, *p.num_tiles) of up to
/// kFp8PrefillRows rows; p.num_small must be non-null. One warp-specialized CTA per SM: a producer
/// warpgroup streams 256 weight rows x 128 tokens x 128 K per stage (cp.async into a 128B-swizzled
/// ring, mbarrier hand-off), two consumer warpgroups run m64n128k32 wgmmas and the block-scale
/// promotion. `grid` = persistent CTAs (>= 1); stream-ordered, graph-safe (counts read on the device).
void launch_fp8_prefill_gate_up(const Fp8GemmParams& p, int grid, cudaStream_t stream);
void launch_fp8_prefill_down(const Fp8GemmParams& p, int grid, cudaStream_t stream);
/// Shared bytes of the larger prefill kernel (fp8_tensor_cores_available checks the device's opt-in
/// limit against it) and the one-time raise of their limit (called by fp8_tensor_cores_available).
int fp8_prefill_smem_bytes();
void fp8_prefill_set_smem_limits();

/// The TMA variant of the prefill kernels (experts_fp8_prefill_tma_cuda.cu; the default's): same arguments and results; needs p.w_maps (fp8_prefill_weight_maps: every weight tile comes by
/// TMA) and p.row_space. Throws InvalidArgument when p.w_maps is null (then launch the cp.async kernels
/// above, as apply does when upload could not encode the maps). Shared bytes and the one-time limit raise as above.
void launch_fp8_prefill_tma_gate_up(const Fp8GemmParams& p, int grid, cudaStream_t stream);
/// Copies x row p.gather[r] to row r of p.x_perm for every row r of the prefill section's tiles of
/// fp8_block experts (Fp8GemmParams::x_perm; before launch_fp8_prefill_tma_gate_up of the Flat layout).
/// Throws InvalidArgument unless x, x_perm and x_perm_stride are 16-byte aligned, H % 16 == 0 and
/// x_perm_stride >= H.
void launch_fp8_prefill_permute_x(const Fp8GemmParams& p, int grid, cudaStream_t stream);
void launch_fp8_prefill_tma_down(const Fp8GemmParams& p, int grid, cudaStream_t stream);
int fp8_prefill_tma_smem_bytes();
void fp8_prefill_tma_set_smem_limits();
/// The most 2-CTA clusters of the gate_up (or down) cluster kernel (Fp8GemmParams::prefill_cluster) resident at once
/// on the current device (cudaOccupancyMaxActiveClusters with the raised shared-memory limit; 0: none, the launch
/// then takes the one-CTA kernel). Measured once per device ordinal, on first use there (fp8_prefill_tma_set_smem_limits
/// or the first cluster launch), and cached per device (thread-safe). Throws InvalidArgument for an ordinal >= 64.
int fp8_prefill_tma_max_clusters(bool gate_up);

}  // namespace epx::experts_cuda
