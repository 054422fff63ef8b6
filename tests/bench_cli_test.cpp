// tests/bench_cli_test.cpp: `epx bench --device cpu` (the smoke path every build has): the RESULTS.md
// JSON shape, one dispatch and one combine row per (case, dtype, backend), validation of every epx
// backend against the identity formula, the accounting named, and one-line errors for bad flags.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include "test_util.h"

namespace {

const std::string kEpx = std::string(EPX_BINARY_DIR) + "/epx";

struct CliResult {
  int code = -1;
  std::string out;
};

CliResult run_epx(const std::string& args) {
  const epx::test::CommandResult c = epx::test::run_command(kEpx + " " + args + " 2>&1");
  return {c.code, c.out};
}

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("epx_bench_cli_test_" + std::to_string(::getpid()) + "_" + name);
}

TEST(BenchCli, CpuSmokeWritesResultsJson) {
  const auto out = temp_path("bench.json");
  CliResult r = run_epx("bench --device cpu --case ll-v3,ht-v3 --backend all --ranks 2 --iters 3 --warmup 1 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("repro: epx bench"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("deepep-ll"), std::string::npos) << r.out;
  // --kernel-time: no GPU kernels on CPU ranks, said once under the table.
  EXPECT_NE(r.out.find("kernel time: unavailable (--device cpu"), std::string::npos) << r.out;
  std::ifstream f(out);
  const nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_EQ(j["tool"], "epx bench");
  for (const char* key : {"command", "git_commit", "date", "device", "nccl_version", "results"}) EXPECT_TRUE(j.contains(key)) << key;
  // (case, dtype, backend) -> ops seen
  std::map<std::string, std::set<std::string>> ops;
  for (const auto& res : j["results"]) {
    for (const char* key : {"case", "backend", "op", "tokens_per_rank", "hidden", "top_k", "num_experts", "ranks", "dtype",
                            "latency_us_p50", "latency_us_p10", "latency_us_p90", "gbps", "accounting", "iterations", "validated",
                            "max_rel_error", "predicted_us", "ratio_to_predicted", "status"})
      EXPECT_TRUE(res.contains(key)) << key << " in " << res.dump();
    const std::string c = res["case"], b = res["backend"], op = res["op"];
    ops[c + "/" + res["dispatch_dtype"].get<std::string>() + "/" + b].insert(op);
    EXPECT_EQ(res["ranks"], 2);
    EXPECT_EQ(res["hidden"], 7168);
    EXPECT_EQ(res["tokens_per_rank"], 16);  // the CPU smoke size
    EXPECT_EQ(res["accounting"], c == "ll-v3" ? "deepep-ll" : "deepep-ht");
    EXPECT_EQ(res["iterations"], 3);
    ASSERT_TRUE(res["latency_us_p50"].is_number()) << res.dump();
    EXPECT_LE(res["latency_us_p10"].get<double>(), res["latency_us_p50"].get<double>());
    EXPECT_LE(res["latency_us_p50"].get<double>(), res["latency_us_p90"].get<double>());
    EXPECT_GT(res["gbps"].get<double>(), 0.0);
    EXPECT_TRUE(res["predicted_us"].is_null()) << "predictions are for the GPUs at the case's own size";
    if (b == "nccl_a2a_raw") {
      EXPECT_EQ(res["validated"], false);
    } else {
      EXPECT_EQ(res["validated"], true) << res.dump();
      EXPECT_LE(res["rel_l2_error"].get<double>(), 1e-2);
    }
    if (op == "combine") {
      EXPECT_EQ(res["dtype"], "bf16");
    }
    ASSERT_TRUE(res.contains("kernel_time")) << res.dump();
    EXPECT_EQ(res["kernel_time"].get<std::string>().rfind("unavailable: --device cpu", 0), 0u) << res.dump();
    for (const char* key : {"kernel_us_p50", "kernel_us_p90", "kernel_us_mean", "kernel_span_us_p50", "kernel_gbps", "kernels",
                            "latency_us_p50_cupti_rounds"})
      EXPECT_TRUE(res.contains(key) && res[key].is_null()) << key << " in " << res.dump();
  }
  // ll-v3: fp8; ht-v3: fp8 and bf16; each with 5 backends + nccl_a2a_raw, two ops each.
  EXPECT_EQ(ops.size(), 3u * 6u);
  for (const auto& [key, s] : ops) EXPECT_EQ(s, (std::set<std::string>{"dispatch", "combine"})) << key;
  std::filesystem::remove(out);
}

TEST(BenchCli, BadFlagsExit2) {
  for (const char* args : {"bench --case nope", "bench --backend nope", "bench --iters 0", "bench --routing banana", "bench --kernel-time sometimes"}) {
    CliResult r = run_epx(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
  }
  // --kernel-time on asks for kernel time: on CPU ranks there is none, so it is a bad flag (it ran as auto,
  // printing 'unavailable' and exit 0), named with its value and rule before anything runs.
  CliResult r = run_epx("bench --device cpu --case ll-v3 --backend ll --ranks 2 --iters 1 --warmup 0 --kernel-time on");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--kernel-time = on: on needs --device cuda"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("epx bench: 1 case(s)"), std::string::npos) << "nothing runs: " << r.out;
}

// --flat-combine: partial_fp32 (default) and partial_bf16 both run every Flat backend on CPU ranks with identity
// experts writing the matching rows (fp32 / bf16). One rounding matches the identity formula to the bit on nearly
// every element; two roundings leave a visible share of elements 1 ulp off (still within 1 ulp and rel L2 1e-2).
// ll ignores the option (its row says null). A value outside the two exits 2.
TEST(BenchCli, FlatCombineBothModesOnCpu) {
  std::map<std::string, double> mismatch;  // flat_combine/backend -> mismatch_fraction
  for (const std::string mode : {"", "partial_fp32", "partial_bf16"}) {
    const auto out = temp_path("flat_" + (mode.empty() ? std::string("default") : mode) + ".json");
    const std::string flag = mode.empty() ? "" : " --flat-combine " + mode;
    CliResult r = run_epx("bench --device cpu --case ht-v3 --dtype bf16 --backend all --ranks 2 --iters 1 --warmup 0" + flag +
                          " --json " + out.string());
    ASSERT_EQ(r.code, 0) << r.out;
    if (!mode.empty()) {
      EXPECT_NE(r.out.find("--flat-combine " + mode), std::string::npos) << "the repro line names it: " << r.out;
    }
    std::ifstream f(out);
    const nlohmann::json j = nlohmann::json::parse(f);
    int flat_rows = 0;
    for (const auto& res : j["results"]) {
      const std::string b = res["backend"];
      if (b == "nccl_a2a_raw") continue;
      EXPECT_EQ(res["status"], "ran") << res.dump();
      ASSERT_EQ(res["validated"], true) << res.dump();
      EXPECT_LE(res["beyond_1ulp_fraction"].get<double>(), 1e-3) << res.dump();
      if (b == "ll") {
        EXPECT_TRUE(res["flat_combine"].is_null()) << res.dump();
        continue;
      }
      ++flat_rows;
      const std::string fc = res["flat_combine"];
      EXPECT_EQ(fc, mode.empty() ? "partial_fp32" : mode) << res.dump();
      if (!mode.empty() && res["op"] == "combine") mismatch[fc + "/" + b] = res["mismatch_fraction"].get<double>();
    }
    EXPECT_EQ(flat_rows, 8) << "naive, allgather_reducescatter, all2allv, ht x dispatch, combine";
    std::filesystem::remove(out);
  }
  for (const char* b : {"naive", "allgather_reducescatter", "all2allv", "ht"}) {
    ASSERT_TRUE(mismatch.count(std::string("partial_fp32/") + b) && mismatch.count(std::string("partial_bf16/") + b)) << b;
    EXPECT_LE(mismatch[std::string("partial_fp32/") + b], 1e-3) << b << ": one rounding";
    EXPECT_GT(mismatch[std::string("partial_bf16/") + b], 1e-2) << b << ": two roundings";
  }
  CliResult bad = run_epx("bench --device cpu --flat-combine partial_fp16");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("--flat-combine"), std::string::npos) << bad.out;
}

// --padded: naive / allgather_reducescatter / all2allv in their padded form (use_worst_case_sizing), each beside its
// nccl_raw:<backend> twin (the Group collectives of that form, same bytes) on CPU ranks (host timers). The padded rows
// validate against the identity formula and carry the padded form's bytes (rank 0's DispatchStats: (R - 1) blocks of
// the record header and C rows, where the dynamic form sends T rows without a header); the twins name their
// collective and its send bytes; ratio_to_nccl_raw and the host enqueue time are there. A backend without a padded
// form is refused before anything runs.
TEST(BenchCli, PaddedFormBesideItsRawCollectivesOnCpu) {
  // ll-v3 on CPU ranks: T = C = 16, H = 7168, K = 8, fp8 rows of 7168 + 56 * 4 + 8 * 4 + 8 * 4 + 4 = 7460 B; the
  // block: a 64-byte header (8 int64 record fields at R = 2) + 16 rows, 119424 B. Combine: fp32 partials, C * H * 4.
  constexpr int64_t R = 2, C = 16, H = 7168, kRow = 7460, kBlock = 64 + C * kRow, kPartF32 = C * H * 4;
  const auto out = temp_path("padded.json");
  CliResult r = run_epx("bench --device cpu --case ll-v3 --backend all --padded --ranks 2 --iters 3 --warmup 1 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("padded form against the raw collectives it makes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--padded"), std::string::npos) << "the repro line names it: " << r.out;
  std::ifstream f(out);
  const nlohmann::json j = nlohmann::json::parse(f);
  std::map<std::string, nlohmann::json> rows;  // backend/op -> row
  for (const auto& res : j["results"]) rows[res["backend"].get<std::string>() + "/" + res["op"].get<std::string>()] = res;
  ASSERT_EQ(rows.size(), 12u) << "3 padded backends + 3 twins, dispatch and combine: " << j.dump(1);
  // The twins' collectives and send bytes (gather_cuda.cpp, all2allv_cuda.cpp).
  const std::map<std::string, std::pair<std::string, int64_t>> raw = {
      {"naive/dispatch", {"group.all_gather of 2 x " + std::to_string(kBlock) + " B", kBlock}},
      {"naive/combine", {"group.all_gather of 2 x " + std::to_string(R * kPartF32) + " B (fp32", R * kPartF32}},
      {"allgather_reducescatter/dispatch", {"group.all_gather of 2 x " + std::to_string(kBlock) + " B", kBlock}},
      {"allgather_reducescatter/combine", {"group.reduce_scatterv of 2 x " + std::to_string(kPartF32) + " B (fp32", R * kPartF32}},
      {"all2allv/dispatch", {"group.all_to_allv of 2 x " + std::to_string(kBlock) + " B", R * kBlock}},
      {"all2allv/combine", {"group.all_to_allv of 2 x " + std::to_string(kPartF32) + " B (fp32", R * kPartF32}},
  };
  for (const auto& [key, want] : raw) {
    ASSERT_TRUE(rows.count(key) && rows.count("nccl_raw:" + key)) << key;
    const nlohmann::json& p = rows[key];
    const nlohmann::json& t = rows["nccl_raw:" + key];
    EXPECT_EQ(p["form"], "padded") << p.dump();
    EXPECT_EQ(p["status"], "ran") << p.dump();
    ASSERT_EQ(p["validated"], true) << p.dump();
    EXPECT_LE(p["beyond_1ulp_fraction"].get<double>(), 1e-3) << p.dump();
    EXPECT_TRUE(p["predicted_us"].is_null()) << p.dump();
    ASSERT_TRUE(p["ratio_to_nccl_raw"].is_number()) << p.dump();
    EXPECT_NEAR(p["ratio_to_nccl_raw"].get<double>(), p["latency_us_p50"].get<double>() / t["latency_us_p50"].get<double>(), 1e-9);
    EXPECT_GT(p["prepare_plus_finalize_ratio_to_nccl_raw"].get<double>(), 0.0) << p.dump();
    for (const nlohmann::json* row : {&p, &t}) {
      ASSERT_TRUE((*row)["host_enqueue_us_p50"].is_number()) << row->dump();
      EXPECT_GT((*row)["host_enqueue_us_p50"].get<double>(), 0.0) << row->dump();
      EXPECT_EQ((*row)["iterations"], 3) << row->dump();
    }
    if (key.find("/dispatch") != std::string::npos) {
      EXPECT_EQ(p["remote_bytes_rank0"], (R - 1) * kBlock) << p.dump();
    }
    EXPECT_EQ(t["validated"], false) << t.dump();
    EXPECT_TRUE(t["form"].is_null()) << t.dump();
    EXPECT_EQ(t["raw_calls"].get<std::string>().rfind(want.first, 0), 0u) << want.first << " vs " << t.dump();
    EXPECT_EQ(t["moved_bytes_per_rank"].get<double>(), static_cast<double>(want.second)) << t.dump();
  }
  std::filesystem::remove(out);

  // The dynamic form of the same backend (no --padded) sends T rows without the header, and says so; naive's padded
  // form with bf16 partials all-reduces them (R * C rows of 2H bytes).
  for (const std::string flags : {"--backend naive", "--backend naive --padded --flat-combine partial_bf16"}) {
    CliResult d = run_epx("bench --device cpu --case ll-v3 --ranks 2 --iters 1 --warmup 0 " + flags + " --json " + out.string());
    ASSERT_EQ(d.code, 0) << d.out;
    std::ifstream g(out);
    const nlohmann::json dj = nlohmann::json::parse(g);
    bool saw = false;
    for (const auto& res : dj["results"]) {
      if (res["op"] != "dispatch" && res["backend"] == "naive") continue;
      if (flags.find("--padded") == std::string::npos) {
        ASSERT_EQ(res["backend"], "naive") << res.dump();
        EXPECT_EQ(res["form"], "dynamic") << res.dump();
        EXPECT_EQ(res["remote_bytes_rank0"], (R - 1) * C * kRow) << res.dump();
        EXPECT_TRUE(res["ratio_to_nccl_raw"].is_null()) << res.dump();
        saw = true;
      } else if (res["backend"] == "nccl_raw:naive" && res["op"] == "combine") {
        EXPECT_EQ(res["raw_calls"], "group.all_reduce_sum of " + std::to_string(R * C * H * 2) + " B (bf16 partials)") << res.dump();
        EXPECT_EQ(res["moved_bytes_per_rank"].get<double>(), static_cast<double>(R * C * H * 2)) << res.dump();
        saw = true;
      }
    }
    EXPECT_TRUE(saw) << flags << ": " << dj.dump(1);
    std::filesystem::remove(out);
  }

  CliResult bad = run_epx("bench --device cpu --case ll-v3 --backend ll --padded --ranks 2 --iters 1");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("has no padded form"), std::string::npos) << bad.out;
  EXPECT_EQ(bad.out.find("epx bench: 1 case(s)"), std::string::npos) << "nothing runs: " << bad.out;
}

// epx-gemm-bench (CUDA builds only) parses --stamps before it opens a GPU: a flag that is not an unsigned
// 32-bit integer is named and exits 2 (std::stoul threw out of main: abort; "-1" wrapped to 2^64 - 1).
TEST(BenchCli, GemmBenchBadStampsExit2) {
  const std::string bench = std::string(EPX_BINARY_DIR) + "/epx-gemm-bench";
  if (!std::filesystem::exists(bench)) GTEST_SKIP() << "no " << bench << " (CPU-only build)";
  for (const std::string bad : {"x", "1,x", "-1", "4294967296", "99999999999999999999999"}) {
    const epx::test::CommandResult r = epx::test::run_command(bench + " --stamps " + bad + " 2>&1");
    EXPECT_EQ(r.code, 2) << bad << "\n" << r.out;
    EXPECT_NE(r.out.find("must be an unsigned 32-bit integer"), std::string::npos) << bad << "\n" << r.out;
  }
}

TEST(BenchCli, HelpNamesTheAccounting) {
  CliResult r = run_epx("bench --help");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* s : {"--case", "--backend", "--ranks", "--iters", "--warmup", "--json", "--routing", "--kernel-time", "deepep-ll", "deepep-ht",
                        "nccl_a2a_raw", "--padded", "nccl_raw:<backend>", "host enqueue"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
}

}  // namespace
