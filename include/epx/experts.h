// epx/experts.h: expert weights and the Experts interface (vLLM: FusedMoEPermuteExpertsUnpermute).
//
// Every expert is a gated MLP with fp32 accumulation:
//   [g, u] = x W13^T + b13                   [M, 2I]  (b13 optional, fp32)
//   h      = act(g, u)                       [M, I]
//   y      = h W2^T + b2                     [M, H]   (b2 optional, fp32)
// act is ExpertActivation (the model family's own):
//   silu_glu    : h = silu(g) * u                                    (DeepSeek, Qwen, Mixtral);
//                 with a finite limit, g = min(g, limit) and u = clamp(u, -limit, limit) first
//                 (DeepSeek-V4's clamped SwiGLU, swiglu_limit);
//   gpt_oss_glu : g = min(g, limit), u = clamp(u, -limit, limit),
//                 h = (u + 1) * g * sigmoid(alpha * g)               (gpt-oss, alpha 1.702, limit 7).
// gpt-oss is computed as transformers' modeling_gpt_oss.py defines it (GptOssExperts: gate_up =
// x @ gate_up_proj + gate_up_proj_bias, gate = gate_up[..., ::2], up = gate_up[..., 1::2], the
// clamps, glu = gate * sigmoid(gate * alpha), (up + 1) * glu @ down_proj + down_proj_bias); the
// checkpoint loader de-interleaves gate/up rows and biases into the [gate; up] layout below.
// Rounding rule (one rule for every activation): the bf16 model rounds every op's output to bf16
// (the gate_up GEMM, the bias add, each elementwise op, the down GEMM, its bias add); epx keeps
// [g, u], the biases and the activation in fp32 and rounds where the down GEMM reads its operand
// and where the expert's output leaves:
//   bf16, mxfp4 : h rounded to bf16 (the down GEMM's bf16 operand);
//   fp8_block   : h quantized to FP8 e4m3 1x128 with fp32 scales (DeepSeek-V3 recipe);
//   y = h W2^T + b2 rounded to bf16 once (the layout every combine consumes).
// So epx's expert is the fp32 model rounded at two points, never less exact than the bf16 model.
#pragma once

#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "epx/tensor.h"

namespace epx {

struct Config;  // epx/config.h

enum class WeightFormat : uint8_t {
  bf16,       ///< bf16 weights
  fp8_block,  ///< fp8_e4m3 weights, one fp32 scale_inv per 128x128 block (DeepSeek-V3 checkpoints)
  mxfp4,      ///< e2m1 packed pairs + one e8m0 scale per 32 inputs (OCP MX; gpt-oss checkpoints)
};
std::string_view weight_format_name(WeightFormat f);
/// The smallest step an intermediate slice may take in `f` without touching a scale block:
/// fp8_block 128 (128x128 scale blocks), mxfp4 32 (one e8m0 scale per 32), bf16 8 (16-byte rows,
/// what the CUDA experts need).
int64_t intermediate_granularity(WeightFormat f);
WeightFormat parse_weight_format(std::string_view name);  // throws InvalidArgument

/// The expert MLP's activation (see the file comment for the formulas).
struct ExpertActivation {
  enum class Kind : uint8_t {
    silu_glu,     ///< silu(g) * u, g and u clamped to `limit` when it is finite
    gpt_oss_glu,  ///< (clamp(u) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))
  };
  Kind kind = Kind::silu_glu;
  float alpha = 1.702f;  ///< gpt_oss_glu only (GptOssExperts.alpha)
  /// g <= limit, -limit <= u <= limit before the activation; +infinity = no clamp (silu_glu's
  /// default). gpt_oss_glu needs a finite limit (gpt-oss: swiglu_limit = 7.0).
  float limit = std::numeric_limits<float>::infinity();

