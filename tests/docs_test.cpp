// tests/docs_test.cpp: the docs keep telling the same story as the code (STYLE.md §5, §10):
// docs/architecture.md names every src/ folder and every public interface header, and getenv
// appears nowhere in src/ but src/core/config.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

namespace {
const fs::path kRoot(EPX_SOURCE_DIR);

std::string read(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
}  // namespace

TEST(Docs, ArchitectureNamesEverySrcFolder) {
  const std::string doc = read(kRoot / "docs" / "architecture.md");
  ASSERT_FALSE(doc.empty()) << "docs/architecture.md is missing";
  int folders = 0;
  for (const auto& e : fs::directory_iterator(kRoot / "src")) {
    if (!e.is_directory()) continue;
    ++folders;
    const std::string name = "src/" + e.path().filename().string() + "/";
    EXPECT_NE(doc.find(name), std::string::npos) << "docs/architecture.md does not describe " << name;
  }
  EXPECT_GT(folders, 0);
}

TEST(Docs, ArchitectureNamesEveryInterfaceHeader) {
  const std::string doc = read(kRoot / "docs" / "architecture.md");
  int headers = 0;
  for (const auto& e : fs::directory_iterator(kRoot / "include" / "epx")) {
    if (e.path().extension() != ".h") continue;
    ++headers;
    const std::string name = "epx/" + e.path().filename().string();
    EXPECT_NE(doc.find(name), std::string::npos) << "docs/architecture.md does not name " << name;
  }
  EXPECT_GT(headers, 0);
}

TEST(Docs, GetenvOnlyInConfigCpp) {
  const fs::path allowed = kRoot / "src" / "core" / "config.cpp";
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(kRoot / "src")) {
    if (!e.is_regular_file()) continue;
    const std::string ext = e.path().extension().string();
    if (ext != ".cpp" && ext != ".h" && ext != ".cu" && ext != ".cuh" && ext != ".hpp" && ext != ".cc") continue;
    ++files;
    if (fs::equivalent(e.path(), allowed)) continue;
    EXPECT_EQ(read(e.path()).find("getenv"), std::string::npos)
        << e.path().lexically_relative(kRoot).string() << " reads the environment: only src/core/config.cpp may (use epx::Config or env_or)";
  }
  EXPECT_GT(files, 0);
}

TEST(Docs, ReadmeGivesTheTwoCommands) {
  const std::string readme = read(kRoot / "README.md");
  EXPECT_NE(readme.find("bash scripts/run-main.sh"), std::string::npos);
  EXPECT_NE(readme.find("bash scripts/run-tests.sh"), std::string::npos);
  EXPECT_TRUE(fs::exists(kRoot / "scripts" / "run-main.sh"));
  EXPECT_TRUE(fs::exists(kRoot / "scripts" / "run-tests.sh"));
  EXPECT_TRUE(fs::exists(kRoot / ".ci" / "run"));
}
