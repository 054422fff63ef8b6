#include "epx/tensor.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

#include "epx/error.h"

namespace epx {

std::string Device::str() const { return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index); }

static void init_contiguous(TensorView& v, const int64_t* dims, size_t n) {
  require_arg("TensorView", "ndim", n, n <= static_cast<size_t>(kMaxDims), "must be <= 4");
  v.ndim = static_cast<int>(n);
  for (size_t i = 0; i < n; ++i) {
    require_arg("TensorView", "shape[" + std::to_string(i) + "]", dims[i], dims[i] >= 0, "must be >= 0");
    v.shape[i] = dims[i];
  }
  // numel() * dtype_size must fit int64 (it wrapped: Tensor::empty({2^40, 2^40}) allocated 64 bytes for that
  // shape). A shape with a 0 holds no elements whatever the other sizes; its strides may wrap (never used).
  bool empty = false;
  for (size_t i = 0; i < n; ++i) empty = empty || dims[i] == 0;
  int64_t bytes = dtype_size(v.dtype), s = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.strides[i] = s;
    const bool wrapped = __builtin_mul_overflow(s, v.shape[i], &s) || __builtin_mul_overflow(bytes, v.shape[i], &bytes);
    if (wrapped && !empty) {
      std::string shape = "[";
      for (size_t j = 0; j < n; ++j) shape += (j ? ", " : "") + std::to_string(dims[j]);
      require_arg("TensorView", "shape", shape + "] " + std::string(dtype_name(v.dtype)), false, "must hold at most 2^63 - 1 bytes");
    }
  }
}

TensorView::TensorView(void* d, DType t, std::initializer_list<int64_t> shp, Device dev) : data(d), dtype(t), device(dev) {
  init_contiguous(*this, shp.begin(), shp.size());
}
TensorView::TensorView(void* d, DType t, const std::vector<int64_t>& shp, Device dev) : data(d), dtype(t), device(dev) {
  init_contiguous(*this, shp.data(), shp.size());
}

