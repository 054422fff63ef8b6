// tools/epx/bench_run.h: `epx bench`, the dispatch/combine microbenchmark (STYLE.md §9).
//
// For each case (ANCHORS.md shapes), wire dtype and backend it times prepare (dispatch) and
// finalize (combine) separately, with the expert step replaced by the identity expert
// (src/experts/identity.h: one untimed pass over x), so only communication is measured:
//   per iteration: group barrier (device sync + all-reduce) and a one-float all-reduce on the
//   rank's stream (the GPUs then start together whatever the hosts' skew), then CUDA events around prepare and
//   around finalize on the rank's stream; an iteration's time is the slowest rank's; p10/p50/p90
//   over the iterations after the warm-up.
// In the same run it times NCCL's raw all-to-all of the same bytes (backend nccl_a2a_raw: grouped
// ncclSend/ncclRecv through Group::all_to_allv, equal blocks, as many rows as the routing's
// rank-deduplicated rows, at the dispatch row size; its combine moves bf16 rows).
// GB/s under the case's accounting (ANCHORS.md): deepep-ll for ll-*, valid selections x
// (H + H/128*4 + 16) bytes for an fp8 dispatch (2H for bf16) and x 2H for the combine; deepep-ht for
// ht-*, rank-deduplicated rows incl. self x (H + H/128*4 | 2H) for the dispatch and x 2H for the
// combine; per rank (mean over ranks) over the p50 latency.
// Validation, each run: the output of the last iteration (every rank's [T, H]) is compared with the
// same backend on CPU ranks (make_cpu_groups) on the same inputs; with --device cpu, with the
// identity formula out[t] = sum_k w[t,k] * round_bf16(x~[t]) instead.
// --device cuda: one process per GPU through the epx launcher; rank 0 validates and reports after
// the other ranks have finished. With fewer GPUs than ranks: R virtual ranks, threads of one process
// on GPU 0 (make_virtual_cuda_groups; launch_cuda_ranks in moe_cuda_run.h), the same body on each
// rank's group. The times then measure one GPU's memory, not NVLink: the header and the report say
// so, JSON "ranks_per_gpu" is R (1 with one process per GPU, null on CPU ranks), nccl_a2a_raw is the
// virtual group's all_to_allv (copies on the GPU; nccl_version null), no prediction is compared (they
// were written for NVLink), and --kernel-time is unavailable (one CUPTI timer per process; `on` is a
// bad flag).
// --graph (cuda): prepare and finalize of each graph-safe backend (ll) are captured in two CUDA graphs
// (separately; the identity expert step runs eagerly between them, untimed) and each timed
// iteration replays them, with CUDA events around each replay (after the alignment the GPU idles
// 200 us before the start event, so the host has queued the replay: its host launch cost is out); nccl_a2a_raw is captured the same
// way (eager if NCCL refuses the capture). Backends that are not graph-safe (a host sync per call)
// report "unsupported". ll also reports the latency at 1 token per rank (the fixed floor): the same
// graphs replayed with the device-side token count (DispatchArgs::num_tokens) set to 1, and the
// SMs its kernels use; rows get speedup_vs_nccl_a2a_raw (raw p50 / p50, same case, dtype, op).
// --kernel-time (cuda; default auto = on when the build has CUPTI, kernel_time.h): after the event rounds
// (so CUPTI's cost stays out of latency_us_*), `iters` more timed iterations with the CUPTI Activity API
// collecting kernel records (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, graph replays included), each call's
// kernels found by an external correlation id pushed around its host calls (or, for a kernel that NCCL's own
// thread launched, by the host time window of the call); every backend's kernel rounds align the ranks with
// a 1 ms delay kernel before the device-side all-reduce (CUPTI slows the host). Per rank and call: the sum of
// its kernels' GPU durations and first start -> last end; p50/p90/mean over the iterations on each rank,
// the largest over the ranks (DeepEP's test_low_latency prints, per rank, bench_kineto's per-call mean of its kernels'
// durations: the anchor's 28.9 / 39.9 us). JSON fields per row (null when not measured):
//   kernel_time            "cupti" | "off" | "unavailable: <reason>"
//   kernel_us_p50/p90/mean sum of the call's kernel durations, us (each rank's statistic, the largest)
//   kernel_us_p50_slowest_rank_per_iteration  p50 over the iterations of the slower rank's sum: it also holds
//                          the iterations where a rank's kernel waited for a peer that started late (in the
//                          CUPTI rounds one rank often does; bench/NOTES.md, 'kernel time (CUPTI)')
//   kernel_span_us_p50/p90 last kernel end - first kernel start of the call, us (as kernel_us)
//   kernel_us_p50_per_rank each rank's own p50 of kernel_us
//   kernel_gbps            the row's accounting (deepep-ll / deepep-ht) bytes per rank / kernel_us_p50
//   kernels                {short kernel name: kernels per call} (rank 0)
//   kernel_iterations      iterations of the CUPTI rounds; latency_us_p50_cupti_rounds: the CUDA-event p50
//                          of those same rounds (CUPTI's and the 1 ms alignment's effect on the event figure)
//   kernel_records_dropped records CUPTI dropped (all ranks)
// --padded (eager; not with --graph): naive, allgather_reducescatter and all2allv in their padded form
// (DispatchConfig::use_worst_case_sizing, C = T rows per rank's block: no host wait), each beside
// "nccl_raw:<backend>": the Group collectives that padded form makes, with the same bytes (dispatch: the
// all_gather of R blocks, or all2allv's all-to-all of equal blocks; combine: naive's all_gather (fp32
// partials) or all_reduce (bf16), allgather_reducescatter's reduce_scatter of C rows per rank,
// all2allv's reverse all-to-all), on buffers of zeros. The two alternate within every iteration (each
// after its own alignment; which goes first alternates), so both medians come from the same rounds.
// Every eager row also gets the host wall time of the timed calls themselves (prepare / finalize, or
// the raw collectives; what the host spends enqueueing, plus any wait inside the call). JSON fields:
//   form                   "padded" | "dynamic" (naive, allgather_reducescatter, all2allv), else null
//   host_enqueue_us_p50/p90  host wall time of the call, us (per iteration the slowest rank's); null for graph replays
//   ratio_to_nccl_raw      padded rows: p50 / the p50 of its nccl_raw:<backend> row (same case, dtype, op)
//   prepare_plus_finalize_ratio_to_nccl_raw  (dispatch p50 + combine p50) / the same sum of nccl_raw:<backend>
//   raw_calls              nccl_raw rows: the collective and its sizes
//   moved_bytes_per_rank   raw rows: the bytes each rank hands to the collective (its send buffer, incl. self)
//   remote_bytes_rank0     epx rows: rank 0's DispatchStats remote_bytes_dispatch / _combine of the last call
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/config.h"
#include "epx/dtype.h"
#include "epx/group.h"

