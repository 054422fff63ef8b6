// epx/error.h: the exceptions every public call throws, and the argument checks that build them.
//
// Message form (STYLE.md §4), always one sentence:
//   "<op>: <argument> = <value>: <rule> [(<hint>)]"
//   e.g. "ll.prepare: num_tokens = 300: must be <= num_max_dispatch_tokens_per_rank = 256"
// Library code never aborts: user errors throw InvalidArgument/Unsupported, peer silence throws
// Timeout, transport failures CommError, CUDA failures CudaError. Internal invariants use
// EPX_ASSERT, which prints the values involved and throws Error.
#pragma once

#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace epx {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// A caller's argument breaks a documented rule (shape, dtype, range, capacity).
class InvalidArgument : public Error { public: using Error::Error; };
/// The combination is valid in general but this backend/device cannot run it.
class Unsupported : public Error { public: using Error::Error; };
/// A wait on a peer rank exceeded timeout_s.
class Timeout : public Error { public: using Error::Error; };
/// A collective or transport failed, or ranks disagree on the configuration.
class CommError : public Error { public: using Error::Error; };
/// A CUDA / NCCL runtime call failed.
class CudaError : public Error { public: using Error::Error; };

namespace detail {
template <class V>
std::string to_text(const V& v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<V, bool>) os << (v ? "true" : "false");
  else os << v;
  return os.str();
}
[[noreturn]] void throw_assert(const char* cond, const std::string& values, std::source_location loc);
}  // namespace detail

/// Builds the one-sentence message "<op>: <arg> = <value>: <rule>".
template <class V>
std::string arg_message(std::string_view op, std::string_view arg, const V& value, std::string_view rule) {
  std::string m;
  m.append(op).append(": ").append(arg).append(" = ").append(detail::to_text(value)).append(": ").append(rule);
  return m;
}

/// Throws InvalidArgument("<op>: <arg> = <value>: <rule>") unless `ok`.
template <class V>
void require_arg(std::string_view op, std::string_view arg, const V& value, bool ok, std::string_view rule) {
  if (!ok) throw InvalidArgument(arg_message(op, arg, value, rule));
}

}  // namespace epx

/// Internal invariant; on failure throws epx::Error naming the condition, the values and file:line.
/// Usage: EPX_ASSERT(a == b, "a=", a, " b=", b);
#define EPX_ASSERT(cond, ...)                                                                       \
  do {                                                                                              \
    if (!(cond)) {                                                                                  \
      std::ostringstream epx_assert_os_;                                                            \
      ::epx::detail::assert_values(epx_assert_os_ __VA_OPT__(, ) __VA_ARGS__);                      \
      ::epx::detail::throw_assert(#cond, epx_assert_os_.str(), std::source_location::current());    \
    }                                                                                               \
  } while (0)

namespace epx::detail {
inline void assert_values(std::ostringstream&) {}
template <class... A>
void assert_values(std::ostringstream& os, const A&... a) { (os << ... << a); }
}  // namespace epx::detail
