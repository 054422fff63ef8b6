// comm/group_nccl.cpp: epx::Group over NCCL, one process per GPU (NCCL-DEVICE-API.md §1).
//
// The communicator is created non-blocking (ncclConfig_t::blocking = 0), so no NCCL call can block
// this thread forever: every call is followed by NcclState::wait, which polls
// ncclCommGetAsyncError until the call has left ncclInProgress, and aborts the communicator and
// throws Timeout after timeout_s (BEHAVIOUR.md: no unbounded spin). Host waits on GPU work
// (barrier, staged host buffers) poll a CUDA event under the same bound.
//
// Collectives are stream-ordered on the caller's stream. Host pointers (e.g. Group::all_gather_i64)
// are staged through stream-ordered device allocations and make the call synchronous.
//
// Teardown order (NCCL-DEVICE-API.md §1.5): buffers deregister their windows when their last owner
// copy goes (each holds the NcclState), then the device communicator, then the communicator.
#include "comm/group_nccl.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include "core/timeout.h"
#include "cuda/check.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/log.h"

namespace epx {
namespace comm {
namespace {

static_assert(sizeof(ncclUniqueId) == UniqueId::kBytes, "UniqueId must hold an ncclUniqueId");

using Clock = std::chrono::steady_clock;

std::string seconds_text(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

std::string where(std::source_location loc) {
  std::string f(loc.file_name());
  const auto pos = f.rfind("/src/");
  if (pos != std::string::npos) f = f.substr(pos + 1);
  return f + ":" + std::to_string(loc.line());
}

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::string hex16(uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = kDigits[v & 15];
  return s;
}

// Short pauses first (most waits end within microseconds), then 1 ms sleeps.
// Host waits on peers are latency-critical (the barrier, a backend's plan exchange): spin (yield)
// for the first ~10 ms, then sleep 50 us, and 1 ms only after about a second. A 1 ms sleep after
// 200 yields (~0.1 ms) added up to 1 ms to every host sync: epx bench measured a 1 MB all-to-all
// at p50 1.2 ms against p10 0.15 ms on 2 x H200, the barrier's exit skew.
void backoff(int64_t spins) {
  if (spins < 20000) std::this_thread::yield();
  else if (spins < 40000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  else std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

bool is_host_pointer(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return a.type == cudaMemoryTypeUnregistered || a.type == cudaMemoryTypeHost;
}

int64_t dtype_bytes(DType t) { return dtype_size(t); }

void check_reduce_dtype(std::string_view op, DType dtype) {
  require_arg(op, "dtype", dtype_name(dtype), dtype == DType::fp32 || dtype == DType::bf16, "must be fp32 or bf16");
}

void check_sizes(std::string_view op, std::string_view arg, const std::vector<int64_t>& v, int world) {
  require_arg(op, std::string(arg) + ".size", v.size(), static_cast<int>(v.size()) == world,
              "must equal the group size = " + std::to_string(world));
  for (size_t i = 0; i < v.size(); ++i)
    require_arg(op, std::string(arg) + "[" + std::to_string(i) + "]", v[i], v[i] >= 0, "must be >= 0");
}

std::vector<int64_t> prefix_offsets(const std::vector<int64_t>& sizes, int64_t scale = 1) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) off[i + 1] = off[i] + sizes[i] * scale;
  return off;
}

/// Device copies of host buffers for one collective call: in() copies a host input to the device,
/// out() gives a device buffer for a host output (reusing an in() copy of the same pointer, for
/// in-place calls); finish() copies outputs back and waits, bounded. Device pointers pass through.
class Staging {
 public:
  Staging(NcclState& state, cudaStream_t stream, std::string_view op) : state_(state), stream_(stream), op_(op) {}
  ~Staging() {
    for (auto& e : entries_) (void)cudaFreeAsync(e.dev, stream_);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  const void* in(const void* p, int64_t bytes) {
    if (bytes <= 0 || p == nullptr || !is_host_pointer(p)) return p;
    Entry& e = add(const_cast<void*>(p), bytes);
    EPX_CUDA_CHECK(cudaMemcpyAsync(e.dev, p, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_));
    return e.dev;
  }
  void* out(void* p, int64_t bytes) {
    if (bytes <= 0 || p == nullptr || !is_host_pointer(p)) return p;
    for (auto& e : entries_) {
      if (e.host == p && e.bytes >= bytes) {
        e.copy_back = true;
        return e.dev;
      }
    }
    Entry& e = add(p, bytes);
    e.copy_back = true;
    return e.dev;
  }
  void finish() {
    if (entries_.empty()) return;
    for (auto& e : entries_) {
      if (e.copy_back)
        EPX_CUDA_CHECK(cudaMemcpyAsync(e.host, e.dev, static_cast<size_t>(e.bytes), cudaMemcpyDeviceToHost, stream_));
      EPX_CUDA_CHECK(cudaFreeAsync(e.dev, stream_));
    }
    entries_.clear();
    state_.wait_stream(stream_, op_);
  }

 private:
  struct Entry {
    void* host = nullptr;
    void* dev = nullptr;
    int64_t bytes = 0;
    bool copy_back = false;
  };
  Entry& add(void* host, int64_t bytes) {
    Entry e;
    e.host = host;
    e.bytes = bytes;
    EPX_CUDA_CHECK(cudaMallocAsync(&e.dev, static_cast<size_t>(bytes), stream_));
    entries_.push_back(e);
    return entries_.back();
  }
  NcclState& state_;
  cudaStream_t stream_;
  std::string_view op_;
  std::vector<Entry> entries_;
};

/// A stream-ordered device allocation freed (stream-ordered) when it goes out of scope.
class StreamBuffer {
 public:
  StreamBuffer(int64_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) EPX_CUDA_CHECK(cudaMallocAsync(&p_, static_cast<size_t>(bytes), stream_));
  }
  ~StreamBuffer() {
    if (p_) (void)cudaFreeAsync(p_, stream_);
  }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  char* get() const { return static_cast<char*>(p_); }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

// ---- NcclState -------------------------------------------------------------------------------

void NcclState::require_alive(std::string_view op) const {
  if (aborted || comm == nullptr)
    throw CommError(std::string(op) + ": group " + name + " was aborted after an earlier failure on rank " +
                    std::to_string(rank) + ": create a new group");
}

void NcclState::abort() noexcept {
  if (node_comm != nullptr) {
    (void)ncclCommAbort(node_comm);
    node_comm = nullptr;
  }
  if (comm != nullptr) {
    (void)ncclCommAbort(comm);
    comm = nullptr;
  }
  aborted = true;
}

void NcclState::wait(ncclResult_t r, const char* statement, std::string_view op, std::source_location loc) {
  wait_on(comm, r, statement, op, loc);
}

void NcclState::wait_on(ncclComm_t c, ncclResult_t r, const char* statement, std::string_view op, std::source_location loc) {
  auto fail = [&](ncclResult_t code, bool broken) {
    std::string m = std::string(op) + ": " + statement + " failed on rank " + std::to_string(rank) + ": " +
                    ncclGetErrorString(code);
    const char* last = c ? ncclGetLastError(c) : nullptr;
    if (last && *last) m += std::string(" (") + last + ")";
    m += " at " + where(loc) + " on cuda:" + std::to_string(device);
    if (broken && c != nullptr && c == node_comm) {
      // Only the per-node communicator broke (e.g. its device communicator): the global one and
      // its host collectives stay usable; the group then has no device communicator.
      (void)ncclCommAbort(node_comm);
      node_comm = nullptr;
    } else if (broken) {
      abort();
    }
    throw CommError(m);
  };
  if (r != ncclSuccess && r != ncclInProgress) fail(r, false);
  if (c == nullptr) return;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t spins = 0;; ++spins) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(c, &state);
    if (q != ncclSuccess) fail(q, true);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) fail(state, true);
    if (Clock::now() > deadline) {
      abort();
      throw Timeout(std::string(op) + ": " + statement + " did not complete within timeout_s = " +
                    seconds_text(timeout_s) + " on rank " + std::to_string(rank) +
                    ": a peer rank is dead, late, or not making the same call");
    }
    backoff(spins);
  }
}

void NcclState::wait_stream(cudaStream_t s, std::string_view op) {
  cudaEvent_t ev = nullptr;
  EPX_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  struct EventFree {
    cudaEvent_t e;
    ~EventFree() { (void)cudaEventDestroy(e); }
  } free_event{ev};
  EPX_CUDA_CHECK(cudaEventRecord(ev, s));
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t spins = 0;; ++spins) {
    const cudaError_t q = cudaEventQuery(ev);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) EPX_CUDA_CHECK(q);
    if (comm != nullptr) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &state) == ncclSuccess && state != ncclSuccess && state != ncclInProgress) {
        const std::string reason = ncclGetErrorString(state);
        abort();
        throw CommError(std::string(op) + ": NCCL reported '" + reason + "' on rank " + std::to_string(rank) +
                        " while waiting: a peer rank failed");
      }
    }
    if (Clock::now() > deadline) {
      abort();
      throw Timeout(std::string(op) + ": no completion within timeout_s = " + seconds_text(timeout_s) + " on rank " +
                    std::to_string(rank) + ": a peer rank is dead or not calling " + std::string(op));
    }
    backoff(spins);
  }
}

