// tests/trace_test.cpp: the trace format (JSON and directory forms), its validation, statistics
// and the JSONL importer. All inputs are written here by hand; no external data.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "epx/error.h"
#include "epx/trace.h"

using namespace epx;

namespace {

// R = 2 ranks, E = 4 experts, K = 2, two steps; rank 1 is idle in step 1; one -1 selection and
// one duplicate (expert 3 twice) so the counts check masking and duplicates too.
const char* kHandTrace = R"({"format": "epx-trace", "version": 1, "num_ranks": 2, "num_experts": 4, "top_k": 2,
  "source": "hand-written",
  "steps": [
    {"ranks": [{"topk_idx": [[0, 1], [2, 3], [0, -1]], "topk_weights": [[0.5, 0.5], [0.75, 0.25], [1.0, 0.0]]},
               {"topk_idx": [[3, 3]],                   "topk_weights": [[0.4, 0.6]]}]},
    {"ranks": [{"topk_idx": [[1, 2], [1, 0]],           "topk_weights": [[0.9, 0.1], [0.3, 0.7]]},
               {"topk_idx": [],                         "topk_weights": []}]}
  ]})";

std::filesystem::path temp_path(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("epx_trace_test_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(p);
  return p;
}

// Expects `fn` to throw InvalidArgument whose message contains every string in `parts`.
template <class Fn>
void expect_invalid(Fn&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning " << *parts.begin();
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "message: " << m << "\nmissing: " << p;
    EXPECT_EQ(m.find('\n'), std::string::npos) << "one line: " << m;
  }
}

std::string replace_once(std::string s, const std::string& from, const std::string& to) {
  const size_t p = s.find(from);
  EXPECT_NE(p, std::string::npos) << from;
  if (p != std::string::npos) s.replace(p, from.size(), to);
  return s;
}

void expect_same(const Trace& a, const Trace& b) {
  ASSERT_EQ(a.num_ranks, b.num_ranks);
  ASSERT_EQ(a.num_experts, b.num_experts);
  ASSERT_EQ(a.top_k, b.top_k);
  ASSERT_EQ(a.hidden, b.hidden);
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t s = 0; s < a.steps.size(); ++s)
    for (int r = 0; r < a.num_ranks; ++r) {
      const TraceRank &x = a.steps[s].ranks[r], &y = b.steps[s].ranks[r];
      ASSERT_EQ(x.num_tokens(), y.num_tokens()) << "step " << s << " rank " << r;
      const int64_t n = x.num_tokens() * a.top_k;
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(x.topk_idx.ptr<int32_t>()[i], y.topk_idx.ptr<int32_t>()[i]);
        EXPECT_EQ(x.topk_weights.ptr<float>()[i], y.topk_weights.ptr<float>()[i]);  // exact round trip
      }
      for (int64_t i = 0; a.hidden > 0 && i < x.num_tokens() * a.hidden; ++i)
        EXPECT_EQ(x.hidden_states.ptr<uint16_t>()[i], y.hidden_states.ptr<uint16_t>()[i]);
    }
}

}  // namespace

TEST(Trace, HandWrittenTraceGivesExpectedCountsPerRankAndExpert) {
  const Trace t = parse_trace_json(kHandTrace, "hand.json");
  EXPECT_EQ(t.steps.size(), 2u);
  EXPECT_EQ(t.source, "hand-written");
  EXPECT_EQ(t.steps[1].ranks[1].num_tokens(), 0);
  EXPECT_EQ(t.max_tokens_per_rank(), 3);
  EXPECT_EQ(t.total_tokens(), 6);
  EXPECT_EQ(t.tokens_per_rank(), (std::vector<int64_t>{5, 1}));
  // Rank 0: step 0 picks 0,1,2,3,0 (the -1 moves nothing); step 1 picks 1,2,1,0.
  // Rank 1: expert 3 twice (a duplicate adds).
  EXPECT_EQ(t.selection_counts(), (std::vector<std::vector<int64_t>>{{3, 3, 2, 1}, {0, 0, 0, 2}}));
  EXPECT_EQ(t.expert_counts(), (std::vector<int64_t>{3, 3, 2, 3}));
  // Per holder rank with E = 4 over R = 2 (experts 0-1 on rank 0, 2-3 on rank 1): 6 and 5 selections.
  const auto c = t.expert_counts();
  EXPECT_EQ(c[0] + c[1], 6);
  EXPECT_EQ(c[2] + c[3], 5);
  EXPECT_FLOAT_EQ(t.steps[0].ranks[0].topk_weights.ptr<float>()[2], 0.75f);
}

