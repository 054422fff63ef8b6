// dispatch/ll_cuda_kernels.h: parameters and launchers of the LL dispatch/combine kernels
// (ll_cuda_kernels.cu), used by the host class in ll_cuda.cpp. Byte layout: ll_layout.h; the
// protocol (signals, parities, why no reset is needed) is documented in ll_cuda.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "dispatch/ll_layout.h"
#include "dispatch/placement.h"

namespace epx::dispatch {

constexpr int kLlMaxRanks = 32;   ///< destination masks are uint32
constexpr int kLlMaxTopK = 32;    ///< one lane per topk column
constexpr int kLlChunkElems = 512; ///< elements of one warp work item: 32 lanes x 16

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
  /// 10 / 11: the last block's end of waiting (dispatch / combine).
  unsigned long long trace[12];
};

/// The error report, in host-mapped memory: the kernels never trap; the host reads it.
struct LlErrorReport {
  enum Kind : int32_t { none = 0, timeout = 1, bad_num_tokens = 2, bad_topk_id = 3 };
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
  bool signal_rank = false;     ///< one completion word per (source, destination), stored by the source's last block
  bool expand_message = false;  ///< sender-ranked slots, (message, chunk) expansion on the receiver
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
  const uint16_t* expert_out = nullptr;  ///< [L, R*max_T, H] bf16
  uint16_t* out = nullptr;               ///< [>= T, H] bf16
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

}  // namespace epx::dispatch
