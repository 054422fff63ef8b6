// moe/moe_cuda.cu: router logits (cuBLAS), the shared-route column and the shared expert's add for
// ModularMoE on CUDA; see moe_cuda.h.
#include <cublas_v2.h>

#include <string>

#include "cuda/check.h"
#include "epx/dtype.h"
#include "epx/error.h"
#include "moe/moe_cuda.h"

namespace epx::moe_cuda {
namespace {

constexpr std::string_view kOp = "ModularMoE(cuda)";

void check_blas(cublasStatus_t s, const char* statement, std::source_location loc = std::source_location::current()) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw CudaError(std::string(statement) + ": " + cublasGetStatusString(s) + " (cublasStatus " + std::to_string(s) + ")" +
                  detail::cuda_error_context(statement, loc));
}
#define EPX_CUBLAS_CHECK(expr) check_blas((expr), #expr)

__global__ void bf16_to_f32_kernel(const uint16_t* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = bf16_bits_to_float(x[i]);
}

/// logits[t, e] += bias[e] in fp32 (F.linear's bias: one IEEE add after the fp32 product sum, as router_logits_cpu).
__global__ void add_row_bias_kernel(float* __restrict__ logits, const float* __restrict__ bias, int64_t T, int64_t E) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T * E; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    logits[i] = __fadd_rn(logits[i], bias[i % E]);
}

constexpr int kColumnThreads = 256;

/// One block per token: copies the K routed columns (in their own dtype: the values are checked by
/// the dispatch, which must see them unchanged), computes g (sigmoid of the gate dot product, or 1)
/// and writes column K.
template <class Index>
__global__ void route_columns_kernel(const Index* __restrict__ idx_in, const float* __restrict__ w_in, int K,
                                     const uint16_t* __restrict__ x, int64_t H, const float* __restrict__ gate_w,
                                     bool has_shared, bool fused, int num_experts, Index* __restrict__ idx_out,
                                     float* __restrict__ w_out, float* __restrict__ gate_out) {
  const int64_t t = blockIdx.x;
  const int cols = K + (has_shared ? 1 : 0);
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    idx_out[t * cols + k] = idx_in[t * K + k];
    w_out[t * cols + k] = w_in[t * K + k];
  }
  if (!has_shared) return;
  float g = 1.0f;
  if (gate_w != nullptr) {
    __shared__ float partial[kColumnThreads];
    float dot = 0.0f;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dot += bf16_bits_to_float(x[t * H + h]) * gate_w[h];
    partial[threadIdx.x] = dot;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
      if (static_cast<int>(threadIdx.x) < s) partial[threadIdx.x] += partial[threadIdx.x + s];
      __syncthreads();
    }
    g = 1.0f / (1.0f + expf(-partial[0]));
  }
  if (threadIdx.x == 0) {
    idx_out[t * cols + K] = fused ? num_experts : -1;
    w_out[t * cols + K] = fused ? g : 0.0f;
    gate_out[t] = g;
  }
}

__global__ void single_route_kernel(int32_t* __restrict__ idx, float* __restrict__ w, int64_t n, int32_t expert) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    idx[i] = expert;
    w[i] = 1.0f;
  }
}

__global__ void fill_i32_kernel(int32_t* __restrict__ t, int64_t n, int32_t value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    t[i] = value;
}

__global__ void local_shared_counts_kernel(const int32_t* __restrict__ recv, int32_t* __restrict__ counts, int L, int32_t rows,
                                           const int32_t* __restrict__ num_rows) {
  for (int l = threadIdx.x; l < L; l += blockDim.x) counts[l] = l + 1 < L ? recv[l] : (num_rows != nullptr ? *num_rows : rows);
}

