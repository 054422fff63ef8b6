// experts/experts_cuda.cu: host side of the CUDA reference experts (make_experts_cuda in
// epx/experts.h): argument checks, weight upload, the workspace, and the launches of the kernels in
// experts_cuda_kernels.cuh (the pipeline is described there) and experts_schedule_kernels.cuh. The
// oracle is experts_cpu.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/experts.h"
#include "epx/quant.h"
#include "experts/contiguous.h"
#include "experts/experts_cuda_kernels.cuh"
#include "experts/experts_schedule_kernels.cuh"
#include "experts/experts_fp8_cuda.h"
#include "experts/experts_mxfp4_cuda.h"

namespace epx {
namespace {

using experts_cuda::ActKind;
using experts_cuda::ErrorRecord;
using experts_cuda::ExpertDesc;
using experts_cuda::ExpertEpi;
using experts_cuda::GemmParams;
using experts_cuda::Tile;

constexpr std::string_view kMake = "make_experts_cuda";
constexpr std::string_view kOp = "experts_cuda.apply";
/// grid.y of the GEMMs: CTAs stride over the device-side tile list, so the grid never depends on
/// the counts (which the host does not know) and stays bounded for large capacities.
constexpr int64_t kMaxTileSlots = 1024;
// Config::experts_fp8_prefill = 1 (the default) takes, per GEMM, the prefill kernels measured fastest (bench/NOTES.md,
// 'FP8 prefill GEMM'; the variants measured slower or level: 'Variants removed from the product').

using GemmKernel = void (*)(GemmParams);

/// Every GEMM instance this file compiles: gate_up for {bf16, fp8} x {3 formats}, down for the 3
/// formats (its A operand is the fp32 intermediate).
struct GemmInstance {
  ActKind act;
  WeightFormat format;
  bool gate_up;
  GemmKernel kernel;
};
const GemmInstance kGemmInstances[] = {
    {ActKind::bf16, WeightFormat::bf16, true, experts_cuda::expert_gemm_kernel<ActKind::bf16, WeightFormat::bf16, true>},
    {ActKind::bf16, WeightFormat::fp8_block, true, experts_cuda::expert_gemm_kernel<ActKind::bf16, WeightFormat::fp8_block, true>},
    {ActKind::bf16, WeightFormat::mxfp4, true, experts_cuda::expert_gemm_kernel<ActKind::bf16, WeightFormat::mxfp4, true>},
    {ActKind::fp8, WeightFormat::bf16, true, experts_cuda::expert_gemm_kernel<ActKind::fp8, WeightFormat::bf16, true>},
    {ActKind::fp8, WeightFormat::fp8_block, true, experts_cuda::expert_gemm_kernel<ActKind::fp8, WeightFormat::fp8_block, true>},
    {ActKind::fp8, WeightFormat::mxfp4, true, experts_cuda::expert_gemm_kernel<ActKind::fp8, WeightFormat::mxfp4, true>},
    {ActKind::f32, WeightFormat::bf16, false, experts_cuda::expert_gemm_kernel<ActKind::f32, WeightFormat::bf16, false>},
    {ActKind::f32, WeightFormat::fp8_block, false, experts_cuda::expert_gemm_kernel<ActKind::f32, WeightFormat::fp8_block, false>},
    {ActKind::f32, WeightFormat::mxfp4, false, experts_cuda::expert_gemm_kernel<ActKind::f32, WeightFormat::mxfp4, false>},
};

GemmKernel gemm_instance(ActKind act, WeightFormat format, bool gate_up) {
  for (const GemmInstance& g : kGemmInstances)
    if (g.act == act && g.format == format && g.gate_up == gate_up) return g.kernel;
  EPX_ASSERT(false, "no GEMM instance for act=", static_cast<int>(act), " format=", weight_format_name(format),
             " gate_up=", gate_up);
  return nullptr;
}

/// The same GEMMs with the experts' biases and activations (expert_gemm_epi_kernel), for objects with them.
using GemmEpiKernel = void (*)(GemmParams, const ExpertEpi*);
struct GemmEpiInstance {
  ActKind act;
  WeightFormat format;
  bool gate_up;
  GemmEpiKernel kernel;
};
const GemmEpiInstance kGemmEpiInstances[] = {
    {ActKind::bf16, WeightFormat::bf16, true, experts_cuda::expert_gemm_epi_kernel<ActKind::bf16, WeightFormat::bf16, true>},
    {ActKind::bf16, WeightFormat::fp8_block, true, experts_cuda::expert_gemm_epi_kernel<ActKind::bf16, WeightFormat::fp8_block, true>},
    {ActKind::bf16, WeightFormat::mxfp4, true, experts_cuda::expert_gemm_epi_kernel<ActKind::bf16, WeightFormat::mxfp4, true>},
    {ActKind::fp8, WeightFormat::bf16, true, experts_cuda::expert_gemm_epi_kernel<ActKind::fp8, WeightFormat::bf16, true>},
    {ActKind::fp8, WeightFormat::fp8_block, true, experts_cuda::expert_gemm_epi_kernel<ActKind::fp8, WeightFormat::fp8_block, true>},
    {ActKind::fp8, WeightFormat::mxfp4, true, experts_cuda::expert_gemm_epi_kernel<ActKind::fp8, WeightFormat::mxfp4, true>},
    {ActKind::f32, WeightFormat::bf16, false, experts_cuda::expert_gemm_epi_kernel<ActKind::f32, WeightFormat::bf16, false>},
    {ActKind::f32, WeightFormat::fp8_block, false, experts_cuda::expert_gemm_epi_kernel<ActKind::f32, WeightFormat::fp8_block, false>},
    {ActKind::f32, WeightFormat::mxfp4, false, experts_cuda::expert_gemm_epi_kernel<ActKind::f32, WeightFormat::mxfp4, false>},
};

GemmEpiKernel gemm_epi_instance(ActKind act, WeightFormat format, bool gate_up) {
  for (const GemmEpiInstance& g : kGemmEpiInstances)
    if (g.act == act && g.format == format && g.gate_up == gate_up) return g.kernel;
  EPX_ASSERT(false, "no GEMM epilogue instance for act=", static_cast<int>(act), " format=", weight_format_name(format),
             " gate_up=", gate_up);
  return nullptr;
}

constexpr WeightFormat kFormats[] = {WeightFormat::bf16, WeightFormat::fp8_block, WeightFormat::mxfp4};

int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }
int64_t ceil_div(int64_t n, int64_t d) { return (n + d - 1) / d; }

/// Device pointers carved from the one workspace allocation.
struct Workspace {
  Tile* tiles = nullptr;           // [max_tiles]
  int32_t* num_tiles = nullptr;    // [1]
  int32_t* pair_row = nullptr;     // Flat [N*K]
  int32_t* slot = nullptr;         // Flat [N*K]
  float* h = nullptr;              // [row space, I_max] fp32
  uint16_t* pair_out = nullptr;    // Flat [N*K, H] bf16
  uint8_t* hq = nullptr;           // fp8 tensor-core path: [row space, hq_stride] FP8 h
  float* hs = nullptr;             // fp8 tensor-core path: [row space, hq_stride / 128] fp32 scales
  uint16_t* hb = nullptr;          // mxfp4 tensor-core path: [row space, hb_cols / 2] bf16 h
};

/// Byte offsets of a Workspace for the given sizes (one layout for sizing and carving).
struct WorkspaceLayout {
  int64_t tiles = 0, num_tiles = 0, pair_row = 0, slot = 0, h = 0, pair_out = 0, hq = 0, hs = 0, hb = 0, total = 0;
  /// hq_cols: bytes per FP8 h row of the tensor-core path (0 = not used); hb_bytes: bytes per bf16
  /// h row of the mxfp4 tensor-core path (0 = not used).
  WorkspaceLayout(int64_t max_tiles, int64_t num_pairs, int64_t h_rows, int64_t h_cols, int64_t pair_out_rows,
                  int64_t hidden, int64_t hq_cols, int64_t hb_bytes = 0) {
    int64_t at = 0;
    auto take = [&](int64_t bytes) {
      const int64_t off = at;
      at = align_up(at + bytes, 256);
      return off;
    };
    tiles = take(max_tiles * static_cast<int64_t>(sizeof(Tile)));
    num_tiles = take(2 * sizeof(int32_t));
    pair_row = take(num_pairs * 4);
    slot = take(num_pairs * 4);
    h = take(h_rows * h_cols * 4);
    pair_out = take(pair_out_rows * hidden * 2);
    hq = take(h_rows * hq_cols);
    hs = take(h_rows * (hq_cols / kFp8GroupSize) * 4);
    hb = take(h_rows * hb_bytes);
    total = at;
  }
  Workspace carve(void* base) const {
    char* b = static_cast<char*>(base);
    return {reinterpret_cast<Tile*>(b + tiles), reinterpret_cast<int32_t*>(b + num_tiles),
            reinterpret_cast<int32_t*>(b + pair_row), reinterpret_cast<int32_t*>(b + slot),
            reinterpret_cast<float*>(b + h), reinterpret_cast<uint16_t*>(b + pair_out),
            reinterpret_cast<uint8_t*>(b + hq), reinterpret_cast<float*>(b + hs), reinterpret_cast<uint16_t*>(b + hb)};
  }
};

class CudaExperts final : public Experts {
 public:
  CudaExperts(std::vector<std::shared_ptr<const ExpertWeights>> experts, int device, const Config& config)
      : experts_(std::move(experts)), device_(device) {
    cuda::ensure_runtime();
    const int64_t num_local = static_cast<int64_t>(experts_.size());
    bool mx_shapes_ok = true;
    require_arg(kMake, "local_experts.size", num_local, num_local >= 1 && num_local <= experts_cuda::kMaxLocalExperts,
                "must be in [1, " + std::to_string(experts_cuda::kMaxLocalExperts) + "]");
    for (size_t l = 0; l < experts_.size(); ++l) {
      const std::string arg = "local_experts[" + std::to_string(l) + "]";
      require_arg(kMake, arg, "null", experts_[l] != nullptr, "must be non-null");
      const ExpertWeights& w = *experts_[l];
      require_arg(kMake, arg + ".hidden", w.hidden, w.hidden == experts_[0]->hidden,
                  "must equal local_experts[0].hidden = " + std::to_string(experts_[0]->hidden));
      require_arg(kMake, arg + ".hidden", w.hidden, w.hidden > 0 && w.hidden % 8 == 0,
                  "must be a positive multiple of 8 (16-byte rows of bf16)");
      require_arg(kMake, arg + ".intermediate", w.intermediate, w.intermediate > 0 && w.intermediate % 8 == 0,
                  "must be a positive multiple of 8");
      require_arg(kMake, arg + ".w13", w.w13.defined() ? "defined" : "undefined", w.w13.defined() && w.w2.defined(),
                  "w13 and w2 must hold the weights");
      inter_max_ = std::max(inter_max_, w.intermediate);
      if (w.format == WeightFormat::fp8_block) fp8_inter_max_ = std::max(fp8_inter_max_, w.intermediate);
      if (w.format == WeightFormat::mxfp4) mx_inter_max_ = std::max(mx_inter_max_, w.intermediate);
      // the mixed tensor-core kernels take fp8_block and mxfp4 experts whose I is a multiple of 128
      if (w.format == WeightFormat::bf16 || w.intermediate % kFp8GroupSize != 0) mx_shapes_ok = false;
      has_format_[static_cast<int>(w.format)] = true;
      if (w.has_cpu_only_math()) has_epi_ = true;  // (make_experts_cuda checked the biases and activation)
    }
    const int num_devices = cuda::device_count();
    require_arg(kMake, "device", device, device >= 0 && device < num_devices,
                "must be in [0, device_count = " + std::to_string(num_devices) + ")");

    cuda::DeviceGuard guard(device_);
    const Device dev = Device::cuda(device_);
    // fp8_block experts fed FP8 activations run on the sm_90a tensor-core GEMMs
    // (experts_fp8_cuda.cu) where the GPU and the build have them; Config::experts_simt
    // (EPX_EXPERTS_SIMT=1) keeps the SIMT reference GEMMs.
    fp8_tensor_cores_ = has_format_[static_cast<int>(WeightFormat::fp8_block)] && config.experts_simt == 0 &&
                        experts_cuda::fp8_tensor_cores_available(device_);
    // Config::experts_fp8_prefill (EPX_EXPERTS_FP8_PREFILL, default 1): experts with more than
    // kTileRows rows run in 128-row tiles on the warp-specialized prefill GEMMs
    // (experts_fp8_prefill_cuda.cu); 0 keeps every tile on the 64-row kernels.
    // The prefill kernels carry no bias / activation epilogue: an object with them (has_epi_) runs its big tiles as
    // 64-row tiles on the fp8_gemm_epi_kernel instead (same results: a row's sums do not depend on its tile).
    fp8_prefill_ = config.experts_fp8_prefill == 1 && !has_epi_;
    fp8_prefill_stages_ = config.experts_fp8_prefill_stages;
    fp8_prefill_min_tiles_ = config.experts_fp8_prefill_min_tiles;
    // The prefill kernels (same results every way): TMA loads with the lean consumer that loads the next K block's
    // operands under the last promotion (Fp8GemmParams::prefill_fast 5) for every GEMM, the Flat gate_up's token rows
    // first copied into row-space order (launch_fp8_prefill_permute_x into the pair_out rows, free until the down
    // GEMMs write them; Fp8GemmParams::x_perm), launched as 2-CTA clusters whose two CTAs (two 128-row tiles of one
    // expert) share the weight tile by TMA multicast (Fp8GemmParams::prefill_cluster 1), the prefill section's tiles
    // ordered for the pairs (ScheduleParams::pair_big: every pair one expert's but one per two odd-count experts);
    // the one-CTA TMA kernel where no cluster fits. A weight map the driver cannot encode leaves every GEMM on the
    // cp.async kernels (early scale reads and stage release, bulk-copy stores, wgmma's A in registers: prefill_fast 2).
    // Objects with mxfp4 experts, all of them fp8_block or mxfp4 with I % 128 == 0 and H % 128 == 0,
    // fed FP8 x, run every expert on the mixed sm_90a kernels (experts_mxfp4_cuda.cu): one grouped
    // launch per GEMM for both formats (FHMoE: FP8 shared + MXFP4 routed). Config::experts_mxfp4_tc
    // = 0 (EPX_EXPERTS_MXFP4_TC=0) keeps them on the SIMT GEMMs.
    mx_tensor_cores_ = has_format_[static_cast<int>(WeightFormat::mxfp4)] && mx_shapes_ok &&
                       experts_[0]->hidden % kFp8GroupSize == 0 && config.experts_simt == 0 && config.experts_mxfp4_tc >= 1 &&
                       experts_cuda::mxfp4_tensor_cores_available(device_);
    // The decode path (mx_decode_): <= 8 rows on TMA slots (decode_item_bulk: TMA boxes and a per-item token buffer,
    // the fastest; bench/NOTES.md, 'MXFP4 decode, the copies off the lanes') where the shapes and maps allow, else the
    // warp-shared cp.async slots (decode_item_ring2, faster than decode_item_ring there); 9..16 rows decode_item_ring.
    EPX_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
    // Config::experts_fp8_prefill_min_tiles = 0: the prefill section runs only when its 128-row
    // tiles fill one wave of the gate_up launch (I / 128 weight tiles each, one CTA per SM);
    // fewer big tiles stay 64-row tiles in the persistent grid of the 64-row kernels instead of a
    // serial tail on a few SMs (the fused shared expert at decode: bench/NOTES.md, 'the fused decode regression').
    if (fp8_prefill_min_tiles_ == 0 && fp8_inter_max_ > 0)
      fp8_prefill_min_tiles_ = static_cast<int>(ceil_div(num_sms_, std::max<int64_t>(1, fp8_inter_max_ / kFp8GroupSize)));
    std::vector<ExpertDesc> descs;
    std::vector<ExpertEpi> epis;
    for (const auto& e : experts_) {
      auto upload = [&](const Tensor& t) -> const void* {
        if (!t.defined()) return nullptr;
        device_weights_.push_back(t.to(dev));
        return device_weights_.back().data();
      };
      ExpertDesc d{};
      d.w13 = upload(e->w13);
      d.w13_scale = upload(e->w13_scale);
      d.w2 = upload(e->w2);
      d.w2_scale = upload(e->w2_scale);
      d.intermediate = static_cast<int32_t>(e->intermediate);
      d.format = static_cast<int32_t>(e->format);
      descs.push_back(d);
      ExpertEpi x{};
      x.b13 = static_cast<const float*>(upload(e->b13));
      x.b2 = static_cast<const float*>(upload(e->b2));
      x.kind = static_cast<int32_t>(e->activation.kind);
      x.alpha = e->activation.alpha;
      x.limit = e->activation.limit;
      epis.push_back(x);
    }
    descs_ = Tensor::empty({num_local * static_cast<int64_t>(sizeof(ExpertDesc))}, DType::uint8, dev);
    EPX_CUDA_CHECK(cudaMemcpy(descs_.data(), descs.data(), descs.size() * sizeof(ExpertDesc), cudaMemcpyHostToDevice));
    if (has_epi_) {  // the epilogue kernels' table; objects without biases or activations never upload it
      epi_ = Tensor::empty({num_local * static_cast<int64_t>(sizeof(ExpertEpi))}, DType::uint8, dev);
      EPX_CUDA_CHECK(cudaMemcpy(epi_.data(), epis.data(), epis.size() * sizeof(ExpertEpi), cudaMemcpyHostToDevice));
    }
    // The prefill kernels load the weight tiles with TMA from per-expert descriptors built here; a map the
    // driver cannot encode keeps every GEMM on the cp.async kernels.
    if (fp8_tensor_cores_) {
      std::vector<experts_cuda::Fp8TmaMap> maps(2 * descs.size());
      bool ok = true;
      for (size_t l = 0; l < descs.size() && ok; ++l)
        if (descs[l].format == static_cast<int32_t>(WeightFormat::fp8_block))
          ok = experts_cuda::fp8_prefill_weight_maps(descs[l], hidden(), maps[2 * l], maps[2 * l + 1]);
      if (ok) {
        w_maps_ = Tensor::empty({static_cast<int64_t>(maps.size() * sizeof(experts_cuda::Fp8TmaMap))}, DType::uint8, dev);
        EPX_CUDA_CHECK(cudaMemcpy(w_maps_.data(), maps.data(), maps.size() * sizeof(experts_cuda::Fp8TmaMap),
                                  cudaMemcpyHostToDevice));
      }
    }
    // The MXFP4 decode path's TMA maps (decode_item_bulk); without them its items take decode_item_ring2.
    if (has_format_[static_cast<int>(WeightFormat::mxfp4)]) {
      std::vector<experts_cuda::Fp8TmaMap> maps(4 * descs.size());
      bool ok = true;
      for (size_t l = 0; l < descs.size() && ok; ++l)
        if (descs[l].format == static_cast<int32_t>(WeightFormat::mxfp4)) {
          experts_cuda::Fp8TmaMap m[4];
          ok = experts_cuda::mxfp4_decode_maps(descs[l], hidden(), m);
          for (int i = 0; i < 4 && ok; ++i) maps[4 * l + i] = m[i];
        }
      if (ok) {
        mx_maps_ = Tensor::empty({static_cast<int64_t>(maps.size() * sizeof(experts_cuda::Fp8TmaMap))}, DType::uint8, dev);
        EPX_CUDA_CHECK(cudaMemcpy(mx_maps_.data(), maps.data(), maps.size() * sizeof(experts_cuda::Fp8TmaMap), cudaMemcpyHostToDevice));
      }
    }
    // The pageable cudaMemcpy uploads above may return before their DMA lands, on the legacy stream,
    // which the caller's cudaStreamNonBlocking stream does not wait for.
    EPX_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    void* rec = nullptr;
    EPX_CUDA_CHECK(cudaHostAlloc(&rec, sizeof(ErrorRecord), cudaHostAllocMapped));
    error_ = static_cast<ErrorRecord*>(rec);
    std::memset(error_, 0, sizeof(ErrorRecord));
    void* rec_dev = nullptr;
    EPX_CUDA_CHECK(cudaHostGetDevicePointer(&rec_dev, rec, 0));
    error_dev_ = static_cast<ErrorRecord*>(rec_dev);
  }

