// tools/epx/commands.h: the `epx` subcommands. Each add_* registers its flags on the CLI11 app;
// each run_* returns the process exit code: 0 success (every backend passed), 1 a validation
// failure or a runtime error, 2 a bad flag or inconsistent shapes (thrown as InvalidArgument and
// turned into one line by main.cpp).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "bench_run.h"
#include "moe_run.h"

namespace epx::cli {

struct MoeCommand {
  CLI::App* app = nullptr;
  MoeOptions options;
  CLI::Option *ranks = nullptr, *tokens = nullptr, *steps = nullptr, *routing = nullptr, *shared = nullptr;
};
void add_moe_command(CLI::App& root, MoeCommand& cmd);
/// `command` is the full command line, recorded in the JSON and printed as the repro line.
int run_moe(MoeCommand& cmd, const std::string& command);

struct BenchCommand {
  CLI::App* app = nullptr;
  BenchOptions options;
};
void add_bench_command(CLI::App& root, BenchCommand& cmd);
int run_bench(BenchCommand& cmd, const std::string& command);

struct TraceCommand {
  CLI::App* app = nullptr;
  CLI::App* import_app = nullptr;
  CLI::App* show_app = nullptr;
  std::string input, output;
  int ranks = 0, skip_passes = 2, num_experts = 0;
  int64_t max_tokens_per_step = 0;
};
void add_trace_command(CLI::App& root, TraceCommand& cmd);
int run_trace(TraceCommand& cmd);

struct InfoCommand {
  CLI::App* app = nullptr;
  std::string config;
  bool backends_only = false;
  CLI::Option* knobs = nullptr;  ///< --knobs [PREFIX] given
  std::string knobs_prefix;
};
void add_info_command(CLI::App& root, InfoCommand& cmd);
int run_info(InfoCommand& cmd);

}  // namespace epx::cli
