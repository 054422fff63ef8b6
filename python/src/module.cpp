// python/src/module.cpp: the epx._epx extension module: errors, version, config, groups.
// Dispatch, experts and the MoE layer are bound in bind_moe.cpp, tensors in py_tensor.cpp.
//
// Errors (include/epx/error.h) become Python exceptions that also derive from the builtin a caller
// would catch: InvalidArgument -> ValueError, Unsupported -> NotImplementedError, Timeout ->
// TimeoutError; CommError and CudaError derive from epx.Error (a RuntimeError) only.
// Every call that may wait on a peer rank releases the GIL (ranks of a CPU group are threads).
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/log.h"
#include "py_tensor.h"

namespace epx::py {

void bind_moe(pyb::module_& m);

namespace {

PyObject* g_error = nullptr;
PyObject* g_invalid = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_timeout = nullptr;
PyObject* g_comm = nullptr;
PyObject* g_cuda = nullptr;

PyObject* new_exception(pyb::module_& m, const char* name, pyb::tuple bases, const char* doc) {
  const std::string full = std::string("epx.") + name;
  PyObject* e = PyErr_NewExceptionWithDoc(full.c_str(), doc, bases.ptr(), nullptr);
  if (!e) throw pyb::error_already_set();
  m.add_object(name, pyb::handle(e));
  return e;
}

void bind_errors(pyb::module_& m) {
  pyb::module_ builtins = pyb::module_::import("builtins");
  g_error = new_exception(m, "Error", pyb::make_tuple(builtins.attr("RuntimeError")),
                          "Base of every error epx raises (epx::Error).");
  pyb::handle err(g_error);
  g_invalid = new_exception(m, "InvalidArgument", pyb::make_tuple(err, builtins.attr("ValueError")),
                            "An argument breaks a documented rule: shape, dtype, device, range, capacity.");
  g_unsupported = new_exception(m, "Unsupported", pyb::make_tuple(err, builtins.attr("NotImplementedError")),
                                "Valid in general, but this backend/device/build cannot run it.");
  g_timeout = new_exception(m, "Timeout", pyb::make_tuple(err, builtins.attr("TimeoutError")),
                            "A wait on a peer rank exceeded Config.timeout_s.");
  g_comm = new_exception(m, "CommError", pyb::make_tuple(err),
                         "A collective or transport failed, or ranks disagree on the configuration.");
  g_cuda = new_exception(m, "CudaError", pyb::make_tuple(err), "A CUDA or NCCL runtime call failed.");
  pyb::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(g_invalid, e.what());
    } catch (const Unsupported& e) {
      PyErr_SetString(g_unsupported, e.what());
    } catch (const Timeout& e) {
      PyErr_SetString(g_timeout, e.what());
    } catch (const CommError& e) {
      PyErr_SetString(g_comm, e.what());
    } catch (const CudaError& e) {
      PyErr_SetString(g_cuda, e.what());
    } catch (const Error& e) {
      PyErr_SetString(g_error, e.what());
    }
  });
}

/// Config.set's text of a Python value: bools as true/false, str as is, numbers by str().
std::string setting_text(pyb::handle value) {
  if (pyb::isinstance<pyb::bool_>(value)) return value.cast<bool>() ? "true" : "false";
  if (pyb::isinstance<pyb::str>(value)) return value.cast<std::string>();
  return pyb::str(value).cast<std::string>();
}

/// Config.<name> as a property of field `key`: reads the field; assigning goes through Config::set
/// (source "api") and Config::validate on a copy, so a bad value raises InvalidArgument (ValueError)
/// naming the key and its rule and leaves the Config as it was.
template <class M>
void bind_setting(pyb::class_<Config>& cls, const char* name, const char* key, M Config::*member, const char* doc) {
  cls.def_property(
      name, [member](const Config& c) { return c.*member; },
      [key](Config& c, pyb::handle value) {
        Config t = c;
        t.set(key, setting_text(value), "api");
        t.validate();
        c = std::move(t);
      },
      doc);
}