  ~CudaExperts() override {
    if (error_ != nullptr) (void)cudaFreeHost(error_);  // waits for kernels that may still write it
  }
  CudaExperts(const CudaExperts&) = delete;
  CudaExperts& operator=(const CudaExperts&) = delete;

  int num_local_experts() const override { return static_cast<int>(experts_.size()); }
  int64_t hidden() const override { return experts_[0]->hidden; }
  bool supports(ActivationLayout) const override { return true; }

  void apply(const ExpertsInput& in, const TensorView& out, Stream stream) override {
    raise_device_error();
    cuda::DeviceGuard guard(device_);
    if (in.layout == ActivationLayout::ExpertMajor) apply_expert_major(in, out, cuda::native(stream));
    else if (in.layout == ActivationLayout::Contiguous) apply_contiguous(in, out, cuda::native(stream));
    else apply_flat(in, out, cuda::native(stream));
  }

 private:
  void check_tensor(std::string_view arg, const TensorView& t, std::initializer_list<DType> dtypes,
                    std::initializer_list<int64_t> shape, bool vector_aligned) const {
    check_device(kOp, arg, t, Device::cuda(device_));
    check_dtype(kOp, arg, t, dtypes);
    check_shape(kOp, arg, t, shape);
    check_contiguous(kOp, arg, t);
    if (vector_aligned)
      require_arg(kOp, std::string(arg) + ".data", t.data, reinterpret_cast<uintptr_t>(t.data) % 16 == 0,
                  "must be 16-byte aligned (vector loads)");
  }

