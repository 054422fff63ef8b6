// experts/experts_cuda_stub.cpp: stand-in for the CUDA experts in a CPU-only build (EPX_CUDA=OFF),
// so the public surface links everywhere and says why it cannot run.
#include <string>
#include <utility>

#include "epx/error.h"
#include "epx/experts.h"

namespace epx {

std::unique_ptr<Experts> make_experts_cuda(std::vector<std::shared_ptr<const ExpertWeights>>, int device) {
  throw Unsupported("make_experts_cuda: device = cuda:" + std::to_string(device) +
                    ": this build has no CUDA (configure with EPX_CUDA=ON)");
}

std::unique_ptr<Experts> make_experts_cuda(std::vector<std::shared_ptr<const ExpertWeights>> local_experts, int device,
                                           const Config&) {
  return make_experts_cuda(std::move(local_experts), device);
}

}  // namespace epx