void bind_config(pyb::module_& m) {
  pyb::class_<Config> cls(m, "Config", R"doc(
epx's one configuration struct (include/epx/config.h). Precedence: default < JSON file (EPX_CONFIG or
Config.load(path)) < EPX_* environment < explicit set() / attribute assignment. Unknown keys raise
InvalidArgument (ValueError) with the nearest known key; a bad value raises InvalidArgument naming the key
and its rule (the Config keeps its old value). describe() lists "key = value  [source]  description" as
`epx info` prints. The launch settings reach a backend through make_prepare_finalize(..., settings=) or
ModularMoE(..., config=); without one the backend reads Config.load() (EPX_CONFIG, EPX_* variables).
Attributes (JSON key, environment variable):
  timeout_s (timeout_s, EPX_TIMEOUT_S): float seconds in [0.001, 1e9]: longest wait on a peer before Timeout.
  ll_combine (ll.combine): "partial_fp32" | "partial_bf16" | "column": ll's combine for `epx bench`
      (the API takes DispatchConfig.ll_combine).
  ll_combine_wait (ll.combine_wait, EPX_LL_COMBINE_WAIT): "flag" (default) | "data": ll on CUDA, partial combine:
      the receiver waits for per-block flags, or polls the partial rows themselves; all ranks must agree.
  ll_warps_per_block (multiple of 4 in [4, 32]), ll_num_blocks (0 = one per SM): ll on CUDA launch shape.
  ht_num_sms (1..132), ht_warps_per_block, ht_combine_mode (0 | 1), ht_chunk_rows (1..4096), ht_fp8_unroll
      (0 | 4 | 7), ht_pdl (0..2): ht on CUDA.
  experts_simt, experts_fp8_pairs, experts_fp8_prefill (0 | 1),
      experts_fp8_prefill_stages (0 or 2..4), experts_fp8_prefill_min_tiles (0 = one wave, >= 1),
      experts_mxfp4_tc (0 | 1): CUDA experts' kernel choice.
  moe_chunk_size (tokens, 0 = unchunked), fhmoe_max_tokens (fuse the shared expert when M <= this).)doc");
  cls.def(pyb::init<>(), "Defaults only (no file, no environment).")
      .def_static("load", [](std::optional<std::string> path) { return path ? Config::load(*path) : Config::load(); },
                  pyb::arg("path") = pyb::none(), "default < JSON file (`path`, else $EPX_CONFIG if set) < EPX_* environment.")
      // set / apply_json / apply_env work on a copy and validate it, as attribute assignment does: a value
      // that breaks its field's rule raises InvalidArgument (ValueError) and the Config keeps its old values.
      .def("apply_json", [](Config& c, const std::string& text, const std::string& origin) {
             Config t = c;
             t.apply_json_text(text, origin);
             t.validate();
             c = std::move(t);
           }, pyb::arg("text"), pyb::arg("origin") = "python",
           "Apply a JSON object of \"key\": value; unknown keys or a bad value raise InvalidArgument (nothing applied).")
      .def("apply_env", [](Config& c) {
             Config t = c;
             t.apply_env();
             t.validate();
             c = std::move(t);
           }, "Apply the EPX_* environment variables; raises InvalidArgument as apply_json (nothing applied).")
      .def("set", [](Config& c, const std::string& key, pyb::handle value) {
             Config t = c;
             t.set(key, setting_text(value), "api");
             t.validate();
             c = std::move(t);
           }, pyb::arg("key"), pyb::arg("value"),
           "Set one field by key (value as text or a number); an unknown key or a value that breaks the key's rule "
           "raises InvalidArgument (ValueError) and leaves the Config as it was.")
      .def("validate", &Config::validate)
      .def("describe", &Config::describe)
      .def_readonly("sources", &Config::sources, "(key, source) pairs: default, json <file>, env EPX_..., api.");
  bind_setting(cls, "timeout_s", "timeout_s", &Config::timeout_s, "Longest wait on a peer before Timeout [s]; > 0.");
  bind_setting(cls, "log_level", "log_level", &Config::log_level, "trace | debug | info | warn | error | off.");
  bind_setting(cls, "ll_warps_per_block", "ll.warps_per_block", &Config::ll_warps_per_block,
               "Warps per block of the ll CUDA kernels; a multiple of 4 in [4, 32].");
  bind_setting(cls, "ll_num_blocks", "ll.num_blocks", &Config::ll_num_blocks, "Blocks of the ll CUDA kernels; 0 = one per SM.");
  bind_setting(cls, "ll_combine", "ll.combine", &Config::ll_combine,
               "\"partial_fp32\" | \"partial_bf16\" | \"column\" (epx bench; the API takes DispatchConfig.ll_combine).");
  bind_setting(cls, "ll_combine_wait", "ll.combine_wait", &Config::ll_combine_wait,
               "ll on CUDA, partial combine: \"flag\" (default: per-send-block flags, then the reduction) or \"data\" "
               "(the partial rows are the signal: each token reduced as its rows land). All ranks must agree.");
  bind_setting(cls, "ht_num_sms", "ht.num_sms", &Config::ht_num_sms, "SM budget of the ht CUDA kernels; 1..132.");
  bind_setting(cls, "ht_warps_per_block", "ht.warps_per_block", &Config::ht_warps_per_block,
               "Warps per block of the ht kernels; 1..32 (ht on CUDA: 1..16).");
  bind_setting(cls, "ht_combine_mode", "ht.combine_mode", &Config::ht_combine_mode,
               "ht combine on CUDA: 0 all sends then all reduces, 1 pipelined (one target per token only).");
  bind_setting(cls, "ht_chunk_rows", "ht.chunk_rows", &Config::ht_chunk_rows, "ht combine on CUDA: rows per chunk flag; 1..4096.");
  bind_setting(cls, "ht_fp8_unroll", "ht.fp8_unroll", &Config::ht_fp8_unroll,
               "ht fp8 dispatch on CUDA: steps of 4 groups a warp loads before quantizing, 4 or 7; 0 = auto.");
  bind_setting(cls, "ht_pdl", "ht.pdl", &Config::ht_pdl,
               "ht on CUDA: 1 dispatch kernel by programmatic dependent launch, 2 also prefetches x rows into L2, 0 neither.");
  bind_setting(cls, "experts_simt", "experts.simt", &Config::experts_simt, "1: CUDA experts always take the SIMT reference GEMMs.");
  bind_setting(cls, "experts_fp8_pairs", "experts.fp8_pairs", &Config::experts_fp8_pairs,
               "1: the FP8 tensor-core mainloop over K-block pairs.");
  bind_setting(cls, "experts_fp8_prefill", "experts.fp8_prefill", &Config::experts_fp8_prefill,
               "1 (default): experts with > 64 rows take the FP8 prefill GEMMs (128-row tiles); 0: the 64-row kernels.");
  bind_setting(cls, "experts_fp8_prefill_stages", "experts.fp8_prefill_stages", &Config::experts_fp8_prefill_stages,
               "Ring depth of the FP8 prefill GEMMs in stages; 0 = maximum, else 2..4.");
  bind_setting(cls, "experts_fp8_prefill_min_tiles", "experts.fp8_prefill_min_tiles", &Config::experts_fp8_prefill_min_tiles,
               "The FP8 prefill GEMMs run only when the experts with > 64 rows fill at least this many 128-row tiles; 0 = one wave of the GPU, 1 = always.");
  bind_setting(cls, "experts_mxfp4_tc", "experts.mxfp4_tc", &Config::experts_mxfp4_tc,
               "1 (default): mxfp4 experts run on the MXFP4 tensor-core kernels; 0: the SIMT GEMMs.");
  bind_setting(cls, "moe_chunk_size", "moe.chunk_size", &Config::moe_chunk_size, "DP chunk: at most this many tokens per MoE call per rank; 0 = unchunked.");
  bind_setting(cls, "fhmoe_max_tokens", "fhmoe.max_tokens", &Config::fhmoe_max_tokens,
               "Capability gate: fuse the shared expert when M <= this (tokens).");
  bind_setting(cls, "fhmoe_max_tokens_mixed", "fhmoe.max_tokens_mixed", &Config::fhmoe_max_tokens_mixed,
               "Capability gate of layers whose shared expert's weight format differs from the routed experts' (V4-Pro: FP8 shared, MXFP4 routed), tokens.");
  bind_setting(cls, "fhmoe_max_tokens_sharded", "fhmoe.max_tokens_sharded", &Config::fhmoe_max_tokens_sharded,
               "Capability gate of layers whose fused path runs the shared expert DP-sharded (naive, allgather_reducescatter), tokens.");
  bind_setting(cls, "fhmoe_local_shared_tokens", "fhmoe.local_shared_tokens", &Config::fhmoe_local_shared_tokens,
               "On ll (per-expert slots) fused chunks with M > this put the shared expert rows into its local slot instead of the dispatch (tokens).");
  cls.def("__repr__", [](const Config& c) {
    std::string s = "epx.Config(";
    for (const auto& line : c.describe()) s += "\n  " + line;
    return s + ")";
  });
}