  void check_x(const ExpertsInput& in, std::initializer_list<int64_t> x_shape, std::initializer_list<int64_t> s_shape) const {
    check_tensor("x", in.x, {DType::bf16, DType::fp8_e4m3}, x_shape, true);
    if (in.x.dtype == DType::fp8_e4m3) {
      require_arg(kOp, "hidden", hidden(), hidden() % kFp8GroupSize == 0, "must be a multiple of 128 for fp8_e4m3 input");
      require_arg(kOp, "x_scales", "empty", in.x_scales.defined(), "must be given for fp8_e4m3 x ([.., H/128] fp32 1x128 scales)");
      check_tensor("x_scales", in.x_scales, {DType::fp32}, s_shape, false);
    } else {
      // As the CPU experts: scales given with bf16 x would be ignored (a caller who meant FP8 x would get bf16 results).
      require_arg(kOp, "x_scales", "given", !in.x_scales.defined(),
                  "must be empty for x.dtype = bf16 (scales belong to fp8_e4m3 x)");
    }
  }

  /// The mixed fp8_block + mxfp4 tensor-core path runs every expert of this apply (FP8 x).
  bool use_mixed_tc(const ExpertsInput& in) const { return mx_tensor_cores_ && in.x.dtype == DType::fp8_e4m3; }
  /// The FP8 tensor-core path runs this apply's fp8_block experts (FP8 x).
  bool use_fp8_tc(const ExpertsInput& in) const {
    return fp8_tensor_cores_ && in.x.dtype == DType::fp8_e4m3 && !use_mixed_tc(in);
  }
  /// ... and its experts with more than kTileRows rows on the prefill kernels (128-row tiles).
  bool use_prefill(const ExpertsInput& in) const { return use_fp8_tc(in) && fp8_prefill_; }
  /// Bytes per FP8 h row of the tensor-core paths (0 when none runs).
  int64_t hq_cols(const ExpertsInput& in) const { return use_fp8_tc(in) || use_mixed_tc(in) ? fp8_inter_max_ : 0; }
  /// Bytes per bf16 h row of the mxfp4 tensor-core path (0 when it does not run).
  int64_t hb_bytes(const ExpertsInput& in) const { return use_mixed_tc(in) ? 2 * mx_inter_max_ : 0; }

