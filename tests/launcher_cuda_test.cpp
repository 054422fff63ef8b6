// tests/launcher_cuda_test.cpp: the GPU main job and benchmark through the epx launcher, as a user
// runs them: `epx moe --device cuda` (one process per GPU, validated against the CPU reference),
// a rank killed mid-run (the launcher exits non-zero within the timeout and names it), and
// `epx bench` on CUDA (every NCCL backend validated against its CPU twin, nccl_a2a_raw timed).
// This process never initialises CUDA (cuda::device_count asks a child), like the epx parent.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "test_util.h"
#include "epx/cuda.h"

namespace {

const std::string kEpx = std::string(EPX_BINARY_DIR) + "/epx";

struct CliResult {
  int code = -1;
  std::string out;
  double seconds = 0;
};

CliResult run_epx(const std::string& args) {
  const auto t0 = std::chrono::steady_clock::now();
  const epx::test::CommandResult c = epx::test::run_command(kEpx + " " + args + " 2>&1");
  return {c.code, c.out, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("epx_launcher_cuda_test_" + std::to_string(::getpid()) + "_" + name);
}

nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

#define REQUIRE_GPUS(n)                                                                                  \
  do {                                                                                                   \
    if (epx::cuda::device_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs, found " << epx::cuda::device_count(); \
  } while (0)

// The NCCL host-collective backends must pass; ll and ht pass or are reported unsupported on CUDA.
void expect_layer_results(const nlohmann::json& j, int ranks, const std::string& preset) {
  std::set<std::string> passed;
  for (const auto& res : j["results"]) {
    const std::string b = res["backend"];
    EXPECT_EQ(res["ranks"], ranks);
    EXPECT_EQ(res["case"], preset);
    if (res["status"] == "pass") {
      passed.insert(b);
      EXPECT_EQ(res["validated"], true);
      EXPECT_GT(res["validated_tokens"].get<int64_t>(), 0);
      EXPECT_LE(res["rel_l2_error"].get<double>(), 1e-2);
      EXPECT_GT(res["latency_us_p50"].get<double>(), 0.0);
    } else {
      EXPECT_TRUE(b == "ll" || b == "ht") << res.dump();
      EXPECT_EQ(res["status"], "unsupported") << res.dump();
    }
  }
  for (const char* b : {"naive", "allgather_reducescatter", "all2allv"}) EXPECT_TRUE(passed.count(b)) << b << " did not pass";
}

TEST(LauncherCuda, MoeTwoRanksEveryBackend) {
  REQUIRE_GPUS(2);
  const auto out = temp_path("moe2.json");
  CliResult r = run_epx("moe --device cuda --ranks 2 --preset deepseek-v3-mini --backend all --steps 2 --tokens-per-rank 24 --json " +
              out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json(out);
  EXPECT_NE(j["device"].get<std::string>().find("2 x "), std::string::npos) << j["device"];
  EXPECT_FALSE(j["nccl_version"].is_null());
  expect_layer_results(j, 2, "deepseek-v3-mini");
  std::filesystem::remove(out);
}

TEST(LauncherCuda, MoeOneRankRouterFp8SeparateGatedShared) {
  REQUIRE_GPUS(1);
  const auto out = temp_path("moe1.json");
  // Qwen1.5-MoE: shared expert with a sigmoid gate, run separately; the model's router on the GPU.
  CliResult r = run_epx("moe --device cuda --ranks 1 --preset qwen1.5-moe-a2.7b-mini --backend naive --routing router --shared separate "
              "--dispatch-dtype fp8 --steps 2 --tokens-per-rank 40 --validate-tokens 0 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json(out);
  ASSERT_EQ(j["results"].size(), 1u);
  EXPECT_EQ(j["results"][0]["status"], "pass") << j["results"][0].dump();
  EXPECT_EQ(j["results"][0]["validated_tokens"], 80);
  EXPECT_EQ(j["results"][0]["counters"]["shared_separate"], 2);
  std::filesystem::remove(out);
}

TEST(LauncherCuda, MoeTwoRanksChunkedAutoShared) {
  REQUIRE_GPUS(2);
  const auto out = temp_path("moe2c.json");
  // 20 tokens in chunks of 8: three chunks per step; auto gate fuses chunks of M <= fhmoe.max_tokens.
  CliResult r = run_epx("moe --device cuda --ranks 2 --preset qwen1.5-moe-a2.7b-mini --backend all2allv --routing router --shared auto "
              "--chunk-size 8 --dispatch-dtype fp8 --steps 2 --tokens-per-rank 20 --validate-tokens 0 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json(out);
  EXPECT_EQ(j["results"][0]["status"], "pass") << j["results"][0].dump();
  EXPECT_EQ(j["results"][0]["counters"]["chunks"], 6);
  std::filesystem::remove(out);
}

TEST(LauncherCuda, DeadRankMakesMoeExitNonZeroNamingIt) {
  REQUIRE_GPUS(2);
  CliResult r = run_epx("moe --device cuda --ranks 2 --preset deepseek-v3-mini --backend naive --steps 3 --debug-kill-rank 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(r.seconds, 60.0) << r.out;
  EXPECT_NE(r.out.find("rank 1 was killed by signal 9"), std::string::npos) << r.out;
}

TEST(LauncherCuda, TooManyRanksIsABadFlag) {
  const int gpus = epx::cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "no GPU";
  CliResult r = run_epx("moe --device cuda --ranks " + std::to_string(gpus + 1) + " --preset deepseek-v3-mini");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--ranks"), std::string::npos) << r.out;
}

TEST(LauncherCuda, BenchValidatesEveryNcclBackend) {
  REQUIRE_GPUS(2);
  const auto out = temp_path("bench.json");
  CliResult r = run_epx("bench --case ll-v3 --backend all --ranks 2 --iters 5 --warmup 2 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json(out);
  std::set<std::string> validated, raw_ops;
  for (const auto& res : j["results"]) {
    if (res["validated"] == true) validated.insert(res["backend"].get<std::string>());
    if (res["backend"] == "nccl_a2a_raw") {
      raw_ops.insert(res["op"].get<std::string>());
      EXPECT_GT(res["latency_us_p50"].get<double>(), 0.0);
      EXPECT_TRUE(res["predicted_us"].is_number());
    }
  }
  for (const char* b : {"naive", "allgather_reducescatter", "all2allv"}) EXPECT_TRUE(validated.count(b)) << b;
  EXPECT_EQ(raw_ops, (std::set<std::string>{"dispatch", "combine"}));
  std::filesystem::remove(out);
}

}  // namespace
