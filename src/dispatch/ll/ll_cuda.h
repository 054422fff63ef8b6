// dispatch/ll/ll_cuda.h: the "ll" (low-latency) backend on CUDA: our own dispatch/combine kernels
// over NCCL symmetric memory (LSA peer pointers of Group::alloc_symmetric), DeepEP-LL compatible,
// bit-identical to the CPU reference LlCpu (ll.h) on the same inputs: the same packed expert-major
// layout [L, R*max_T, H], slot order (source rank, then source token), handle, bf16 payload, fp8
// codes and scales, and the combine's sums in the order of its LlCombine mode (column order, or the
// expert-side partials; fp32).
//
// Kernels (ll_cuda_kernels.cu): one per phase, B blocks (Config ll_num_blocks, 0 = one per SM) of
// 32 x ll_warps_per_block threads, all resident at once (checked at create).
//   dispatch send: every block computes the destination mask of every token and the slot of token t
//     at destination d (tokens before t going to d, a ballot scan), and ranks each token among its
//     own tokens per expert id (shared-memory bitmaps, one bit per (id, token)); warps take (token,
//     512-element chunk) items, quantize in registers (fp8) and store 16-byte vectors straight into
//     each destination's message slot (a token crosses NVLink once per destination rank), with the
//     token's rank per column. Block 0 stores, right after its slot scan and before any payload, the
//     per-(destination, local expert) counts and the message counts as tagged words (count_tag: every
//     call stores all of them, so a word of parity n % 2 holds zeros or call n - 2's value, whose
//     tag differs, so no flag is needed for them), and each message slot's source token t as a 64-bit
//     word tagged with the call's own number, (n + 1) << 32 | t (a slot carries a message only in
//     some calls, so its word can be many calls old; one more slot per call and destination is
//     rewritten round robin, so no word is more than 2 max_T calls old and the 32-bit tag cannot wrap onto it:
//     slot_token_word in ll_cuda_kernels.cu). Then each block's last warp stores n + 1 into the block's
//     own flag word at every destination (release order; one word per (source, block): no contended
//     remote atomics).
//   dispatch recv: the receiver polls the counts (normally there already), computes the slot bases
//     (slot = tokens of lower source ranks for that expert + the sender's rank), and all warps of the
//     grid take (message, run of chunks) items; each item waits only for the flags of the send blocks
//     that stored its chunk 0 and its run's chunks (source s's item t * nchunks + c runs on block
//     (item / W_s) mod B_s; W_s, B_s exchanged at create), loads the run once and stores it into each
//     of its local experts' slots: the expansion of a message starts when its blocks are done, not
//     after the slowest block of the grid, and the counts' round trip is off the critical path.
//   The fallback where the bitmaps do not fit in shared memory (large capacities with many experts;
//     every rank then takes it, same results): the expert expansion with block signals: the receiver
//     waits (acquire) until all B_s flags of every source reached n + 1, then block-per-local-expert:
//     which messages select it (ballots over 32 messages), an exclusive scan (slot order = source
//     rank, then source token), and all warps copy (slot, chunk) items into x.
//   combine send: (slot, chunk) items copy expert_out rows straight into the source's combine
//     region at (token, first column of that expert); signal as above.
//   combine recv: wait, then (token, chunk) items sum w * y over columns in column order in fp32
//     and round once to bf16.
//   Partial combine modes (DispatchConfig::ll_combine, LlCombine): the dispatch also carries the
//     weights, the expansion records per message its local rows (LlHandle::msg_*), the combine send
//     sums each message's local rows weighted in column order in fp32 and stores one partial row
//     (fp32, or bf16 rounded) per (token, rank) at the source, which adds them in rank order (fp32,
//     one more rounding). Bit-identical to LlCpu in the same mode. fp32 rows go out as whole 128-byte
//     lines per warp instruction (two lanes' halves exchanged by shuffles; bench/NOTES.md, 'LL combine,
//     where the first ~6 us go').
//   ll.combine_wait = data (LlLaunch::combine_data; partial modes; every rank the same, the same
//     results): no combine flags. The receiver's partial-row regions hold a poison word
//     (kLlPoison = 0xffffffff, never a partial's word: the sender canonicalizes NaN) wherever no row
//     is pending; the sender stores its partial rows with volatile 16-byte stores (NaN made
//     canonical), the receiver's (token, run) items poll the rows themselves (volatile loads, every
//     32-bit word checked, each word single-copy atomic), reduce as soon as they are all there, and
//     store the poison back. So each token is reduced while other rows are still in flight, and no
//     release round trip or flag stands between the last row and the reduce. Reuse of a region:
//     at the start of each combine kernel with a send part, block 0 tells every peer how many
//     combine receives this rank has finished (word combine_flag(rank, 0) there, release), and a
//     sender's call n waits (usually already true) until the destination finished receive n - 2,
//     whose parity region call n overwrites. Both parities are poisoned at create.
//   Runs: the partial combine's send takes (message, run of up to 4 consecutive 256-element chunks)
//     items, each warp loading its message's routing, the source's count and the call number in one
//     round trip (no block-wide prefix), then every local row of the run at once; its receive takes
//     (token, run of 2 chunks); the dispatch expansion takes (message, run of 2 chunks). Runs are sized
//     so one round covers the grid (bench/NOTES.md, 'LL combine runs').
//
// Protocol: call n of each part (dispatch/combine, send/recv) is derived on the device from a
// per-object counter of finished blocks (n = counter / B), and flags are monotonic (n + 1 after
// call n); payload regions alternate by parity n % 2. So nothing is reset,
// the host passes no per-call values, and CUDA graphs (any number, on one object, replayed in any
// interleaving that keeps the per-rank call sequence the same on all ranks) stay consistent.
// Why parity is enough: a source's send of call n + 2 comes (stream order) after its receive of
// call n + 1, which waited for every peer's send of call n + 1, which each peer issued after its
// receive of call n: so no one still reads the parity-n region when it is overwritten.
//
// Rules for the caller (as with DeepEP's LL buffers): every rank makes the same sequence of calls
// (also with T = 0); calls on one object are ordered on one stream (or by the caller); between a
// *_send and its *_recv no other call is made on the object.
//
// Errors: arguments are checked on the host before anything is launched (InvalidArgument /
// Unsupported, on this rank only: there is no host collective in a call). A refused prepare launches
// nothing, so a peer's call then fails with Timeout naming this rank. A refused finalize (or
// finalize_send) still launches this rank's combine marked rejected: it reads, sends and writes no
// rows and releases its flags as (n + 1) | kLlFlagRejected, so every peer's combine ends at once,
// writes NaN into its out and reports it (below: InvalidArgument naming this rank, "refused its finalize
// arguments"), and every object stays usable. A refused finalize is that prepare's finalize: the next call
// is a prepare, not a retry (a retried finalize throws InvalidArgument "no prepare to finalize"). Not with ll.combine_wait = data (no flags: the peers time out) nor inside a
// graph capture. Device-side checks (a device num_tokens outside [0, x.shape[0]], a topk id outside
// [-1, max id]) cannot throw: the kernels send nothing for them (T = 0, id = -1) and write an error report
// into host-mapped memory. Such a report (and a peer's refusal) is thrown as InvalidArgument by check(),
// or by the first finalize / finalize_recv whose host sees it, after that call's combine is launched (so
// every rank's prepare / finalize pair completes; prepare never throws it: a throw before its launch
// would leave the peers' dispatch waiting for this rank), or taken by take_device_error (ModularMoE folds
// it into its next call's all-gather and defers it there: defer_device_errors). Every device wait is bounded by timeout_s (globaltimer); a timeout is
// reported the same way and the next call or check() throws Timeout naming the peer and the
// operation, and so does every later call (the call numbers of the ranks no longer agree).
// Never __trap().
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dispatch/ll/ll.h"
#include "dispatch/ll/ll_cuda_kernels.h"
#include "dispatch/prepare_finalize_base.h"

