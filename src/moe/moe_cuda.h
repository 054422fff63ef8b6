// moe/moe_cuda.h: the device-side pieces of ModularMoE (modular_moe*.cpp) when its group is on CUDA:
// router logits through cuBLAS, the [T, K+1] routing with the shared-route column, and the
// separate shared expert's add. Each is the twin of a CPU loop in modular_moe*.cpp /
// reference_cpu.cpp and follows the same arithmetic; differences are fp32 summation order only
// (the GEMM, the shared gate's dot product). Free of CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "epx/tensor.h"

namespace epx::moe_cuda {

/// A cuBLAS handle bound to one device (created on first use, destroyed with the object).
class Blas {
 public:
  explicit Blas(int device);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  void* handle();  ///< cublasHandle_t
  int device() const { return device_; }
  /// The handle's own workspace (allocated on first use), so the GEMM never allocates (graph capture).
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  void* workspace();

 private:
  int device_ = 0;
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
};

/// logits [T, E] fp32 = x [T, H] bf16 . router_weight [E, H] fp32 ^T, fp32 accumulation (x
/// converted to fp32 into `x_f32` [>= T*H] fp32 scratch, then cublasSgemm with the default math
/// mode: no TF32), then + router_bias [E] fp32 (gpt-oss mlp.router.bias) in fp32 when it is given
/// (data non-null), as router_logits_cpu. All on the Blas device, contiguous; stream-ordered.
void router_logits(Blas& blas, const TensorView& router_weight, const TensorView& x, const TensorView& x_f32,
                   const TensorView& logits, Stream stream, const TensorView& router_bias = {});

struct RouteColumnsParams {
  TensorView topk_idx;      ///< [n, K] int32 or int64 (rows of the chunk), CUDA
  TensorView topk_weights;  ///< [n, K] fp32, CUDA
  TensorView x;             ///< [n, H] bf16: read only with a shared gate
  const float* shared_gate_weight = nullptr;  ///< [H] fp32 on the device, or null (g = 1)
  bool has_shared = false;  ///< append column K
  bool fused = false;       ///< column K = (num_experts, g) when fused, else (-1, 0)
  int num_experts = 0;
};
/// out_idx [n, K(+1)] of topk_idx's dtype (int32 or int64), out_weights [n, K(+1)] fp32 (contiguous),
/// and gate [n] fp32 (g per token, written when has_shared; may be empty otherwise). Stream-ordered.
/// The ids are copied, never narrowed: int64 ids stay int64, so the dispatch's device-side check sees
/// the caller's value (an id such as 2^32 + 3 is rejected there as itself, not read as expert 3).
void build_route_columns(const RouteColumnsParams& p, const TensorView& out_idx, const TensorView& out_weights,
                         const TensorView& gate, Stream stream);

/// The route of the separate shared expert as a one-expert Flat layout: idx [n, 1] int32 =
/// `local_expert` (0 for the one-expert shared layer; L-1 for the DP shard inside the routed
/// experts), weights [n, 1] fp32 = 1.
void fill_single_route(const TensorView& idx, const TensorView& weights, Stream stream, int local_expert = 0);

/// t [numel] int32 on the device = value everywhere (e.g. recv_count [1] = n of the separate shared
/// expert as a one-expert ExpertMajor layout). Stream-ordered, capturable.
void fill_i32(const TensorView& t, int32_t value, Stream stream);
/// t (contiguous, on the device) = zero bytes, stream-ordered, capturable.
void zero_async(const TensorView& t, Stream stream);

/// The counts of the local shared slot (ModularMoE, fhmoe.local_shared): counts [L] int32 =
/// recv_count [L] (the backend's, left as it is) with counts[L-1] = *num_rows when num_rows ([1]
/// int32, a graph's valid count) is given, else `rows`. Stream-ordered, capturable.
void local_shared_counts(const TensorView& recv_count, const TensorView& counts, int32_t rows, const TensorView& num_rows,
                         Stream stream);

/// dst = src (same dtype and element count, contiguous, on one device), stream-ordered, capturable.
void copy_async(const TensorView& dst, const TensorView& src, Stream stream);

/// CUDA events marking phase boundaries, `marks` per chunk (ModularMoEOptions::time_phases): the
/// events are created on first use and reused by later calls, so timing allocates nothing per call.
class PhaseEvents {
 public:
  PhaseEvents(int device, int marks) : device_(device), marks_(marks) {}
  ~PhaseEvents();
  PhaseEvents(const PhaseEvents&) = delete;
  PhaseEvents& operator=(const PhaseEvents&) = delete;
  void reset() { next_ = 0; }                 ///< a new call: forget the marks of the last
  void mark(Stream stream);                   ///< records the next event on `stream`
  /// [marks - 1] microseconds between consecutive marks, summed over the recorded chunks (waits for
  /// the last event). Returns the chunk count in `chunks`.
  std::vector<double> elapsed_us(int64_t& chunks);

 private:
  int device_, marks_;
  size_t next_ = 0;
  std::vector<void*> events_;
};

/// cudaStreamSynchronize(stream) on `device`. Throws CudaError.
void synchronize(Stream stream, int device);

/// One captured CUDA graph (cudaGraph_t + its instantiation), for the whole-layer capture of
/// ModularMoE. begin() starts stream capture in thread-local mode (other threads' CUDA calls are
/// not affected); end() stops it and instantiates; launch() replays. A failure inside the captured
/// region ends the capture before it throws, so the stream is usable afterwards.
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  /// Throws InvalidArgument for the legacy default stream (it cannot be captured), CudaError.
  void begin(Stream stream);
  /// Ends the capture begun on `stream` and instantiates it. Throws CudaError (e.g. an operation
  /// that is not capturable ran inside: an allocation, a host sync).
  void end(Stream stream);
  /// Abandons a capture in progress (after an exception inside it); no-op otherwise.
  void abort(Stream stream) noexcept;
  void launch(Stream stream);
  bool captured() const { return exec_ != nullptr; }

 private:
  void* graph_ = nullptr;  ///< cudaGraph_t
  void* exec_ = nullptr;   ///< cudaGraphExec_t
};

/// out [n, H] bf16 (in place) = round_bf16(out + gate[t] * shared_y[t]) with shared_y [n, H] bf16
/// (the expert output, already bf16-rounded) and gate [n] fp32: the CPU's add, element for element.
/// out fp32 (an fp32 partial, or a combine's addend): out += gate[t] * shared_y[t], unrounded.
/// num_rows: optional [1] int32 on the device (a graph's valid count): rows >= it are left alone.
void add_shared(const TensorView& out, const TensorView& shared_y, const TensorView& gate, Stream stream,
                const TensorView& num_rows = {});

}  // namespace epx::moe_cuda