  /// Throws the bad input that a schedule kernel of an earlier apply() left in the mapped record.
  void raise_device_error() {
    volatile ErrorRecord* r = error_;
    const int32_t code = r->code;
    if (code == experts_cuda::kNoError) return;
    const int32_t row = r->row, col = r->col;
    const int64_t value = r->value;
    r->code = experts_cuda::kNoError;
    const std::string when = " (seen on the device by an earlier apply, which skipped it)";
    if (code == experts_cuda::kBadTopkIdx)
      throw InvalidArgument(arg_message(kOp, "topk_idx[" + std::to_string(row) + ", " + std::to_string(col) + "]", value,
                                        "must be -1 (not on this rank) or a local expert index in [0, L = " +
                                            std::to_string(num_local_experts()) + ")" + when));
    if (code == experts_cuda::kBadExpertOffsets)
      throw InvalidArgument(arg_message(kOp, "expert_offsets[" + std::to_string(row) + "]", value,
                                        "must be in [0, N] and >= the previous offset (offsets of experts sorted by "
                                        "id; that apply wrote nothing)" + when));
    throw InvalidArgument(arg_message(kOp, "recv_count[" + std::to_string(row) + "]", value,
                                      "must be in [0, cap] (the x capacity per expert; clamped)" + when));
  }

