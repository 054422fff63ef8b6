// tools/epx/moe_run.cpp: workload construction, one backend's run over R CPU ranks, validation.
#include "moe_run.h"

#include "moe_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <random>
#include <thread>

#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/routing.h"
#include "epx/trace.h"

namespace epx::cli {

namespace {
constexpr std::string_view kOp = "epx moe";

uint64_t mix(uint64_t x) {  // splitmix64: decorrelates (seed, step, rank) streams
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

uint64_t stream_seed(uint64_t seed, uint64_t what, uint64_t step, uint64_t rank) {
  return mix(mix(mix(seed) ^ what) ^ step) ^ rank;
}

// [T, H] bf16 N(0, 1): the scale of post-norm hidden states.
Tensor random_hidden(int64_t T, int64_t H, uint64_t seed) {
  Tensor x = Tensor::empty({T, H}, DType::bf16);
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  uint16_t* p = x.ptr<uint16_t>();
  for (int64_t i = 0; i < T * H; ++i) p[i] = float_to_bf16_bits(n(g));
  return x;
}

// Synthetic routing: K distinct experts per token drawn without replacement from a popularity
// p(expert perm[i]) ~ 1 / (i + 1)^s (s = 0: uniform); weights positive, summing to 1. A large s
// underflows the tail's popularity to 0: once the positive ones are drawn, the token takes the
// first experts not yet drawn (every eligible expert can be picked, whatever its popularity).
void synthetic_routing(int64_t T, int K, int E, double zipf_s, const std::vector<int>& perm, uint64_t seed, Tensor& idx,
                       Tensor& wts) {
  idx = Tensor::empty({T, K}, DType::int32);
  wts = Tensor::empty({T, K}, DType::fp32);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> pop(E);
  for (int i = 0; i < E; ++i) pop[i] = zipf_s > 0 ? 1.0 / std::pow(i + 1.0, zipf_s) : 1.0;
  std::vector<double> left(E);
  std::vector<char> drawn(E);
  for (int64_t t = 0; t < T; ++t) {
    left = pop;
    std::fill(drawn.begin(), drawn.end(), 0);
    double total = 0, wsum = 0;
    for (double v : left) total += v;
    for (int k = 0; k < K; ++k) {  // K <= E: an expert not yet drawn is always left
      double x = u(g) * total;
      int pick = -1;
      for (int i = 0; i < E; ++i) {
        if (drawn[i]) continue;
        if (pick < 0 || left[i] > 0) pick = i;  // the last positive one absorbs rounding at the top end
        if (left[i] > 0 && (x -= left[i]) < 0) break;
      }
      total = std::max(0.0, total - left[pick]);
      left[pick] = 0;
      drawn[pick] = 1;
      idx.ptr<int32_t>()[t * K + k] = perm[pick];
      const double w = 0.05 + u(g);
      wts.ptr<float>()[t * K + k] = static_cast<float>(w);
      wsum += w;
    }
    for (int k = 0; k < K; ++k) wts.ptr<float>()[t * K + k] = static_cast<float>(wts.ptr<float>()[t * K + k] / wsum);
  }
}

// Rows of `parts` (each [T_r, cols] of `dtype`) stacked into [sum T_r, cols].
Tensor concat_rows(const std::vector<Tensor>& parts, DType dtype, int64_t cols) {
  int64_t rows = 0;
  for (const Tensor& p : parts) rows += p.size(0);
  Tensor out = Tensor::empty({rows, cols}, dtype);
  char* dst = static_cast<char*>(out.data());
  for (const Tensor& p : parts) {
    if (p.nbytes() > 0) std::memcpy(dst, p.data(), static_cast<size_t>(p.nbytes()));
    dst += p.nbytes();
  }
  return out;
}

// Rows `rows` of t [N, cols] (any dtype) as a new contiguous tensor.
Tensor gather_rows(const Tensor& t, const std::vector<int64_t>& rows) {
  const int64_t cols = t.size(1), row_bytes = cols * dtype_size(t.dtype());
  Tensor out = Tensor::empty({static_cast<int64_t>(rows.size()), cols}, t.dtype());
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(static_cast<char*>(out.data()) + i * row_bytes, static_cast<const char*>(t.data()) + rows[i] * row_bytes,
                static_cast<size_t>(row_bytes));
  return out;
}

// Per token of the concatenated step: did ModularMoE run its chunk's shared expert fused? Mirrors
// the layer's rule (moe.h): chunk c of every rank; M = max over ranks of chunk c's tokens; fused
// when mode is fused, or auto and M <= the gate (`fhmoe_max_tokens`: the layer's, e.g.
// ModularMoE::fhmoe_max_tokens; -1 = Config::fhmoe_max_tokens). Only matters for the reference's
// rounding when the wire is fp8 (fused: one rounding of the routed sum plus g * shared).
std::vector<char> fused_per_token(const Workload& w, const StepInput& st, int64_t fhmoe_max_tokens, int64_t local_slot_tokens,
                                  int64_t graph_tokens) {
  const int64_t gate = fhmoe_max_tokens >= 0 ? fhmoe_max_tokens : w.config.fhmoe_max_tokens;
  std::vector<int64_t> tokens;
  int64_t max_t = 0;
  for (const Tensor& x : st.x) max_t = std::max(max_t, tokens.emplace_back(x.size(0)));
  const int64_t chunk = w.chunk_size > 0 ? w.chunk_size : std::max<int64_t>(max_t, 1);
  std::vector<char> fused;
  for (int64_t T : tokens)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t c = t / chunk;
      int64_t m = 0;
      for (int64_t u : tokens) m = std::max(m, std::clamp<int64_t>(u - c * chunk, 0, chunk));
      if (graph_tokens > 0) m = graph_tokens;
      const bool f = w.shared_mode == SharedExpertMode::fused || (w.shared_mode == SharedExpertMode::auto_gate && m <= gate);
      fused.push_back(!f ? 0 : local_slot_tokens >= 0 && m > local_slot_tokens ? 2 : 1);
    }
  return fused;
}

bool check_step(const Tensor& out, const Tensor& ref, size_t step, BackendResult& res) {
  double max_rel = 0, rel_l2 = 0;
  errors_against(out, ref, &max_rel, &rel_l2);
  res.max_rel_error = std::max(res.max_rel_error, max_rel);
  res.rel_l2_error = std::max(res.rel_l2_error, rel_l2);
  if (rel_l2 <= kRelL2Tolerance) return true;
  if (res.message.empty())
    res.message = "step " + std::to_string(step) + ": rel L2 error " + std::to_string(rel_l2) + " > " + std::to_string(kRelL2Tolerance);
  return false;
}

void errors_against(const Tensor& out, const Tensor& ref, double* max_rel, double* rel_l2) {
  const int64_t n = ref.numel();
  const uint16_t* a = out.ptr<uint16_t>();
  const uint16_t* b = ref.ptr<uint16_t>();
  double max_diff = 0, max_ref = 0, sq_diff = 0, sq_ref = 0;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const double x = bf16_bits_to_float(a[i]), y = bf16_bits_to_float(b[i]);
    const double d = std::fabs(x - y);
    if (std::isnan(d) || std::isinf(d)) nan = true;
    max_diff = std::max(max_diff, d);
    max_ref = std::max(max_ref, std::fabs(y));
    sq_diff += d * d;
    sq_ref += y * y;
  }
  if (nan) {
    *max_rel = *rel_l2 = INFINITY;  // NaN never passes
    return;
  }
  *max_rel = max_diff == 0 ? 0.0 : max_diff / std::max(max_ref, 1e-30);
  *rel_l2 = sq_diff == 0 ? 0.0 : std::sqrt(sq_diff / std::max(sq_ref, 1e-300));
}

namespace {
PathCounters minus(const PathCounters& a, const PathCounters& b) {
  PathCounters d = a;
  d.calls -= b.calls;
  d.chunks -= b.chunks;
  d.idle_chunks -= b.idle_chunks;
  d.shared_fused -= b.shared_fused;
  d.shared_separate -= b.shared_separate;
  d.shared_sharded -= b.shared_sharded;
  d.graph_replays -= b.graph_replays;
  return d;
}
}  // namespace

int64_t StepInput::num_tokens() const {
  int64_t n = 0;
  for (const Tensor& t : x) n += t.size(0);
  return n;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos)), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

