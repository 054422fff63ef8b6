// ModularMoE on CUDA with a gpt-oss-style layer (router bias, expert biases, clamped SwiGLU; MXFP4 and bf16
// experts) at R = 1 and 2 through tests/cuda_ranks.h run_cuda_ranks, against moe_reference_cpu computed in
// the parent before the ranks start. Outputs are NaN-poisoned first. Shared: moe_cuda_testing.h.
//
// Rank bodies work on their own cudaStreamNonBlocking stream and wait on it (or on the legacy stream),
// never on the whole device, never touch the environment (set before run_cuda_ranks), and only read
// what the parent built (weights, inputs, references): on virtual ranks they are threads.
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

#ifdef EPX_WITH_CUDA

#include "moe_cuda_testing.h"

namespace {

/// A gpt-oss-style layer at the mini shape (H = I = 256, E = 16, top-4 softmax renormalised over the top-k, no shared
/// expert): experts of `format` with b13 / b2 and gpt_oss_glu (alpha 1.702, the limit at the median |gate_up| of
/// expert 0, so about half of the gate / up values are clamped), and a router bias of twice the logits' scale (it
/// changes most tokens' selections: the negative control below says so).
std::shared_ptr<const MoEWeights> gpt_oss_layer(WeightFormat format, uint64_t seed) {
  MoEConfig c;
  c.name = "gpt-oss-mini";
  c.hidden = 256;
  c.intermediate = 256;
  c.router.num_experts = 16;
  c.router.top_k = 4;
  c.router.scoring = ScoringFunc::softmax;
  c.router.renormalize = true;
  c.routed_format = format;
  auto w = MoEWeights::random(c, seed);
  const int64_t H = c.hidden, I = c.intermediate;
  const Tensor probe = test::random_bf16(4, H, seed + 1);
  std::vector<float> mags;
  const float* a = w->experts[0]->w13_f32();
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t o = 0; o < 2 * I; ++o) {
      float acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += bf16_bits_to_float(probe.ptr<const uint16_t>()[r * H + k]) * a[o * H + k];
      mags.push_back(std::fabs(acc));
    }
  std::nth_element(mags.begin(), mags.begin() + mags.size() / 2, mags.end());
  const float limit = mags[mags.size() / 2];
  auto vec = [](int64_t n, uint64_t s, float scale) {
    const Tensor t = test::random_f32(1, n, s, scale);
    Tensor v = Tensor::empty({n}, DType::fp32);
    std::copy_n(t.ptr<const float>(), n, v.ptr<float>());
    return v;
  };
  for (size_t e = 0; e < w->experts.size(); ++e) {
    const ExpertWeights& s0 = *w->experts[e];
    auto x = std::make_shared<ExpertWeights>();
    x->format = s0.format, x->hidden = s0.hidden, x->intermediate = s0.intermediate;
    x->w13 = s0.w13, x->w13_scale = s0.w13_scale, x->w2 = s0.w2, x->w2_scale = s0.w2_scale;
    x->activation = ExpertActivation::gpt_oss(1.702f, limit);
    x->b13 = vec(2 * I, seed * 31 + e, limit);
    x->b2 = vec(H, seed * 37 + e, 0.05f);
    w->experts[e] = x;
  }
  Tensor logits = Tensor::empty({64, c.router.num_experts}, DType::fp32);
  router_logits_cpu(*w, test::random_bf16(64, H, seed + 2), logits);
  double sq = 0;
  for (int64_t i = 0; i < logits.numel(); ++i) sq += static_cast<double>(logits.ptr<float>()[i]) * logits.ptr<float>()[i];
  w->router_bias = vec(c.router.num_experts, seed * 41, 2.0f * static_cast<float>(std::sqrt(sq / logits.numel())));
  return w;
}

/// The CPU routing of x through w (router_logits_cpu with w's router bias, route) and, per token, whether the k-th and
/// (k+1)-th biased logits are more than 1e-3 apart (a selection the CUDA router's logits, cuBLAS's sums within a few
/// ulps of BLAS's, cannot flip).
void cpu_route(const MoEWeights& w, const Tensor& x, Tensor& idx, Tensor& wts, std::vector<bool>& clear) {
  const int64_t T = x.size(0), E = w.config.router.num_experts, K = w.config.router.top_k;
  Tensor logits = Tensor::empty({T, E}, DType::fp32);
  router_logits_cpu(w, x, logits);
  idx = Tensor::empty({T, K}, DType::int32), wts = Tensor::empty({T, K}, DType::fp32);
  route(w.config.router, logits, TensorView(), idx, wts);
  clear.assign(static_cast<size_t>(T), true);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> l(logits.ptr<const float>() + t * E, logits.ptr<const float>() + (t + 1) * E);
    std::sort(l.begin(), l.end(), std::greater<float>());
    clear[static_cast<size_t>(t)] = l[K - 1] - l[K] > 1e-3f;
  }
}

}  // namespace

