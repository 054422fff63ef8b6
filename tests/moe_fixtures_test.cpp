// tests/moe_fixtures_test.cpp: MoE layers checked against their model's own definition.
//
// A fixture is a directory <family>-<layout>/ holding a one-layer checkpoint (config.json +
// model.safetensors, layer 0, in the layout its name says) and io.safetensors:
//   x            BF16 [T, H]  the block's input
//   out          F32  [T, H]  the MoE block's output (routed + shared), computed in fp32
//   topk_idx     I64  [T, K]  the router's choice
//   topk_weights F32  [T, K]  its weights (what multiplies each expert's output)
//   router_logits F32 [T, E]
// with __metadata__ naming the generator and, for tools/make_moe_fixtures.py, the transformers
// version. Every fixture is loaded through load_moe_layer and run on every CPU backend at R = 1, 2, 4
// with bf16 and FP8 dispatch on the fixture's routing: rel L2 to `out` <= 1e-2 (bf16) / 5e-2 (FP8).
// The layer's own router is compared with topk_idx: tokens whose expert set differs are counted,
// and a flip must be a near tie (selection scores within 1e-2 of each other) and at most 2% of T.
//
// Two sources: tests/fixtures/moe (transformers' own modules, written by tools/make_moe_fixtures.py
// on a machine with torch; skipped with the reason when absent) and fixtures this test writes itself
// from the model code's formulas evaluated here in double (Mixtral, Qwen2/3-MoE, DeepSeek-V3,
// gpt-oss with biases, both layouts), which runs everywhere and checks the harness.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <set>

#include "epx/checkpoint.h"
#include "epx/dispatch.h"
#include "epx/group.h"
#include "epx/moe.h"
#include "epx/quant.h"
#include "test_util.h"

