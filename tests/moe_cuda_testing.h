// moe_cuda_testing.h: what the ModularMoE CUDA tests share (moe_cuda_test.cpp, moe_errors_cuda_test.cpp,
// moe_gpt_oss_cuda_test.cpp): the presets' weights built before the ranks start, inputs per rank, the
// moe_reference_cpu reference of a path, row errors, the tolerance, and the ModularMoECuda fixture (R = 2, 4
// and 8). Test-only; include inside EPX_WITH_CUDA.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/moe.h"
#include "epx/routing.h"
#include "forked_ranks.h"
#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda_ranks.h"
#endif

using namespace epx;

namespace {

using test::cuda_ok;
using test::run_cuda_ranks;
using test::virtual_ranks_for;

/// The weights of a preset, built in the gtest process before the ranks start: rank bodies only read
/// the shared_ptr they are handed (on virtual ranks they are threads, and this cache is not
/// thread-safe). "deepseek-v3-mini-wide-shared" is deepseek-v3-mini with a shared expert 128 * R wide:
/// one fp8_block 128-block per rank of R, the narrowest shared expert that still runs DP-sharded.
inline std::shared_ptr<const MoEWeights> weights_for(const std::string& name, int R = 2) {
  static std::map<std::string, std::shared_ptr<const MoEWeights>> cache;
  const bool wide = name == "deepseek-v3-mini-wide-shared";
  auto& w = cache[wide ? name + " R" + std::to_string(R) : name];
  if (!w && wide) {
    MoEConfig c = preset("deepseek-v3-mini");
    c.name = name;
    c.shared_intermediate = 128 * R;
    w = MoEWeights::random(c, 99);
  }
  if (!w) w = MoEWeights::random(preset(name), 2025);
  return w;
}

/// "{5,0,3,8}"
inline std::string list_text(const std::vector<int64_t>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "}";
}

using test::RankStream;
using test::per_rank;
using test::throw_failures;
using test::say_where;

/// Per-rank inputs [T_r rows] and the reference of the concatenated rows.
struct Inputs {
  std::vector<Tensor> x, idx, wts;
  Tensor reference;              // [sum T_r, H]
  std::vector<int64_t> offset;   // first reference row of each rank
};

/// Reference of rows [0, valid[r]) of each rank's inputs (`fused`: the shared path it models;
/// `two_roundings`: the separate path's routed sum rounded to bf16 before g * shared joins, as the
/// layer does where the shared rows are added after the combine: the local shared slot).
inline Tensor reference_of(const MoEWeights& w, const Inputs& in, const std::vector<int64_t>& valid, DType wire, bool fused = true,
                    bool two_roundings = false) {
  const int64_t H = w.config.hidden;
  const int K = w.config.router.top_k;
  const int64_t T = std::accumulate(valid.begin(), valid.end(), int64_t{0});
  Tensor x = Tensor::empty({T, H}, DType::bf16), idx = Tensor::empty({T, K}, DType::int32), wts = Tensor::empty({T, K}, DType::fp32);
  int64_t row = 0;
  for (size_t r = 0; r < valid.size(); ++r) {
    std::copy_n(in.x[r].ptr<uint16_t>(), valid[r] * H, x.ptr<uint16_t>() + row * H);
    std::copy_n(in.idx[r].ptr<int32_t>(), valid[r] * K, idx.ptr<int32_t>() + row * K);
    std::copy_n(in.wts[r].ptr<float>(), valid[r] * K, wts.ptr<float>() + row * K);
    row += valid[r];
  }
  Tensor out = Tensor::empty({T, H}, DType::bf16);
  moe_reference_cpu(w, x, idx, wts, out, {.dispatch_dtype = wire, .shared_fused = fused, .two_roundings = two_roundings});
  return out;
}

inline Inputs make_inputs(const MoEWeights& w, const std::vector<int64_t>& tokens, uint64_t seed, DType wire) {
  Inputs in;
  const int K = w.config.router.top_k;
  for (size_t r = 0; r < tokens.size(); ++r) {
    in.x.push_back(test::random_bf16(tokens[r], w.config.hidden, seed * 17 + r));
    Tensor i, v;
    test::random_routing(tokens[r], K, w.config.router.num_experts, seed * 17 + 9 + r, {.masked_fraction = 0.1, .allow_duplicates = true},
                         i, v);
    in.idx.push_back(i);
    in.wts.push_back(v);
  }
  in.reference = reference_of(w, in, tokens, wire);
  int64_t off = 0;
  for (int64_t t : tokens) {
    in.offset.push_back(off);
    off += t;
  }
  return in;
}

/// rel L2 of `got` (device [>= n, H]) rows [0, n) against reference rows [first, first + n).
inline double rel_l2_rows(const TensorView& got_dev, const Tensor& reference, int64_t first, int64_t n) {
  const int64_t H = reference.size(1);
  Tensor got = Tensor::empty({n, H}, DType::bf16), want = Tensor::empty({n, H}, DType::bf16);
  if (n == 0) return 0.0;
  copy(got, got_dev.slice_rows(0, n));
  std::copy_n(reference.ptr<uint16_t>() + first * H, n * H, want.ptr<uint16_t>());
  return test::rel_l2_error(got, want);
}

constexpr double kTol = 1e-2;

struct ShardCase {
  std::string preset, backend;
  std::vector<int64_t> tokens;
  DType wire;
};

/// Every multi-rank case at R ranks: 2, and 4 and 8 on the mini presets.
class ModularMoECuda : public ::testing::TestWithParam<int> {};

}  // namespace