// gpt-oss on CUDA: the router bias (logits + bias before the top-k, on the device), the expert biases and the clamped
// SwiGLU (the *_epi kernels) through ModularMoE at R = 1 and 2, MXFP4 and bf16 experts, bf16 and FP8 wires (FP8 x:
// the MXFP4 experts on the mixed tensor-core kernels), ll (ExpertMajor) and all2allv (Flat). forward_routed with the
// CPU's routing against moe_reference_cpu on every token; forward (the CUDA router) on every token whose top-k is
// clear of ties. Negative control: the reference without the router bias is far from the one with it.
TEST(ModularMoECudaGptOss, RouterBiasExpertBiasesAndClampedSwigluMatchTheCpuReference) {
  for (WeightFormat format : {WeightFormat::mxfp4, WeightFormat::bf16}) {
    const auto w = gpt_oss_layer(format, format == WeightFormat::mxfp4 ? 71 : 72);
    auto no_bias = std::make_shared<MoEWeights>(*w);
    no_bias->router_bias = Tensor();
    for (int R : {1, 2}) {
      say_where(R);
      const std::vector<int64_t> tokens = R == 1 ? std::vector<int64_t>{40} : std::vector<int64_t>{40, 23};
      for (DType wire : {DType::bf16, DType::fp8_e4m3}) {
        std::vector<Tensor> x, idx, wts, ref;
        std::vector<std::vector<bool>> clear;
        for (int r = 0; r < R; ++r) {
          x.push_back(test::random_bf16(tokens[r], 256, 700 + 10 * r + R));
          Tensor i, v, i0, v0, out = Tensor::empty({tokens[r], 256}, DType::bf16), out0 = Tensor::empty({tokens[r], 256}, DType::bf16);
          std::vector<bool> c, c0;
          cpu_route(*w, x.back(), i, v, c);
          moe_reference_cpu(*w, x.back(), i, v, out, {.dispatch_dtype = wire});
          cpu_route(*no_bias, x.back(), i0, v0, c0);
          moe_reference_cpu(*no_bias, x.back(), i0, v0, out0, {.dispatch_dtype = wire});
          EXPECT_GT(test::rel_l2_error(out, out0), 10 * kTol) << "the router bias barely changes the layer: the test could not fail";
          idx.push_back(i), wts.push_back(v), ref.push_back(out), clear.push_back(c);
        }
        for (const std::string backend : {"ll", "all2allv"}) {
          const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
            const RankStream rs;
            const Device dev = g->device();
            const int64_t T = tokens[static_cast<size_t>(rank)], H = 256;
            DispatchConfig dc;
            dc.num_max_dispatch_tokens_per_rank = 64;
            dc.dispatch_dtype = wire;
            ModularMoE layer(w, g, backend, dc, Config{}, ModularMoEOptions{});
            const Tensor xd = x[rank].to(dev), id = idx[rank].to(dev), wd = wts[rank].to(dev);
            std::string failures;
            for (int routed : {1, 0}) {
              Tensor out = Tensor::empty({T, H}, DType::bf16, dev);
              test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison");
              if (routed) layer.forward_routed(xd, id, wd, out, Stream{rs.s});
              else layer.forward(xd, out, Stream{rs.s});
              cuda_ok(cudaStreamSynchronize(rs.s), "sync");
              const Tensor got = out.to(Device::cpu());
              std::vector<int64_t> rows;
              for (int64_t t = 0; t < T; ++t)
                if (routed || clear[rank][static_cast<size_t>(t)]) rows.push_back(t);
              Tensor a = Tensor::empty({static_cast<int64_t>(rows.size()), H}, DType::bf16), b = Tensor::empty({static_cast<int64_t>(rows.size()), H}, DType::bf16);
              for (size_t j = 0; j < rows.size(); ++j) {
                std::copy_n(got.ptr<const uint16_t>() + rows[j] * H, H, a.ptr<uint16_t>() + j * H);
                std::copy_n(ref[rank].ptr<const uint16_t>() + rows[j] * H, H, b.ptr<uint16_t>() + j * H);
              }
              const double e = rows.empty() ? 0.0 : test::rel_l2_error(a, b);
              const std::string what = std::string(weight_format_name(format)) + " " + backend + " wire " +
                                       std::string(dtype_name(wire)) + (routed ? " forward_routed" : " forward") + " rank " +
                                       std::to_string(rank);
              if (!(e <= kTol)) failures += what + ": rel L2 " + std::to_string(e) + "; ";
              if (!routed && rows.size() * 2 < static_cast<size_t>(T)) failures += what + ": fewer than half the tokens clear of ties; ";
              if (rank == 0)
                std::printf("R=%d %s: rel L2 %.2e over %zu of %lld tokens\n", R, what.c_str(), e, rows.size(), static_cast<long long>(T));
              g->barrier();
            }
            throw_failures(rank, failures);
          });
          EXPECT_EQ(failed, "");
        }
      }
    }
  }
}

#endif  // EPX_WITH_CUDA
