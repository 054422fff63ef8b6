// comm/group_virtual_cuda.cpp: virtual ranks (make_virtual_cuda_groups, epx/group.h): R ranks as
// threads of one process on one CUDA device.
//
// Every collective runs the two-phase protocol of comm/world.h on the host (descriptors, checks,
// timeouts naming the rank that never called), and between the phases each rank enqueues on its
// stream: a device barrier (group_virtual.h), its reads of the peers' buffers (cudaMemcpyAsync
// device to device; same device, so a peer's pointer is directly usable), a second device barrier.
// The first barrier orders every rank's earlier work before the reads, the second keeps a rank from
// reusing its send buffer while a peer still reads it. Sums gather the R blocks into a stream-ordered
// temporary and reduce them with launch_sum_ranks (fp32 in rank order, one rounding), as the NCCL
// group does. Nothing waits on the host for the device unless a pointer is host memory or the
// stream is the legacy default stream.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/group_nccl.h"
#include "comm/group_virtual.h"
#include "comm/world.h"
#include "core/timeout.h"
#include "cuda/check.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/group.h"

namespace epx {
namespace {

using comm::Posted;
using comm::World;

/// The world's device state: barrier flags and epochs, the abort word, the timeout record.
struct DeviceWorld {
  int device = 0;
  int num_ranks = 1;
  uint64_t* flags = nullptr;  // [R * R] then epoch [R] then the abort word, one allocation
  comm::VirtualTimeoutRecord* record_host = nullptr;
  comm::VirtualTimeoutRecord* record_dev = nullptr;

  DeviceWorld(int dev, int R) : device(dev), num_ranks(R) {
    cuda::DeviceGuard guard(dev);
    const size_t bytes = sizeof(uint64_t) * static_cast<size_t>(R * R + R + 1);
    EPX_CUDA_CHECK(cudaMalloc(&flags, bytes));
    EPX_CUDA_CHECK(cudaMemset(flags, 0, bytes));
    void* host = nullptr;
    EPX_CUDA_CHECK(cudaHostAlloc(&host, sizeof(comm::VirtualTimeoutRecord), cudaHostAllocMapped));
    record_host = new (host) comm::VirtualTimeoutRecord();
    void* dev_ptr = nullptr;
    EPX_CUDA_CHECK(cudaHostGetDevicePointer(&dev_ptr, host, 0));
    record_dev = static_cast<comm::VirtualTimeoutRecord*>(dev_ptr);
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    cuda::virtual_ranks_begin();
  }
  ~DeviceWorld() {
    cuda::virtual_ranks_end();
    cuda::DeviceGuard guard(device);
    (void)cudaDeviceSynchronize();
    if (flags) (void)cudaFree(flags);
    if (record_host) (void)cudaFreeHost(record_host);
  }
  DeviceWorld(const DeviceWorld&) = delete;
  DeviceWorld& operator=(const DeviceWorld&) = delete;