NcclState::~NcclState() {
  if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
  if (comm != nullptr) {
    (void)cudaDeviceSynchronize();
    // Quiet, bounded version of wait(): a destructor reports instead of throwing.
    auto settle_on = [&](ncclComm_t c, ncclResult_t r, const char* what) {
      if (r != ncclSuccess && r != ncclInProgress) {
        log::warn(name + ": " + what + " failed: " + ncclGetErrorString(r));
        return false;
      }
      const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
      for (int64_t spins = 0;; ++spins) {
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(c, &state) != ncclSuccess) return false;
        if (state == ncclSuccess) return true;
        if (state != ncclInProgress || Clock::now() > deadline) {
          log::warn(name + ": " + what + " did not complete (" + ncclGetErrorString(state) + "); aborting");
          return false;
        }
        backoff(spins);
      }
    };
    auto settle = [&](ncclResult_t r, const char* what) { return settle_on(comm, r, what); };
    bool ok = true;
    if (has_dev_comm) ok = settle_on(lsa_comm(), ncclDevCommDestroy(lsa_comm(), &dev_comm), "ncclDevCommDestroy");
    if (ok && node_comm != nullptr) {
      ok = settle_on(node_comm, ncclCommFinalize(node_comm), "ncclCommFinalize (node)");
      if (ok) {
        (void)ncclCommDestroy(node_comm);
        node_comm = nullptr;
      }
    }
    if (ok) ok = settle(ncclCommFinalize(comm), "ncclCommFinalize");
    if (ok) {
      (void)ncclCommDestroy(comm);
      comm = nullptr;
    } else {
      abort();
    }
  }
  if (barrier_word) (void)cudaFree(barrier_word);
  if (stream) (void)cudaStreamDestroy(stream);
  (void)cudaGetLastError();
}

