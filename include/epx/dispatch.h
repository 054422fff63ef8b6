// epx/dispatch.h: token dispatch/combine behind one interface (vLLM: FusedMoEPrepareAndFinalize).
//
//   prepare  (dispatch): x [T, H] + topk_idx/topk_weights [T, K] on every rank -> the tokens each
//            local expert must process, in the backend's ActivationLayout (optionally FP8).
//   experts  : Experts::apply on that layout.
//   finalize (combine): expert outputs back to the source rank, weighted by topk_weights and
//            reduced in fp32, rounded once -> out [T, H] bf16. The Flat backends' per-rank partial
//            sums cross ranks in fp32 (DispatchConfig::flat_combine), and a separate shared expert
//            joins the same fp32 sum (FinalizeArgs::addend) before that one rounding.
// prepare and finalize are one object because finalize needs what prepare learnt (the handle:
// where each received row came from).
//
// Backends (registry in src/dispatch/registry.cpp):
//   naive                   all-gather tokens + routing to every rank; all-reduce; Flat
//   allgather_reducescatter all-gather(v) tokens; reduce-scatter(v) partial outputs; Flat
//   all2allv                rank-deduplicated all-to-all(v) both ways; Flat
//   ll                      low latency, static buffers, expert-major [L, R*maxT, H] (DeepEP LL layout)
//   ht                      high throughput, rank-deduplicated flat [N_recv, H] + per-expert counts + handle
// Across nodes (Group::num_nodes() > 1) ll and ht run hierarchically (src/dispatch/hier/hier.h): a token
// crosses to each destination node once (grouped ncclSend/ncclRecv of fixed-size blocks), then the
// backend runs inside the node; Capabilities::hierarchical says so.
// Devices: a CPU group runs all five (the reference). An NCCL group (one process per GPU) runs naive,
// allgather_reducescatter and all2allv on tensors of its GPU, stream-ordered on DispatchArgs::stream /
// FinalizeArgs::stream, with the same layouts, bytes and stats as the CPU; each prepare and finalize
// waits on the host once (the sizes of the collectives that follow depend on every rank's counts),
// so they are not graph-safe, unless DispatchConfig::use_worst_case_sizing gives them their padded
// form: fixed blocks of num_max_dispatch_tokens_per_rank rows per rank, the counts on the device, no
// host wait, graph-safe (see that field). ht on CUDA (src/dispatch/ht/ht_cuda.h) moves rows with its own kernels over
// NCCL symmetric memory: one host read of N_recv per prepare, none with use_worst_case_sizing
// (graph-safe; with DispatchArgs::num_tokens one graph serves every T). ll on CUDA (src/dispatch/ll/ll_cuda.h) runs its own kernels over NCCL symmetric memory:
// no host sync, graph-safe, the token count optionally on the device (DispatchArgs::num_tokens).
//
// Expert placement: global expert e lives on rank expert_rank(e); E experts are split into R
// contiguous ranges whose sizes differ by at most one (the first E % R ranks hold one more).
// FHMoE shared route: with DispatchConfig::shared_route, id E (== num_experts) means "the shared
// expert replica on the token's own rank"; it is local expert num_local_experts(rank) there.
// Heterogeneous routes (issue 6): topk_idx / topk_weights then have exactly top_k = K+1 columns,
// the K routed columns hold -1 or ids in [0, E) and the last column holds E (fused) or -1 (the
// shared expert runs separately). Anything else throws InvalidArgument naming topk_idx[t, k] (or
// the column count), on every rank, before anything moves; a CUDA backend that finds it on the
// device reports it as for any bad id (ll: that selection dropped, thrown by the next call). The
// shared column's weight is not checked: it is 1.0, or the shared gate g(t) where the model has one
// (Qwen2-MoE's sigmoid(x . shared_expert_gate)).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epx/experts.h"
#include "epx/group.h"
#include "epx/tensor.h"