std::string shared_mode_name(SharedExpertMode m) {
  return m == SharedExpertMode::separate ? "separate" : m == SharedExpertMode::fused ? "fused" : "auto";
}

std::vector<RunVariant> run_variants(const Workload& w, const std::vector<std::string>& backends, bool compare) {
  std::vector<RunVariant> v;
  const bool ab = compare && w.model.num_shared_experts > 0;
  for (const std::string& b : backends) {
    if (!ab) {
      v.push_back({b, w.shared_mode});
      continue;
    }
    v.push_back({b, SharedExpertMode::fused});
    v.push_back({b, SharedExpertMode::separate});
  }
  return v;
}

double tokens_per_second(const Workload& w, const BackendResult& r) {
  double tokens = 0, seconds = 0;
  for (size_t s = 0; s < r.step_us.size() && s < w.steps.size(); ++s) {
    tokens += static_cast<double>(w.steps[s].num_tokens());
    seconds += r.step_us[s] * 1e-6;
  }
  return seconds > 0 ? tokens / seconds : 0.0;
}

void set_shared_mode(Workload& w, SharedExpertMode mode) {
  if (mode == w.shared_mode) return;
  w.shared_mode = mode;
  if (w.model.num_shared_experts > 0 && w.dispatch_dtype != DType::bf16)
    for (StepInput& st : w.steps) st.reference = Tensor();
}

