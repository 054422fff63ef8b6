// tests/cli_test.cpp: the built `epx` binary as a user runs it: exit codes, one-line errors,
// `moe --help` coverage, the main job's JSON, and trace import -> replay end to end.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include "epx/config.h"
#include "test_util.h"

namespace {

const std::string kEpx = std::string(EPX_BINARY_DIR) + "/epx";

struct CliRun {
  int code = -1;
  std::string out;  // stdout and stderr together
  std::string err;  // stderr alone
};

// Runs `epx <args>`; stderr is also captured on its own so its line count can be checked.
CliRun run_epx(const std::string& args) {
  const epx::test::CommandResult c = epx::test::run_command(kEpx + " " + args, /*capture_stderr=*/true);
  return {c.code, c.out + c.err, c.err};
}

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("epx_cli_test_" + std::to_string(::getpid()) + "_" + name);
}

// The message is exactly one line ending in '\n'.
void expect_one_line(const std::string& s) {
  ASSERT_FALSE(s.empty());
  EXPECT_EQ(s.back(), '\n') << s;
  EXPECT_EQ(s.find('\n'), s.size() - 1) << "more than one line:\n" << s;
}

nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

}  // namespace

TEST(Cli, BinaryExists) { ASSERT_TRUE(std::filesystem::exists(kEpx)) << kEpx; }

// A huge Zipf exponent makes every popularity but the first underflow to 0: the synthetic routing
// must still draw K distinct experts (it indexed left[-1] and aborted in free(): moe and bench).
TEST(Cli, HugeZipfExponentStillDrawsKDistinctExperts) {
  for (const char* args : {"moe --preset mixtral-8x7b-mini --ranks 2 --backend naive --steps 1 --tokens-per-rank 4 --routing zipf --zipf-s 1e30",
                           "moe --preset qwen3-30b-a3b-mini --ranks 2 --backend ll --steps 1 --tokens-per-rank 4 --routing zipf --zipf-s 1e3",
                           "bench --device cpu --case ll-v3 --backend naive --ranks 2 --iters 1 --routing zipf --zipf-s 1e30"}) {
    CliRun r = run_epx(args);
    EXPECT_EQ(r.code, 0) << args << "\n" << r.out;
  }
}

TEST(Cli, BadFlagExits2WithOneLine) {
  for (const char* args : {"moe --no-such-flag", "moe --ranks zero", "moe --routing banana", "moe --backend nope",
                                  "no-such-command", "trace import", "moe --dispatch-dtype fp4"}) {
    CliRun r = run_epx(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    expect_one_line(r.err);
    EXPECT_EQ(r.err.rfind("epx: error: ", 0), 0u) << r.err;
  }
  // An unknown subcommand is named as such (it was "A subcommand is required", as if none was given).
  CliRun r = run_epx("no-such-command --ranks 2");
  EXPECT_EQ(r.err, "epx: error: no-such-command: not a subcommand; one of moe, bench, trace, info (see epx --help)\n");
}

// Range errors of numeric flags read as a rule, not CLI11's "not in range 0.000000 to <309 digits>".
TEST(Cli, NegativeOrZeroNumericFlagsNameTheRuleBriefly) {
  for (const char* args : {"moe --chunk-size -1", "moe --validate-tokens -2", "moe --zipf-s 0 --routing zipf", "moe --zipf-s inf",
                           "bench --zipf-s -1", "bench --tokens-per-rank -1", "trace import x.jsonl -o y.json --skip-passes -1",
                           "trace import x.jsonl -o y.json --num-experts -1", "moe --checkpoint /nonexistent --layer -1",
                           "moe --expert-pool -1", "moe --preset deepseek-v3-mini --expert-pool 257"}) {
    CliRun r = run_epx(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    expect_one_line(r.err);
    EXPECT_LT(r.err.size(), 200u) << args << "\n" << r.err;
  }
}

TEST(Cli, InconsistentShapesExit2WithOneLine) {
  // A trace of top_k = 2 for a preset of top_k = 8.
  const auto trace = temp_path("k2.json");
  std::ofstream(trace) << R"({"format": "epx-trace", "version": 1, "num_ranks": 2, "num_experts": 4, "top_k": 2,
    "steps": [{"ranks": [{"topk_idx": [[0, 1]], "topk_weights": [[0.5, 0.5]]}, {"topk_idx": [], "topk_weights": []}]}]})";
  CliRun r = run_epx("moe --preset deepseek-v3-mini --trace " + trace.string());
  EXPECT_EQ(r.code, 2) << r.out;
  expect_one_line(r.err);
  EXPECT_NE(r.err.find("top_k = 2"), std::string::npos) << r.err;
  r = run_epx("moe --preset deepseek-v3-mini --ranks 3 --trace " + trace.string());
  EXPECT_EQ(r.code, 2) << r.out;
  expect_one_line(r.err);
  EXPECT_NE(r.err.find("--ranks = 3"), std::string::npos) << r.err;
  r = run_epx("moe --preset deepseek-v3-mini --tokens-per-rank 4 --trace " + trace.string());
  EXPECT_EQ(r.code, 2) << r.out;
  expect_one_line(r.err);
  std::filesystem::remove(trace);
  r = run_epx("moe --preset deepseek-v3-mini --trace /nonexistent/trace.json");
  EXPECT_EQ(r.code, 2) << r.out;
  expect_one_line(r.err);
#ifndef EPX_WITH_CUDA
  r = run_epx("moe --device cuda");
  EXPECT_EQ(r.code, 2) << r.out;
  expect_one_line(r.err);
  EXPECT_NE(r.err.find("no CUDA"), std::string::npos) << r.err;
#endif
}

