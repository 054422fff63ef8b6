// tools/epx/cmd_info.cpp: `epx info`: version, devices (with a CUDA build: NCCL library and header
// versions, GPU names and the peer/NVLink matrix), the effective Config with each value's source, the dispatch backends with their capabilities, and the model presets.
#include <cstdlib>
#include <iomanip>
#include <iostream>

#include "commands.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/group.h"
#include "epx/moe.h"
#include "moe_cuda_run.h"
#include "moe_report.h"

namespace epx::cli {

void add_info_command(CLI::App& root, InfoCommand& cmd) {
  cmd.app = root.add_subcommand("info", "Print version, devices, effective configuration, backends and presets");
  cmd.app->add_option("--config", cmd.config, "Config JSON file to apply (default < this file < EPX_* env)");
  cmd.app->add_flag("--backends", cmd.backends_only, "Print only the backends x capabilities table (Markdown, as in docs/architecture.md)");
  cmd.knobs = cmd.app->add_option("--knobs", cmd.knobs_prefix,
                                  "Print only the configuration knobs whose key starts with PREFIX (all without one): key, "
                                  "environment variable, type, default, allowed values, meaning (Markdown, as in docs/configuration.md)")
                  ->expected(0, 1);
}

namespace {
std::vector<std::string> devices() {
  std::vector<std::string> d{cpu_device_name()};
  if (!cuda::built_with_cuda()) return d;
  const int n = cuda::device_count();  // asks a child process: this one stays free of CUDA
  if (n == 0) d.push_back("cuda: built with CUDA, but no device is visible");
  for (int i = 0; i < n; ++i) d.push_back("cuda:" + std::to_string(i));
  return d;
}

// Each backend's Capabilities, read from an instance on a one-rank CPU group.
void print_backend_table(std::ostream& os) {
  os << "| backend | layout | fp8 dispatch | graph-safe | static buffers |\n|---|---|---|---|---|\n";
  auto yes = [](bool b) { return b ? "yes" : "no"; };
  for (const std::string& name : backend_names()) {
    DispatchConfig cfg;
    cfg.hidden = 256;
    cfg.num_experts = 8;
    cfg.top_k = 2;
    cfg.num_max_dispatch_tokens_per_rank = 16;
    Capabilities caps;
    std::string error;
    auto groups = make_cpu_groups(1);
    try {
      run_ranks(groups, [&](int r) { caps = make_prepare_finalize(name, groups[r], cfg)->capabilities(); });
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!error.empty()) {
      os << "| " << name << " | (cannot create: " << error << ") | | | |\n";
      continue;
    }
    os << "| " << name << " | " << layout_name(caps.layout) << " | " << yes(caps.supports_fp8_dispatch) << " | "
       << yes(caps.graph_safe) << " | " << yes(caps.static_buffers) << " |\n";
  }
}
}  // namespace

int run_info(InfoCommand& cmd) {
  if (cmd.knobs != nullptr && cmd.knobs->count() > 0) {
    std::cout << Config::knobs_markdown(cmd.knobs_prefix);
    return 0;
  }
  const Config config = cmd.config.empty() ? Config::load() : Config::load(cmd.config);
  if (cmd.backends_only) {
    print_backend_table(std::cout);
    return 0;
  }
  const char* build = cuda::built_with_cuda() ? "CUDA" : "CPU-only";
  std::cout << "epx " << EPX_VERSION << " (" << build << " build, git " << git_commit() << ")\n\ndevices:\n";
  for (const std::string& d : devices()) std::cout << "  " << d << "\n";
  if (cuda::built_with_cuda()) {
    const int hv = cuda::nccl_header_version();
    std::cout << "\nNCCL: library " << (nccl_version_string().empty() ? std::string("not loaded") : nccl_version_string())
              << ", headers " << hv / 10000 << "." << hv % 10000 / 100 << "." << hv % 100 << "\n";
    if (cuda::device_count() > 0) {
      std::cout << "\ntopology (CUDA runtime):\n";
      for (const std::string& line : gpu_topology_lines()) std::cout << "  " << line << "\n";
      // What make_nccl_group will find for one process per visible GPU (NodeLayout, NCCL's rules).
      const int n = cuda::device_count();
      std::vector<int64_t> keys;
      for (int r = 0; r < n; ++r) keys.push_back(node_key_from_env(r));
      const NodeLayout nodes = NodeLayout::from_keys(keys, 0);
      std::cout << "\nnode layout (one rank per visible GPU, NCCL's rules): " << nodes.describe() << " ("
                << (nodes.num_nodes > 1 ? "multi-node path: per-node communicators; ll/ht hierarchical across nodes"
                                        : "single-node fast path")
                << ")\n";
      for (const char* v : {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_HOSTID"})
        if (const char* x = std::getenv(v)) std::cout << "  " << v << "=" << x << "\n";
    }
  }
  std::cout << "\nconfig (default < JSON file (--config or EPX_CONFIG) < EPX_* env; rules: epx info --knobs):\n";
  for (const std::string& line : config.describe()) std::cout << "  " << line << "\n";
  std::cout << "\nbackends:\n";
  print_backend_table(std::cout);
  std::cout << "\npresets:\n  " << std::left << std::setw(24) << "name" << std::right << std::setw(7) << "hidden" << std::setw(7)
            << "inter" << std::setw(9) << "experts" << std::setw(6) << "top_k" << std::setw(8) << "shared" << "  router, weights\n";
  for (const std::string& name : preset_names()) {
    const MoEConfig m = preset(name);
    const RouterConfig& rc = m.router;
    std::cout << "  " << std::left << std::setw(24) << name << std::right << std::setw(7) << m.hidden << std::setw(7) << m.intermediate
              << std::setw(9) << rc.num_experts << std::setw(6) << rc.top_k << std::setw(8)
              << (m.num_shared_experts > 0 ? std::to_string(m.shared_intermediate) : std::string("-")) << "  "
              << (rc.scoring == ScoringFunc::sigmoid ? "sigmoid" : "softmax") << (rc.renormalize ? "+renorm" : "")
              << (rc.n_group > 1 ? ", groups " + std::to_string(rc.n_group) + "/" + std::to_string(rc.topk_group) : std::string())
              << (rc.routed_scaling_factor != 1.0f ? ", x" + std::to_string(rc.routed_scaling_factor).substr(0, 4) : std::string())
              << (m.shared_gate ? ", shared gate" : "") << ", " << weight_format_name(m.routed_format) << "\n";
  }
  return 0;
}

}  // namespace epx::cli
