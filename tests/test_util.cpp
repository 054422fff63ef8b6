#include "test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <cmath>
#include <cstring>

#include "epx/error.h"

namespace epx::test {

Tensor random_bf16(int64_t rows, int64_t cols, uint64_t seed, float scale) {
  Tensor t = Tensor::empty({rows, cols}, DType::bf16);
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.0f, scale);
  auto* p = t.ptr<uint16_t>();
  for (int64_t i = 0; i < rows * cols; ++i) {
    float v = n(g);
    if (v == 0.0f) v = scale * 1e-3f;
    p[i] = float_to_bf16_bits(v);
  }
  return t;
}

Tensor random_f32(int64_t rows, int64_t cols, uint64_t seed, float scale) {
  Tensor t = Tensor::empty({rows, cols}, DType::fp32);
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.0f, scale);
  auto* p = t.ptr<float>();
  for (int64_t i = 0; i < rows * cols; ++i) p[i] = n(g);
  return t;
}

void random_routing(int64_t T, int K, int E, uint64_t seed, const RoutingOptions& opt, Tensor& topk_idx, Tensor& topk_weights) {
  topk_idx = Tensor::empty({T, K}, DType::int32);
  topk_weights = Tensor::empty({T, K}, DType::fp32);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> cdf(E);
  double acc = 0;
  for (int e = 0; e < E; ++e) {
    acc += opt.zipf_s > 0 ? 1.0 / std::pow(e + 1.0, opt.zipf_s) : 1.0;
    cdf[e] = acc;
  }
  // Permute popularity so hot experts are spread across ranks.
  std::vector<int> perm(E);
  for (int e = 0; e < E; ++e) perm[e] = e;
  std::shuffle(perm.begin(), perm.end(), g);
  auto draw = [&] {
    double x = u(g) * acc;
    int e = static_cast<int>(std::lower_bound(cdf.begin(), cdf.end(), x) - cdf.begin());
    return perm[std::min(e, E - 1)];
  };
  auto* idx = topk_idx.ptr<int32_t>();
  auto* w = topk_weights.ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> chosen;
    for (int k = 0; k < K; ++k) {
      int e = draw();
      if (!opt.allow_duplicates && K <= E) {
        int guard = 0;
        while (std::find(chosen.begin(), chosen.end(), e) != chosen.end()) {
          e = (++guard > 64) ? (e + 1) % E : draw();
        }
      }
      chosen.push_back(e);
      idx[t * K + k] = e;
      w[t * K + k] = static_cast<float>(0.05 + u(g));
      if (opt.masked_fraction > 0 && u(g) < opt.masked_fraction) idx[t * K + k] = -1;
    }
  }
}

std::vector<float> to_float(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  EPX_ASSERT(t.device.is_cpu() && t.is_contiguous());
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype) {
      case DType::bf16: out[i] = bf16_bits_to_float(t.ptr<uint16_t>()[i]); break;
      case DType::fp32: out[i] = t.ptr<float>()[i]; break;
      case DType::fp16: out[i] = fp16_bits_to_float(t.ptr<uint16_t>()[i]); break;
      case DType::fp8_e4m3: out[i] = fp8_e4m3_bits_to_float(t.ptr<uint8_t>()[i]); break;
      default: EPX_ASSERT(false, "to_float: dtype ", dtype_name(t.dtype));
    }
  }
  return out;
}

double max_rel_error(const TensorView& a, const TensorView& b) {
  EPX_ASSERT(a.numel() == b.numel(), a.numel(), " vs ", b.numel());
  auto fa = to_float(a), fb = to_float(b);
  double num = 0, den = 0;
  for (size_t i = 0; i < fa.size(); ++i) {
    double d = std::fabs(static_cast<double>(fa[i]) - fb[i]);
    if (std::isnan(d)) return INFINITY;
    num = std::max(num, d);
    den = std::max(den, std::fabs(static_cast<double>(fb[i])));
  }
  return num / std::max(den, 1e-30);
}

double rel_l2_error(const TensorView& a, const TensorView& b) {
  EPX_ASSERT(a.numel() == b.numel(), a.numel(), " vs ", b.numel());
  auto fa = to_float(a), fb = to_float(b);
  double num = 0, den = 0;
  for (size_t i = 0; i < fa.size(); ++i) {
    double d = static_cast<double>(fa[i]) - fb[i];
    if (std::isnan(d)) return INFINITY;
    num += d * d;
    den += static_cast<double>(fb[i]) * fb[i];
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

void poison(const TensorView& t) {
  EPX_ASSERT(t.device.is_cpu());
  std::memset(t.data, 0xFF, static_cast<size_t>(t.nbytes()));
}

CommandResult run_command(const std::string& command, bool capture_stderr) {
  static std::atomic<int> counter{0};
  const std::filesystem::path err_file =
      std::filesystem::temp_directory_path() /
      ("epx_test_stderr_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".txt");
  CommandResult r;
  FILE* p = ::popen((capture_stderr ? command + " 2>" + err_file.string() : command).c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (capture_stderr) {
    std::ifstream f(err_file);
    std::stringstream ss;
    ss << f.rdbuf();
    r.err = ss.str();
    std::filesystem::remove(err_file);
  }
  return r;
}

int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  return ok ? ntohs(a.sin_port) : -1;
}

}  // namespace epx::test