// ---- NcclGroup ---------------------------------------------------------------------------------

NcclGroup::NcclGroup(const UniqueId& uid, int rank, int world, int device, double timeout_s) {
  constexpr std::string_view op = "group.create";
  require_arg(op, "world", world, world >= 1, "must be >= 1");
  require_arg(op, "rank", rank, rank >= 0 && rank < world, "must be in [0, world = " + std::to_string(world) + ")");
  require_timeout(op, "timeout_s", timeout_s);
  cuda::ensure_runtime();
  int num_devices = 0;
  EPX_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
  require_arg(op, "device", device, device >= 0 && device < num_devices,
              "must be in [0, " + std::to_string(num_devices) + ") (visible CUDA devices)");
  cuda::set_device(device);

  state_ = std::make_shared<NcclState>();
  NcclState& st = *state_;
  st.rank = rank;
  st.world = world;
  st.device = device;
  st.timeout_s = timeout_s;
  st.name = "nccl-" + hex16(fnv1a(uid.bytes.data(), uid.bytes.size()));

  ncclUniqueId id;
  std::memcpy(&id, uid.bytes.data(), sizeof id);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  cfg.commName = st.name.c_str();
  st.wait(ncclCommInitRankConfig(&st.comm, world, id, rank, &cfg), "ncclCommInitRankConfig", op);

  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&st.stream, cudaStreamNonBlocking));
  EPX_CUDA_CHECK(cudaMalloc(&st.barrier_word, sizeof(int)));
  // On st.stream: ordered before the barrier's all-reduces there (a legacy-stream memset is not).
  EPX_CUDA_CHECK(cudaMemsetAsync(st.barrier_word, 0, sizeof(int), st.stream));

  // Node structure (NCCL-DEVICE-API.md §1.4). NCCL 2.28.9 brings GIN up for a device communicator
  // of a communicator that spans nodes, and our machines have none, so the device communicator and
  // the windows live on a per-node communicator when there are several nodes; host collectives stay
  // on the global one. The keys follow NCCL's rules; NCCL's LSA team size on the node communicator
  // then confirms them (st.layout.lsa_size).
  st.layout = NodeLayout::from_keys(all_gather_i64(node_key_from_env(rank)), rank);
  st.layout.lsa_size = 0;
  if (st.layout.num_nodes > 1) {
    ncclConfig_t node_cfg = NCCL_CONFIG_INITIALIZER;
    node_cfg.blocking = 0;
    const std::string node_name = st.name + "-node" + std::to_string(st.layout.node);
    node_cfg.commName = node_name.c_str();
    const ncclResult_t r = ncclCommSplit(st.comm, st.layout.node, rank, &st.node_comm, &node_cfg);
    st.wait(r, "ncclCommSplit (per node)", op);
    if (st.node_comm == nullptr)
      throw CommError(std::string(op) + ": ncclCommSplit (per node) gave no communicator on rank " + std::to_string(rank));
    st.wait_on(st.node_comm, ncclSuccess, "ncclCommSplit (per node)", op);
  }
  ncclDevCommRequirements reqs;
  std::memset(&reqs, 0, sizeof reqs);  // 2.28.9 has no initializer macro
  reqs.lsaBarrierCount = kNumLsaBarriers;
  try {
    st.wait_on(st.lsa_comm(), ncclDevCommCreate(st.lsa_comm(), &reqs, &st.dev_comm), "ncclDevCommCreate", op);
    st.has_dev_comm = true;
    st.lsa_rank = st.dev_comm.lsaRank;
    st.lsa_size = st.dev_comm.lsaSize;
    st.layout.lsa_size = st.dev_comm.lsaSize;
    if (st.lsa_size != st.layout.local_size)
      log::warn(st.name + ": NCCL's LSA team on node " + std::to_string(st.layout.node) + " has " + std::to_string(st.lsa_size) +
                " ranks, the node layout (" + st.layout.describe() + ") " + std::to_string(st.layout.local_size) +
                ": ranks outside the LSA team get no peer pointers");
  } catch (const CommError& e) {
    if (st.aborted) throw;  // the communicator itself broke
    st.dev_comm_unsupported = e.what();
    st.lsa_rank = 0;
    st.lsa_size = 1;
    log::warn(st.name + ": no device communicator (LL/HT kernels and symmetric memory unavailable): " + e.what());
  }
}

