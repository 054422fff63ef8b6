// dispatch/row_codec.h: the wire format of one token row of the flat backends (naive, agrs,
// all2allv, ht), shared by the CPU reference (encode/decode on the host) and the CUDA kernels
// (flat_kernels.cuh), so the bytes on the wire and the byte accounting cannot drift apart.
//
//   [payload: bf16 [H] | fp8_e4m3 [H]] [fp8 only: scales fp32 [H/128]] [topk ids int32 [K]] [topk weights fp32 [K]]
//   [source token index int32]
// Every part is a multiple of 4 bytes (H % 8 == 0; fp8 H % 128 == 0), so rows are 4-byte aligned. A
// token is quantized once on its source rank; its scales travel with it unchanged (BEHAVIOUR.md).
#pragma once

#include <cstdint>
#include <vector>

#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx::dispatch {

struct Routing;

struct RowCodec {
  int64_t hidden = 0;
  int top_k = 0;
  bool use_fp8 = false;
  bool use_ue8m0 = false;

  EPX_HOST_DEVICE int64_t payload_bytes() const { return use_fp8 ? hidden : 2 * hidden; }
  EPX_HOST_DEVICE int64_t scale_bytes() const { return use_fp8 ? hidden / kFp8GroupSize * 4 : 0; }
  EPX_HOST_DEVICE int64_t ids_offset() const { return payload_bytes() + scale_bytes(); }
  EPX_HOST_DEVICE int64_t weights_offset() const { return ids_offset() + 4 * static_cast<int64_t>(top_k); }
  EPX_HOST_DEVICE int64_t src_token_offset() const { return weights_offset() + 4 * static_cast<int64_t>(top_k); }
  EPX_HOST_DEVICE int64_t row_bytes() const { return src_token_offset() + 4; }

  /// CPU: rows [T][row_bytes] from x [T, H] bf16 and the routing (global ids).
  void encode(const TensorView& x, const Routing& routing, std::vector<uint8_t>& rows) const;
};

}  // namespace epx::dispatch