__global__ void add_shared_kernel(uint16_t* __restrict__ out, const uint16_t* __restrict__ y, const float* __restrict__ gate,
                                  int64_t H, int64_t n, const int32_t* __restrict__ num_rows) {
  if (num_rows != nullptr) n = min(n, static_cast<int64_t>(max(*num_rows, 0)) * H);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i / H];
    // Product and sum rounded separately, as on the CPU (no fused multiply-add).
    out[i] = float_to_bf16_bits(__fadd_rn(bf16_bits_to_float(out[i]), __fmul_rn(g, bf16_bits_to_float(y[i]))));
  }
}

/// fp32 out: out[i] += g * y[i], unrounded (an fp32 partial, or FinalizeArgs::addend from zeros).
__global__ void add_shared_f32_kernel(float* __restrict__ out, const uint16_t* __restrict__ y, const float* __restrict__ gate,
                                      int64_t H, int64_t n, const int32_t* __restrict__ num_rows) {
  if (num_rows != nullptr) n = min(n, static_cast<int64_t>(max(*num_rows, 0)) * H);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __fadd_rn(out[i], __fmul_rn(gate[i / H], bf16_bits_to_float(y[i])));
}

void require_cuda_contiguous(std::string_view arg, const TensorView& t, std::initializer_list<DType> dtypes) {
  require_arg(kOp, arg, t.device.str(), t.device.is_cuda(), "must be a CUDA tensor");
  check_dtype(kOp, arg, t, dtypes);
  check_contiguous(kOp, arg, t);
}

}  // namespace

Blas::Blas(int device) : device_(device) {}

Blas::~Blas() {
  if (workspace_) {
    int previous = -1;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(device_);
    (void)cudaFree(workspace_);
    if (previous >= 0) (void)cudaSetDevice(previous);
  }
  if (handle_) {
    int previous = -1;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(device_);
    (void)cublasDestroy(static_cast<cublasHandle_t>(handle_));
    if (previous >= 0) (void)cudaSetDevice(previous);
  }
}

void* Blas::handle() {
  if (!handle_) {
    cuda::DeviceGuard guard(device_);
    cublasHandle_t h = nullptr;
    EPX_CUBLAS_CHECK(cublasCreate(&h));
    handle_ = h;
    // Default math: fp32 FMA, no TF32 down-conversion (the CPU reference sums fp32 products).
    EPX_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  }
  return handle_;
}

void* Blas::workspace() {
  if (!workspace_) {
    cuda::DeviceGuard guard(device_);
    EPX_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  }
  return workspace_;
}

void router_logits(Blas& blas, const TensorView& router_weight, const TensorView& x, const TensorView& x_f32,
                   const TensorView& logits, Stream stream, const TensorView& router_bias) {
  require_cuda_contiguous("router_weight", router_weight, {DType::fp32});
  if (router_bias.data != nullptr) {
    require_cuda_contiguous("router_bias", router_bias, {DType::fp32});
    check_shape(kOp, "router_bias", router_bias, {router_weight.shape[0]});
  }
  require_cuda_contiguous("x", x, {DType::bf16});
  require_cuda_contiguous("x_f32", x_f32, {DType::fp32});
  require_cuda_contiguous("logits", logits, {DType::fp32});
  const int64_t T = x.shape[0], H = x.shape[1], E = router_weight.shape[0];
  check_shape(kOp, "router_weight", router_weight, {E, H});
  check_shape(kOp, "logits", logits, {T, E});
  require_arg(kOp, "x_f32.numel()", x_f32.numel(), x_f32.numel() >= T * H, "must be >= T * H = " + std::to_string(T * H));
  if (T == 0) return;
  cuda::DeviceGuard guard(blas.device());
  const cudaStream_t s = cuda::native(stream);
  bf16_to_f32_kernel<<<cuda::grid_for(T * H, 256, 4096), 256, 0, s>>>(x.ptr<const uint16_t>(), x_f32.ptr<float>(), T * H);
  cuda::check_launch("bf16_to_f32_kernel");
  auto h = static_cast<cublasHandle_t>(blas.handle());
  EPX_CUBLAS_CHECK(cublasSetStream(h, s));
  // cublasSetStream resets the workspace to cuBLAS's pool, which may allocate inside a CUDA-graph
  // capture; a workspace of our own keeps the GEMM capturable (the whole-layer graph).
  EPX_CUBLAS_CHECK(cublasSetWorkspace(h, blas.workspace(), Blas::kWorkspaceBytes));
  // Column-major view: logits^T [E, T] = (W [H, E] col-major)^T . (X^T [H, T] col-major).
  const float alpha = 1.0f, beta = 0.0f;
  EPX_CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(E), static_cast<int>(T), static_cast<int>(H), &alpha,
                               router_weight.ptr<const float>(), static_cast<int>(H), x_f32.ptr<const float>(),
                               static_cast<int>(H), &beta, logits.ptr<float>(), static_cast<int>(E)));
  if (router_bias.data != nullptr) {
    add_row_bias_kernel<<<cuda::grid_for(T * E, 256, 4096), 256, 0, s>>>(logits.ptr<float>(), router_bias.ptr<const float>(), T, E);
    cuda::check_launch("add_row_bias_kernel");
  }
}

