// tools/epx/validators.h: CLI11 validators for numeric flags whose failure reads as the rule
// ("--chunk-size: -1: must be >= 0") instead of CLI11's NonNegativeNumber / PositiveNumber text
// ("Value -1 not in range 0.000000 to " followed by DBL_MAX in 309 digits).
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <string>

namespace epx::cli {

/// A number >= 0 (CLI::NonNegativeNumber's rule).
inline CLI::Validator non_negative_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v)) return s + ": must be a number";
        return v >= 0 ? std::string() : s + ": must be >= 0";
      },
      "NONNEGATIVE");
}

/// A finite number > 0 (CLI::PositiveNumber's rule, without infinity).
inline CLI::Validator positive_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v)) return s + ": must be a number";
        return v > 0 && std::isfinite(v) ? std::string() : s + ": must be a finite number > 0";
      },
      "POSITIVE");
}

}  // namespace epx::cli