TEST(Trace, JsonAndDirectoryFormsRoundTripExactly) {
  Trace t = parse_trace_json(kHandTrace, "hand.json");
  // Add hidden states (H = 3) so the optional tensor round-trips too.
  t.hidden = 3;
  uint16_t bits = 0x3f80;  // 1.0 in bf16, then increasing patterns
  for (auto& st : t.steps)
    for (auto& r : st.ranks) {
      std::vector<uint16_t> h(static_cast<size_t>(r.num_tokens() * 3));
      for (auto& v : h) v = bits++;
      r.hidden_states = Tensor::empty({r.num_tokens(), 3}, DType::bf16);
      std::copy(h.begin(), h.end(), r.hidden_states.ptr<uint16_t>());
    }
  t.validate();

  const auto json_path = temp_path("rt.json");
  save_trace(t, json_path.string());
  expect_same(t, load_trace(json_path.string()));

  const auto dir = temp_path("rt_dir");
  save_trace(t, dir.string());
  EXPECT_TRUE(std::filesystem::exists(dir / "manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(dir / "s000000_r0000.topk_idx.npy"));
  expect_same(t, load_trace(dir.string()));
  std::filesystem::remove_all(dir);
  std::filesystem::remove(json_path);
}

TEST(Trace, BadJsonTracesGiveClearErrors) {
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "[[3, 3]]", "[[3, 4]]"), "f.json"); },
                 {"trace f.json", "steps[0].ranks[1].topk_idx[0, 1] = 4", "must be -1 (no selection) or an expert id in [0, num_experts = 4)"});
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "[[3, 3]]", "[[3, -2]]"), "f.json"); },
                 {"topk_idx[0, 1] = -2"});
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "[2, 3], [0, -1]", "[2, 3, 1], [0, -1]"), "f.json"); },
                 {"steps[0].ranks[0].topk_idx[1].size = 3", "top_k"});
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "\"num_ranks\": 2", "\"num_ranks\": 3"), "f.json"); },
                 {"steps[0].ranks.size = 2", "must equal num_ranks = 3"});
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "[[0.4, 0.6]]", "[[0.4, 0.6], [0.1, 0.1]]"), "f.json"); },
                 {"steps[0].ranks[1].topk_weights.rows = 2", "topk_idx.rows = 1"});
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "\"version\": 1", "\"version\": 2"), "f.json"); }, {"version = 2"});
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "epx-trace", "other"), "f.json"); }, {"format"});
  expect_invalid([] { parse_trace_json("{not json", "f.json"); }, {"trace f.json", "valid JSON"});
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "\"top_k\": 2,", ""), "f.json"); }, {"top_k = (missing)"});
  expect_invalid([] { load_trace("/nonexistent/epx.trace.json"); }, {"/nonexistent/epx.trace.json", "readable"});
  // Counts past INT_MAX are refused, not wrapped (num_experts = 2^32 + 4 loaded as 4 experts).
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "\"num_experts\": 4", "\"num_experts\": 4294967300"), "f.json"); },
                 {"num_experts = 4294967300", "must fit in a 32-bit int"});
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "\"top_k\": 2", "\"top_k\": 4294967298"), "f.json"); },
                 {"top_k = 4294967298", "must fit in a 32-bit int"});
  // A negative hidden is named with its own rule (H >= 0), not as hidden states missing "when hidden = -8".
  expect_invalid([] { parse_trace_json(replace_once(kHandTrace, "\"top_k\": 2", "\"top_k\": 2, \"hidden\": -8"), "f.json"); },
                 {"trace f.json", "hidden = -8", "must be >= 0"});
}

TEST(Trace, DealTokensIsContiguousAndEven) {
  for (int R : {1, 2, 3, 4, 8})
    for (int64_t n : {0, 1, 2, 7, 25, 1406}) {
      int64_t next = 0, lo = INT64_MAX, hi = 0;
      for (int r = 0; r < R; ++r) {
        auto [b, e] = deal_tokens(n, R, r);
        EXPECT_EQ(b, next);
        next = e;
        lo = std::min(lo, e - b);
        hi = std::max(hi, e - b);
        if (r > 0) {
          EXPECT_LE(e - b, deal_tokens(n, R, r - 1).second - deal_tokens(n, R, r - 1).first);
        }
      }
      EXPECT_EQ(next, n);
      EXPECT_LE(hi - lo, 1);
    }
}