Workload build_workload(const MoeOptions& options, const Config& config) {
  MoeOptions o = options;
  require_arg(kOp, "--mode", o.mode, o.mode.empty() || o.mode == "decode" || o.mode == "prefill", "must be decode or prefill");
  if (!o.tokens_given && o.trace.empty() && !o.mode.empty())
    o.tokens_per_rank = o.mode == "decode" ? kDecodeTokensPerRank : kPrefillTokensPerRank;
  Workload w;
  w.mode = o.mode;
  w.use_graph = o.mode == "decode" && o.graph;
  w.compare = o.compare;
  w.expert_contiguous = o.expert_contiguous;
  w.model = workload_model(o);  // the preset, or the --checkpoint layer
  w.config = config;
  const int K = w.model.router.top_k, E = w.model.router.num_experts;
  const int64_t H = w.model.hidden;
  w.dispatch_dtype = parse_dtype(o.dispatch_dtype);
  require_arg(kOp, "--dispatch-dtype", o.dispatch_dtype, w.dispatch_dtype == DType::bf16 || w.dispatch_dtype == DType::fp8_e4m3,
              "must be bf16 or fp8");
  w.shared_mode = o.shared == "separate" ? SharedExpertMode::separate
                  : o.shared == "fused"  ? SharedExpertMode::fused
                                         : SharedExpertMode::auto_gate;
  // Given on a model without one, --shared chose nothing, and the results would say it ran.
  require_arg(kOp, "--shared", o.shared, !o.shared_given || w.model.num_shared_experts > 0,
              "needs a model with a shared expert (" + w.model.name + " has none)");
  // Likewise --expert-contiguous with one backend other than ht: it would change nothing and the results would not say so.
  require_arg(kOp, "--expert-contiguous", "given", !o.expert_contiguous || o.backend == "ht" || o.backend == "all",
              "is an ht option (the experts on ht's expert-contiguous rows); --backend " + o.backend + " does not take it");
  require_arg(kOp, "--warmup", o.warmup, o.warmup >= 0, "must be >= 0");
  require_arg(kOp, "--chunk-size", o.chunk_size, o.chunk_size >= 0, "must be >= 0 (0 = moe.chunk_size of the config)");
  require_arg(kOp, "--expert-pool", o.expert_pool, o.expert_pool >= 0 && o.expert_pool <= E,
              "must be in [0, num_experts = " + std::to_string(E) + "] (0 = every expert distinct)");
  w.warmup = o.warmup;

  if (!o.trace.empty()) {
    require_arg(kOp, "--tokens-per-rank", o.tokens_per_rank, !o.tokens_given, "cannot be combined with --trace (the trace gives T per rank and step)");
    require_arg(kOp, "--routing", o.routing, !o.routing_given, "cannot be combined with --trace (the trace gives the routing)");
    const Trace t = load_trace(o.trace);
    const std::string rule_src = " (trace " + o.trace + ")";
    require_arg(kOp, "--ranks", o.ranks, !o.ranks_given || o.ranks == t.num_ranks,
                "must equal the trace's num_ranks = " + std::to_string(t.num_ranks) + rule_src);
    require_arg(kOp, "trace top_k", t.top_k, t.top_k == K,
                "must equal the preset's top_k = " + std::to_string(K) + " (" + o.preset + ")" + rule_src);
    require_arg(kOp, "trace num_experts", t.num_experts, t.num_experts <= E,
                "must be <= the preset's num_experts = " + std::to_string(E) + " (" + o.preset + ")" + rule_src);
    require_arg(kOp, "trace hidden", t.hidden, t.hidden == 0 || t.hidden == H,
                "must equal the preset's hidden = " + std::to_string(H) + " (" + o.preset + ")" + rule_src);
    require_arg(kOp, "trace steps", t.steps.size(), !t.steps.empty(), "must be >= 1" + rule_src);
    require_arg(kOp, "--steps", o.steps, !o.steps_given || o.steps >= 1, "must be >= 1");
    const size_t S = o.steps_given ? std::min<size_t>(o.steps, t.steps.size()) : t.steps.size();
    w.num_ranks = t.num_ranks;
    w.routing = "trace " + o.trace;
    w.trace_source = t.source;
    for (size_t s = 0; s < S; ++s) {
      StepInput st;
      for (int r = 0; r < t.num_ranks; ++r) {
        const TraceRank& tr = t.steps[s].ranks[r];
        st.x.push_back(tr.hidden_states);  // undefined: random, filled below
        st.topk_idx.push_back(tr.topk_idx);
        st.topk_weights.push_back(tr.topk_weights);
      }
      w.steps.push_back(std::move(st));
    }
    // Random hidden states of (step, rank) depend only on (seed, step, rank): built in parallel
    // (a sweep trace holds ~10^9 values; one thread took ~10 ns each).
    std::vector<std::pair<size_t, int>> todo;
    for (size_t s = 0; s < S; ++s)
      for (int r = 0; r < t.num_ranks; ++r)
        if (!w.steps[s].x[r].defined()) todo.emplace_back(s, r);
    const size_t nt = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, std::max<size_t>(todo.size(), 1));
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(nt);
    for (size_t i = 0; i < nt; ++i)
      threads.emplace_back([&, i] {
        try {
          for (size_t j = i; j < todo.size(); j += nt) {
            const auto [s, r] = todo[j];
            w.steps[s].x[r] = random_hidden(t.steps[s].ranks[r].num_tokens(), H, stream_seed(o.seed, 1, s, r));
          }
        } catch (...) {
          errors[i] = std::current_exception();  // rethrown on this thread below
        }
      });
    for (auto& th : threads) th.join();
    for (const auto& e : errors)
      if (e) std::rethrow_exception(e);
  } else {
    require_arg(kOp, "--ranks", o.ranks, o.ranks >= 1 && o.ranks <= 1024, "must be in [1, 1024]");
    require_arg(kOp, "--tokens-per-rank", o.tokens_per_rank, o.tokens_per_rank >= 0, "must be >= 0");
    require_arg(kOp, "--steps", o.steps, o.steps >= 1, "must be >= 1");
    require_arg(kOp, "--zipf-s", o.zipf_s, o.routing != "zipf" || o.zipf_s > 0, "must be > 0 with --routing zipf");
    w.num_ranks = o.ranks;
    w.use_router = o.routing == "router";
    w.routing = o.routing == "zipf" ? "zipf(s=" + std::to_string(o.zipf_s).substr(0, 4) + ")" : o.routing;
    // Hot experts sit at random places, so Zipf skew lands on random ranks, not always rank 0.
    std::vector<int> perm(E);
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(stream_seed(o.seed, 2, 0, 0)));
    const std::vector<Tensor> hidden = workload_hidden(o, H, o.ranks);  // --hidden FILE, else empty
    for (int s = 0; s < o.steps; ++s) {
      StepInput st;
      for (int r = 0; r < o.ranks; ++r) {
        const int64_t T = hidden.empty() ? o.tokens_per_rank : hidden[r].size(0);
        st.x.push_back(hidden.empty() ? random_hidden(T, H, stream_seed(o.seed, 1, s, r)) : hidden[r]);
        if (w.use_router) continue;
        Tensor idx, wts;
        synthetic_routing(T, K, E, o.routing == "zipf" ? o.zipf_s : 0.0, perm, stream_seed(o.seed, 3, s, r), idx, wts);
        st.topk_idx.push_back(idx);
        st.topk_weights.push_back(wts);
      }
      w.steps.push_back(std::move(st));
    }
  }
  for (const StepInput& st : w.steps)
    for (const Tensor& x : st.x) w.max_tokens_per_rank = std::max(w.max_tokens_per_rank, x.size(0));
  w.chunk_size = o.chunk_size > 0 ? o.chunk_size : config.moe_chunk_size;
  w.capacity = w.chunk_size > 0 ? w.chunk_size : std::max<int64_t>(1, w.max_tokens_per_rank);
  w.weights = workload_weights(o, w.model);  // random, or the --checkpoint experts [expert_begin, expert_end)
  return w;
}