#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace epx {
namespace {

namespace fs = std::filesystem;

struct Fixture {
  std::string name, dir;
  Tensor x, out, topk_idx, topk_weights, logits;  // x bf16; the rest fp32 / int64 as read
  std::map<std::string, std::string> meta;
};

Tensor read_as(const SafetensorsFile& f, const std::string& name, DType want) {
  Tensor t = f.read(name);
  if (t.dtype() == want) return t;
  Tensor o = Tensor::empty(std::vector<int64_t>(t.view().shape.begin(), t.view().shape.begin() + t.view().ndim), want);
  if (t.dtype() == DType::int32 && want == DType::int64) {
    for (int64_t i = 0; i < t.numel(); ++i) o.ptr<int64_t>()[i] = t.ptr<const int32_t>()[i];
  } else if (t.dtype() == DType::bf16 && want == DType::fp32) {
    for (int64_t i = 0; i < t.numel(); ++i) o.ptr<float>()[i] = bf16_bits_to_float(t.ptr<const uint16_t>()[i]);
  } else {
    throw InvalidArgument(f.path() + ": " + name + " has an unexpected dtype " + std::string(dtype_name(t.dtype())));
  }
  return o;
}

Fixture read_fixture(const fs::path& dir) {
  Fixture fx;
  fx.name = dir.filename().string();
  fx.dir = dir.string();
  const SafetensorsFile f = SafetensorsFile::open((dir / "io.safetensors").string());
  fx.x = f.read("x");
  fx.out = read_as(f, "out", DType::fp32);
  fx.topk_idx = read_as(f, "topk_idx", DType::int64);
  fx.topk_weights = read_as(f, "topk_weights", DType::fp32);
  fx.logits = read_as(f, "router_logits", DType::fp32);
  fx.meta = f.metadata();
  return fx;
}

double rel_l2(const Tensor& got_bf16, const Tensor& want_f32) {
  double e = 0, n = 0;
  for (int64_t i = 0; i < want_f32.numel(); ++i) {
    const double g = bf16_bits_to_float(got_bf16.ptr<const uint16_t>()[i]), w = want_f32.ptr<const float>()[i];
    e += (g - w) * (g - w);
    n += w * w;
  }
  return std::isfinite(e) && n > 0 ? std::sqrt(e / n) : INFINITY;
}

/// The layer over R CPU ranks (tokens split in order) on the given routing; out [T, H] bf16.
Tensor run_layer(const std::shared_ptr<const MoEWeights>& w, const Fixture& fx, const std::string& backend, int R, DType dtype) {
  const int64_t T = fx.x.size(0), H = fx.x.size(1), K = fx.topk_idx.size(1);
  Tensor out = Tensor::empty({T, H}, DType::bf16);
  std::vector<int64_t> begin(static_cast<size_t>(R) + 1, 0);
  for (int r = 0; r < R; ++r) begin[r + 1] = begin[r] + T / R + (r < T % R ? 1 : 0);
  DispatchConfig dc;
  dc.num_max_dispatch_tokens_per_rank = static_cast<int>(T / R + 1);
  dc.dispatch_dtype = dtype;
  auto groups = make_cpu_groups(R, 60.0);
  run_ranks(groups, [&](int r) {
    const int64_t b = begin[r], n = begin[r + 1] - b;
    ModularMoE layer(w, groups[r], backend, dc, Config{});
    const TensorView xv(fx.x.ptr<uint16_t>() + b * H, DType::bf16, {n, H});
    const TensorView iv(fx.topk_idx.ptr<int64_t>() + b * K, DType::int64, {n, K});
    const TensorView wv(fx.topk_weights.ptr<float>() + b * K, DType::fp32, {n, K});
    const TensorView ov(out.ptr<uint16_t>() + b * H, DType::bf16, {n, H});
    layer.forward_routed(xv, iv, wv, ov);
  });
  return out;
}

struct RoutingCheck {
  int64_t flips = 0, near_ties = 0;
};

/// The layer's router against the fixture's choice: tokens whose sets differ, and of those the near
/// ties (the fixture's logits of the differing experts within 1e-2 of each other).
RoutingCheck check_routing(const MoEWeights& w, const Fixture& fx) {
  const int64_t T = fx.x.size(0), K = fx.topk_idx.size(1), E = w.config.router.num_experts;
  Tensor logits = Tensor::empty({T, E}, DType::fp32), idx = Tensor::empty({T, K}, DType::int32), wts = Tensor::empty({T, K}, DType::fp32);
  router_logits_cpu(w, fx.x.view(), logits.view());
  route(w.config.router, logits.view(), w.correction_bias.view(), idx.view(), wts.view());
  RoutingCheck c;
  for (int64_t t = 0; t < T; ++t) {
    std::set<int64_t> a, b;
    for (int64_t k = 0; k < K; ++k) a.insert(idx.ptr<int32_t>()[t * K + k]), b.insert(fx.topk_idx.ptr<int64_t>()[t * K + k]);
    if (a == b) continue;
    ++c.flips;
    double gap = INFINITY;
    for (int64_t x : a)
      for (int64_t y : b)
        if (!b.count(x) && !a.count(y)) gap = std::min(gap, std::abs(static_cast<double>(fx.logits.ptr<float>()[t * E + x]) - fx.logits.ptr<float>()[t * E + y]));
    if (gap < 1e-2) ++c.near_ties;
  }
  return c;
}

/// Runs every check on every fixture under `root`; returns how many fixtures ran.
int check_fixtures(const fs::path& root) {
  std::vector<fs::path> dirs;
  for (const auto& d : fs::directory_iterator(root))
    if (fs::exists(d.path() / "io.safetensors")) dirs.push_back(d.path());
  std::sort(dirs.begin(), dirs.end());
  std::printf("%-26s %-24s %2s %-5s %10s %12s\n", "fixture", "backend", "R", "wire", "rel_l2", "route flips");
  for (const fs::path& d : dirs) {
    SCOPED_TRACE(d.string());
    const Fixture fx = read_fixture(d);
    const MoELayerCheckpoint ck = load_moe_layer(fx.dir, {.layer = 0});
    const RoutingCheck rc = check_routing(*ck.weights, fx);
    const int64_t T = fx.x.size(0);
    EXPECT_EQ(rc.flips, rc.near_ties) << fx.name << ": routing differs on tokens that are not near ties";
    EXPECT_LE(rc.flips, std::max<int64_t>(1, T / 50)) << fx.name;
    for (const std::string& backend : backend_names())
      for (int R : {1, 2, 4})
        for (DType dtype : {DType::bf16, DType::fp8_e4m3}) {
          if (dtype == DType::fp8_e4m3 && fx.x.size(1) % 128 != 0) continue;
          SCOPED_TRACE(backend + " R=" + std::to_string(R) + " " + std::string(dtype_name(dtype)));
          Tensor out;
          try {
            out = run_layer(ck.weights, fx, backend, R, dtype);
          } catch (const Unsupported& e) {
            std::printf("%-26s %-24s %2d %-5s %10s %12s\n", fx.name.c_str(), backend.c_str(), R, dtype == DType::bf16 ? "bf16" : "fp8",
                        "n/a", e.what());
            continue;
          }
          const double err = rel_l2(out, fx.out);
          std::printf("%-26s %-24s %2d %-5s %10.2e %5lld/%-6lld\n", fx.name.c_str(), backend.c_str(), R, dtype == DType::bf16 ? "bf16" : "fp8",
                      err, static_cast<long long>(rc.flips), static_cast<long long>(T));
          EXPECT_LE(err, dtype == DType::bf16 ? 1e-2 : 5e-2);
        }
  }
  return static_cast<int>(dirs.size());
}

// ---- fixtures from the model code's formulas, evaluated here in double -------------------------

struct Family {
  std::string name;
  CheckpointConvention conv;
  MoEConfig cfg;
  bool gpt_oss = false;
};

/// [n] fp32 values of bf16 precision from `seed`.
Tensor bf16_valued(int64_t n, uint64_t seed, float scale) {
  Tensor t = test::random_f32(1, n, seed, scale), v = Tensor::empty({n}, DType::fp32);
  for (int64_t i = 0; i < n; ++i) v.ptr<float>()[i] = round_bf16(t.ptr<const float>()[i]);
  return v;
}

std::shared_ptr<MoEWeights> model_weights(const Family& f, uint64_t seed) {
  auto w = MoEWeights::random(f.cfg, seed);
  for (int64_t i = 0; i < w->router_weight.numel(); ++i) w->router_weight.ptr<float>()[i] = round_bf16(w->router_weight.ptr<float>()[i]);
  if (w->shared_gate_weight.defined())
    for (int64_t i = 0; i < w->shared_gate_weight.numel(); ++i) w->shared_gate_weight.ptr<float>()[i] = round_bf16(w->shared_gate_weight.ptr<float>()[i]);
  if (!f.gpt_oss) return w;
  const int64_t H = f.cfg.hidden, I = f.cfg.intermediate;
  for (size_t e = 0; e < w->experts.size(); ++e) {
    const ExpertWeights& s = *w->experts[e];
    auto x = std::make_shared<ExpertWeights>();
    x->format = s.format, x->hidden = s.hidden, x->intermediate = s.intermediate;
    x->w13 = s.w13, x->w2 = s.w2;
    x->activation = ExpertActivation::gpt_oss(1.702f, 7.0f);
    x->b13 = bf16_valued(2 * I, seed * 31 + e, 0.5f);
    x->b2 = bf16_valued(H, seed * 37 + e, 0.25f);
    w->experts[e] = x;
  }
  w->router_bias = bf16_valued(f.cfg.router.num_experts, seed * 41, 0.5f);
  return w;
}

/// One expert in double: gate_up (+ bias), the family's activation, down (+ bias); no rounding.
void expert_double(const ExpertWeights& w, const float* x, std::vector<double>& y) {
  const int64_t H = w.hidden, I = w.intermediate;
  const float *a = w.w13_f32(), *d = w.w2_f32();
  std::vector<double> h(static_cast<size_t>(I));
  const ExpertActivation& act = w.activation;
  for (int64_t i = 0; i < I; ++i) {
    double g = 0, u = 0;
    for (int64_t k = 0; k < H; ++k) g += static_cast<double>(x[k]) * a[i * H + k], u += static_cast<double>(x[k]) * a[(I + i) * H + k];
    if (w.b13.defined()) g += w.b13.ptr<const float>()[i], u += w.b13.ptr<const float>()[I + i];
    if (act.kind == ExpertActivation::Kind::gpt_oss_glu) {
      g = std::min<double>(g, act.limit), u = std::clamp<double>(u, -act.limit, act.limit);
      h[i] = (u + 1) * g / (1 + std::exp(-act.alpha * g));
    } else {
      h[i] = g / (1 + std::exp(-g)) * u;
    }
  }
  y.assign(static_cast<size_t>(H), 0.0);
  for (int64_t o = 0; o < H; ++o) {
    double s = w.b2.defined() ? w.b2.ptr<const float>()[o] : 0.0;
    for (int64_t i = 0; i < I; ++i) s += h[i] * d[o * I + i];
    y[o] = s;
  }
}

/// The block as the model code defines it (MixtralSparseMoeBlock, Qwen2/3MoeSparseMoeBlock,
/// DeepseekV3MoE with its TopkRouter, GptOssMLP), in double; writes io.safetensors into `dir`.
void write_formula_io(const std::string& dir, const MoEWeights& w, int64_t T, uint64_t seed) {
  const MoEConfig& m = w.config;
  const RouterConfig& rc = m.router;
  const int64_t H = m.hidden, E = rc.num_experts, K = rc.top_k;
  Tensor x = test::random_bf16(T, H, seed);
  Tensor out = Tensor::empty({T, H}, DType::fp32), idx = Tensor::empty({T, K}, DType::int64), wts = Tensor::empty({T, K}, DType::fp32),
         logits = Tensor::empty({T, E}, DType::fp32);
  std::vector<float> xf(static_cast<size_t>(H));
  std::vector<double> y, acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < H; ++k) xf[k] = bf16_bits_to_float(x.ptr<uint16_t>()[t * H + k]);
    std::vector<double> l(static_cast<size_t>(E)), sel(static_cast<size_t>(E)), val(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      double s = w.router_bias.defined() ? w.router_bias.ptr<const float>()[e] : 0.0;
      for (int64_t k = 0; k < H; ++k) s += static_cast<double>(xf[k]) * w.router_weight.ptr<const float>()[e * H + k];
      l[e] = s;
      logits.ptr<float>()[t * E + e] = static_cast<float>(s);
    }
    if (rc.scoring == ScoringFunc::sigmoid) {  // DeepseekV3TopkRouter: sigmoid, + bias for choice, group top-2 sums
      for (int64_t e = 0; e < E; ++e) val[e] = 1 / (1 + std::exp(-l[e])), sel[e] = val[e] + (rc.use_correction_bias ? w.correction_bias.ptr<const float>()[e] : 0.0);
      const int64_t G = rc.n_group, per = E / G;
      std::vector<std::pair<double, int64_t>> gs;
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
        std::sort(v.rbegin(), v.rend());
        gs.push_back({v[0] + (per > 1 ? v[1] : 0.0), -g});
      }
      std::sort(gs.rbegin(), gs.rend());
      std::vector<bool> keep(static_cast<size_t>(G), false);
      for (int64_t g = 0; g < rc.topk_group; ++g) keep[-gs[g].second] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per]) sel[e] = 0.0;  // transformers masked_fill(0.0)
    } else {  // softmax over all experts; top-k of the probabilities (gpt-oss: of the logits, the same order)
      const double mx = *std::max_element(l.begin(), l.end());
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - mx);
      for (int64_t e = 0; e < E; ++e) val[e] = sel[e] = std::exp(l[e] - mx) / z;
    }
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sel[a] > sel[b]; });
    double sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += val[order[k]];
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = order[k];
      double wt = val[e];
      if (rc.renormalize) wt /= rc.scoring == ScoringFunc::sigmoid ? sum + 1e-20 : sum;
      wt *= rc.routed_scaling_factor;
      idx.ptr<int64_t>()[t * K + k] = e;
      wts.ptr<float>()[t * K + k] = static_cast<float>(wt);
      expert_double(*w.experts[e], xf.data(), y);
      for (int64_t o = 0; o < H; ++o) acc[o] += static_cast<float>(wt) * y[o];
    }
    if (w.shared) {
      double g = 1;
      if (m.shared_gate) {
        double s = 0;
        for (int64_t k = 0; k < H; ++k) s += static_cast<double>(xf[k]) * w.shared_gate_weight.ptr<const float>()[k];
        g = 1 / (1 + std::exp(-s));
      }
      expert_double(*w.shared, xf.data(), y);
      for (int64_t o = 0; o < H; ++o) acc[o] += g * y[o];
    }
    for (int64_t o = 0; o < H; ++o) out.ptr<float>()[t * H + o] = static_cast<float>(acc[o]);
  }
  write_safetensors(dir + "/io.safetensors",
                    {SafetensorsEntry::from("x", x), SafetensorsEntry::from("out", out), SafetensorsEntry::from("topk_idx", idx, "I64"),
                     SafetensorsEntry::from("topk_weights", wts), SafetensorsEntry::from("router_logits", logits)},
                    {{"generator", "moe_fixtures_test (the model code's formulas in double)"}});
}