  static ExpertActivation silu() { return {}; }
  static ExpertActivation gpt_oss(float alpha = 1.702f, float limit = 7.0f) { return {Kind::gpt_oss_glu, alpha, limit}; }
  /// silu_glu with no clamp: what the default CUDA expert kernels compute (an object with any other
  /// activation or a bias runs their epilogue variants, make_experts_cuda).
  bool is_plain_silu() const { return kind == Kind::silu_glu && !(limit < std::numeric_limits<float>::infinity()); }
  bool operator==(const ExpertActivation&) const = default;
};
/// "silu_glu", "silu_glu(limit=L)" or "gpt_oss_glu(alpha=A, limit=L)".
std::string expert_activation_name(const ExpertActivation& a);

/// One expert's weights, CPU-resident. Layout follows HF checkpoints, gate and up stacked:
///   w13 [2I, H]  rows [0, I) = gate_proj.weight, rows [I, 2I) = up_proj.weight
///   w2  [H, I]   = down_proj.weight
/// Storage per format:
///   bf16      : w13 bf16 [2I, H];          w2 bf16 [H, I];          scales undefined
///   fp8_block : w13 fp8_e4m3 [2I, H], w13_scale fp32 [2I/128, H/128]; w2 likewise [H/128, I/128]
///   mxfp4     : w13 fp4_e2m1x2 [2I, H/2], w13_scale e8m0 [2I, H/32]; w2 [H, I/2], w2_scale [H, I/32]
/// Optional biases, fp32 in every format (gpt-oss): b13 [2I] (rows [0, I) gate, [I, 2I) up), b2 [H];
/// undefined = no bias. The CPU experts and every CUDA path (make_experts_cuda) compute them.
struct ExpertWeights {
  WeightFormat format = WeightFormat::bf16;
  int64_t hidden = 0;        ///< H
  int64_t intermediate = 0;  ///< I
  Tensor w13, w13_scale, w2, w2_scale;
  Tensor b13, b2;            ///< fp32 [2I], [H], or undefined
  ExpertActivation activation;

  /// Whether b13 or b2 is defined, or the activation is not plain silu_glu: what only the CPU computes.
  bool has_cpu_only_math() const { return b13.defined() || b2.defined() || !activation.is_plain_silu(); }
  /// Checks b13 / b2 (fp32, contiguous, CPU, [2I] / [H]) and the activation (finite alpha, limit > 0,
  /// gpt_oss_glu with a finite limit). Throws InvalidArgument naming `what` and the field.
  void check_extras(std::string_view op, const std::string& what) const;

  /// Quantizes fp32 weights gate_up [2I, H] and down [H, I] into `format`.
  /// fp8_block needs H % 128 == 0 and I % 128 == 0; mxfp4 needs H % 32 == 0 and I % 32 == 0.
  static std::shared_ptr<ExpertWeights> from_float(WeightFormat format, const TensorView& gate_up, const TensorView& down);
  /// Deterministic random weights ~ N(0, 1/fan_in) from `seed`, then quantized into `format`.
  static std::shared_ptr<ExpertWeights> random(WeightFormat format, int64_t hidden, int64_t intermediate, uint64_t seed);

  /// Columns [begin, end) of the intermediate dimension, in the stored format (no re-quantization):
  /// gate rows [begin, end), up rows [I + begin, I + end) of w13 and columns [begin, end) of w2, with
  /// their scale blocks. The slices of one expert sum to it: down(h) = sum over slices of
  /// down_s(h_s), the split the DP-sharded shared expert uses (Megatron-style intermediate split).
  /// The activation is kept; b13 is sliced with the rows; b2 stays on the slice with begin == 0
  /// only, so the slices still sum to the expert.
  /// begin and end must be multiples of intermediate_granularity(format) (or end == I) with
  /// 0 <= begin < end <= I. Throws InvalidArgument naming the bad bound.
  std::shared_ptr<ExpertWeights> slice_intermediate(int64_t begin, int64_t end) const;

  /// Dequantized fp32 copies [2I, H] and [H, I], built once on first use (thread-safe), for the CPU path.
  const float* w13_f32() const;
  const float* w2_f32() const;

