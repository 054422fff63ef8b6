// dispatch/hier/hier_cuda.h: the kernels of the hierarchical ll / ht (hier.h) on CUDA, host launchers
// only (no CUDA types: hier.cpp includes it in CUDA builds). Every launcher is stream-ordered, reads
// the token count on the device and does no host sync, so a CUDA graph can capture it.
#pragma once

#include <cstdint>

#include "dispatch/hier/hier.h"

namespace epx::dispatch {

/// Host-mapped report of ids the pack kernel refused (hier.h "Bad arguments").
struct HierErrorReport {
  int32_t bad_count = 0;  ///< ids outside [-1, max id] seen since the last reset
  int32_t bad_token = 0, bad_column = 0;
  int64_t bad_value = 0;
};

struct HierPackParams {
  int device = 0;                    ///< the group's GPU (made current for the launch)
  HierLayout lay;
  const uint16_t* x = nullptr;       ///< [T, H] bf16 (any 2-byte alignment)
  const void* idx = nullptr;         ///< [T, K] int32 | int64
  bool idx64 = false;
  const float* weights = nullptr;    ///< [T, K]
  int64_t num_tokens_host = 0;       ///< T = x.shape[0]
  const int32_t* num_tokens_dev = nullptr;  ///< optional device T (<= num_tokens_host)
  int32_t* num_tokens_out = nullptr; ///< [1] the T used (read by the sum kernel of the matching finalize)
  int32_t* pos = nullptr;            ///< [N, M] row of token t in node n's block, -1 = not sent
  uint8_t* send = nullptr;           ///< [N, block_bytes]
  HierErrorReport* report = nullptr; ///< host-mapped
};
/// Builds the N send blocks (counts, source tokens, ids, weights, rows) and pos.
void launch_hier_pack(const HierPackParams& p, void* stream);

/// Received blocks [N, block_bytes] -> the node backend's x [N*M, H], ids [N*M, K] (node ids, -1
/// beyond a block's count), weights [N*M, K].
void launch_hier_unpack(int device, const HierLayout& lay, const uint8_t* recv, uint16_t* x_in, int32_t* idx_in, float* w_in, void* stream);

/// out[t] = round_bf16(sum over nodes n in order with pos[n, t] >= 0 of ret[n*M + pos[n, t]], then
/// + addend[t] when addend is not null), fp32, for t < *num_tokens; out rows of H bf16, any 2-byte
/// alignment; addend [T, H] fp32 (FinalizeArgs::addend).
void launch_hier_sum(int device, const HierLayout& lay, const uint16_t* ret, const int32_t* pos, const int32_t* num_tokens,
                     const float* addend, uint16_t* out, void* stream);

/// A zeroed host-mapped report on `device`; *dev gets its device address. Free with hier_report_free.
HierErrorReport* hier_report_alloc(int device, HierErrorReport** dev);
void hier_report_free(HierErrorReport* host) noexcept;

}  // namespace epx::dispatch