NcclGroup::~NcclGroup() = default;

const ncclDevComm& NcclGroup::dev_comm() const {
  if (!state_->has_dev_comm)
    throw Unsupported("group.dev_comm: " + state_->name + " has no device communicator: " + state_->dev_comm_unsupported);
  return state_->dev_comm;
}

ncclWindow_t NcclGroup::window(const SymmetricBuffer& buffer) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  const auto it = state_->windows.find(buffer.local);
  if (it == state_->windows.end())
    throw InvalidArgument(arg_message("group.window", "buffer.local", buffer.local,
                                      "is not a live buffer from alloc_symmetric of " + state_->name));
  return it->second;
}

void NcclGroup::lsa_barrier(Stream s) {
  state_->require_alive("group.lsa_barrier");
  cuda::set_device(state_->device);
  launch_lsa_barrier(dev_comm(), kGroupBarrierIndex, cuda::native(s));
}

void NcclGroup::barrier() {
  constexpr std::string_view op = "group.barrier";
  NcclState& st = *state_;
  st.require_alive(op);
  cuda::set_device(st.device);
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  st.wait(ncclAllReduce(st.barrier_word, st.barrier_word, 1, ncclInt32, ncclSum, st.comm, st.stream), "ncclAllReduce",
          op);
  st.wait_stream(st.stream, op);
}

void NcclGroup::all_gather(const void* send, void* recv, int64_t bytes_per_rank, Stream s) {
  constexpr std::string_view op = "group.all_gather";
  NcclState& st = *state_;
  st.require_alive(op);
  require_arg(op, "bytes_per_rank", bytes_per_rank, bytes_per_rank >= 0, "must be >= 0");
  if (bytes_per_rank == 0) return;
  cuda::set_device(st.device);
  const cudaStream_t stream = cuda::native(s);
  Staging stage(st, stream, op);
  const void* sd = stage.in(send, bytes_per_rank);
  void* rd = stage.out(recv, bytes_per_rank * st.world);
  st.wait(ncclAllGather(sd, rd, static_cast<size_t>(bytes_per_rank), ncclUint8, st.comm, stream), "ncclAllGather", op);
  stage.finish();
}