namespace {
// A vLLM-MoE-Logger-shaped log: meta line, two warm-up passes (3 and 2 rows, all [1, 2]), then a
// real pass of 5 tokens and one of 2 tokens.
std::string hand_jsonl() {
  std::ostringstream os;
  os << R"({"type": "meta", "model_id": "toy", "top_k": 2})" << "\n";
  auto rec = [&](int tok, int a, int b, double wa, double wb) {
    os << R"({"type": "route", "req_id": "r1", "token_idx": )" << tok << R"(, "layer": 0, "topk_ids": [)" << a << ", " << b
       << R"(], "topk_weights": [)" << wa << ", " << wb << "]}\n";
  };
  for (int t = 0; t < 3; ++t) rec(t, 1, 2, 0.5, 0.25);
  for (int t = 0; t < 2; ++t) rec(t, 1, 2, 0.5, 0.25);
  for (int t = 0; t < 5; ++t) rec(t, t % 6, (t + 1) % 6, 0.125 * (t + 1), 0.0625);
  os << "\n";  // blank lines are skipped
  for (int t = 0; t < 2; ++t) rec(t, 5, 0, 0.5, 0.5);
  return os.str();
}

Trace import_text(const std::string& text, TraceImportOptions opt, TraceImportSummary* sum = nullptr) {
  std::istringstream is(text);
  return import_routing_jsonl(is, opt, "toy.jsonl", sum);
}
}  // namespace

TEST(TraceImport, DropsWarmupPassesAndDealsEachPassOverRanks) {
  TraceImportSummary sum;
  const Trace t = import_text(hand_jsonl(), {.num_ranks = 2, .skip_passes = 2}, &sum);
  EXPECT_EQ(sum.num_records, 12);
  EXPECT_EQ(sum.num_passes, 4);
  EXPECT_EQ(sum.num_skipped_records, 5);
  EXPECT_EQ(t.top_k, 2);
  EXPECT_EQ(t.num_experts, 6);  // max id 5 + 1
  EXPECT_EQ(t.num_ranks, 2);
  ASSERT_EQ(t.steps.size(), 2u);
  EXPECT_EQ(t.steps[0].ranks[0].num_tokens(), 3);  // 5 tokens over 2 ranks: 3 + 2, contiguous
  EXPECT_EQ(t.steps[0].ranks[1].num_tokens(), 2);
  EXPECT_EQ(t.steps[1].ranks[0].num_tokens(), 1);
  EXPECT_EQ(t.steps[1].ranks[1].num_tokens(), 1);
  // Rank 1 of step 0 holds tokens 3 and 4: ids (3, 4) and (4, 5).
  const int32_t* idx = t.steps[0].ranks[1].topk_idx.ptr<int32_t>();
  EXPECT_EQ((std::vector<int32_t>(idx, idx + 4)), (std::vector<int32_t>{3, 4, 4, 5}));
  EXPECT_FLOAT_EQ(t.steps[0].ranks[1].topk_weights.ptr<float>()[0], 0.5f);
  // No warm-up row ([1, 2] with weight 0.25) survived: expert 2 is picked only by tokens 1 and 2.
  EXPECT_EQ(t.expert_counts()[2], 2);
  EXPECT_EQ(t.total_tokens(), 7);
}

TEST(TraceImport, RanksMaxTokensAndExpertCountOptions) {
  const Trace t3 = import_text(hand_jsonl(), {.num_ranks = 3, .skip_passes = 2});
  EXPECT_EQ(t3.steps[1].ranks[2].num_tokens(), 0);  // 2 tokens over 3 ranks: 1, 1, 0
  const Trace split = import_text(hand_jsonl(), {.num_ranks = 1, .skip_passes = 2, .max_tokens_per_step = 2});
  ASSERT_EQ(split.steps.size(), 4u);  // 5 -> 2, 2, 1; then 2
  EXPECT_EQ(split.steps[2].ranks[0].num_tokens(), 1);
  const Trace all = import_text(hand_jsonl(), {.num_ranks = 1, .skip_passes = 0, .num_experts = 60});
  EXPECT_EQ(all.steps.size(), 4u);
  EXPECT_EQ(all.num_experts, 60);
}

