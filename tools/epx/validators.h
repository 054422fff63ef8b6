// tools/epx/validators.h: CLI11 validators for numeric flags whose failure reads as the rule
// ("--chunk-size: -1: must be >= 0") instead of CLI11's NonNegativeNumber / PositiveNumber text
// ("Value -1 not in range 0.000000 to " followed by DBL_MAX in 309 digits), and the up-front check of
// an output path.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "epx/error.h"

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

/// --json PATH of moe / bench: refused before the run when it cannot be written (found only when the
/// results were written, a whole run later, it lost them). Makes the parent directories as the writers do;
/// a file this check creates is removed again, an existing one is opened for append (not truncated).
/// Throws InvalidArgument "<op>: --json = PATH: must be a writable file path" (exit status 2).
inline void require_writable_json(std::string_view op, const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  bool ok = false;
  {
    std::ofstream f(path, std::ios::app);
    ok = f.good();
  }
  if (ok && !existed) std::filesystem::remove(path, ec);
  require_arg(op, "--json", path, ok, "must be a writable file path");
}

}  // namespace epx::cli
