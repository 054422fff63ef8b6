// src/checkpoint/matrix.h: one weight matrix [rows, cols] in an ExpertWeights storage format
// (weights + block scales), and the row slicing and stacking the loader and the writer share. Layouts (include/epx/experts.h):
//   bf16      : w bf16 [rows, cols];            scale undefined
//   fp8_block : w fp8_e4m3 [rows, cols];        scale fp32 [rows/128, cols/128]
//   mxfp4     : w fp4_e2m1x2 [rows, cols/2];    scale e8m0 [rows, cols/32]
#pragma once

#include <cstdint>
#include <cstring>

#include "epx/error.h"
#include "epx/experts.h"

namespace epx::ckpt {

constexpr int64_t kFp8Block = 128;
constexpr int64_t kMxBlock = 32;

struct Matrix {
  Tensor w, scale;
};

/// Rows [r0, r1) and byte columns [c0, c1) of a contiguous 2-D tensor, as a new tensor.
inline Tensor slice2d(const Tensor& t, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  EPX_ASSERT(t.view().ndim == 2 && r0 >= 0 && r0 <= r1 && r1 <= t.size(0) && c0 >= 0 && c0 <= c1 && c1 <= t.size(1),
             "slice2d ", t.view().describe(), " rows ", r0, "..", r1, " cols ", c0, "..", c1);
  Tensor out = Tensor::empty({r1 - r0, c1 - c0}, t.dtype());
  const int64_t es = dtype_size(t.dtype()), src_row = t.size(1) * es, dst_row = (c1 - c0) * es;
  for (int64_t r = r0; r < r1; ++r)
    if (dst_row > 0)
      std::memcpy(static_cast<char*>(out.data()) + (r - r0) * dst_row, static_cast<const char*>(t.data()) + r * src_row + c0 * es,
                  static_cast<size_t>(dst_row));
  return out;
}

/// [a; b] along rows (same dtype and columns).
inline Tensor stack_rows(const Tensor& a, const Tensor& b) {
  EPX_ASSERT(a.dtype() == b.dtype() && a.size(1) == b.size(1), a.view().describe(), " vs ", b.view().describe());
  Tensor out = Tensor::empty({a.size(0) + b.size(0), a.size(1)}, a.dtype());
  if (a.nbytes() > 0) std::memcpy(out.data(), a.data(), static_cast<size_t>(a.nbytes()));
  if (b.nbytes() > 0) std::memcpy(static_cast<char*>(out.data()) + a.nbytes(), b.data(), static_cast<size_t>(b.nbytes()));
  return out;
}

/// Logical rows [r0, r1) (multiples of 128 for fp8_block: whole scale rows).
inline Matrix rows_of(const Matrix& m, WeightFormat f, int64_t r0, int64_t r1) {
  Matrix out;
  out.w = slice2d(m.w, r0, r1, 0, m.w.size(1));
  if (f == WeightFormat::fp8_block) out.scale = slice2d(m.scale, r0 / kFp8Block, r1 / kFp8Block, 0, m.scale.size(1));
  if (f == WeightFormat::mxfp4) out.scale = slice2d(m.scale, r0, r1, 0, m.scale.size(1));
  return out;
}

inline Matrix stack(const Matrix& a, const Matrix& b, WeightFormat f) {
  Matrix out;
  out.w = stack_rows(a.w, b.w);
  if (f != WeightFormat::bf16) out.scale = stack_rows(a.scale, b.scale);
  return out;
}

}  // namespace epx::ckpt
