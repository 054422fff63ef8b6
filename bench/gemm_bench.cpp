// bench/gemm_bench.cpp: `epx-gemm-bench`, the grouped expert GEMM benchmark of issue 6 on one GPU.
//
// DeepSeek-V3 expert shapes (H 7168, I 2048, fp8_block weights, FP8 1x128 activations), 128 local
// experts (EP2 of 256), the whole expert MLP per call (gate_up, SiLU-and-mul, FP8 requantization
// of h, down), in the same process:
//   ceilings   HBM copy bandwidth (1 GiB device-to-device copy, bytes read + written) and the dense
//              FP8 tensor-core rate (cuBLASLt e4m3 8192^3, bf16 out, per-tensor scales 1.0);
//   epx-wgmma  make_experts_cuda (the sm_90a tensor-core path for fp8_block);
//   epx-simt   the same with EPX_EXPERTS_SIMT=1 (the SIMT reference GEMMs);
//   cublaslt   a per-expert loop of cuBLASLt FP8 GEMMs (gate_up then down, per-tensor scales 1.0,
//              bf16 out; GEMMs only: no SiLU, no requantization, h is random FP8).
// Cases: decode = ExpertMajor (masked) with 8 tokens per expert (cap 32); prefill = Flat
// (token rows + top-k, grouped by expert on the device), 4096 tokens top-8, 256 rows per expert,
// ExpertMajor with every row of cap 256 valid, and Contiguous (rows already sorted by expert + cumulative
// offsets, torch._scaled_grouped_mm's layout): the same rows with 256 per expert (byte-identical to
// ExpertMajor's output), and uneven experts of 0..512 rows (prefill-v3-uneven). Decode reports weight bytes / time against the HBM
// copy rate; prefill reports TFLOP/s (2 * rows * H * 3I) against the measured FP8 rate.
// Timing: CUDA events around each call, median (p10/p90) over --iters calls after 3 warm-up calls.
// Validation: the wgmma outputs against the SIMT outputs of the same inputs (normwise rel. L2), and
// the decode case also against the CPU experts.
// Usage: epx-gemm-bench [--json PATH] [--iters N] [--experts L] [--no-simt] [--no-cublas] [--prefill-variants]
//        [--prefill-only] [--prefill-modes M,M,...]
// (--prefill-only: the ceilings, the prefill rows of the default kernels and the cuBLASLt prefill loop
// alone; --prefill-modes: rows epx-wgmma-mode<M> for each listed EPX_EXPERTS_FP8_PREFILL value on
// both prefill layouts, instead of --prefill-variants' fixed list)
// (--stamps F,F,...: after the ExpertMajor prefill row, the stamped mode-17 kernels
// (set_fp8_prefill_debug, experts_fp8_cuda.h) once per listed ablation flag set (0 = none; kPfDbg*:
// 1 no loads, 4 no promotions, 8 no weight-tile loads): their time (p50 of --iters) and
// the per-phase clock stamps of the K loop per warpgroup (medians over CTAs and a window of K blocks),
// as rows prefill-v3-stamps; --no-flat skips the Flat prefill case)
// (--rounds N: after the prefill rows, the default kernels' Flat, ExpertMajor, Contiguous and uneven Contiguous
// (layout contiguous-uneven) applies again in N interleaved rounds (each round times each case with --iters calls, in a
// rotated order), and with --prefill-modes each listed mode's applies of the same inputs (layouts "<layout>-mode<M>");
// rows prefill-v3-rounds give the median, min and max over the rounds of each round's p50 (and every round's p50 in the
// JSON's round_p50_us): rows of identical GPU work
// move by up to ~10 % inside one process with what ran before them (bench/NOTES.md, twelfth session), so layout and
// mode comparisons use these)
// (--prefill-variants: also the prefill kernel with early scales / release, bulk-copy stores and wgmma's A in
// registers (=17; the default 1 runs it for the Flat gate_up gather only), the TMA loads (=10), the TMA loads with the
// lean consumer (=23) and with its early next-block loads (=27, the default's other kernels); the removed variants (2-7,
// 9, 11-16, 18-22, 24-26) and the ring depths were measured before, bench/NOTES.md)
#include <cublasLt.h>
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
#include "experts/experts_fp8_cuda.h"

namespace {

using namespace epx;
using json = nlohmann::json;
using namespace epx::bench;

#define CKL(x)                                                                                         \
  do {                                                                                                 \
    cublasStatus_t s_ = (x);                                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                 \
      std::fprintf(stderr, "%s: cublas status %d at %s:%d\n", #x, static_cast<int>(s_), __FILE__, __LINE__); \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)

constexpr int64_t kH = 7168, kI = 2048;

/// ||a - b|| / ||b|| over the listed row ranges [r0, r1) of [*, H] bf16 (NaN -> inf).
double rel_l2(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  double num = 0, den = 0;
  for (auto [r0, r1] : ranges)
    for (int64_t i = r0 * kH; i < r1 * kH; ++i) {
      const double x = bf16_bits_to_float(a[i]), y = bf16_bits_to_float(b[i]);
      if (!std::isfinite(x)) return INFINITY;
      num += (x - y) * (x - y);
      den += y * y;
    }
  return std::sqrt(num / std::max(den, 1e-30));
}

/// cuBLASLt FP8 GEMM out[M, N] (bf16, row-major) = a[M, K] (fp8 rows) . w[N, K]^T (fp8 rows),
/// per-tensor scales 1.0: column-major C[N, M] = W^T(op T) . A (op N), the "TN" layout FP8 needs.
#define CKLT(x)                                                                                        \
  do {                                                                                                 \
    cublasStatus_t s_ = (x);                                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                 \
      std::fprintf(stderr, "%s: cublas status %d at %s:%d\n", #x, static_cast<int>(s_), __FILE__, __LINE__); \
      ok = false;                                                                                      \
      return;                                                                                          \
    }                                                                                                  \
  } while (0)

struct LtGemm {
  bool ok = true;  // false: cuBLASLt refused this shape (reported, the row is skipped)
  cublasLtHandle_t lt;
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t la{}, lb{}, lc{};
  cublasLtMatmulHeuristicResult_t heur{};
  void* ws;
  size_t ws_bytes;
  LtGemm(cublasLtHandle_t h, int64_t M, int64_t N, int64_t K, void* workspace, size_t workspace_bytes)
      : lt(h), ws(workspace), ws_bytes(workspace_bytes) {
    CKLT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    CKLT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    CKLT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n));
    CKLT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K));  // W^T: [K, N] col-major, ld K
    CKLT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, M, K));  // A:   [K, M] col-major, ld K
    CKLT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));     // C:   [N, M] col-major = out rows
    cublasLtMatmulPreference_t pref;
    CKLT(cublasLtMatmulPreferenceCreate(&pref));
    CKLT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
    int found = 0;
    CKLT(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &heur, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0) {
      std::fprintf(stderr, "cuBLASLt: no FP8 algorithm for M=%lld N=%lld K=%lld\n", (long long)M, (long long)N, (long long)K);
      ok = false;
    }
  }
  void run(const void* a, const void* w, void* out, cudaStream_t s) const {
    const float one = 1.0f, zero = 0.0f;
    if (ok) CKL(cublasLtMatmul(lt, desc, &one, w, la, a, lb, &zero, out, lc, out, lc, &heur.algo, ws, ws_bytes, s));
  }
  ~LtGemm() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
  }
};

}  // namespace