  comm::VirtualBarrierArgs barrier_args(int rank, double timeout_s) const {
    comm::VirtualBarrierArgs a;
    a.flags = flags;
    a.epoch = flags + static_cast<size_t>(num_ranks * num_ranks);
    a.aborted = reinterpret_cast<int*>(a.epoch + num_ranks);
    a.record = record_dev;
    a.rank = rank;
    a.num_ranks = num_ranks;
    a.timeout_ns = static_cast<long long>(timeout_s * 1e9);
    return a;
  }
};

bool is_device_memory(const void* p) {
  if (p == nullptr) return true;  // zero bytes: nothing is read or written
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

/// Stream-ordered device scratch (cudaMallocAsync / cudaFreeAsync on the stream: graph-capturable).
class Scratch {
 public:
  Scratch(int64_t bytes, cudaStream_t s) : s_(s) {
    if (bytes > 0) EPX_CUDA_CHECK(cudaMallocAsync(&p_, static_cast<size_t>(bytes), s));
  }
  ~Scratch() {
    if (p_) (void)cudaFreeAsync(p_, s_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  char* get() const { return static_cast<char*>(p_); }

 private:
  void* p_ = nullptr;
  cudaStream_t s_;
};

class VirtualCudaGroup final : public comm::ThreadWorldGroup {
 public:
  VirtualCudaGroup(std::shared_ptr<World> world, std::shared_ptr<DeviceWorld> dev, int rank, int ranks_per_node)
      : world_(std::move(world)), dev_(std::move(dev)), rank_(rank), ranks_per_node_(ranks_per_node) {
    cuda::DeviceGuard guard(dev_->device);
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&internal_, cudaStreamNonBlocking));
  }
  ~VirtualCudaGroup() override {
    cuda::DeviceGuard guard(dev_->device);
    (void)cudaStreamSynchronize(internal_);
    (void)cudaStreamDestroy(internal_);
  }

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  Device device() const override { return Device::cuda(dev_->device); }
  std::string name() const override { return world_->name(); }
  double timeout_s() const override { return world_->timeout_s(); }
  int ranks_per_gpu() const override { return world_->size(); }
  World& world() override { return *world_; }
  NodeLayout node_layout() const override { return comm::thread_node_layout(size(), ranks_per_node_, rank_); }

  /// Every rank's work issued on this device before the call has finished, and every rank called.
  void barrier() override {
    const char* op = "group.barrier";
    check_device_timeout(op);
    {
      cuda::DeviceGuard guard(dev_->device);
      EPX_CUDA_CHECK(cudaDeviceSynchronize());
    }
    check_device_timeout(op);
    // Between the phases no rank has work in flight (each synchronised the device before arriving)
    // and none launches any: rank 0 frees what the ranks' Tensors released since the last barrier.
    world_->collective(rank_, op, {}, [] {}, [&] {
      if (rank_ == 0) cuda::free_deferred();
    });
  }

  void all_gather(const void* send, void* recv, int64_t bytes_per_rank, Stream stream) override {
    const char* op = "group.all_gather";
    // Bad sizes are not thrown here but by the checks after the first phase, alike on every rank.
    Call c(*this, op, stream);
    const char* dsend = c.stage_in(send, bytes_per_rank);
    char* drecv = c.stage_out(recv, std::max<int64_t>(bytes_per_rank, 0) * size());
    Posted p;
    p.send = dsend;
    p.n = bytes_per_rank;
    c.run(p, [&] { world_->check_same_n(op, "bytes_per_rank"); },
          [&] {
            const int64_t n = world_->posted[0].n;
            for (int r = 0; r < size(); ++r) c.copy(drecv + r * n, world_->posted[static_cast<size_t>(r)].send, n);
          });
  }

  void all_gatherv(const void* send, void* recv, const std::vector<int64_t>& recv_bytes, Stream stream) override {
    const char* op = "group.all_gatherv";
    int64_t total = 0;
    for (int64_t b : recv_bytes) total += std::max<int64_t>(b, 0);
    const int64_t mine = static_cast<int>(recv_bytes.size()) > rank_ ? recv_bytes[static_cast<size_t>(rank_)] : 0;
    Call c(*this, op, stream);
    const char* dsend = c.stage_in(send, mine);
    char* drecv = c.stage_out(recv, total);
    Posted p;
    p.send = dsend;
    p.recv_sizes = &recv_bytes;
    c.run(p, [&] { world_->check_same_sizes(op, "recv_bytes"); },
          [&] {
            int64_t off = 0;
            for (int r = 0; r < size(); ++r) {
              const int64_t n = recv_bytes[static_cast<size_t>(r)];
              c.copy(drecv + off, world_->posted[static_cast<size_t>(r)].send, n);
              off += n;
            }
          });
  }

  void all_reduce_sum(const void* send, void* recv, int64_t n, DType dtype, Stream stream) override {
    const char* op = "group.all_reduce_sum";
    const int64_t es = dtype == DType::fp32 ? 4 : 2;
    Call c(*this, op, stream);
    const char* dsend = c.stage_in(send, n * es);
    char* drecv = c.stage_out(recv, std::max<int64_t>(n, 0) * es, /*in_place_of=*/send, dsend);
    Scratch blocks(std::max<int64_t>(n, 0) * es * size(), c.s);
    Posted p;
    p.send = dsend;
    p.n = n;
    p.dtype = dtype;
    c.run(
        p,
        [&] {
          world_->check_same_n(op, "n");
          world_->check_reduce_dtype(op);
        },
        [&] {
          for (int r = 0; r < size(); ++r) c.copy(blocks.get() + r * n * es, world_->posted[static_cast<size_t>(r)].send, n * es);
        },
        [&] {  // after the second barrier: no peer reads this rank's send any more, so recv may alias it
          if (n > 0) comm::launch_sum_ranks(blocks.get(), size(), n, dtype, drecv, c.s);
        });
  }

  void reduce_scatterv(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype, Stream stream) override {
    const char* op = "group.reduce_scatterv";
    const int64_t es = dtype == DType::fp32 ? 4 : 2;
    int64_t total = 0, off = 0;
    for (int r = 0; r < static_cast<int>(counts.size()); ++r) {
      const int64_t k = std::max<int64_t>(counts[static_cast<size_t>(r)], 0);
      if (r < rank_) off += k;
      total += k;
    }
    const int64_t mine = static_cast<int>(counts.size()) > rank_ ? std::max<int64_t>(counts[static_cast<size_t>(rank_)], 0) : 0;
    Call c(*this, op, stream);
    const char* dsend = c.stage_in(send, total * es);
    char* drecv = c.stage_out(recv, mine * es, send, dsend);
    Scratch blocks(mine * es * size(), c.s);
    Posted p;
    p.send = dsend;
    p.recv_sizes = &counts;
    p.dtype = dtype;
    c.run(
        p,
        [&] {
          world_->check_same_sizes(op, "counts");
          world_->check_reduce_dtype(op);
        },
        [&] {
          for (int r = 0; r < size(); ++r)
            c.copy(blocks.get() + r * mine * es, static_cast<const char*>(world_->posted[static_cast<size_t>(r)].send) + off * es, mine * es);
        },
        [&] {
          if (mine > 0) comm::launch_sum_ranks(blocks.get(), size(), mine, dtype, drecv, c.s);
        });
  }

  void all_to_allv(const void* send, const std::vector<int64_t>& send_bytes, void* recv, const std::vector<int64_t>& recv_bytes,
                   Stream stream) override {
    const char* op = "group.all_to_allv";
    int64_t sent = 0, got = 0;
    for (int64_t b : send_bytes) sent += std::max<int64_t>(b, 0);
    for (int64_t b : recv_bytes) got += std::max<int64_t>(b, 0);
    Call c(*this, op, stream);
    const char* dsend = c.stage_in(send, sent);
    char* drecv = c.stage_out(recv, got);
    Posted p;
    p.send = dsend;
    p.send_sizes = &send_bytes;
    p.recv_sizes = &recv_bytes;
    c.run(p, [&] { world_->check_all_to_allv(op); },
          [&] {
            int64_t out = 0;
            for (int s = 0; s < size(); ++s) {
              const Posted& q = world_->posted[static_cast<size_t>(s)];
              int64_t src_off = 0;
              for (int d = 0; d < rank_; ++d) src_off += (*q.send_sizes)[static_cast<size_t>(d)];
              const int64_t n = recv_bytes[static_cast<size_t>(s)];
              c.copy(drecv + out, static_cast<const char*>(q.send) + src_off, n);
              out += n;
            }
          });
  }

  SymmetricBuffer alloc_symmetric(int64_t bytes) override {
    const char* op = "group.alloc_symmetric";
    require_arg(op, "bytes", bytes, bytes >= 0, "must be >= 0");
    check_device_timeout(op);
    const int device = dev_->device;
    cuda::DeviceGuard guard(device);
    void* mem = nullptr;
    const size_t sz = static_cast<size_t>((std::max<int64_t>(bytes, 1) + 255) / 256 * 256);
    EPX_CUDA_CHECK(cudaMalloc(&mem, sz));
    // Freed like a Tensor (held back while virtual ranks are live: cudaFree waits for the device).
    std::shared_ptr<void> mine(mem, [device](void* q) { device_allocator(DeviceKind::cuda)->free(q, device); });
    EPX_CUDA_CHECK(cudaMemsetAsync(mem, 0, sz, internal_));
    EPX_CUDA_CHECK(cudaStreamSynchronize(internal_));
    return world_->share_symmetric(rank_, op, bytes, std::move(mine));
  }

 private:
  /// Throws Timeout (and aborts the world) once a device barrier of this world has timed out.
  void check_device_timeout(const std::string& op) {
    const volatile comm::VirtualTimeoutRecord* rec = dev_->record_host;
    if (!rec->done) return;
    const std::string msg = op + ": rank " + std::to_string(rec->peer) + " did not reach the device side of a collective within timeout_s = " +
                            comm::seconds_text(world_->timeout_s()) + " (rank " + std::to_string(rec->rank) +
                            " waited on its stream; group " + world_->name() + " is aborted)";
    world_->abort(msg);
    throw Timeout(msg);
  }

  /// Waits until `s` is idle, bounded by timeout_s (Timeout naming the operation).
  void wait_stream(cudaStream_t s, const std::string& op) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(world_->timeout_s());
    for (;;) {
      const cudaError_t e = cudaStreamQuery(s);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) EPX_CUDA_CHECK(e);
      check_device_timeout(op);
      if (std::chrono::steady_clock::now() > deadline) {
        const std::string msg = op + ": rank " + std::to_string(rank_) + "'s stream did not finish within timeout_s = " +
                                comm::seconds_text(world_->timeout_s());
        world_->abort(msg);
        throw Timeout(msg);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    check_device_timeout(op);
  }

  /// One collective call of this rank: the stream it runs on, host staging, the device barriers.
  struct Call {
    VirtualCudaGroup& g;
    const char* op;
    cudaStream_t s = nullptr;
    bool synchronous = false;  ///< the legacy default stream or host memory: wait before returning
    bool capturing = false;
    cuda::DeviceGuard guard;
    std::vector<std::unique_ptr<Scratch>> staged;
    void* host_recv = nullptr;
    const char* dev_recv = nullptr;
    int64_t recv_bytes = 0;

    Call(VirtualCudaGroup& group, const char* name, Stream stream) : g(group), op(name), guard(group.dev_->device) {
      g.check_device_timeout(op);
      s = cuda::native(stream);
      if (s == nullptr) {
        // The legacy default stream would serialise the ranks: run on this rank's own stream after
        // the caller's earlier default-stream work, and return when done.
        EPX_CUDA_CHECK(cudaStreamSynchronize(nullptr));
        s = g.internal_;
        synchronous = true;
      }
      cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
      EPX_CUDA_CHECK(cudaStreamIsCapturing(s, &st));
      capturing = st != cudaStreamCaptureStatusNone;
    }
    ~Call() = default;

    void need_sync(const char* what) {
      if (capturing)
        throw Unsupported(std::string(op) + ": " + what + " is host memory, which a CUDA graph cannot capture on virtual ranks: pass device memory");
      synchronous = true;
    }
    /// A device copy of `p` (host memory is staged through stream-ordered scratch).
    const char* stage_in(const void* p, int64_t bytes) {
      if (bytes <= 0 || is_device_memory(p)) return static_cast<const char*>(p);
      need_sync("send");
      staged.push_back(std::make_unique<Scratch>(bytes, s));
      EPX_CUDA_CHECK(cudaMemcpyAsync(staged.back()->get(), p, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, s));
      return staged.back()->get();
    }
    /// Where the device result goes: `p`, or scratch copied to `p` before return when `p` is host
    /// memory (then the scratch of `in_place_of`'s staging when p aliases the caller's send).
    char* stage_out(void* p, int64_t bytes, const void* in_place_of = nullptr, const char* staged_send = nullptr) {
      if (bytes <= 0 || is_device_memory(p)) return static_cast<char*>(p);
      need_sync("recv");
      host_recv = p;
      recv_bytes = bytes;
      if (in_place_of == p && staged_send) {
        dev_recv = staged_send;
      } else {
        staged.push_back(std::make_unique<Scratch>(bytes, s));
        dev_recv = staged.back()->get();
      }
      return const_cast<char*>(dev_recv);
    }
    void copy(char* dst, const void* src, int64_t bytes) {
      if (bytes > 0) EPX_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s));
    }
    void device_barrier() { comm::launch_virtual_barrier(g.dev_->barrier_args(g.rank_, g.world_->timeout_s()), s); }

    /// The two-phase collective with `reads` between two device barriers and `after` behind the second.
    void run(Posted p, const std::function<void()>& check, const std::function<void()>& reads,
             const std::function<void()>& after = {}) {
      g.world_->collective(g.rank_, op, p, check, [&] {
        device_barrier();
        reads();
        device_barrier();
      });
      if (after) after();
      if (host_recv) EPX_CUDA_CHECK(cudaMemcpyAsync(host_recv, dev_recv, static_cast<size_t>(recv_bytes), cudaMemcpyDeviceToHost, s));
      if (synchronous) {
        staged.clear();  // frees are stream-ordered behind the copies
        g.wait_stream(s, op);
      }
    }
  };

