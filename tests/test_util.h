// tests/test_util.h: fixtures shared by the gtest suites (random inputs, routing cases, comparisons).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/tensor.h"

namespace epx::test {

/// Sets (value != nullptr) or unsets an environment variable for this scope and, at its end, restores what the
/// process had before (the old value, or unset), so a test's A/B settings (EPX_EXPERTS_*: Config::load reads them
/// when an object is made) never erase a value given to the whole run from outside. set() changes it again inside
/// the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    set(value);
  }
  ~ScopedEnv() { set(had_ ? old_.c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  void set(const char* value) const {
    if (value) ::setenv(name_.c_str(), value, 1);
    else ::unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

/// [rows, cols] bf16 with N(0, scale^2) values from `seed` (never zeros).
Tensor random_bf16(int64_t rows, int64_t cols, uint64_t seed, float scale = 1.0f);
/// [rows, cols] fp32 N(0, scale^2).
Tensor random_f32(int64_t rows, int64_t cols, uint64_t seed, float scale = 1.0f);

struct RoutingOptions {
  double masked_fraction = 0.0;  ///< share of entries set to -1
  bool allow_duplicates = false; ///< a token may pick the same expert twice
  double zipf_s = 0.0;           ///< 0 = uniform; > 0 Zipf popularity exponent
};
/// topk_idx [T, K] int32 and topk_weights [T, K] fp32 (positive, not normalised) from `seed`.
void random_routing(int64_t T, int K, int E, uint64_t seed, const RoutingOptions& opt, Tensor& topk_idx, Tensor& topk_weights);

/// Tensor of bf16/fp32 values as float vector.
std::vector<float> to_float(const TensorView& t);
/// max |a - b| / max(max |b|, tiny): normwise relative error.
double max_rel_error(const TensorView& a, const TensorView& b);
/// ||a - b||_2 / ||b||_2 (METHOD.md: bf16 operands land between 1e-3 and 1e-2; NaN never passes).
double rel_l2_error(const TensorView& a, const TensorView& b);
/// Fills a tensor's bytes with a poison pattern (0xFF: NaN in bf16/fp32/fp8).
void poison(const TensorView& t);

/// The message of the epx::InvalidArgument that `fn()` throws, or "no InvalidArgument" when it throws none.
template <class Fn>
std::string invalid_argument_message(Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no InvalidArgument";
}

/// What a shell command printed and how it ended.
struct CommandResult {
  int code = -1;    ///< exit status; -1 when the command could not start or did not exit normally
  std::string out;  ///< stdout (and stderr where the command redirects it, e.g. "2>&1")
  std::string err;  ///< stderr, when `capture_stderr` (else it goes where the command sends it)
};
/// Runs `command` through /bin/sh (popen). With `capture_stderr`, stderr goes to a temporary file
/// that is read into `err` and removed.
CommandResult run_command(const std::string& command, bool capture_stderr = false);

/// A TCP port on 127.0.0.1 that nobody listens on right now (bind to port 0, read it back, close),
/// or -1 if the socket calls fail. Racy in principle: another process could take the port before
/// the caller binds it (the test then fails loudly).
int free_tcp_port();

}  // namespace epx::test