int64_t TensorView::numel() const {
  if (ndim == 0) return data ? 1 : 0;
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

TensorView TensorView::row(int64_t r) const {
  EPX_ASSERT(ndim >= 1 && r >= 0 && r < shape[0], "r=", r, " rows=", ndim ? shape[0] : 0);
  TensorView v;
  v.data = static_cast<char*>(data) + r * strides[0] * dtype_size(dtype);
  v.dtype = dtype;
  v.device = device;
  v.ndim = ndim - 1;
  for (int i = 1; i < ndim; ++i) {
    v.shape[i - 1] = shape[i];
    v.strides[i - 1] = strides[i];
  }
  return v;
}

TensorView TensorView::slice_rows(int64_t begin, int64_t end) const {
  EPX_ASSERT(ndim >= 1 && begin >= 0 && begin <= end && end <= shape[0], "begin=", begin, " end=", end);
  TensorView v = *this;
  v.data = data ? static_cast<char*>(data) + begin * strides[0] * dtype_size(dtype) : nullptr;
  v.shape[0] = end - begin;
  return v;
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << "] " << dtype_name(dtype) << " " << device.str();
  return os.str();
}

static std::mutex g_alloc_mu;
static DeviceAllocator g_cuda_alloc;
static bool g_cuda_registered = false;

void register_device_allocator(DeviceKind kind, const DeviceAllocator& a) {
  std::lock_guard<std::mutex> lk(g_alloc_mu);
  if (kind == DeviceKind::cuda) {
    g_cuda_alloc = a;
    g_cuda_registered = true;
  }
}
const DeviceAllocator* device_allocator(DeviceKind kind) {
  std::lock_guard<std::mutex> lk(g_alloc_mu);
  if (kind == DeviceKind::cuda && g_cuda_registered) return &g_cuda_alloc;
  return nullptr;
}

Tensor Tensor::empty(std::vector<int64_t> shape, DType dtype, Device device) {
  Tensor t;
  t.view_ = TensorView(nullptr, dtype, shape, device);
  int64_t bytes = t.view_.nbytes();
  if (device.is_cpu()) {
    // 64-byte alignment so vector loads and BLAS are happy; at least one byte so data != nullptr.
    size_t sz = static_cast<size_t>((std::max<int64_t>(bytes, 1) + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, sz);
    if (!p) throw Error("Tensor::empty: cannot allocate " + std::to_string(bytes) + " bytes on cpu");
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    const DeviceAllocator* a = device_allocator(device.kind);
    if (!a) throw Unsupported("Tensor::empty: device = " + device.str() + ": this build has no CUDA runtime (configure with EPX_CUDA=ON)");
    int dev = device.index;
    void* p = a->alloc(std::max<int64_t>(bytes, 16), dev);
    auto free_fn = a->free;
    t.storage_ = std::shared_ptr<void>(p, [free_fn, dev](void* q) { free_fn(q, dev); });
  }
  t.view_.data = t.storage_.get();
  return t;
}

Tensor Tensor::zeros(std::vector<int64_t> shape, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
  if (device.is_cpu()) std::memset(t.data(), 0, static_cast<size_t>(t.nbytes()));
  else device_allocator(device.kind)->memset(t.data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(std::vector<int64_t>(view_.shape.begin(), view_.shape.begin() + view_.ndim), view_.dtype, device);
  copy(t.view(), view_);
  return t;
}

void copy(const TensorView& dst, const TensorView& src) {
  require_arg("copy", "dst.dtype", dtype_name(dst.dtype), dst.dtype == src.dtype, "must equal src.dtype = " + std::string(dtype_name(src.dtype)));
  require_arg("copy", "dst.numel", dst.numel(), dst.numel() == src.numel(), "must equal src.numel = " + std::to_string(src.numel()));
  check_contiguous("copy", "dst", dst);
  check_contiguous("copy", "src", src);
  int64_t bytes = src.nbytes();
  if (bytes == 0) return;
  if (dst.device.is_cpu() && src.device.is_cpu()) {
    std::memmove(dst.data, src.data, static_cast<size_t>(bytes));
    return;
  }
  const DeviceAllocator* a = device_allocator(DeviceKind::cuda);
  if (!a) throw Unsupported("copy: device = cuda: this build has no CUDA runtime");
  int kind = src.device.is_cpu() ? 0 : (dst.device.is_cpu() ? 1 : 2);
  a->copy(dst.data, src.data, bytes, kind);
}

void check_dtype(std::string_view op, std::string_view arg, const TensorView& t, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string rule = "must be one of {";
  bool first = true;
  for (DType d : allowed) {
    rule += (first ? "" : ", ") + std::string(dtype_name(d));
    first = false;
  }
  rule += "}";
  throw InvalidArgument(arg_message(op, std::string(arg) + ".dtype", dtype_name(t.dtype), rule));
}

void check_shape(std::string_view op, std::string_view arg, const TensorView& t, std::initializer_list<int64_t> expected) {
  bool ok = static_cast<int>(expected.size()) == t.ndim;
  int i = 0;
  std::string want = "[";
  for (int64_t e : expected) {
    if (ok && e >= 0 && t.shape[i] != e) ok = false;
    want += (i ? ", " : "") + (e >= 0 ? std::to_string(e) : std::string("*"));
    ++i;
  }
  want += "]";
  if (!ok) {
    std::string got = t.describe();
    throw InvalidArgument(arg_message(op, std::string(arg) + ".shape", got.substr(0, got.find(']') + 1), "must be " + want));
  }
}

void check_data(std::string_view op, std::string_view arg, const TensorView& t) {
  if (t.data == nullptr && t.ndim > 0 && t.numel() > 0)
    require_arg(op, std::string(arg) + ".data", "null of " + t.describe(), false,
                "must point to its " + std::to_string(t.numel()) + " elements");
}

void check_contiguous(std::string_view op, std::string_view arg, const TensorView& t) {
  // Every public entry point runs this on each tensor it reads or writes, so it also refuses a view that
  // claims elements but has no memory (a C++ caller's unset pointer; the Python binding refuses it too).
  check_data(op, arg, t);
  if (t.is_contiguous()) return;  // the message (an ostringstream) only on failure: this runs on every call
  std::string strides = "[";
  for (int i = 0; i < t.ndim; ++i) strides += (i ? ", " : "") + std::to_string(t.strides[i]);
  require_arg(op, std::string(arg) + ".strides", strides + "] of " + t.describe(), false,
              "must be contiguous (row-major); call .contiguous() first");
}

void check_device(std::string_view op, std::string_view arg, const TensorView& t, Device expected) {
  require_arg(op, std::string(arg) + ".device", t.device.str(), t.device == expected, "must be on " + expected.str());
}

}  // namespace epx