void NcclGroup::all_gatherv(const void* send, void* recv, const std::vector<int64_t>& recv_bytes, Stream s) {
  constexpr std::string_view op = "group.all_gatherv";
  NcclState& st = *state_;
  st.require_alive(op);
  check_sizes(op, "recv_bytes", recv_bytes, st.world);
  const auto off = prefix_offsets(recv_bytes);
  if (off.back() == 0) return;
  cuda::set_device(st.device);
  const cudaStream_t stream = cuda::native(s);
  const int me = st.rank;
  const int64_t mine = recv_bytes[static_cast<size_t>(me)];
  Staging stage(st, stream, op);
  const char* sd = static_cast<const char*>(stage.in(send, mine));
  char* rd = static_cast<char*>(stage.out(recv, off.back()));
  if (st.world > 1) {
    EPX_NCCL_CHECK(ncclGroupStart());
    ncclResult_t first = ncclSuccess;
    for (int p = 0; p < st.world; ++p) {
      if (p == me) continue;
      ncclResult_t r = ncclSuccess;
      if (mine > 0) r = ncclSend(sd, static_cast<size_t>(mine), ncclUint8, p, st.comm, stream);
      if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
      const int64_t theirs = recv_bytes[static_cast<size_t>(p)];
      if (theirs > 0) r = ncclRecv(rd + off[static_cast<size_t>(p)], static_cast<size_t>(theirs), ncclUint8, p, st.comm, stream);
      if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
    }
    const ncclResult_t end = ncclGroupEnd();
    st.wait(first != ncclSuccess ? first : end, "ncclSend/ncclRecv group", op);
  }
  if (mine > 0 && rd + off[static_cast<size_t>(me)] != sd)
    EPX_CUDA_CHECK(cudaMemcpyAsync(rd + off[static_cast<size_t>(me)], sd, static_cast<size_t>(mine), cudaMemcpyDeviceToDevice, stream));
  stage.finish();
}

void NcclGroup::all_reduce_sum(const void* send, void* recv, int64_t n, DType dtype, Stream s) {
  constexpr std::string_view op = "group.all_reduce_sum";
  NcclState& st = *state_;
  st.require_alive(op);
  check_reduce_dtype(op, dtype);
  require_arg(op, "n", n, n >= 0, "must be >= 0");
  if (n == 0) return;
  cuda::set_device(st.device);
  const cudaStream_t stream = cuda::native(s);
  const int64_t bytes = n * dtype_bytes(dtype);
  Staging stage(st, stream, op);
  const void* sd = stage.in(send, bytes);
  void* rd = stage.out(recv, bytes);
  if (dtype == DType::fp32) {
    st.wait(ncclAllReduce(sd, rd, static_cast<size_t>(n), ncclFloat32, ncclSum, st.comm, stream), "ncclAllReduce", op);
  } else {
    StreamBuffer gathered(bytes * st.world, stream);
    st.wait(ncclAllGather(sd, gathered.get(), static_cast<size_t>(bytes), ncclUint8, st.comm, stream), "ncclAllGather", op);
    launch_sum_ranks(gathered.get(), st.world, n, dtype, rd, stream);
  }
  stage.finish();
}

