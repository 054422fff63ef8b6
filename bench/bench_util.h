// bench/bench_util.h: what the one-GPU benchmarks (gemm_bench.cpp, gemm_mxfp4_bench.cpp) share:
// a fatal CUDA check, CUDA-event timing, random FP8 inputs, host <-> device copies, the UTC stamp of
// the RESULTS.md JSON. Header-only; benchmark code, not part of the library.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "epx/dtype.h"
#include "epx/tensor.h"

/// Exits with status 2 naming the call, the CUDA error and file:line when a CUDA runtime call fails.
#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s: %s at %s:%d\n", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

namespace epx::bench {

/// Percentiles of one timed call [microseconds].
struct Stats {
  double p10 = 0, p50 = 0, p90 = 0;
};

/// fn() timed with CUDA events on stream s: 3 warm-up calls, then `iters` calls each between its own
/// event pair; p10 / p50 / p90 of the per-call times (nearest rank).
inline Stats time_us(cudaStream_t s, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < 3; ++i) fn();
  CK(cudaStreamSynchronize(s));
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(iters));
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(ev[2 * i], s));
    fn();
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us.push_back(ms * 1e3);
  }
  for (auto& e : ev) CK(cudaEventDestroy(e));
  std::sort(us.begin(), us.end());
  auto at = [&](double q) { return us[std::min<size_t>(us.size() - 1, static_cast<size_t>(q * (us.size() - 1) + 0.5))]; };
  return {at(0.1), at(0.5), at(0.9)};
}

/// Random FP8 e4m3 codes of N(0, 1) * 64 values (|v| < 448, never NaN) and scales ~1/64 per 128
/// consecutive codes: q [rows * cols], s [rows * cols / 128].
inline void random_fp8(int64_t rows, int64_t cols, uint64_t seed, std::vector<uint8_t>& q, std::vector<float>& s) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  q.resize(static_cast<size_t>(rows * cols));
  s.resize(static_cast<size_t>(rows * cols / 128));
  for (auto& b : q) b = float_to_fp8_e4m3_bits(std::clamp(nd(rng), -6.9f, 6.9f) * 64.0f);
  for (auto& v : s) v = (0.75f + 0.5f * std::uniform_real_distribution<float>(0, 1)(rng)) / 64.0f;
}

/// A tensor on CUDA device 0 holding a copy of the host bytes at src.
inline Tensor dev_from(const void* src, std::vector<int64_t> shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt, Device::cuda(0));
  CK(cudaMemcpy(t.data(), src, t.nbytes(), cudaMemcpyHostToDevice));
  return t;
}

/// The bf16 bit patterns of a device tensor, copied to the host.
inline std::vector<uint16_t> host_bf16(const Tensor& t) {
  std::vector<uint16_t> h(static_cast<size_t>(t.nbytes() / 2));
  CK(cudaMemcpy(h.data(), t.data(), t.nbytes(), cudaMemcpyDeviceToHost));
  return h;
}

/// Now as "YYYY-MM-DDTHH:MM:SSZ" (the JSON's date).
/// Selects GPU 0 and makes a non-blocking stream for a benchmark; prints "<name>: no CUDA device"
/// and returns false when there is none.
inline bool open_bench_device(const char* name, cudaDeviceProp& prop, cudaStream_t& stream) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1) {
    std::fprintf(stderr, "%s: no CUDA device\n", name);
    return false;
  }
  CK(cudaSetDevice(0));
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return true;
}

inline std::string utc_now() {
  char buf[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

}  // namespace epx::bench
