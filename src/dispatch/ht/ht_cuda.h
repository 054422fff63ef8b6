// dispatch/ht/ht_cuda.h: the "ht" (high-throughput) backend on a CUDA group (NCCL or virtual ranks): our own kernels over
// NCCL symmetric memory (LSA peer pointers, comm/group_nccl.h), the CUDA twin of HtCpu (ht.h).
//
// Same outputs as HtCpu on the same inputs: the Flat layout of dedup_cpu.h, rows ordered by source
// rank then source token; bf16 rows bit-exact, fp8 codes and 1x128 scales bit-exact (quantized
// once on the source, in the dispatch kernel, with the arithmetic of quant_cuda.cu); recv_count
// aligned to expert_alignment; combine = fp32 sum of the destinations' partial rows (fp32, or bf16
// with flat_combine partial_bf16) in destination-rank order from 0.0f, then FinalizeArgs::addend, one
// rounding (DedupCpu::finalize; partial_bf16 with an addend: the sum rounded, the addend added, rounded).
//
// One symmetric buffer per backend object (alloc_symmetric, sized at create for the worst case
// R * num_max_dispatch_tokens_per_rank received rows), carved by HtLayout:
//   slots     [2][R] per source: that source's row counts to every rank, its per-expert counts for
//             this rank and its argument status (the count exchange; LSA stores + a release flag),
//             two sets used by layout epoch parity
//   flags     [3][R] uint64 epochs: counts published, dispatch rows stored, combine done (the
//             source has finished reading its `back` block: its peers' next combine may overwrite it)
//   recv      x [R*cap, H] bf16|fp8, x_scales [R*cap, H/128] fp32, topk_idx [R*cap, K] int32 local
//             expert or -1, topk_weights [R*cap, K] fp32, src_idx [R*cap] int32: the dispatch output
//             itself (sources store straight into their final rows; no unpack pass)
//   back      [R*cap, H] fp32 (DispatchConfig::flat_combine partial_fp32) or bf16 (partial_bf16): partial
//             rows returned by destination d, block d at rows [d*cap, ...)
// Three kernels: (1) layout (prepare): one CTA scans the routing (the scan is skipped when topk_idx
// equals the cached layout's: DeepEP's cached handle), publishes the counts to every peer, waits for
// every peer's, and derives the rank prefix matrix, each source's block in each destination, N_recv and
// the aligned per-expert counts: no host collective; (2) dispatch (prepare): ht_num_sms CTAs of
// ht_warps_per_block warps, launched right behind the layout kernel with programmatic dependent
// launch (Config::ht_pdl; the layout triggers it at its start, the CTAs poll HtState::layout_ready,
// which the layout releases before its host-record writes, and the grid ends after the layout's),
// one warp per token, 16-byte peer stores of its row (fp8: quantized on the fly, in rounds of 28 groups
// when H allows) into every destination it goes to (local rows are local
// stores), the metadata (topk_idx, topk_weights, src_idx) by the whole grid in coalesced runs, then
// the last CTA publishes "rows stored" and waits for every peer's; (2b) with expert_contiguous, a map kernel (one CTA per
// local expert, a block scan over the received rows) and a copy kernel build the expert-contiguous
// layout; (3) combine (finalize): the same CTAs, every warp sends and reduces: items are (chunk of
// chunk_rows received rows, target rank), dealt to warps CTA-major; an item's send half stores those
// rows' partials into the target's `back` block and releases one flag per chunk there, its reduce
// half sums this rank's tokens whose rows went out in the matching chunk (the peer's same warp sends
// it), after all of the warp's sends; tokens
// whose rows stayed here are summed at the end, reading expert_out in place. With expert_contiguous
// the partials are formed from the per-pair outputs (weighted by FinalizeArgs::topk_weights or not)
// and this rank's own rows travel through `back` too.
// Reuse of `back` across finalizes: a combine's senders first wait (one poll per CTA) until every
// target has published "combine done" for the previous combine epoch (its last CTA, after all its
// reads of `back`). Without it two finalizes of one prepare (expert_contiguous: weighted, then
// unweighted; or any caller that finalizes twice) let a rank that has nothing to wait for overwrite
// its peer's `back` while the peer is still reducing the first one (bench/NOTES.md, "ht ordering bug").
// Epochs are monotonic counters in device memory, so no flag is ever reset and graph replays work.
//
// Token count on the device (DispatchArgs::num_tokens, [1] int32, 0 <= value <= x.shape[0]): the
// layout kernel reads it; only rows [0, value) of x / topk_* take part and finalize writes rows
// [0, value) of out (the rest untouched); the handle's [T, R] views keep T = x.shape[0] rows, of
// which rows >= value are stale. A value out of range is a bad argument (nothing moves; InvalidArgument
// on this call, or in worst-case mode from a later finalize, after its launch).
// Worst-case mode (DispatchConfig::use_worst_case_sizing) for CUDA graphs: prepare and finalize do
// no host sync and no allocation; PrepareResult views have R * num_max_dispatch_tokens_per_rank rows,
// N_recv is PrepareResult::num_recv_tokens_device ([1] int32, read it after the stream, or let the
// experts skip rows whose topk_idx is -1 everywhere), finalize takes expert_out with that many rows.
// Combine semantics = HtCpu: out[t] = sum of the destinations' partial rows; Flat: the experts applied
// topk_weights; expert_contiguous: the partials are weighted here when FinalizeArgs::topk_weights is
// given (ht.h).
// Measured speeds and the SM sweep: bench/NOTES.md "HT kernels".
//
// The combine's waits assume the grid (ht_num_sms CTAs <= SMs) is resident on every rank at once;
// a GPU kept busy by other kernels delays it, and at worst a wait expires (Timeout), it never hangs.
// Every device wait is bounded by the group's timeout_s (%globaltimer); a wait that expires writes
// {timeout, peer, op} to host-mapped memory and the kernel returns (no trap); the host throws
// epx::Timeout naming the peer on the same call (prepare, default mode) or on the next call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dispatch/placement.h"
#include "dispatch/prepare_finalize_base.h"
#include "epx/tensor.h"