void build_route_columns(const RouteColumnsParams& p, const TensorView& out_idx, const TensorView& out_weights,
                         const TensorView& gate, Stream stream) {
  const int64_t n = p.topk_idx.shape[0], K = p.topk_idx.shape[1];
  require_cuda_contiguous("topk_idx", p.topk_idx, {DType::int32, DType::int64});
  require_cuda_contiguous("topk_weights", p.topk_weights, {DType::fp32});
  check_shape(kOp, "topk_weights", p.topk_weights, {n, K});
  const int64_t cols = K + (p.has_shared ? 1 : 0);
  require_cuda_contiguous("route idx", out_idx, {p.topk_idx.dtype});
  require_cuda_contiguous("route weights", out_weights, {DType::fp32});
  check_shape(kOp, "route idx", out_idx, {n, cols});
  check_shape(kOp, "route weights", out_weights, {n, cols});
  const int64_t H = p.x.ndim == 2 ? p.x.shape[1] : 0;
  if (p.has_shared) {
    require_cuda_contiguous("gate", gate, {DType::fp32});
    require_arg(kOp, "gate.numel()", gate.numel(), gate.numel() >= n, "must be >= n = " + std::to_string(n));
    if (p.shared_gate_weight) {
      require_cuda_contiguous("x", p.x, {DType::bf16});
      check_shape(kOp, "x", p.x, {n, -1});
    }
  }
  if (n == 0) return;
  cuda::DeviceGuard guard(out_idx.device.index);
  const cudaStream_t s = cuda::native(stream);
  const auto* x = p.shared_gate_weight ? p.x.ptr<const uint16_t>() : nullptr;
  float* g = p.has_shared ? gate.ptr<float>() : nullptr;
  if (p.topk_idx.dtype == DType::int32) {
    route_columns_kernel<int32_t><<<static_cast<unsigned>(n), kColumnThreads, 0, s>>>(
        p.topk_idx.ptr<const int32_t>(), p.topk_weights.ptr<const float>(), static_cast<int>(K), x, H, p.shared_gate_weight,
        p.has_shared, p.fused, p.num_experts, out_idx.ptr<int32_t>(), out_weights.ptr<float>(), g);
  } else {  // int64 stays int64: a narrowing here turned id 2^32 + 3 into a valid expert 3
    route_columns_kernel<int64_t><<<static_cast<unsigned>(n), kColumnThreads, 0, s>>>(
        p.topk_idx.ptr<const int64_t>(), p.topk_weights.ptr<const float>(), static_cast<int>(K), x, H, p.shared_gate_weight,
        p.has_shared, p.fused, p.num_experts, out_idx.ptr<int64_t>(), out_weights.ptr<float>(), g);
  }
  cuda::check_launch("route_columns_kernel");
}

