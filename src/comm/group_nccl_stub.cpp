// comm/group_nccl_stub.cpp: stand-ins for the NCCL group in a CPU-only build (EPX_CUDA=OFF), so the
// public surface links everywhere and says why it cannot run.
#include "epx/error.h"
#include "epx/group.h"

namespace epx {

UniqueId UniqueId::create() {
  throw Unsupported("UniqueId.create: this build has no NCCL (configure with EPX_CUDA=ON)");
}

std::shared_ptr<Group> make_nccl_group(const UniqueId&, int, int, int, double) {
  throw Unsupported("group.create: backend = nccl: this build has no CUDA/NCCL (configure with EPX_CUDA=ON)");
}

std::vector<std::shared_ptr<Group>> make_virtual_cuda_groups(int, int, double, int) {
  throw Unsupported("make_virtual_cuda_groups: this build has no CUDA (configure with EPX_CUDA=ON)");
}

}  // namespace epx