  std::shared_ptr<World> world_;
  std::shared_ptr<DeviceWorld> dev_;
  int rank_;
  int ranks_per_node_ = 0;
  cudaStream_t internal_ = nullptr;
};

/// True when the driver loads kernels lazily (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2).
/// Read through the runtime's driver entry point (no libcuda link); false where it cannot be read.
bool module_loading_is_lazy() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || fn == nullptr)
    return false;
  CUmoduleLoadingMode mode = CU_MODULE_EAGER_LOADING;
  if (reinterpret_cast<CUresult (*)(CUmoduleLoadingMode*)>(fn)(&mode) != CUDA_SUCCESS) return false;
  return mode == CU_MODULE_LAZY_LOADING;
}

}  // namespace

std::vector<std::shared_ptr<Group>> make_virtual_cuda_groups(int num_ranks, int device, double timeout_s, int ranks_per_node) {
  const char* op = "make_virtual_cuda_groups";
  require_arg(op, "num_ranks", num_ranks, num_ranks >= 1 && num_ranks <= comm::kMaxVirtualRanks,
              "must be in [1, " + std::to_string(comm::kMaxVirtualRanks) + "]");
  require_timeout(op, "timeout_s", timeout_s);
  require_arg(op, "ranks_per_node", ranks_per_node, ranks_per_node >= 0 && (ranks_per_node == 0 || num_ranks % ranks_per_node == 0),
              "must be 0 (one node) or >= 1 and divide num_ranks = " + std::to_string(num_ranks));
  cuda::ensure_runtime();
  int count = 0;
  EPX_CUDA_CHECK(cudaGetDeviceCount(&count));
  require_arg(op, "device", device, device >= 0 && device < count, "must be in [0, " + std::to_string(count) + ") (the visible CUDA devices)");
  cuda::set_device(device);
  // A lazily loaded kernel is loaded at its first launch, and loading may wait for the whole device
  // (CUDA Programming Guide, "Lazy Loading": possible hazards, concurrent execution). On virtual ranks
  // a peer's kernel spins on the GPU until this rank's kernel runs, so that first launch would wait
  // out the timeout. Eager loading (every kernel at context creation) has no such wait.
  if (num_ranks > 1 && module_loading_is_lazy())
    throw Unsupported(arg_message(op, "CUDA_MODULE_LOADING", "LAZY",
                                  "virtual ranks need eager kernel loading: set CUDA_MODULE_LOADING=EAGER in the environment before "
                                  "CUDA starts (a lazily loaded kernel's first launch waits for the device, where a peer rank's kernel "
                                  "waits for it); epx's CLI and tests set it themselves"));
  auto world = std::make_shared<World>(num_ranks, timeout_s, "virtual");
  auto dev = std::make_shared<DeviceWorld>(device, num_ranks);
  std::vector<std::shared_ptr<Group>> groups;
  groups.reserve(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) groups.push_back(std::make_shared<VirtualCudaGroup>(world, dev, r, ranks_per_node));
  return groups;
}

}  // namespace epx