namespace epx::dispatch {

/// Launch shape and wait bound (Config ll_warps_per_block, ll_num_blocks, timeout_s).
struct LlLaunch {
  int warps_per_block = 16;   ///< 4..32 (Config's default)
  int num_blocks = 0;         ///< 0 = one per SM
  double timeout_s = 60.0;    ///< bound of every device-side wait on a peer
  /// The message expansion with chunk signals where its bitmaps fit in shared memory; false forces the
  /// fallback (expert expansion, block signals) that large capacities take (tests); every rank takes the
  /// fallback when one does (exchanged at create).
  bool expand_message = true;
  bool combine_data = false;   ///< Config ll.combine_wait = data (LlCommon::combine_data); every rank must agree
  /// Tests only (ll_cuda_test's stale-token regression test): LlCommon::debug_block0_delay_ns (>= 0) and
  /// debug_token_tag_mask; rank-local; the defaults leave the protocol as documented.
  long long debug_block0_delay_ns = 0;
  uint32_t debug_token_tag_mask = 0xffffffffu;
};

class LlCuda final : public PrepareFinalizeBase {
 public:
  /// Collective (alloc_symmetric, the exchange of every rank's block count). group: a CUDA group (NCCL or virtual ranks)
  /// whose ranks all share one LSA team (one NVLink domain). Throws InvalidArgument for
  /// num_max_dispatch_tokens_per_rank = 0, R > 32, top_k > 32, or a launch shape whose blocks
  /// cannot all be resident; Unsupported when a peer is not load/store accessible.
  LlCuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const LlLaunch& launch);
  ~LlCuda() override;

  /// Dispatch = prepare_send + prepare_recv in one kernel. args.num_tokens (optional, [1] int32 on
  /// the group's GPU) gives T on the device: rows [0, T) of x / topk_* are sent, T <= x.shape[0].
  /// PrepareResult::num_recv_tokens is -1 (the counts exist only on the device: recv_count), or 0
  /// on a rank without local experts. Graph-safe: no host sync, no allocation.
  PrepareResult prepare(const DispatchArgs& args) override;
  /// Combine = finalize_send + finalize_recv in one kernel. Writes rows [0, T) of out (T of the
  /// matching prepare, as the device knew it); rows beyond are not touched. Graph-safe.
  void finalize(const FinalizeArgs& args) override;
  std::optional<std::string> why_unsupported(const DispatchArgs& args) const override;