 private:
  mutable std::once_flag f32_once_;
  mutable Tensor w13_f32_, w2_f32_;
  void build_f32() const;
};

/// CPU reference of one expert: x [M, H] fp32 (already dequantized input) -> y [M, H] fp32 whose
/// values are bf16-rounded (see the precision rules above), with the expert's biases and
/// activation. Uses BLAS sgemm (fp32 accumulation).
void expert_mlp_cpu(const ExpertWeights& w, const float* x, int64_t num_rows, float* y);

enum class ActivationLayout : uint8_t {
  /// [L, cap, H] + recv_count[L]: DeepEP low-latency layout, vLLM BatchedExperts.
  ExpertMajor,
  /// [N, H] + per-row local topk_idx/topk_weights: DeepEP HT / vLLM Standard format.
  Flat,
  /// [N, H] with the rows already sorted by local expert + expert_offsets[L] (cumulative row ends):
  /// the m-grouped contiguous layout of grouped GEMMs (torch._grouped_mm / torch._scaled_grouped_mm's
  /// `offs`, DeepGEMM's m_grouped contiguous), what an HT / AG-RS receive side produces after sorting.
  Contiguous,
};
std::string_view layout_name(ActivationLayout l);

/// What the experts receive from prepare (dispatch).
struct ExpertsInput {
  ActivationLayout layout = ActivationLayout::Flat;
  TensorView x;             ///< ExpertMajor [L, cap, H] / Flat [N, H]; bf16 or fp8_e4m3
  TensorView x_scales;      ///< fp8 only: [L, cap, H/128] / [N, H/128] fp32; else empty
  TensorView recv_count;    ///< ExpertMajor: [L] int32 valid rows per local expert
  TensorView topk_idx;      ///< Flat: [N, K] int32 local expert index, -1 = not on this rank
  TensorView topk_weights;  ///< Flat: [N, K] fp32
  /// Contiguous: int32 on x's device, in either of two forms (told apart by the length):
  /// - [L] cumulative row ends (torch._grouped_mm / torch._scaled_grouped_mm's `offs`): expert l owns rows
  ///   [l == 0 ? 0 : expert_offsets[l - 1], expert_offsets[l]);
  /// - [L + 1] row starts with the end last (ExpertContiguousLayout::expert_offsets of ht's prepare, vLLM's
  ///   expert_offsets): expert l owns rows [expert_offsets[l], expert_offsets[l + 1]).
  /// Non-decreasing, each in [0, N]; rows outside every expert's range are neither read nor written.
  TensorView expert_offsets = {};  // (a default, so brace-initialized inputs of the other layouts may omit it)
};

class Experts {
 public:
  virtual ~Experts() = default;
  virtual int num_local_experts() const = 0;
  virtual int64_t hidden() const = 0;
  virtual bool supports(ActivationLayout layout) const = 0;
  /// ExpertMajor: out [L, cap, H] bf16; row j < recv_count[l] of expert l gets expert_l(x[l, j])
  ///              (unweighted); rows >= recv_count[l] are not written.
  /// Flat:        out [N, H] bf16 or fp32; row n = sum over k with topk_idx[n,k] >= 0 of
  ///              topk_weights[n,k] * expert_{topk_idx[n,k]}(x[n]), fp32 accumulation in column
  ///              order, rounded once to bf16, or left unrounded in an fp32 out (the partial that a
  ///              Flat combine sums over ranks before its one rounding); rows with no local selection
  ///              are zeros.
  /// Contiguous:  out [N, H] bf16; row i of expert l's rows gets expert_l(x[i]) (unweighted, as
  ///              ExpertMajor); rows outside every expert's range are not written.
  /// Throws InvalidArgument on shape/dtype mismatch, an index >= L, fp8_e4m3 x without x_scales, (CPU)
  /// x_scales given with bf16 x, or (CPU) expert_offsets that decrease or leave [0, N].
  virtual void apply(const ExpertsInput& in, const TensorView& out, Stream stream = {}) = 0;
};

/// CPU experts over `local_experts` (index = local expert id). Supports every ActivationLayout.
std::unique_ptr<Experts> make_experts_cpu(std::vector<std::shared_ptr<const ExpertWeights>> local_experts);

/// CUDA experts over `local_experts` (index = local expert id) on cuda:`device`: the grouped expert
/// MLP. fp8_block experts fed FP8 x run on sm_90a tensor-core grouped GEMMs (wgmma e4m3, weights in
/// the M slot and tokens in N, 128x128 block scales promoted into fp32 after every 128-deep K block
/// as DeepSeek-V3's recipe; SiLU-and-mul and the FP8 1x128 requantization of h fused into the
/// gate_up epilogue; src/experts/experts_fp8_cuda.cu) on a compute-capability 9.0 GPU of a build
/// that carries sm_90a code. Objects with mxfp4 experts whose experts are all mxfp4 or fp8_block
/// with I % 128 == 0 (H % 128 == 0), fed FP8 x, run every expert on the mixed sm_90a kernels
/// (src/experts/experts_mxfp4_cuda.cu): e2m1 + e8m0 streamed at 0.53 B per weight and expanded in
/// shared memory (gate_up as e4m3 with a per-row block exponent, down as bf16 with h kept bf16);
/// mxfp4 experts with <= 16 rows take the decode path of the same kernels instead (mma.sync, every
/// 32-K block scale applied in fp32; <= 8 rows with the weights and the token operand staged by bulk
/// copies on mbarriers, 9..16 through a per-warp cp.async ring; src/experts/experts_mxfp4_kernels.cuh),
/// fp8_block experts in the same grouped launch (FHMoE: FP8 shared + MXFP4 routed experts, one
/// launch per GEMM); Config::experts_mxfp4_tc = 0 keeps them on the SIMT GEMMs. Every other case (bf16 x, bf16 experts, other GPUs, or the
/// Config::experts_simt = 1, from EPX_EXPERTS_SIMT=1 or EPX_CONFIG, read by Config::load() at
/// construction) runs the simple tiled SIMT reference
/// kernels. Both paths hold the same precision rules. Uploads every expert's weights
/// once, in their stored format, and dequantizes them inside the GEMMs; the precision rules above
/// and every layout is the CPU's (make_experts_cpu), up to fp32 summation order. Experts may mix
/// formats and intermediate sizes (FHMoE); hidden and every intermediate must be multiples of 8,
/// at most 2048 local experts.
/// apply(): all tensors on cuda:`device`, contiguous, 16-byte aligned; stream-ordered on `stream`,
///   no host sync; recv_count (ExpertMajor), topk_idx (Flat) and expert_offsets (Contiguous) are read on
///   the device only. A topk_idx outside [-1, L) or a recv_count outside [0, cap] cannot throw at once:
///   the entry is treated as no selection (clamped count), and the next apply() on this object throws
///   InvalidArgument naming it (synchronize the stream first to be sure it is seen). expert_offsets
///   that decrease or leave [0, N] make that apply write nothing, and the next apply() throws likewise.
///   Workspace (about the size of x for ExpertMajor and Contiguous; [N*K, H] bf16 + [N*K, I] fp32 for Flat; plus
///   [rows, I] FP8 + [rows, I/128] fp32 of h on the tensor-core path) is
///   allocated on first use and grown when a larger shape arrives: to capture apply() in a CUDA
///   graph, call it once eagerly with the largest shape first (growing during capture throws
///   Unsupported). Calls on one object must be ordered (one stream, or synchronized).
/// Experts with more than 64 rows in one apply() run on the warp-specialized FP8 prefill GEMMs
/// (128-token tiles, src/experts/experts_fp8_prefill_cuda.cu) unless Config::experts_fp8_prefill = 0.
/// The path choices experts.simt / experts.fp8_prefill come from `config` (ModularMoE passes its own);
/// the two-argument form reads them with Config::load().
/// Experts with biases (b13 / b2) or an activation other than plain silu_glu (gpt-oss's clamped SwiGLU,
/// DeepSeek-V4's clamp) are computed by every path with the CPU experts' arithmetic and rounding points
/// (above): an object with any such expert launches epilogue variants of the GEMM kernels (the SIMT
/// GEMMs, the FP8 tensor-core GEMMs, the mixed MXFP4 ones) that add b13 to [g, u] and apply the
/// activation in fp32, and add b2 in fp32 before y's one rounding; the default kernels are not
/// touched. Such an object runs its FP8 128-row (prefill) tiles as 64-row tiles and its MXFP4
/// decode-size tiles (<= 16 rows) on the wgmma path, the two paths without an epilogue variant: the
/// same results within fp32 summation order, at those paths' speed.
/// Throws Unsupported in a CPU-only build; InvalidArgument for bad weights (a bias's shape or dtype,
/// the activation's alpha / limit, as the CPU experts: before any device work) or device, a `config` field outside
/// its rule (Config::validate()'s sentence), or (two-argument form) a bad EPX_* variable / EPX_CONFIG file.
std::unique_ptr<Experts> make_experts_cuda(std::vector<std::shared_ptr<const ExpertWeights>> local_experts, int device);
std::unique_ptr<Experts> make_experts_cuda(std::vector<std::shared_ptr<const ExpertWeights>> local_experts, int device,
                                           const Config& config);

}  // namespace epx