  /// Grows the workspace to `bytes`. Not during graph capture (cudaMalloc is not capturable).
  Workspace workspace(const WorkspaceLayout& layout, cudaStream_t stream) {
    if (layout.total > workspace_bytes_) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      EPX_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
      if (status != cudaStreamCaptureStatusNone)
        throw Unsupported(arg_message(kOp, "workspace_bytes", layout.total,
                                      "exceeds the " + std::to_string(workspace_bytes_) +
                                          " bytes allocated so far while the stream is being captured (call apply "
                                          "once eagerly with the largest shape before capturing)"));
      // Stream-ordered free and allocation: the old workspace goes after the earlier applies on this
      // stream, with no host wait and no device-wide sync (cudaFree's would stall on other ranks'
      // kernels on this GPU that wait for work this rank has yet to queue: virtual ranks).
      // 1/8 headroom: eager prefill steps receive a few % more or fewer rows each, and every new
      // maximum reallocates ~1-2 GB inside the experts phase.
      const int64_t bytes = align_up(layout.total + layout.total / 8, 256);
      cuda::DeviceGuard guard(device_);
      void* old = workspace_.release();
      if (old) EPX_CUDA_CHECK(cudaFreeAsync(old, stream));
      void* p = nullptr;
      EPX_CUDA_CHECK(cudaMallocAsync(&p, static_cast<size_t>(bytes), stream));
      workspace_.reset(p);
      workspace_bytes_ = bytes;
    }
    return layout.carve(static_cast<uint8_t*>(workspace_.get()));
  }

  void apply_expert_major(const ExpertsInput& in, const TensorView& out, cudaStream_t stream) {
    const int64_t num_local = num_local_experts(), h = hidden();
    require_arg(kOp, "x.ndim", in.x.ndim, in.x.ndim == 3, "must be 3 ([L, cap, H]) for the expert_major layout");
    const int64_t cap = in.x.size(1);
    check_x(in, {num_local, cap, h}, {num_local, cap, h / kFp8GroupSize});
    check_tensor("recv_count", in.recv_count, {DType::int32}, {num_local}, false);
    check_tensor("out", out, {DType::bf16}, {num_local, cap, h}, true);
    require_arg(kOp, "L * cap", num_local * cap, num_local * cap < (int64_t{1} << 31), "must be < 2^31");
    if (cap == 0) return;

    const int64_t max_tiles = num_local * ceil_div(cap, experts_cuda::kTileRows);
    const WorkspaceLayout layout(max_tiles, 0, num_local * cap, inter_max_, 0, h, hq_cols(in), hb_bytes(in));
    const Workspace ws = workspace(layout, stream);

    experts_cuda::ScheduleParams sp{};
    sp.cap = cap;
    sp.recv_count = in.recv_count.ptr<const int32_t>();
    // No expert can exceed kTileRows rows when cap <= kTileRows (decode): no prefill section.
    run_rows(in, out, sp, ws, max_tiles, use_prefill(in) && cap > experts_cuda::kTileRows, stream);
  }

  /// ExpertMajor / Contiguous (sp holds the layout's fields): the schedule kernel's tiles over the experts' rows,
  /// then the MLP in place (no gather, out rows = x rows). `big`: the prefill section may be used.
  void run_rows(const ExpertsInput& in, const TensorView& out, experts_cuda::ScheduleParams sp, const Workspace& ws,
                int64_t max_tiles, bool big, cudaStream_t stream) {
    sp.num_local = num_local_experts();
    sp.tiles = ws.tiles;
    sp.num_tiles = ws.num_tiles;
    sp.big_rows = big ? experts_cuda::kFp8PrefillRows : 0;
    sp.big_min_tiles = fp8_prefill_min_tiles_;
    sp.pair_big = fp8_prefill_pair_tiles_;
    sp.error = error_dev_;
    experts_cuda::schedule_expert_major_kernel<<<1, experts_cuda::kScheduleThreads,
                                                 experts_cuda::schedule_smem_bytes(sp.num_local), stream>>>(sp);
    cuda::check_launch("schedule_expert_major_kernel");
    run_mlp(in, nullptr, out.ptr<uint16_t>(), ws, max_tiles, big, stream);
  }