TEST(TraceImport, BadInputGivesClearErrors) {
  expect_invalid([] { import_text(hand_jsonl(), {.num_ranks = 2, .skip_passes = 4}); }, {"skip_passes = 4", "number of passes found = 4"});
  expect_invalid([] { import_text(hand_jsonl(), {.num_ranks = 0}); }, {"num_ranks = 0"});
  expect_invalid([] { import_text(hand_jsonl(), {.num_ranks = 1, .num_experts = 3}); }, {"num_experts = 3", "largest expert id"});
  std::string jump = replace_once(hand_jsonl(), R"("token_idx": 1, "layer": 0, "topk_ids": [1, 2])", R"("token_idx": 2, "layer": 0, "topk_ids": [1, 2])");
  expect_invalid([&] { import_text(jump, {.num_ranks = 1}); }, {"toy.jsonl:3 token_idx = 2", "previous token_idx + 1 = 1"});
  std::string ragged = replace_once(hand_jsonl(), "\"topk_ids\": [1, 2]", "\"topk_ids\": [1, 2, 3]");
  expect_invalid([&] { import_text(ragged, {.num_ranks = 1}); }, {"toy.jsonl:2 topk_ids.size = 3", "top_k = 2"});
  std::string no_w = replace_once(hand_jsonl(), ", \"topk_weights\": [0.5, 0.25]}", "}");
  expect_invalid([&] { import_text(no_w, {.num_ranks = 1}); }, {"toy.jsonl:2 topk_weights", "must be present"});
  expect_invalid([] { import_text("{\"type\": \"meta\"}\nnot json\n", {.num_ranks = 1}); }, {"toy.jsonl:2", "one JSON object per line"});
  expect_invalid([] { import_text("{\"type\": \"meta\"}\n", {.num_ranks = 1}); }, {"no route records"});
  expect_invalid([] { import_routing_jsonl_file("/nonexistent.jsonl", {.num_ranks = 1}); }, {"/nonexistent.jsonl"});
  // No meta line and an empty first route: the rule is a non-empty array, not "top_k = 0 ids".
  expect_invalid([] { import_text(R"({"type": "route", "req_id": "r1", "token_idx": 0, "layer": 0, "topk_ids": [], "topk_weights": []})" "\n", {.num_ranks = 1}); },
                 {"toy.jsonl:1 topk_ids.size = 0: must be a non-empty array"});
  // An id past int32 names the bound it breaks (it is >= -1, so ">= -1" alone would not explain the rejection).
  std::string huge = replace_once(hand_jsonl(), "\"topk_ids\": [1, 2]", "\"topk_ids\": [1, 99999999999]");
  expect_invalid([&] { import_text(huge, {.num_ranks = 1}); }, {"topk_ids[1] = 99999999999: must be -1 (no selection) or an expert id in [0, 2147483646]"});
  // INT32_MAX itself: num_experts = largest id + 1 must fit an int (it overflowed to -2147483648).
  std::string edge = replace_once(hand_jsonl(), "\"topk_ids\": [1, 2]", "\"topk_ids\": [1, 2147483647]");
  expect_invalid([&] { import_text(edge, {.num_ranks = 1}); }, {"topk_ids[1] = 2147483647: must be -1 (no selection) or an expert id in [0, 2147483646]"});
  // A record's "type" that is not a string was nlohmann's type_error ("type must be string, but is number").
  expect_invalid([] { import_text("{\"type\": 3}\n" + hand_jsonl(), {.num_ranks = 1}); }, {"toy.jsonl:1 type = 3", "must be a string"});
}

