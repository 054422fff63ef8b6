// python/src/bind_moe.cpp: dispatch backends (prepare/finalize), experts, routing, quantization,
// presets, weights and the ModularMoE layer. Names follow include/epx/{dispatch,experts,moe}.h.
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "epx/checkpoint.h"
#include "epx/config.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/experts.h"
#include "epx/moe.h"
#include "epx/quant.h"
#include "epx/routing.h"
#include "py_tensor.h"

namespace epx::py {

namespace {

std::string scoring_name(ScoringFunc s) { return s == ScoringFunc::softmax ? "softmax" : "sigmoid"; }
ScoringFunc parse_scoring(const std::string& s) {
  if (s == "softmax") return ScoringFunc::softmax;
  if (s == "sigmoid") return ScoringFunc::sigmoid;
  throw InvalidArgument(arg_message("epx.RouterConfig", "scoring", s, "must be \"softmax\" or \"sigmoid\""));
}
SharedExpertMode parse_shared_mode(const std::string& s) {
  if (s == "separate") return SharedExpertMode::separate;
  if (s == "fused") return SharedExpertMode::fused;
  if (s == "auto" || s == "auto_gate") return SharedExpertMode::auto_gate;
  throw InvalidArgument(arg_message("epx.ModularMoE", "shared_mode", s, "must be \"separate\", \"fused\" or \"auto\""));
}

/// An owned CPU copy of an argument (weights are CPU-resident and outlive the call).
Tensor owned_cpu_copy(const TensorView& v) {
  if (!v.defined()) return Tensor();
  std::vector<int64_t> dims(v.shape.begin(), v.shape.begin() + v.ndim);
  Tensor t = Tensor::empty(dims, v.dtype);
  copy(t.view(), v);
  return t;
}

std::string activation_kind_name(ExpertActivation::Kind k) {
  return k == ExpertActivation::Kind::gpt_oss_glu ? "gpt_oss_glu" : "silu_glu";
}
ExpertActivation::Kind parse_activation_kind(const std::string& s, std::string_view op) {
  if (s == "silu_glu") return ExpertActivation::Kind::silu_glu;
  if (s == "gpt_oss_glu") return ExpertActivation::Kind::gpt_oss_glu;
  throw InvalidArgument(arg_message(op, "kind", s, "must be \"silu_glu\" or \"gpt_oss_glu\""));
}
/// The rules ExpertWeights::check_extras applies to an activation, checked where Python builds one.
void check_activation(std::string_view op, const ExpertActivation& a) {
  require_arg(op, "limit", a.limit, a.limit > 0, "must be > 0 (the clamp bound; inf = none)");
  require_arg(op, "alpha", a.alpha, std::isfinite(a.alpha), "must be finite");
  if (a.kind == ExpertActivation::Kind::gpt_oss_glu)
    require_arg(op, "limit", a.limit, std::isfinite(a.limit), "must be finite for gpt_oss_glu (swiglu_limit)");
}

/// Sets one of an expert's optional fp32 tensors (b13 / b2) from a Python argument (None clears it) as an
/// owned CPU copy; the expert is checked (check_extras) and left as it was when the value is refused.
void set_expert_bias(ExpertWeights& w, Tensor ExpertWeights::*field, pyb::handle value, const char* name) {
  const std::string op = std::string("epx.ExpertWeights.") + name;
  CallArgs a(op, 0);
  TensorView v = a.get(value, name, std::nullopt, true);
  a.rethrow_local();
  Tensor old = w.*field;
  w.*field = owned_cpu_copy(v);
  try {
    w.check_extras(op, "ExpertWeights");
  } catch (...) {
    w.*field = old;
    throw;
  }
}

/// from_float / random's keyword extras: biases and activation, then check_extras over the result.
std::shared_ptr<ExpertWeights> with_extras(std::shared_ptr<ExpertWeights> w, pyb::handle b13, pyb::handle b2,
                                           std::optional<ExpertActivation> activation, std::string_view op) {
  if (activation) w->activation = *activation;
  set_expert_bias(*w, &ExpertWeights::b13, b13, "b13");
  set_expert_bias(*w, &ExpertWeights::b2, b2, "b2");
  w->check_extras(op, "ExpertWeights");
  return w;
}

/// MoEWeights::router_bias from a Python argument: [E] fp32 (None = no bias), an owned CPU copy.
Tensor router_bias_arg(pyb::handle value, int64_t num_experts, std::string_view op) {
  CallArgs a(std::string(op), 0);
  TensorView v = a.get(value, "router_bias", std::nullopt, true);
  a.rethrow_local();
  if (!v.defined()) return Tensor();
  check_dtype(op, "router_bias", v, {DType::fp32});
  check_shape(op, "router_bias", v, {num_experts});
  return owned_cpu_copy(v);
}

pyb::object opt_view(const TensorView& v, pyb::object owner, int64_t stream) {
  if (!v.defined()) return pyb::none();
  return wrap_view(v, std::move(owner), stream);
}

pyb::object opt_owned(const Tensor& t) { return t.defined() ? wrap_owned(t) : pyb::none(); }

/// A backend plus the group it runs on (kept alive with it).
struct PyPrepareFinalize {
  std::shared_ptr<Group> group;
  std::unique_ptr<PrepareFinalize> pf;
};

/// PrepareResult::contiguous as epx.Tensor views (ht with DispatchConfig::expert_contiguous).
struct PyContiguous {
  pyb::object x, x_scales, expert_offsets, row_expert, pair_row;
  int64_t num_rows = 0;
};

/// prepare()'s result: epx.Tensor views into the backend's buffers (valid until the next prepare).
struct PyPrepareResult {
  PrepareResult raw;
  std::string layout;
  pyb::object x, x_scales, recv_count, topk_idx, topk_weights, num_recv_tokens_device;
  pyb::object contiguous = pyb::none();  ///< a PyContiguous, or None
  int64_t num_recv_tokens = 0;
};

pyb::dict capabilities_dict(const Capabilities& c) {
  pyb::dict d;
  d["name"] = c.name;
  d["layout"] = std::string(layout_name(c.layout));
  d["graph_safe"] = c.graph_safe;
  d["supports_fp8_dispatch"] = c.supports_fp8_dispatch;
  d["static_buffers"] = c.static_buffers;
  d["hierarchical"] = c.hierarchical;
  return d;
}

pyb::dict stats_dict(const DispatchStats& s) {
  pyb::dict d;
  d["num_valid_selections"] = s.num_valid_selections;
  d["num_rank_dedup_rows"] = s.num_rank_dedup_rows;
  d["remote_bytes_dispatch"] = s.remote_bytes_dispatch;
  d["remote_bytes_combine"] = s.remote_bytes_combine;
  return d;
}

void bind_dispatch(pyb::module_& m) {
  pyb::class_<DispatchConfig>(m, "DispatchConfig", "Backend configuration (include/epx/dispatch.h); all ranks must agree.")
      .def(pyb::init([](int64_t hidden, int num_experts, int top_k, int num_max_dispatch_tokens_per_rank, const std::string& dispatch_dtype,
                        bool use_ue8m0, bool shared_route, int expert_alignment, bool use_worst_case_sizing,
                        const std::string& ll_combine, bool expert_contiguous, const std::string& flat_combine) {
             DispatchConfig c;
             c.hidden = hidden;
             c.num_experts = num_experts;
             c.top_k = top_k;
             c.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank;
             c.dispatch_dtype = parse_dtype(dispatch_dtype);
             c.use_ue8m0 = use_ue8m0;
             c.shared_route = shared_route;
             c.expert_alignment = expert_alignment;
             c.use_worst_case_sizing = use_worst_case_sizing;
             c.ll_combine = parse_ll_combine(ll_combine, "DispatchConfig.ll_combine");
             c.expert_contiguous = expert_contiguous;
             c.flat_combine = parse_flat_combine(flat_combine, "DispatchConfig.flat_combine");
             return c;
           }),
           pyb::kw_only(), pyb::arg("hidden") = 0, pyb::arg("num_experts") = 0, pyb::arg("top_k") = 0,
           pyb::arg("num_max_dispatch_tokens_per_rank") = 0, pyb::arg("dispatch_dtype") = "bf16", pyb::arg("use_ue8m0") = false,
           pyb::arg("shared_route") = false, pyb::arg("expert_alignment") = 1, pyb::arg("use_worst_case_sizing") = false,
           pyb::arg("ll_combine") = "partial_fp32", pyb::arg("expert_contiguous") = false, pyb::arg("flat_combine") = "partial_fp32")
      .def_property("flat_combine", [](const DispatchConfig& c) { return std::string(flat_combine_name(c.flat_combine)); },
                    [](DispatchConfig& c, const std::string& s) { c.flat_combine = parse_flat_combine(s, "DispatchConfig.flat_combine"); },
                    "naive, allgather_reducescatter, all2allv, ht (epx::FlatCombine): the dtype each rank's Flat partial crosses "
                    "ranks in. \"partial_fp32\" (default: the experts write fp32 rows, finalize takes expert_out fp32 and sums "
                    "the ranks' partials in fp32, one rounding) or \"partial_bf16\" (expert_out bf16: the partials are rounded "
                    "before the sum, two roundings). ValueError otherwise.")
      .def_property("ll_combine", [](const DispatchConfig& c) { return std::string(ll_combine_name(c.ll_combine)); },
                    [](DispatchConfig& c, const std::string& s) { c.ll_combine = parse_ll_combine(s, "DispatchConfig.ll_combine"); },
                    "ll combine reduction (epx::LlCombine): \"partial_fp32\" (default: expert-side fp32 partial sums, one "
                    "rounding), \"partial_bf16\" (bf16 partials, two roundings) or \"column\" (every (token, expert) row "
                    "back, summed in column order: the no-EP reference bit for bit). ValueError otherwise.")
      .def_readwrite("hidden", &DispatchConfig::hidden, "H; multiple of 8 (bf16), of 128 for fp8 dispatch.")
      .def_readwrite("num_experts", &DispatchConfig::num_experts, "E, routed experts (global).")
      .def_readwrite("top_k", &DispatchConfig::top_k, "K, columns of topk_idx.")
      .def_readwrite("num_max_dispatch_tokens_per_rank", &DispatchConfig::num_max_dispatch_tokens_per_rank,
                     "Capacity per rank per call; all ranks agree.")
      .def_property("dispatch_dtype", [](const DispatchConfig& c) { return std::string(dtype_name(c.dispatch_dtype)); },
                    [](DispatchConfig& c, const std::string& s) { c.dispatch_dtype = parse_dtype(s); }, "\"bf16\" or \"fp8_e4m3\".")
      .def_readwrite("use_ue8m0", &DispatchConfig::use_ue8m0)
      .def_readwrite("shared_route", &DispatchConfig::shared_route)
      .def_readwrite("expert_alignment", &DispatchConfig::expert_alignment)
      .def_readwrite("expert_contiguous", &DispatchConfig::expert_contiguous,
                     "ht only (make_prepare_finalize raises InvalidArgument for another backend): prepare also lays the "
                     "received rows out expert-contiguous for a grouped GEMM (PrepareResult.contiguous: the m-grouped layout "
                     "of DeepGEMM / vLLM's DeepEP-HT path), and finalize then takes expert_out [M, H] bf16, one unweighted "
                     "row per contiguous row, weighting them itself when finalize(topk_weights=) is given.")
      .def_readwrite("use_worst_case_sizing", &DispatchConfig::use_worst_case_sizing,
                     "ht on CUDA: graph-safe worst-case sizing (DeepEP num_worst_tokens): Flat results have "
                     "R * num_max_dispatch_tokens_per_rank rows, N_recv stays on the device (num_recv_tokens_device). "
                     "naive / allgather_reducescatter / all2allv (CPU and CUDA): the padded form, every rank's block "
                     "num_max_dispatch_tokens_per_rank rows (row s * C + i from rank s, the rest padding with topk_idx -1), "
                     "no host wait on CUDA, graph-safe.")
      .def("__repr__", [](const DispatchConfig& c) {
        return "epx.DispatchConfig(hidden=" + std::to_string(c.hidden) + ", num_experts=" + std::to_string(c.num_experts) +
               ", top_k=" + std::to_string(c.top_k) + ", num_max_dispatch_tokens_per_rank=" +
               std::to_string(c.num_max_dispatch_tokens_per_rank) + ", dispatch_dtype='" + std::string(dtype_name(c.dispatch_dtype)) +
               "', ll_combine='" + ll_combine_name(c.ll_combine) + "', flat_combine='" + flat_combine_name(c.flat_combine) + "'" + (c.expert_contiguous ? ", expert_contiguous=True" : "") + ")";
      });

  m.def("backend_names", &backend_names);
  m.def("expert_range", [](int num_experts, int num_ranks, int rank) {
    ExpertRange r = expert_range(num_experts, num_ranks, rank);
    return std::make_pair(r.begin, r.end);
  }, pyb::arg("num_experts"), pyb::arg("num_ranks"), pyb::arg("rank"),
        "[begin, end) of the routed experts on `rank`: contiguous ranges whose sizes differ by at most one.");
  m.def("expert_rank", &expert_rank, pyb::arg("num_experts"), pyb::arg("num_ranks"), pyb::arg("expert"));
  m.def("num_local_experts", &num_local_experts, pyb::arg("config"), pyb::arg("num_ranks"), pyb::arg("rank"));

  pyb::class_<PyContiguous>(m, "ExpertContiguousLayout", R"doc(
ht with DispatchConfig.expert_contiguous (include/epx/dispatch.h ExpertContiguousLayout): the received rows
again, grouped by local expert, the m-grouped contiguous layout of DeepGEMM / vLLM's DeepEP-HT path. Received
row n appears once per distinct local expert l it selects; expert l owns rows
[expert_offsets[l], expert_offsets[l + 1]) (recv_count[l] rows, aligned to expert_alignment): its rows in
received-row order, then zero padding rows (row_expert -1). Views into the backend's buffers, valid until the
next prepare.)doc")
      .def_readonly("x", &PyContiguous::x, "[M, H] bf16 | fp8_e4m3 (as PrepareResult.x).")
      .def_readonly("x_scales", &PyContiguous::x_scales, "fp8: [M, H/128] fp32 (0 in padding rows); else None.")
      .def_readonly("expert_offsets", &PyContiguous::expert_offsets, "[L + 1] int32: exclusive prefix sum of recv_count; [L] = M.")
      .def_readonly("row_expert", &PyContiguous::row_expert, "[M] int32: local expert of each row, -1 = padding (DeepGEMM m_indices).")
      .def_readonly("pair_row", &PyContiguous::pair_row,
                    "[N_recv, K] int32: the row of (n, topk_idx[n, k]) in x, -1 where topk_idx is -1 (duplicates share one).")
      .def_readonly("num_rows", &PyContiguous::num_rows,
                    "M = sum of recv_count (ht on CUDA with use_worst_case_sizing: the row capacity; M is expert_offsets[L] on the device).");

  pyb::class_<PyPrepareResult>(m, "PrepareResult", R"doc(
What prepare (dispatch) delivers to the experts. layout "expert_major": x [L, cap, H] with recv_count [L]
valid rows per local expert (DeepEP LL layout); "flat": x [N_recv, H] with per-row topk_idx [N_recv, K]
(local expert or -1) and topk_weights [N_recv, K]. x is bf16 or fp8_e4m3 (then x_scales [.., H/128] fp32).
The tensors are views into the backend's buffers, valid until the next prepare().)doc")
      .def_readonly("layout", &PyPrepareResult::layout)
      .def_readonly("x", &PyPrepareResult::x)
      .def_readonly("x_scales", &PyPrepareResult::x_scales)
      .def_readonly("recv_count", &PyPrepareResult::recv_count)
      .def_readonly("topk_idx", &PyPrepareResult::topk_idx, "Flat: [N_recv, K] int32 local expert index or -1; else None.")
      .def_readonly("topk_weights", &PyPrepareResult::topk_weights,
                    "Flat: [N_recv, K] fp32, the source's topk_weights of each received row (the combine weights "
                    "finalize(topk_weights=) takes with expert_contiguous); else None.")
      .def_readonly("contiguous", &PyPrepareResult::contiguous,
                    "ht with DispatchConfig.expert_contiguous: an ExpertContiguousLayout; else None.")
      .def_readonly("num_recv_tokens", &PyPrepareResult::num_recv_tokens)
      .def_readonly("num_recv_tokens_device", &PyPrepareResult::num_recv_tokens_device,
                    "ht on CUDA: [1] int32 N_recv on the device (valid once the stream reaches it); else None.")
      .def("__repr__", [](const PyPrepareResult& r) {
        return "epx.PrepareResult(layout=" + r.layout + ", x=" + r.raw.x.describe() + ", num_recv_tokens=" +
               std::to_string(r.num_recv_tokens) + ")";
      });

  pyb::class_<PyPrepareFinalize, std::shared_ptr<PyPrepareFinalize>>(m, "PrepareFinalize", R"doc(
One dispatch backend on one rank (vLLM: FusedMoEPrepareAndFinalize). prepare = dispatch, finalize = combine;
both are collective (every rank calls them, also with 0 tokens). Create with make_prepare_finalize.)doc")
      .def_property_readonly("capabilities", [](const PyPrepareFinalize& p) { return capabilities_dict(p.pf->capabilities()); })
      .def_property_readonly("config", [](const PyPrepareFinalize& p) { return p.pf->config(); })
      .def_property_readonly("group", [](const PyPrepareFinalize& p) { return p.group; })
      .def_property_readonly("stats", [](const PyPrepareFinalize& p) { return stats_dict(p.pf->stats()); },
                             "Byte accounting of the last prepare/finalize on this rank.")
      .def("why_unsupported", [](PyPrepareFinalize& p, pyb::handle x, pyb::handle topk_idx, pyb::handle topk_weights) {
        CallArgs a("epx.PrepareFinalize.why_unsupported", 0);
        DispatchArgs d{a.get(x, "x", DType::bf16), a.get(topk_idx, "topk_idx"), a.get(topk_weights, "topk_weights"), {}};
        a.rethrow_local();
        return p.pf->why_unsupported(d);
      }, pyb::arg("x"), pyb::arg("topk_idx"), pyb::arg("topk_weights"), "None when prepare can run these arguments, else one sentence why not.")
      .def("prepare", [](pyb::object self, pyb::handle x, pyb::handle topk_idx, pyb::handle topk_weights, int64_t stream,
                         pyb::handle num_tokens, pyb::handle reject) {
        PyPrepareFinalize& p = self.cast<PyPrepareFinalize&>();
        CallArgs a("epx.PrepareFinalize.prepare", stream);
        DispatchArgs d{a.get(x, "x", DType::bf16), a.get(topk_idx, "topk_idx"), a.get(topk_weights, "topk_weights"), to_stream(stream),
                       a.get(num_tokens, "num_tokens", std::nullopt, true)};
        if (a.reject(reject)) d.x = CallArgs::placeholder();
        PyPrepareResult r;
        r.raw = call_released(a, [&] { return p.pf->prepare(d); });
        r.layout = std::string(layout_name(r.raw.layout));
        r.x = wrap_view(r.raw.x, self, stream);
        r.x_scales = opt_view(r.raw.x_scales, self, stream);
        r.recv_count = opt_view(r.raw.recv_count, self, stream);
        r.topk_idx = opt_view(r.raw.topk_idx, self, stream);
        r.topk_weights = opt_view(r.raw.topk_weights, self, stream);
        r.num_recv_tokens_device = opt_view(r.raw.num_recv_tokens_device, self, stream);
        r.num_recv_tokens = r.raw.num_recv_tokens;
        const ExpertContiguousLayout& cl = r.raw.contiguous;
        if (cl.row_expert.defined()) {
          PyContiguous c;
          c.x = opt_view(cl.x, self, stream);
          c.x_scales = opt_view(cl.x_scales, self, stream);
          c.expert_offsets = opt_view(cl.expert_offsets, self, stream);
          c.row_expert = opt_view(cl.row_expert, self, stream);
          c.pair_row = opt_view(cl.pair_row, self, stream);
          c.num_rows = cl.num_rows;
          r.contiguous = pyb::cast(std::move(c));
        }
        return r;
      }, pyb::arg("x"), pyb::arg("topk_idx"), pyb::arg("topk_weights"), pyb::arg("stream") = 0, pyb::arg("num_tokens") = pyb::none(),
         pyb::arg("reject") = pyb::none(), R"doc(
Dispatch (collective). x [T, H] bf16, T <= num_max_dispatch_tokens_per_rank; topk_idx [T, K] int32/int64
(-1 = no selection); topk_weights [T, K] fp32; all on the group's device, contiguous. stream: cudaStream_t
as int (0 = legacy default). num_tokens: optional [1] int32 on the GPU, the rows of x that take part
(ll on CUDA: one captured graph for every T; other backends raise InvalidArgument when it is set).
reject: None, or an exception instance the caller raises for this call after the collective status
exchange, so every other rank raises too, with the same sentence (the deepep shim's own checks).
Raises InvalidArgument (on every rank), Unsupported, Timeout, CommError.)doc")
      .def("finalize", [](PyPrepareFinalize& p, pyb::handle expert_out, pyb::handle out, int64_t stream, pyb::handle topk_weights,
                          pyb::handle reject) {
        CallArgs a("epx.PrepareFinalize.finalize", stream);
        FinalizeArgs f{a.get(expert_out, "expert_out", DType::bf16), a.get_out(out, "out", DType::bf16), to_stream(stream),
                       a.get(topk_weights, "topk_weights", std::nullopt, true)};
        if (a.reject(reject)) f.expert_out = CallArgs::placeholder();
        call_released(a, [&] { p.pf->finalize(f); });
      }, pyb::arg("expert_out"), pyb::arg("out"), pyb::arg("stream") = 0, pyb::arg("topk_weights") = pyb::none(),
         pyb::arg("reject") = pyb::none(), R"doc(
Combine for the last prepare (collective). expert_out: as the experts wrote it (ExpertMajor [L, cap, H] bf16 /
Flat [N_recv, H] fp32, or bf16 with DispatchConfig.flat_combine = "partial_bf16"; ht with expert_contiguous: [M, H] bf16, row i = expert row_expert[i] on
contiguous.x[i], unweighted); out [T, H] bf16 is written: out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]),
fp32 accumulation, one rounding. topk_weights: ht with expert_contiguous only, [N_recv, K] fp32 on the
group's device (usually PrepareResult.topk_weights): received row n's partial is
sum_k topk_weights[n, k] * expert_out[pair_row[n, k]]; None: the same sum with weight 1 (the weights were
applied before the experts). Raises InvalidArgument (on every rank) for a bad shape, dtype or device, or
topk_weights given to another backend / without expert_contiguous; Timeout; CommError. reject: as in prepare.)doc");

  m.def("make_prepare_finalize", [](const std::string& name, std::shared_ptr<Group> group, const DispatchConfig& cfg,
                                    std::optional<Config> settings) {
    auto p = std::make_shared<PyPrepareFinalize>();
    p->group = group;
    {
      pyb::gil_scoped_release release;
      p->pf = settings ? make_prepare_finalize(name, group, cfg, *settings) : make_prepare_finalize(name, group, cfg);
    }
    return p;
  }, pyb::arg("name"), pyb::arg("group"), pyb::arg("config"), pyb::arg("settings") = pyb::none(), R"doc(
Creates backend `name` (backend_names(): naive, allgather_reducescatter, all2allv, ll, ht) on `group`.
Collective: all ranks must agree on the DispatchConfig (CommError naming the field otherwise).
settings: an epx.Config whose launch settings the CUDA kernels take (ll: ll_warps_per_block, ll_num_blocks,
ll_combine_wait; ht: ht_num_sms, ht_warps_per_block, ht_chunk_rows, ht_pdl); None: the backend
reads Config.load() (EPX_CONFIG, EPX_* variables). Across nodes the hierarchical ll / ht hand it to their node
backend; the CPU backends ignore it.)doc");
}

void bind_experts(pyb::module_& m) {
  pyb::class_<ExpertActivation>(m, "ExpertActivation", R"doc(
An expert MLP's activation h = act(g, u) on the gate / up halves of x W13^T + b13 (include/epx/experts.h):
  "silu_glu"    : silu(g) * u; with a finite limit, g = min(g, limit) and u = clamp(u, -limit, limit) first
                  (DeepSeek-V4's swiglu_limit); limit inf (default) = plain SwiGLU (DeepSeek, Qwen, Mixtral).
  "gpt_oss_glu" : g = min(g, limit), u = clamp(u, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g)
                  (modeling_gpt_oss.py GptOssExperts: alpha 1.702, limit = swiglu_limit, 7.0).
The CPU experts compute every activation; the CUDA experts only plain silu_glu (others raise Unsupported).
Raises InvalidArgument for an unknown kind, limit <= 0, a non-finite alpha, or gpt_oss_glu without a finite limit.)doc")
      .def(pyb::init([](const std::string& kind, float alpha, float limit) {
             ExpertActivation a{parse_activation_kind(kind, "epx.ExpertActivation"), alpha, limit};
             check_activation("epx.ExpertActivation", a);
             return a;
           }),
           pyb::arg("kind") = "silu_glu", pyb::kw_only(), pyb::arg("alpha") = 1.702f,
           pyb::arg("limit") = std::numeric_limits<float>::infinity())
      .def_static("silu", &ExpertActivation::silu, "Plain silu_glu (no clamp).")
      .def_static("gpt_oss", [](float alpha, float limit) {
        const ExpertActivation a = ExpertActivation::gpt_oss(alpha, limit);
        check_activation("epx.ExpertActivation.gpt_oss", a);
        return a;
      }, pyb::arg("alpha") = 1.702f, pyb::arg("limit") = 7.0f, "gpt_oss_glu with GptOssExperts' alpha and limit (swiglu_limit).")
      .def_property_readonly("kind", [](const ExpertActivation& a) { return activation_kind_name(a.kind); },
                             "\"silu_glu\" or \"gpt_oss_glu\".")
      .def_readonly("alpha", &ExpertActivation::alpha, "gpt_oss_glu's sigmoid scale (unused by silu_glu).")
      .def_readonly("limit", &ExpertActivation::limit, "The clamp bound (inf = none).")
      .def_property_readonly("is_plain_silu", &ExpertActivation::is_plain_silu,
                             "silu_glu without a clamp: what every CUDA expert path computes.")
      .def(pyb::self == pyb::self)
      .def("__hash__", [](const ExpertActivation& a) {
        return pyb::hash(pyb::make_tuple(activation_kind_name(a.kind), a.alpha, a.limit));
      })
      .def("__repr__", [](const ExpertActivation& a) { return "epx.ExpertActivation(" + expert_activation_name(a) + ")"; });

  pyb::class_<ExpertWeights, std::shared_ptr<ExpertWeights>>(m, "ExpertWeights", R"doc(
One expert's gated-MLP weights, CPU-resident, HF layout: w13 [2I, H] = gate_proj rows then up_proj rows,
w2 [H, I] = down_proj. Formats: bf16; fp8_block (fp8_e4m3 + fp32 scale_inv per 128x128 block);
mxfp4 (fp4 pairs [.., K/2] + e8m0 scale per 32 inputs). Optional, in every format: biases b13 [2I] fp32
(gate entries then up entries, as w13's rows) and b2 [H] fp32, and the activation (ExpertActivation;
default plain silu_glu): y = act(x W13^T + b13) W2^T + b2. gpt-oss's interleaved gate_up_proj [H, 2I]
(gate = columns ::2, up = columns 1::2) and its bias de-interleave into this layout (load_moe_layer does
it). The CPU experts compute biases and every activation; the CUDA experts refuse them (Unsupported).)doc")
      .def_static("from_float", [](const std::string& format, pyb::handle gate_up, pyb::handle down, pyb::handle b13, pyb::handle b2,
                                   std::optional<ExpertActivation> activation) {
        CallArgs a("epx.ExpertWeights.from_float", 0);
        TensorView gu = a.get(gate_up, "gate_up"), dn = a.get(down, "down");
        a.rethrow_local();
        auto w = std::const_pointer_cast<ExpertWeights>(ExpertWeights::from_float(parse_weight_format(format), gu, dn));
        return with_extras(std::move(w), b13, b2, activation, "epx.ExpertWeights.from_float");
      }, pyb::arg("format"), pyb::arg("gate_up"), pyb::arg("down"), pyb::kw_only(), pyb::arg("b13") = pyb::none(),
                  pyb::arg("b2") = pyb::none(), pyb::arg("activation") = pyb::none(),
                  "Quantizes fp32 gate_up [2I, H] and down [H, I] (CPU) into `format` (bf16, fp8_block, mxfp4); b13 [2I] / b2 "
                  "[H] fp32 biases and the activation (None: plain silu_glu) are kept as given.")
      .def_static("random", [](const std::string& format, int64_t hidden, int64_t intermediate, uint64_t seed, pyb::handle b13,
                               pyb::handle b2, std::optional<ExpertActivation> activation) {
        auto w = std::const_pointer_cast<ExpertWeights>(ExpertWeights::random(parse_weight_format(format), hidden, intermediate, seed));
        return with_extras(std::move(w), b13, b2, activation, "epx.ExpertWeights.random");
      }, pyb::arg("format"), pyb::arg("hidden"), pyb::arg("intermediate"), pyb::arg("seed"), pyb::kw_only(),
                  pyb::arg("b13") = pyb::none(), pyb::arg("b2") = pyb::none(), pyb::arg("activation") = pyb::none())
      .def_property("activation", [](const ExpertWeights& w) { return w.activation; },
                    [](ExpertWeights& w, const ExpertActivation& a) {
                      check_activation("epx.ExpertWeights.activation", a);
                      w.activation = a;
                    },
                    "ExpertActivation (typed). Set it, and b13 / b2, before building Experts or a layer over this expert.")
      .def_property("b13", [](const ExpertWeights& w) { return opt_owned(w.b13); },
                    [](ExpertWeights& w, pyb::handle v) { set_expert_bias(w, &ExpertWeights::b13, v, "b13"); },
                    "[2I] fp32 gate_up bias (gate entries, then up entries), or None. Setting copies; None removes it.")
      .def_property("b2", [](const ExpertWeights& w) { return opt_owned(w.b2); },
                    [](ExpertWeights& w, pyb::handle v) { set_expert_bias(w, &ExpertWeights::b2, v, "b2"); },
                    "[H] fp32 down bias, or None. Setting copies; None removes it.")
      .def_property_readonly("format", [](const ExpertWeights& w) { return std::string(weight_format_name(w.format)); })
      .def_readonly("hidden", &ExpertWeights::hidden)
      .def_readonly("intermediate", &ExpertWeights::intermediate)
      .def_property_readonly("w13", [](const ExpertWeights& w) { return opt_owned(w.w13); })
      .def_property_readonly("w13_scale", [](const ExpertWeights& w) { return opt_owned(w.w13_scale); })
      .def_property_readonly("w2", [](const ExpertWeights& w) { return opt_owned(w.w2); })
      .def_property_readonly("w2_scale", [](const ExpertWeights& w) { return opt_owned(w.w2_scale); })
      .def("w13_float", [](const ExpertWeights& w) {
        Tensor t = Tensor::empty({2 * w.intermediate, w.hidden}, DType::fp32);
        std::memcpy(t.data(), w.w13_f32(), static_cast<size_t>(t.nbytes()));
        return wrap_owned(t);
      }, "Dequantized fp32 copy [2I, H].")
      .def("w2_float", [](const ExpertWeights& w) {
        Tensor t = Tensor::empty({w.hidden, w.intermediate}, DType::fp32);
        std::memcpy(t.data(), w.w2_f32(), static_cast<size_t>(t.nbytes()));
        return wrap_owned(t);
      }, "Dequantized fp32 copy [H, I].");

  pyb::class_<Experts, std::shared_ptr<Experts>>(m, "Experts", R"doc(
Grouped SwiGLU experts over this rank's local experts (vLLM: FusedMoEPermuteExpertsUnpermute).
apply(prepared, out): ExpertMajor out [L, cap, H] (unweighted, rows < recv_count); Flat out [N, H]
(weighted sum over the row's local selections): bf16, or fp32 (the sum unrounded: the partial a Flat
combine with flat_combine = "partial_fp32" takes). apply_contiguous(x, expert_offsets, out, x_scales):
rows already sorted by expert (ActivationLayout::Contiguous).)doc")
      .def_property_readonly("num_local_experts", &Experts::num_local_experts)
      .def_property_readonly("hidden", &Experts::hidden)
      .def("supports", [](const Experts& e, const std::string& layout) {
        for (ActivationLayout l : {ActivationLayout::ExpertMajor, ActivationLayout::Flat, ActivationLayout::Contiguous})
          if (layout == layout_name(l)) return e.supports(l);
        throw InvalidArgument(arg_message("epx.Experts.supports", "layout", layout,
                                          "must be \"expert_major\", \"flat\" or \"contiguous\""));
      }, pyb::arg("layout"), "Whether apply() takes this layout: \"expert_major\", \"flat\" or \"contiguous\".")
      .def("apply", [](Experts& e, const PyPrepareResult& in, pyb::handle out, int64_t stream) {
        CallArgs a("epx.Experts.apply", stream);
        TensorView o = a.get_out(out, "out", DType::bf16);
        a.rethrow_local();
        const ExpertsInput ei = in.raw.experts_input();
        call_released(a, [&] { e.apply(ei, o, to_stream(stream)); });
      }, pyb::arg("prepared"), pyb::arg("out"), pyb::arg("stream") = 0)
      .def("apply_contiguous", [](Experts& e, pyb::handle x, pyb::handle expert_offsets, pyb::handle out, pyb::handle x_scales,
                                  int64_t stream) {
        CallArgs a("epx.Experts.apply_contiguous", stream);
        ExpertsInput in;
        in.layout = ActivationLayout::Contiguous;
        // numpy: uint16 bf16 bits / uint8 e4m3 bits, told apart by the width (itemsize), so uint16 x with x_scales reads as
        // bf16 (and is refused below, naming x_scales) instead of as an unknown uint16 dtype.
        std::optional<DType> x_bits = x_scales.is_none() ? DType::bf16 : DType::fp8_e4m3;
        if (pyb::hasattr(x, "itemsize") && pyb::isinstance<pyb::int_>(x.attr("itemsize")))
          x_bits = x.attr("itemsize").cast<int64_t>() == 1 ? DType::fp8_e4m3 : DType::bf16;
        in.x = a.get(x, "x", x_bits);
        in.x_scales = a.get(x_scales, "x_scales", std::nullopt, true);
        in.expert_offsets = a.get(expert_offsets, "expert_offsets");
        TensorView o = a.get_out(out, "out", DType::bf16);
        a.rethrow_local();
        // Every device (the CUDA experts would ignore them): scales belong to fp8_e4m3 x.
        require_arg("epx.Experts.apply_contiguous", "x_scales", "given", in.x.dtype != DType::bf16 || !in.x_scales.defined(),
                    "must be None for x.dtype = bf16 (scales belong to fp8_e4m3 x)");
        call_released(a, [&] { e.apply(in, o, to_stream(stream)); });
      }, pyb::arg("x"), pyb::arg("expert_offsets"), pyb::arg("out"), pyb::arg("x_scales") = pyb::none(), pyb::arg("stream") = 0,
           "ActivationLayout::Contiguous: x [N, H] bf16 (or fp8_e4m3 with x_scales [N, H/128] fp32), rows sorted by local "
           "expert; expert_offsets int32 [L] (cumulative ends, torch._grouped_mm's offs) or [L + 1] (starts then the end, "
           "Prepared.contiguous.expert_offsets); out [N, H] bf16, unweighted; rows outside every expert's range untouched.");
  m.def("make_experts", [](std::vector<std::shared_ptr<ExpertWeights>> local, const std::string& device) {
    std::vector<std::shared_ptr<const ExpertWeights>> w(local.begin(), local.end());
    const Device dev = device_from_string(device);
    pyb::gil_scoped_release release;
    return std::shared_ptr<Experts>(dev.is_cpu() ? make_experts_cpu(std::move(w)) : make_experts_cuda(std::move(w), dev.index));
  }, pyb::arg("local_experts"), pyb::arg("device") = "cpu",
        "Experts over `local_experts` (index = local expert id) on \"cpu\" (OpenBLAS) or \"cuda:N\" (uploads once).");
}

void bind_moe_layer(pyb::module_& m) {
  pyb::class_<RouterConfig>(m, "RouterConfig")
      .def(pyb::init<>())
      .def_readwrite("num_experts", &RouterConfig::num_experts)
      .def_readwrite("top_k", &RouterConfig::top_k)
      .def_property("scoring", [](const RouterConfig& r) { return scoring_name(r.scoring); },
                    [](RouterConfig& r, const std::string& s) { r.scoring = parse_scoring(s); }, "\"softmax\" or \"sigmoid\".")
      .def_readwrite("renormalize", &RouterConfig::renormalize)
      .def_readwrite("n_group", &RouterConfig::n_group)
      .def_readwrite("topk_group", &RouterConfig::topk_group)
      .def_readwrite("routed_scaling_factor", &RouterConfig::routed_scaling_factor)
      .def_readwrite("use_correction_bias", &RouterConfig::use_correction_bias);

  pyb::class_<MoEConfig>(m, "MoEConfig", "One MoE layer's shape and router (from a model's config.json; see preset()).")
      .def(pyb::init<>())
      .def_readwrite("name", &MoEConfig::name)
      .def_readwrite("hidden", &MoEConfig::hidden)
      .def_readwrite("intermediate", &MoEConfig::intermediate)
      .def_readwrite("router", &MoEConfig::router)
      .def_readwrite("num_shared_experts", &MoEConfig::num_shared_experts)
      .def_readwrite("shared_intermediate", &MoEConfig::shared_intermediate)
      .def_readwrite("shared_gate", &MoEConfig::shared_gate)
      .def_property("routed_format", [](const MoEConfig& c) { return std::string(weight_format_name(c.routed_format)); },
                    [](MoEConfig& c, const std::string& s) { c.routed_format = parse_weight_format(s); })
      .def_property("shared_format", [](const MoEConfig& c) { return std::string(weight_format_name(c.shared_format)); },
                    [](MoEConfig& c, const std::string& s) { c.shared_format = parse_weight_format(s); })
      .def("__repr__", [](const MoEConfig& c) {
        return "epx.MoEConfig(name='" + c.name + "', hidden=" + std::to_string(c.hidden) + ", intermediate=" +
               std::to_string(c.intermediate) + ", num_experts=" + std::to_string(c.router.num_experts) + ", top_k=" +
               std::to_string(c.router.top_k) + ", num_shared_experts=" + std::to_string(c.num_shared_experts) + ")";
      });
  m.def("preset_names", &preset_names);
  m.def("preset", &preset, pyb::arg("name"), "deepseek-v3, deepseek-v4-pro, qwen3-30b-a3b, mixtral-8x7b, qwen1.5-moe-a2.7b (+ -mini).");

  pyb::class_<MoEWeights, std::shared_ptr<MoEWeights>>(m, "MoEWeights", "All weights of one MoE layer (global), CPU-resident.")
      .def_static("random", [](pyb::handle cfg, uint64_t seed, int expert_begin, int expert_end) {
        const MoEConfig c = pyb::isinstance<pyb::str>(cfg) ? preset(cfg.cast<std::string>()) : cfg.cast<MoEConfig>();
        pyb::gil_scoped_release release;
        return MoEWeights::random(c, seed, expert_begin, expert_end);
      }, pyb::arg("config"), pyb::arg("seed"), pyb::arg("expert_begin") = 0, pyb::arg("expert_end") = -1,
                  "Deterministic random weights; expert e depends only on (seed, e), so a rank may build only its range "
                  "[expert_begin, expert_end). `config`: a MoEConfig or a preset name.")
      .def_static("from_parts", [](const MoEConfig& cfg, pyb::handle router_weight, std::vector<std::shared_ptr<ExpertWeights>> experts,
                                   std::shared_ptr<ExpertWeights> shared, pyb::handle correction_bias, pyb::handle shared_gate_weight,
                                   pyb::handle router_bias) {
        CallArgs a("epx.MoEWeights.from_parts", 0);
        TensorView rw = a.get(router_weight, "router_weight");
        TensorView cb = a.get(correction_bias, "correction_bias", std::nullopt, true);
        TensorView sg = a.get(shared_gate_weight, "shared_gate_weight", std::nullopt, true);
        a.rethrow_local();
        const std::string op = "epx.MoEWeights.from_parts";
        check_dtype(op, "router_weight", rw, {DType::fp32});
        check_shape(op, "router_weight", rw, {cfg.router.num_experts, cfg.hidden});
        require_arg(op, "len(experts)", experts.size(), static_cast<int>(experts.size()) == cfg.router.num_experts,
                    "must equal num_experts = " + std::to_string(cfg.router.num_experts) + " (None for experts another rank holds)");
        auto w = std::make_shared<MoEWeights>();
        w->config = cfg;
        w->router_weight = owned_cpu_copy(rw);
        w->correction_bias = owned_cpu_copy(cb);
        w->shared_gate_weight = owned_cpu_copy(sg);
        w->router_bias = router_bias_arg(router_bias, cfg.router.num_experts, op);
        w->experts.assign(experts.begin(), experts.end());
        w->shared = shared;
        return w;
      }, pyb::arg("config"), pyb::arg("router_weight"), pyb::arg("experts"), pyb::arg("shared") = nullptr,
                  pyb::arg("correction_bias") = pyb::none(), pyb::arg("shared_gate_weight") = pyb::none(), pyb::kw_only(),
                  pyb::arg("router_bias") = pyb::none(),
                  "A layer from your own weights: router_weight [E, H] fp32; experts: E ExpertWeights (or None for experts "
                  "not held here), each with its own biases and activation; router_bias [E] fp32 (gpt-oss mlp.router.bias: "
                  "logits = x W^T + b before the top-k; CPU only, a CUDA ModularMoE raises Unsupported); copies the router "
                  "tensors.")
      .def("add_random_experts", &MoEWeights::add_random_experts, pyb::arg("seed"), pyb::arg("expert_ids"))
      .def_readonly("config", &MoEWeights::config)
      .def_property_readonly("router_weight", [](const MoEWeights& w) { return opt_owned(w.router_weight); })
      .def_property_readonly("correction_bias", [](const MoEWeights& w) { return opt_owned(w.correction_bias); })
      .def_property("router_bias", [](const MoEWeights& w) { return opt_owned(w.router_bias); },
                    [](MoEWeights& w, pyb::handle v) {
                      w.router_bias = router_bias_arg(v, w.config.router.num_experts, "epx.MoEWeights.router_bias");
                    },
                    "[E] fp32 router logit bias (gpt-oss), or None. Setting copies; None removes it.")
      .def_property_readonly("shared_gate_weight", [](const MoEWeights& w) { return opt_owned(w.shared_gate_weight); })
      .def_property_readonly("experts", [](const MoEWeights& w) {
        std::vector<std::shared_ptr<ExpertWeights>> v;
        for (const auto& e : w.experts) v.push_back(std::const_pointer_cast<ExpertWeights>(e));
        return v;
      })
      .def_property_readonly("shared", [](const MoEWeights& w) { return std::const_pointer_cast<ExpertWeights>(w.shared); });

  pyb::class_<ModularMoE>(m, "ModularMoE", R"doc(
The EP MoE layer on one rank: router -> prepare (dispatch) -> experts -> finalize (combine), plus the shared
expert (separate, fused as route id E, or auto by M <= fhmoe_max_tokens). Collective construction.)doc")
      .def(pyb::init([](std::shared_ptr<MoEWeights> weights, std::shared_ptr<Group> group, const std::string& backend,
                        int num_max_dispatch_tokens_per_rank, const std::string& dispatch_dtype, bool use_ue8m0, int expert_alignment,
                        std::optional<Config> config, const std::string& shared_mode, int chunk_size, int fhmoe_max_tokens,
                        const std::string& ll_combine, bool expert_contiguous, const std::string& flat_combine) {
             DispatchConfig d;
             d.expert_contiguous = expert_contiguous;
             d.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank;
             d.dispatch_dtype = parse_dtype(dispatch_dtype);
             d.use_ue8m0 = use_ue8m0;
             d.expert_alignment = expert_alignment;
             d.ll_combine = parse_ll_combine(ll_combine, "ModularMoE.ll_combine");
             d.flat_combine = parse_flat_combine(flat_combine, "ModularMoE.flat_combine");
             ModularMoEOptions o;
             o.shared_mode = parse_shared_mode(shared_mode);
             o.chunk_size = chunk_size;
             o.fhmoe_max_tokens = fhmoe_max_tokens;
             const Config c = config ? *config : Config::load();
             pyb::gil_scoped_release release;
             return std::make_unique<ModularMoE>(weights, group, backend, d, c, o);
           }),
           pyb::arg("weights"), pyb::arg("group"), pyb::arg("backend"), pyb::kw_only(), pyb::arg("num_max_dispatch_tokens_per_rank") = 0,
           pyb::arg("dispatch_dtype") = "bf16", pyb::arg("use_ue8m0") = false, pyb::arg("expert_alignment") = 1,
           pyb::arg("config") = pyb::none(), pyb::arg("shared_mode") = "auto", pyb::arg("chunk_size") = 0, pyb::arg("fhmoe_max_tokens") = -1,
           pyb::arg("ll_combine") = "partial_fp32", pyb::arg("expert_contiguous") = false, pyb::arg("flat_combine") = "partial_fp32",
           pyb::keep_alive<1, 2>(),
           pyb::keep_alive<1, 3>())
      .def("forward", [](ModularMoE& l, pyb::handle x, pyb::handle out, int64_t stream) {
        CallArgs a("epx.ModularMoE.forward", stream);
        TensorView xv = a.get(x, "x", DType::bf16), ov = a.get_out(out, "out", DType::bf16);
        call_released(a, [&] { l.forward(xv, ov, to_stream(stream)); });
      }, pyb::arg("x"), pyb::arg("out"), pyb::arg("stream") = 0, "x [T, H] bf16 -> out [T, H] bf16 (written). Collective.")
      .def("forward_routed", [](ModularMoE& l, pyb::handle x, pyb::handle topk_idx, pyb::handle topk_weights, pyb::handle out, int64_t stream) {
        CallArgs a("epx.ModularMoE.forward_routed", stream);
        TensorView xv = a.get(x, "x", DType::bf16), iv = a.get(topk_idx, "topk_idx"), wv = a.get(topk_weights, "topk_weights"),
                   ov = a.get_out(out, "out", DType::bf16);
        call_released(a, [&] { l.forward_routed(xv, iv, wv, ov, to_stream(stream)); });
      }, pyb::arg("x"), pyb::arg("topk_idx"), pyb::arg("topk_weights"), pyb::arg("out"), pyb::arg("stream") = 0,
           "Same with given routing: topk_idx [T, K] int32/int64, topk_weights [T, K] fp32. Collective.")
      .def_property_readonly("counters", [](const ModularMoE& l) {
        const PathCounters& c = l.counters();
        pyb::dict d;
        d["backend"] = c.backend;
        d["calls"] = c.calls;
        d["chunks"] = c.chunks;
        d["idle_chunks"] = c.idle_chunks;
        d["shared_fused"] = c.shared_fused;
        d["shared_separate"] = c.shared_separate;
        return d;
      });

  m.def("moe_reference", [](const MoEWeights& w, pyb::handle x, pyb::handle topk_idx, pyb::handle topk_weights, pyb::handle out,
                            const std::string& dispatch_dtype, bool use_ue8m0, bool shared_fused) {
    CallArgs a("epx.moe_reference", 0);
    TensorView xv = a.get(x, "x", DType::bf16), iv = a.get(topk_idx, "topk_idx"), wv = a.get(topk_weights, "topk_weights"),
               ov = a.get_out(out, "out", DType::bf16);
    a.rethrow_local();
    ReferenceOptions o{parse_dtype(dispatch_dtype), use_ue8m0, shared_fused};
    call_released(a, [&] { moe_reference_cpu(w, xv, iv, wv, ov, o); });
  }, pyb::arg("weights"), pyb::arg("x"), pyb::arg("topk_idx"), pyb::arg("topk_weights"), pyb::arg("out"), pyb::kw_only(),
        pyb::arg("dispatch_dtype") = "bf16", pyb::arg("use_ue8m0") = false, pyb::arg("shared_fused") = false,
        "Single-rank no-EP reference of the whole layer on CPU (include/epx/moe.h moe_reference_cpu).");
  m.def("router_logits", [](const MoEWeights& w, pyb::handle x, pyb::handle logits) {
    CallArgs a("epx.router_logits", 0);
    TensorView xv = a.get(x, "x", DType::bf16), lv = a.get_out(logits, "logits");
    a.rethrow_local();
    call_released(a, [&] { router_logits_cpu(w, xv, lv); });
  }, pyb::arg("weights"), pyb::arg("x"), pyb::arg("logits"), "logits [T, E] fp32 = x [T, H] bf16 . router_weight^T (CPU).");
  m.def("route", [](const RouterConfig& cfg, pyb::handle logits, pyb::handle correction_bias, pyb::handle topk_idx,
                    pyb::handle topk_weights, int64_t stream) {
    CallArgs a("epx.route", stream);
    TensorView lv = a.get(logits, "logits"), cb = a.get(correction_bias, "correction_bias", std::nullopt, true),
               iv = a.get_out(topk_idx, "topk_idx"), wv = a.get_out(topk_weights, "topk_weights");
    a.rethrow_local();
    call_released(a, [&] { route(cfg, lv, cb, iv, wv, to_stream(stream)); });
  }, pyb::arg("config"), pyb::arg("logits"), pyb::arg("correction_bias"), pyb::arg("topk_idx"), pyb::arg("topk_weights"),
        pyb::arg("stream") = 0, "Routes T tokens (include/epx/routing.h): logits [T, E] -> topk_idx, topk_weights [T, K] (written).");
  m.def("quantize_fp8_per_token_group", [](pyb::handle x, pyb::handle q, pyb::handle scales, int group_size, bool ue8m0, int64_t stream) {
    CallArgs a("epx.quantize_fp8_per_token_group", stream);
    TensorView xv = a.get(x, "x", DType::bf16), qv = a.get_out(q, "q", DType::fp8_e4m3), sv = a.get_out(scales, "scales");
    a.rethrow_local();
    call_released(a, [&] { quantize_fp8_per_token_group(xv, qv, sv, group_size, ue8m0, to_stream(stream)); });
  }, pyb::arg("x"), pyb::arg("q"), pyb::arg("scales"), pyb::arg("group_size") = kFp8GroupSize, pyb::arg("ue8m0") = false,
        pyb::arg("stream") = 0, "x [T, H] bf16/fp32 -> q [T, H] fp8_e4m3, scales [T, H/group] fp32 (DeepSeek-V3 1x128 recipe).");
}

void bind_checkpoint(pyb::module_& m) {
  m.def("load_moe_layer", [](const std::string& dir, int layer, int expert_begin, int expert_end, std::vector<int> expert_ids,
                             bool load_router, bool load_shared) {
    MoELayerLoadOptions o;
    o.layer = layer;
    o.expert_begin = expert_begin;
    o.expert_end = expert_end;
    o.expert_ids = std::move(expert_ids);
    o.load_router = load_router;
    o.load_shared = load_shared;
    MoELayerCheckpoint c;
    {
      pyb::gil_scoped_release release;
      c = load_moe_layer(dir, o);
    }
    pyb::dict info;
    info["model_type"] = c.info.model_type;
    info["convention"] = std::string(checkpoint_convention_name(c.info.convention));
    info["layer"] = c.info.layer;
    info["num_hidden_layers"] = c.info.num_hidden_layers;
    info["prefix"] = c.info.prefix;
    info["activation"] = c.info.activation;
    info["fused_experts"] = c.info.fused_experts;
    return pyb::make_tuple(c.weights, c.notes, info);
  }, pyb::arg("dir"), pyb::arg("layer") = 0, pyb::kw_only(), pyb::arg("expert_begin") = 0, pyb::arg("expert_end") = -1,
        pyb::arg("expert_ids") = std::vector<int>{}, pyb::arg("load_router") = true, pyb::arg("load_shared") = true, R"doc(
One MoE layer of a Hugging Face safetensors checkpoint directory (include/epx/checkpoint.h): returns
(MoEWeights, notes, info). Loads the router and the routed experts [expert_begin, expert_end) (or exactly
expert_ids), e.g. epx.expert_range(E, R, rank) for a rank's own; others stay None. Conventions: DeepSeek-V3/V4,
Qwen3/Qwen2-MoE, Mixtral, gpt-oss. Raises InvalidArgument / Unsupported naming the key or tensor.)doc");
  m.def("write_moe_checkpoint", [](const std::string& dir, const MoEWeights& w, const std::string& convention, int layer,
                                   int num_shards, const std::string& router_dtype, const std::string& model_type) {
    CheckpointWriteOptions o;
    o.convention = parse_checkpoint_convention(convention);
    o.layer = layer;
    o.num_shards = num_shards;
    o.router_dtype = router_dtype;
    o.model_type = model_type;
    pyb::gil_scoped_release release;
    write_moe_checkpoint(dir, w, o);
  }, pyb::arg("dir"), pyb::arg("weights"), pyb::kw_only(), pyb::arg("convention") = "deepseek", pyb::arg("layer") = 0,
        pyb::arg("num_shards") = 1, pyb::arg("router_dtype") = "BF16", pyb::arg("model_type") = "",
        "Writes `weights` as one MoE layer of a checkpoint (config.json + safetensors) in `convention`.");
}

}  // namespace

void bind_moe(pyb::module_& m) {
  bind_checkpoint(m);
  bind_dispatch(m);
  bind_experts(m);
  bind_moe_layer(m);
}

}  // namespace epx::py