  /// Contiguous: ExpertMajor's kernels over a row space of x's N rows, the tiles made from expert_offsets
  /// (schedule_expert_major_kernel with ScheduleParams::expert_offsets).
  void apply_contiguous(const ExpertsInput& in, const TensorView& out, cudaStream_t stream) {
    const int64_t num_local = num_local_experts(), h = hidden();
    require_arg(kOp, "x.ndim", in.x.ndim, in.x.ndim == 2, "must be 2 ([N, H]) for the contiguous layout");
    const int64_t n = in.x.size(0);
    check_x(in, {n, h}, {n, h / kFp8GroupSize});
    const int64_t num_offsets = experts_detail::contiguous_offsets_count(kOp, in.expert_offsets, num_local);
    check_tensor("expert_offsets", in.expert_offsets, {DType::int32}, {num_offsets}, false);
    check_tensor("out", out, {DType::bf16}, {n, h}, true);
    require_arg(kOp, "N", n, n < (int64_t{1} << 31), "must be < 2^31");
    if (n == 0) return;

    // Every expert's rows end in a partial tile at most: N / kTileRows + L tiles.
    const int64_t max_tiles = ceil_div(n, experts_cuda::kTileRows) + num_local;
    const WorkspaceLayout layout(max_tiles, 0, n, inter_max_, 0, h, hq_cols(in), hb_bytes(in));
    const Workspace ws = workspace(layout, stream);

    experts_cuda::ScheduleParams sp{};
    sp.expert_offsets = in.expert_offsets.ptr<const int32_t>();
    sp.offsets_lead = num_offsets == num_local + 1;
    sp.num_rows = n;
    run_rows(in, out, sp, ws, max_tiles, use_prefill(in) && n > experts_cuda::kTileRows, stream);
  }

  void apply_flat(const ExpertsInput& in, const TensorView& out, cudaStream_t stream) {
    const int64_t num_local = num_local_experts(), h = hidden();
    require_arg(kOp, "x.ndim", in.x.ndim, in.x.ndim == 2, "must be 2 ([N, H]) for the flat layout");
    const int64_t n = in.x.size(0);
    check_x(in, {n, h}, {n, h / kFp8GroupSize});
    require_arg(kOp, "topk_idx.ndim", in.topk_idx.ndim, in.topk_idx.ndim == 2, "must be 2 ([N, K])");
    const int64_t k = in.topk_idx.size(1);
    check_tensor("topk_idx", in.topk_idx, {DType::int32, DType::int64}, {n, k}, false);
    check_tensor("topk_weights", in.topk_weights, {DType::fp32}, {n, k}, false);
    check_tensor("out", out, {DType::bf16, DType::fp32}, {n, h}, true);  // fp32: the weighted sum unrounded
    const int64_t num_pairs = n * k;
    require_arg(kOp, "N * K", num_pairs, num_pairs < (int64_t{1} << 31), "must be < 2^31");
    if (n == 0) return;
    if (k == 0) {  // no selections: every row is zero
      EPX_CUDA_CHECK(cudaMemsetAsync(out.data, 0, static_cast<size_t>(out.nbytes()), stream));
      return;
    }

    const int64_t max_tiles = ceil_div(num_pairs, experts_cuda::kTileRows) + num_local;
    const WorkspaceLayout layout(max_tiles, num_pairs, num_pairs, inter_max_, num_pairs, h, hq_cols(in), hb_bytes(in));
    const Workspace ws = workspace(layout, stream);

    experts_cuda::ScheduleParams sp{};
    sp.num_local = static_cast<int>(num_local);
    sp.topk_idx = in.topk_idx.data;
    sp.idx_int64 = in.topk_idx.dtype == DType::int64;
    sp.num_pairs = num_pairs;
    sp.top_k = static_cast<int>(k);
    sp.pair_row = ws.pair_row;
    sp.slot = ws.slot;
    sp.tiles = ws.tiles;
    sp.num_tiles = ws.num_tiles;
    const bool big = use_prefill(in) && num_pairs > experts_cuda::kTileRows;
    sp.big_rows = big ? experts_cuda::kFp8PrefillRows : 0;
    sp.big_min_tiles = fp8_prefill_min_tiles_;
    sp.pair_big = fp8_prefill_pair_tiles_;
    sp.error = error_dev_;
    experts_cuda::schedule_flat_kernel<<<1, experts_cuda::kScheduleThreads, experts_cuda::schedule_smem_bytes(sp.num_local),
                                         stream>>>(sp);
    cuda::check_launch("schedule_flat_kernel");
    run_mlp(in, ws.pair_row, ws.pair_out, ws, max_tiles, big, stream);

    experts_cuda::CombineParams cp{};
    cp.pair_out = ws.pair_out;
    cp.slot = ws.slot;
    cp.topk_weights = in.topk_weights.ptr<const float>();
    cp.out = out.dtype == DType::bf16 ? out.ptr<uint16_t>() : nullptr;
    cp.out_f32 = out.dtype == DType::fp32 ? out.ptr<float>() : nullptr;
    cp.num_tokens = n;
    cp.hidden = h;
    cp.top_k = static_cast<int>(k);
    experts_cuda::combine_kernel<<<static_cast<unsigned>(std::min<int64_t>(n, 65535)), experts_cuda::kCombineThreads, 0,
                                   stream>>>(cp);
    cuda::check_launch("combine_kernel");
  }

