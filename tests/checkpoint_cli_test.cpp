// tests/checkpoint_cli_test.cpp: `epx moe --checkpoint DIR --layer N [--hidden FILE]` as a user
// runs it, on small checkpoints written here: every backend validated against the reference on the
// checkpoint's router and weights, hidden states from .npy and safetensors files (and the output
// changes with them), and one-line errors with exit status 2 for bad flags or a broken checkpoint.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"
#include "epx/checkpoint.h"
#include "epx/moe.h"
#include "epx/trace.h"

#pragma GCC diagnostic ignored "-Wmissing-field-initializers"  // designated initializers (GCC PR 96868)

namespace epx {
namespace {

namespace fs = std::filesystem;
const std::string kEpx = std::string(EPX_BINARY_DIR) + "/epx";

fs::path root() { return fs::temp_directory_path() / ("epx_ckpt_cli_" + std::to_string(::getpid())); }

class Cleanup : public ::testing::Environment {
 public:
  void TearDown() override { fs::remove_all(root()); }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new Cleanup);

struct CliRun {
  int code = -1;
  std::string out, err;
};

CliRun epx(const std::string& args) {
  fs::create_directories(root());
  const test::CommandResult c = test::run_command(kEpx + " " + args, /*capture_stderr=*/true);
  return {c.code, c.out, c.err};
}

std::string checkpoint(const std::string& name, const MoEConfig& cfg, CheckpointConvention conv, int layer, int shards = 1) {
  const std::string dir = (root() / name).string();
  fs::remove_all(dir);
  auto w = MoEWeights::random(cfg, 77);
  write_moe_checkpoint(dir, *w, {.convention = conv, .layer = layer, .num_shards = shards});
  return dir;
}

MoEConfig small(const std::string& preset_name, int num_experts) {
  MoEConfig c = preset(preset_name);
  c.router.num_experts = num_experts;
  return c;
}

TEST(CheckpointCli, EveryBackendPassesOnTheCheckpointLayer) {
  const std::string dir = checkpoint("ds", small("deepseek-v3-mini", 32), CheckpointConvention::deepseek, 3, 2);
  const std::string json = (root() / "ds.json").string();
  const CliRun r = epx("moe --checkpoint " + dir + " --layer 3 --ranks 2 --tokens-per-rank 16 --steps 2 --json " + json);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("deepseek_v3-layer3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("router"), std::string::npos) << "routing defaults to the checkpoint's router:\n" << r.out;
  std::ifstream f(json);
  const nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_FALSE(j.dump().empty());
  EXPECT_NE(j.dump().find("deepseek_v3-layer3"), std::string::npos);
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
}

TEST(CheckpointCli, GptOssLayerRunsWithItsOwnActivationAndBiases) {
  MoEConfig oss = preset("mixtral-8x7b-mini");
  oss.router.top_k = 4;
  oss.routed_format = WeightFormat::mxfp4;
  const std::string dir = checkpoint("oss", oss, CheckpointConvention::gpt_oss, 0);
  const CliRun r = epx("moe --checkpoint " + dir + " --layer 0 --ranks 2 --backend ll --tokens-per-rank 8 --steps 1");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(r.err.find("checkpoint note"), std::string::npos) << "gpt-oss is computed, not noted:\n" << r.err;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
}

TEST(CheckpointCli, HiddenStatesFromNpyAndSafetensors) {
  const MoEConfig cfg = small("qwen1.5-moe-a2.7b-mini", 12);
  const std::string dir = checkpoint("qwen", cfg, CheckpointConvention::qwen_moe, 0);
  const int64_t N = 13, H = cfg.hidden;
  NpyArray a;
  a.descr = "<f4";
  a.shape = {N, H};
  a.data.resize(static_cast<size_t>(N * H * 4));
  std::vector<float> vals(static_cast<size_t>(N * H));
  for (size_t i = 0; i < vals.size(); ++i) vals[i] = std::sin(0.11f * static_cast<float>(i)) * 2.0f;
  std::memcpy(a.data.data(), vals.data(), a.data.size());
  const std::string npy = (root() / "h.npy").string();
  write_npy(npy, a);
  const std::string st = (root() / "h.safetensors").string();
  write_safetensors(st, {{"hidden_states", "F32", {1, N, H}, vals.data(), static_cast<uint64_t>(N * H * 4)},
                         {"other", "F32", {1}, vals.data(), 4}});
  const std::string j1 = (root() / "h1.json").string(), j2 = (root() / "h2.json").string();
  const CliRun r1 = epx("moe --checkpoint " + dir + " --layer 0 --ranks 3 --backend all --steps 1 --hidden " + npy + " --json " + j1);
  EXPECT_EQ(r1.code, 0) << r1.out << r1.err;
  const CliRun r2 = epx("moe --checkpoint " + dir + " --layer 0 --ranks 3 --backend naive --steps 1 --hidden " + st + " --json " + j2);
  EXPECT_EQ(r2.code, 0) << r2.out << r2.err;
  const CliRun r3 = epx("moe --checkpoint " + dir + " --layer 0 --ranks 2 --backend naive --steps 1 --hidden " + st + ":other");
  EXPECT_EQ(r3.code, 2) << r3.out << r3.err;
  EXPECT_NE(r3.err.find("other"), std::string::npos) << r3.err;
  const CliRun r4 = epx("moe --checkpoint " + dir + " --layer 0 --ranks 2 --tokens-per-rank 4 --hidden " + npy);
  EXPECT_EQ(r4.code, 2) << r4.out << r4.err;
  // A wrong hidden size names the file's shape (it printed "shape = 2", the rank).
  a.shape = {N / 2, 2 * H};
  a.data.resize(static_cast<size_t>((N / 2) * 2 * H * 4));
  const std::string wide = (root() / "wide.npy").string();
  write_npy(wide, a);
  const CliRun r5 = epx("moe --checkpoint " + dir + " --layer 0 --ranks 2 --backend naive --steps 1 --hidden " + wide);
  EXPECT_EQ(r5.code, 2) << r5.out << r5.err;
  EXPECT_NE(r5.err.find("shape = [" + std::to_string(N / 2) + ", " + std::to_string(2 * H) + "]"), std::string::npos) << r5.err;
  const CliRun r6 = epx("moe --checkpoint " + dir + " --layer 0 --ranks 2 --backend naive --steps 1 --hidden " + st + ":other");
  EXPECT_NE(r6.err.find("shape = [1]"), std::string::npos) << r6.err;
}

TEST(CheckpointCli, BadFlagsAndBrokenCheckpointsAreOneLineErrors) {
  const std::string dir = checkpoint("mix", preset("mixtral-8x7b-mini"), CheckpointConvention::mixtral, 1);
  struct Case { std::string args, fragment; };
  const std::vector<Case> cases = {
      {"moe --checkpoint " + dir, "--layer"},
      {"moe --checkpoint " + dir + " --layer 1 --preset deepseek-v3-mini", "--preset"},
      {"moe --layer 1", "needs --checkpoint"},
      {"moe --checkpoint " + dir + " --layer 5", "num_hidden_layers"},
      {"moe --checkpoint " + (root() / "nope").string() + " --layer 0", "must be a directory"},
  };
  for (const Case& c : cases) {
    const CliRun r = epx(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(c.fragment), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.args << "\n" << r.err;
  }
  // A truncated checkpoint file: a clear error naming it, never a crash.
  const fs::path f = fs::path(dir) / "model.safetensors";
  fs::resize_file(f, fs::file_size(f) / 2);
  const CliRun r = epx("moe --checkpoint " + dir + " --layer 1 --ranks 2");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find(f.string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("truncated"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace epx