void NcclGroup::reduce_scatterv(const void* send, void* recv, const std::vector<int64_t>& counts, DType dtype, Stream s) {
  constexpr std::string_view op = "group.reduce_scatterv";
  NcclState& st = *state_;
  st.require_alive(op);
  check_reduce_dtype(op, dtype);
  check_sizes(op, "counts", counts, st.world);
  const int64_t es = dtype_bytes(dtype);
  const auto off = prefix_offsets(counts, es);  // byte offsets of each rank's block in send
  if (off.back() == 0) return;
  cuda::set_device(st.device);
  const cudaStream_t stream = cuda::native(s);
  const int me = st.rank;
  const int64_t mine = counts[static_cast<size_t>(me)] * es;
  Staging stage(st, stream, op);
  const char* sd = static_cast<const char*>(stage.in(send, off.back()));
  void* rd = stage.out(recv, mine);
  StreamBuffer blocks(mine * st.world, stream);  // [R, counts[me]]: rank r's block for me in row r
  if (st.world > 1) {
    EPX_NCCL_CHECK(ncclGroupStart());
    ncclResult_t first = ncclSuccess;
    for (int p = 0; p < st.world; ++p) {
      if (p == me) continue;
      ncclResult_t r = ncclSuccess;
      const int64_t theirs = counts[static_cast<size_t>(p)] * es;
      if (theirs > 0) r = ncclSend(sd + off[static_cast<size_t>(p)], static_cast<size_t>(theirs), ncclUint8, p, st.comm, stream);
      if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
      if (mine > 0) r = ncclRecv(blocks.get() + p * mine, static_cast<size_t>(mine), ncclUint8, p, st.comm, stream);
      if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
    }
    const ncclResult_t end = ncclGroupEnd();
    st.wait(first != ncclSuccess ? first : end, "ncclSend/ncclRecv group", op);
  }
  if (mine > 0) {
    EPX_CUDA_CHECK(cudaMemcpyAsync(blocks.get() + me * mine, sd + off[static_cast<size_t>(me)], static_cast<size_t>(mine),
                                   cudaMemcpyDeviceToDevice, stream));
    launch_sum_ranks(blocks.get(), st.world, counts[static_cast<size_t>(me)], dtype, rd, stream);
  }
  stage.finish();
}

void NcclGroup::all_to_allv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                            const std::vector<int64_t>& recv_bytes, Stream s) {
  constexpr std::string_view op = "group.all_to_allv";
  NcclState& st = *state_;
  st.require_alive(op);
  check_sizes(op, "send_bytes", send_bytes, st.world);
  check_sizes(op, "recv_bytes", recv_bytes, st.world);
  const int me = st.rank;
  require_arg(op, "send_bytes[rank]", send_bytes[static_cast<size_t>(me)],
              send_bytes[static_cast<size_t>(me)] == recv_bytes[static_cast<size_t>(me)],
              "must equal recv_bytes[rank] = " + std::to_string(recv_bytes[static_cast<size_t>(me)]) + " (the block a rank keeps)");
  const auto soff = prefix_offsets(send_bytes), roff = prefix_offsets(recv_bytes);
  cuda::set_device(st.device);
  const cudaStream_t stream = cuda::native(s);
  Staging stage(st, stream, op);
  const char* sd = static_cast<const char*>(stage.in(send, soff.back()));
  char* rd = static_cast<char*>(stage.out(recv, roff.back()));
  if (st.world > 1) {
    EPX_NCCL_CHECK(ncclGroupStart());
    ncclResult_t first = ncclSuccess;
    for (int p = 0; p < st.world; ++p) {
      if (p == me) continue;
      const size_t pi = static_cast<size_t>(p);
      ncclResult_t r = ncclSuccess;
      if (send_bytes[pi] > 0) r = ncclSend(sd + soff[pi], static_cast<size_t>(send_bytes[pi]), ncclUint8, p, st.comm, stream);
      if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
      if (recv_bytes[pi] > 0) r = ncclRecv(rd + roff[pi], static_cast<size_t>(recv_bytes[pi]), ncclUint8, p, st.comm, stream);
      if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
    }
    const ncclResult_t end = ncclGroupEnd();
    st.wait(first != ncclSuccess ? first : end, "ncclSend/ncclRecv group", op);
  }
  const size_t mi = static_cast<size_t>(me);
  if (send_bytes[mi] > 0 && rd + roff[mi] != sd + soff[mi])
    EPX_CUDA_CHECK(cudaMemcpyAsync(rd + roff[mi], sd + soff[mi], static_cast<size_t>(send_bytes[mi]), cudaMemcpyDeviceToDevice, stream));
  stage.finish();
}

