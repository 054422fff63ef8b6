#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>

#include "epx/config.h"
#include "epx/error.h"
#include "epx/tensor.h"
#include "test_util.h"

using namespace epx;

TEST(Error, RequireArgNamesArgumentValueAndRule) {
  try {
    require_arg("ll.prepare", "num_tokens", 300, false, "must be <= num_max_dispatch_tokens_per_rank = 256");
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "ll.prepare: num_tokens = 300: must be <= num_max_dispatch_tokens_per_rank = 256");
  }
}

TEST(Error, AssertPrintsValues) {
  int a = 3, b = 4;
  try {
    EPX_ASSERT(a == b, "a=", a, " b=", b);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a=3 b=4"), std::string::npos) << e.what();
  }
}

TEST(Tensor, ShapeStridesRowsAndChecks) {
  Tensor t = Tensor::zeros({3, 5}, DType::bf16);
  EXPECT_EQ(t.numel(), 15);
  EXPECT_EQ(t.nbytes(), 30);
  EXPECT_TRUE(t.view().is_contiguous());
  EXPECT_EQ(t.view().strides[0], 5);
  TensorView r = t.view().row(2);
  EXPECT_EQ(r.ndim, 1);
  EXPECT_EQ(static_cast<char*>(r.data) - static_cast<char*>(t.data()), 20);
  EXPECT_THROW(check_shape("op", "x", t, {3, 4}), InvalidArgument);
  EXPECT_NO_THROW(check_shape("op", "x", t, {-1, 5}));
  EXPECT_THROW(check_dtype("op", "x", t, {DType::fp32}), InvalidArgument);
  TensorView nc = t.view();
  nc.strides[0] = 7;
  EXPECT_THROW(check_contiguous("op", "x", nc), InvalidArgument);
  EXPECT_THROW(TensorView(nullptr, DType::fp32, {1, 2, 3, 4, 5}), InvalidArgument);
  Tensor zero_rows = Tensor::empty({0, 7168}, DType::bf16);
  EXPECT_EQ(zero_rows.numel(), 0);
  EXPECT_NE(zero_rows.data(), nullptr);
}