void fill_single_route(const TensorView& idx, const TensorView& weights, Stream stream, int local_expert) {
  require_cuda_contiguous("shared idx", idx, {DType::int32});
  require_cuda_contiguous("shared weights", weights, {DType::fp32});
  const int64_t n = idx.numel();
  require_arg(kOp, "shared weights.numel()", weights.numel(), weights.numel() == n, "must equal idx.numel() = " + std::to_string(n));
  if (n == 0) return;
  cuda::DeviceGuard guard(idx.device.index);
  single_route_kernel<<<cuda::grid_for(n, 256, 1024), 256, 0, cuda::native(stream)>>>(idx.ptr<int32_t>(), weights.ptr<float>(), n, local_expert);
  cuda::check_launch("single_route_kernel");
}

void zero_async(const TensorView& t, Stream stream) {
  require_cuda_contiguous("t", t, {t.dtype});
  if (t.nbytes() == 0) return;
  cuda::DeviceGuard guard(t.device.index);
  EPX_CUDA_CHECK(cudaMemsetAsync(t.data, 0, static_cast<size_t>(t.nbytes()), cuda::native(stream)));
}

void fill_i32(const TensorView& t, int32_t value, Stream stream) {
  require_cuda_contiguous("t", t, {DType::int32});
  const int64_t n = t.numel();
  if (n == 0) return;
  cuda::DeviceGuard guard(t.device.index);
  fill_i32_kernel<<<cuda::grid_for(n, 256, 1024), 256, 0, cuda::native(stream)>>>(t.ptr<int32_t>(), n, value);
  cuda::check_launch("fill_i32_kernel");
}

void local_shared_counts(const TensorView& recv_count, const TensorView& counts, int32_t rows, const TensorView& num_rows,
                         Stream stream) {
  require_cuda_contiguous("recv_count", recv_count, {DType::int32});
  require_cuda_contiguous("counts", counts, {DType::int32});
  if (num_rows.defined()) require_cuda_contiguous("num_rows", num_rows, {DType::int32});
  const int64_t L = recv_count.numel();
  require_arg(kOp, "counts.numel()", counts.numel(), counts.numel() == L, "must equal recv_count.numel() = " + std::to_string(L));
  if (L == 0) return;
  cuda::DeviceGuard guard(counts.device.index);
  local_shared_counts_kernel<<<1, 256, 0, cuda::native(stream)>>>(recv_count.ptr<const int32_t>(), counts.ptr<int32_t>(),
                                                                   static_cast<int>(L), rows,
                                                                   num_rows.defined() ? num_rows.ptr<const int32_t>() : nullptr);
  cuda::check_launch("local_shared_counts_kernel");
}

void copy_async(const TensorView& dst, const TensorView& src, Stream stream) {
  require_arg(kOp, "src.dtype", std::string(dtype_name(src.dtype)), src.dtype == dst.dtype, "must equal dst.dtype = " + std::string(dtype_name(dst.dtype)));
  require_arg(kOp, "src.numel()", src.numel(), src.numel() == dst.numel(), "must equal dst.numel() = " + std::to_string(dst.numel()));
  check_contiguous(kOp, "src", src);
  check_contiguous(kOp, "dst", dst);
  if (src.numel() == 0) return;
  cuda::DeviceGuard guard(dst.device.index);
  EPX_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, static_cast<size_t>(src.nbytes()), cudaMemcpyDeviceToDevice, cuda::native(stream)));
}