std::vector<Family> families() {
  auto cfg = [](const char* p, int E, int K) {
    MoEConfig c = preset(p);
    c.router.num_experts = E;
    c.router.top_k = K;
    c.routed_format = c.shared_format = WeightFormat::bf16;
    return c;
  };
  MoEConfig ds = cfg("deepseek-v3-mini", 16, 4);
  ds.router.n_group = 4, ds.router.topk_group = 2;
  ds.shared_intermediate = ds.intermediate;
  MoEConfig oss = cfg("mixtral-8x7b-mini", 8, 4);
  return {{"mixtral", CheckpointConvention::mixtral, cfg("mixtral-8x7b-mini", 8, 2)},
          {"qwen3_moe", CheckpointConvention::qwen_moe, cfg("qwen3-30b-a3b-mini", 8, 4)},
          {"qwen2_moe", CheckpointConvention::qwen_moe, cfg("qwen1.5-moe-a2.7b-mini", 8, 2)},
          {"deepseek_v3", CheckpointConvention::deepseek, ds},
          {"gpt_oss", CheckpointConvention::gpt_oss, oss, true}};
}

TEST(MoEFixtures, FormulaFixturesMatchOnEveryBackend) {
  const fs::path root = fs::temp_directory_path() / ("epx_moe_fixtures_" + std::to_string(::getpid()));
  fs::remove_all(root);
  uint64_t seed = 1;
  for (const Family& f : families()) {
    const auto w = model_weights(f, ++seed);
    for (bool fused : {false, true}) {
      if (fused && f.gpt_oss) continue;  // gpt-oss has one stacked layout
      const std::string dir = (root / (f.name + (f.gpt_oss ? "-stacked" : fused ? "-fused" : "-per_expert"))).string();
      write_moe_checkpoint(dir, *w, {.convention = f.conv, .layer = 0, .fused_experts = fused});
      write_formula_io(dir, *w, 24, seed * 7);
    }
  }
  EXPECT_EQ(check_fixtures(root), 9);
  fs::remove_all(root);
}

TEST(MoEFixtures, TransformersFixturesMatchOnEveryBackend) {
  const fs::path root = fs::path(EPX_SOURCE_DIR) / "tests" / "fixtures" / "moe";
  if (!fs::is_directory(root))
    GTEST_SKIP() << root.string() << " is absent: tools/make_moe_fixtures.py writes it on a machine with torch and transformers";
  EXPECT_GT(check_fixtures(root), 0) << "no fixture (a directory with io.safetensors) under " << root.string();
}

}  // namespace
}  // namespace epx
