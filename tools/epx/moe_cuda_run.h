// tools/epx/moe_cuda_run.h: `epx moe --device cuda`: the main job on GPUs, one process per GPU.
//
// The parent forks R ranks through the epx launcher (src/comm/launcher.h) before it touches CUDA;
// each rank creates its NCCL group through a fresh file rendezvous, builds only its own experts'
// weights (MoEWeights::random over its expert range; the CUDA experts upload them), uploads its
// inputs and runs every backend for the warm-up and measured steps. Per step: a group barrier, then
// CUDA events around forward on the rank's stream; the step's latency is the slowest rank's.
// Validation: each rank copies back the first V rows of its output (V = --validate-tokens) and
// rank 0 gathers them; after the other ranks have finished, rank 0 builds the experts those rows
// select (add_random_experts), runs moe_reference_cpu on that subset and reports (table + JSON).
// A full-size reference over every token would take minutes of CPU time and tens of GB.
// A rank that dies makes the launcher stop the others and exit non-zero naming it.
#pragma once

#include <string>
#include <vector>

#include "epx/config.h"
#include "moe_run.h"

namespace epx::cli {

/// Runs `backends` (names; "all" expanded by the caller) on R = options.ranks GPUs (or the trace's
/// R). Returns the exit code: 0 every backend passed (with "all": every backend that has a CUDA
/// implementation; the others are listed as unsupported), 1 a failure or a dead rank, 2 bad input.
/// Throws InvalidArgument before forking for bad flags or too few GPUs; Unsupported in a CPU build.
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
