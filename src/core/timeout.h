// core/timeout.h: the one rule for timeout_s arguments (Config::timeout_s, groups, rendezvous, ll).
#pragma once

#include <string_view>

#include "epx/error.h"

namespace epx {

/// The longest timeout_s anything accepts [s] (about 31 years): deadlines are kept in int64
/// nanoseconds (std::chrono::steady_clock, the kernels' globaltimer), which a larger value
/// overflows (1e10 s wrapped the deadline into the past: an immediate Timeout).
inline constexpr double kMaxTimeoutS = 1e9;

/// The shortest timeout_s anything accepts [s]: a wait on a peer must outlast one step of the peer (a host
/// wake-up, a kernel launch, an NCCL round trip: microseconds to milliseconds), so a smaller value is a timeout
/// that cannot be met (1e-300 s would be a 0 ns deadline: every wait would time out at once).
inline constexpr double kMinTimeoutS = 1e-3;

/// Throws InvalidArgument "<op>: <arg> = <value>: <rule>" unless kMinTimeoutS <= timeout_s <= kMaxTimeoutS
/// (NaN and infinity are refused too).
inline void require_timeout(std::string_view op, std::string_view arg, double timeout_s) {
  require_arg(op, arg, timeout_s, timeout_s >= kMinTimeoutS && timeout_s <= kMaxTimeoutS,
              "must be at least 0.001 s (a shorter wait cannot outlast one step of a peer) and at most 1e9 s "
              "(deadlines are int64 nanoseconds)");
}

}  // namespace epx