  /// gate_up (per format present), FP8 re-quantization of h (fp8_block experts), down.
  /// `big`: the schedule split the tile list (ScheduleParams::big_rows); the tiles past
  /// num_tiles[1] run on the FP8 prefill kernels.
  void run_mlp(const ExpertsInput& in, const int32_t* gather, uint16_t* out_rows, const Workspace& ws, int64_t max_tiles,
               bool big, cudaStream_t stream) {
    const int64_t h = hidden();
    GemmParams gp{};
    gp.experts = descs_.ptr<const ExpertDesc>();
    gp.tiles = ws.tiles;
    gp.num_tiles = ws.num_tiles;
    gp.a = in.x.data;
    gp.a_scales = in.x.dtype == DType::fp8_e4m3 ? in.x_scales.ptr<const float>() : nullptr;
    gp.gather = gather;
    gp.a_stride = h;
    gp.a_scales_stride = h / kFp8GroupSize;
    gp.hidden = h;
    gp.h = ws.h;
    gp.h_stride = inter_max_;
    gp.out = out_rows;
    const unsigned tile_slots = static_cast<unsigned>(std::min(max_tiles, kMaxTileSlots));
    const ActKind act = in.x.dtype == DType::fp8_e4m3 ? ActKind::fp8 : ActKind::bf16;
    const bool tc = use_fp8_tc(in);  // fp8_block experts on the tensor cores, not the SIMT GEMMs
    const bool mixed = use_mixed_tc(in);  // fp8_block and mxfp4 experts on the mixed tensor-core GEMMs
    // The experts' biases and activations: every GEMM launch takes its *_epi kernel (null: the default kernels).
    const ExpertEpi* epi = has_epi_ ? epi_.ptr<const ExpertEpi>() : nullptr;
    auto simt_runs = [&](WeightFormat f) {
      return has_format_[static_cast<int>(f)] && !(tc && f == WeightFormat::fp8_block) && !(mixed && f != WeightFormat::bf16);
    };
    // The fields the mixed (MixedGemmParams) and FP8 (Fp8GemmParams) tensor-core launches share.
    auto fill_tc_params = [&](auto& p) {
      p.experts = gp.experts;
      p.tiles = ws.tiles;
      p.num_tiles = ws.num_tiles;
      p.hidden = h;
      p.x = in.x.ptr<const uint8_t>();
      p.x_scales = in.x_scales.ptr<const float>();
      p.gather = gather;
      p.hq = ws.hq;
      p.hs = ws.hs;
      p.h_stride = fp8_inter_max_;
      p.hs_stride = fp8_inter_max_ / kFp8GroupSize;
      p.out = out_rows;
    };
    if (mixed) {
      experts_cuda::MixedGemmParams mp{};
      fill_tc_params(mp);
      mp.hb = ws.hb;
      mp.hb_stride = mx_inter_max_;
      mp.decode = mx_decode_;
      mp.mx_maps = mx_maps_.defined() ? static_cast<const experts_cuda::Fp8TmaMap*>(mx_maps_.data()) : nullptr;
      // Persistent grids of one CTA per multiprocessor (~219 KiB of shared memory each).
      mp.max_weight_tiles = static_cast<int32_t>(inter_max_ / kFp8GroupSize);
      const int64_t up_items = max_tiles * mp.max_weight_tiles;
      experts_cuda::launch_mixed_gate_up(mp, static_cast<int>(std::clamp<int64_t>(up_items, 1, num_sms_)), stream, epi);
      mp.gather = nullptr;
      mp.max_weight_tiles = static_cast<int32_t>(ceil_div(h, experts_cuda::kFp8TileWeightRows));
      const int64_t down_items = max_tiles * mp.max_weight_tiles;
      experts_cuda::launch_mixed_down(mp, static_cast<int>(std::clamp<int64_t>(down_items, 1, num_sms_)), stream, epi);
    }
    if (tc) {
      experts_cuda::Fp8GemmParams fp{};
      fill_tc_params(fp);
      fp.num_small = big ? ws.num_tiles + 1 : nullptr;
      fp.prefill_stages = fp8_prefill_stages_;
      fp.w_maps = w_maps_.defined() ? w_maps_.data() : nullptr;
      fp.prefill_fast = fp8_prefill_fast_;
      fp.row_space = in.layout == ActivationLayout::ExpertMajor  ? in.x.size(0) * in.x.size(1)
                     : in.layout == ActivationLayout::Contiguous ? in.x.size(0)
                                                                 : in.topk_idx.size(0) * in.topk_idx.size(1);
      // Persistent grids of one CTA per multiprocessor (the kernels take ~205-217 KiB of shared memory).
      fp.max_weight_tiles = static_cast<int32_t>(fp8_inter_max_ / kFp8GroupSize);
      const int up_grid = static_cast<int>(std::clamp<int64_t>(max_tiles * fp.max_weight_tiles, 1, num_sms_));
      experts_cuda::launch_fp8_gate_up(fp, up_grid, stream, epi);
      // The prefill section: TMA kernels where there are weight maps. They first copy
      // the Flat gate_up's token rows into row-space order, into the first H bytes of each row's pair_out
      // row (out_rows: [N * K, H] bf16, written only by the down GEMMs after this gate_up, stream-ordered).
      const bool tma = fp.w_maps != nullptr;
      fp.prefill_cluster = fp8_prefill_cluster_;
      if (big && tma) {
        fp.prefill_fast = fp8_prefill_tma_fast_;
        if (fp8_prefill_permute_ && fp.gather != nullptr) {
          fp.x_perm = reinterpret_cast<uint8_t*>(out_rows);
          fp.x_perm_stride = 2 * h;
          experts_cuda::launch_fp8_prefill_permute_x(fp, static_cast<int>(std::clamp<int64_t>(max_tiles, 1, 65535)), stream);
        }
        experts_cuda::launch_fp8_prefill_tma_gate_up(fp, up_grid, stream);
        fp.x_perm = nullptr;
      } else if (big) {
        experts_cuda::launch_fp8_prefill_gate_up(fp, up_grid, stream);
      }
      fp.gather = nullptr;
      fp.max_weight_tiles = static_cast<int32_t>(ceil_div(h, experts_cuda::kFp8TileWeightRows));
      const int down_grid = static_cast<int>(std::clamp<int64_t>(max_tiles * fp.max_weight_tiles, 1, num_sms_));
      fp.prefill_fast = fp8_prefill_fast_;
      experts_cuda::launch_fp8_down(fp, down_grid, stream, epi);
      if (big && tma) {
        fp.prefill_fast = fp8_prefill_tma_fast_;
        experts_cuda::launch_fp8_prefill_tma_down(fp, down_grid, stream);
      } else if (big) {
        experts_cuda::launch_fp8_prefill_down(fp, down_grid, stream);
      }
    }
    const dim3 gate_up_grid(static_cast<unsigned>(ceil_div(2 * inter_max_, experts_cuda::kTileCols)), tile_slots);
    for (WeightFormat f : kFormats) {
      if (!simt_runs(f)) continue;
      if (epi != nullptr) gemm_epi_instance(act, f, true)<<<gate_up_grid, experts_cuda::kGemmThreads, 0, stream>>>(gp, epi);
      else gemm_instance(act, f, true)<<<gate_up_grid, experts_cuda::kGemmThreads, 0, stream>>>(gp);
      cuda::check_launch("expert_gemm_kernel (gate_up)");
    }
    if (simt_runs(WeightFormat::fp8_block)) {
      experts_cuda::QuantizeHParams qp{gp.experts, ws.tiles, ws.num_tiles, ws.h, inter_max_};
      experts_cuda::quantize_h_kernel<<<tile_slots, experts_cuda::kQuantizeThreads, 0, stream>>>(qp);
      cuda::check_launch("quantize_h_kernel");
    }
    gp.a = ws.h;
    gp.a_scales = nullptr;
    gp.gather = nullptr;
    gp.a_stride = inter_max_;
    const dim3 down_grid(static_cast<unsigned>(ceil_div(h, experts_cuda::kTileCols)), tile_slots);
    for (WeightFormat f : kFormats) {
      if (!simt_runs(f)) continue;
      if (epi != nullptr) gemm_epi_instance(ActKind::f32, f, false)<<<down_grid, experts_cuda::kGemmThreads, 0, stream>>>(gp, epi);
      else gemm_instance(ActKind::f32, f, false)<<<down_grid, experts_cuda::kGemmThreads, 0, stream>>>(gp);
      cuda::check_launch("expert_gemm_kernel (down)");
    }
  }

