// tools/epx/cmd_trace.cpp: `epx trace import` (JSON Lines routing log -> epx-trace) and
// `epx trace show` (what a trace holds: steps, tokens per rank, load per expert).
#include <algorithm>
#include <iomanip>
#include <iostream>

#include "commands.h"
#include "epx/dispatch.h"
#include "epx/trace.h"
#include "validators.h"

namespace epx::cli {

void add_trace_command(CLI::App& root, TraceCommand& cmd) {
  cmd.app = root.add_subcommand("trace", "Recorded routing: import JSON Lines logs, inspect traces (docs/trace-format.md)");
  cmd.app->require_subcommand(1);
  CLI::App* im = cmd.app->add_subcommand(
      "import", "Convert JSON Lines of per-token routing records (token_idx, topk_ids, topk_weights) into an epx trace");
  cmd.import_app = im;
  im->add_option("input", cmd.input, "JSON Lines file; token_idx restarts at 0 at every forward pass; non-route lines (meta) are skipped")
      ->required();
  im->add_option("-o,--output", cmd.output, "Output: a .json file, or a directory (manifest.json + .npy files) for large traces")->required();
  im->add_option("--ranks", cmd.ranks, "R: ranks to deal each step's tokens over (contiguous blocks, sizes differ by at most one)")
      ->required()
      ->check(CLI::Range(1, 1024));
  im->add_option("--skip-passes", cmd.skip_passes, "Leading forward passes to drop (vLLM's profile and warm-up dummy passes)")
      ->check(non_negative_number())
      ->capture_default_str();
  im->add_option("--max-tokens-per-step", cmd.max_tokens_per_step, "Split a pass longer than N tokens into steps of at most N (0 = one step per pass)")
      ->check(non_negative_number())
      ->capture_default_str();
  im->add_option("--num-experts", cmd.num_experts, "E (0 = the meta line's num_experts, else the largest id + 1)")
      ->check(non_negative_number())
      ->capture_default_str();
  CLI::App* show = cmd.app->add_subcommand("show", "Print a trace's header, tokens per rank and load per expert");
  cmd.show_app = show;
  show->add_option("trace", cmd.input, "epx-trace JSON file or directory")->required();
}

namespace {
void print_summary(const Trace& t) {
  const auto per_rank = t.tokens_per_rank();
  const auto per_expert = t.expert_counts();
  const int64_t total = t.total_tokens();
  std::cout << "steps " << t.steps.size() << ", ranks " << t.num_ranks << ", experts " << t.num_experts << ", top_k " << t.top_k
            << ", hidden states " << (t.hidden > 0 ? "H=" + std::to_string(t.hidden) : std::string("none")) << "\n";
  if (!t.source.empty()) std::cout << "source: " << t.source << "\n";
  std::cout << "tokens: " << total << " total, max " << t.max_tokens_per_rank() << " per rank per step; per rank:";
  for (int64_t n : per_rank) std::cout << " " << n;
  std::cout << "\n";
  int64_t sel = 0, hottest = 0;
  for (int64_t c : per_expert) sel += c, hottest = std::max(hottest, c);
  const double mean = per_expert.empty() ? 0.0 : static_cast<double>(sel) / per_expert.size();
  std::cout << "selections: " << sel << "; hottest expert " << std::fixed << std::setprecision(2)
            << (mean > 0 ? hottest / mean : 0.0) << "x the mean; per EP rank (experts split evenly over " << t.num_ranks << " ranks):";
  for (int r = 0; r < t.num_ranks; ++r) {
    const ExpertRange er = expert_range(t.num_experts, t.num_ranks, r);
    int64_t n = 0;
    for (int e = er.begin; e < er.end; ++e) n += per_expert[e];
    std::cout << " " << n;
  }
  std::cout << "\n";
}
}  // namespace

int run_trace(TraceCommand& cmd) {
  if (cmd.show_app->parsed()) {
    const Trace t = load_trace(cmd.input);
    print_summary(t);
    std::cout << "selections per expert:";  // the load per expert, experts 0..E-1
    for (int64_t c : t.expert_counts()) std::cout << " " << c;
    std::cout << "\n";
    return 0;
  }
  TraceImportOptions opt;
  opt.num_ranks = cmd.ranks;
  opt.skip_passes = cmd.skip_passes;
  opt.max_tokens_per_step = cmd.max_tokens_per_step;
  opt.num_experts = cmd.num_experts;
  TraceImportSummary sum;
  const Trace t = import_routing_jsonl_file(cmd.input, opt, &sum);
  save_trace(t, cmd.output);
  std::cout << "read " << sum.num_records << " route records in " << sum.num_passes << " passes; dropped the first "
            << cmd.skip_passes << " passes (" << sum.num_skipped_records << " records)\n";
  print_summary(t);
  std::cout << "wrote " << cmd.output << "\n";
  return 0;
}

}  // namespace epx::cli
