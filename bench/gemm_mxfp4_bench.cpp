// bench/gemm_mxfp4_bench.cpp: `epx-gemm-mxfp4-bench`, the MXFP4 grouped expert GEMMs and the FHMoE
// fused-vs-separate shared expert of issue 6 on one GPU.
//
// DeepSeek-V4-Pro experts (H 7168, I 3072, MXFP4 routed weights, FP8 128x128-block shared expert
// of width 3072, FP8 1x128 activations), --experts L routed experts (default 192 = EP2 of 384), the
// whole expert MLP per call, in the same process:
//   ceiling    HBM copy bandwidth (1 GiB device-to-device copy, bytes read + written);
//   epx-mxfp4-wgmma  make_experts_cuda (the sm_90a mixed tensor-core path, experts_mxfp4_cuda.cu);
//              validated against the CPU (decode) / the default variant (prefill);
//   epx-simt   the same with EPX_EXPERTS_SIMT=1 (the SIMT reference GEMMs), unless --no-simt.
// Order: ceiling, the FHMoE sweeps, decode, prefill (an opt-in variant that fails loses only the rows after it).
// Cases: decode-v4pro = ExpertMajor (masked) with 8 tokens per expert (cap 32), validated against
// the CPU experts; decode-v4pro-m32 (32 per expert); prefill-v4pro = Flat, 4096 tokens top-6.
// FHMoE sweep (fhmoe-v4pro): T tokens, Flat, top-6 random routed experts + the shared expert:
//   fused     one Experts object of L MXFP4 routed experts + the FP8 shared expert (local id L),
//             topk_idx [T, 7] with column 6 = L, weight 1.0: one grouped launch per GEMM;
//   separate  the routed Experts (topk_idx [T, 6]) then a one-expert FP8 Experts on the same x
//             ([T, 1], weight 1.0); the bf16 add of the two outputs is NOT timed (it favours
//             separate by one T x H elementwise pass).
// Both validated for T <= 64 against the CPU experts (fused: 7 columns in one apply; separate: the
// two outputs added in fp32 on the host). The JSON's "fhmoe_gate" object holds the largest T of
// the sweep at which fused is at least as fast as separate (the capability gate's threshold).
// Timing: CUDA events around each call, median (p10/p90) over --iters calls after 3 warm-up calls.
// --cases LIST runs a subset of fhmoe,decode,prefill (default all); --stamps adds, after the decode rows, the stamped kernels' per-phase
// cycles per K-loop stage (set_mixed_debug, experts_mxfp4_cuda.h), a timing-only ablation (the
// expansion skipped) and the .L2::256B load hint as decode-v4pro-stamps rows.
// Usage: epx-gemm-mxfp4-bench [--json PATH] [--iters N] [--experts L] [--no-simt] [--max-tokens T]
//        [--fhmoe-experts L1,L2,...] [--cases fhmoe,decode,prefill] [--stamps]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "epx/dtype.h"
#include "epx/experts.h"
#include "epx/quant.h"
#include "epx/tensor.h"
#include "experts/experts_mxfp4_cuda.h"