namespace epx::cli {

struct BenchOptions {
  std::vector<std::string> cases{"ll-v3"};
  std::string backend = "all";      ///< a dispatch backend, nccl_a2a_raw, or all
  int ranks = 2;
  int iters = 100;
  int warmup = 10;
  std::string routing = "uniform";  ///< uniform | zipf
  double zipf_s = 1.2;
  std::string device = "auto";      ///< cpu | cuda (virtual ranks on GPU 0 when fewer than R GPUs) | auto (cuda when built with it and R GPUs are visible)
  int64_t tokens_per_rank = 0;      ///< 0: the case's (cuda) or min(case, 16) (cpu)
  std::string dtype;                ///< "" = the case's dtypes; else bf16 or fp8
  /// The Flat backends' DispatchConfig::flat_combine: partial_fp32 (one rounding; the identity
  /// experts write fp32 Flat rows) | partial_bf16 (two roundings; bf16 rows).
  std::string flat_combine = "partial_fp32";
  uint64_t seed = 1;
  std::string json;
  std::string config;
  std::string device_name_for_report;  ///< set by run_bench on CUDA ("2 x NVIDIA H200")
  int ranks_per_gpu_for_report = 0;    ///< set by run_bench on CUDA: 1, or R on virtual ranks (JSON "ranks_per_gpu")
  NodeLayout node_layout_for_report;   ///< set by run_bench: the group's node layout (JSON "node_layout")
  bool graph = false;               ///< --graph: time CUDA-graph replays (cuda only)
  std::string kernel_time = "auto"; ///< --kernel-time: auto (on with CUPTI on cuda) | on | off
  /// --padded: naive / allgather_reducescatter / all2allv in their padded form (use_worst_case_sizing),
  /// each with its nccl_raw:<backend> twin timed in the same iterations (eager only).
  bool padded = false;
};

/// A standard shape (ANCHORS.md "Standard shapes").
struct BenchCase {
  std::string name;
  int64_t tokens_per_rank = 0;
  int64_t hidden = 0;
  int top_k = 0;
  int num_experts = 0;
  std::vector<DType> dtypes;        ///< dispatch dtypes to run
  std::string accounting;           ///< deepep-ll | deepep-ht
};
/// ll-v3, ht-v3, ll-v4.
std::vector<BenchCase> bench_cases();

/// The prediction written before measuring (bench/NOTES.md): microseconds and its derivation, or
/// predicted_us < 0 when none was written for this (case, dtype, backend, op, ranks).
struct Prediction {
  double predicted_us = -1;
  std::string derivation;
};
Prediction predict(const std::string& case_name, DType dtype, const std::string& backend, const std::string& op, int ranks);

/// Runs the benchmark, prints the table and the repro line, writes --json. Returns the exit code:
/// 0 every epx backend that ran validated (unsupported ones are listed), 1 otherwise.
/// Throws InvalidArgument for bad flags.
int run_bench(const BenchOptions& options, const std::string& command);

}  // namespace epx::cli