/// Median and mean of v (0 when empty).
static json med_mean(std::vector<double> v) {
  if (v.empty()) return {{"median", 0}, {"mean", 0}, {"n", 0}};
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  return {{"median", v[v.size() / 2]}, {"mean", sum / static_cast<double>(v.size())}, {"n", v.size()}};
}

/// The stamps of GEMM g (0 gate_up, 1 down) in the debug buffer b (experts_fp8_cuda.h,
/// set_fp8_prefill_debug): per phase of the K loop the clock cycles (median, mean) over the CTAs and
/// the recorded window, per role; the wait for a stage's load; the CTAs' span and the SM clock.
/// `line` gets a one-line summary.
static json analyze_stamps(const std::vector<uint32_t>& b, int g, std::string& line) {
  using namespace epx::experts_cuda;
  static const char* kCons[kPfDbgStamps] = {"", "full_wait", "scales_ldmatrix", "issue0", "wait0", "promote0",
                                            "issue1", "wait1", "release", "promote1"};
  std::vector<double> ph[3][kPfDbgStamps + 1];  // [role][phase]; phase kPfDbgStamps = the K block's period
  std::vector<double> load_lat, lockstep, epi, item_len, busy_ns, ghz, cta_end;
  double t_min = 1e30, t_max = 0;
  int ctas = 0;
  double kblocks = 0, items = 0;
  for (int c = 0; c < kPfDbgCtas; ++c) {
    const uint32_t* d = b.data() + (static_cast<size_t>(g) * kPfDbgCtas + c) * kPfDbgCtaWords;
    if (d[7] == 0) continue;  // no item ran here
    ++ctas;
    kblocks += d[6], items += d[7];
    const double t0 = static_cast<double>(d[0] | (uint64_t{d[1]} << 32)), tc = static_cast<double>(d[2] | (uint64_t{d[3]} << 32));
    t_min = std::min(t_min, t0), t_max = std::max(t_max, tc);
    busy_ns.push_back(tc - t0);
    cta_end.push_back(tc);
    if (tc > t0) ghz.push_back(static_cast<double>(static_cast<uint32_t>(d[9] - d[8])) / (tc - t0));
    auto rec = [&](int role, int j) { return d + kPfDbgHeader + (role * kPfDbgWin + j) * kPfDbgStamps; };
    for (int role = 0; role < 3; ++role) {
      const int last = role == 0 ? 2 : 9;
      for (int j = 0; j < kPfDbgWin; ++j) {
        const uint32_t* r = rec(role, j);
        if (r[0] == 0 && r[last] == 0) continue;
        for (int i = 1; i <= last; ++i) ph[role][i].push_back(static_cast<double>(static_cast<uint32_t>(r[i] - r[i - 1])));
        if (j + 1 < kPfDbgWin) {
          const uint32_t* n = rec(role, j + 1);
          const double gap = static_cast<uint32_t>(n[0] - r[last]);
          // across an item boundary the epilogue lies in between: not a K-loop period
          if ((n[0] != 0 || n[last] != 0) && gap < 1500) ph[role][kPfDbgStamps].push_back(static_cast<uint32_t>(n[0] - r[0]));
        }
      }
    }
    for (int j = 0; j < kPfDbgWin; ++j) {
      const uint32_t *pr = rec(0, j), *c0 = rec(1, j), *c1 = rec(2, j);
      if (pr[2] == 0 || c0[1] == 0) continue;
      // the consumer was already waiting when the stage's copies were issued: from the issue to
      // the stage's `full` completion = the load's latency
      if (static_cast<int32_t>(pr[2] - c0[0]) > 0) load_lat.push_back(static_cast<int32_t>(c0[1] - pr[2]));
      if (c1[3] != 0) lockstep.push_back(std::abs(static_cast<double>(static_cast<int32_t>(c0[3] - c1[3]))));
    }
    const uint32_t* it = d + kPfDbgHeader + 3 * kPfDbgWin * kPfDbgStamps;
    for (int i = 0; i < kPfDbgItems && i < static_cast<int>(d[7]); ++i) {
      epi.push_back(static_cast<uint32_t>(it[3 * i + 2] - it[3 * i + 1]));
      item_len.push_back(static_cast<uint32_t>(it[3 * i + 2] - it[3 * i]));
    }
  }
  json j = {{"gemm", g == 0 ? "gate_up" : "down"}, {"ctas", ctas}, {"kblocks_per_cta", ctas ? kblocks / ctas : 0},
            {"items_per_cta", ctas ? items / ctas : 0}};
  json roles = json::object();
  for (int role = 0; role < 3; ++role) {
    json r = json::object();
    if (role == 0) {
      r["empty_wait"] = med_mean(ph[0][1]);
      r["issue_copies"] = med_mean(ph[0][2]);
    } else {
      for (int i = 1; i < kPfDbgStamps; ++i) r[kCons[i]] = med_mean(ph[role][i]);
    }
    r["kblock_period"] = med_mean(ph[role][kPfDbgStamps]);
    roles[role == 0 ? "producer_warp0" : role == 1 ? "consumer_wg0_warp0" : "consumer_wg1_warp0"] = r;
  }
  j["cycles"] = roles;
  j["load_latency_issue_to_full"] = med_mean(load_lat);
  j["wg_issue0_offset"] = med_mean(lockstep);
  j["epilogue"] = med_mean(epi);
  j["item"] = med_mean(item_len);
  const json clk = med_mean(ghz);
  j["sm_clock_ghz"] = clk;
  const json busy = med_mean(busy_ns);
  const double span = t_max - t_min;
  j["span_ns"] = span;
  j["cta_busy_ns"] = busy;
  j["cta_busy_over_span"] = span > 0 ? busy["mean"].get<double>() / span : 0;
  std::sort(cta_end.begin(), cta_end.end());
  j["cta_end_p10_p50_p100_ns_after_first_start"] = cta_end.empty() ? json::array() : json::array({
      cta_end[cta_end.size() / 10] - t_min, cta_end[cta_end.size() / 2] - t_min, cta_end.back() - t_min});
  char buf[1024];
  auto m = [&](int role, int i) { return ph[role][i].empty() ? 0.0 : roles[role == 1 ? "consumer_wg0_warp0" : "consumer_wg1_warp0"][kCons[i]]["median"].get<double>(); };
  std::snprintf(buf, sizeof buf,
                "%-7s %d CTAs, K-block period %.0f / %.0f clk (wg0 / wg1 median); wg0 full_wait %.0f pre %.0f issue0 %.0f wait0 %.0f "
                "promote0 %.0f issue1 %.0f wait1 %.0f release %.0f promote1 %.0f; producer empty_wait %.0f issue %.0f; "
                "load latency %.0f; wg offset %.0f; epilogue %.0f; clock %.2f GHz; span %.0f us, busy/span %.3f",
                g == 0 ? "gate_up" : "down", ctas, roles["consumer_wg0_warp0"]["kblock_period"]["median"].get<double>(),
                roles["consumer_wg1_warp0"]["kblock_period"]["median"].get<double>(), m(1, 1), m(1, 2), m(1, 3), m(1, 4), m(1, 5),
                m(1, 6), m(1, 7), m(1, 8), m(1, 9), roles["producer_warp0"]["empty_wait"]["median"].get<double>(),
                roles["producer_warp0"]["issue_copies"]["median"].get<double>(), j["load_latency_issue_to_full"]["median"].get<double>(),
                j["wg_issue0_offset"]["median"].get<double>(), j["epilogue"]["median"].get<double>(), clk["median"].get<double>(),
                span / 1e3, j["cta_busy_over_span"].get<double>());
  line = buf;
  return j;
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a run cut by a timeout keeps the rows it printed
  std::string json_path;
  int iters = 20, L = 128, rounds = 0;
  bool do_simt = true, do_cublas = true, do_variants = false, prefill_only = false, do_flat = true;
  std::vector<std::string> modes;
  std::vector<uint32_t> stamp_flags;
  std::string command = "epx-gemm-bench";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    command += " " + a;
    if (a == "--json" && i + 1 < argc) json_path = argv[++i], command += std::string(" ") + argv[i];
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]), command += std::string(" ") + argv[i];
    else if (a == "--rounds" && i + 1 < argc) rounds = std::atoi(argv[++i]), command += std::string(" ") + argv[i];
    else if (a == "--experts" && i + 1 < argc) L = std::atoi(argv[++i]), command += std::string(" ") + argv[i];
    else if (a == "--no-simt") do_simt = false;
    else if (a == "--no-cublas") do_cublas = false;
    else if (a == "--prefill-variants") do_variants = true;
    else if (a == "--prefill-only") prefill_only = true;
    else if (a == "--no-flat") do_flat = false;
    else if (a == "--stamps" && i + 1 < argc) {
      const std::string list = argv[++i];
      command += " " + list;
      for (size_t b = 0; b <= list.size();) {
        const size_t e = std::min(list.find(',', b), list.size());
        const std::string f = list.substr(b, e - b);
        if (f.empty()) {  // "1,,2" and a trailing comma: no flag there
          b = e + 1;
          continue;
        }
        // Digits only, below 2^32 (std::stoul threw out of main on "x" and wrapped "-1").
        const bool digits = f.size() <= 10 && f.find_first_not_of("0123456789") == std::string::npos;
        if (!digits || std::stoull(f) > 0xffffffffull) {
          std::fprintf(stderr, "epx-gemm-bench: --stamps %s: '%s' must be an unsigned 32-bit integer (flags F,F,...)\n", list.c_str(), f.c_str());
          return 2;
        }
        stamp_flags.push_back(static_cast<uint32_t>(std::stoull(f)));
        b = e + 1;
      }
      if (!experts_cuda::fp8_prefill_stamps_built()) {
        std::fprintf(stderr, "epx-gemm-bench: --stamps needs the stamped FP8 prefill kernels, which this build lacks "
                             "(configure with -DEPX_FP8_PREFILL_STAMPS=ON, as tools/device/gpu-check.sh does)\n");
        return 2;
      }
    }
    else if (a == "--prefill-modes" && i + 1 < argc) {
      const std::string list = argv[++i];
      command += " " + list;
      for (size_t b = 0; b <= list.size();) {
        const size_t e = std::min(list.find(',', b), list.size());
        if (e > b) modes.push_back(list.substr(b, e - b));
        b = e + 1;
      }
    }
    else {
      std::fprintf(stderr, "usage: epx-gemm-bench [--json PATH] [--iters N] [--experts L] [--no-simt] [--no-cublas] [--prefill-variants] "
                           "[--prefill-only] [--prefill-modes M,M,...] [--stamps F,F,...] [--no-flat] [--rounds N]\n");
      return 1;
    }
  }
  cudaDeviceProp prop{};
  cudaStream_t stream;
  if (!open_bench_device("epx-gemm-bench", prop, stream)) return 1;
  json rows = json::array();
  const double weight_bytes = static_cast<double>(L) * (3.0 * kH * kI + 3.0 * (kH / 128) * (kI / 128) * 4);

  // ---- ceilings ----
  double hbm_gbps = 0, fp8_tflops = 0;
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
  cublasLtHandle_t lt;
  CKL(cublasLtCreate(&lt));
  const size_t lt_ws_bytes = size_t{64} << 20;
  void* lt_ws;
  CK(cudaMalloc(&lt_ws, lt_ws_bytes));
  {
    const int64_t n = 8192;
    std::vector<uint8_t> q;
    std::vector<float> s;
    random_fp8(n, n, 7, q, s);
    Tensor a = dev_from(q.data(), {n, n}, DType::fp8_e4m3), w = dev_from(q.data(), {n, n}, DType::fp8_e4m3);
    Tensor c = Tensor::empty({n, n}, DType::bf16, Device::cuda(0));
    LtGemm g(lt, n, n, n, lt_ws, lt_ws_bytes);
    if (!g.ok) fp8_tflops = 1190.0;  // the figure, only when cuBLASLt cannot measure it
    if (g.ok) {
    const Stats st = time_us(stream, iters, [&] { g.run(a.data(), w.data(), c.data(), stream); });
    fp8_tflops = 2.0 * n * n * n / (st.p50 * 1e-6) / 1e12;
    rows.push_back({{"case", "dense-fp8-8192"}, {"backend", "cublaslt"}, {"op", "gemm"}, {"latency_us_p50", st.p50},
                    {"latency_us_p10", st.p10}, {"latency_us_p90", st.p90}, {"tflops", fp8_tflops},
                    {"accounting", "flops"}, {"iterations", iters}, {"dtype", "fp8_e4m3 per-tensor scale, bf16 out"}});
    std::printf("ceiling  cuBLASLt FP8 8192^3: %.1f us, %.0f TFLOP/s\n", st.p50, fp8_tflops);
    }
  }

  // ---- experts ----
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::shared_ptr<const ExpertWeights>> experts;
  {
    auto w0 = ExpertWeights::random(WeightFormat::fp8_block, kH, kI, 11), w1 = ExpertWeights::random(WeightFormat::fp8_block, kH, kI, 12);
    for (int l = 0; l < L; ++l) experts.push_back(l % 2 ? w1 : w0);  // distinct device copies per expert
  }
  unsetenv("EPX_EXPERTS_SIMT");
  auto tc = make_experts_cuda(experts, 0);
  // The 64-row kernels alone (EPX_EXPERTS_FP8_PREFILL=0): the prefill kernels' A/B reference.
  std::unique_ptr<Experts> tc64;
  if (!prefill_only) {
    setenv("EPX_EXPERTS_FP8_PREFILL", "0", 1);
    tc64 = make_experts_cuda(experts, 0);
    unsetenv("EPX_EXPERTS_FP8_PREFILL");
  }
  std::unique_ptr<Experts> simt;
  if (do_simt) {
    setenv("EPX_EXPERTS_SIMT", "1", 1);
    simt = make_experts_cuda(experts, 0);
    unsetenv("EPX_EXPERTS_SIMT");
  }
  std::printf("weights: %d experts, %.2f GB of FP8 weights + scales per backend, ready in %.1f s\n", L, weight_bytes / 1e9,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  auto write_json = [&] {
    if (json_path.empty()) return;
    // GEMM_BENCH_COMMIT, not EPX_*: Config::load() (inside make_experts_cuda) rejects unknown EPX_* names.
    const char* commit = std::getenv("GEMM_BENCH_COMMIT");
    json doc = {{"tool", "gemm bench"}, {"command", command}, {"git_commit", commit ? commit : "unknown"},
                {"date", utc_now()}, {"device", std::string("1 x ") + prop.name}, {"results", rows}};
    std::ofstream(json_path) << doc.dump(2) << "\n";
  };
  auto add_row = [&](const std::string& cas, const std::string& backend, const std::string& layout, int64_t rows_per_expert,
                     const Stats& st, bool decode, bool validated, double err, const std::string& note) {
    const double flops = 2.0 * L * rows_per_expert * kH * 3.0 * kI;
    const double gbps = weight_bytes / (st.p50 * 1e-6) / 1e9, tfl = flops / (st.p50 * 1e-6) / 1e12;
    json r = {{"case", cas}, {"backend", backend}, {"op", "gemm"}, {"layout", layout}, {"num_local_experts", L},
              {"hidden", kH}, {"intermediate", kI}, {"rows_per_expert", rows_per_expert}, {"dtype", "fp8_block"},
              {"latency_us_p50", st.p50}, {"latency_us_p10", st.p10}, {"latency_us_p90", st.p90}, {"gbps", gbps},
              {"tflops", tfl}, {"accounting", decode ? "weight-bytes" : "flops"},
              {"fraction_of_peak", decode ? gbps / hbm_gbps : tfl / fp8_tflops},
              {"fraction_of_peak_basis", decode ? "measured HBM copy GB/s" : "measured cuBLASLt FP8 8192^3 TFLOP/s"},
              {"iterations", iters}, {"validated", validated}, {"max_rel_error", err}};
    if (!note.empty()) r["note"] = note;
    rows.push_back(r);
    write_json();  // after every row: a later failure or timeout keeps what ran
    std::printf("%-16s %-10s %-13s %4lld rows/expert: %9.1f us  %7.0f GB/s weights  %6.1f TFLOP/s  (%.0f %% of %s)  rel_l2 %.2e\n",
                cas.c_str(), backend.c_str(), layout.c_str(), static_cast<long long>(rows_per_expert), st.p50, gbps, tfl,
                100.0 * (decode ? gbps / hbm_gbps : tfl / fp8_tflops), decode ? "HBM copy" : "FP8 dense", err);
  };

  // The default kernels' prefill applies per layout, kept for --rounds (each closure owns its tensors); with
  // --prefill-modes also each listed mode's applies (cases "<layout>-mode<M>").
  std::vector<std::pair<std::string, std::function<void()>>> round_cases;
  // One Experts object per --prefill-modes mode, made at its first use (kept until the rounds ran).
  std::vector<std::pair<std::string, std::shared_ptr<Experts>>> mode_objects;
  auto mode_object = [&](const std::string& md) {
    for (const auto& [m, e] : mode_objects)
      if (m == md) return e;
    setenv("EPX_EXPERTS_FP8_PREFILL", md.c_str(), 1);
    std::shared_ptr<Experts> e = make_experts_cuda(experts, 0);
    unsetenv("EPX_EXPERTS_FP8_PREFILL");
    if (md == "1" || md == "30" || md == "31" || md == "33")  // the 2-CTA cluster modes: clusters the launches get (0: one-CTA kernels)
      std::printf("mode %s: 2-CTA clusters resident at once: gate_up %d, down %d\n", md.c_str(),
                  experts_cuda::fp8_prefill_tma_max_clusters(true), experts_cuda::fp8_prefill_tma_max_clusters(false));
    mode_objects.emplace_back(md, e);
    return e;
  };
  // Rows epx-wgmma-mode<M> of --prefill-modes on one prefill input (max_rel_error against `ref`,
  // the default kernels' output of the same input).
  // `keep`: the tensors `in` views, held by the mode's --rounds closure.
  auto mode_rows = [&](const ExpertsInput& in, const Tensor& ref, const char* layout, int64_t rows_per_expert,
                       const std::vector<Tensor>& keep) {
    const TensorView& rv = ref.view();
    const std::vector<int64_t> shape(rv.shape.begin(), rv.shape.begin() + rv.ndim);
    const int64_t nrows = ref.numel() / kH;
    for (const std::string& md : modes) {
      const std::shared_ptr<Experts> tcv = mode_object(md);
      Tensor o = Tensor::empty(shape, DType::bf16, Device::cuda(0));
      CK(cudaMemset(o.data(), 0xFF, o.nbytes()));
      const Stats sm = time_us(stream, iters, [&] { tcv->apply(in, o, Stream{stream}); });
      CK(cudaStreamSynchronize(stream));
      add_row("prefill-v3", "epx-wgmma-mode" + md, layout, rows_per_expert, sm, false, true,
              rel_l2(host_bf16(o), host_bf16(ref), {{0, nrows}}), "EPX_EXPERTS_FP8_PREFILL=" + md + "; max_rel_error against epx-wgmma");
      const std::string rc = std::string(layout) + "-mode" + md;
      bool listed = false;
      for (const auto& c : round_cases) listed = listed || c.first == rc;
      if (rounds > 0 && !listed) round_cases.push_back({rc, [tcv, in, o, keep, stream] { tcv->apply(in, o, Stream{stream}); }});
    }
  };

  // ---- decode: ExpertMajor, 8 tokens per expert, cap 32 ----
  if (!prefill_only) {
    const int64_t cap = 32, m = 8;
    std::vector<uint8_t> q;
    std::vector<float> s;
    random_fp8(L * cap, kH, 21, q, s);
    const Tensor x = dev_from(q.data(), {L, cap, kH}, DType::fp8_e4m3), xs = dev_from(s.data(), {L, cap, kH / 128}, DType::fp32);
    std::vector<int32_t> cnt(static_cast<size_t>(L), static_cast<int32_t>(m));
    const Tensor rc = dev_from(cnt.data(), {L}, DType::int32);
    Tensor out = Tensor::empty({L, cap, kH}, DType::bf16, Device::cuda(0)), out2 = Tensor::empty({L, cap, kH}, DType::bf16, Device::cuda(0));
    CK(cudaMemset(out.data(), 0xFF, out.nbytes()));
    const ExpertsInput in{ActivationLayout::ExpertMajor, x, xs, rc, {}, {}};
    const Stats st = time_us(stream, iters, [&] { tc->apply(in, out, Stream{stream}); });
    CK(cudaStreamSynchronize(stream));
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t l = 0; l < L; ++l) ranges.push_back({l * cap, l * cap + m});
    const std::vector<uint16_t> got = host_bf16(out);
    // CPU reference (the oracle) on the same inputs.
    Tensor xh = Tensor::empty({L, cap, kH}, DType::fp8_e4m3), xsh = Tensor::empty({L, cap, kH / 128}, DType::fp32);
    std::memcpy(xh.data(), q.data(), q.size());
    std::memcpy(xsh.data(), s.data(), s.size() * 4);
    Tensor rch = Tensor::empty({L}, DType::int32), ref = Tensor::empty({L, cap, kH}, DType::bf16);
    std::memcpy(rch.data(), cnt.data(), cnt.size() * 4);
    std::memset(ref.data(), 0, ref.nbytes());
    make_experts_cpu(experts)->apply({ActivationLayout::ExpertMajor, xh, xsh, rch, {}, {}}, ref);
    std::vector<uint16_t> refv(static_cast<size_t>(ref.nbytes() / 2));
    std::memcpy(refv.data(), ref.data(), ref.nbytes());
    const double err = rel_l2(got, refv, ranges);
    add_row("decode-v3", "epx-wgmma", "expert_major", m, st, true, true, err, "validated against the CPU experts");
    if (simt) {
      const Stats s2 = time_us(stream, std::max(3, iters / 4), [&] { simt->apply(in, out2, Stream{stream}); });
      CK(cudaStreamSynchronize(stream));
      add_row("decode-v3", "epx-simt", "expert_major", m, s2, true, true, rel_l2(host_bf16(out2), refv, ranges), "validated against the CPU experts");
    }
  }

  // ---- decode at 32 tokens per expert (the N=64 tile path; timing only) ----
  if (!prefill_only) {
    const int64_t cap = 32, m = 32;
    std::vector<uint8_t> q;
    std::vector<float> s;
    random_fp8(L * cap, kH, 22, q, s);
    const Tensor x = dev_from(q.data(), {L, cap, kH}, DType::fp8_e4m3), xs = dev_from(s.data(), {L, cap, kH / 128}, DType::fp32);
    std::vector<int32_t> cnt(static_cast<size_t>(L), static_cast<int32_t>(m));
    const Tensor rc = dev_from(cnt.data(), {L}, DType::int32);
    Tensor out = Tensor::empty({L, cap, kH}, DType::bf16, Device::cuda(0));
    const ExpertsInput in{ActivationLayout::ExpertMajor, x, xs, rc, {}, {}};
    const Stats st = time_us(stream, iters, [&] { tc->apply(in, out, Stream{stream}); });
    add_row("decode-v3-m32", "epx-wgmma", "expert_major", m, st, true, false, 0, "timing only (tiles of 17-64 rows)");
  }

  // ---- prefill: Flat, 4096 tokens top-8 over the L experts, 256 rows per expert ----
  if (do_flat) {
    const int64_t T = 4096, K = 8, m = T * K / L;
    std::vector<uint8_t> q;
    std::vector<float> s;
    random_fp8(T, kH, 31, q, s);
    const Tensor x = dev_from(q.data(), {T, kH}, DType::fp8_e4m3), xs = dev_from(s.data(), {T, kH / 128}, DType::fp32);
    std::vector<int32_t> idx(static_cast<size_t>(T * K));
    std::vector<float> wts(static_cast<size_t>(T * K));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) idx[t * K + k] = static_cast<int32_t>((t * K + k) % L), wts[t * K + k] = 0.125f;
    const Tensor id = dev_from(idx.data(), {T, K}, DType::int32), wd = dev_from(wts.data(), {T, K}, DType::fp32);
    Tensor out = Tensor::empty({T, kH}, DType::bf16, Device::cuda(0)), out2 = Tensor::empty({T, kH}, DType::bf16, Device::cuda(0));
    CK(cudaMemset(out.data(), 0xFF, out.nbytes()));
    const ExpertsInput in{ActivationLayout::Flat, x, xs, {}, id, wd};
    const Stats st = time_us(stream, iters, [&] { tc->apply(in, out, Stream{stream}); });
    double err = -1;
    if (simt) {
      const Stats s2 = time_us(stream, 3, [&] { simt->apply(in, out2, Stream{stream}); });
      CK(cudaStreamSynchronize(stream));
      err = rel_l2(host_bf16(out), host_bf16(out2), {{0, T}});
      add_row("prefill-v3", "epx-simt", "flat", m, s2, false, false, 0, "");
    }
    add_row("prefill-v3", "epx-wgmma", "flat", m, st, false, simt != nullptr, err,
            "Flat layout: includes the device schedule, gather and the top-k weighted combine; validated against epx-simt");
    if (rounds > 0) round_cases.push_back({"flat", [&tc, stream, in, x, xs, id, wd, out] { tc->apply(in, out, Stream{stream}); }});
    mode_rows(in, out, "flat", m, {x, xs, id, wd});
    if (tc64) {
      Tensor out4 = Tensor::empty({T, kH}, DType::bf16, Device::cuda(0));
      CK(cudaMemset(out4.data(), 0xFF, out4.nbytes()));
      const Stats s4 = time_us(stream, iters, [&] { tc64->apply(in, out4, Stream{stream}); });
      CK(cudaStreamSynchronize(stream));
      add_row("prefill-v3", "epx-wgmma-64", "flat", m, s4, false, true, rel_l2(host_bf16(out), host_bf16(out4), {{0, T}}),
              "EPX_EXPERTS_FP8_PREFILL=0 (64-row kernels only); max_rel_error = epx-wgmma (prefill kernels) against this");
      // Early scales / release, bulk stores and A in registers (=17) and the TMA weight loads (=10; Flat
      // gathers its token rows with cp.async) on the Flat layout.
      for (const char* mode : {"17", "10"}) {
        if (!do_variants || !modes.empty()) break;
        setenv("EPX_EXPERTS_FP8_PREFILL", mode, 1);
        auto tcv = make_experts_cuda(experts, 0);
        unsetenv("EPX_EXPERTS_FP8_PREFILL");
        CK(cudaMemset(out4.data(), 0xFF, out4.nbytes()));
        const Stats s5 = time_us(stream, iters, [&] { tcv->apply(in, out4, Stream{stream}); });
        CK(cudaStreamSynchronize(stream));
        const std::string md = mode;
        const char* name = md == "17" ? "epx-wgmma-fast-rs" : "epx-wgmma-tma-swap";
        add_row("prefill-v3", name, "flat", m, s5, false, true,
                rel_l2(host_bf16(out4), host_bf16(out), {{0, T}}),
                std::string("EPX_EXPERTS_FP8_PREFILL=") + mode + "; max_rel_error against epx-wgmma");
      }
    }
  }
  // ---- prefill: ExpertMajor with every row of cap 256 valid ----
  {
    const int64_t cap = 256;
    std::vector<uint8_t> q;
    std::vector<float> s;
    random_fp8(L * cap, kH, 41, q, s);
    const Tensor x = dev_from(q.data(), {L, cap, kH}, DType::fp8_e4m3), xs = dev_from(s.data(), {L, cap, kH / 128}, DType::fp32);
    std::vector<int32_t> cnt(static_cast<size_t>(L), static_cast<int32_t>(cap));
    const Tensor rc = dev_from(cnt.data(), {L}, DType::int32);
    Tensor out = Tensor::empty({L, cap, kH}, DType::bf16, Device::cuda(0)), out2 = Tensor::empty({L, cap, kH}, DType::bf16, Device::cuda(0));
    CK(cudaMemset(out.data(), 0xFF, out.nbytes()));
    const ExpertsInput in{ActivationLayout::ExpertMajor, x, xs, rc, {}, {}};
    const Stats st = time_us(stream, iters, [&] { tc->apply(in, out, Stream{stream}); });
    double err = -1;
    if (simt) {
      const Stats s2 = time_us(stream, 3, [&] { simt->apply(in, out2, Stream{stream}); });
      CK(cudaStreamSynchronize(stream));
      err = rel_l2(host_bf16(out), host_bf16(out2), {{0, L * cap}});
      add_row("prefill-v3", "epx-simt", "expert_major", cap, s2, false, false, 0, "");
    }
    add_row("prefill-v3", "epx-wgmma", "expert_major", cap, st, false, simt != nullptr, err, "validated against epx-simt");
    if (rounds > 0) round_cases.push_back({"expert_major", [&tc, stream, in, x, xs, rc, out] { tc->apply(in, out, Stream{stream}); }});
    if (!stamp_flags.empty()) {
      // The stamped mode-17 kernels (results checked against the default output for flags 0), then
      // each ablation; one analysed call per flag set after the timed ones.
      setenv("EPX_EXPERTS_FP8_PREFILL", "17", 1);
      auto t17 = make_experts_cuda(experts, 0);
      unsetenv("EPX_EXPERTS_FP8_PREFILL");
      uint32_t* dbg = nullptr;
      CK(cudaMalloc(&dbg, sizeof(uint32_t) * experts_cuda::kPfDbgWords));
      std::vector<uint32_t> hb(experts_cuda::kPfDbgWords);
      for (uint32_t f : stamp_flags) {
        experts_cuda::set_fp8_prefill_debug(dbg, f);
        CK(cudaMemset(out2.data(), 0xFF, out2.nbytes()));
        const Stats ss = time_us(stream, iters, [&] { t17->apply(in, out2, Stream{stream}); });
        CK(cudaMemsetAsync(dbg, 0, sizeof(uint32_t) * experts_cuda::kPfDbgWords, stream));
        t17->apply(in, out2, Stream{stream});
        CK(cudaStreamSynchronize(stream));
        experts_cuda::set_fp8_prefill_debug(nullptr, 0);
        CK(cudaMemcpy(hb.data(), dbg, sizeof(uint32_t) * hb.size(), cudaMemcpyDeviceToHost));
        const double e = rel_l2(host_bf16(out2), host_bf16(out), {{0, L * cap}});
        const std::string name = "epx-wgmma-mode17-stamped-flags" + std::to_string(f);
        // GEMM_BENCH_STAMPS_RAW=DIR: the raw buffer as DIR/stamps-flags<f>.u32 (layout: experts_fp8_cuda.h)
        if (const char* dir = std::getenv("GEMM_BENCH_STAMPS_RAW"); dir != nullptr && *dir != 0)
          std::ofstream(std::string(dir) + "/stamps-flags" + std::to_string(f) + ".u32", std::ios::binary)
              .write(reinterpret_cast<const char*>(hb.data()), static_cast<std::streamsize>(hb.size() * sizeof(uint32_t)));
        add_row("prefill-v3-stamps", name, "expert_major", cap, ss, false, f == 0, e,
                "set_fp8_prefill_debug flags " + std::to_string(f) +
                    " (1 no loads, 4 no promotions, 8 no weight-tile loads; results wrong unless 0); max_rel_error against epx-wgmma");
        json sj = json::array();
        for (int g = 0; g < 2; ++g) {
          std::string line;
          sj.push_back(analyze_stamps(hb, g, line));
          std::printf("stamps flags %u %s\n", f, line.c_str());
        }
        rows.back()["stamps"] = sj;
        write_json();
      }
      CK(cudaFree(dbg));
    }
    mode_rows(in, out, "expert_major", cap, {x, xs, rc});
    // ---- prefill: Contiguous (rows sorted by expert + cumulative offsets, torch._scaled_grouped_mm's
    // `offs`; gemm_torch.py times torch on this layout with 256 rows per expert) ----
    {
      // (a) the same bytes as the ExpertMajor case: x [L * 256, H], offsets 256 (l + 1); out must equal
      //     the ExpertMajor out byte for byte.
      const TensorView xc(x.data(), DType::fp8_e4m3, {L * cap, kH}, Device::cuda(0)),
          xsc(xs.data(), DType::fp32, {L * cap, kH / 128}, Device::cuda(0));
      std::vector<int32_t> ends(static_cast<size_t>(L));
      for (int64_t l = 0; l < L; ++l) ends[l] = static_cast<int32_t>((l + 1) * cap);
      const Tensor od = dev_from(ends.data(), {L}, DType::int32);
      ExpertsInput ic;
      ic.layout = ActivationLayout::Contiguous;
      ic.x = xc, ic.x_scales = xsc, ic.expert_offsets = od;
      Tensor oc = Tensor::empty({L * cap, kH}, DType::bf16, Device::cuda(0));
      CK(cudaMemset(oc.data(), 0xFF, oc.nbytes()));
      const Stats sc = time_us(stream, iters, [&] { tc->apply(ic, oc, Stream{stream}); });
      CK(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> ocv = host_bf16(oc), emv = host_bf16(out);
      const bool same = ocv == emv;
      add_row("prefill-v3", "epx-wgmma", "contiguous", cap, sc, false, same, same ? 0.0 : rel_l2(ocv, emv, {{0, L * cap}}),
              std::string("Contiguous layout, 256 rows per expert (torch._scaled_grouped_mm's offs in gemm_torch.py); ") +
                  (same ? "byte-identical to" : "DIFFERS from") + " the expert_major row's output of the same rows");
      if (rounds > 0) round_cases.push_back({"contiguous", [&tc, stream, ic, x, xs, od, oc] { tc->apply(ic, oc, Stream{stream}); }});
      // Run-order check (the twelfth session's first run had contiguous 12 % behind ExpertMajor on the same kernels
      // and tiles): ExpertMajor again, then the contiguous row again, timing only.
      {
        Tensor o2 = Tensor::empty({L, cap, kH}, DType::bf16, Device::cuda(0));
        const Stats se2 = time_us(stream, iters, [&] { tc->apply(in, o2, Stream{stream}); });
        add_row("prefill-v3-order", "epx-wgmma", "expert_major", cap, se2, false, false, 0,
                "the expert_major row again, after the contiguous row (run-order check; timing only)");
        const Stats sc2 = time_us(stream, iters, [&] { tc->apply(ic, oc, Stream{stream}); });
        add_row("prefill-v3-order", "epx-wgmma", "contiguous", cap, sc2, false, false, 0,
                "the contiguous row again, after expert_major again (run-order check; timing only)");
        CK(cudaStreamSynchronize(stream));
        // Where the difference comes from: the host's enqueue time per apply (no sync inside the 10 calls) and each
        // layout's apply captured once in a CUDA graph, replayed (no host work between the kernels).
        auto host_us = [&](const std::function<void()>& fn) {
          CK(cudaStreamSynchronize(stream));
          const auto h0 = std::chrono::steady_clock::now();
          for (int i = 0; i < 10; ++i) fn();
          const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count() / 10;
          CK(cudaStreamSynchronize(stream));
          return us;
        };
        const double he = host_us([&] { tc->apply(in, o2, Stream{stream}); });
        const double hc = host_us([&] { tc->apply(ic, oc, Stream{stream}); });
        std::printf("host enqueue per apply: expert_major %.1f us, contiguous %.1f us\n", he, hc);
        for (int which = 0; which < 2; ++which) {
          cudaGraph_t g;
          cudaGraphExec_t ge;
          CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          if (which == 0) tc->apply(in, o2, Stream{stream});
          else tc->apply(ic, oc, Stream{stream});
          CK(cudaStreamEndCapture(stream, &g));
          CK(cudaGraphInstantiate(&ge, g, 0));
          const Stats sg = time_us(stream, iters, [&] { CK(cudaGraphLaunch(ge, stream)); });
          add_row("prefill-v3-order", "epx-wgmma-graph", which == 0 ? "expert_major" : "contiguous", cap, sg, false, false, 0,
                  std::string("one apply captured in a CUDA graph, replayed (timing only); host enqueue per eager apply ") +
                      std::to_string(which == 0 ? he : hc) + " us");
          CK(cudaGraphExecDestroy(ge));
          CK(cudaGraphDestroy(g));
        }
      }
      // (b) uneven experts, the same L * 256 rows: counts drawn around 256 (0 .. 512), so expert boundaries
      //     fall inside 128-row tiles; validated byte for byte against ExpertMajor of the same rows (cap 512).
      // Pairs of experts (2j, 2j + 1) get 256 + d and 256 - d rows, d = 16 ((7 j + 3) mod 33 - 16) in [-256, 256]
      // (multiples of 16, which torch's FP8 grouped GEMM may need; gemm_torch.py --uneven uses the same formula):
      // the total stays L * 256.
      std::vector<int32_t> cnt2(static_cast<size_t>(L), static_cast<int32_t>(cap));
      for (int64_t l = 0; l + 1 < L; l += 2) {
        const int32_t d = static_cast<int32_t>(16 * ((7 * (l / 2) + 3) % 33 - 16));
        cnt2[l] += d, cnt2[l + 1] -= d;
      }
      for (int64_t l = 0, e = 0; l < L; ++l) ends[l] = static_cast<int32_t>(e += cnt2[l]);
      const Tensor od2 = dev_from(ends.data(), {L}, DType::int32);
      ExpertsInput iu = ic;
      iu.expert_offsets = od2;
      Tensor ouv = Tensor::empty({L * cap, kH}, DType::bf16, Device::cuda(0));
      CK(cudaMemset(ouv.data(), 0xFF, ouv.nbytes()));
      const Stats su = time_us(stream, iters, [&] { tc->apply(iu, ouv, Stream{stream}); });
      CK(cudaStreamSynchronize(stream));
      const int64_t cap2 = 2 * cap;
      Tensor xe = Tensor::empty({L, cap2, kH}, DType::fp8_e4m3, Device::cuda(0)), xse = Tensor::empty({L, cap2, kH / 128}, DType::fp32, Device::cuda(0));
      Tensor oe = Tensor::empty({L, cap2, kH}, DType::bf16, Device::cuda(0));
      for (int64_t l = 0, b = 0; l < L; b += cnt2[l++]) {
        CK(cudaMemcpyAsync(static_cast<uint8_t*>(xe.data()) + l * cap2 * kH, static_cast<const uint8_t*>(x.data()) + b * kH,
                           static_cast<size_t>(cnt2[l] * kH), cudaMemcpyDeviceToDevice, stream));
        CK(cudaMemcpyAsync(static_cast<float*>(xse.data()) + l * cap2 * (kH / 128), static_cast<const float*>(xs.data()) + b * (kH / 128),
                           static_cast<size_t>(cnt2[l] * (kH / 128) * 4), cudaMemcpyDeviceToDevice, stream));
      }
      const Tensor rc2 = dev_from(cnt2.data(), {L}, DType::int32);
      tc->apply({ActivationLayout::ExpertMajor, xe, xse, rc2, {}, {}}, oe, Stream{stream});
      CK(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> ou = host_bf16(ouv), oev = host_bf16(oe);
      int64_t differ = 0;
      for (int64_t l = 0, b = 0; l < L; b += cnt2[l++])
        differ += !std::equal(ou.begin() + b * kH, ou.begin() + (b + cnt2[l]) * kH, oev.begin() + l * cap2 * kH);
      int32_t cmin = cnt2[0], cmax = cnt2[0];
      for (int32_t c : cnt2) cmin = std::min(cmin, c), cmax = std::max(cmax, c);
      add_row("prefill-v3-uneven", "epx-wgmma", "contiguous", cap, su, false, differ == 0, differ == 0 ? 0.0 : 1.0,
              "Contiguous layout, L * 256 rows in uneven experts (" + std::to_string(cmin) + " .. " + std::to_string(cmax) +
                  " rows, gemm_torch.py --uneven's counts); rows_per_expert is the mean; " +
                  (differ == 0 ? "byte-identical to ExpertMajor of the same rows"
                               : std::to_string(differ) + " experts DIFFER from ExpertMajor of the same rows"));
      if (rounds > 0) round_cases.push_back({"contiguous-uneven", [&tc, stream, iu, x, xs, od2, ouv] { tc->apply(iu, ouv, Stream{stream}); }});
      mode_rows(ic, oc, "contiguous", cap, {x, xs, od});
      mode_rows(iu, ouv, "contiguous-uneven", cap, {x, xs, od2});
    }
    if (tc64) {
      Tensor out4 = Tensor::empty({L, cap, kH}, DType::bf16, Device::cuda(0));
      CK(cudaMemset(out4.data(), 0xFF, out4.nbytes()));
      const Stats s4 = time_us(stream, iters, [&] { tc64->apply(in, out4, Stream{stream}); });
      CK(cudaStreamSynchronize(stream));
      add_row("prefill-v3", "epx-wgmma-64", "expert_major", cap, s4, false, true,
              rel_l2(host_bf16(out), host_bf16(out4), {{0, L * cap}}),
              "EPX_EXPERTS_FP8_PREFILL=0 (64-row kernels only); max_rel_error = epx-wgmma (prefill kernels) against this");
      // Early scales / release, bulk stores and A in registers (=17) and the TMA loads (=10).
      struct Variant {
        const char *env, *value, *backend;
      };
      for (const Variant& v : {Variant{"EPX_EXPERTS_FP8_PREFILL", "17", "epx-wgmma-fast-rs"},
                               Variant{"EPX_EXPERTS_FP8_PREFILL", "10", "epx-wgmma-tma-swap"}}) {
        if (!do_variants || !modes.empty()) break;
        setenv(v.env, v.value, 1);
        auto tcs = make_experts_cuda(experts, 0);
        unsetenv(v.env);
        CK(cudaMemset(out4.data(), 0xFF, out4.nbytes()));
        const Stats s5 = time_us(stream, iters, [&] { tcs->apply(in, out4, Stream{stream}); });
        CK(cudaStreamSynchronize(stream));
        add_row("prefill-v3", v.backend, "expert_major", cap, s5, false, true, rel_l2(host_bf16(out4), host_bf16(out), {{0, L * cap}}),
                std::string(v.env) + "=" + v.value + "; max_rel_error against epx-wgmma");
      }
    }
  }
  // ---- --rounds: the layouts again, interleaved ----
  if (rounds > 0 && !round_cases.empty()) {
    const size_t n = round_cases.size();
    std::vector<std::vector<double>> p50(n);
    for (int r = 0; r < rounds; ++r)
      for (size_t j = 0; j < n; ++j) {  // round r starts at case r % n: each case runs first, last, in between
        const size_t c = (j + static_cast<size_t>(r)) % n;
        p50[c].push_back(time_us(stream, iters, round_cases[c].second).p50);
      }
    for (size_t c = 0; c < n; ++c) {
      std::vector<double> v = p50[c];
      std::sort(v.begin(), v.end());
      const Stats st{v.front(), v[v.size() / 2], v.back()};
      add_row("prefill-v3-rounds", "epx-wgmma", round_cases[c].first, 256, st, false, false, 0,
              "median over " + std::to_string(rounds) + " interleaved rounds of each round's p50 (p10 / p90 fields: the "
              "min / max over the rounds); outputs validated by the rows above; round_p50_us: each round's p50, in round order "
              "(paired comparisons round by round)");
      rows.back()["round_p50_us"] = p50[c];
      write_json();
    }
  }
  round_cases.clear();
  mode_objects.clear();
  tc.reset();
  tc64.reset();
  simt.reset();

  // ---- cuBLASLt per-expert loop ----
  if (do_cublas) {
    std::vector<uint8_t> w13h, w2h, junk;
    std::vector<float> js;
    random_fp8(2 * kI, kH, 51, w13h, js);
    random_fp8(kH, kI, 52, w2h, js);
    std::vector<Tensor> w13, w2;
    for (int l = 0; l < L; ++l) {
      w13.push_back(dev_from(w13h.data(), {2 * kI, kH}, DType::fp8_e4m3));
      w2.push_back(dev_from(w2h.data(), {kH, kI}, DType::fp8_e4m3));
    }
    for (int64_t m : {int64_t{8}, int64_t{256}}) {
      if (prefill_only && m == 8) continue;
      random_fp8(L * m, kH, 61, junk, js);
      const Tensor x = dev_from(junk.data(), {L * m, kH}, DType::fp8_e4m3);
      random_fp8(L * m, kI, 62, junk, js);
      const Tensor h = dev_from(junk.data(), {L * m, kI}, DType::fp8_e4m3);
      Tensor gu = Tensor::empty({L * m, 2 * kI}, DType::bf16, Device::cuda(0)), y = Tensor::empty({L * m, kH}, DType::bf16, Device::cuda(0));
      LtGemm g1(lt, m, 2 * kI, kH, lt_ws, lt_ws_bytes), g2(lt, m, kH, kI, lt_ws, lt_ws_bytes);
      if (!g1.ok || !g2.ok) continue;
      const Stats st = time_us(stream, std::max(3, iters / 2), [&] {
        for (int l = 0; l < L; ++l) {
          g1.run(static_cast<const uint8_t*>(x.data()) + l * m * kH, w13[l].data(), static_cast<uint16_t*>(gu.data()) + l * m * 2 * kI, stream);
          g2.run(static_cast<const uint8_t*>(h.data()) + l * m * kI, w2[l].data(), static_cast<uint16_t*>(y.data()) + l * m * kH, stream);
        }
      });
      add_row(m == 8 ? "decode-v3" : "prefill-v3", "cublaslt-loop", "per-expert", m, st, m == 8, false, 0,
              "cuBLASLt FP8 e4m3 per-tensor scales 1.0 (not 128x128 blocks), bf16 out, 2 GEMMs per expert, eager loop; "
              "GEMMs only (no SiLU, no requantization)");
    }
  }
  cublasLtDestroy(lt);
  CK(cudaFree(lt_ws));

  write_json();
  if (!json_path.empty()) std::printf("wrote %s\n", json_path.c_str());
  CK(cudaStreamDestroy(stream));
  return 0;
}
