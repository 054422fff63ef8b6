// tools/epx/moe_cuda_run.h: `epx moe --device cuda`: the main job on GPUs, one process per GPU, or
// R virtual ranks on one GPU when the machine has fewer than R.
//
// The parent forks through the epx launcher (src/comm/launcher.h) before it touches CUDA. With R
// visible GPUs: R processes, each creating its NCCL group through a fresh file rendezvous (rank r on
// GPU r). With fewer: one process whose R threads are the ranks of make_virtual_cuda_groups on GPU 0
// (timings then measure one GPU's memory, not NVLink; the header and the JSON say so: ranks_per_gpu).
// Either way every rank runs the same body on its Group: it builds only its own experts'
// weights (MoEWeights::random over its expert range; the CUDA experts upload them), uploads its
// inputs and runs every backend for the warm-up and measured steps. Per step: a group barrier, then
// CUDA events around forward on the rank's stream; the step's latency is the slowest rank's.
// Validation: each rank copies back the first V rows of its output (V = --validate-tokens) and
// rank 0 gathers them; after the other ranks have finished, rank 0 builds the experts those rows
// select (add_random_experts), runs moe_reference_cpu on that subset and reports (table + JSON).
// A full-size reference over every token would take minutes of CPU time and tens of GB.
// A rank process that dies makes the launcher stop the others and exit non-zero naming it (virtual
// ranks share one process: a rank that throws aborts the others' collectives instead).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "epx/config.h"
#include "epx/group.h"
#include "moe_run.h"

namespace epx::cli {

/// Where the R ranks of a `--device cuda` run go, decided in the parent (which never initialises
/// CUDA): one process per GPU (rank r on GPU r, an NCCL group) when R GPUs are visible, else R
/// virtual ranks (make_virtual_cuda_groups): threads of one process on GPU 0.
struct CudaRanks {
  int ranks = 1;
  int gpus = 0;                ///< visible GPUs
  bool virtual_ranks = false;  ///< gpus < ranks
  /// Ranks sharing one GPU: R on virtual ranks, else 1 (JSON "ranks_per_gpu").
  int ranks_per_gpu() const { return virtual_ranks ? ranks : 1; }
  /// "1 x NVIDIA H200" on virtual ranks, "R x NVIDIA H200" otherwise (initialises CUDA: call it in a rank).
  std::string device_name() const;
  /// The loaded NCCL ("2.28.9") with one process per GPU; "" on virtual ranks (no NCCL: their
  /// collectives are copies on the GPU).
  std::string nccl_version() const;
};

/// The placement of R ranks on the visible GPUs. Throws InvalidArgument naming --ranks when no GPU is
/// visible, or when R > visible GPUs and R exceeds the virtual ranks' limit (64 on one GPU).
CudaRanks cuda_ranks_for(std::string_view op, int ranks);

/// Runs body(group) once per rank of `where` and returns the exit code: rank 0's return value once
/// the other ranks returned 0 (rank 0 reports after them), else the first failure's code. Each rank
/// has its GPU current (cudaSetDevice) when body starts. One process per GPU: comm::launch_ranks of
/// R processes, each with its NCCL group (make_nccl_group through the run's rendezvous). Virtual ranks:
/// launch_ranks of one process that makes the R groups and runs body on one thread per rank
/// (run_ranks: a rank that throws aborts the others' collectives). A rank's escaping exception is
/// printed as "epx: rank r: error: <what>" (exit 2 for InvalidArgument, else 1); a rank process that
/// dies is named on stderr ("epx: error: <op>: ..."). Bodies on virtual ranks are threads: each works
/// on its own cudaStreamNonBlocking stream and never waits for the whole device between multi-rank
/// work. Throws Unsupported in a CPU-only build.
int launch_cuda_ranks(std::string_view op, const CudaRanks& where, const Config& config, const std::string& tag,
                      const std::function<int(const std::shared_ptr<Group>& group)>& body);

/// Runs `backends` (names; "all" expanded by the caller) on R = options.ranks ranks (or the trace's
/// R): one process per GPU, or virtual ranks on GPU 0 when fewer than R GPUs are visible (CudaRanks).
/// Returns the exit code: 0 every backend passed (with "all": every backend that has a CUDA
/// implementation; the others are listed as unsupported), 1 a failure or a dead rank, 2 bad input.
/// Throws InvalidArgument before forking for bad flags, no visible GPU, or --debug-kill-rank on
/// virtual ranks (it kills a rank's process: it needs one process per rank); Unsupported in a CPU build.
int run_moe_cuda(const MoeOptions& options, const Config& config, const std::vector<std::string>& backends,
                 bool all_backends, const std::string& command);

/// "N x <GPU name>" for the first N visible GPUs, from a rank's process (initialises CUDA).
std::string gpu_device_name(int num_gpus);
/// "2.28.9" from the loaded NCCL (empty without CUDA).
std::string nccl_version_string();
/// `epx info`'s device section from CUDA runtime queries (initialises CUDA in this process): one
/// line per visible GPU (name, memory, compute capability, SMs, PCI bus id), then the peer matrix
/// (nvidia-smi topo style): per pair whether cudaDeviceCanAccessPeer holds, with native atomics
/// over the link (NVLink-class) or without (PCIe-class), and the driver's P2P performance rank.
/// Empty without CUDA or a visible GPU.
std::vector<std::string> gpu_topology_lines();

}  // namespace epx::cli
