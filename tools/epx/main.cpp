// tools/epx/main.cpp: the `epx` CLI entry point (subcommands: moe, bench, trace, info).
//
// Exit status: 0 success; 1 a validation failure or runtime error; 2 a bad flag or inconsistent
// shapes. Errors print as one line on stderr, "epx: error: <sentence>".
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>

#include "commands.h"
#include "epx/error.h"
#include "moe_report.h"

namespace {
// One line, whatever the message holds.
std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace epx::cli;
  // `--device cuda --ranks R` on fewer GPUs runs virtual ranks, which need eager kernel loading
  // (make_virtual_cuda_groups); set before CUDA starts, unless the caller chose a mode.
  ::setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  CLI::App app{"epx: expert-parallel MoE runtime (CPU reference; CUDA when built with it)", "epx"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("epx ") + EPX_VERSION);
  MoeCommand moe;
  BenchCommand bench;
  TraceCommand trace;
  InfoCommand info;
  add_moe_command(app, moe);
  add_bench_command(app, bench);
  add_trace_command(app, trace);
  add_info_command(app, info);
  if (argc > 1 && argv[1][0] != '-') {
    // CLI11 reports an unknown first word as "A subcommand is required", as if none had been given.
    std::string names;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      known = known || sub->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::cerr << "epx: error: " << argv[1] << ": not a subcommand; one of " << names << " (see epx --help)\n";
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "epx: error: " << one_line(e.what()) << " (see epx --help)\n";
    return 2;
  }
  try {
    if (moe.app->parsed()) return run_moe(moe, command_line(argc, argv));
    if (bench.app->parsed()) return run_bench(bench, command_line(argc, argv));
    if (trace.app->parsed()) return run_trace(trace);
    if (info.app->parsed()) return run_info(info);
    return 2;
  } catch (const epx::InvalidArgument& e) {
    std::cerr << "epx: error: " << one_line(e.what()) << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "epx: error: " << one_line(e.what()) << "\n";
    return 1;
  }
}