void ensure_references(Workload& w) {
  const int64_t H = w.model.hidden;
  const int K = w.model.router.top_k;
  for (StepInput& st : w.steps) {
    if (st.reference.defined()) continue;
    const Tensor x = concat_rows(st.x, DType::bf16, H);
    const int64_t N = x.size(0);
    Tensor idx, wts;
    if (w.use_router) {
      Tensor logits = Tensor::empty({N, w.model.router.num_experts}, DType::fp32);
      idx = Tensor::empty({N, K}, DType::int32);
      wts = Tensor::empty({N, K}, DType::fp32);
      router_logits_cpu(*w.weights, x, logits);
      route(w.model.router, logits, w.weights->correction_bias.view(), idx, wts);
    } else {
      idx = concat_rows(st.topk_idx, DType::int32, K);
      wts = concat_rows(st.topk_weights, DType::fp32, K);
    }
    ReferenceOptions ro;
    ro.dispatch_dtype = w.dispatch_dtype;
    st.reference = Tensor::empty({N, H}, DType::bf16);
    // With a bf16 wire fused and separate references coincide; with fp8 they differ in the shared
    // expert's input, so rows are split by the path their chunk took.
    std::vector<char> fused;
    if (w.model.num_shared_experts > 0 && w.dispatch_dtype != DType::bf16) fused = fused_per_token(w, st);
    std::vector<int64_t> rows[3];  // by path: separate, fused (one rounding each), two roundings (fused_per_token)
    for (int64_t t = 0; t < N; ++t) rows[fused.empty() ? 0 : fused[t]].push_back(t);
    for (int f = 0; f < 3; ++f) {
      ro.shared_fused = f == 1;
      ro.two_roundings = f == 2;
      if (rows[f].size() == static_cast<size_t>(N)) {
        moe_reference_cpu(*w.weights, x, idx, wts, st.reference, ro);
      } else if (!rows[f].empty()) {
        Tensor part = Tensor::empty({static_cast<int64_t>(rows[f].size()), H}, DType::bf16);
        moe_reference_cpu(*w.weights, gather_rows(x, rows[f]), gather_rows(idx, rows[f]), gather_rows(wts, rows[f]), part, ro);
        for (size_t i = 0; i < rows[f].size(); ++i)
          std::memcpy(st.reference.ptr<uint16_t>() + rows[f][i] * H, part.ptr<uint16_t>() + i * H, static_cast<size_t>(H * 2));
      }
    }
  }
}

