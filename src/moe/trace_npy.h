// src/moe/trace_npy.h: the directory form of a trace (manifest.json + .npy files), used by trace.cpp.
#pragma once

#include <string>

#include "epx/trace.h"

namespace epx::detail {
/// Reads <dir>/manifest.json and the .npy files it names; validates. Throws InvalidArgument.
Trace load_trace_dir(const std::string& dir);
/// Creates `dir` if needed and writes manifest.json + s<step>_r<rank>.<tensor>.npy files.
void save_trace_dir(const Trace& trace, const std::string& dir);
}  // namespace epx::detail
