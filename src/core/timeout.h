// core/timeout.h: the one rule for timeout_s arguments (Config::timeout_s, groups, rendezvous, ll).
#pragma once

#include <string_view>

#include "epx/error.h"

namespace epx {

/// The longest timeout_s anything accepts [s] (about 31 years): deadlines are kept in int64
/// nanoseconds (std::chrono::steady_clock, the kernels' globaltimer), which a larger value
/// overflows (1e10 s wrapped the deadline into the past: an immediate Timeout).
inline constexpr double kMaxTimeoutS = 1e9;

/// Throws InvalidArgument "<op>: <arg> = <value>: <rule>" unless 0 < timeout_s <= kMaxTimeoutS
/// (NaN and infinity are refused too).
inline void require_timeout(std::string_view op, std::string_view arg, double timeout_s) {
  require_arg(op, arg, timeout_s, timeout_s > 0 && timeout_s <= kMaxTimeoutS,
              "must be > 0 and at most 1e9 s (finite: deadlines are int64 nanoseconds)");
}

}  // namespace epx
