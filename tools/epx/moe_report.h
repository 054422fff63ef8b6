// tools/epx/moe_report.h: printing and saving what `epx moe` measured (RESULTS.md JSON).
#pragma once

#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "moe_run.h"

namespace epx::cli {

/// One line naming the model, ranks, steps, routing, wire dtype, shared mode, chunk and device.
void print_header(std::ostream& os, const Workload& workload);
/// The table: run (backend [shared mode]), tokens/rank, graph, per-step latency p25/p50/p75/p99 and
/// mean [ms], tokens/s, rel L2, pass/FAIL, path counters (shared fused/separate/sharded chunks,
/// graph replays); then each failure's and each graph refusal's reason, "N/M pass", and with
/// --compare the delta tables.
void print_table(std::ostream& os, const Workload& workload, const std::vector<BackendResult>& results);
/// --compare: the delta tables (backends against the first one, fused against separate shared
/// expert per backend, with the counters that prove which path ran). print_table calls it.
void print_compare(std::ostream& os, const Workload& workload, const std::vector<BackendResult>& results);
/// Writes the RESULTS.md document (tool "epx moe", one result per backend) to `path`
/// (parent folders created). Throws InvalidArgument when it cannot be written.
void write_results_json(const std::string& path, const std::string& command, const Workload& workload,
                        const std::vector<BackendResult>& results);

/// Short commit of the repository the binary was built in (or the working directory), with
/// "-dirty" for uncommitted tracked changes; "unknown" without git.
std::string git_commit();
/// "epx <args...>" with shell quoting, for the JSON "command" and the repro line.
std::string command_line(int argc, char** argv);
/// "virtual ranks: R on one GPU (timings measure one GPU's memory, not NVLink)": the header line of a
/// GPU run whose R ranks are threads on one GPU (make_virtual_cuda_groups).
std::string virtual_ranks_note(int ranks);
/// "cpu (N threads)".
std::string cpu_device_name();
/// The JSON "node_layout" of a run (RESULTS.md; issue 11): num_nodes, ranks_per_node (0 when
/// uneven), node_of_rank, describe ("2 nodes x 1 rank"), nccl_lsa_size (NCCL's LSA team on rank 0's
/// node; for CPU threads the node itself), path ("single-node" or "multi-node: ...") and the NCCL
/// variables that decide it (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE, NCCL_HOSTID; null when unset).
nlohmann::ordered_json node_layout_json(const NodeLayout& layout);

}  // namespace epx::cli
