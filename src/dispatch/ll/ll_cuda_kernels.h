// dispatch/ll/ll_cuda_kernels.h: parameters and launchers of the LL dispatch/combine kernels
// (ll_cuda_kernels.cu), used by the host class in ll_cuda.cpp. Byte layout: ll_layout.h; the
// protocol (signals, parities, why no reset is needed) is documented in ll_cuda.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "dispatch/ll/ll_layout.h"
#include "dispatch/placement.h"

namespace epx::dispatch {

constexpr int kLlMaxRanks = 32;   ///< destination masks are uint32
constexpr int kLlMaxTopK = 32;    ///< one lane per topk column
constexpr int kLlChunkElems = 512; ///< elements of one warp work item: 32 lanes x 16
/// A combine flag word's "rejected" marker: a rank that refused its finalize arguments on the host still
/// launches its combine (LlCombineParams::rejected), sends no rows and releases (call + 1) | this bit, so
/// the peers' waits end at once and report LlErrorReport::peer_rejected instead of timing out. The waits
/// compare the word without the bit (a marked word of call n is not call n + 1's). Dispatch flags never carry it.
constexpr unsigned long long kLlFlagRejected = 1ull << 62;

/// Per-object device state (device memory, zeroed at create, advanced only by the kernels).
/// The call number n of a kernel part is (blocks of that part finished so far) / B: every block
/// adds 1 when it is done, so during call n the counter is in [n B, n B + B - 1].
struct LlDeviceState {
  unsigned long long dispatch_send_blocks;
  unsigned long long dispatch_recv_blocks;
  unsigned long long combine_send_blocks;
  unsigned long long combine_recv_blocks;
  int32_t num_tokens;   ///< T of the last dispatch send (the combine's row count)
  int32_t error_claim;  ///< 0 until one thread claims the error report
  /// globaltimer [ns] of the last calls: dispatch 0 start (block 0), 1 last block's flags stored
  /// (max over blocks, never reset: the latest), 2 block 0 done waiting, 3 last block done;
  /// combine 4..7 the same; 8 / 9 the last block's start (dispatch / combine: the launch spread).
  /// Read by LlCuda::trace() (diagnostics).
  /// 10 / 11: the last block's end of waiting (dispatch / combine). The rest: LlTraceSlot.
  unsigned long long trace[36];  // = kTrSlots
};

/// Slots of LlDeviceState::trace ("b0": thread 0 of block 0; "max": the latest over all blocks).
enum LlTraceSlot : int {
  kTrDispStart = 0,        ///< b0: dispatch kernel start
  kTrDispFlags = 1,        ///< max: flags stored (after the release)
  kTrDispWaited0 = 2,      ///< b0: done waiting
  kTrDispDone = 3,         ///< max: block done (after a final __syncthreads)
  kTrCombStart = 4,
  kTrCombFlags = 5,
  kTrCombWaited0 = 6,
  kTrCombDone = 7,
  kTrDispLastStart = 8,    ///< max: block start
  kTrCombLastStart = 9,
  kTrDispWaitedLast = 10,  ///< max: done waiting
  kTrCombWaitedLast = 11,
  kTrDispT = 12,           ///< b0: call numbers and T known (first __syncthreads)
  kTrDispScanned = 13,     ///< b0: masks, per-id ranks and slots done (items start)
  kTrDispItems = 14,       ///< max: the block's send items done (its __syncthreads)
  kTrDispCounts = 15,      ///< b0: count stores issued (before the flag release)
  kTrDispBases = 16,       ///< b0: recv slot bases known (expansion items start)
  kTrCombCounts = 17,      ///< b0: send items start (counts / call numbers known)
  kTrCombItems = 18,       ///< max: the block's send items done
  kTrCombReduced0 = 19,    ///< b0: recv items done
  kTrHostPreDisp = 20,     ///< stamp kernels of the bench's diagnostics (LlCuda::stamp)
  kTrHostPostDisp = 21,
  kTrHostPreComb = 22,
  kTrHostPostComb = 23,
  kTrDispMasks = 24,       ///< b0: the mask loop done (its __syncthreads)
  kTrDispWarp0Items = 25,  ///< b0: warp 0's send items done (before the block's __syncthreads)
  // SM clock (clock64) of block 0 since its start, stored as start + cycles (trace_clk): printed in
  // kilocycles beside the microseconds of the same point, so the ratio is the SM clock in GHz.
  kTrDispMasksCyc = 26,       ///< b0: at kTrDispMasks
  kTrDispWarp0ItemsCyc = 27,  ///< b0: at kTrDispWarp0Items
  kTrDispBasesCyc = 28,       ///< b0: at kTrDispBases
  kTrCombReducedCyc = 29,     ///< b0: at kTrCombReduced0
  kTrCombLoaded0 = 30,        ///< b0: warp 0's first item's expert rows loaded and summed (before its stores)
  kTrCombStored0 = 31,        ///< b0: warp 0's first item's stores issued
  // One dependent load's round trip, stored as start + round trip (printed: the round trip in us):
  kTrDispLoadStart = 32,      ///< b0's last thread: a state word at the dispatch kernel's start (after its warp's first loads)
  kTrDispLoadWaited = 33,     ///< b0's last thread: a word of the local buffer after the wait (message expansion, after its warp's item loads)
  kTrCombRecvLoaded0 = 34,    ///< b0: warp 0's first receive item's partial rows loaded and added (flag)
  kTrCombRecvStored0 = 35,    ///< b0: warp 0's first receive item's bf16 stores issued
  kTrSlots = 36
};
/// Name of a slot for the diagnostics (nullptr: unused), and whether it is on the combine's timeline.
inline const char* ll_trace_name(int i) {
  static const char* const names[kTrSlots] = {
      "dispatch start", "dispatch flags stored (last block)", "dispatch waited (block 0)", "dispatch done (last block)",
      "combine start", "combine flags stored (last block)", "combine waited (block 0)", "combine done (last block)",
      "dispatch last block start", "combine last block start", "dispatch waited (last block)", "combine waited (last block)",
      "dispatch T known (block 0)", "dispatch slots scanned (block 0)", "dispatch send items done (last block)",
      "dispatch counts issued (block 0)", "dispatch slot bases (block 0)", "combine send items start (block 0)",
      "combine send items done (last block)", "combine reduce done (block 0)", "stamp before dispatch graph",
      "stamp after dispatch graph", "stamp before combine graph", "stamp after combine graph",
      "dispatch masks done (block 0)", "dispatch warp 0 items done (block 0)", "dispatch masks done, kcycles (block 0)",
      "dispatch warp 0 items done, kcycles (block 0)", "dispatch slot bases, kcycles (block 0)", "combine reduce done, kcycles (block 0)",
      "combine warp 0 rows loaded (block 0)", "combine warp 0 stores issued (block 0)",
      "dispatch one load at the start, round trip (block 0)", "dispatch one load after the wait, round trip (block 0)",
      "combine warp 0 receive rows added (block 0)", "combine warp 0 receive stores issued (block 0)"};
  return i >= 0 && i < kTrSlots ? names[i] : nullptr;
}
inline bool ll_trace_is_combine(int i) {
  return i == 4 || i == 5 || i == 6 || i == 7 || i == 9 || i == 11 || i == 17 || i == 18 || i == 19 || i == 22 || i == 23 || (i >= 29 && i <= 31) || i == 34 || i == 35;
}

/// The error report, in host-mapped memory: the kernels never trap; the host reads it.
struct LlErrorReport {
  /// peer_rejected: combine call `value`, rank `peer` refused its finalize arguments (its flags carried
  /// kLlFlagRejected); this rank's out of that call was written as NaN.
  enum Kind : int32_t { none = 0, timeout = 1, bad_num_tokens = 2, bad_topk_id = 3, peer_rejected = 4 };
  enum Op : int32_t { dispatch = 0, combine = 1 };
  int32_t kind;   ///< written last (after a system fence)
  int32_t peer;   ///< timeout: the rank that did not signal
  int32_t op;
  int32_t pad;
  int64_t value;  ///< timeout: the call number; bad_num_tokens / bad_topk_id: the value
  int64_t index;  ///< bad_num_tokens: x.shape[0]; bad_topk_id: t * K + k; timeout: signal seen
};

struct LlCommon {
  LlLayout lay;
  Placement placement;
  int rank = 0;
  int num_local = 0;   ///< L
  uint8_t* local = nullptr;
  uint8_t* peers[kLlMaxRanks] = {};
  int32_t src_blocks[kLlMaxRanks] = {};  ///< B of every source rank (exchanged at create)
  LlDeviceState* state = nullptr;
  LlErrorReport* error = nullptr;        ///< device alias of the host-mapped report
  long long timeout_ns = 0;
  int32_t src_warps[kLlMaxRanks] = {};  ///< warps per block of every source rank (chunk signals: its item -> block map)
  /// Tests only (LlLaunch::debug_*; 0 / all ones in production). Chunk signals: block 0 of the sender
  /// sleeps this long [ns] before its tagged stores and again before its send items (a receiver then
  /// sees an old slot-token word, and the message's payload late).
  long long debug_block0_delay_ns = 0;
  /// Tests only: the slot-token tag is (n + 1) & this mask; 3 makes calls n and n - 4 share one, as a
  /// two-valued tag would (the regression test's self-check that it catches that bug).
  uint32_t debug_token_tag_mask = 0xffffffffu;
  /// The message expansion (sender-ranked slots, (message, run) expansion on the receiver) with chunk
  /// signals: the counts and each message slot's source token go out tagged before the payload, and the
  /// receiver waits per (message, run) item only for the flags of the send blocks that stored its chunks.
  /// false: the expert expansion with block signals (where the bitmaps do not fit; ll_cuda.h).
  bool expand_message = false;
  bool combine_data = false;    ///< partial combine: the rows are the signal (ll.combine_wait = data, ll_cuda.h)
};

struct LlDispatchParams {
  LlCommon c;
  bool send = true, recv = true, ue8m0 = false;
  const uint16_t* x = nullptr;  ///< [x_rows, H] bf16, 16-byte aligned rows
  int64_t x_rows = 0;
  const void* topk_idx = nullptr;  ///< [x_rows, K] int32 | int64
  bool idx64 = false;
  const float* topk_weights = nullptr;
  const int32_t* num_tokens = nullptr;  ///< [1] on the device, or nullptr (T = x_rows)
  // outputs (recv)
  uint8_t* out_x = nullptr;        ///< [L, R*max_T, H] bf16 | fp8
  float* out_scales = nullptr;     ///< [L, R*max_T, H/128]
  int32_t* recv_count = nullptr;   ///< [L]
  int32_t* src_rank = nullptr;     ///< [L, R*max_T]
  int32_t* src_token = nullptr;
  int32_t* topk_column = nullptr;
  int64_t* layout_range = nullptr; ///< [L, R]
  // routing kept for the combine (send)
  int32_t* first_col = nullptr;    ///< [max_T, K] first column with the same id, -1 for none (column mode)
  float* weights = nullptr;        ///< [max_T, K] (column mode)
  uint32_t* dest_mask = nullptr;   ///< [max_T] ranks holding one of the token's experts (partial modes)
  // partial modes: the handle's per-message routing (LlHandle::msg_*)
  int32_t* msg_count = nullptr;     ///< [R]
  int32_t* msg_src_token = nullptr; ///< [R, max_T]
  int32_t* msg_rows = nullptr;      ///< [R, max_T, K]
  float* msg_weights = nullptr;     ///< [R, max_T, K]
};

struct LlCombineParams {
  LlCommon c;
  bool send = true, recv = true;
  /// This rank refused its finalize arguments (LlCuda::finalize): the send part reads no rows and sends
  /// none, its flags carry kLlFlagRejected; the receive part waits as usual but writes nothing (out unused).
  /// Never with LlCommon::combine_data (no flags there).
  bool rejected = false;
  const uint16_t* expert_out = nullptr;  ///< [L, R*max_T, H] bf16
  uint16_t* out = nullptr;               ///< [>= T, H] bf16
  const float* addend = nullptr;         ///< [>= T, H] fp32 (FinalizeArgs::addend): joins each token's fp32 sum before its rounding, or null
  const int32_t* recv_count = nullptr;
  const int32_t* src_rank = nullptr;
  const int32_t* src_token = nullptr;
  const int32_t* topk_column = nullptr;
  const int32_t* first_col = nullptr;
  const float* weights = nullptr;
  const uint32_t* dest_mask = nullptr;      ///< partial modes (recv)
  const int32_t* msg_count = nullptr;       ///< partial modes (send)
  const int32_t* msg_src_token = nullptr;
  const int32_t* msg_rows = nullptr;
  const float* msg_weights = nullptr;
};

/// Dynamic shared memory of the kernels for a layout (bytes).
size_t ll_dispatch_smem_bytes(const LlLayout& lay, bool expand_message, int num_local);
size_t ll_combine_smem_bytes(int num_local, int num_ranks);
/// Blocks of `threads` threads that can be resident at once on the device (all SMs), for the
/// heavier of the two kernels: every block of an LL kernel may spin on peers, so all must fit.
int ll_max_resident_blocks(int threads, size_t dispatch_smem, size_t combine_smem);

void launch_ll_dispatch(const LlDispatchParams& p, int blocks, int threads, cudaStream_t stream);
void launch_ll_combine(const LlCombineParams& p, int blocks, int threads, cudaStream_t stream);
/// A one-warp kernel that spins for `ns` nanoseconds (globaltimer): benchmarks put it between
/// their rank alignment and their start event, so the host has queued the timed work before it.
void launch_gpu_delay(long long ns, cudaStream_t stream);
/// One thread writes the globaltimer [ns] to *dst (diagnostics: LlCuda::stamp).
void launch_gpu_stamp(unsigned long long* dst, cudaStream_t stream);
/// An empty kernel with the LL kernels' register budget (launch bounds), `smem` dynamic shared memory.
void launch_ll_empty(size_t smem, int blocks, int threads, cudaStream_t stream);

}  // namespace epx::dispatch