  /// The send half of prepare (DeepEP's return_recv_hook): launches the sends and returns; the
  /// result's views hold data only after prepare_recv (the hook) has run on the stream. Overlap
  /// other work between the two; make no other call on this object in between.
  PrepareResult prepare_send(const DispatchArgs& args);
  /// The receive hook of prepare_send: waits for every peer's messages and expands them, on `stream`.
  void prepare_recv(Stream stream);
  /// The send half of finalize; finalize_recv (the hook) waits and reduces into args.out.
  void finalize_send(const FinalizeArgs& args);
  void finalize_recv(Stream stream);

  /// Waits for the work queued on `stream`, then throws what a kernel reported (Timeout naming the
  /// peer and operation, InvalidArgument for a bad device-side num_tokens or topk id).
  void check(Stream stream);
  /// PrepareFinalize::take_device_error: the argument error a kernel reported (cleared), without a sync.
  std::optional<std::string> take_device_error() override;
  /// PrepareFinalize::defer_device_errors: finalize no longer throws a device-side argument error (check() does).
  void defer_device_errors() override { defer_errors_ = true; }

  /// Where each slot came from (the last prepare; device tensors).
  const LlHandle& handle() const { return handle_; }
  const LlLayout& layout() const { return layout_; }
  int num_blocks() const { return blocks_; }
  /// Diagnostics: the kernels' timeline of the last dispatch and combine (LlDeviceState::trace) as
  /// microseconds since each kernel's start: {flags stored, waits done, all done} x {dispatch,
  /// combine}, then the last block's start {dispatch, combine} (the launch spread), then the last
  /// block's end of waiting {dispatch, combine}. Synchronizes.
  std::vector<double> trace();
  /// Diagnostics: every stamp of LlDeviceState::trace (LlTraceSlot) as {name, us since the dispatch
  /// kernel's start (dispatch and host-dispatch slots) or the combine kernel's start}, for the slots
  /// stamped since create (others are left out). Synchronizes.
  std::vector<std::pair<std::string, double>> trace_named();
  /// Diagnostics: a one-thread kernel on `stream` that writes the globaltimer into trace slot `slot`
  /// (LlTraceSlot kTrHost*), to place the graph launches on the kernels' timeline.
  void stamp(int slot, Stream stream);
  /// Diagnostics: an empty kernel of the dispatch kernel's launch shape (blocks, threads, dynamic
  /// shared memory, register budget) on `stream`: the launch floor under the same timing.
  void launch_empty(Stream stream);
  int threads_per_block() const { return threads_; }

 private:
  /// Throws a reported timeout (always) or device-side argument error (when `argument_errors`: check(),
  /// and the end of finalize / finalize_recv after their launch, so every rank's call pair completes).
  void throw_reported(bool argument_errors);
  /// The end of finalize / finalize_recv: throw_reported(true) unless deferred (defer_device_errors).
  void throw_launched_errors();
  LlDispatchParams dispatch_params(const DispatchArgs& args, bool send, bool recv);
  PrepareResult result() const;
  void check_prepare_args(const DispatchArgs& args);
  /// The host checks of a finalize / finalize_send; a refused argument (InvalidArgument / Unsupported)
  /// still launches the combine marked rejected (launch_rejected_combine) before it is thrown.
  void check_finalize_args(const FinalizeArgs& args);
  void check_finalize_tensors(const FinalizeArgs& args);
  /// This rank's combine of the call with LlCombineParams::rejected (no rows read, sent or written; flags
  /// marked kLlFlagRejected): the peers' waits end and report LlErrorReport::peer_rejected. Not with
  /// ll.combine_wait = data (no flags) nor while `stream` captures a graph; never throws.
  void launch_rejected_combine(Stream stream);
  void set_partial(LlCombineParams& p) const;

  LlLayout layout_;
  LlLaunch launch_;
  int blocks_ = 0, threads_ = 0;
  SymmetricBuffer buffer_;
  LlCommon common_;
  Tensor state_;  ///< LlDeviceState
  LlErrorReport* report_host_ = nullptr;
  Tensor x_, x_scales_, recv_count_, first_col_, weights_, dest_mask_;
  LlHandle handle_;
  TensorView pending_out_;  ///< finalize_send -> finalize_recv
  TensorView pending_addend_;  ///< FinalizeArgs::addend of that finalize_send (empty: none)
  bool broken_ = false;     ///< after a timeout: every call throws
  bool defer_errors_ = false;  ///< defer_device_errors(): device argument errors only through take_device_error / check
  std::string broken_message_;
};

std::unique_ptr<PrepareFinalize> make_ll_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const LlLaunch& launch);

}  // namespace epx::dispatch
