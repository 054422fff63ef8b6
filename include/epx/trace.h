// epx/trace.h: recorded routing ("traces") that `epx moe --trace` replays, and their import.
//
// A trace holds, per step and per rank, the routing that rank feeds into the MoE layer:
//   topk_idx      [T_r, K] int32   expert ids, -1 = no selection
//   topk_weights  [T_r, K] fp32    router weights
//   hidden_states [T_r, H] bf16    optional; the layer input (random inputs are used without it)
// T_r may differ between ranks and steps (0 included). The on-disk forms are documented in
// docs/trace-format.md:
//   - one JSON file ("format": "epx-trace", "version": 1) for small traces;
//   - a directory with manifest.json and one .npy file per (step, rank, tensor) for large ones.
// Every loader validates fully and throws InvalidArgument in the STYLE.md form, naming the file
// and the element, e.g. "trace t.json: steps[2].ranks[1].topk_idx[5, 0] = 61: must be -1 (no
// selection) or an expert id in [0, num_experts = 60)".
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <utility>
#include <vector>

#include "epx/tensor.h"

namespace epx {

/// One rank's routing in one step. All tensors are CPU, contiguous.
struct TraceRank {
  Tensor topk_idx;       ///< [T_r, K] int32; -1 = no selection
  Tensor topk_weights;   ///< [T_r, K] fp32
  Tensor hidden_states;  ///< [T_r, H] bf16, or undefined when the trace carries none
  int64_t num_tokens() const { return topk_idx.defined() ? topk_idx.size(0) : 0; }
};

struct TraceStep {
  std::vector<TraceRank> ranks;  ///< [num_ranks]
};

struct Trace {
  int num_ranks = 0;      ///< R: DP ranks feeding the EP group
  int num_experts = 0;    ///< E: valid ids are [0, E) and -1
  int top_k = 0;          ///< K: columns of topk_idx / topk_weights
  int64_t hidden = 0;     ///< H of hidden_states; 0 = the trace carries no hidden states
  std::string source;     ///< free text: where the routing came from (model, layer, file)
  std::vector<TraceStep> steps;

  /// Checks every rule of docs/trace-format.md: R, E, K >= 1; every step has R ranks; shapes
  /// [T_r, K] (and [T_r, H] for hidden states, present on all ranks or none); ids in [-1, E);
  /// finite weights. Throws InvalidArgument "trace <origin>: <element> = <value>: <rule>".
  void validate(const std::string& origin = "<memory>") const;

  int64_t max_tokens_per_rank() const;   ///< max over steps and ranks of T_r (0 for an empty trace)
  int64_t total_tokens() const;          ///< sum of T_r over steps and ranks
  /// [R][E]: valid selections (id != -1) of expert e made by tokens of source rank r, over all steps.
  std::vector<std::vector<int64_t>> selection_counts() const;
  /// [R]: tokens each source rank contributes over all steps.
  std::vector<int64_t> tokens_per_rank() const;
  /// [E]: valid selections of each expert over all steps and ranks (duplicates count twice).
  std::vector<int64_t> expert_counts() const;
};

/// Builds one rank's routing from row-major vectors; idx.size() must be T*K and equal
/// weights.size() (InvalidArgument otherwise). `hidden_bf16` (T*H bf16 bits) may be empty.
TraceRank make_trace_rank(int top_k, const std::vector<int32_t>& topk_idx, const std::vector<float>& topk_weights,
                          int64_t hidden = 0, const std::vector<uint16_t>& hidden_bf16 = {});

/// Loads `path`: a JSON file, or a directory holding manifest.json. Validates before returning.
/// Throws InvalidArgument for unreadable files, bad JSON, unknown format/version or any rule.
Trace load_trace(const std::string& path);
/// Parses the JSON form from text; `origin` names it in error messages. Validates.
Trace parse_trace_json(const std::string& text, const std::string& origin = "<json>");
/// The JSON form of `trace` (validated first). Weights print as shortest round-trip decimals.
std::string trace_to_json(const Trace& trace);
/// Writes `trace` (validated first): `path` ending in ".json" gets the JSON form, any other path
/// becomes a directory (created if missing; existing trace files in it are overwritten) with
/// manifest.json + .npy files. Throws InvalidArgument when the path cannot be written.
void save_trace(const Trace& trace, const std::string& path);

/// Contiguous, even deal of n tokens over R ranks, as DP attention splits a batch: rank r gets
/// [first, second); sizes differ by at most one, the first n % R ranks get the larger size.
std::pair<int64_t, int64_t> deal_tokens(int64_t num_tokens, int num_ranks, int rank);

struct TraceImportOptions {
  int num_ranks = 1;                 ///< R: ranks the tokens of each step are dealt over
  int skip_passes = 2;               ///< leading forward passes to drop (vLLM profile/warm-up passes)
  int64_t max_tokens_per_step = 0;   ///< > 0: a pass longer than this becomes consecutive steps of at most this many tokens
  int num_experts = 0;               ///< E; 0 = "num_experts" of the meta line if present, else max id + 1
};

/// What the importer saw, for the CLI to print.
struct TraceImportSummary {
  int64_t num_records = 0;           ///< route records read (all passes)
  int64_t num_passes = 0;            ///< forward passes found (token_idx restarting at 0)
  int64_t num_skipped_records = 0;   ///< records in the dropped passes
};

/// Converts JSON Lines of per-token routing records into a Trace.
///   record: {"type": "route", "token_idx": i, "topk_ids": [K ints], "topk_weights": [K floats], ...}
///   a line with "type" other than "route" (the "meta" header) is skipped; its "top_k" and
///   "num_experts", when present, fix K and E; blank lines are skipped.
/// token_idx == 0 starts a new forward pass; otherwise it must be the previous token_idx + 1.
/// The first `skip_passes` passes are dropped, each remaining pass becomes one step (or several,
/// see max_tokens_per_step) whose tokens are dealt over R ranks with deal_tokens().
/// Throws InvalidArgument naming "<origin>:<line>" and the field for malformed input.
Trace import_routing_jsonl(std::istream& in, const TraceImportOptions& options, const std::string& origin,
                           TraceImportSummary* summary = nullptr);
/// Same, reading the file at `path`.
Trace import_routing_jsonl_file(const std::string& path, const TraceImportOptions& options,
                                TraceImportSummary* summary = nullptr);

/// A minimal NumPy .npy array (format 1.0/2.0/3.0 read, 1.0 written): C order, little-endian.
/// descr is one of "<i4", "<i8", "<f4", "<u2" (the directory trace form stores bf16 bits as "<u2").
struct NpyArray {
  std::string descr;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  ///< product(shape) * itemsize bytes
  int64_t numel() const;
};
/// Throws InvalidArgument naming the file for a bad magic, header, fortran_order, or short data.
NpyArray read_npy(const std::string& path);
void write_npy(const std::string& path, const NpyArray& array);

}  // namespace epx
