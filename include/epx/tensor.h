// epx/tensor.h: Device, Stream, TensorView (non-owning) and Tensor (owning, CPU or CUDA).
//
// Strides are in elements (for fp4_e2m1x2: in packed bytes), row-major by default. Views never own
// memory; a Tensor owns its allocation through a shared_ptr, so copies of a Tensor share storage.
// Index arithmetic is 64-bit throughout (rows x hidden can pass 2^31, BEHAVIOUR.md).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "epx/dtype.h"

namespace epx {

enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int i) { return {DeviceKind::cuda, i}; }
  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu" or "cuda:N"
};

/// A CUDA stream handle (cudaStream_t) as an opaque pointer, so core stays free of CUDA headers.
/// nullptr = the legacy default stream; ignored on the CPU.
struct Stream {
  void* handle = nullptr;
};

constexpr int kMaxDims = 4;

/// Non-owning view: data, dtype, shape, strides (elements), device.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::fp32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  Device device{};

  TensorView() = default;
  /// Contiguous row-major view. Throws InvalidArgument for more than kMaxDims dims or a negative size.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::cpu());
  TensorView(void* data, DType dtype, const std::vector<int64_t>& shape, Device device = Device::cpu());

  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t numel() const;
  int64_t nbytes() const { return numel() * dtype_size(dtype); }
  bool empty() const { return data == nullptr && numel() == 0; }
  bool defined() const { return ndim > 0 || data != nullptr; }
  bool is_contiguous() const;
  template <class T> T* ptr() const { return static_cast<T*>(data); }
  /// Row r of a tensor with ndim >= 1 (a view of one slice along dim 0).
  TensorView row(int64_t r) const;
  /// Rows [begin, end) along dim 0.
  TensorView slice_rows(int64_t begin, int64_t end) const;
  std::string describe() const;  // "[128, 7168] bf16 cuda:0"
};

/// Owning tensor. Allocation on CUDA goes through the allocator that the CUDA runtime registers;
/// in a CPU-only build Tensor::empty(cuda) throws Unsupported.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(std::vector<int64_t> shape, DType dtype, Device device = Device::cpu());
  /// On CUDA the zeros are written before this returns (usable on any stream, a non-blocking one too).
  static Tensor zeros(std::vector<int64_t> shape, DType dtype, Device device = Device::cpu());
  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  void* data() const { return view_.data; }
  template <class T> T* ptr() const { return static_cast<T*>(view_.data); }
  int64_t numel() const { return view_.numel(); }
  int64_t nbytes() const { return view_.nbytes(); }
  int64_t size(int d) const { return view_.size(d); }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  bool defined() const { return view_.defined(); }
  /// Copy to another device (host<->CUDA through the registered allocator's copy), complete on return.
  Tensor to(Device device) const;

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

/// Memory hooks for non-CPU devices, registered by the CUDA runtime (src/cuda) at static init.
struct DeviceAllocator {
  void* (*alloc)(int64_t bytes, int device) = nullptr;
  void (*free)(void* p, int device) = nullptr;
  /// Synchronous copy, complete on return (not merely queued on some stream); kind: 0 host->device,
  /// 1 device->host, 2 device->device.
  void (*copy)(void* dst, const void* src, int64_t bytes, int kind) = nullptr;
  /// Synchronous memset, complete on return.
  void (*memset)(void* p, int value, int64_t bytes) = nullptr;
};
void register_device_allocator(DeviceKind kind, const DeviceAllocator& alloc);
const DeviceAllocator* device_allocator(DeviceKind kind);  // nullptr if none registered

/// Copies `src` into `dst` (same dtype and shape; any devices), complete on return. On CUDA it runs on
/// the legacy default stream: after earlier work of blocking streams, not of cudaStreamNonBlocking
/// ones (synchronize those before copying what they write). Throws InvalidArgument otherwise.
void copy(const TensorView& dst, const TensorView& src);

/// Argument checks for public entry points. Each throws InvalidArgument in the STYLE.md form.
void check_dtype(std::string_view op, std::string_view arg, const TensorView& t, std::initializer_list<DType> allowed);
void check_shape(std::string_view op, std::string_view arg, const TensorView& t, std::initializer_list<int64_t> expected);  // -1 = any
/// A view with a null data pointer that holds elements (numel > 0, an unset pointer): "<arg>.data = null".
void check_data(std::string_view op, std::string_view arg, const TensorView& t);
/// Also runs check_data.
void check_contiguous(std::string_view op, std::string_view arg, const TensorView& t);
void check_device(std::string_view op, std::string_view arg, const TensorView& t, Device expected);

}  // namespace epx
