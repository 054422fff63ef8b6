// tests/launcher_cuda_test.cpp: the GPU main job and benchmark through the epx launcher, as a user
// runs them: `epx moe --device cuda` (validated against the CPU reference), a rank killed mid-run (the
// launcher exits non-zero within the timeout and names it), and `epx bench --device cuda` (every
// backend validated against its CPU twin, nccl_a2a_raw timed). With R GPUs a run is one process per
// GPU; with fewer it runs its R ranks as virtual ranks (threads of one process on GPU 0), and the
// header and the JSON say so (ranks_per_gpu = R, else 1): these tests run either way and check which.
// This process never initialises CUDA (cuda::device_count asks a child), like the epx parent.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

// True when epx runs R ranks as virtual ranks here (fewer visible GPUs than R).
bool virtual_for(int ranks) { return epx::cuda::device_count() < ranks; }

// The placement the run reports: on virtual ranks the header line, JSON ranks_per_gpu = R (top level and
// per row), one GPU named and no NCCL version; else one process per GPU (ranks_per_gpu 1, R GPUs named).
void expect_placement(const CliResult& r, const nlohmann::json& j, int ranks) {
  const bool virt = virtual_for(ranks);
  const int per_gpu = virt ? ranks : 1;
  EXPECT_EQ(j["ranks_per_gpu"], per_gpu) << j["ranks_per_gpu"];
  for (const auto& res : j["results"]) EXPECT_EQ(res["ranks_per_gpu"], per_gpu) << res.dump();
  const std::string device = j["device"].get<std::string>();
  const std::string note = "virtual ranks: " + std::to_string(ranks) + " on one GPU (timings measure one GPU's memory, not NVLink)";
  if (virt) {
    EXPECT_NE(r.out.find(note), std::string::npos) << r.out;
    EXPECT_EQ(device.rfind("1 x ", 0), 0u) << device;
    EXPECT_TRUE(j["nccl_version"].is_null()) << j["nccl_version"];
  } else {
    EXPECT_EQ(r.out.find("virtual ranks:"), std::string::npos) << r.out;
    EXPECT_EQ(device.rfind(std::to_string(ranks) + " x ", 0), 0u) << device;
    EXPECT_FALSE(j["nccl_version"].is_null());
  }
}

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

