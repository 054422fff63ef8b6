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

#include <deque>
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

/// The registry's entry of `key` (Config::knobs()); a key the registry lacks is a defect of this file.
const Knob& knob(const char* key) {
  static const std::vector<Knob> all = Config::knobs();
  for (const Knob& k : all)
    if (k.key == key) return k;
  throw Error(std::string("epx._epx: Config has no knob ") + key);
}

/// A knob's docstring, from the registry: meaning, type and unit, default, rule, JSON key and variable.
std::string knob_doc(const Knob& k) {
  return k.meaning + ".\n" + k.type + (k.unit.empty() ? "" : " [" + k.unit + "]") + ", default " + k.default_value + "; " + k.rule +
         ".\nJSON key \"" + k.key + "\", environment variable " + k.env + ".";
}

/// Config.<attr> as a property of the knob `key`: reads the field; assigning goes through Config::set
/// (source "api") and Config::validate on a copy, so a bad value raises InvalidArgument (ValueError)
/// naming the key and its rule and leaves the Config as it was. The docstring comes from the registry.
template <class M>
void bind_setting(pyb::class_<Config>& cls, const char* key, M Config::*member) {
  const Knob& k = knob(key);
  static std::deque<std::string> docs;  // pybind11 keeps the pointer: the texts live as long as the module
  docs.push_back(knob_doc(k));
  cls.def_property(
      k.attr.c_str(), [member](const Config& c) { return c.*member; },
      [key](Config& c, pyb::handle value) {
        Config t = c;
        t.set(key, setting_text(value), "api");
        t.validate();
        c = std::move(t);
      },
      docs.back().c_str());
}

/// The class docstring: how a Config is made and applied, then one line per knob from the registry.
const char* config_doc() {
  static const std::string doc = [] {
    std::string d = R"doc(
epx's one configuration struct (include/epx/config.h). Precedence: default < JSON file (EPX_CONFIG or
Config.load(path)) < EPX_* environment < explicit set() / attribute assignment. Unknown keys raise
InvalidArgument (ValueError) with the nearest known key; a bad value raises InvalidArgument naming the key
and its rule (the Config keeps its old value). describe() lists "key = value  [source]  meaning" as
`epx info` prints; Config.knobs() every knob's key, variable, type, default, rule and meaning. The launch
settings reach a backend through make_prepare_finalize(..., settings=) or ModularMoE(..., config=);
without one the backend reads Config.load() (EPX_CONFIG, EPX_* variables).
Attributes (JSON key; type, default; allowed values: meaning):
)doc";
    for (const Knob& k : Config::knobs())
      d += "  " + k.attr + " (" + k.key + "; " + k.type + ", " + k.default_value + (k.unit.empty() ? "" : " " + k.unit) + "; " + k.allowed +
           "): " + k.meaning + ".\n";
    return d;
  }();
  return doc.c_str();
}

void bind_config(pyb::module_& m) {
  pyb::class_<Config> cls(m, "Config", config_doc());
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
      .def_static("knobs", [] {
        pyb::list out;
        for (const Knob& k : Config::knobs()) {
          pyb::dict d;
          d["key"] = k.key, d["env"] = k.env, d["attr"] = k.attr, d["type"] = k.type, d["unit"] = k.unit;
          d["default"] = k.default_value, d["allowed"] = k.allowed, d["rule"] = k.rule, d["meaning"] = k.meaning;
          out.append(d);
        }
        return out;
      }, "Every knob as a dict (key, env, attr, type, unit, default, allowed, rule, meaning), from the registry `epx info --knobs` prints.")
      .def_static("knobs_markdown", &Config::knobs_markdown, pyb::arg("prefix") = "",
                  "The Markdown table of the knobs whose key starts with `prefix` (docs/configuration.md).")
      .def_readonly("sources", &Config::sources, "(key, source) pairs: default, json <file>, env EPX_..., api.");
  bind_setting(cls, "timeout_s", &Config::timeout_s);
  bind_setting(cls, "log_level", &Config::log_level);
  bind_setting(cls, "ll.warps_per_block", &Config::ll_warps_per_block);
  bind_setting(cls, "ll.num_blocks", &Config::ll_num_blocks);
  bind_setting(cls, "ll.combine", &Config::ll_combine);
  bind_setting(cls, "ll.combine_wait", &Config::ll_combine_wait);
  bind_setting(cls, "ht.num_sms", &Config::ht_num_sms);
  bind_setting(cls, "ht.warps_per_block", &Config::ht_warps_per_block);
  bind_setting(cls, "ht.chunk_rows", &Config::ht_chunk_rows);
  bind_setting(cls, "ht.pdl", &Config::ht_pdl);
  bind_setting(cls, "experts.simt", &Config::experts_simt);
  bind_setting(cls, "experts.fp8_prefill", &Config::experts_fp8_prefill);
  bind_setting(cls, "experts.fp8_prefill_stages", &Config::experts_fp8_prefill_stages);
  bind_setting(cls, "experts.fp8_prefill_min_tiles", &Config::experts_fp8_prefill_min_tiles);
  bind_setting(cls, "experts.mxfp4_tc", &Config::experts_mxfp4_tc);
  bind_setting(cls, "moe.chunk_size", &Config::moe_chunk_size);
  bind_setting(cls, "fhmoe.max_tokens", &Config::fhmoe_max_tokens);
  bind_setting(cls, "fhmoe.max_tokens_mixed", &Config::fhmoe_max_tokens_mixed);
  bind_setting(cls, "fhmoe.max_tokens_sharded", &Config::fhmoe_max_tokens_sharded);
  bind_setting(cls, "fhmoe.local_shared_tokens", &Config::fhmoe_local_shared_tokens);
  // Every knob of the registry is an attribute (a knob added there and not here fails the import).
  for (const Knob& k : Config::knobs())
    if (!pyb::hasattr(cls, k.attr.c_str())) throw Error("epx._epx: Config lacks the attribute " + k.attr + " of knob " + k.key);
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