void bind_groups(pyb::module_& m) {
  pyb::class_<Group, std::shared_ptr<Group>>(m, "Group", R"doc(
A group of R ranks (the EP group). CPU groups (make_cpu_groups) are threads of this process; NCCL groups
(make_nccl_group, group_from_torch) are one process per GPU; virtual ranks (make_virtual_cuda_groups) are
threads of this process on one GPU. Every wait on a peer is bounded by timeout_s.)doc")
      .def_property_readonly("rank", &Group::rank)
      .def_property_readonly("size", &Group::size)
      .def_property_readonly("device", [](const Group& g) { return g.device().str(); })
      .def_property_readonly("name", &Group::name)
      .def_property_readonly("ranks_per_gpu", &Group::ranks_per_gpu,
                             "Ranks of this group on this rank's GPU: R for virtual ranks, else 1.")
      .def("barrier", &Group::barrier, pyb::call_guard<pyb::gil_scoped_release>(), "Collective.")
      .def("all_gather_i64", &Group::all_gather_i64, pyb::arg("value"), pyb::call_guard<pyb::gil_scoped_release>(),
           "Collective: one int64 from every rank, in rank order.")
      .def("__repr__", [](const Group& g) {
        return "epx.Group(rank=" + std::to_string(g.rank()) + ", size=" + std::to_string(g.size()) + ", device=" + g.device().str() + ")";
      });

  m.def("make_cpu_groups", [](int num_ranks, double timeout_s, int ranks_per_node) {
          require_arg("make_cpu_groups", "ranks_per_node", ranks_per_node, ranks_per_node >= 0,
                      "must be >= 0 (0: one node; else it divides num_ranks)");
          return ranks_per_node > 0 ? make_cpu_groups(num_ranks, timeout_s, ranks_per_node) : make_cpu_groups(num_ranks, timeout_s);
        }, pyb::arg("num_ranks"), pyb::arg("timeout_s") = 60.0, pyb::arg("ranks_per_node") = 0,
        "R CPU groups sharing one in-process world; element r is rank r. Drive each from its own thread (run_ranks).\n"
        "ranks_per_node > 0: the ranks report num_ranks / ranks_per_node nodes of consecutive ranks (the CPU twin\n"
        "of a multi-node group: ll and ht take their hierarchical path); it must divide num_ranks, and a negative\n"
        "ranks_per_node raises ValueError.");
  m.def("run_ranks", [](const std::vector<std::shared_ptr<Group>>& groups, const std::function<void(int)>& fn) {
    pyb::gil_scoped_release release;
    run_ranks(groups, [&](int rank) {
      pyb::gil_scoped_acquire acquire;
      fn(rank);
    });
  }, pyb::arg("groups"), pyb::arg("fn"), R"doc(
Runs fn(rank) on one thread per rank of `groups` (CPU groups, or virtual ranks: make_virtual_cuda_groups).
If a rank raises, the world is aborted (peers blocked in a collective raise CommError instead of hanging)
and the first exception is raised here once every thread has finished. epx calls release the GIL, so the
ranks run in parallel.)doc");
  m.def("make_virtual_cuda_groups", &make_virtual_cuda_groups, pyb::arg("num_ranks"), pyb::arg("device") = 0,
        pyb::arg("timeout_s") = 60.0, pyb::arg("ranks_per_node") = 0, pyb::call_guard<pyb::gil_scoped_release>(), R"doc(
R groups whose ranks are threads of this process on CUDA device `device` ("virtual ranks"), for machines
with fewer GPUs than ranks; element r is rank r. Drive them with run_ranks (one thread per rank).

The NCCL group's semantics: collectives are stream-ordered, prepare / finalize of every backend (ll and ht
too), ModularMoE and CUDA graphs run unchanged, and the kernels that wait on peers (ll, ht) take at most
1 / num_ranks of the GPU's SMs each. Each rank works on its own non-blocking stream (torch: inside the
rank's function, `with torch.cuda.stream(torch.cuda.Stream()):`, whose pool streams are non-blocking;
torch's default stream would serialise the ranks) and waits with that stream's synchronize(), never for
the whole device (torch.cuda.synchronize()) between multi-rank calls: a peer's kernel on the same GPU may
wait for work this rank has not queued yet. Timings measure one GPU's memory, not NVLink. More than
one rank needs eager kernel loading: set CUDA_MODULE_LOADING=EAGER in the environment before torch or epx
starts CUDA (otherwise Unsupported, naming CUDA_MODULE_LOADING).
timeout_s [s] bounds every wait, on the host and on the device. ranks_per_node > 0: the ranks report
num_ranks / ranks_per_node virtual nodes of consecutive ranks (ll and ht then take their hierarchical path).
Raises InvalidArgument (ValueError) for num_ranks outside [1, 64] or a bad device, timeout_s or
ranks_per_node; CudaError; Unsupported (NotImplementedError) in a CPU-only build.)doc");

  pyb::class_<UniqueId>(m, "UniqueId", "The 128-byte NCCL unique id that names one NCCL group; rank 0 creates it.")
      .def_static("create", &UniqueId::create, "A fresh id (ncclGetUniqueId). Raises Unsupported in a CPU-only build.")
      .def_static("parse", &UniqueId::parse, pyb::arg("hex"), "Inverse of hex(); raises InvalidArgument.")
      .def("hex", &UniqueId::hex, "256 lowercase hex digits.")
      .def("__eq__", [](const UniqueId& a, const UniqueId& b) { return a == b; })
      .def("__repr__", [](const UniqueId& u) { return "epx.UniqueId('" + u.hex().substr(0, 16) + "...')"; });
  m.def("exchange_unique_id", &exchange_unique_id, pyb::arg("path"), pyb::arg("rank"), pyb::arg("timeout_s") = 60.0,
        pyb::call_guard<pyb::gil_scoped_release>(),
        "File rendezvous: rank 0 writes a fresh id to `path`, the others wait for it (path must be fresh per group).");
  m.def("make_nccl_group",
        pyb::overload_cast<const UniqueId&, int, int, int, double>(&make_nccl_group),
        pyb::arg("uid"), pyb::arg("rank"), pyb::arg("world"), pyb::arg("device"), pyb::arg("timeout_s") = 60.0,
        pyb::call_guard<pyb::gil_scoped_release>(),
        "The NCCL group of `rank` of `world` on CUDA device `device` (collective). Raises Timeout, CommError, CudaError, "
        "Unsupported (CPU-only build).");
  m.def("make_nccl_group",
        pyb::overload_cast<const std::string&, int, int, int, double>(&make_nccl_group),
        pyb::arg("rendezvous_path"), pyb::arg("rank"), pyb::arg("world"), pyb::arg("device"), pyb::arg("timeout_s") = 60.0,
        pyb::call_guard<pyb::gil_scoped_release>(), "Same, with a file rendezvous (exchange_unique_id).");
  m.def("make_nccl_group_from_env", &make_nccl_group_from_env, pyb::arg("timeout_s") = 60.0,
        pyb::call_guard<pyb::gil_scoped_release>(),
        "From EPX_RANK, EPX_WORLD_SIZE, EPX_RENDEZVOUS (a file path) and EPX_LOCAL_RANK, as `epx moe --ranks` sets them.");

  m.def("built_with_cuda", &cuda::built_with_cuda);
  m.def("cuda_device_count", &cuda::device_count, "CUDA devices this process may use; 0 without a GPU or a CUDA build.");
  m.def("nccl_version", [] { return std::make_pair(cuda::nccl_header_version(), cuda::nccl_runtime_version()); },
        "(NCCL_VERSION_CODE of the headers, ncclGetVersion() of the loaded library); (0, 0) in a CPU-only build.");
}

}  // namespace
}  // namespace epx::py

PYBIND11_MODULE(_epx, m) {
  using namespace epx::py;
  m.doc() = "epx: expert-parallel MoE dispatch/combine and the modular MoE layer (C++ core; see the epx package).";
  m.attr("__version__") = EPX_VERSION;
  bind_errors(m);
  bind_tensor(m);
  bind_config(m);
  bind_groups(m);
  bind_moe(m);
}