TEST(Tensor, NullDataWithElementsIsRefusedByTheBoundaryChecks) {
  // A view whose data is null but whose shape holds elements (a C++ caller's unset pointer) was read at the
  // API boundary as a tensor: ModularMoE::forward and every backend's prepare segfaulted. check_contiguous,
  // which every public entry point runs on each tensor, refuses it naming the argument; empty views (no
  // elements, optional inputs) and real ones still pass.
  TensorView null_x(nullptr, DType::bf16, {4, 256});
  try {
    check_contiguous("op", "x", null_x);
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("op: x.data = null of [4, 256] bf16 cpu: must point to its 1024 elements"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(check_contiguous("op", "x", TensorView(nullptr, DType::bf16, {0, 256})));
  EXPECT_NO_THROW(check_contiguous("op", "x", TensorView()));
  EXPECT_NO_THROW(check_contiguous("op", "x", Tensor::zeros({4, 256}, DType::bf16)));
}

TEST(Tensor, ShapeWhoseBytesPassInt64IsRefused) {
  // numel() * dtype_size wrapped: Tensor::empty({2^40, 2^40}, bf16) returned a tensor of that shape over a
  // 64-byte allocation (numel() 0), which the first write overran. The shape is refused where views are made.
  const int64_t big = int64_t{1} << 40;
  std::string what = test::invalid_argument_message([&] { Tensor::empty({big, big}, DType::bf16); });
  EXPECT_NE(what.find("TensorView: shape = [1099511627776, 1099511627776] bf16: must hold at most 2^63 - 1 bytes"), std::string::npos)
      << what;
  what = test::invalid_argument_message([&] { TensorView(nullptr, DType::fp32, {int64_t{1} << 62, 2}); });
  EXPECT_NE(what.find("must hold at most 2^63 - 1 bytes"), std::string::npos) << what;
  EXPECT_NO_THROW(TensorView(nullptr, DType::bf16, {int64_t{1} << 31, 7168}));  // 2^31 rows x 7168: 64-bit, fine
  EXPECT_NO_THROW(TensorView(nullptr, DType::bf16, {0, int64_t{1} << 62, 1 << 20}));  // no elements
}

#ifndef EPX_WITH_CUDA
TEST(Tensor, CudaTensorInCpuBuildIsUnsupported) {
  EXPECT_THROW(Tensor::empty({4}, DType::fp32, Device::cuda(0)), Unsupported);
}
#endif

TEST(Config, PrecedenceJsonThenEnvAndUnknownKeys) {
  Config c;
  c.apply_json_text(R"({"ll.warps_per_block": 16, "timeout_s": 5})", "json test");
  EXPECT_EQ(c.ll_warps_per_block, 16);
  EXPECT_EQ(c.timeout_s, 5.0);
  setenv("EPX_LL_WARPS_PER_BLOCK", "8", 1);
  c.apply_env();
  unsetenv("EPX_LL_WARPS_PER_BLOCK");
  EXPECT_EQ(c.ll_warps_per_block, 8);
  bool saw_env_source = false;
  for (auto& line : c.describe())
    if (line.find("ll.warps_per_block = 8") == 0 && line.find("env EPX_LL_WARPS_PER_BLOCK") != std::string::npos) saw_env_source = true;
  EXPECT_TRUE(saw_env_source);
  try {
    c.apply_json_text(R"({"ll.warps_per_blok": 16})", "json test");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean 'll.warps_per_block'"), std::string::npos) << e.what();
  }
  setenv("EPX_TIMEOUT", "3", 1);
  EXPECT_THROW(c.apply_env(), InvalidArgument);
  unsetenv("EPX_TIMEOUT");
  c.ll_warps_per_block = 6;
  EXPECT_THROW(c.validate(), InvalidArgument);
  EXPECT_THROW(c.set("timeout_s", "abc"), InvalidArgument);
}

// experts.fp8_prefill takes 0 and 1, experts.mxfp4_tc 0 and 1; the numbers of the removed kernel variants
// (bench/NOTES.md, 'Variants removed from the product') are refused with the rule.
TEST(Config, ExpertsKernelChoicesAreOnOff) {
  Config c;
  for (int m : {0, 1}) {
    c.experts_fp8_prefill = m;
    c.experts_mxfp4_tc = m;
    EXPECT_NO_THROW(c.validate()) << m;
  }
  c.experts_mxfp4_tc = 1;
  for (int m : {2, 8, 10, 17, 23, 27, 29, 30, 31, 33, -1}) {
    c.experts_fp8_prefill = m;
    EXPECT_EQ(test::invalid_argument_message([&] { c.validate(); }), "config: experts.fp8_prefill = " + std::to_string(m) + ": must be 0 or 1") << m;
  }
  c.experts_fp8_prefill = 1;
  for (int m : {2, 3, 7, -1}) {
    c.experts_mxfp4_tc = m;
    EXPECT_EQ(test::invalid_argument_message([&] { c.validate(); }), "config: experts.mxfp4_tc = " + std::to_string(m) + ": must be 0 or 1") << m;
  }
}

// The registry describes every knob once: its variable is EPX_ + the key in capitals, its default keeps its
// rule, and a value just outside the rule is refused by set() with exactly the registry's rule text. So the
// rule that validate() applies and the one `epx info --knobs`, the Python docstrings and
// docs/configuration.md print are one.
TEST(Config, RegistryRulesAreTheOnesValidateApplies) {
  const std::vector<Knob> knobs = Config::knobs();
  ASSERT_GE(knobs.size(), 15u);
  for (const Knob& k : knobs) {
    SCOPED_TRACE(k.key);
    std::string env = "EPX_" + k.key;
    for (char& ch : env) ch = ch == '.' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    EXPECT_EQ(k.env, env);
    EXPECT_TRUE(k.type == "int" || k.type == "float" || k.type == "choice") << k.type;
    EXPECT_EQ(k.rule.rfind("must be " + k.allowed, 0), 0u) << k.rule;
    EXPECT_FALSE(k.meaning.empty());
    EXPECT_EQ(k.meaning.find('|'), std::string::npos) << "a '|' breaks the Markdown table";
    Config c;
    EXPECT_NO_THROW(c.set(k.key, k.default_value)) << "the default breaks its own rule";
    // A value outside the rule: a choice's name with a suffix, or one below the range's lower bound.
    std::string bad;
    if (k.type == "choice") bad = std::isdigit(static_cast<unsigned char>(k.default_value[0])) ? "9" : k.default_value + "9";
    else if (k.allowed.rfind(">= ", 0) == 0) bad = "-1";
    else if (k.allowed.find("in [") != std::string::npos) {
      const std::string lo = k.allowed.substr(k.allowed.find("in [") + 4, k.allowed.find(',', k.allowed.find("in [")) - k.allowed.find("in [") - 4);
      bad = k.type == "int" ? std::to_string(std::stoll(lo) - 1) : "-1";
      if (k.allowed.rfind(bad + " or ", 0) == 0) bad = "-1";  // the value allowed besides the range
    }
    ASSERT_FALSE(bad.empty()) << k.allowed;
    EXPECT_EQ(test::invalid_argument_message([&] { c.set(k.key, bad); }), "config: " + k.key + " = " + bad + ": " + k.rule + " (set by api)");
  }
  const std::string md = Config::knobs_markdown();
  for (const Knob& k : knobs) EXPECT_NE(md.find("| `" + k.key + "` | `" + k.env + "` | " + k.type), std::string::npos) << k.key;
  const std::string ll = Config::knobs_markdown("ll.");
  EXPECT_NE(ll.find("`ll.num_blocks`"), std::string::npos);
  EXPECT_EQ(ll.find("`ht.num_sms`"), std::string::npos);
  EXPECT_NE(test::invalid_argument_message([] { Config::knobs_markdown("zz."); }).find("knob prefix = zz.: must begin at least one key"),
            std::string::npos);
}

// Knobs without a production meaning are gone (bench/NOTES.md, 'Variants removed from the product'):
// experts.fp8_pairs, ht.combine_mode and ht.fp8_unroll are unknown keys, and ht.pdl takes 0 or 1 (2, the L2
// prefetch, was slower).
TEST(Config, RemovedKnobValuesAreRefused) {
  Config c;
  for (const char* key : {"experts.fp8_pairs", "ht.combine_mode", "ht.fp8_unroll"})
    EXPECT_NE(test::invalid_argument_message([&] { c.set(key, "1"); }).find("unknown"), std::string::npos) << key;
  EXPECT_EQ(test::invalid_argument_message([&] { c.set("ht.pdl", "2"); }), "config: ht.pdl = 2: must be 0 or 1 (set by api)");
  EXPECT_NO_THROW(c.set("ht.pdl", "0"));
}

// ll.combine_wait takes flag and data; the removed flag_lane and data's removed variants are refused.
TEST(Config, LlCombineWaitTakesFlagOrData) {
  Config c;
  for (const char* w : {"flag", "data"}) {
    c.ll_combine_wait = w;
    EXPECT_NO_THROW(c.validate()) << w;
  }
  for (const char* w : {"flag_lane", "data_fence", "data_nofence", "data_cg", "data_weak", "flags", ""}) {
    c.ll_combine_wait = w;
    EXPECT_EQ(test::invalid_argument_message([&] { c.validate(); }), std::string("config: ll.combine_wait = ") + w + ": must be flag or data") << w;
  }
}

// The removed ll protocol knobs (ll.signal, ll.expand, ll.items) are unknown keys now: a JSON file or an
// EPX_* variable naming one is refused, not silently ignored.
TEST(Config, RemovedLlKnobsAreUnknownKeys) {
  Config c;
  for (const char* key : {"ll.signal", "ll.expand", "ll.items"}) {
    const std::string what = test::invalid_argument_message([&] { c.set(key, "chunk"); });
    EXPECT_NE(what.find(key), std::string::npos) << what;
  }
  setenv("EPX_LL_SIGNAL", "chunk", 1);
  const std::string what = test::invalid_argument_message([&] { c.apply_env(); });
  unsetenv("EPX_LL_SIGNAL");
  EXPECT_NE(what.find("EPX_LL_SIGNAL"), std::string::npos) << what;
}

// A JSON document or environment with one bad entry changes nothing: the entries before it are not
// applied either (nothing already held is lost).
TEST(Config, FailedJsonOrEnvLeavesTheConfigAsItWas) {
  Config c;
  c.apply_json_text(R"({"timeout_s": 5})", "json first");
  EXPECT_THROW(c.apply_json_text(R"({"ht.num_sms": 24, "timeout_s": 7, "ll.warps_per_blok": 8})", "json second"), InvalidArgument);
  EXPECT_EQ(c.ht_num_sms, 64);
  EXPECT_EQ(c.timeout_s, 5.0);
  for (const auto& [k, s] : c.sources) EXPECT_NE(s, "json second") << k;
  setenv("EPX_HT_NUM_SMS", "24", 1);
  setenv("EPX_TIMEOUT", "3", 1);  // unknown
  EXPECT_THROW(c.apply_env(), InvalidArgument);
  unsetenv("EPX_HT_NUM_SMS");
  unsetenv("EPX_TIMEOUT");
  EXPECT_EQ(c.ht_num_sms, 64);
}

// EPX_CONFIG / --config naming a directory (a missing file name in a path) read as an empty JSON text:
// "must be valid JSON (... unexpected end of input)". It is named as a path that is not a readable file.
TEST(Config, JsonPathThatIsADirectoryIsNamedAsSuch) {
  const std::string dir = ::testing::TempDir();
  const std::string what = test::invalid_argument_message([&] { Config::load(dir); });
  EXPECT_NE(what.find("config: json_path = " + dir + ": must name a readable file"), std::string::npos) << what;
  EXPECT_EQ(what.find("valid JSON"), std::string::npos) << what;
}

// Keys are flat dotted names; a nested object ({"ll": {"signal": ...}}) is named as such, with the
// flat key it meant, instead of "unknown key ll (did you mean 'ht.pdl'?)".
TEST(Config, NestedJsonObjectIsNamedWithTheFlatKey) {
  Config c;
  try {
    c.apply_json_text(R"({"ll": {"combine": "column"}})", "json nested");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("\"ll.combine\""), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.ll_combine, "partial_fp32");
}

// Config::set checked only that a value parses: ll.combine = columns or ht.num_sms = 0 were taken (and
// failed later, or never, in C++ code that does not call validate()). Now the key's rule is checked
// with its origin named, and a refused value leaves the Config as it was.
TEST(Config, SetChecksTheKeysRuleAndLeavesTheConfigOnFailure) {
  const auto message = [](auto&& fn) { return test::invalid_argument_message(fn); };
  Config c;
  EXPECT_EQ(message([&] { c.set("ll.combine", "columns"); }), "config: ll.combine = columns: must be one of column, partial_fp32, partial_bf16 (set by api)");
  EXPECT_EQ(c.ll_combine, "partial_fp32");  // the default, unchanged
  EXPECT_EQ(message([&] { c.set("ht.num_sms", "0", "cli"); }), "config: ht.num_sms = 0: must be in [1, 132] (set by cli)");
  EXPECT_EQ(c.ht_num_sms, 64);
  EXPECT_NE(message([&] { c.set("timeout_s", "-1"); }).find("timeout_s = -1"), std::string::npos);
  EXPECT_EQ(c.timeout_s, 60.0);
  EXPECT_TRUE(c.sources.empty()) << c.sources.front().first;
  c.set("ht.num_sms", "24", "cli");
  EXPECT_EQ(c.ht_num_sms, 24);
  ASSERT_EQ(c.sources.size(), 1u);
  EXPECT_EQ(c.sources[0], (std::pair<std::string, std::string>{"ht.num_sms", "cli"}));
  // A field set badly in code elsewhere does not make an unrelated set() fail.
  c.ll_warps_per_block = 6;
  EXPECT_NO_THROW(c.set("ll.combine", "column"));
  EXPECT_EQ(c.ll_combine, "column");
}

// A whole integer too large for its field was called "not an integer"; a value set by an EPX_* variable
// or a JSON file that breaks its rule did not say where it came from; "7 " was refused while " 7" passed.
TEST(Config, IntegerRangeAndTheSourceOfABadValueAreNamed) {
  const auto message = [](auto&& fn) { return test::invalid_argument_message(fn); };
  Config c;
  std::string m = message([&] { c.set("fhmoe.max_tokens", "99999999999"); });
  EXPECT_EQ(m, "config: fhmoe.max_tokens = 99999999999: must be an integer in [-2147483648, 2147483647]");
  m = message([&] { c.set("fhmoe.max_tokens", "1.5"); });
  EXPECT_EQ(m, "config: fhmoe.max_tokens = 1.5: must be an integer");
  m = message([&] { c.set("fhmoe.max_tokens", ""); });
  EXPECT_EQ(m, "config: fhmoe.max_tokens = : must be an integer");
  c.set("fhmoe.max_tokens", "7 ");
  EXPECT_EQ(c.fhmoe_max_tokens, 7);
  c.set("fhmoe.max_tokens", " +8");
  EXPECT_EQ(c.fhmoe_max_tokens, 8);
  EXPECT_EQ(c.timeout_s, 60.0);
  m = message([&] { c.set("timeout_s", "abc"); });
  EXPECT_EQ(m, "config: timeout_s = abc: must be a number");

  setenv("EPX_FHMOE_MAX_TOKENS", "-1", 1);
  m = message([] { Config::load(""); });
  unsetenv("EPX_FHMOE_MAX_TOKENS");
  EXPECT_EQ(m, "config: fhmoe.max_tokens = -1: must be >= 0 (set by env EPX_FHMOE_MAX_TOKENS)");
  setenv("EPX_FHMOE_MAX_TOKENS_MIXED", "-2", 1);
  m = message([] { Config::load(""); });
  unsetenv("EPX_FHMOE_MAX_TOKENS_MIXED");
  EXPECT_EQ(m, "config: fhmoe.max_tokens_mixed = -2: must be >= 0 (set by env EPX_FHMOE_MAX_TOKENS_MIXED)");
  setenv("EPX_FHMOE_MAX_TOKENS_MIXED", "768", 1);
  EXPECT_EQ(Config::load("").fhmoe_max_tokens_mixed, 768);
  unsetenv("EPX_FHMOE_MAX_TOKENS_MIXED");
  Config j;
  m = message([&] { j.apply_json_text(R"({"experts.fp8_prefill_min_tiles": -3})", "json my.json"); });
  EXPECT_EQ(m, "config: experts.fp8_prefill_min_tiles = -3: must be >= 0 (set by json my.json)");
  Config d;
  d.ht_num_sms = 0;  // set in code: no source to name
  m = message([&] { d.validate(); });
  EXPECT_EQ(m, "config: ht.num_sms = 0: must be in [1, 132]");
  // epx info's columns keep a blank between them when a key = value is longer than the column
  for (const auto& line : Config{}.describe()) {
    if (line.rfind("experts.fp8_prefill_min_tiles", 0) == 0) {
      EXPECT_NE(line.find("= 0 [default]"), std::string::npos) << line;
    }
  }
}

// Three inputs the Config refuses, naming the key, the value and the rule, and leaving the Config as it was:
// timeout_s = 1e-300 (a wait no peer can meet: it ends before any step of a peer can land), a number given as a
// JSON string ("5"), and a key given twice in one JSON object (taking the last would hide the first). EPX_*
// variables still carry numbers as text.
TEST(Config, TinyTimeoutStringNumbersAndDuplicateJsonKeysAreRefused) {
  const auto message = [](auto&& fn) { return test::invalid_argument_message(fn); };
  Config c;
  std::string m = message([&] { c.set("timeout_s", "1e-300"); });
  EXPECT_NE(m.find("config: timeout_s = 1e-300: must be"), std::string::npos) << m;
  EXPECT_NE(m.find("must be in [0.001, 1e9] (a shorter wait cannot outlast one step of a peer"), std::string::npos) << m;
  m = message([&] { c.apply_json_text(R"({"timeout_s": 1e-300})", "json tiny"); });
  EXPECT_NE(m.find("config: timeout_s = 1e-300: must be"), std::string::npos) << m;
  EXPECT_NE(m.find("(set by json tiny)"), std::string::npos) << m;
  EXPECT_EQ(c.timeout_s, 60.0);
  c.set("timeout_s", "0.001");  // the smallest allowed
  EXPECT_EQ(c.timeout_s, 0.001);

  Config j;
  m = message([&] { j.apply_json_text(R"({"ht.num_sms": 24, "timeout_s": "5"})", "json strings"); });
  EXPECT_EQ(m, "config: timeout_s = \"5\": must be a JSON number, not a string (json strings)");
  m = message([&] { j.apply_json_text(R"({"fhmoe.max_tokens": "7"})", "json strings"); });
  EXPECT_EQ(m, "config: fhmoe.max_tokens = \"7\": must be a JSON number, not a string (json strings)");
  m = message([&] { j.apply_json_text(R"({"ll.combine": 3})", "json numbers"); });
  EXPECT_EQ(m, "config: ll.combine = 3: must be a JSON string (json numbers)");
  EXPECT_EQ(j.timeout_s, 60.0);
  EXPECT_EQ(j.ht_num_sms, 64);
  j.apply_json_text(R"({"ht.num_sms": 24, "timeout_s": 5, "ll.combine": "column"})", "json good");
  EXPECT_EQ(j.ht_num_sms, 24);
  EXPECT_EQ(j.timeout_s, 5.0);
  EXPECT_EQ(j.ll_combine, "column");

  Config d;
  m = message([&] { d.apply_json_text(R"({"ht.num_sms": 24, "timeout_s": 5, "ht.num_sms": 32})", "json dup"); });
  EXPECT_EQ(m, "config: ht.num_sms = 32: is given twice in one JSON object (json dup); give each key once");
  EXPECT_EQ(d.ht_num_sms, 64);
  EXPECT_EQ(d.timeout_s, 60.0);

  // The environment still gives numbers as text, and its timeout_s has the same floor.
  setenv("EPX_TIMEOUT_S", "7.5", 1);
  EXPECT_EQ(Config::load("").timeout_s, 7.5);
  setenv("EPX_TIMEOUT_S", "1e-300", 1);
  m = message([] { Config::load(""); });
  unsetenv("EPX_TIMEOUT_S");
  EXPECT_NE(m.find("config: timeout_s = 1e-300: must be"), std::string::npos) << m;
  EXPECT_NE(m.find("(set by env EPX_TIMEOUT_S)"), std::string::npos) << m;
}