namespace epx::dispatch {

/// Default rows per combine chunk flag (a reducing warp waits per chunk, not per row or per peer);
/// Config::ht_chunk_rows (EPX_HT_CHUNK_ROWS) chooses it.
constexpr int kHtChunkRows = 4;
/// Largest group ht supports on CUDA: the peer pointers travel in the kernel parameters.
constexpr int kHtMaxRanks = 8;

/// Byte offsets into the symmetric buffer (the same on every rank) and the local state buffer.
struct HtLayout {
  int num_ranks = 1, rank = 0, top_k = 1, max_local = 1;  ///< R, this rank, K, max over ranks of L
  int64_t hidden = 0, capacity = 0;                      ///< H, cap = num_max_dispatch_tokens_per_rank
  bool use_fp8 = false, use_ue8m0 = false;
  int64_t partial_bytes = 4;  ///< bytes per element of a partial row in `back`: 4 (flat_combine partial_fp32) or 2
  Placement placement;
  // symmetric buffer
  int64_t slot_bytes = 0, off_slots = 0, off_flags = 0, off_chunk_flags = 0, off_x = 0, off_scales = 0, off_idx = 0, off_weights = 0,
          off_src_idx = 0, off_back = 0, symmetric_bytes = 0;
  // slot fields (int32 words): [0, R) rows to each rank, R status, R + 1 valid flag, then [Lmax] counts
  static constexpr int kSlotStatus = 0;  ///< + R
  /// Slot of source s for layout epoch e: two sets by epoch parity. A peer's next layout (e + 1) may
  /// publish while this rank still reads epoch e's slots (after a rejected prepare no later handshake
  /// orders them); it cannot reach e + 2 before this rank has published e + 1, i.e. finished reading e.
  EPX_HOST_DEVICE int64_t slot_offset(uint64_t epoch, int s) const {
    return off_slots + (static_cast<int64_t>(epoch & 1) * num_ranks + s) * slot_bytes;
  }
  EPX_HOST_DEVICE int64_t rows() const { return num_ranks * capacity; }  ///< worst-case received rows
  EPX_HOST_DEVICE int64_t payload_bytes() const { return use_fp8 ? hidden : 2 * hidden; }
  EPX_HOST_DEVICE int64_t groups() const { return hidden / 128; }
  /// Flag word f (0 counts, 1 dispatch, 2 combine done) of source s, uint64 index into the flags region.
  EPX_HOST_DEVICE int64_t flag_index(int f, int s) const { return (static_cast<int64_t>(f) * num_ranks + s) * 8; }  // 64-byte stride
  /// Combine chunk flags per source: one per row (the chunk size is chosen at create, >= 1 row); flag of
  /// (source d, chunk c) at uint64 [d * chunks() + c].
  EPX_HOST_DEVICE int64_t chunks() const { return capacity; }
  static HtLayout make(const DispatchConfig& cfg, int num_ranks, int rank);
};

/// Written by the device into host-mapped memory, read by the host (volatile; the epoch last).
struct HtHostRecord {
  int32_t num_recv = 0;         ///< N_recv of the last completed layout
  int32_t any_bad = 0;          ///< 1: some rank's arguments were bad (nothing moved)
  int32_t bad_rank = -1;        ///< lowest such rank
  int32_t cache_hit = 0;        ///< the layout was the cached one
  int64_t bad_index = -1;       ///< this rank: first bad flat topk_idx index t*K+k, else -1
  int64_t valid_selections = 0, dedup_rows = 0, rows_to_self = 0, rows_from_others = 0;
  int64_t contig_rows = 0;      ///< sum of the aligned recv_count (rows of the expert-contiguous layout)
  int32_t bad_num_tokens = 0;   ///< this rank's device num_tokens was out of [0, x.shape[0]] (value below)
  int32_t bad_num_tokens_value = 0;
  int32_t error_code = 0;       ///< sticky: 1 = a device wait timed out
  int32_t error_peer = -1;      ///< the peer waited for
  int32_t error_op = 0;         ///< 0 layout (prepare), 1 dispatch (prepare), 2 combine (finalize)
  int32_t pad = 0;
  uint64_t layout_epoch = 0;    ///< epoch of the last completed layout kernel (written last)
  uint64_t bad_epoch = 0;       ///< epoch of the last layout whose arguments were bad (0: none yet); bad_rank,
                                ///< bad_index and bad_num_tokens* are that layout's and are kept until the next bad one
};

/// Device-local state (one allocation): epochs, the cached layout, the derived offsets.
struct HtState {
  uint64_t epoch_dispatch, epoch_combine;
  uint32_t ticket_dispatch, ticket_combine;
  int32_t cache_valid, cache_tokens;
  int32_t failed;                 ///< a wait timed out: later kernels move nothing
  int32_t any_bad;                ///< the current epoch's arguments were bad on some rank
  int32_t num_recv;               ///< N_recv
  int32_t num_tokens;             ///< T of the last prepare (DispatchArgs::num_tokens if given, else x.shape[0])
  int32_t valid_selections, dedup_rows;
  /// 0 while a layout kernel runs, 1 once it has derived everything the dispatch kernel reads (st.*
  /// offsets, epoch_dispatch, failed / any_bad): the dispatch kernel, launched early with programmatic
  /// dependent launch, polls it instead of waiting for the layout grid's end (the host-mapped record
  /// writes and their system fence come after it).
  int32_t layout_ready;
  int32_t pad0;
  int32_t rows_to[kHtMaxRanks];               ///< rows this rank sends to rank d
  int32_t dst_offset[kHtMaxRanks];            ///< first row of this rank's block in rank d's recv
  int32_t recv_offset[kHtMaxRanks + 1];       ///< rows [recv_offset[s], recv_offset[s+1]) came from s
  int32_t rank_prefix_matrix[kHtMaxRanks * kHtMaxRanks];  ///< [s, d]: rows d receives from ranks 0..s
  /// %globaltimer ns of the last prepare/finalize (diagnostics, HtTimeline order); reset by the layout kernel.
  unsigned long long timeline[16];
  // followed by (offsets in HtDeviceArrays)
};

/// HtState::timeline slots: layout start / end (offsets derived, before the host record), dispatch first
/// CTA start / last CTA arrival / handshake end, combine first CTA start / last sender warp done / last
/// CTA end; then the layout's steps (routing compared or planned, counts published to the peers, every
/// peer's counts seen, the host record written) and the first dispatch CTA past the layout_ready wait.
enum HtTimeline : int { kTlLayoutStart, kTlLayoutEnd, kTlDispatchStart, kTlDispatchArrive, kTlDispatchEnd, kTlCombineStart,
                        kTlCombineSent, kTlCombineEnd, kTlLayoutPlanned, kTlLayoutPublished, kTlLayoutCountsSeen,
                        kTlLayoutRecord, kTlDispatchReady, kTlCount };

/// Offsets of the arrays after HtState in the local state allocation.
struct HtDeviceArrays {
  int64_t expert_counts = 0;   ///< int32 [R, Lmax]: this rank's rows per (destination, local expert)
  int64_t recv_count = 0;      ///< int32 [Lmax]: aligned rows per local expert on this rank
  int64_t cached_idx = 0;      ///< int32 [cap, K]: the routing of the cached layout
  int64_t send_pos = 0;        ///< int32 [cap, R]: row of token t in its block on rank d, -1 if not sent
  int64_t send_tok = 0;        ///< int32 [R, cap]: the inverse, token of row j of this rank's block on rank d
  int64_t is_token_in_rank = 0;  ///< uint8 [cap, R]
  int64_t num_recv_device = 0; ///< int32 [1]: N_recv, for PrepareResult::num_recv_tokens_device
  int64_t bytes = 0;
  static HtDeviceArrays make(const HtLayout& l);
};

/// Parameters of every ht kernel (passed by value).
struct HtParams {
  HtLayout l;
  HtDeviceArrays a;
  uint8_t* state = nullptr;               ///< local state allocation (HtState + arrays)
  uint8_t* peers[kHtMaxRanks] = {};       ///< symmetric buffer of rank r, mapped here (peers[rank] = local)
  HtHostRecord* record = nullptr;         ///< device pointer of the host-mapped record
  uint64_t timeout_ns = 0;
  bool worst_case = false;
  // prepare
  const uint16_t* x = nullptr;            ///< [T, H] bf16 (row stride H)
  bool x_aligned16 = false;
  const void* topk_idx = nullptr;         ///< [T, K] int32 | int64
  bool idx_is_i64 = false;
  const float* topk_weights = nullptr;    ///< [T, K]
  int64_t num_tokens = 0;                 ///< T = x.shape[0] (rows of x; an upper bound with num_tokens_dev)
  const int32_t* num_tokens_dev = nullptr;  ///< DispatchArgs::num_tokens ([1] int32) or null
  int32_t local_status = 0;               ///< 0 ok, 2 the host rejected the arguments
  int expert_alignment = 1;
  int fp8_unroll = 4;                     ///< fp8 dispatch: steps of 4 groups a warp loads before quantizing (4 or 7)
  // finalize
  const uint16_t* expert_out = nullptr;   ///< [N_recv or R*cap, H] fp32 (partial_f32; as uint16 pairs) | bf16; contiguous: [rows, H] bf16
  bool partial_f32 = false;               ///< partials (Flat expert_out, `back`) are fp32 (flat_combine partial_fp32)
  const float* addend = nullptr;          ///< [T, H] fp32 (FinalizeArgs::addend), or null
  uint16_t* out = nullptr;                ///< [T, H] bf16
  bool io_aligned16 = false;              ///< expert_out, out and addend 16-byte aligned, H * element size a multiple of 16
  alignas(8) int chunk_rows = 4;          ///< rows per combine chunk flag, 1..capacity (8-aligned: the layout the kernels were verified with)
  const int32_t* pair_row = nullptr;      ///< expert-contiguous: [rows, K] contiguous row of pair (n, k) or -1; null = Flat
  const float* combine_weights = nullptr; ///< expert-contiguous: [rows, K] weights of the pairs, null = unweighted
  // expert-contiguous layout (prepare; DispatchConfig::expert_contiguous)
  uint8_t* contig_x = nullptr;            ///< [contig_cap, payload bytes]
  float* contig_scales = nullptr;         ///< fp8: [contig_cap, H/128]
  int32_t* contig_offsets = nullptr;      ///< [L + 1]
  int32_t* contig_row_expert = nullptr;   ///< [contig_cap]
  int32_t* contig_src = nullptr;          ///< [contig_cap] received row of each contiguous row, -1 padding
  int32_t* contig_pair_row = nullptr;     ///< [rows, K]
  int64_t contig_cap = 0;
  int num_local = 0;                      ///< L of this rank
};

/// One CTA of 1024 threads: the layout step and the count exchange (see the file comment).
void launch_ht_layout(const HtParams& p, Stream stream);
/// `blocks` CTAs of 32 * warps threads: the dispatch rows, then the "rows stored" handshake. pdl: launched
/// with programmatic dependent launch right behind the layout kernel (which triggers it at its start);
/// the CTAs wait for HtState::layout_ready, not for the layout grid's end.
void launch_ht_dispatch(const HtParams& p, int blocks, int warps, bool pdl, Stream stream);
/// Combine: one kernel; every warp stores partial rows into their sources' `back` blocks (a flag per
/// chunk of chunk_rows rows) and reduces tokens as their chunks arrive (see the file comment).
void launch_ht_combine(const HtParams& p, int blocks, int warps, Stream stream);

/// Expert-contiguous layout (after the dispatch kernel, same stream): max(L, 1) CTAs of 512 threads,
/// one per local expert, scan the received rows in order and place each row selecting that expert
/// (ht.h); then `blocks` CTAs copy the rows (and zero the padding rows).
void launch_ht_contiguous(const HtParams& p, int blocks, int warps, Stream stream);

/// The device-side handle of the last prepare (DeepEP's handle), views into backend-owned memory
/// valid until the next prepare. Compare with HtHandle (ht.h).
struct HtDeviceHandle {
  TensorView rank_prefix_matrix;          ///< [R, R] int32: rows rank d receives from ranks 0..s
  TensorView is_token_in_rank;            ///< [T, R] uint8
  TensorView send_pos;                    ///< [T, R] int32: row of token t in its block on rank d, -1
  TensorView recv_src_idx;                ///< [N_recv] int32 (worst case: [R*cap]) token index on the source
  TensorView num_recv_tokens_per_expert;  ///< [L] int32 aligned (= recv_count)
  int64_t layout_cache_hits = 0;          ///< prepares whose layout step was skipped (default mode)
};

/// The HT backend on CUDA. Created by make_ht_cuda (registry.cpp); the class is public for tests
/// and for callers that want the device handle.
class HtCuda final : public PrepareFinalizeBase {
 public:
  /// Launch settings (ht_num_sms, ht_warps_per_block, ht_chunk_rows, ht_pdl) from `config`;
  /// the two-argument form reads them with Config::load().
  HtCuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const Config& config);
  HtCuda(std::shared_ptr<Group> group, const DispatchConfig& cfg);
  ~HtCuda() override;
  PrepareResult prepare(const DispatchArgs& args) override;
  void finalize(const FinalizeArgs& args) override;
  const DispatchStats& stats() const override;
  const HtDeviceHandle& handle() const { return handle_; }
  int num_sms() const { return num_sms_; }
  int warps_per_block() const { return warps_; }
  /// The HtState::timeline of the last calls (kTlCount slots, HtTimeline order), in microseconds after the
  /// layout kernel's start (synchronizes the device; diagnostics for tuning, not for the hot path).
  std::vector<double> timeline_us() const;
  /// PrepareFinalize::take_device_error (worst-case mode): a bad topk_idx / num_tokens that the layout
  /// kernel found on this rank in an earlier prepare (which moved nothing), taken; other ranks' findings
  /// are cleared here and reported by the rank that found them.
  std::optional<std::string> take_device_error() override;
  /// PrepareFinalize::defer_device_errors: finalize no longer throws those (worst-case mode).
  void defer_device_errors() override { defer_errors_ = true; }

