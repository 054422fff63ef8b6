// dispatch/registry.cpp: the one list of dispatch backends (STYLE.md §2), expert placement, and
// make_prepare_finalize: agree on the config collectively, validate it, build the backend.
#include <algorithm>
#include <optional>
#include <string>

#include "dispatch/backends.h"
#include "dispatch/hier/hier.h"
#include "dispatch/placement.h"
#include "dispatch/prepare_finalize_base.h"
#include "epx/config.h"
#include "epx/error.h"

namespace epx {
namespace {

using Factory = std::unique_ptr<PrepareFinalize> (*)(std::shared_ptr<Group>, const DispatchConfig&);
using ConfigFactory = std::unique_ptr<PrepareFinalize> (*)(std::shared_ptr<Group>, const DispatchConfig&, const Config&);

struct BackendEntry {
  const char* name;
  Factory make_cpu;  ///< nullptr: no CPU implementation
  Factory make_cuda; ///< nullptr: no CUDA implementation in this build
  const char* why_no_cuda;  ///< when make_cuda is nullptr in a CUDA build: why, one sentence
  ConfigFactory make_cuda_with_config = nullptr;  ///< the CUDA factory taking the caller's Config, if it reads one
};

#ifdef EPX_WITH_CUDA
constexpr Factory kNaiveCuda = &dispatch::make_naive_cuda;
constexpr Factory kAgrsCuda = &dispatch::make_agrs_cuda;
constexpr Factory kAll2allvCuda = &dispatch::make_all2allv_cuda;
constexpr Factory kHtCuda = &dispatch::make_ht_cuda;
constexpr ConfigFactory kHtCudaWithConfig = &dispatch::make_ht_cuda;
constexpr Factory kLlCuda = &dispatch::make_ll_cuda;
constexpr ConfigFactory kLlCudaWithConfig = &dispatch::make_ll_cuda;
#else
constexpr Factory kNaiveCuda = nullptr, kAgrsCuda = nullptr, kAll2allvCuda = nullptr;
constexpr Factory kHtCuda = nullptr, kLlCuda = nullptr;
constexpr ConfigFactory kHtCudaWithConfig = nullptr, kLlCudaWithConfig = nullptr;
#endif

// Order = backend_names() order = the order of the `epx info` table and the test cross product.
constexpr BackendEntry kBackends[] = {
    {"naive", &dispatch::make_naive_cpu, kNaiveCuda, nullptr},
    {"allgather_reducescatter", &dispatch::make_agrs_cpu, kAgrsCuda, nullptr},
    {"all2allv", &dispatch::make_all2allv_cpu, kAll2allvCuda, nullptr},
    {"ll", &dispatch::make_ll_cpu, kLlCuda, nullptr, kLlCudaWithConfig},
    {"ht", &dispatch::make_ht_cpu, kHtCuda, nullptr, kHtCudaWithConfig},
};

}  // namespace

ExpertRange expert_range(int num_experts, int num_ranks, int rank) {
  require_arg("expert_range", "num_ranks", num_ranks, num_ranks >= 1, "must be >= 1");
  require_arg("expert_range", "rank", rank, rank >= 0 && rank < num_ranks, "must be in [0, num_ranks = " + std::to_string(num_ranks) + ")");
  require_arg("expert_range", "num_experts", num_experts, num_experts >= 0, "must be >= 0");
  // The first E % R ranks hold one expert more: sizes differ by at most one (BEHAVIOUR.md).
  const dispatch::Placement p{num_experts, num_ranks, false};
  return {p.range_begin(rank), p.range_end(rank)};
}

LlCombine parse_ll_combine(const std::string& text, const std::string& what) {
  if (text == "column") return LlCombine::column;
  if (text == "partial_fp32") return LlCombine::partial_fp32;
  if (text == "partial_bf16") return LlCombine::partial_bf16;
  throw InvalidArgument(what + " = \"" + text + "\": must be one of column, partial_fp32, partial_bf16");
}

const char* ll_combine_name(LlCombine mode) {
  switch (mode) {
    case LlCombine::column: return "column";
    case LlCombine::partial_fp32: return "partial_fp32";
    case LlCombine::partial_bf16: return "partial_bf16";
  }
  return "?";
}

FlatCombine parse_flat_combine(const std::string& text, const std::string& what) {
  if (text == "partial_fp32") return FlatCombine::partial_fp32;
  if (text == "partial_bf16") return FlatCombine::partial_bf16;
  throw InvalidArgument(what + " = \"" + text + "\": must be one of partial_fp32 (one rounding), partial_bf16 (two roundings)");
}

const char* flat_combine_name(FlatCombine mode) {
  switch (mode) {
    case FlatCombine::partial_fp32: return "partial_fp32";
    case FlatCombine::partial_bf16: return "partial_bf16";
  }
  return "?";
}

int expert_rank(int num_experts, int num_ranks, int expert) {
  require_arg("expert_rank", "expert", expert, expert >= 0 && expert < num_experts,
              "must be in [0, num_experts = " + std::to_string(num_experts) + ")");
  require_arg("expert_rank", "num_ranks", num_ranks, num_ranks >= 1, "must be >= 1");
  return dispatch::Placement{num_experts, num_ranks, false}.rank_of(expert);
}

int num_local_experts(const DispatchConfig& cfg, int num_ranks, int rank) {
  return expert_range(cfg.num_experts, num_ranks, rank).size() + (cfg.shared_route ? 1 : 0);
}

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const auto& b : kBackends) names.emplace_back(b.name);
  return names;
}

