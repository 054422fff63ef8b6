#include "dispatch/prepare_finalize_cpu.h"

#include <algorithm>
#include <cstring>

#include "dispatch/flat_cuda.h"
#include "epx/quant.h"

namespace epx::dispatch {

// ---- RowCodec -----------------------------------------------------------------------------------

void RowCodec::encode(const TensorView& x, const Routing& routing, std::vector<uint8_t>& rows) const {
  const int64_t T = routing.num_tokens, rb = row_bytes();
  rows.resize(static_cast<size_t>(T * rb));
  std::vector<float> row_f32(use_fp8 ? static_cast<size_t>(hidden) : 0);
  const uint16_t* xb = x.ptr<const uint16_t>();
  for (int64_t t = 0; t < T; ++t) {
    uint8_t* dst = rows.data() + t * rb;
    const uint16_t* src = xb + t * hidden;
    if (use_fp8) {
      for (int64_t i = 0; i < hidden; ++i) row_f32[static_cast<size_t>(i)] = bf16_bits_to_float(src[i]);
      quantize_fp8_row(row_f32.data(), hidden, dst, reinterpret_cast<float*>(dst + payload_bytes()), kFp8GroupSize, use_ue8m0);
    } else {
      std::memcpy(dst, src, static_cast<size_t>(2 * hidden));
    }
    uint8_t* tail = dst + payload_bytes() + scale_bytes();
    std::memcpy(tail, routing.idx.data() + t * top_k, 4 * static_cast<size_t>(top_k));
    std::memcpy(tail + 4 * top_k, routing.weights + t * top_k, 4 * static_cast<size_t>(top_k));
    const int32_t token = static_cast<int32_t>(t);
    std::memcpy(tail + 8 * top_k, &token, 4);
  }
}

// ---- CpuPrepareFinalize -------------------------------------------------------------------------

LocalError CpuPrepareFinalize::check_prepare(const DispatchArgs& a, Routing& routing) const {
  LocalError err = check_args(a);
  if (err.kind != LocalError::none) return err;
  int64_t T = a.x.shape[0];
  if (a.num_tokens.defined()) {  // padded forms only (check_args): rows [0, value) of x take part
    const int64_t v = a.num_tokens.ptr<const int32_t>()[0];
    if (v < 0 || v > T)
      return {LocalError::invalid_argument,
              arg_message(op_prepare_, "num_tokens", v, "must be in [0, x.shape[0] = " + std::to_string(T) + "]")};
    T = v;
  }
  const int K = cfg_.top_k;
  routing.num_tokens = T;
  routing.top_k = K;
  routing.idx.resize(static_cast<size_t>(T * K));
  routing.weights = a.topk_weights.ptr<const float>();
  const bool is_i64 = a.topk_idx.dtype == DType::int64;
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t v = is_i64 ? a.topk_idx.ptr<const int64_t>()[i] : a.topk_idx.ptr<const int32_t>()[i];
    if (!placement_.valid_id(v, i % K, K)) return {LocalError::invalid_argument, bad_topk_id(op_prepare_, cfg_, i / K, i % K, v).what()};
    routing.idx[static_cast<size_t>(i)] = static_cast<int32_t>(v);
  }
  return {};
}

void CpuPrepareFinalize::token_dest_ranks(const Routing& routing, int64_t t, std::vector<uint8_t>& is_in_rank) const {
  is_in_rank.assign(static_cast<size_t>(num_ranks_), 0);
  for (int k = 0; k < routing.top_k; ++k) {
    const int d = dest_rank(routing.at(t, k), rank_);
    if (d >= 0) is_in_rank[static_cast<size_t>(d)] = 1;
  }
}

void CpuPrepareFinalize::count_selections(const Routing& routing) {
  stats_ = {};
  std::vector<uint8_t> in_rank;
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    for (int k = 0; k < routing.top_k; ++k) stats_.num_valid_selections += routing.at(t, k) >= 0;
    token_dest_ranks(routing, t, in_rank);
    for (uint8_t f : in_rank) stats_.num_rank_dedup_rows += f;
  }
}

void CpuPrepareFinalize::decode_flat(const uint8_t* rows, int64_t num_rows, const std::vector<int>& src_rank, FlatRecv& out) const {
  const RowCodec c = codec();
  const int64_t H = c.hidden, rb = c.row_bytes();
  const int K = c.top_k;
  out.x = Tensor::empty({num_rows, H}, c.use_fp8 ? DType::fp8_e4m3 : DType::bf16);
  out.x_scales = c.use_fp8 ? Tensor::empty({num_rows, H / kFp8GroupSize}, DType::fp32) : Tensor();
  out.topk_idx = Tensor::empty({num_rows, K}, DType::int32);
  out.topk_weights = Tensor::empty({num_rows, K}, DType::fp32);
  out.recv_count = Tensor::zeros({num_local_}, DType::int32);
  out.src_token.resize(static_cast<size_t>(num_rows));
  int32_t* counts = out.recv_count.ptr<int32_t>();
  std::vector<int64_t> last_row(static_cast<size_t>(num_local_), -1);  // a duplicate expert counts its row once
  for (int64_t n = 0; n < num_rows; ++n) {
    const uint8_t* row = rows + n * rb;
    std::memcpy(static_cast<uint8_t*>(out.x.data()) + n * c.payload_bytes(), row, static_cast<size_t>(c.payload_bytes()));
    if (c.use_fp8)
      std::memcpy(static_cast<uint8_t*>(out.x_scales.data()) + n * c.scale_bytes(), row + c.payload_bytes(),
                  static_cast<size_t>(c.scale_bytes()));
    const uint8_t* tail = row + c.payload_bytes() + c.scale_bytes();
    int32_t* idx = out.topk_idx.ptr<int32_t>() + n * K;
    std::memcpy(idx, tail, 4 * static_cast<size_t>(K));
    std::memcpy(out.topk_weights.ptr<float>() + n * K, tail + 4 * K, 4 * static_cast<size_t>(K));
    std::memcpy(&out.src_token[static_cast<size_t>(n)], tail + 8 * K, 4);
    for (int k = 0; k < K; ++k) {
      const int l = local_index(idx[k], src_rank[static_cast<size_t>(n)], rank_);
      idx[k] = l;
      if (l >= 0 && last_row[static_cast<size_t>(l)] != n) {
        last_row[static_cast<size_t>(l)] = n;
        ++counts[l];
      }
    }
  }
}