// An unwritable --json path was found only when the results were written, after the whole run (a full-size
// replay: minutes, then exit 2 and nothing kept). It is a bad flag before anything runs.
TEST(Cli, UnwritableJsonPathIsABadFlagBeforeTheRun) {
  const auto blocker = temp_path("not_a_dir");
  std::ofstream(blocker) << "a file, so no directory can be made here\n";
  const std::string json = (blocker / "out.json").string();
  for (const std::string& args : {"moe --preset mixtral-8x7b-mini --ranks 2 --backend ll --steps 1 --tokens-per-rank 2 --json " + json,
                                  "bench --device cpu --case ll-v3 --backend naive --ranks 2 --iters 1 --json " + json}) {
    CliRun r = run_epx(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    expect_one_line(r.err);
    EXPECT_NE(r.err.find("--json = " + json + ": must be a writable file path"), std::string::npos) << r.err;
    EXPECT_EQ(r.out, r.err) << "ran before refusing the flag:\n" << r.out;  // nothing on stdout: no header, no table
  }
  // A writable path that does not exist yet is not left behind by the check when the run then fails.
  const auto later = temp_path("later.json");
  std::filesystem::remove(later);
  CliRun r = run_epx("moe --preset mixtral-8x7b-mini --ranks 2 --backend ll --steps 1 --tokens-per-rank 2 --chunk-size 1 --json " +
                     later.string() + " --config /nonexistent.json");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_FALSE(std::filesystem::exists(later));
  std::filesystem::remove(blocker);
}

// --shared on a model without a shared expert chose nothing, ran, and the results named the mode.
TEST(Cli, SharedOnAModelWithoutASharedExpertIsABadFlag) {
  const std::string run = "moe --preset mixtral-8x7b-mini --ranks 2 --backend naive --steps 1 --tokens-per-rank 2";
  CliRun r = run_epx(run + " --shared fused");
  EXPECT_EQ(r.code, 2) << r.out;
  expect_one_line(r.err);
  EXPECT_NE(r.err.find("--shared = fused: needs a model with a shared expert (mixtral-8x7b-mini has none)"), std::string::npos) << r.err;
  r = run_epx(run);  // the default (auto) still runs
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_epx("moe --preset deepseek-v3-mini --ranks 2 --backend naive --steps 1 --tokens-per-rank 2 --shared separate");
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST(Cli, MoeHelpDocumentsEveryFlag) {
  CliRun r = run_epx("moe --help");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* flag : {"--preset", "--ranks", "--backend", "--tokens-per-rank", "--steps", "--device", "--routing", "--zipf-s",
                           "--dispatch-dtype", "--shared", "--chunk-size", "--seed", "--trace", "--json", "--config", "--warmup",
                           "--mode", "--compare", "--no-graph", "--expert-pool"})
    EXPECT_NE(r.out.find(flag), std::string::npos) << "moe --help does not mention " << flag;
  EXPECT_NE(r.out.find("Exit status"), std::string::npos);
  CliRun t = run_epx("trace import --help");
  EXPECT_EQ(t.code, 0);
  for (const char* flag : {"--ranks", "--skip-passes", "--max-tokens-per-step", "--num-experts", "--output"})
    EXPECT_NE(t.out.find(flag), std::string::npos) << "trace import --help does not mention " << flag;
}

TEST(Cli, InfoPrintsConfigBackendsAndPresets) {
  CliRun r = run_epx("info");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* s : {"epx ", "devices:", "cpu (", "timeout_s", "backends:", "naive", "presets:", "deepseek-v3-mini"})
    EXPECT_NE(r.out.find(s), std::string::npos) << "epx info lacks " << s << "\n" << r.out;
}