namespace {

/// make_prepare_finalize with the caller's Config (nullptr: backends that read one call Config::load()).
std::unique_ptr<PrepareFinalize> make_backend(const std::string& name, std::shared_ptr<Group> group, const DispatchConfig& cfg,
                                              const Config* config) {
  require_arg("make_prepare_finalize", "group", "null", group != nullptr, "must be a group");
  int index = -1;
  for (size_t i = 0; i < std::size(kBackends); ++i)
    if (name == kBackends[i].name) index = static_cast<int>(i);
  // Agree first (also on the backend), so a rank with a bad name or config cannot leave its peers
  // waiting in a collective: every rank then fails the same way.
  const std::string op = (index >= 0 ? name : std::string("make_prepare_finalize")) + ".create";
  // A backend that reads launch settings from a Config (ll / ht on CUDA) and got none from the caller used to call
  // Config::load() itself after the agreement, so a bad EPX_* variable (or EPX_CONFIG file) in one process stopped
  // that rank alone and its peers waited in the backend's first collective until timeout_s. It is loaded here
  // instead, inside the verdict gather below, and handed to the backend as the caller's would be.
  std::optional<Config> loaded;
  const bool load_here = !config && index >= 0 && group->device().is_cuda() && kBackends[index].make_cuda_with_config != nullptr;
  if (config || load_here) {
    // The caller's Config reaches the CUDA kernels' launch settings as it is (ht.chunk_rows divides, ll.signal
    // picks a protocol): one built in C++ is held to the rules that Config::set / JSON / EPX_* enforce. A rank
    // whose Config breaks one (or whose Config::load() fails) throws that sentence; the others learn which rank
    // it was (one gather, so nobody waits in a later collective for a rank that stopped).
    std::string bad;
    try {
      if (load_here) loaded = Config::load();  // validates
      else config->validate();
    } catch (const InvalidArgument& e) {
      bad = e.what();
    }
    const std::vector<int64_t> verdicts = group->all_gather_i64(bad.empty() ? 0 : 1);
    if (!bad.empty()) throw InvalidArgument(bad);
    for (size_t r = 0; r < verdicts.size(); ++r)
      if (verdicts[r] != 0)
        throw InvalidArgument(op + ": config of rank " + std::to_string(r) +
                              " breaks a rule: every rank stops (see that rank's error)");
    if (load_here) config = &*loaded;
  }
  group->check_agreement(op, {{"backend", index},
                              {"hidden", cfg.hidden},
                              {"num_experts", cfg.num_experts},
                              {"top_k", cfg.top_k},
                              {"num_max_dispatch_tokens_per_rank", cfg.num_max_dispatch_tokens_per_rank},
                              {"dispatch_dtype", static_cast<int64_t>(cfg.dispatch_dtype)},
                              {"use_ue8m0", cfg.use_ue8m0},
                              {"shared_route", cfg.shared_route},
                              {"expert_alignment", cfg.expert_alignment},
                              {"use_worst_case_sizing", cfg.use_worst_case_sizing},
                              {"expert_contiguous", cfg.expert_contiguous},
                              {"ll_combine", static_cast<int64_t>(cfg.ll_combine)},
                              {"flat_combine", static_cast<int64_t>(cfg.flat_combine)}},
                         [](size_t field, int64_t v) -> std::string {  // names, not enum indices, in the message
                           if (field == 0) return v >= 0 && v < static_cast<int64_t>(std::size(kBackends)) ? kBackends[v].name : "an unknown name";
                           if (field == 5) return std::string(dtype_name(static_cast<DType>(v)));
                           if (field == 11) return v >= 0 && v <= 2 ? ll_combine_name(static_cast<LlCombine>(v)) : "";
                           if (field == 12) return v >= 0 && v <= 1 ? flat_combine_name(static_cast<FlatCombine>(v)) : "";
                           return "";
                         });
  if (index < 0) {
    std::string known;
    for (const auto& b : kBackends) known += (known.empty() ? "" : ", ") + std::string(b.name);
    throw InvalidArgument(arg_message("make_prepare_finalize", "name", name, "must be one of {" + known + "}"));
  }
  dispatch::validate_config(name, cfg, group->size());
  const BackendEntry& entry = kBackends[index];
  const Factory make = group->device().is_cpu() ? entry.make_cpu : entry.make_cuda;
  // ll and ht move rows with load/store (LSA) kernels inside one NVLink domain: across nodes they
  // run hierarchically (hier.h): an NCCL stage between nodes, then the same backend on each node.
  // Every rank sees the same layout, so every rank takes the same path (or throws the same).
  const bool with_config = config && group->device().is_cuda() && entry.make_cuda_with_config;
  if (make && (name == "ll" || name == "ht") && group->num_nodes() > 1) {
    if (!with_config) return dispatch::make_hierarchical(name, std::move(group), cfg, make);
    const ConfigFactory make_with = entry.make_cuda_with_config;
    const Config settings = *config;  // the node backend takes the caller's launch settings too
    return dispatch::make_hierarchical(name, std::move(group), cfg,
                                       [make_with, settings](std::shared_ptr<Group> g, const DispatchConfig& c) { return make_with(std::move(g), c, settings); });
  }
  if (!make) {
    std::string why = "backend " + name + " has no implementation for this device in this build";
#ifdef EPX_WITH_CUDA
    if (group->device().is_cuda() && entry.why_no_cuda) why = "backend " + name + " has no CUDA implementation yet: " + entry.why_no_cuda;
#endif
    throw Unsupported(op + ": device = " + group->device().str() + ": " + why);
  }
  if (with_config) return entry.make_cuda_with_config(std::move(group), cfg, *config);
  return make(std::move(group), cfg);
}

}  // namespace

std::unique_ptr<PrepareFinalize> make_prepare_finalize(const std::string& name, std::shared_ptr<Group> group,
                                                       const DispatchConfig& cfg) {
  return make_backend(name, std::move(group), cfg, nullptr);
}

std::unique_ptr<PrepareFinalize> make_prepare_finalize(const std::string& name, std::shared_ptr<Group> group,
                                                       const DispatchConfig& cfg, const Config& config) {
  return make_backend(name, std::move(group), cfg, &config);
}

}  // namespace epx