SymmetricBuffer NcclGroup::alloc_symmetric(int64_t bytes) {
  constexpr std::string_view op = "group.alloc_symmetric";
  NcclState& st = *state_;
  st.require_alive(op);
  require_arg(op, "bytes", bytes, bytes >= 0, "must be >= 0");
  check_agreement(std::string(op), {{"bytes", bytes}});
  if (!st.has_dev_comm)
    throw Unsupported(std::string(op) + ": " + st.name + " has no symmetric memory: " + st.dev_comm_unsupported);
  cuda::set_device(st.device);
  // Windows start on 4 KiB boundaries (NCCL_WIN_REQUIRED_ALIGNMENT); ncclMemAlloc rounds the
  // allocation itself up to the VMM granularity (2 MiB on H200).
  const int64_t size = (std::max<int64_t>(bytes, 1) + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
                       NCCL_WIN_REQUIRED_ALIGNMENT;
  void* p = nullptr;
  EPX_NCCL_CHECK(ncclMemAlloc(&p, static_cast<size_t>(size)));
  struct MemGuard {
    void* p;
    ~MemGuard() {
      if (p) (void)ncclMemFree(p);
    }
  } mem_guard{p};
  // Zero before registering: registration is collective and ends in a barrier, so no peer can
  // write into this buffer before our memset has finished.
  EPX_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(size), st.stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(st.stream));
  ncclWindow_t win = nullptr;
  st.wait_on(st.lsa_comm(), ncclCommWindowRegister(st.lsa_comm(), p, static_cast<size_t>(size), &win, NCCL_WIN_DEFAULT),
             "ncclCommWindowRegister", op);
  if (win == nullptr)
    throw Unsupported(std::string(op) + ": NCCL returned no window on rank " + std::to_string(st.rank) +
                      " (symmetric memory needs CUDA P2P between the GPUs, cuMem and NCCL_WIN_ENABLE=1)");

  SymmetricBuffer buf;
  buf.local = p;
  buf.bytes = bytes;
  buf.peers.assign(static_cast<size_t>(st.world), nullptr);
  {
    StreamBuffer table(static_cast<int64_t>(sizeof(void*)) * st.lsa_size, st.stream);
    std::vector<void*> lsa(static_cast<size_t>(st.lsa_size), nullptr);
    launch_lsa_peer_pointers(win, st.lsa_size, reinterpret_cast<void**>(table.get()), st.stream);
    EPX_CUDA_CHECK(cudaMemcpyAsync(lsa.data(), table.get(), sizeof(void*) * lsa.size(), cudaMemcpyDeviceToHost, st.stream));
    st.wait_stream(st.stream, op);
    // LSA teams are contiguous ranks of the node communicator, whose ranks are the node's ranks in
    // group order (ncclCommSplit key = group rank).
    const std::vector<int> node_ranks = st.layout.ranks_of_node(st.layout.node);
    const int lsa_base = st.layout.local_rank - st.lsa_rank;
    for (int q = 0; q < st.lsa_size; ++q)
      buf.peers[static_cast<size_t>(node_ranks[static_cast<size_t>(lsa_base + q)])] = lsa[static_cast<size_t>(q)];
  }
  buf.peers[static_cast<size_t>(st.rank)] = p;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    st.windows[p] = win;
  }
  mem_guard.p = nullptr;
  std::shared_ptr<NcclState> keep = state_;
  buf.owner = std::shared_ptr<void>(p, [keep, win](void* q) {
    {
      std::lock_guard<std::mutex> lock(keep->mu);
      keep->windows.erase(q);
    }
    if (cudaSetDevice(keep->device) != cudaSuccess) (void)cudaGetLastError();
    if (keep->comm != nullptr && !keep->aborted) {
      (void)cudaDeviceSynchronize();  // local work on the buffer has finished
      const ncclResult_t r = ncclCommWindowDeregister(keep->lsa_comm(), win);
      if (r != ncclSuccess && r != ncclInProgress)
        log::warn(keep->name + ": ncclCommWindowDeregister failed: " + ncclGetErrorString(r));
      const auto deadline = Clock::now() + std::chrono::duration<double>(keep->timeout_s);
      for (int64_t spins = 0; r == ncclInProgress; ++spins) {
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(keep->lsa_comm(), &state) != ncclSuccess || state != ncclInProgress) break;
        if (Clock::now() > deadline) {
          log::warn(keep->name + ": ncclCommWindowDeregister did not complete within timeout_s");
          break;
        }
        backoff(spins);
      }
    }
    (void)ncclMemFree(q);
  });
  return buf;
}

}  // namespace comm

UniqueId UniqueId::create() {
  cuda::ensure_runtime();
  ncclUniqueId id;
  EPX_NCCL_CHECK(ncclGetUniqueId(&id));
  UniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof id);
  return out;
}

std::shared_ptr<Group> make_nccl_group(const UniqueId& uid, int rank, int world, int device, double timeout_s) {
  return std::make_shared<comm::NcclGroup>(uid, rank, world, device, timeout_s);
}

}  // namespace epx