FlatRecv CpuPrepareFinalize::pad_flat(const FlatRecv& in, const std::vector<int64_t>& rows_per_source,
                                      std::vector<int64_t>& padded_row) const {
  const int64_t C = cfg_.num_max_dispatch_tokens_per_rank, N = static_cast<int64_t>(num_ranks_) * C;
  const int64_t pb = codec().payload_bytes(), sb = codec().scale_bytes(), K = cfg_.top_k;
  FlatRecv out;
  out.x = Tensor::zeros({N, cfg_.hidden}, in.x.dtype());
  out.x_scales = in.x_scales.defined() ? Tensor::zeros({N, cfg_.hidden / kFp8GroupSize}, DType::fp32) : Tensor();
  out.topk_idx = Tensor::empty({N, K}, DType::int32);
  out.topk_weights = Tensor::zeros({N, K}, DType::fp32);
  std::fill_n(out.topk_idx.ptr<int32_t>(), N * K, -1);
  out.recv_count = in.recv_count;
  out.src_token.assign(static_cast<size_t>(N), -1);
  padded_row.clear();
  int64_t n = 0;
  for (int s = 0; s < num_ranks_; ++s) {
    for (int64_t i = 0; i < rows_per_source[static_cast<size_t>(s)]; ++i, ++n) {
      const int64_t p = s * C + i;
      padded_row.push_back(p);
      std::memcpy(static_cast<uint8_t*>(out.x.data()) + p * pb, static_cast<const uint8_t*>(in.x.data()) + n * pb, static_cast<size_t>(pb));
      if (sb > 0)
        std::memcpy(static_cast<uint8_t*>(out.x_scales.data()) + p * sb, static_cast<const uint8_t*>(in.x_scales.data()) + n * sb,
                    static_cast<size_t>(sb));
      std::memcpy(out.topk_idx.ptr<int32_t>() + p * K, in.topk_idx.ptr<const int32_t>() + n * K, static_cast<size_t>(4 * K));
      std::memcpy(out.topk_weights.ptr<float>() + p * K, in.topk_weights.ptr<const float>() + n * K, static_cast<size_t>(4 * K));
      out.src_token[static_cast<size_t>(p)] = in.src_token[static_cast<size_t>(n)];
    }
  }
  return out;
}

int64_t CpuPrepareFinalize::padded_block_bytes() const {
  return dispatch::padded_block_bytes(num_ranks_, cfg_.num_max_dispatch_tokens_per_rank, codec().row_bytes());
}

const void* CpuPrepareFinalize::compact_partials(const TensorView& expert_out, const std::vector<int64_t>& padded_row) {
  const int64_t row = dtype_size(expert_out.dtype) * cfg_.hidden, n = static_cast<int64_t>(padded_row.size());
  compact_.resize(static_cast<size_t>(n * row));
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(compact_.data() + i * row, static_cast<const uint8_t*>(expert_out.data) + padded_row[static_cast<size_t>(i)] * row,
                static_cast<size_t>(row));
  return compact_.data();
}

void CpuPrepareFinalize::sum_partials_bf16(const std::vector<const uint16_t*>& partials, int64_t hidden, uint16_t* out) {
  for (int64_t i = 0; i < hidden; ++i) {
    float acc = 0.0f;
    for (const uint16_t* p : partials)
      if (p) acc += bf16_bits_to_float(p[i]);
    out[i] = float_to_bf16_bits(acc);
  }
}

void CpuPrepareFinalize::sum_partials_fp32(const std::vector<const float*>& partials, const float* addend, int64_t hidden,
                                           uint16_t* out) {
  for (int64_t i = 0; i < hidden; ++i) {
    float acc = 0.0f;
    for (const float* p : partials)
      if (p) acc += p[i];
    if (addend) acc += addend[i];
    out[i] = float_to_bf16_bits(acc);
  }
}

void CpuPrepareFinalize::finish_rows(const void* sum, DType sum_dtype, const float* addend, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = sum_dtype == DType::fp32 ? static_cast<const float*>(sum)[i] : bf16_bits_to_float(static_cast<const uint16_t*>(sum)[i]);
    if (addend) acc += addend[i];
    out[i] = float_to_bf16_bits(acc);
  }
}

}  // namespace epx::dispatch