namespace {

using namespace epx;
using json = nlohmann::json;
using namespace epx::bench;

constexpr int64_t kH = 7168, kI = 3072, kTopK = 6;

Tensor host_from(const void* src, std::vector<int64_t> shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt);
  std::memcpy(t.data(), src, t.nbytes());
  return t;
}
std::vector<float> to_float(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_bits_to_float(b[i]);
  return f;
}
/// ||a - b|| / ||b|| over rows [r0, r1) of [*, H] values, for each listed range (NaN -> inf).
double rel_l2(const std::vector<float>& a, const std::vector<float>& b, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  double num = 0, den = 0;
  for (auto [r0, r1] : ranges)
    for (int64_t i = r0 * kH; i < r1 * kH; ++i) {
      if (!std::isfinite(a[i])) return INFINITY;
      num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
      den += double(b[i]) * b[i];
    }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int iters = 20, L = 192;
  int64_t max_tokens = 4096;
  std::vector<int> fhmoe_experts;  // routed experts per FHMoE sweep (default: L)
  bool do_simt = true, do_stamps = false;
  std::string cases = "fhmoe,decode,prefill";
  std::string command = "epx-gemm-mxfp4-bench";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    command += " " + a;
    if (a == "--json" && i + 1 < argc) json_path = argv[++i], command += std::string(" ") + argv[i];
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]), command += std::string(" ") + argv[i];
    else if (a == "--experts" && i + 1 < argc) L = std::atoi(argv[++i]), command += std::string(" ") + argv[i];
    else if (a == "--max-tokens" && i + 1 < argc) max_tokens = std::atoll(argv[++i]), command += std::string(" ") + argv[i];
    else if (a == "--no-simt") do_simt = false;
    else if (a == "--stamps") do_stamps = true;
    else if (a == "--cases" && i + 1 < argc) cases = argv[++i], command += std::string(" ") + argv[i];
    else if (a == "--fhmoe-experts" && i + 1 < argc) {
      const std::string list = argv[++i];
      command += " " + list;
      for (size_t b = 0; b < list.size();) {
        const size_t e = std::min(list.find(',', b), list.size());
        fhmoe_experts.push_back(std::atoi(list.substr(b, e - b).c_str()));
        b = e + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: epx-gemm-mxfp4-bench [--json PATH] [--iters N] [--experts L] [--no-simt] [--max-tokens T] "
                   "[--fhmoe-experts L1,L2,...] [--cases fhmoe,decode,prefill] [--stamps]\n");
      return 1;
    }
  }
  cudaDeviceProp prop{};
  cudaStream_t stream;
  if (!open_bench_device("epx-gemm-mxfp4-bench", prop, stream)) return 1;
  json rows = json::array();
  json gate = json::object();
  // MXFP4 bytes per routed expert: codes (half a byte per weight) + one e8m0 per 32.
  const double mx_expert_bytes = 3.0 * kH * kI / 2 + 3.0 * kH * kI / 32;
  const double fp8_expert_bytes = 3.0 * kH * kI + 3.0 * (kH / 128) * (kI / 128) * 4;
  const double weight_bytes = L * mx_expert_bytes;

  double hbm_gbps = 0;
  {
    const size_t bytes = size_t{1} << 30;
    void *a, *b;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 0x3c, bytes));
    const Stats st = time_us(stream, iters, [&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream)); });
    hbm_gbps = 2.0 * bytes / (st.p50 * 1e-6) / 1e9;
    rows.push_back({{"case", "hbm-copy-1GiB"}, {"backend", "cudaMemcpyAsync"}, {"op", "copy"}, {"latency_us_p50", st.p50},
                    {"latency_us_p10", st.p10}, {"latency_us_p90", st.p90}, {"gbps", hbm_gbps},
                    {"accounting", "bytes read + written"}, {"iterations", iters}});
    std::printf("ceiling  HBM copy 1 GiB: %.1f us, %.0f GB/s (read + write)\n", st.p50, hbm_gbps);
    CK(cudaFree(a));
    CK(cudaFree(b));
  }

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::shared_ptr<const ExpertWeights>> routed;
  {
    auto w0 = ExpertWeights::random(WeightFormat::mxfp4, kH, kI, 11), w1 = ExpertWeights::random(WeightFormat::mxfp4, kH, kI, 12);
    for (int l = 0; l < L; ++l) routed.push_back(l % 2 ? w1 : w0);  // distinct device copies per expert
  }
  const std::shared_ptr<const ExpertWeights> shared = ExpertWeights::random(WeightFormat::fp8_block, kH, kI, 13);
  unsetenv("EPX_EXPERTS_SIMT");
  auto has_case = [&](const std::string& c) { return ("," + cases + ",").find("," + c + ",") != std::string::npos; };
  std::unique_ptr<Experts> tc;
  if (has_case("decode") || has_case("prefill")) tc = make_experts_cuda(routed, 0);
  std::printf("weights: %d MXFP4 experts, %.2f GB, ready in %.1f s\n", L, weight_bytes / 1e9,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  auto write_json = [&] {
    if (json_path.empty()) return;
    const char* commit = std::getenv("GEMM_BENCH_COMMIT");
    const char* tc_env = std::getenv("EPX_EXPERTS_MXFP4_TC");
    json doc = {{"tool", "gemm bench"}, {"command", command}, {"git_commit", commit ? commit : "unknown"},
                {"EPX_EXPERTS_MXFP4_TC", tc_env ? tc_env : "unset"},
                {"date", utc_now()}, {"device", std::string("1 x ") + prop.name}, {"fhmoe_gate", gate}, {"results", rows}};
    std::ofstream(json_path) << doc.dump(2) << "\n";
  };
  auto add_row = [&](json r, const Stats& st, const char* fmt_note) {
    r["op"] = "gemm";
    r["hidden"] = kH;
    r["intermediate"] = kI;
    r["latency_us_p50"] = st.p50;
    r["latency_us_p10"] = st.p10;
    r["latency_us_p90"] = st.p90;
    r["iterations"] = iters;
    rows.push_back(r);
    write_json();  // after every row: a later failure or timeout keeps what ran
    std::printf("%-14s %-18s %s p50 %9.1f us  %s\n", r["case"].get<std::string>().c_str(), r["backend"].get<std::string>().c_str(),
                fmt_note, st.p50, r.contains("max_rel_error") ? ("rel_l2 " + std::to_string(r["max_rel_error"].get<double>())).c_str() : "");
  };

  // The FHMoE sweep runs first: its rows are in the JSON even if a later (opt-in) variant fails.
  // ---- FHMoE: fused (one launch pair for routed + shared) vs separate shared expert ----
  if (fhmoe_experts.empty()) fhmoe_experts.push_back(L);
  json gates = json::array();
  if (!has_case("fhmoe")) fhmoe_experts.clear();
  for (const int FL : fhmoe_experts) {
    const std::vector<std::shared_ptr<const ExpertWeights>> routed_fl(routed.begin(), routed.begin() + std::min(FL, L));
    std::vector<std::shared_ptr<const ExpertWeights>> fused_fl = routed_fl;
    fused_fl.push_back(shared);
    const int L = static_cast<int>(routed_fl.size());  // this sweep's routed experts
    auto fused = make_experts_cuda(fused_fl, 0);
    auto routed_only = make_experts_cuda(routed_fl, 0);
    auto shared_only = make_experts_cuda({shared}, 0);
    std::unique_ptr<Experts> cpu_fused;
    std::vector<int64_t> sweep;
    for (int64_t t = 1; t <= max_tokens; t *= 2) sweep.push_back(t);
    for (int64_t t : {int64_t{24}, int64_t{48}, int64_t{96}, int64_t{192}, int64_t{384}, int64_t{768}})
      if (t <= max_tokens) sweep.push_back(t);
    std::sort(sweep.begin(), sweep.end());
    std::mt19937_64 rng(77);
    int64_t threshold = 0, threshold10 = 0;
    bool crossed = false, crossed10 = false;
    for (int64_t T : sweep) {
      const int64_t K = kTopK, K1 = kTopK + 1;
      std::vector<uint8_t> q;
      std::vector<float> s;
      random_fp8(T, kH, 1000 + T, q, s);
      std::vector<int32_t> idx1(static_cast<size_t>(T * K1)), idx(static_cast<size_t>(T * K)), sidx(static_cast<size_t>(T), 0);
      std::vector<float> w1(static_cast<size_t>(T * K1)), w(static_cast<size_t>(T * K)), sw(static_cast<size_t>(T), 1.0f);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int32_t> pick;
        while (static_cast<int64_t>(pick.size()) < K) {
          const int32_t e = static_cast<int32_t>(rng() % L);
          if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
        }
        for (int64_t k = 0; k < K; ++k) {
          const float wt = 0.05f + 0.3f * std::uniform_real_distribution<float>(0, 1)(rng);
          idx[t * K + k] = idx1[t * K1 + k] = pick[k];
          w[t * K + k] = w1[t * K1 + k] = wt;
        }
        idx1[t * K1 + K] = L;  // the shared expert: local id L, weight 1.0
        w1[t * K1 + K] = 1.0f;
      }
      const Tensor x = dev_from(q.data(), {T, kH}, DType::fp8_e4m3), xs = dev_from(s.data(), {T, kH / 128}, DType::fp32);
      const Tensor i1 = dev_from(idx1.data(), {T, K1}, DType::int32), wd1 = dev_from(w1.data(), {T, K1}, DType::fp32);
      const Tensor i0 = dev_from(idx.data(), {T, K}, DType::int32), wd0 = dev_from(w.data(), {T, K}, DType::fp32);
      const Tensor is = dev_from(sidx.data(), {T, 1}, DType::int32), wds = dev_from(sw.data(), {T, 1}, DType::fp32);
      Tensor of = Tensor::empty({T, kH}, DType::bf16, Device::cuda(0)), orr = Tensor::empty({T, kH}, DType::bf16, Device::cuda(0)),
             os = Tensor::empty({T, kH}, DType::bf16, Device::cuda(0));
      CK(cudaMemset(of.data(), 0xFF, of.nbytes()));
      const ExpertsInput inf{ActivationLayout::Flat, x, xs, {}, i1, wd1};
      const ExpertsInput inr{ActivationLayout::Flat, x, xs, {}, i0, wd0};
      const ExpertsInput ins{ActivationLayout::Flat, x, xs, {}, is, wds};
      const Stats sf = time_us(stream, iters, [&] { fused->apply(inf, of, Stream{stream}); });
      const Stats ssep = time_us(stream, iters, [&] {
        routed_only->apply(inr, orr, Stream{stream});
        shared_only->apply(ins, os, Stream{stream});
      });
      CK(cudaStreamSynchronize(stream));
      double ef = -1, es = -1;
      const bool validate = T <= 64;
      if (validate) {
        if (!cpu_fused) cpu_fused = make_experts_cpu(fused_fl);
        Tensor ref = Tensor::empty({T, kH}, DType::bf16);
        cpu_fused->apply({ActivationLayout::Flat, host_from(q.data(), {T, kH}, DType::fp8_e4m3),
                          host_from(s.data(), {T, kH / 128}, DType::fp32), {}, host_from(idx1.data(), {T, K1}, DType::int32),
                          host_from(w1.data(), {T, K1}, DType::fp32)},
                         ref);
        std::vector<uint16_t> rb(static_cast<size_t>(ref.nbytes() / 2));
        std::memcpy(rb.data(), ref.data(), ref.nbytes());
        const std::vector<float> refv = to_float(rb), gf = to_float(host_bf16(of));
        std::vector<float> gs = to_float(host_bf16(orr));
        const std::vector<float> gsh = to_float(host_bf16(os));
        for (size_t i = 0; i < gs.size(); ++i) gs[i] = round_bf16(gs[i] + gsh[i]);  // separate: out + y, rounded again
        ef = rel_l2(gf, refv, {{0, T}});
        es = rel_l2(gs, refv, {{0, T}});
      }
      const double speedup = ssep.p50 / sf.p50;
      if (!crossed && sf.p50 <= ssep.p50) threshold = T;
      if (sf.p50 > ssep.p50) crossed = true;
      if (!crossed10 && speedup >= 1.1) threshold10 = T;
      if (speedup < 1.1) crossed10 = true;
      const double bytes = L * mx_expert_bytes + fp8_expert_bytes;  // upper bound: every expert touched
      json base = {{"case", "fhmoe-v4pro"}, {"layout", "flat"}, {"num_local_experts", L}, {"tokens", T}, {"top_k", K},
                   {"dtype", "mxfp4 routed + fp8_block shared"}, {"accounting", "weight-bytes"},
                   {"weight_bytes_upper_bound", bytes}, {"validated", validate}};
      json rf = base, rs = base;
      rf["backend"] = "epx-fhmoe-fused";
      rf["max_rel_error"] = ef;
      rf["speedup_vs_separate"] = speedup;
      rf["note"] = "one Experts of L MXFP4 + 1 FP8 shared expert, topk_idx [T, 7] (column 6 = shared, weight 1)";
      rs["backend"] = "epx-fhmoe-separate";
      rs["max_rel_error"] = es;
      rs["note"] = "routed Experts [T, 6] + one-expert FP8 Experts [T, 1]; the bf16 add of the outputs is not timed";
      add_row(rf, sf, ("T=" + std::to_string(T)).c_str());
      add_row(rs, ssep, ("T=" + std::to_string(T) + " speedup fused " + std::to_string(speedup)).c_str());
    }
    gates.push_back({{"num_local_experts", L},
                     {"rule", "largest T of the sweep, scanning upward, before the first T where fused is slower than separate"},
                     {"threshold_tokens", threshold},
                     {"fused_10pct_faster_up_to_tokens", threshold10},
                     {"sweep", sweep}});
    gate = {{"per_num_local_experts", gates}};
    write_json();
    std::printf("FHMoE L=%d: fused <= separate up to T = %lld; fused >= 10 %% faster up to T = %lld\n", L,
                static_cast<long long>(threshold), static_cast<long long>(threshold10));
  }

  // ---- decode: ExpertMajor, 8 tokens per expert (cap 32), validated against the CPU experts ----
  for (int64_t m : {int64_t{8}, int64_t{32}}) {
    if (!has_case("decode")) break;
    const int64_t cap = 32;
    std::vector<uint8_t> q;
    std::vector<float> s;
    random_fp8(L * cap, kH, 21 + m, q, s);
    const Tensor x = dev_from(q.data(), {L, cap, kH}, DType::fp8_e4m3), xs = dev_from(s.data(), {L, cap, kH / 128}, DType::fp32);
    std::vector<int32_t> cnt(static_cast<size_t>(L), static_cast<int32_t>(m));
    const Tensor rc = dev_from(cnt.data(), {L}, DType::int32);
    Tensor out = Tensor::empty({L, cap, kH}, DType::bf16, Device::cuda(0));
    CK(cudaMemset(out.data(), 0xFF, out.nbytes()));
    const ExpertsInput in{ActivationLayout::ExpertMajor, x, xs, rc, {}, {}};
    const Stats st = time_us(stream, iters, [&] { tc->apply(in, out, Stream{stream}); });
    CK(cudaStreamSynchronize(stream));
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t l = 0; l < L; ++l) ranges.push_back({l * cap, l * cap + m});
    double err = -1;
    std::vector<float> refv;
    if (m == 8) {
      Tensor ref = Tensor::empty({L, cap, kH}, DType::bf16);
      std::memset(ref.data(), 0, ref.nbytes());
      make_experts_cpu(routed)->apply({ActivationLayout::ExpertMajor, host_from(q.data(), {L, cap, kH}, DType::fp8_e4m3),
                                       host_from(s.data(), {L, cap, kH / 128}, DType::fp32),
                                       host_from(cnt.data(), {L}, DType::int32), {}, {}},
                                      ref);
      std::vector<uint16_t> rb(static_cast<size_t>(ref.nbytes() / 2));
      std::memcpy(rb.data(), ref.data(), ref.nbytes());
      refv = to_float(rb);
      err = rel_l2(to_float(host_bf16(out)), refv, ranges);
    }
    const double gbps = weight_bytes / (st.p50 * 1e-6) / 1e9;
    json r = {{"case", m == 8 ? "decode-v4pro" : "decode-v4pro-m32"}, {"backend", "epx-mxfp4-wgmma"}, {"layout", "expert_major"},
              {"num_local_experts", L}, {"rows_per_expert", m}, {"dtype", "mxfp4"}, {"gbps", gbps},
              {"accounting", "weight-bytes"}, {"fraction_of_peak", gbps / hbm_gbps},
              {"fraction_of_peak_basis", "measured HBM copy GB/s"}, {"validated", m == 8}, {"max_rel_error", err}};
    add_row(r, st, (std::to_string(static_cast<int>(gbps)) + " GB/s of weights").c_str());
    if (do_stamps && m == 8) {
      // Where the cycles of a stage go: the stamped kernels (mode 1, results checked), then the
      // ablation without the expansion (mode 2; timing only, wrong results).
      unsigned long long* dbg = nullptr;
      CK(cudaMalloc(&dbg, experts_cuda::kMixedDebugWords * sizeof(unsigned long long)));
      static const char* kPhaseNames[] = {"issue", "load_wait", "convert", "mma_wait", "promote", "fence", "barrier", "load_issue",
                                          "prologue", "epilogue"};
      for (int mode : {1, 2, 3}) {
        Experts* obj = tc.get();
        experts_cuda::set_mixed_debug(dbg, mode);
        CK(cudaMemset(out.data(), 0xFF, out.nbytes()));
        const Stats sd = time_us(stream, iters, [&] { obj->apply(in, out, Stream{stream}); });
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemsetAsync(dbg, 0, experts_cuda::kMixedDebugWords * sizeof(unsigned long long), stream));
        obj->apply(in, out, Stream{stream});  // one stamped call
        std::vector<unsigned long long> h(experts_cuda::kMixedDebugWords);
        CK(cudaMemcpyAsync(h.data(), dbg, h.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream));
        CK(cudaStreamSynchronize(stream));
        experts_cuda::set_mixed_debug(nullptr, 0);
        json rd = r;
        rd["case"] = "decode-v4pro-stamps";
        rd["backend"] = mode == 1   ? "epx-mxfp4-wgmma-stamped"
                        : mode == 2 ? "ablation-no-expansion"
                                    : "epx-mxfp4-wgmma-stamped-l2pf256";
        rd["gbps"] = weight_bytes / (sd.p50 * 1e-6) / 1e9;
        rd["fraction_of_peak"] = rd["gbps"].get<double>() / hbm_gbps;
        rd["max_rel_error"] = mode != 2 ? rel_l2(to_float(host_bf16(out)), refv, ranges) : -1.0;
        rd["validated"] = mode != 2;
        json gemms = json::object();
        for (int g = 0; g < 2; ++g) {
          const unsigned long long* w0 = h.data() + g * experts_cuda::kMixedDebugWarps * experts_cuda::kMixedDebugPhases;
          auto at = [&](int w, int ph) { return static_cast<double>(w0[w * experts_cuda::kMixedDebugPhases + ph]); };
          const double stages = at(0, experts_cuda::kDbgStages), items = at(0, experts_cuda::kDbgMxItems) + at(0, experts_cuda::kDbgFp8Items);
          const double ctas = at(0, experts_cuda::kDbgCtas);
          int warps = 0;  // warps per CTA that stamped (8)
          for (int w = 0; w < experts_cuda::kMixedDebugWarps; ++w) warps += at(w, experts_cuda::kDbgCtas) > 0;
          warps = std::max(warps, 1);
          json ph = json::object();
          std::string line;
          char buf[96];
          for (int k = 0; k < 10; ++k) {
            double mean = 0, mx = 0;
            for (int w = 0; w < warps; ++w) {
              mean += at(w, k) / warps;
              mx = std::max(mx, at(w, k));
            }
            const double per = k < 8 ? std::max(stages, 1.0) : std::max(items, 1.0);  // loop phases per stage, others per item
            ph[kPhaseNames[k]] = {{"mean_cycles", mean / per}, {"max_warp_cycles", mx / per}, {"per", k < 8 ? "stage" : "item"}};
            std::snprintf(buf, sizeof buf, " %s %.0f", kPhaseNames[k], mean / per);
            line += buf;
          }
          const double kernel = at(0, experts_cuda::kDbgKernel) / std::max(ctas, 1.0);
          gemms[g == 0 ? "gate_up" : "down"] = {{"phases", ph},          {"stages", stages},          {"items", items}, {"warps", warps},
                                                 {"ctas", ctas},         {"kernel_cycles_per_cta", kernel},
                                                 {"cycles_per_stage", kernel * ctas / std::max(stages, 1.0)}};
          std::printf("stamps mode %d %-7s stages %.0f items %.0f ctas %.0f: %.0f cycles per stage (kernel %.0f per CTA); per stage:%s\n",
                      mode, g == 0 ? "gate_up" : "down", stages, items, ctas, kernel * ctas / std::max(stages, 1.0), kernel, line.c_str());
        }
        rd["stamps"] = gemms;
        rd["note"] = "clock64 per phase of the K loop, summed per warp over the CTAs of one call (mean over the 8 warps per stage); "
                     "mode " + std::to_string(mode) +
                     (mode == 1   ? " (stamped kernels, results checked)"
                      : mode == 2 ? " (expansion skipped, timing only)"
                                  : " (stamped, raw loads with the .L2::256B prefetch hint, results checked)");
        add_row(rd, sd, (std::string("stamped mode ") + std::to_string(mode)).c_str());
      }
      CK(cudaFree(dbg));
    }
    if (do_simt && m == 8) {
      setenv("EPX_EXPERTS_SIMT", "1", 1);
      auto simt = make_experts_cuda(routed, 0);
      unsetenv("EPX_EXPERTS_SIMT");
      CK(cudaMemset(out.data(), 0xFF, out.nbytes()));
      const Stats s2 = time_us(stream, 3, [&] { simt->apply(in, out, Stream{stream}); });
      CK(cudaStreamSynchronize(stream));
      const double e2 = rel_l2(to_float(host_bf16(out)), refv, ranges);
      json r2 = r;
      r2["backend"] = "epx-simt";
      r2["gbps"] = weight_bytes / (s2.p50 * 1e-6) / 1e9;
      r2["fraction_of_peak"] = r2["gbps"].get<double>() / hbm_gbps;
      r2["max_rel_error"] = e2;
      r2["iterations"] = 3;
      add_row(r2, s2, "SIMT reference");
      rows.back()["iterations"] = 3;
    }
  }

  // ---- prefill: Flat, 4096 tokens top-6 over the L experts ----
  if (has_case("prefill")) {
    const int64_t T = 4096, K = kTopK;
    std::vector<uint8_t> q;
    std::vector<float> s;
    random_fp8(T, kH, 31, q, s);
    const Tensor x = dev_from(q.data(), {T, kH}, DType::fp8_e4m3), xs = dev_from(s.data(), {T, kH / 128}, DType::fp32);
    std::vector<int32_t> idx(static_cast<size_t>(T * K));
    std::vector<float> wts(static_cast<size_t>(T * K), 1.0f / K);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) idx[t * K + k] = static_cast<int32_t>((t * K + k) % L);
    const Tensor id = dev_from(idx.data(), {T, K}, DType::int32), wd = dev_from(wts.data(), {T, K}, DType::fp32);
    Tensor out = Tensor::empty({T, kH}, DType::bf16, Device::cuda(0));
    const ExpertsInput in{ActivationLayout::Flat, x, xs, {}, id, wd};
    const Stats st = time_us(stream, iters, [&] { tc->apply(in, out, Stream{stream}); });
    const double flops = 2.0 * T * K * kH * 3.0 * kI;
    json r = {{"case", "prefill-v4pro"}, {"backend", "epx-mxfp4-wgmma"}, {"layout", "flat"}, {"num_local_experts", L},
              {"tokens", T}, {"top_k", K}, {"rows_per_expert", T * K / L}, {"dtype", "mxfp4"},
              {"tflops", flops / (st.p50 * 1e-6) / 1e12}, {"accounting", "flops"}, {"validated", false},
              {"note", "timing only (the GPU tests check the Flat layout at 8192 rows against the CPU)"}};
    add_row(r, st, (std::to_string(static_cast<int>(flops / (st.p50 * 1e-6) / 1e12)) + " TFLOP/s").c_str());
  }
  tc.reset();

  write_json();
  if (!json_path.empty()) std::printf("wrote %s\n", json_path.c_str());
  CK(cudaStreamDestroy(stream));
  return 0;
}
