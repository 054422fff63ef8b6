// tools/epx/moe_report.h: printing and saving what `epx moe` measured (RESULTS.md JSON).
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "moe_run.h"

namespace epx::cli {

/// One line naming the model, ranks, steps, routing, wire dtype, shared mode, chunk and device.
void print_header(std::ostream& os, const Workload& workload);
/// The table: backend, tokens/rank, per-step latency p50/p90/p99 [ms], max rel error, rel L2,
/// pass/FAIL, shared fused/separate chunk counters; then each failure's reason and "N/M pass".
void print_table(std::ostream& os, const Workload& workload, const std::vector<BackendResult>& results);
/// Writes the RESULTS.md document (tool "epx moe", one result per backend) to `path`
/// (parent folders created). Throws InvalidArgument when it cannot be written.
void write_results_json(const std::string& path, const std::string& command, const Workload& workload,
                        const std::vector<BackendResult>& results);

/// Short commit of the repository the binary was built in (or the working directory), with
/// "-dirty" for uncommitted tracked changes; "unknown" without git.
std::string git_commit();
/// "epx <args...>" with shell quoting, for the JSON "command" and the repro line.
std::string command_line(int argc, char** argv);
/// "cpu (N threads)".
std::string cpu_device_name();

}  // namespace epx::cli