  std::vector<std::shared_ptr<const ExpertWeights>> experts_;
  int device_;
  int64_t inter_max_ = 0;
  int64_t fp8_inter_max_ = 0;     // widest fp8_block expert (I % 128 == 0)
  bool fp8_tensor_cores_ = false; // fp8_block experts with FP8 x run on the sm_90a wgmma GEMMs
  bool fp8_prefill_ = false;      // experts with > 64 rows on the prefill kernels (EPX_EXPERTS_FP8_PREFILL)
  int fp8_prefill_stages_ = 0;    // their ring depth (EPX_EXPERTS_FP8_PREFILL_STAGES; 0 = maximum)
  int fp8_prefill_min_tiles_ = 1; // big tiles the prefill section needs to run (EPX_EXPERTS_FP8_PREFILL_MIN_TILES; 0 -> one wave)
  static constexpr int fp8_prefill_fast_ = 2;      // the cp.async prefill kernels (Fp8GemmParams::prefill_fast)
  static constexpr int fp8_prefill_tma_fast_ = 5;  // the TMA prefill kernels' lean consumer with the prefetch
  static constexpr bool fp8_prefill_permute_ = true;  // the Flat gate_up's token rows copied into row-space order first
  static constexpr int fp8_prefill_cluster_ = 1;      // the TMA prefill kernels as 2-CTA clusters sharing the weight tile by multicast
  static constexpr bool fp8_prefill_pair_tiles_ = true;  // the prefill section ordered for the clusters' pairs (ScheduleParams::pair_big)
  int64_t mx_inter_max_ = 0;      // widest mxfp4 expert
  bool mx_tensor_cores_ = false;  // fp8_block + mxfp4 experts with FP8 x run on the mixed sm_90a GEMMs
  static constexpr int mx_decode_ = 1 | 2;  // MixedGemmParams::decode: the mma.sync decode path with its TMA slots
  int num_sms_ = 1;
  std::array<bool, 3> has_format_{};
  std::vector<Tensor> device_weights_;  // uploaded w13 / scales / w2 / scales of every expert
  Tensor descs_;                        // [L] ExpertDesc on the device
  bool has_epi_ = false;                // some expert has b13 / b2 or an activation other than plain silu_glu
  Tensor epi_;                          // [L] ExpertEpi on the device (has_epi_), else undefined
  Tensor w_maps_;                       // [2L] Fp8TmaMap of the fp8_block weights (prefill kernels' TMA), or undefined
  Tensor mx_maps_;                      // [4L] Fp8TmaMap of the mxfp4 weights (decode_item_bulk), or undefined
  /// cudaMallocAsync'd on the stream of the apply that grew it; a later growth frees it on its own
  /// stream (stream-ordered), the destructor with cudaFree (which waits for the device).
  struct CudaFree {
    void operator()(void* p) const { (void)cudaFree(p); }
  };
  std::unique_ptr<void, CudaFree> workspace_;
  int64_t workspace_bytes_ = 0;
  ErrorRecord* error_ = nullptr;        // host-mapped, pinned
  ErrorRecord* error_dev_ = nullptr;
};

}  // namespace

std::unique_ptr<Experts> make_experts_cuda(std::vector<std::shared_ptr<const ExpertWeights>> local_experts, int device) {
  return make_experts_cuda(std::move(local_experts), device, Config::load());
}

std::unique_ptr<Experts> make_experts_cuda(std::vector<std::shared_ptr<const ExpertWeights>> local_experts, int device,
                                           const Config& config) {
  // A Config built in C++ is held to the rules Config::set / JSON / EPX_* enforce (experts.fp8_prefill = 5, a
  // removed mode, would otherwise run some other kernel): validate()'s sentence names the key, value and rule.
  config.validate();
  // Biases and activations (gpt-oss, DeepSeek-V4's clamp) run on every path, in the *_epi kernels; their shapes and
  // values are checked here, before any device work, as the CPU experts check them.
  for (size_t l = 0; l < local_experts.size(); ++l)
    if (local_experts[l] != nullptr) local_experts[l]->check_extras(kMake, "local_experts[" + std::to_string(l) + "]");
  return std::make_unique<CudaExperts>(std::move(local_experts), device, config);
}

}  // namespace epx
