// tools/epx/cmd_moe.cpp: `epx moe`, the main job. Runs the EP MoE layer (ModularMoE over R CPU
// ranks) for S steps per backend and checks every step against the single-rank no-EP reference.
#include <chrono>
#include <iostream>

#include "commands.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "moe_checkpoint.h"
#include "moe_cuda_run.h"
#include "moe_report.h"
#include "validators.h"

namespace epx::cli {

namespace {
constexpr std::string_view kOp = "epx moe";

// cpu: R ranks as threads of this process. cuda: one process per GPU, or R virtual ranks on GPU 0
// when fewer GPUs are visible (moe_cuda_run.h). auto stays on the CPU: the GPU path is asked for by name.
std::string resolve_device(const std::string& device) {
  if (device == "cuda") {
#ifdef EPX_WITH_CUDA
    return "cuda";
#else
    throw InvalidArgument(arg_message(kOp, "--device", device, "this build has no CUDA (configure with -DEPX_CUDA=ON on a machine with nvcc); use --device cpu or auto"));
#endif
  }
  return "cpu";
}

std::vector<std::string> names_with_all(std::vector<std::string> v) {
  v.push_back("all");
  return v;
}
}  // namespace

void add_moe_command(CLI::App& root, MoeCommand& cmd) {
  MoeOptions& o = cmd.options;
  CLI::App* m = root.add_subcommand("moe", "Run the EP MoE layer over R ranks and validate every step against the no-EP reference");
  cmd.app = m;
  m->add_option("--preset", o.preset, "Model preset (layer shape and router); see `epx info`")
      ->check(CLI::IsMember(preset_names()))
      ->capture_default_str();
  cmd.ranks = m->add_option("--ranks", o.ranks, "R: ranks of the EP group (one DP attention rank each); with --trace, defaults to the trace's R")
                  ->check(CLI::Range(1, 1024))
                  ->capture_default_str();
  m->add_option("--backend", o.backend, "Dispatch backend, or `all` to run every backend in turn")
      ->check(CLI::IsMember(names_with_all(backend_names())))
      ->capture_default_str();
  cmd.tokens = m->add_option("--tokens-per-rank", o.tokens_per_rank, "T: tokens each rank feeds into every step (not with --trace)")
                   ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
                   ->capture_default_str();
  cmd.steps = m->add_option("--steps", o.steps, "S: measured and validated steps (with --trace: the first S steps; default all)")
                  ->check(CLI::Range(1, 1 << 20))
                  ->capture_default_str();
  m->add_option("--warmup", o.warmup, "W: untimed, unvalidated steps run first")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  m->add_option("--device", o.device,
                "cpu (ranks are threads), cuda (one process per GPU, forked by epx; with fewer GPUs than R, R virtual ranks: "
                "threads of one process on GPU 0), or auto (= cpu)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd.routing = m->add_option("--routing", o.routing,
                              "uniform | zipf: synthetic topk_idx/topk_weights (K distinct experts, uniform or Zipf popularity), "
                              "passed to forward_routed; router: the model's router (random weights) via forward()")
                    ->check(CLI::IsMember({"uniform", "zipf", "router"}))
                    ->capture_default_str();
  m->add_option("--zipf-s", o.zipf_s, "Zipf exponent s of --routing zipf: expert i (in a random order) has popularity 1/i^s")
      ->check(positive_number())
      ->capture_default_str();
  m->add_option("--dispatch-dtype", o.dispatch_dtype, "Wire dtype of dispatch: bf16, or fp8 (e4m3, 1x128 fp32 scales)")
      ->check(CLI::IsMember({"bf16", "fp8", "fp8_e4m3"}))
      ->capture_default_str();
  cmd.shared = m->add_option("--shared", o.shared, "Shared expert: separate, fused (FHMoE: one extra route of weight g), or auto (fuse when M <= fhmoe.max_tokens); "
                "given on a model without a shared expert: a bad flag")
      ->check(CLI::IsMember({"separate", "fused", "auto"}))
      ->capture_default_str();
  m->add_option("--chunk-size", o.chunk_size, "C: DP chunk, at most C tokens per MoE call per rank; 0 = moe.chunk_size of the config (0 = unchunked)")
      ->check(non_negative_number())
      ->capture_default_str();
  m->add_option("--mode", o.mode,
                 "decode: 128 tokens/rank unless --tokens-per-rank is given, and with --device cuda the whole layer captured "
                 "once as a CUDA graph and replayed per step where the backend is graph-safe (else eager, with the reason); "
                 "prefill: 4096 tokens/rank unless given, eager")
      ->check(CLI::IsMember({"decode", "prefill"}));
  m->add_flag("--compare", o.compare,
              "A/B in one run: every chosen backend, each with the shared expert fused and separate (models with one), "
              "then delta tables (backends against the first; fused against separate with the path counters); also in the JSON");
  m->add_flag("--graph,!--no-graph", o.graph, "decode: replay a captured whole-layer graph where possible (default) or run eagerly");
  m->add_flag("--expert-contiguous", o.expert_contiguous,
              "ht: the experts run on prepare's expert-contiguous rows and finalize weights them (DispatchConfig::"
              "expert_contiguous) instead of the Flat rows; with --backend all the other backends run as without it, with one "
              "other --backend it is a bad flag");
  m->add_option("--seed", o.seed, "Seed of the weights, hidden states and synthetic routing")->capture_default_str();
  m->add_option("--expert-pool", o.expert_pool,
                "P > 0: random routed expert e takes the values of expert e mod P, so each rank builds at most P experts "
                "(full-size presets: seconds instead of ~40 s); every expert is still its own copy on the GPU and in the "
                "layer, and the reference uses the same values. 0 = all distinct. Not with --checkpoint")
      ->check(non_negative_number())
      ->capture_default_str();
  m->add_option("--trace", o.trace, "Replay recorded routing: an epx-trace JSON file or directory (docs/trace-format.md); "
                                    "gives R, T per rank and step, and optionally hidden states");
  m->add_option("--validate-tokens", o.validate_tokens,
                 "V: with --device cuda, the first V tokens of each rank and step are checked against the reference (0 = all)")
      ->check(non_negative_number())
      ->capture_default_str();
  // Fault injection for the launcher's dead-rank test: rank N kills itself after its first step.
  m->add_option("--debug-kill-rank", o.debug_kill_rank)->group("");
  add_checkpoint_flags(*m, o);  // --checkpoint, --layer, --hidden
  m->add_option("--json", o.json, "Write the results as a RESULTS.md JSON file here");
  m->add_option("--config", o.config, "Config JSON file (default < this file < EPX_* env); see `epx info`");
  m->footer(
      "Every step's output (all ranks' rows) is compared with moe_reference_cpu on the concatenated tokens: pass when\n"
      "||out - ref||_2 / ||ref||_2 <= 1e-2 (NaN never passes). Capacity num_max_dispatch_tokens_per_rank = C, or the\n"
      "largest T of any rank and step when unchunked. Latency: per step, barrier to barrier, as rank 0 sees it.\n"
      "--device cuda: one process per GPU (R <= visible GPUs), each building only its own experts; latency from CUDA\n"
      "events around forward after a group barrier, the slowest rank's; the first V (--validate-tokens) tokens of each\n"
      "rank and step are checked against moe_reference_cpu on rank 0. If a rank dies, the others are stopped and the\n"
      "exit status is non-zero, naming it. With fewer GPUs than R: R virtual ranks, threads of one process on GPU 0\n"
      "(each rank its own stream and share of the SMs); the same validation, and timings of one GPU's memory, not\n"
      "NVLink (the header says so; JSON ranks_per_gpu = R, else 1).\n"
      "--mode decode|prefill and --compare report per-step latency p25/p50/p75/p99 and mean, tokens/s (tokens of all\n"
      "ranks over the summed step latencies), the path counters and the error against the reference.\n"
      "Exit status: 0 every backend passed, 1 a validation failure or runtime error, 2 a bad flag or inconsistent shapes.\n"
      "Examples:\n"
      "  epx moe --preset deepseek-v3-mini --ranks 4 --backend all --json results.json\n"
      "  epx moe --preset qwen3-30b-a3b-mini --ranks 8 --backend ll --routing zipf --zipf-s 1.2 --dispatch-dtype fp8\n"
      "  epx moe --device cuda --ranks 2 --preset deepseek-v3 --backend naive --steps 3\n"
      "  epx moe --device cuda --ranks 4 --preset deepseek-v3-mini --backend all   (one GPU: 4 virtual ranks)\n"
      "  epx moe --device cuda --ranks 2 --preset deepseek-v3 --mode decode --compare --backend all --steps 20\n"
      "  epx trace import routing.jsonl --ranks 4 -o t.json && epx moe --preset qwen1.5-moe-a2.7b --trace t.json\n"
      "  epx moe --checkpoint /models/Qwen3-30B-A3B --layer 5 --ranks 4 --backend ll --hidden h.npy");
}

int run_moe(MoeCommand& cmd, const std::string& command) {
  MoeOptions o = cmd.options;
  o.ranks_given = cmd.ranks->count() > 0;
  o.tokens_given = cmd.tokens->count() > 0;
  o.steps_given = cmd.steps->count() > 0;
  o.routing_given = cmd.routing->count() > 0;
  o.shared_given = cmd.shared->count() > 0;
  finish_checkpoint_options(o, *cmd.app);
  require_writable_json("epx moe", o.json);  // before the run, not after it
  const std::string device = resolve_device(o.device);
  const Config config = o.config.empty() ? Config::load() : Config::load(o.config);
  const std::vector<std::string> backends = o.backend == "all" ? backend_names() : std::vector<std::string>{o.backend};
  if (device == "cuda") return run_moe_cuda(o, config, backends, o.backend == "all", command);

  Workload w = build_workload(o, config);
  print_header(std::cout, w);
  std::cout << std::flush;
  std::vector<BackendResult> results;
  const auto t_ref = std::chrono::steady_clock::now();
  ensure_references(w);
  std::cerr << "reference: " << w.steps.size() << " steps in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t_ref).count() << " s\n";
  for (const RunVariant& v : run_variants(w, backends, o.compare)) {
    set_shared_mode(w, v.shared_mode);
    ensure_references(w);
    const auto t0 = std::chrono::steady_clock::now();
    results.push_back(run_backend(w, v.backend));
    std::cerr << v.backend << " [" << shared_mode_name(v.shared_mode) << "]: " << results.back().status << " ("
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)\n";
  }
  print_table(std::cout, w, results);
  if (!o.json.empty()) {
    write_results_json(o.json, command, w, results);
    std::cout << "wrote " << o.json << "\n";
  }
  std::cout << "repro: " << command << "\n";
  for (const BackendResult& r : results)
    if (r.status != "pass") return 1;
  return 0;
}

}  // namespace epx::cli