// `epx info --knobs [PREFIX]` prints the Config registry's Markdown table (docs/configuration.md holds the full one)
// and nothing else; a prefix that begins no key is a bad argument named in one line (exit 2).
TEST(Cli, InfoKnobsPrintsTheRegistrysTable) {
  CliRun all = run_epx("info --knobs");
  EXPECT_EQ(all.code, 0) << all.out;
  EXPECT_EQ(all.out, epx::Config::knobs_markdown());
  CliRun ll = run_epx("info --knobs ll.");
  EXPECT_EQ(ll.code, 0) << ll.out;
  EXPECT_EQ(ll.out, epx::Config::knobs_markdown("ll."));
  EXPECT_NE(ll.out.find("`ll.combine_wait`"), std::string::npos) << ll.out;
  CliRun bad = run_epx("info --knobs zz.");
  EXPECT_EQ(bad.code, 2) << bad.out;
  expect_one_line(bad.err);
  EXPECT_NE(bad.err.find("knob prefix = zz.: must begin at least one key"), std::string::npos) << bad.err;
}

// --expert-contiguous: ht's layer runs its experts on prepare's expert-contiguous rows (the other backends as
// without it); every backend still validates against the reference, and the JSON says which ran it.
TEST(Cli, ExpertContiguousRunsOnHtAndIsRecorded) {
  const auto out = temp_path("moe-contig.json");
  CliRun r = run_epx("moe --preset deepseek-v4-pro-mini --ranks 2 --backend all --steps 2 --tokens-per-rank 8 --dispatch-dtype fp8 "
                     "--expert-contiguous --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("ht expert-contiguous"), std::string::npos) << r.out;
  const nlohmann::json j = read_json(out);
  int ht = 0;
  for (const auto& res : j["results"]) {
    EXPECT_EQ(res["status"], "pass") << res.dump();
    EXPECT_EQ(res["expert_contiguous"], res["backend"] == "ht") << res.dump();
    ht += res["backend"] == "ht";
  }
  EXPECT_EQ(ht, 1);
  std::filesystem::remove(out);
}

// --expert-contiguous is an ht option: with one other backend chosen it changes nothing, and the results would say
// nothing either; a bad flag (exit 2, one line naming it), as --shared on a model without a shared expert.
TEST(Cli, ExpertContiguousWithOnlyAnotherBackendIsABadFlag) {
  for (const char* backend : {"ll", "naive"}) {
    CliRun r = run_epx(std::string("moe --preset deepseek-v3-mini --ranks 2 --steps 1 --tokens-per-rank 4 --backend ") + backend +
                       " --expert-contiguous");
    EXPECT_EQ(r.code, 2) << backend << "\n" << r.out << r.err;
    expect_one_line(r.err);
    EXPECT_NE(r.err.find("--expert-contiguous"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(backend), std::string::npos) << r.err;
  }
}

TEST(Cli, MainJobValidatesEveryBackendAndWritesResultsJson) {
  const auto out = temp_path("moe.json");
  CliRun r = run_epx("moe --preset deepseek-v3-mini --ranks 2 --backend all --steps 2 --tokens-per-rank 8 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("p50 ms"), std::string::npos) << r.out;
  const nlohmann::json j = read_json(out);
  EXPECT_EQ(j["tool"], "epx moe");
  for (const char* key : {"command", "git_commit", "date", "device", "results"}) EXPECT_TRUE(j.contains(key)) << key;
  std::set<std::string> backends;
  for (const auto& res : j["results"]) {
    backends.insert(res["backend"].get<std::string>());
    EXPECT_EQ(res["validated"], true) << res.dump();
    EXPECT_EQ(res["status"], "pass") << res.dump();
    EXPECT_EQ(res["case"], "deepseek-v3-mini");
    EXPECT_EQ(res["op"], "layer");
    EXPECT_EQ(res["ranks"], 2);
    EXPECT_EQ(res["tokens_per_rank"], 8);
    EXPECT_EQ(res["steps"], 2);
    EXPECT_LE(res["rel_l2_error"].get<double>(), 1e-2);
    for (const char* key : {"latency_us_p50", "latency_us_p10", "latency_us_p90", "latency_us_p99", "latency_us_mean",
                            "max_rel_error", "hidden", "top_k", "num_experts", "dtype", "accounting", "counters"})
      EXPECT_TRUE(res.contains(key)) << key;
  }
  EXPECT_EQ(backends, (std::set<std::string>{"naive", "allgather_reducescatter", "all2allv", "ll", "ht"}));
  std::filesystem::remove(out);
}

// --mode decode (128 tokens/rank by default) --compare: every backend fused and separate, validated,
// percentiles and tokens/s in the JSON, counters proving the path each run took (the gathering
// backends shard the shared expert over the 2 ranks), the graph refusal's reason on CPU ranks, and
// the delta tables in the output and the JSON.
TEST(Cli, DecodeCompareWritesTheAbTablesAndCounters) {
  const auto out = temp_path("ab.json");
  CliRun r = run_epx("moe --preset qwen1.5-moe-a2.7b-mini --ranks 2 --backend all --mode decode --compare --steps 2 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* s : {"p25 ms", "p75 ms", "tokens/s", "A/B: backends", "A/B: shared expert fused against separate", "baseline",
                        "CUDA graphs need a group on a GPU", "phases, p50 ms"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  const nlohmann::json j = read_json(out);
  ASSERT_EQ(j["results"].size(), 10u);
  for (const auto& res : j["results"]) {
    const std::string b = res["backend"], mode = res["shared_mode"];
    EXPECT_EQ(res["status"], "pass") << res.dump();
    EXPECT_EQ(res["tokens_per_rank"], 128);
    EXPECT_EQ(res["mode"], "decode");
    EXPECT_EQ(res["graph"], false);
    EXPECT_NE(res["graph_reason"].get<std::string>().find("GPU"), std::string::npos);
    for (const char* key : {"latency_us_p25", "latency_us_p50", "latency_us_p75", "latency_us_p99", "latency_us_mean", "tokens_per_s"})
      EXPECT_TRUE(res[key].is_number()) << key << " " << res.dump();
    EXPECT_LE(res["latency_us_p25"].get<double>(), res["latency_us_p75"].get<double>());
    // Eager steps report where the time went; the separate shared expert only on the separate path.
    ASSERT_TRUE(res.contains("phase_us_p50")) << res.dump();
    for (const char* key : {"prepare", "experts", "finalize", "shared_separate"})
      EXPECT_GE(res["phase_us_p50"][key].get<double>(), 0.0) << key << " " << res.dump();
    EXPECT_GT(res["phase_us_p50"]["experts"].get<double>(), 0.0) << res.dump();
    EXPECT_LE(res["phase_us_p50"]["experts"].get<double>(), res["latency_us_p99"].get<double>()) << res.dump();
    if (mode == "separate") {
      EXPECT_GT(res["phase_us_p50"]["shared_separate"].get<double>(), 0.0) << res.dump();
    }
    const auto& c = res["counters"];
    const bool gathers = b == "naive" || b == "allgather_reducescatter";
    EXPECT_EQ(c["shared_fused"], mode == "fused" ? 2 : 0) << res.dump();
    EXPECT_EQ(c["shared_separate"], mode == "separate" ? 2 : 0) << res.dump();
    EXPECT_EQ(c["shared_sharded"], mode == "fused" && gathers ? 2 : 0) << res.dump();
    EXPECT_EQ(res["shared_sharded"], gathers) << res.dump();
  }
  ASSERT_TRUE(j.contains("compare"));
  EXPECT_EQ(j["compare"]["backends"].size(), 10u);
  ASSERT_EQ(j["compare"]["shared_fused_vs_separate"].size(), 5u);
  for (const auto& p : j["compare"]["shared_fused_vs_separate"]) {
    EXPECT_TRUE(p["delta_pct_fused_vs_separate"].is_number()) << p.dump();
    EXPECT_EQ(p["fused_counters"]["shared_fused"], 2) << p.dump();
    EXPECT_EQ(p["separate_counters"]["shared_separate"], 2) << p.dump();
  }
  std::filesystem::remove(out);
}

TEST(Cli, TraceImportThenReplayValidates) {
  // A vLLM-MoE-Logger-shaped log for a 60-expert top-4 model: one warm-up pass (2 rows) to drop,
  // then passes of 7 and 3 tokens.
  const auto log = temp_path("log.jsonl"), trace = temp_path("t.json"), out = temp_path("replay.json");
  {
    std::ofstream f(log);
    f << R"({"type": "meta", "model_id": "toy", "top_k": 4})" << "\n";
    int row = 0;
    for (int n : {2, 7, 3})
      for (int t = 0; t < n; ++t, ++row)
        f << R"({"type": "route", "req_id": "r1", "token_idx": )" << t << R"(, "layer": 12, "topk_ids": [)" << row % 60 << ", "
          << (row * 7 + 1) % 60 << ", " << (row * 13 + 2) % 60 << ", " << (row * 29 + 3) % 60
          << R"(], "topk_weights": [0.3, 0.2, 0.1, 0.05]})" << "\n";
  }
  CliRun im = run_epx("trace import " + log.string() + " --ranks 2 --skip-passes 1 --num-experts 60 -o " + trace.string());
  ASSERT_EQ(im.code, 0) << im.out;
  EXPECT_NE(im.out.find("steps 2, ranks 2"), std::string::npos) << im.out;
  CliRun mo = run_epx("moe --preset qwen1.5-moe-a2.7b-mini --trace " + trace.string() + " --backend ll --json " + out.string());
  ASSERT_EQ(mo.code, 0) << mo.out;
  const nlohmann::json j = read_json(out);
  ASSERT_EQ(j["results"].size(), 1u);
  EXPECT_EQ(j["results"][0]["validated"], true);
  EXPECT_EQ(j["results"][0]["tokens_per_rank"], 4);  // 7 tokens over 2 ranks: 4 + 3
  EXPECT_EQ(j["results"][0]["tokens_total"], 10);
  // `trace show` prints the load per expert it promises (README, its help): E counts summing to the
  // selections (10 tokens x top-4).
  CliRun sh = run_epx("trace show " + trace.string());
  ASSERT_EQ(sh.code, 0) << sh.out;
  const size_t at = sh.out.find("selections per expert:");
  ASSERT_NE(at, std::string::npos) << sh.out;
  const size_t from = at + std::string("selections per expert:").size();
  std::istringstream per(sh.out.substr(from, sh.out.find('\n', at) - from));
  int64_t count = 0, sum = 0, v = 0;
  while (per >> v) ++count, sum += v;
  EXPECT_EQ(count, 60) << sh.out;
  EXPECT_EQ(sum, 40) << sh.out;
  for (const auto& p : {log, trace, out}) std::filesystem::remove(p);
}
