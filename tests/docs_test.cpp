// tests/docs_test.cpp: the docs keep telling the same story as the code (STYLE.md §5, §10):
// docs/architecture.md names every src/ folder and every public interface header, getenv
// appears nowhere in src/ but src/core/config.cpp, the product carries no lab notes (issue 27), the README
// stays a front page (at most 250 lines), and every knob table in the docs is the Config registry's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "epx/config.h"

namespace fs = std::filesystem;

namespace {
const fs::path kRoot(EPX_SOURCE_DIR);

std::string read(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; }
bool digits(const std::string& s, size_t pos, size_t n) {
  for (size_t i = pos; i < pos + n; ++i)
    if (std::isdigit(static_cast<unsigned char>(s[i])) == 0) return false;
  return true;
}

/// What makes `line` a lab note, or "" if nothing does: the word "session" or "sessions" in any case, standing
/// alone (an identifier that contains it, such as NCCL's ncclLsaBarrierSession, does not count), or an ISO date
/// (YYYY-MM-DD). Those belong in bench/NOTES.md, the lab notebook; the product says what the code does and
/// why, in the present tense, and cites a NOTES.md section where a default's history matters.
std::string lab_note(const std::string& line) {
  static const std::string kWord = std::string("sess") + "ion";  // in pieces, so that this file holds no hit
  std::string low(line);
  std::transform(low.begin(), low.end(), low.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (size_t p = low.find(kWord); p != std::string::npos; p = low.find(kWord, p + 1)) {
    size_t end = p + kWord.size();
    if (end < low.size() && low[end] == 's') ++end;
    if ((p == 0 || !word_char(low[p - 1])) && (end == low.size() || !word_char(low[end])))
      return "the word '" + line.substr(p, end - p) + "'";
  }
  for (size_t p = 0; p + 10 <= line.size(); ++p) {
    if (p > 0 && word_char(line[p - 1])) continue;
    if (digits(line, p, 4) && line[p + 4] == '-' && digits(line, p + 5, 2) && line[p + 7] == '-' && digits(line, p + 8, 2) &&
        (p + 10 == line.size() || !word_char(line[p + 10])))
      return "the date " + line.substr(p, 10);
  }
  return "";
}

/// Appends "file:line: what: text" for every lab note in `file` to `hits`.
void find_lab_notes(const fs::path& file, std::vector<std::string>& hits) {
  std::istringstream in(read(file));
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string what = lab_note(line);
    if (what.empty()) continue;
    const size_t first = line.find_first_not_of(" \t");
    std::string text = first == std::string::npos ? line : line.substr(first);
    if (text.size() > 140) text = text.substr(0, 140) + " ...";
    hits.push_back(file.lexically_relative(kRoot).string() + ":" + std::to_string(n) + ": " + what + ": " + text);
  }
}

std::string lines(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += "  " + x + "\n";
  return s;
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

// Issue 27, "product, not lab": the code, its comments, docstrings and help text, and the docs carry no
// session numbers and no dates (bench/NOTES.md does). Every source and markdown file of the product is read.
TEST(Docs, NoLabNotesInTheProduct) {
  std::vector<std::string> hits;
  int files = 0;
  for (const char* dir : {"src", "include", "python/epx", "python/src", "tools/epx", "docs"}) {
    ASSERT_TRUE(fs::is_directory(kRoot / dir)) << dir;
    for (const auto& e : fs::recursive_directory_iterator(kRoot / dir)) {
      if (!e.is_regular_file()) continue;
      const std::string ext = e.path().extension().string();
      if (ext != ".cpp" && ext != ".h" && ext != ".cu" && ext != ".cuh" && ext != ".hpp" && ext != ".cc" && ext != ".py" &&
          ext != ".md" && ext != ".txt")
        continue;
      ++files;
      find_lab_notes(e.path(), hits);
    }
  }
  EXPECT_GT(files, 0);
  EXPECT_TRUE(hits.empty()) << hits.size() << " lines read like lab notes (say what the code does and why; the "
                            << "history goes to bench/NOTES.md, cited at most once per knob):\n"
                            << lines(hits);
}

// The README is the product's front page: the same rule.
TEST(Docs, NoLabNotesInTheReadme) {
  std::vector<std::string> hits;
  ASSERT_TRUE(fs::exists(kRoot / "README.md"));
  find_lab_notes(kRoot / "README.md", hits);
  EXPECT_TRUE(hits.empty()) << hits.size() << " lines of README.md read like lab notes (the history goes to "
                            << "bench/NOTES.md):\n"
                            << lines(hits);
}

// The scanner itself: what counts as a lab note and what does not.
TEST(Docs, LabNoteScannerFindsWordsAndDates) {
  const std::string w = std::string("Sess") + "ion";
  EXPECT_NE(lab_note("// measured in the seventh " + w + "s"), "");
  EXPECT_NE(lab_note("// (" + w + " 7)"), "");
  EXPECT_NE(lab_note("batch of 2026-11-30: 3 us"), "");
  EXPECT_EQ(lab_note("ncclLsaBarrier" + w + "<ncclCoopCta> bar"), "");
  EXPECT_EQ(lab_note("a " + w + "_id or " + w + "less value"), "");
  EXPECT_EQ(lab_note("shape 4096-128-64 and 12026-11-30x"), "");
}

TEST(Docs, ReadmeIsAtMost250Lines) {
  std::istringstream in(read(kRoot / "README.md"));
  std::string line;
  int n = 0;
  while (std::getline(in, line)) ++n;
  EXPECT_GT(n, 0);
  EXPECT_LE(n, 250) << "README.md is for users: move detail to docs/ and link it";
}

namespace {
const std::string kBlockStart = "<!-- knobs ";
const std::string kBlockEnd = "<!-- end knobs -->";

std::vector<fs::path> doc_files() {
  std::vector<fs::path> files{kRoot / "README.md"};
  for (const auto& e : fs::directory_iterator(kRoot / "docs"))
    if (e.path().extension() == ".md") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

/// The first line where the registry's table and the document's differ, both shown.
std::string first_difference(const std::string& want, const std::string& got) {
  std::istringstream a(want), b(got);
  std::string la, lb;
  for (int n = 1;; ++n) {
    const bool ha = static_cast<bool>(std::getline(a, la)), hb = static_cast<bool>(std::getline(b, lb));
    if (!ha && !hb) return "";
    if (!ha || !hb || la != lb)
      return "table line " + std::to_string(n) + ":\n  registry: " + (ha ? la : "(none)") + "\n  document: " + (hb ? lb : "(none)") + "\n";
  }
}
}  // namespace

// Every generated knob table (between "<!-- knobs PREFIX: generated by ... -->" and "<!-- end knobs -->") is
// what `epx info --knobs PREFIX` prints from the Config registry; docs/configuration.md holds the full one.
// On a difference: python3 tools/update_knob_tables.py rewrites them.
TEST(Docs, KnobTablesAreTheRegistrys) {
  int blocks = 0;
  bool full = false;
  for (const fs::path& file : doc_files()) {
    const std::string text = read(file), name = file.lexically_relative(kRoot).string();
    for (size_t p = text.find(kBlockStart); p != std::string::npos; p = text.find(kBlockStart, p + 1)) {
      const size_t head_end = text.find('\n', p);
      ASSERT_NE(head_end, std::string::npos) << name;
      const std::string head = text.substr(p + kBlockStart.size(), head_end - p - kBlockStart.size());
      const std::string prefix = head.substr(0, head.find(':'));
      const size_t end = text.find(kBlockEnd, head_end);
      ASSERT_NE(end, std::string::npos) << name << ": a knob table without " << kBlockEnd;
      const std::string got = text.substr(head_end + 1, end - head_end - 1);
      const std::string want = epx::Config::knobs_markdown(prefix);
      ++blocks;
      full = full || (prefix.empty() && name == "docs/configuration.md");
      EXPECT_EQ(got, want) << name << ": the knob table '" << prefix << "' differs from the registry (src/core/config.cpp); "
                           << "python3 tools/update_knob_tables.py rewrites it\n" << first_difference(want, got);
    }
  }
  EXPECT_TRUE(full) << "docs/configuration.md lacks the table of every knob (" << kBlockStart << ": generated by ...)";
  EXPECT_GT(blocks, 0);
}
// A hand-written table row that names a knob (| `ll.num_blocks` | ...) drifts from the registry: the docs use
// the generated tables instead. Back-quoted names that look like knobs but are not (a removed knob) are named too.
TEST(Docs, NoHandWrittenKnobRowsAndNoUnknownKnobs) {
  std::vector<std::string> keys;
  for (const epx::Knob& k : epx::Config::knobs()) keys.push_back(k.key);
  std::vector<std::string> hits;
  for (const fs::path& file : doc_files()) {
    std::istringstream in(read(file));
    std::string line;
    bool generated = false;
    for (int n = 1; std::getline(in, line); ++n) {
      const std::string where = file.lexically_relative(kRoot).string() + ":" + std::to_string(n) + ": ";
      if (line.rfind(kBlockStart, 0) == 0) generated = true;
      if (line.rfind(kBlockEnd, 0) == 0) generated = false;
      if (generated) continue;
      for (size_t p = line.find('`'); p != std::string::npos; p = line.find('`', p + 1)) {
        const size_t q = line.find('`', p + 1);
        if (q == std::string::npos) break;
        const std::string word = line.substr(p + 1, q - p - 1);
        p = q;
        const size_t dot = word.find('.');
        if (dot == std::string::npos) continue;
        const std::string family = word.substr(0, dot), rest = word.substr(dot + 1);
        if (family != "ll" && family != "ht" && family != "experts" && family != "moe" && family != "fhmoe") continue;
        if (rest.empty() || !std::all_of(rest.begin(), rest.end(), [](char c) { return std::islower(static_cast<unsigned char>(c)) || c == '_' || std::isdigit(static_cast<unsigned char>(c)); }))
          continue;
        if (rest == "h" || rest == "cpp" || rest == "cu" || rest == "cuh" || rest == "md" || rest == "json" || rest == "py") continue;  // files
        const bool known = std::find(keys.begin(), keys.end(), word) != keys.end();
        if (!known) hits.push_back(where + "`" + word + "` is not a knob (src/core/config.cpp's registry)");
        else if (line.rfind("| `" + word + "`", 0) == 0) hits.push_back(where + "a hand-written row for knob " + word + ": use a generated table");
      }
    }
  }
  EXPECT_TRUE(hits.empty()) << lines(hits);
}