 private:
  void throw_sticky_error(const std::string& op);
  /// Worst-case mode: the bad-argument verdict of the last completed layout, not yet reported, as a
  /// message (marked reported); own_only: nullopt when only another rank's arguments were bad.
  std::optional<std::string> take_bad_layout(const std::string& op, bool own_only);
  void wait_layout(const std::string& op);

  HtLayout layout_;
  HtDeviceArrays arrays_;
  SymmetricBuffer symmetric_;
  Tensor state_;
  HtHostRecord* record_host_ = nullptr;
  HtHostRecord* record_dev_ = nullptr;
  uint64_t host_epoch_ = 0;
  uint64_t reported_bad_epoch_ = 0;
  double timeout_s_ = 60.0;
  int num_sms_ = 24, warps_ = 16;
  int chunk_rows_ = kHtChunkRows;
  bool pdl_ = true;
  int fp8_unroll_ = 4;
  // expert-contiguous layout (cfg_.expert_contiguous): buffers sized for contig_cap_ rows at create
  int64_t contig_cap_ = 0, contig_rows_ = 0;
  Tensor contig_x_, contig_scales_, contig_offsets_, contig_row_expert_, contig_src_, contig_pair_row_;
  bool dead_ = false;
  bool defer_errors_ = false;  ///< defer_device_errors()
  HtDeviceHandle handle_;
  int64_t num_recv_ = 0;
  int64_t cache_hits_ = 0;
  mutable DispatchStats stats_view_;
};

}  // namespace epx::dispatch
