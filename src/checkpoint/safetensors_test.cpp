// checkpoint/safetensors_test.cpp: the safetensors reader and writer: round trips of every dtype,
// and every malformed-file rule giving a clear InvalidArgument that names the file and tensor
// (never a crash: every truncation and many random corruptions of a valid file are opened).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "epx/checkpoint.h"
#include "epx/error.h"

namespace epx {
namespace {

namespace fs = std::filesystem;

std::string tmp(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("epx_st_test_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return (d / name).string();
}

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

void put_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

/// A file with header text `header` (its length written as `declared`, default the true length)
/// followed by `data_bytes` bytes 0, 1, 2, ...
std::string raw_file(const std::string& name, const std::string& header, size_t data_bytes, int64_t declared = -1) {
  std::vector<uint8_t> b(8);
  const uint64_t n = declared < 0 ? header.size() : static_cast<uint64_t>(declared);
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(n >> (8 * i));
  b.insert(b.end(), header.begin(), header.end());
  for (size_t i = 0; i < data_bytes; ++i) b.push_back(static_cast<uint8_t>(i));
  const std::string p = tmp(name);
  put_bytes(p, b);
  return p;
}

/// Opening `path` throws InvalidArgument whose message holds every fragment.
void expect_open_error(const std::string& path, std::initializer_list<std::string> fragments) {
  try {
    (void)SafetensorsFile::open(path);
    ADD_FAILURE() << path << ": opened without error";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(path), std::string::npos) << "message does not name the file: " << m;
    for (const std::string& f : fragments) EXPECT_NE(m.find(f), std::string::npos) << "missing '" << f << "' in: " << m;
  }
}

TEST(Safetensors, RoundTripEveryDtype) {
  std::mt19937 g(7);
  struct Case { std::string name, dtype; std::vector<int64_t> shape; int bits; };
  const std::vector<Case> cases = {
      {"f32", "F32", {3, 5}, 32},     {"f16", "F16", {7}, 16},       {"bf16", "BF16", {2, 3, 4}, 16},
      {"fp8", "F8_E4M3", {4, 33}, 8}, {"u8", "U8", {9}, 8},          {"i8", "I8", {2, 2}, 8},
      {"i32", "I32", {5, 1}, 32},     {"i64", "I64", {3}, 64},       {"e8m0", "F8_E8M0", {6}, 8},
      {"scalar", "F32", {}, 32},      {"empty", "BF16", {0, 3}, 16}, {"f64", "F64", {2}, 64},
      {"f4", "F4", {2, 6}, 4},        {"bool", "BOOL", {3}, 8},
  };
  std::vector<std::vector<uint8_t>> data;
  std::vector<SafetensorsEntry> entries;
  for (const Case& c : cases) {
    int64_t n = 1;
    for (int64_t d : c.shape) n *= d;
    data.emplace_back(static_cast<size_t>(n * c.bits / 8));
    for (auto& b : data.back()) b = static_cast<uint8_t>(g());
  }
  for (size_t i = 0; i < cases.size(); ++i)
    entries.push_back({cases[i].name, cases[i].dtype, cases[i].shape, data[i].data(), data[i].size()});
  const std::string path = tmp("all.safetensors");
  write_safetensors(path, entries, {{"format", "pt"}, {"note", "x"}});

  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.data_offset() % 8, 0u) << "header padded to 8 bytes";
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.names().size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const SafetensorsTensorInfo& t = f.info(cases[i].name);
    EXPECT_EQ(t.dtype, cases[i].dtype);
    EXPECT_EQ(t.shape, cases[i].shape);
    const auto b = f.bytes(cases[i].name);
    ASSERT_EQ(b.size(), data[i].size()) << cases[i].name;
    EXPECT_TRUE(std::equal(b.begin(), b.end(), data[i].begin())) << cases[i].name;
  }
  // read(): epx dtypes and shapes ([] -> [1]); the bytes again.
  const Tensor bf = f.read("bf16");
  EXPECT_EQ(bf.dtype(), DType::bf16);
  EXPECT_EQ(bf.view().ndim, 3);
  EXPECT_EQ(bf.size(2), 4);
  EXPECT_EQ(std::memcmp(bf.data(), data[2].data(), data[2].size()), 0);
  EXPECT_EQ(f.read("fp8").dtype(), DType::fp8_e4m3);
  EXPECT_EQ(f.read("i64").dtype(), DType::int64);
  EXPECT_EQ(f.read("e8m0").dtype(), DType::e8m0);
  const Tensor s = f.read("scalar");
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(std::memcmp(s.data(), data[9].data(), 4), 0);
  EXPECT_EQ(f.read("empty").numel(), 0);
  EXPECT_THROW((void)f.read("i8"), Unsupported);   // no epx int8: bytes() only
  EXPECT_THROW((void)f.read("f64"), Unsupported);
  try {
    (void)f.info("nope");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("\"nope\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(Safetensors, EntryFromTensorAndWriterChecks) {
  Tensor t = Tensor::empty({4, 8}, DType::bf16);
  for (int i = 0; i < 32; ++i) t.ptr<uint16_t>()[i] = static_cast<uint16_t>(i * 977);
  const std::string path = tmp("from.safetensors");
  write_safetensors(path, {SafetensorsEntry::from("x", t)});
  const Tensor back = SafetensorsFile::open(path).read("x");
  EXPECT_EQ(std::memcmp(back.data(), t.data(), 64), 0);
  uint8_t buf[4] = {};
  EXPECT_THROW(write_safetensors(path, {{"a", "F32", {2}, buf, 4}}), InvalidArgument);          // 2 x F32 = 8 bytes
  EXPECT_THROW(write_safetensors(path, {{"a", "F7", {1}, buf, 1}}), InvalidArgument);           // unknown dtype
  EXPECT_THROW(write_safetensors(path, {{"a", "U8", {1}, buf, 1}, {"a", "U8", {1}, buf, 1}}), InvalidArgument);  // duplicate
  EXPECT_THROW(write_safetensors(path, {{"a", "F4", {3}, buf, 1}}), InvalidArgument);           // 12 bits
  EXPECT_THROW(write_safetensors("/nonexistent-dir/x.safetensors", {}), Error);
}

TEST(Safetensors, MalformedFilesNameTheRule) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  // Sanity: the helper makes a valid file.
  EXPECT_NO_THROW((void)SafetensorsFile::open(raw_file("ok.st", "{" + ok_entry + "}", 8)));
  EXPECT_NO_THROW((void)SafetensorsFile::open(raw_file("pad.st", "{" + ok_entry + "}    ", 8)));  // space padding

  expect_open_error(tmp("missing.st"), {"must exist"});
  {
    const std::string p = tmp("short.st");
    put_bytes(p, {1, 0, 0});
    expect_open_error(p, {"size", "3 bytes", "truncated"});
  }
  {
    const std::string p = tmp("zero.st");
    put_bytes(p, {});
    expect_open_error(p, {"0 bytes"});
  }
  expect_open_error(raw_file("len.st", "{" + ok_entry + "}", 8, 1000), {"header length = 1000", "file size - 8"});
  expect_open_error(raw_file("huge.st", "{}", 0, int64_t{1} << 40), {"header length", "100000000"});
  expect_open_error(raw_file("json.st", "{\"a\": {\"dtype\": ", 0), {"must be valid JSON"});
  expect_open_error(raw_file("notobj.st", "[1, 2]", 0), {"must start with '{'"});
  expect_open_error(raw_file("dup.st", "{" + ok_entry + "," + ok_entry + "}", 8), {"\"a\"", "appears twice"});
  expect_open_error(raw_file("nodtype.st", R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), {"tensor \"a\" dtype", "missing"});
  expect_open_error(raw_file("noshape.st", R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8), {"tensor \"a\" shape"});
  expect_open_error(raw_file("nooff.st", R"({"a":{"dtype":"F32","shape":[2]}})", 8), {"tensor \"a\" data_offsets", "missing"});
  expect_open_error(raw_file("negshape.st", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), {"tensor \"a\" shape", ">= 0"});
  expect_open_error(raw_file("negoff.st", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", 8), {"data_offsets"});
  expect_open_error(raw_file("dtype.st", R"({"a":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", 8), {"tensor \"a\" dtype = F7", "unknown", "BF16"});
  expect_open_error(raw_file("size.st", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                    {"tensor \"a\" data_offsets", "[3] x F32 needs 12"});
  expect_open_error(raw_file("overflow.st", R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
                    {"tensor \"a\" shape", "overflows"});
  expect_open_error(raw_file("order.st", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), {"begin <= end"});
  expect_open_error(raw_file("range.st", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 5),
                    {"tensor \"a\" data_offsets = [0, 8)", "data section of 5 bytes", "truncated"});
  expect_open_error(raw_file("overlap.st", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
                    {"tensor \"b\"", "overlaps tensor \"a\""});
  expect_open_error(raw_file("hole.st", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), {"tensor \"a\"", "hole of 4 bytes"});
  expect_open_error(raw_file("trail.st", "{" + ok_entry + "}", 12), {"data section", "trailing"});
  expect_open_error(raw_file("meta.st", R"({"__metadata__":{"k":1}})", 0), {"__metadata__.k", "must be a string"});
  expect_open_error(raw_file("entry.st", R"({"a":3})", 0), {"tensor \"a\"", "must be an object"});
}

TEST(Safetensors, EveryTruncationAndRandomCorruptionIsAnErrorNotACrash) {
  std::vector<uint8_t> payload(300);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7);
  const std::string path = tmp("valid.st");
  write_safetensors(path, {{"w", "BF16", {10, 10}, payload.data(), 200}, {"s", "F32", {25}, payload.data() + 200, 100}});
  const std::vector<uint8_t> good = file_bytes(path);
  const std::string bad = tmp("corrupt.st");
  for (size_t n = 0; n < good.size(); ++n) {  // every proper prefix fails: the data must be covered exactly
    put_bytes(bad, std::vector<uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)));
    EXPECT_THROW((void)SafetensorsFile::open(bad), InvalidArgument) << "prefix of " << n << " bytes";
  }
  std::mt19937 g(3);
  const size_t header_end = SafetensorsFile::open(path).data_offset();
  int opened = 0, rejected = 0;
  for (int trial = 0; trial < 400; ++trial) {
    std::vector<uint8_t> b = good;
    const int flips = 1 + static_cast<int>(g() % 3);
    for (int i = 0; i < flips; ++i) b[g() % header_end] = static_cast<uint8_t>(g());
    put_bytes(bad, b);
    try {
      const SafetensorsFile f = SafetensorsFile::open(bad);
      for (const std::string& n : f.names()) {  // whatever opened must be readable in bounds
        const auto s = f.bytes(n);
        volatile uint8_t sink = 0;
        for (uint8_t v : s) sink = sink ^ v;
        (void)sink;
      }
      ++opened;
    } catch (const Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 200) << "opened " << opened;
}

}  // namespace
}  // namespace epx
