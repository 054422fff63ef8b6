// tools/epx/moe_checkpoint.h: `epx moe --checkpoint DIR --layer N [--hidden FILE]`: the layer's
// shape, router and weights from a Hugging Face checkpoint (include/epx/checkpoint.h) instead of
// a preset with random weights, and hidden states from a file instead of random ones. The hooks
// below are what build_workload (moe_run.cpp) and the GPU path (moe_cuda_run.cpp) call; without
// --checkpoint / --hidden they return the preset and MoEWeights::random.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <vector>

#include "moe_run.h"

namespace epx::cli {

/// Registers --checkpoint, --layer and --hidden on `epx moe`.
void add_checkpoint_flags(CLI::App& moe, MoeOptions& options);
/// After parsing: --checkpoint excludes an explicit --preset and needs --layer; with it, --routing
/// defaults to router (the checkpoint's own). Throws InvalidArgument.
void finish_checkpoint_options(MoeOptions& options, const CLI::App& moe);

/// The layer's MoEConfig: preset(options.preset), or the checkpoint's layer (config.json).
MoEConfig workload_model(const MoeOptions& options);
/// The layer's weights with experts [expert_begin, expert_end) (end -1 = all): MoEWeights::random
/// from the seed, or loaded from the checkpoint (each rank reads only its experts). Prints the
/// loader's notes (what the checkpoint holds that the layer does not compute) once, on stderr.
std::shared_ptr<MoEWeights> workload_weights(const MoeOptions& options, const MoEConfig& model);
/// Adds experts `ids` still missing from `weights` (random from the seed, or from the checkpoint).
void add_workload_experts(const MoeOptions& options, MoEWeights& weights, const std::vector<int>& ids);

/// --hidden FILE[:TENSOR]: hidden states [N, H] (or [B, S, H], flattened) from a .npy file (<f4, or
/// <u2 holding bf16 bits) or a safetensors file (F32/F16/BF16; TENSOR, else its only tensor, else
/// "hidden_states"), rounded to bf16 and split over `num_ranks` ranks in order, as evenly as
/// possible (rank r gets rows [N*r/R, N*(r+1)/R)); every step feeds the same tokens. Empty
/// without --hidden. Throws InvalidArgument naming the file (missing, wrong dtype, H mismatch).
std::vector<Tensor> workload_hidden(const MoeOptions& options, int64_t hidden, int num_ranks);

}  // namespace epx::cli