namespace epx {

/// How the ll backend reduces in combine (DispatchConfig::ll_combine; JSON "ll.combine",
/// EPX_LL_COMBINE). Every mode accumulates in fp32 and is bit-identical between LlCpu and LlCuda.
enum class LlCombine : int32_t {
  /// Every (token, expert) row goes back to the source, which sums w * y over the topk columns in
  /// column order and rounds once: the no-EP reference's arithmetic (dispatch_harness.h), bit for bit.
  column = 0,
  /// Expert-side partial reduction (DeepEP-style): each rank sums, in fp32 and column order, w * y of
  /// its own experts for each received token and sends one fp32 row per (token, rank) back; the
  /// source adds the ranks' partials in rank order and rounds once. Fewer bytes (4H per token and
  /// holding rank instead of 2H per selection); a different summation order than `column`.
  partial_fp32 = 1,
  /// As partial_fp32, but the partial is rounded to bf16 before it is sent (half the bytes again);
  /// the source sums the bf16 partials in fp32 and rounds once more: two roundings.
  partial_bf16 = 2,
};
/// "column" | "partial_fp32" | "partial_bf16"; throws InvalidArgument naming `what` otherwise.
LlCombine parse_ll_combine(const std::string& text, const std::string& what);
const char* ll_combine_name(LlCombine mode);

/// How the Flat-layout backends (naive, allgather_reducescatter, all2allv, ht) carry each rank's
/// weighted partial sum across ranks in combine (DispatchConfig::flat_combine).
enum class FlatCombine : int32_t {
  /// The partial stays fp32 (Experts::apply writes the Flat rows as fp32, expert_out fp32): the
  /// reduce-scatter / all-reduce / reverse all-to-all moves fp32 rows, the source sums the ranks'
  /// partials in rank order, then FinalizeArgs::addend, in fp32, and rounds once. 4H bytes per row.
  partial_fp32 = 0,
  /// The partial is rounded to bf16 by the experts (expert_out bf16) before it crosses ranks; the
  /// source sums the bf16 partials in fp32 and rounds once more: two roundings. 2H bytes per row.
  partial_bf16 = 1,
};
/// "partial_fp32" | "partial_bf16"; throws InvalidArgument naming `what` otherwise.
FlatCombine parse_flat_combine(const std::string& text, const std::string& what);
const char* flat_combine_name(FlatCombine mode);

struct DispatchConfig {
  int64_t hidden = 0;                         ///< H; multiple of 8 (bf16) and of 128 for fp8 dispatch
  int num_experts = 0;                        ///< E (routed experts, global)
  int top_k = 0;                              ///< K = columns of topk_idx (incl. the shared route column, last)
  int num_max_dispatch_tokens_per_rank = 0;   ///< capacity T_max per rank per call; all ranks agree
  DType dispatch_dtype = DType::bf16;         ///< bf16 or fp8_e4m3 (1x128 fp32 scales fused in dispatch)
  bool use_ue8m0 = false;                     ///< fp8: power-of-two scales
  bool shared_route = false;                  ///< FHMoE: id E routes to the source rank's shared replica
  int expert_alignment = 1;                   ///< ht: per-expert counts rounded up to this
  /// ht on CUDA: graph-safe "worst-case" sizing (DeepEP num_worst_tokens): prepare never waits on the
  /// host; every Flat output has R * num_max_dispatch_tokens_per_rank rows, N_recv stays on the device
  /// (PrepareResult::num_recv_tokens_device), rows beyond it have topk_idx -1 (no expert work), and
  /// finalize takes expert_out with that many rows. Off: one host read of N_recv per prepare.
  ///
  /// naive, allgather_reducescatter, all2allv (CPU and CUDA): the padded form. With C =
  /// num_max_dispatch_tokens_per_rank (>= 1, else create throws InvalidArgument), every source rank's
  /// block has C rows: the Flat outputs have N = R * C rows (0 on a rank without a local expert), row
  /// s * C + i the i-th row from source rank s (its i-th token for naive / agrs, its i-th
  /// rank-deduplicated row to this rank for all2allv) while i < that source's count, the rest padding
  /// (x 0, x_scales 0, topk_idx -1, topk_weights 0: no expert work); num_recv_tokens = N; dtypes as
  /// without it (x bf16 | fp8_e4m3, topk_idx int32, weights fp32, recv_count [L] int32 of the real
  /// rows). finalize takes expert_out [N, H] (fp32 | bf16 per flat_combine; padding rows are not read
  /// into any real token's sum) and writes out [x.shape[0], H] (rows past DispatchArgs::num_tokens
  /// undefined). On CUDA nothing waits on the host: each block carries the source's plan record (count,
  /// status, first bad id) in the same collective (prepare: one all_gather of R blocks, or one
  /// all-to-all of equal blocks for all2allv; finalize: one collective and the finish), so
  /// Capabilities::graph_safe is true and ModularMoE::capture_graph takes these backends. Errors: a
  /// rank whose host rejects its arguments (T > C, bad shapes or dtypes) throws InvalidArgument from
  /// prepare after sending its record; the peers' prepare then moves nothing (every row padding) and
  /// their finalize throws InvalidArgument naming that rank, after its launch; a bad topk_idx or
  /// DispatchArgs::num_tokens found on the device does the same on every rank (or take_device_error()
  /// after defer_device_errors()). The CPU form throws in prepare on every rank, as without it. Bytes
  /// (DispatchStats; on CUDA num_valid_selections and num_rank_dedup_rows are -1, device-only): every
  /// block goes whatever the routing: dispatch (R - 1) x block bytes (the record's 16-byte-aligned
  /// header + C rows of RowCodec::row_bytes); combine (R - 1) x C rows of H x (4 | 2) for agrs and
  /// all2allv, ring accounting 2 (R - 1) / R x R * C rows for naive. all2allv thus moves R * C rows per
  /// rank each way where the dynamic form moves only the rows each rank selects.
  bool use_worst_case_sizing = false;
  /// ht only: prepare also lays the received rows out expert-contiguous for a grouped GEMM
  /// (PrepareResult::contiguous; the Flat outputs stay as they are), and finalize then takes one
  /// unweighted output row per (received row, local expert) of that layout, weighting them itself
  /// when FinalizeArgs::topk_weights is given. Off: Flat only (Experts::apply weights the rows).
  /// A ModularMoE built with it runs its experts on that layout (ActivationLayout::Contiguous with the
  /// layout's [L + 1] offsets) and has finalize weight them; its experts must support Contiguous.
  bool expert_contiguous = false;
  /// ll only: the combine's reduction (LlCombine); sizes the ll buffer (ll_buffer_bytes). Default
  /// partial_fp32, chosen by measurement (bench/NOTES.md "LL fixed cost ... partial combine": ll-v3
  /// FP8 combine 31.1 us against 40.1 us for column, still fp32 with one rounding); `column` keeps the
  /// no-EP reference's summation order bit for bit.
  LlCombine ll_combine = LlCombine::partial_fp32;
  /// naive, allgather_reducescatter, all2allv, ht: the dtype each rank's partial sum crosses ranks
  /// in (FlatCombine); expert_out of finalize is fp32 for partial_fp32 (one rounding) and bf16 for
  /// partial_bf16 (two roundings). ll ignores it (ll_combine). ht with expert_contiguous: expert_out
  /// stays the experts' bf16 rows; the per-rank partials ht forms from them follow this field.
  FlatCombine flat_combine = FlatCombine::partial_fp32;
};

/// Experts [begin, end) held by `rank` out of E split over R (sizes differ by at most one).
struct ExpertRange { int begin = 0; int end = 0; int size() const { return end - begin; } };
ExpertRange expert_range(int num_experts, int num_ranks, int rank);
/// Rank holding routed expert e (0 <= e < E).
int expert_rank(int num_experts, int num_ranks, int expert);
/// Local experts on `rank`: its routed range, plus one when cfg.shared_route.
int num_local_experts(const DispatchConfig& cfg, int num_ranks, int rank);

struct DispatchArgs {
  TensorView x;             ///< [T, H] bf16, T <= num_max_dispatch_tokens_per_rank (T may be 0)
  TensorView topk_idx;      ///< [T, K] int32 or int64; -1 = no selection; duplicates add
  TensorView topk_weights;  ///< [T, K] fp32
  Stream stream{};
  /// Optional token count given on the device ([1] int32 on the group's GPU, 0 <= value <= x.shape[0]):
  /// only rows [0, value) of x / topk_* take part, so one CUDA graph captured with x [max_T, H] serves
  /// every T. Empty (default) = x.shape[0]. Read by ll and ht on CUDA (finalize then writes rows
  /// [0, value) of out only) and by naive / allgather_reducescatter / all2allv with
  /// use_worst_case_sizing (CPU: [1] int32 on the host; rows [0, value) of out are defined); every
  /// other backend throws InvalidArgument when it is set.
  TensorView num_tokens{};
};

/// ht with DispatchConfig::expert_contiguous: the received rows again, grouped by local expert, the
/// m-grouped contiguous layout of DeepGEMM / vLLM's DeepEP-HT path, and the map back for combine.
/// Received row n appears once per distinct local expert l it selects; expert l owns rows
/// [expert_offsets[l], expert_offsets[l + 1]) (recv_count[l] rows, aligned to expert_alignment): its
/// rows in received-row order, then zero padding rows (row_expert -1).
struct ExpertContiguousLayout {
  TensorView x;               ///< [M, H] bf16 | fp8_e4m3 (as PrepareResult::x)
  TensorView x_scales;        ///< fp8: [M, H/128] fp32 (0 in padding rows); else empty
  TensorView expert_offsets;  ///< [L + 1] int32: exclusive prefix sum of recv_count, offsets[L] = M
  TensorView row_expert;      ///< [M] int32 local expert of each row, -1 = padding (DeepGEMM m_indices)
  TensorView pair_row;        ///< [N_recv, K] int32 row of (n, topk_idx[n, k]) in x, -1 where topk_idx is -1 (duplicates share one)
  /// M = sum of recv_count. ht on CUDA with use_worst_case_sizing: the capacity
  /// R * num_max_dispatch_tokens_per_rank * min(K, L) + L * (expert_alignment - 1) (M itself is
  /// expert_offsets[L] on the device; rows beyond it have row_expert -1 and are not written).
  int64_t num_rows = 0;
  /// As the Experts interface takes it: ActivationLayout::Contiguous with the [L + 1] offsets.
  ExpertsInput experts_input() const {
    ExpertsInput in;
    in.layout = ActivationLayout::Contiguous;
    in.x = x;
    in.x_scales = x_scales;
    in.expert_offsets = expert_offsets;
    return in;
  }
};

struct PrepareResult {
  ActivationLayout layout = ActivationLayout::Flat;
  TensorView x;             ///< ExpertMajor [L, cap, H] / Flat [N_recv, H]; bf16 or fp8_e4m3
  TensorView x_scales;      ///< fp8: [.., H/128] fp32; else empty
  TensorView recv_count;    ///< [L] int32 tokens per local expert (ht: aligned to expert_alignment)
  TensorView topk_idx;      ///< Flat: [N_recv, K] int32 local expert index or -1
  TensorView topk_weights;  ///< Flat: [N_recv, K] fp32
  int64_t num_recv_tokens = 0;  ///< Flat: N_recv; ExpertMajor: sum of recv_count (-1 where only the device knows it: ll on CUDA)
  /// ht on CUDA: [1] int32 on the device, N_recv of this prepare, valid once the stream reaches it
  /// (with use_worst_case_sizing the host-side num_recv_tokens is the row capacity instead); else empty.
  TensorView num_recv_tokens_device;
  /// ht with DispatchConfig::expert_contiguous; else empty views.
  ExpertContiguousLayout contiguous;
  /// As the Experts interface takes it.
  ExpertsInput experts_input() const { return {layout, x, x_scales, recv_count, topk_idx, topk_weights}; }
};

struct FinalizeArgs {
  TensorView expert_out;  ///< as Experts::apply wrote it: ExpertMajor [L, cap, H] bf16 / Flat [N_recv, H] fp32
                          ///< (DispatchConfig::flat_combine partial_fp32) or bf16 (partial_bf16)
                          ///< (ht with expert_contiguous: [M, H] bf16, row i = expert row_expert[i] on contiguous.x[i], unweighted)
  TensorView out;         ///< [T, H] bf16 (T of the matching prepare), written
  Stream stream{};
  /// ht with expert_contiguous only (DeepEP's optional combine weights; vLLM's weight-and-reduce in
  /// finalize): [N_recv, K] fp32, usually PrepareResult::topk_weights. Given: received row n's partial
  /// is sum over k with pair_row[n, k] >= 0 of topk_weights[n, k] * expert_out[pair_row[n, k]]
  /// (weighted); empty: the same sum with weight 1 (unweighted: the weights were applied before the
  /// experts). fp32 from 0, product and sum rounded separately, k in order, kept fp32 (flat_combine
  /// partial_fp32) or rounded to bf16 (partial_bf16) per rank; the source then sums the ranks'
  /// partials as always. Every other backend and the Flat layout (whose rows Experts::apply already
  /// weighted) throw InvalidArgument when it is set.
  TensorView topk_weights{};
  /// Optional [T, H] fp32 on the group's device (backends with Capabilities::combine_addend): added to
  /// each token's fp32 sum after the ranks' partials, before the one rounding to bf16. ModularMoE
  /// passes g(t) * shared(x~[t]) of the separate shared expert here, so that path rounds once too.
  /// Backends without the capability throw InvalidArgument when it is set.
  TensorView addend{};
};

/// Byte accounting of the last prepare/finalize on this rank (ANCHORS.md).
struct DispatchStats {
  int64_t num_valid_selections = 0;   ///< valid (token, expert) pairs sent by this rank (deepep-ll)
  int64_t num_rank_dedup_rows = 0;    ///< rows sent after rank de-duplication, incl. to self (deepep-ht)
  int64_t remote_bytes_dispatch = 0;  ///< bytes this rank sent to other ranks in prepare
  int64_t remote_bytes_combine = 0;   ///< bytes this rank sent to other ranks in finalize
};

struct Capabilities {
  std::string name;
  ActivationLayout layout = ActivationLayout::Flat;
  bool graph_safe = false;          ///< no host sync / allocation inside prepare/finalize
  bool supports_fp8_dispatch = false;
  bool static_buffers = false;
  /// prepare hands every rank all ranks' tokens (Flat [sum_r T_r, H], source-rank order) and
  /// finalize sums the partial outputs over ranks (naive, allgather_reducescatter): a partial any
  /// rank adds to a gathered row reaches that row's source exactly once (the DP-sharded shared expert).
  bool gathers_all_tokens = false;
  /// ll / ht on a group that spans nodes (Group::num_nodes() > 1): the hierarchical path
  /// (src/dispatch/hier/hier.h: inter-node NCCL stage, then the backend inside each node). false on one
  /// node: the flat backend, the single-node fast path.
  bool hierarchical = false;
  /// finalize takes FinalizeArgs::addend (every backend on CPU and CUDA; the hierarchical ll / ht add it
  /// to the cross-node fp32 sum, whose node partials arrive rounded: src/dispatch/hier/hier.h).
  bool combine_addend = false;
};

class PrepareFinalize {
 public:
  virtual ~PrepareFinalize() = default;
  virtual const Capabilities& capabilities() const = 0;
  virtual const DispatchConfig& config() const = 0;
  /// nullopt when prepare(args) can run; else one sentence why not (asked before any allocation).
  virtual std::optional<std::string> why_unsupported(const DispatchArgs& args) const = 0;
  /// Dispatch. Collective: every rank calls it, also with T = 0. Views in the result stay valid until
  /// the next prepare. Throws InvalidArgument (before any rank writes), Timeout, CommError.
  virtual PrepareResult prepare(const DispatchArgs& args) = 0;
  /// Combine for the last prepare. Collective. out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]), fp32, one rounding.
  /// Backends without host syncs (ll on CUDA, ht in worst-case mode, hierarchical ll / ht) may throw here, after
  /// this call's launch, the InvalidArgument of a bad argument that the device found in an earlier call, unless
  /// defer_device_errors() was called (then take_device_error() returns it).
  virtual void finalize(const FinalizeArgs& args) = 0;
  virtual const DispatchStats& stats() const = 0;
  /// A bad argument that a backend without host syncs found on the device in an earlier call and has not
  /// thrown yet (ll on CUDA, ht in worst-case mode, hierarchical ll / ht: a bad topk_idx or num_tokens, whose selection was dropped): its sentence, taken
  /// (this clears it, as the backend's own later throw would), or nullopt. Reads host-mapped memory, no sync: a report of a
  /// call still running on the device comes later. ModularMoE folds it into its per-call all-gather of T, so
  /// every rank stops, not only this one (the others' next dispatch would otherwise wait until timeout_s).
  virtual std::optional<std::string> take_device_error() { return std::nullopt; }
  /// Called once by a caller that takes those errors through take_device_error at a point every rank
  /// reaches together (ModularMoE: its per-call all-gather of T): prepare / finalize then leave them to
  /// it instead of throwing them themselves. Thrown there, they stop only the rank whose host saw the
  /// report first, at a call that depends on host timing, while its peers' kernels (or NCCL steps) wait
  /// for it until timeout_s. Also: each such error is then reported by one rank only (the one that
  /// found it). Timeouts and explicit checks (LlCuda::check) are unchanged. Default: nothing.
  virtual void defer_device_errors() {}
};

/// Creates backend `name` (see backend_names()) on `group`. Collective: checks that all ranks agree
/// on the DispatchConfig (CommError naming the field otherwise). Throws InvalidArgument for an
/// unknown name (listing the known ones) or a bad config, Unsupported for a backend/device pair
/// that does not exist.
std::unique_ptr<PrepareFinalize> make_prepare_finalize(const std::string& name, std::shared_ptr<Group> group,
                                                       const DispatchConfig& cfg);
struct Config;  // epx/config.h
/// The same, with the caller's Config for the launch settings of the CUDA kernels (ht on CUDA:
/// ht_num_sms, ht_warps_per_block, ht_chunk_rows, ht_pdl; ll on CUDA: ll_warps_per_block,
/// ll_num_blocks, ll_combine_wait) instead of a Config::load() inside the backend (which re-reads
/// EPX_CONFIG and the EPX_* variables); ModularMoE passes its own. Across nodes the hierarchical ll / ht
/// hands it to its node backend. Backends without such settings ignore it. A `config` field outside its
/// rule (a Config built in C++ bypasses Config::set's checks) throws InvalidArgument with
/// Config::validate()'s sentence on that rank, and on the others one naming that rank, before anything is
/// built (one all-gather of a flag).
std::unique_ptr<PrepareFinalize> make_prepare_finalize(const std::string& name, std::shared_ptr<Group> group,
                                                       const DispatchConfig& cfg, const Config& config);
/// naive, allgather_reducescatter, all2allv, ll, ht.
std::vector<std::string> backend_names();

}  // namespace epx