void add_shared(const TensorView& out, const TensorView& shared_y, const TensorView& gate, Stream stream,
                const TensorView& num_rows) {
  require_cuda_contiguous("out", out, {DType::bf16, DType::fp32});
  require_cuda_contiguous("shared_y", shared_y, {DType::bf16});
  require_cuda_contiguous("gate", gate, {DType::fp32});
  if (num_rows.defined()) require_cuda_contiguous("num_rows", num_rows, {DType::int32});
  const int64_t n = out.shape[0], H = out.shape[1];
  check_shape(kOp, "shared_y", shared_y, {n, H});
  require_arg(kOp, "gate.numel()", gate.numel(), gate.numel() >= n, "must be >= n = " + std::to_string(n));
  if (n == 0 || H == 0) return;
  cuda::DeviceGuard guard(out.device.index);
  if (out.dtype == DType::fp32) {
    add_shared_f32_kernel<<<cuda::grid_for(n * H, 256, 8192), 256, 0, cuda::native(stream)>>>(
        out.ptr<float>(), shared_y.ptr<const uint16_t>(), gate.ptr<const float>(), H, n * H,
        num_rows.defined() ? num_rows.ptr<const int32_t>() : nullptr);
    cuda::check_launch("add_shared_f32_kernel");
    return;
  }
  add_shared_kernel<<<cuda::grid_for(n * H, 256, 8192), 256, 0, cuda::native(stream)>>>(
      out.ptr<uint16_t>(), shared_y.ptr<const uint16_t>(), gate.ptr<const float>(), H, n * H,
      num_rows.defined() ? num_rows.ptr<const int32_t>() : nullptr);
  cuda::check_launch("add_shared_kernel");
}

PhaseEvents::~PhaseEvents() {
  for (void* e : events_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

void PhaseEvents::mark(Stream stream) {
  cuda::DeviceGuard guard(device_);
  if (next_ == events_.size()) {
    cudaEvent_t e = nullptr;
    EPX_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  EPX_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(events_[next_++]), cuda::native(stream)));
}

std::vector<double> PhaseEvents::elapsed_us(int64_t& chunks) {
  cuda::DeviceGuard guard(device_);
  std::vector<double> us(static_cast<size_t>(marks_ - 1), 0.0);
  chunks = static_cast<int64_t>(next_ / static_cast<size_t>(marks_));
  if (chunks == 0) return us;
  EPX_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[static_cast<size_t>(chunks * marks_) - 1])));
  for (int64_t c = 0; c < chunks; ++c)
    for (int k = 0; k + 1 < marks_; ++k) {
      float ms = 0;
      const size_t i = static_cast<size_t>(c * marks_ + k);
      EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[i]), static_cast<cudaEvent_t>(events_[i + 1])));
      us[static_cast<size_t>(k)] += static_cast<double>(ms) * 1e3;
    }
  return us;
}

void synchronize(Stream stream, int device) {
  cuda::DeviceGuard guard(device);
  EPX_CUDA_CHECK(cudaStreamSynchronize(cuda::native(stream)));
}

Graph::~Graph() {
  if (exec_) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) (void)cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
}

void Graph::begin(Stream stream) {
  require_arg(kOp, "stream", "the legacy default stream", stream.handle != nullptr,
              "must be a created stream to capture a CUDA graph (cudaStreamCreate)");
  require_arg(kOp, "graph", "already captured", exec_ == nullptr, "capture once per object");
  EPX_CUDA_CHECK(cudaStreamBeginCapture(cuda::native(stream), cudaStreamCaptureModeThreadLocal));
}

void Graph::end(Stream stream) {
  cudaGraph_t g = nullptr;
  EPX_CUDA_CHECK(cudaStreamEndCapture(cuda::native(stream), &g));
  graph_ = g;
  cudaGraphExec_t e = nullptr;
  EPX_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  exec_ = e;
}

void Graph::abort(Stream stream) noexcept {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(cuda::native(stream), &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
    cudaGraph_t g = nullptr;
    if (cudaStreamEndCapture(cuda::native(stream), &g) == cudaSuccess && g) (void)cudaGraphDestroy(g);
  }
  (void)cudaGetLastError();  // clear the capture-invalidated error so later calls do not see it
}

void Graph::launch(Stream stream) {
  require_arg(kOp, "graph", "none", exec_ != nullptr, "must be captured before it is replayed");
  EPX_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), cuda::native(stream)));
}

}  // namespace epx::moe_cuda
