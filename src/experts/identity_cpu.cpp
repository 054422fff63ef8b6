// experts/identity_cpu.cpp: the identity expert on the CPU and the factory; see identity.h.
#include <algorithm>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/quant.h"
#include "experts/identity.h"

namespace epx {
namespace {

constexpr std::string_view kOp = "identity_experts.apply";

class IdentityExperts final : public Experts {
 public:
  IdentityExperts(int num_local, int64_t hidden, Device device) : num_local_(num_local), hidden_(hidden), device_(device) {}
  int num_local_experts() const override { return num_local_; }
  int64_t hidden() const override { return hidden_; }
  /// ExpertMajor and Flat (what the dispatch backends produce); not Contiguous.
  bool supports(ActivationLayout layout) const override { return layout != ActivationLayout::Contiguous; }

  void apply(const ExpertsInput& in, const TensorView& out, Stream stream) override {
    const int64_t H = hidden_;
    if (!supports(in.layout))
      throw Unsupported(arg_message(kOp, "in.layout", std::string(layout_name(in.layout)),
                                    "must be expert_major or flat (the layouts the dispatch backends produce)"));
    check_device(kOp, "x", in.x, device_);
    check_dtype(kOp, "x", in.x, {DType::bf16, DType::fp8_e4m3});
    check_contiguous(kOp, "x", in.x);
    check_device(kOp, "out", out, device_);
    // Flat rows may stay fp32 (the unrounded partial of flat_combine partial_fp32); expert-major rows are bf16.
    if (in.layout == ActivationLayout::Flat) check_dtype(kOp, "out", out, {DType::bf16, DType::fp32});
    else check_dtype(kOp, "out", out, {DType::bf16});
    check_contiguous(kOp, "out", out);
    require_arg(kOp, "x.shape[-1]", in.x.size(-1), in.x.size(-1) == H, "must equal hidden = " + std::to_string(H));
    require_arg(kOp, "out.numel()", out.numel(), out.numel() == in.x.numel(), "must equal x.numel() = " + std::to_string(in.x.numel()));
    if (in.x.dtype == DType::fp8_e4m3) {
      check_device(kOp, "x_scales", in.x_scales, device_);
      require_arg(kOp, "x_scales.numel()", in.x_scales.numel(), in.x_scales.numel() * kFp8GroupSize == in.x.numel(),
                  "must be x.numel() / 128");
    }
    if (in.layout == ActivationLayout::ExpertMajor) {
      check_shape(kOp, "x", in.x, {num_local_, -1, H});
      check_device(kOp, "recv_count", in.recv_count, device_);
      check_dtype(kOp, "recv_count", in.recv_count, {DType::int32});
      check_shape(kOp, "recv_count", in.recv_count, {num_local_});
    } else {
      check_shape(kOp, "x", in.x, {-1, H});
      check_device(kOp, "topk_idx", in.topk_idx, device_);
      check_dtype(kOp, "topk_idx", in.topk_idx, {DType::int32, DType::int64});
      check_shape(kOp, "topk_idx", in.topk_idx, {in.x.size(0), -1});
      check_device(kOp, "topk_weights", in.topk_weights, device_);
      check_dtype(kOp, "topk_weights", in.topk_weights, {DType::fp32});
      check_shape(kOp, "topk_weights", in.topk_weights, {in.x.size(0), in.topk_idx.size(1)});
    }
    if (device_.is_cuda()) {
#ifdef EPX_WITH_CUDA
      experts_detail::identity_apply_cuda(in, out, num_local_, stream);
      return;
#else
      throw Unsupported(std::string(kOp) + ": device = " + device_.str() + ": this build has no CUDA");
#endif
    }
    apply_cpu(in, out);
  }

 private:
  int num_local_;
  int64_t hidden_;
  Device device_;

  // y = round_bf16(x~) of row `row` into yr.
  void load_row(const ExpertsInput& in, int64_t row, std::vector<float>& yr) const {
    const int64_t H = hidden_;
    if (in.x.dtype == DType::fp8_e4m3)
      dequantize_fp8_row(in.x.ptr<const uint8_t>() + row * H, in.x_scales.ptr<const float>() + row * (H / kFp8GroupSize), H,
                         yr.data(), kFp8GroupSize);
    else
      for (int64_t i = 0; i < H; ++i) yr[i] = bf16_bits_to_float(in.x.ptr<const uint16_t>()[row * H + i]);
    for (float& v : yr) v = round_bf16(v);
  }

  void apply_cpu(const ExpertsInput& in, const TensorView& out) const {
    const int64_t H = hidden_;
    std::vector<float> yr(static_cast<size_t>(H)), acc(static_cast<size_t>(H));
    uint16_t* o = out.dtype == DType::bf16 ? out.ptr<uint16_t>() : nullptr;
    if (in.layout == ActivationLayout::ExpertMajor) {
      const int64_t cap = in.x.size(1);
      for (int64_t l = 0; l < num_local_; ++l) {
        const int64_t n = std::clamp<int64_t>(in.recv_count.ptr<const int32_t>()[l], 0, cap);
        for (int64_t j = 0; j < n; ++j) {
          load_row(in, l * cap + j, yr);
          for (int64_t i = 0; i < H; ++i) o[(l * cap + j) * H + i] = float_to_bf16_bits(yr[i]);
        }
      }
      return;
    }
    const int64_t N = in.x.size(0), K = in.topk_idx.size(1);
    for (int64_t n = 0; n < N; ++n) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      bool loaded = false;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t l = in.topk_idx.dtype == DType::int32 ? in.topk_idx.ptr<const int32_t>()[n * K + k]
                                                             : in.topk_idx.ptr<const int64_t>()[n * K + k];
        if (l < 0 || l >= num_local_) continue;
        if (!loaded) load_row(in, n, yr);
        loaded = true;
        const float w = in.topk_weights.ptr<const float>()[n * K + k];
        for (int64_t i = 0; i < H; ++i) acc[i] += w * yr[i];
      }
      if (out.dtype == DType::fp32) std::copy(acc.begin(), acc.end(), out.ptr<float>() + n * H);
      else
        for (int64_t i = 0; i < H; ++i) o[n * H + i] = float_to_bf16_bits(acc[i]);
    }
  }
};

}  // namespace

std::unique_ptr<Experts> make_identity_experts(int num_local_experts, int64_t hidden, Device device) {
  require_arg("make_identity_experts", "num_local_experts", num_local_experts, num_local_experts >= 0, "must be >= 0");
  require_arg("make_identity_experts", "hidden", hidden, hidden > 0, "must be > 0");
#ifndef EPX_WITH_CUDA
  if (device.is_cuda()) throw Unsupported("make_identity_experts: device = " + device.str() + ": this build has no CUDA");
#endif
  return std::make_unique<IdentityExperts>(num_local_experts, hidden, device);
}

}  // namespace epx