// `epx moe --device cuda` at R ranks, every backend, checked against the CPU reference.
void moe_every_backend(int ranks, const std::string& name) {
  const auto out = temp_path(name + ".json");
  CliResult r = run_epx("moe --device cuda --ranks " + std::to_string(ranks) +
                        " --preset deepseek-v3-mini --backend all --steps 2 --tokens-per-rank 24 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json(out);
  expect_placement(r, j, ranks);
  expect_layer_results(j, ranks, "deepseek-v3-mini");
  std::filesystem::remove(out);
}

TEST(LauncherCuda, MoeTwoRanksEveryBackend) {
  REQUIRE_GPUS(1);  // fewer than 2: virtual ranks
  moe_every_backend(2, "moe2");
}

TEST(LauncherCuda, MoeFourRanksEveryBackend) {
  REQUIRE_GPUS(1);  // fewer than 4: virtual ranks
  moe_every_backend(4, "moe4");
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
  EXPECT_EQ(j["ranks_per_gpu"], 1);
  std::filesystem::remove(out);
}

TEST(LauncherCuda, MoeTwoRanksChunkedAutoShared) {
  REQUIRE_GPUS(1);  // fewer than 2: virtual ranks
  const auto out = temp_path("moe2c.json");
  // 20 tokens in chunks of 8: three chunks per step; auto gate fuses chunks of M <= fhmoe.max_tokens.
  CliResult r = run_epx("moe --device cuda --ranks 2 --preset qwen1.5-moe-a2.7b-mini --backend all2allv --routing router --shared auto "
              "--chunk-size 8 --dispatch-dtype fp8 --steps 2 --tokens-per-rank 20 --validate-tokens 0 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json(out);
  EXPECT_EQ(j["results"][0]["status"], "pass") << j["results"][0].dump();
  EXPECT_EQ(j["results"][0]["counters"]["chunks"], 6);
  expect_placement(r, j, 2);
  std::filesystem::remove(out);
}

// --mode decode: ll's whole layer captured once as a CUDA graph per rank and replayed every step (on
// virtual ranks each rank's thread captures on its own stream), validated on every token.
TEST(LauncherCuda, MoeTwoRanksDecodeGraphLl) {
  REQUIRE_GPUS(1);  // fewer than 2: virtual ranks
  const auto out = temp_path("moe2d.json");
  CliResult r = run_epx("moe --device cuda --ranks 2 --preset deepseek-v3-mini --backend ll --mode decode --tokens-per-rank 16 "
                        "--steps 3 --validate-tokens 0 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json(out);
  ASSERT_EQ(j["results"].size(), 1u);
  const auto& res = j["results"][0];
  EXPECT_EQ(res["status"], "pass") << res.dump();
  EXPECT_EQ(res["graph"], true) << res.dump();
  EXPECT_EQ(res["validated_tokens"], 2 * 16 * 3) << res.dump();
  expect_placement(r, j, 2);
  std::filesystem::remove(out);
}

TEST(LauncherCuda, DeadRankMakesMoeExitNonZeroNamingIt) {
  if (epx::cuda::device_count() < 2)
    GTEST_SKIP() << "needs 2 GPUs: a rank process killed by a signal (virtual ranks are threads of one process; "
                    "there --debug-kill-rank is a bad flag: DebugKillRankOnVirtualRanksIsABadFlag)";
  CliResult r = run_epx("moe --device cuda --ranks 2 --preset deepseek-v3-mini --backend naive --steps 3 --debug-kill-rank 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(r.seconds, 60.0) << r.out;
  EXPECT_NE(r.out.find("rank 1 was killed by signal 9"), std::string::npos) << r.out;
}

// Killing one rank's process is what the flag tests; virtual ranks share one process, so it is refused.
TEST(LauncherCuda, DebugKillRankOnVirtualRanksIsABadFlag) {
  const int gpus = epx::cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "no GPU";
  CliResult r = run_epx("moe --device cuda --ranks " + std::to_string(gpus + 1) + " --preset deepseek-v3-mini --backend naive --steps 3 "
                        "--debug-kill-rank 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--debug-kill-rank"), std::string::npos) << r.out;
}

// Beyond the GPUs, ranks run as virtual ranks up to 64; more is a bad flag naming --ranks.
TEST(LauncherCuda, TooManyRanksIsABadFlag) {
  const int gpus = epx::cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "no GPU";
  const int ranks = std::max(gpus, 64) + 1;
  for (const char* cmd : {"moe --device cuda --preset deepseek-v3-mini --ranks ", "bench --device cuda --case ll-v3 --ranks "}) {
    CliResult r = run_epx(cmd + std::to_string(ranks));
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("--ranks"), std::string::npos) << r.out;
  }
}

TEST(LauncherCuda, BenchValidatesEveryBackend) {
  REQUIRE_GPUS(1);  // fewer than 2: virtual ranks
  const auto out = temp_path("bench.json");
  CliResult r = run_epx("bench --device cuda --case ll-v3 --backend all --ranks 2 --iters 5 --warmup 2 --json " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json(out);
  const bool virt = virtual_for(2);
  expect_placement(r, j, 2);
  std::set<std::string> validated, raw_ops;
  for (const auto& res : j["results"]) {
    if (res["validated"] == true) validated.insert(res["backend"].get<std::string>());
    if (res["backend"] == "nccl_a2a_raw") {
      raw_ops.insert(res["op"].get<std::string>());
      EXPECT_GT(res["latency_us_p50"].get<double>(), 0.0);
      // Predictions were written for NVLink: none on virtual ranks.
      EXPECT_EQ(res["predicted_us"].is_number(), !virt) << res.dump();
    }
    if (virt) {
      EXPECT_NE(res["status"], "unsupported") << "every backend runs on virtual ranks: " << res.dump();
      EXPECT_NE(res["kernel_time"].get<std::string>().find("virtual ranks"), std::string::npos) << res.dump();
    }
  }
  for (const char* b : {"naive", "allgather_reducescatter", "all2allv"}) EXPECT_TRUE(validated.count(b)) << b;
  if (virt) {
    for (const char* b : {"ll", "ht"}) EXPECT_TRUE(validated.count(b)) << b;
  }
  EXPECT_EQ(raw_ops, (std::set<std::string>{"dispatch", "combine"}));
  if (virt) {
    EXPECT_NE(r.out.find("epx bench measures one GPU's memory, not NVLink"), std::string::npos) << r.out;
  }
  std::filesystem::remove(out);
}

// --graph: ll's prepare and finalize replayed from CUDA graphs (each rank's own), with the T = 1 floor.
TEST(LauncherCuda, BenchGraphLl) {
  REQUIRE_GPUS(1);  // fewer than 2: virtual ranks
  const auto out = temp_path("bench_graph.json");
  CliResult r = run_epx("bench --device cuda --case ll-v3 --backend ll --ranks 2 --graph --kernel-time off --iters 5 --warmup 2 --json " +
                        out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json(out);
  expect_placement(r, j, 2);
  int full = 0, floor = 0;
  for (const auto& res : j["results"]) {
    ASSERT_EQ(res["backend"], "ll") << res.dump();
    EXPECT_EQ(res["timing"], "cuda-graph replay") << res.dump();
    EXPECT_GT(res["latency_us_p50"].get<double>(), 0.0) << res.dump();
    if (res["tokens_per_rank"] == 1) {
      ++floor;
    } else {
      ++full;
      EXPECT_EQ(res["validated"], true) << res.dump();
    }
  }
  EXPECT_EQ(full, 2);   // dispatch, combine
  EXPECT_EQ(floor, 2);  // the same at T = 1
  std::filesystem::remove(out);
}

// --kernel-time on asks for CUPTI's per-process timer on every rank: virtual ranks share one process.
TEST(LauncherCuda, BenchKernelTimeOnVirtualRanksIsABadFlag) {
  const int gpus = epx::cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "no GPU";
  CliResult r = run_epx("bench --device cuda --case ll-v3 --backend naive --ranks " + std::to_string(gpus + 1) + " --kernel-time on");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--kernel-time = on"), std::string::npos) << r.out;
}

}  // namespace