BackendResult run_backend(const Workload& w, const std::string& backend) {
  BackendResult res;
  res.backend = backend;
  const int R = w.num_ranks;
  const size_t S = w.steps.size();
  const int64_t H = w.model.hidden;
  // Outputs start as NaN (0xFF bytes), so a row the layer never writes fails validation.
  std::vector<std::vector<Tensor>> outs(S, std::vector<Tensor>(R));
  for (size_t s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) {
      outs[s][r] = Tensor::empty({w.steps[s].x[r].size(0), H}, DType::bf16);
      std::memset(outs[s][r].data(), 0xFF, static_cast<size_t>(outs[s][r].nbytes()));
    }
  std::vector<double> step_us(S, 0.0);
  std::vector<PathCounters> counters(R);
  res.shared_mode = w.shared_mode;

  DispatchConfig dcfg;
  dcfg.num_max_dispatch_tokens_per_rank = static_cast<int>(w.capacity);
  dcfg.dispatch_dtype = w.dispatch_dtype;
  dcfg.expert_contiguous = w.expert_contiguous && backend == "ht";  // (an ht option: the other backends run as without it)
  ModularMoEOptions mo;
  mo.shared_mode = w.shared_mode;
  mo.chunk_size = w.chunk_size;
  mo.time_phases = true;
  std::vector<PhaseTimes> phases(S);  // rank 0's (ranks are threads sharing the cores)
  auto groups = make_cpu_groups(R, w.config.timeout_s);
  try {
    run_ranks(groups, [&](int r) {
      ModularMoE layer(w.weights, groups[r], backend, dcfg, w.config, mo);
      if (r == 0) {
        res.shared_sharded = layer.shared_expert_sharded();
        // Ranks are threads here: a whole-layer graph needs a CUDA group (--device cuda).
        if (w.use_graph) res.graph_reason = layer.why_no_graph(w.max_tokens_per_rank).value_or("");
      }
      auto call = [&](size_t s, const TensorView& out) {
        const StepInput& st = w.steps[s];
        if (w.use_router) layer.forward(st.x[r], out);
        else layer.forward_routed(st.x[r], st.topk_idx[r], st.topk_weights[r], out);
      };
      for (int i = 0; i < w.warmup; ++i) {
        const size_t s = static_cast<size_t>(i) % S;
        Tensor scratch = Tensor::empty({w.steps[s].x[r].size(0), H}, DType::bf16);
        call(s, scratch);
      }
      const PathCounters before = layer.counters();
      for (size_t s = 0; s < S; ++s) {
        groups[r]->barrier();
        const auto t0 = std::chrono::steady_clock::now();
        call(s, outs[s][r]);
        groups[r]->barrier();
        const auto t1 = std::chrono::steady_clock::now();
        if (r == 0) step_us[s] = std::chrono::duration<double, std::micro>(t1 - t0).count();
        if (r == 0) phases[s] = layer.last_phase_times();
      }
      counters[r] = minus(layer.counters(), before);
    });
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Unsupported& e) {
    res.status = "unsupported";
    res.message = e.what();
    return res;
  } catch (const std::exception& e) {
    res.status = "error";
    res.message = e.what();
    return res;
  }
  res.step_us = step_us;
  res.phases = phases;
  res.counters = counters[0];
  bool ok = true;
  for (size_t s = 0; s < S; ++s) {
    if (!check_step(concat_rows(outs[s], DType::bf16, H), w.steps[s].reference, s, res)) ok = false;
  }
  res.validated = true;
  res.status = ok ? "pass" : "FAIL";
  return res;
}

}  // namespace epx::cli
