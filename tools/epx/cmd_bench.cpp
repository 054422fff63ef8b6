// tools/epx/cmd_bench.cpp: `epx bench`, the dispatch/combine microbenchmark (bench_run.h).
#include <algorithm>
#include <iostream>

#include "bench_run.h"
#include "commands.h"
#include "epx/dispatch.h"
#include "validators.h"

namespace epx::cli {

void add_bench_command(CLI::App& root, BenchCommand& cmd) {
  BenchOptions& o = cmd.options;
  CLI::App* b = root.add_subcommand("bench", "Time dispatch (prepare) and combine (finalize) per backend at the ANCHORS.md shapes");
  cmd.app = b;
  std::vector<std::string> cases{"all"};
  for (const BenchCase& c : bench_cases()) cases.push_back(c.name);
  b->add_option("--case", o.cases, "Shape(s) from ANCHORS.md: ll-v3 (128 tok, fp8), ht-v3 (4096 tok, fp8 and bf16), ll-v4, or all")
      ->delimiter(',')
      ->check(CLI::IsMember(cases))
      ->capture_default_str();
  std::vector<std::string> backends = backend_names();
  backends.push_back("nccl_a2a_raw");
  backends.push_back("all");
  b->add_option("--backend", o.backend,
                "Dispatch backend, nccl_a2a_raw (NCCL's all-to-all of the same bytes), all (every backend + nccl_a2a_raw), or a "
                "comma-separated list of these (one run)")
      ->check([backends](const std::string& v) {
        std::string list = v + ",", bad;
        for (size_t at = list.find(','); at != std::string::npos; at = list.find(',')) {
          const std::string b = list.substr(0, at);
          list.erase(0, at + 1);
          if (std::find(backends.begin(), backends.end(), b) == backends.end()) bad = b;
        }
        return bad.empty() ? std::string() : "'" + bad + "' is not a backend (one of the names in epx info, nccl_a2a_raw, all)";
      })
      ->capture_default_str();
  b->add_option("--ranks", o.ranks,
                "R: ranks (one process per GPU with --device cuda; with fewer GPUs, R virtual ranks: threads on GPU 0, "
                "timing one GPU's memory, not NVLink)")->check(CLI::Range(1, 1024))->capture_default_str();
  b->add_option("--iters", o.iters, "Timed iterations per (case, dtype, backend)")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  b->add_option("--warmup", o.warmup, "Untimed iterations first")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  b->add_option("--routing", o.routing, "uniform: K distinct experts uniformly at random; zipf: skewed expert popularity (--zipf-s)")
      ->check(CLI::IsMember({"uniform", "zipf"}))
      ->capture_default_str();
  b->add_option("--zipf-s", o.zipf_s, "Zipf exponent of --routing zipf")->check(positive_number())->capture_default_str();
  b->add_option("--device", o.device,
                "cuda (one process per GPU, or virtual ranks on GPU 0 when fewer than R GPUs are visible), cpu (ranks are "
                "threads: a smoke test), or auto (cuda when built with it and R GPUs are visible)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  b->add_option("--tokens-per-rank", o.tokens_per_rank, "T: override the case's tokens per rank (0 = the case's, capped at 16 on cpu; a value given here is used as is)")
      ->check(non_negative_number())
      ->capture_default_str();
  b->add_option("--dtype", o.dtype, "Run only this dispatch dtype (bf16 or fp8); default: the case's")
      ->check(CLI::IsMember({"bf16", "fp8", "fp8_e4m3"}));
  b->add_option("--flat-combine", o.flat_combine,
                 "naive, allgather_reducescatter, all2allv, ht: partial_fp32 (each rank's partial crosses in fp32, one rounding; "
                 "the identity experts write fp32 rows) or partial_bf16 (bf16 partials, two roundings)")
      ->check(CLI::IsMember({"partial_fp32", "partial_bf16"}))
      ->capture_default_str();
  b->add_option("--seed", o.seed, "Seed of the hidden states and routing")->capture_default_str();
  b->add_option("--json", o.json, "Write the results as a RESULTS.md JSON file here");
  b->add_flag("--graph", o.graph,
             "Capture prepare and finalize in CUDA graphs (separately) and time their replays (cuda; graph-safe backends + "
             "nccl_a2a_raw); adds the 1-token-per-rank latency and the SMs used for ll");
  b->add_flag("--padded", o.padded,
             "naive, allgather_reducescatter, all2allv in their padded form (use_worst_case_sizing: C = T rows per rank's block, "
             "no host wait), each beside nccl_raw:<backend>, the Group collectives that form makes with the same bytes, timed in "
             "the same iterations (eager; not with --graph); rows add ratio_to_nccl_raw and host_enqueue_us_p50");
  b->add_option("--kernel-time", o.kernel_time,
                 "GPU duration of each call's kernels from CUPTI activity records (DeepEP's bench_kineto figure), in separate "
                 "rounds after the event rounds: auto (on for --device cuda when built with CUPTI, else 'unavailable' and the "
                 "run goes on), on (a bad flag, exit 2, without --device cuda or CUPTI; a job whose CUPTI rounds fail at run time "
                 "fails the run), off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  b->add_option("--config", o.config, "Config JSON file (default < this file < EPX_* env); see `epx info`");
  b->footer(
      "Per iteration: a group barrier, then CUDA events around prepare and around finalize (the expert step between them\n"
      "is the identity, untimed); an iteration counts as its slowest rank; p10/p50/p90 over the timed iterations.\n"
      "GB/s = bytes per rank / p50 under the case's accounting (ANCHORS.md): deepep-ll (valid selections x (H + H/128*4 + 16)\n"
      "fp8 dispatch, x 2H combine) or deepep-ht (rank-deduplicated rows incl. self x row bytes). validated: the last\n"
      "iteration's output equals the same backend on CPU ranks (cuda) or the identity formula (cpu) within rel L2 1e-2;\n"
      "on cpu a backend that rounds once (ll, and the Flat backends with --flat-combine partial_fp32) also has >= 99.9 %\n"
      "of elements within 1 bf16 ulp of the formula.\n"
      "predicted_us: bench/NOTES.md (2 ranks, the case's tokens, uniform routing).\n"
      "kern p50/p90 (--kernel-time, cuda + CUPTI): sum of each call's kernel durations (CUPTI activity records; each rank's\n"
      "percentile, the largest) in separate rounds; span p50: first kernel start to last kernel end; kGB/s: the accounting on kern p50.\n"
      "--device cuda with fewer GPUs than R: R virtual ranks (threads of one process on GPU 0, each with its share of the\n"
      "SMs); validated the same way, but the times measure one GPU's memory, not NVLink (JSON ranks_per_gpu = R; no\n"
      "predictions; nccl_a2a_raw is the virtual group's all-to-all; --kernel-time unavailable).\n"
      "--padded: per iteration the padded backend's prepare / finalize and its nccl_raw:<backend> twin (all_gather of the\n"
      "R blocks or all2allv's all-to-all; naive's all_gather (fp32) / all_reduce (bf16), agrs's reduce_scatter, all2allv's\n"
      "reverse all-to-all of the partials), each aligned on its own, the order alternating; ratio = p50 / the twin's p50.\n"
      "host enqueue (eager rows): host wall time of the timed call itself, without a wait on the stream after it.\n"
      "Exit status: 0 every epx backend that ran validated, 1 otherwise, 2 a bad flag.\n"
      "Examples:\n"
      "  epx bench --case ll-v3 --backend all --ranks 2 --json bench-ll-v3.json\n"
      "  epx bench --case ht-v3 --backend all2allv --ranks 2 --routing zipf\n"
      "  epx bench --device cpu --case ll-v3 --ranks 2 --iters 5\n"
      "  epx bench --device cuda --case ll-v3 --backend all --padded --ranks 1 --iters 200\n"
      "  epx bench --device cuda --case ll-v3 --backend all --ranks 2 --iters 20   (one GPU: 2 virtual ranks)");
}

int run_bench(BenchCommand& cmd, const std::string& command) { return run_bench(cmd.options, command); }

}  // namespace epx::cli