TEST(Npy, ReadsNumpyWrittenBytesAndRejectsBadFiles) {
  // Exactly what numpy.save(f, np.array([[1, -1], [7, 2]], dtype='<i4')) writes (format 1.0).
  std::string header = "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string bytes = std::string("\x93NUMPY\x01\x00", 8) + std::string(1, static_cast<char>(header.size() & 0xff)) + std::string(1, static_cast<char>(header.size() >> 8)) + header;
  const int32_t vals[4] = {1, -1, 7, 2};
  bytes.append(reinterpret_cast<const char*>(vals), 16);
  const auto p = temp_path("a.npy");
  { std::ofstream(p, std::ios::binary) << bytes; }
  NpyArray a = read_npy(p.string());
  EXPECT_EQ(a.descr, "<i4");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(a.numel(), 4);
  EXPECT_EQ(reinterpret_cast<const int32_t*>(a.data.data())[1], -1);

  write_npy(p.string(), a);  // our writer produces the same bytes numpy does
  std::ifstream f(p, std::ios::binary);
  std::string again((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(again, bytes);

  { std::ofstream(p, std::ios::binary) << replace_once(bytes, "False", "True "); }
  expect_invalid([&] { read_npy(p.string()); }, {"fortran_order = True", "C order"});
  { std::ofstream(p, std::ios::binary) << replace_once(bytes, "<i4", ">i4"); }
  expect_invalid([&] { read_npy(p.string()); }, {"descr = >i4"});
  { std::ofstream(p, std::ios::binary) << bytes.substr(0, bytes.size() - 4); }
  expect_invalid([&] { read_npy(p.string()); }, {"data = short"});
  { std::ofstream(p, std::ios::binary) << "PK\x03\x04 not npy"; }
  expect_invalid([&] { read_npy(p.string()); }, {"magic"});
  // A crafted shape: product(shape) * itemsize wrapped past 2^64 to 0 bytes (2^54 x 256 x 4) was read as a
  // tensor of 2^54 rows and no data (epx moe --hidden then segfaulted); one that does not wrap but passes what the
  // file holds (2^40 x 256 x 2 bytes) was allocated before the short read (std::bad_alloc, not an epx::Error).
  auto npy_with = [](const std::string& descr, const std::string& shape) {
    std::string h = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }\n";
    return std::string("\x93NUMPY\x01\x00", 8) + std::string(1, static_cast<char>(h.size() & 0xff)) +
           std::string(1, static_cast<char>(h.size() >> 8)) + h + std::string(16, '\0');
  };
  { std::ofstream(p, std::ios::binary) << npy_with("<f4", "(18014398509481984, 256)"); }
  expect_invalid([&] { read_npy(p.string()); }, {"shape = (18014398509481984, 256)", "product(shape) * itemsize must fit in int64"});
  { std::ofstream(p, std::ios::binary) << npy_with("<u2", "(1099511627776, 256)"); }
  expect_invalid([&] { read_npy(p.string()); }, {"data = short", "562949953421312 bytes"});
  std::filesystem::remove(p);
}

TEST(Trace, DirectoryFormValidatesShapesAgainstManifest) {
  const Trace t = parse_trace_json(kHandTrace, "hand.json");
  const auto dir = temp_path("bad_dir");
  save_trace(t, dir.string());
  // Replace rank 0's step-0 ids with a [3, 3] array: the manifest says [3, 2].
  NpyArray a{"<i4", {3, 3}, std::vector<uint8_t>(36, 0)};
  write_npy((dir / "s000000_r0000.topk_idx.npy").string(), a);
  expect_invalid([&] { load_trace(dir.string()); }, {"steps[0].ranks[0].topk_idx.shape = [3, 3]", "must be [3, 2]"});
  // An out-of-range id inside a .npy is caught by validation too.
  NpyArray b{"<i8", {3, 2}, std::vector<uint8_t>(48, 0)};
  b.data[0] = 9;
  write_npy((dir / "s000000_r0000.topk_idx.npy").string(), b);
  expect_invalid([&] { load_trace(dir.string()); }, {"topk_idx[0, 0] = 9", "must be -1 (no selection) or an expert id in [0, num_experts = 4)"});
  std::filesystem::remove(dir / "manifest.json");
  expect_invalid([&] { load_trace(dir.string()); }, {"manifest.json", "must exist"});
  std::filesystem::remove_all(dir);
}

TEST(Trace, DirectoryManifestFieldsOfTheWrongTypeAreNamed) {
  // manifest.json's optional fields were read with nlohmann's value()/get(): a string hidden, a numeric
  // source or hidden_states file name escaped as "[json.exception.type_error.302] ..." (no field named, not
  // an epx::Error), and hidden = 1.5 was read as 1. Each is now InvalidArgument naming the field and rule.
  const Trace t = parse_trace_json(kHandTrace, "hand.json");
  const auto dir = temp_path("bad_manifest");
  save_trace(t, dir.string());
  std::stringstream ss;
  ss << std::ifstream(dir / "manifest.json").rdbuf();
  const nlohmann::json good = nlohmann::json::parse(ss.str());
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    std::ofstream(dir / "manifest.json") << j.dump();
  };
  with([](nlohmann::json& j) { j["hidden"] = "abc"; });
  expect_invalid([&] { load_trace(dir.string()); }, {"hidden = \"abc\"", "must be an integer >= 0"});
  with([](nlohmann::json& j) { j["hidden"] = 1.5; });
  expect_invalid([&] { load_trace(dir.string()); }, {"hidden = 1.5", "must be an integer >= 0"});
  with([](nlohmann::json& j) { j["hidden"] = -8; });
  expect_invalid([&] { load_trace(dir.string()); }, {"hidden = -8", "must be an integer >= 0"});
  with([](nlohmann::json& j) { j["source"] = 3; });
  expect_invalid([&] { load_trace(dir.string()); }, {"source = 3", "must be a string"});
  with([](nlohmann::json& j) { j["hidden"] = 8; j["steps"][0]["ranks"][0]["hidden_states"] = 5; });
  expect_invalid([&] { load_trace(dir.string()); }, {"steps[0].ranks[0].hidden_states", "must name a .npy file in the directory"});
  with([](nlohmann::json&) {});
  EXPECT_NO_THROW(load_trace(dir.string()));
  std::filesystem::remove_all(dir);
}
