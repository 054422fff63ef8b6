// python/src/py_tensor.cpp: DLPack in (borrow) and out (epx.Tensor.__dlpack__), epx.Tensor itself.
#include "py_tensor.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "epx/dtype.h"
#include "epx/error.h"
#include "epx/quant.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace epx::py {

namespace {

constexpr const char* kLegacyName = "dltensor";
constexpr const char* kLegacyUsed = "used_dltensor";
constexpr const char* kVersionedName = "dltensor_versioned";
constexpr const char* kVersionedUsed = "used_dltensor_versioned";

std::string to_hex(uintptr_t x) {
  char buf[2 * sizeof(uintptr_t) + 1];
  std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(x));
  return buf;
}

std::string dl_dtype_name(const dl::DataType& t) {
  std::string base;
  switch (t.code) {
    case dl::kInt: base = "int"; break;
    case dl::kUInt: base = "uint"; break;
    case dl::kFloat: base = "float"; break;
    case dl::kBfloat: base = "bfloat"; break;
    case dl::kBool: return "bool";
    case dl::kFloat8_e4m3fn: return "float8_e4m3fn";
    case dl::kFloat8_e8m0fnu: return "float8_e8m0fnu";
    default: return "dlpack code " + std::to_string(t.code) + " bits " + std::to_string(t.bits);
  }
  std::string s = base + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

/// epx dtype of a DLPack dtype; nullopt when epx has none.
std::optional<DType> from_dl_dtype(const dl::DataType& t, std::optional<DType> bits_as) {
  if (t.lanes != 1) return std::nullopt;
  if (bits_as && t.code == dl::kUInt && t.bits == 8 * dtype_size(*bits_as)) return bits_as;
  switch (t.code) {
    case dl::kFloat:
      if (t.bits == 32) return DType::fp32;
      if (t.bits == 16) return DType::fp16;
      break;
    case dl::kBfloat:
      if (t.bits == 16) return DType::bf16;
      break;
    case dl::kInt:
      if (t.bits == 32) return DType::int32;
      if (t.bits == 64) return DType::int64;
      break;
    case dl::kUInt:
      if (t.bits == 8) return DType::uint8;
      break;
    case dl::kFloat8_e4m3fn:
      if (t.bits == 8) return DType::fp8_e4m3;
      break;
    case dl::kFloat8_e8m0fnu:
      if (t.bits == 8) return DType::e8m0;
      break;
    default: break;
  }
  return std::nullopt;
}

/// What a consumed capsule holds, whichever ABI it came in.
struct Imported {
  const dl::Tensor* tensor = nullptr;
  bool read_only = false;
  bool is_copied = false;
};

/// Consumes a DLPack capsule into `keep` (the producer's deleter then runs exactly once, when `keep`
/// dies, whatever happens after this point). Versioned capsules ("dltensor_versioned") and legacy ones
/// ("dltensor") have different struct layouts (DLManagedTensorVersioned puts version, manager_ctx,
/// deleter and flags before the DLTensor): each is read through its own type.
Imported consume_capsule(pyb::handle cap, const std::string& op, const std::string& name, Borrowed& keep) {
  PyObject* c = cap.ptr();
  if (!PyCapsule_CheckExact(c)) {
    throw InvalidArgument(arg_message(op, name + ".__dlpack__()", pyb::str(pyb::type::of(cap)).cast<std::string>(),
                                      "must return a DLPack capsule (\"dltensor\" or \"dltensor_versioned\")"));
  }
  Imported out;
  if (PyCapsule_IsValid(c, kVersionedName)) {
    auto* m = static_cast<dl::ManagedTensorVersioned*>(PyCapsule_GetPointer(c, kVersionedName));
    if (PyCapsule_SetName(c, kVersionedUsed) != 0) throw pyb::error_already_set();
    keep.versioned = m;
    // DLPack: a consumer may read only version and deleter of a major version it does not know.
    if (m->version.major != dl::kMaxMajor) {
      throw InvalidArgument(arg_message(op, name + ".__dlpack__ version",
                                        std::to_string(m->version.major) + "." + std::to_string(m->version.minor),
                                        "must be DLPack 1.x (epx asked for max_version = (1, 1))"));
    }
    out.tensor = &m->dl_tensor;
    out.read_only = (m->flags & dl::kFlagReadOnly) != 0;
    out.is_copied = (m->flags & dl::kFlagIsCopied) != 0;
    return out;
  }
  if (PyCapsule_IsValid(c, kLegacyName)) {
    auto* m = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(c, kLegacyName));
    if (PyCapsule_SetName(c, kLegacyUsed) != 0) throw pyb::error_already_set();
    keep.legacy = m;
    out.tensor = &m->dl_tensor;  // DLPack 0.x cannot say read-only: producers export writable memory only
    return out;
  }
  const char* cname = PyCapsule_GetName(c);
  PyErr_Clear();
  const std::string got = cname ? std::string("capsule \"") + cname + "\"" : std::string("unnamed capsule");
  const bool used = cname && (std::string(cname) == kLegacyUsed || std::string(cname) == kVersionedUsed);
  throw InvalidArgument(arg_message(op, name + ".__dlpack__()", got,
                                    used ? "was already consumed (a DLPack capsule is used once)"
                                         : "must be an unused DLPack capsule (\"dltensor\" or \"dltensor_versioned\")"));
}

bool is_torch_fp8(pyb::handle obj) {
  if (!pyb::hasattr(obj, "dtype")) return false;
  const std::string d = pyb::str(obj.attr("dtype")).cast<std::string>();
  return d == "torch.float8_e4m3fn";
}

/// numpy 1.x cannot export a read-only array through DLPack (e.g. one that numpy.from_dlpack made):
/// those are borrowed through the numpy array interface (__array_interface__), still without a copy.
std::optional<TensorView> from_array_interface(pyb::handle obj, const std::string& op, const std::string& name,
                                               std::optional<DType> bits_as, bool* read_only) {
  if (!pyb::hasattr(obj, "__array_interface__")) return std::nullopt;
  pyb::dict ai = obj.attr("__array_interface__");
  const std::string ts = ai["typestr"].cast<std::string>();
  if (ts.size() < 3 || ts[0] == '>') return std::nullopt;
  const char kind = ts[1];
  const int bytes = std::stoi(ts.substr(2));
  dl::DataType dt{};
  dt.lanes = 1;
  dt.bits = static_cast<uint8_t>(8 * bytes);
  if (kind == 'f') dt.code = dl::kFloat;
  else if (kind == 'i') dt.code = dl::kInt;
  else if (kind == 'u') dt.code = dl::kUInt;
  else if (kind == 'b') dt.code = dl::kBool;
  else return std::nullopt;
  auto dtype = from_dl_dtype(dt, bits_as);
  if (!dtype) {
    throw InvalidArgument(arg_message(op, name + ".dtype", dl_dtype_name(dt),
                                      "epx takes fp32, bf16, fp16, fp8_e4m3, e8m0, int32, int64 or uint8 (numpy: bf16 as uint16 bit patterns)"));
  }
  auto shape = ai["shape"].cast<std::vector<int64_t>>();
  require_arg(op, name + ".ndim", shape.size(), shape.size() <= static_cast<size_t>(kMaxDims), "must be <= 4");
  TensorView v;
  v.dtype = *dtype;
  v.ndim = static_cast<int>(shape.size());
  v.device = Device::cpu();
  auto data = ai["data"].cast<std::pair<intptr_t, bool>>();
  v.data = reinterpret_cast<void*>(data.first);
  *read_only = data.second;
  pyb::object strides = ai.contains("strides") ? pyb::object(ai["strides"]) : pyb::object(pyb::none());
  std::vector<int64_t> st;
  if (!strides.is_none()) st = strides.cast<std::vector<int64_t>>();
  int64_t s = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = shape[i];
    if (!st.empty() && st[i] % bytes != 0)
      throw InvalidArgument(arg_message(op, name + ".strides[" + std::to_string(i) + "]", st[i], "must be a multiple of the item size (bytes)"));
    v.strides[i] = st.empty() ? s : st[i] / bytes;
    s *= shape[i];
  }
  return v;
}

}  // namespace

Borrowed::~Borrowed() {
  if (versioned && versioned->deleter) versioned->deleter(versioned);
  if (legacy && legacy->deleter) legacy->deleter(legacy);
}

Stream to_stream(int64_t handle) { return Stream{reinterpret_cast<void*>(static_cast<intptr_t>(handle))}; }

void order_streams(int64_t producer_stream, int64_t consumer_stream, int device) {
  if (producer_stream == consumer_stream) return;
#ifdef EPX_WITH_CUDA
  auto check = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw CudaError(std::string("epx.Tensor.__dlpack__: ") + what + ": " + cudaGetErrorString(e));
  };
  int prev = 0;
  check(cudaGetDevice(&prev), "cudaGetDevice");
  if (prev != device) check(cudaSetDevice(device), "cudaSetDevice");
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  cudaError_t e1 = cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(producer_stream)));
  cudaError_t e2 = e1 == cudaSuccess ? cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(consumer_stream)), ev, 0)
                                     : cudaSuccess;
  cudaEventDestroy(ev);
  if (prev != device) cudaSetDevice(prev);
  check(e1, "cudaEventRecord");
  check(e2, "cudaStreamWaitEvent");
#else
  (void)device;
#endif
}

TensorView CallArgs::get_impl(pyb::handle obj, const char* name_c, std::optional<DType> bits_as, bool optional, bool writes) {
  const std::string name(name_c);
  last_read_only_ = false;
  try {
    if (obj.is_none()) {
      if (optional) return TensorView();
      throw InvalidArgument(arg_message(op_, name, "None", "must be a tensor"));
    }
    if (pyb::isinstance<PyTensor>(obj)) {
      const PyTensor& t = obj.cast<const PyTensor&>();
      if (writes && t.read_only)
        throw InvalidArgument(arg_message(op_, name, "a read-only epx.Tensor", "must be writable: epx writes this output"));
      if (t.view.device.is_cuda()) order_streams(t.stream, stream_, t.view.device.index);
      last_read_only_ = t.read_only;
      return t.view;
    }
    if (!pyb::hasattr(obj, "__dlpack__")) {
      throw pyb::type_error(op_ + ": " + name + ": expected a tensor (torch.Tensor, numpy.ndarray, epx.Tensor or any object with "
                            "__dlpack__), got " + pyb::str(pyb::type::of(obj)).cast<std::string>());
    }
    return import_dlpack(obj, name, bits_as, writes);
  } catch (...) {
    remember(std::current_exception());
    return placeholder();
  }
}

TensorView CallArgs::placeholder() {
  TensorView poison;  // 0-d uint8: every entry point rejects it, on every rank
  poison.dtype = DType::uint8;
  return poison;
}

void CallArgs::remember(std::exception_ptr e) {
  if (error_) return;  // the first error is the one reported
  error_ = e;
  try {
    std::rethrow_exception(e);
  } catch (pyb::error_already_set& py) {
    message_ = pyb::str(py.value()).cast<std::string>();
    unsupported_ = py.matches(PyExc_NotImplementedError);
  } catch (const Unsupported& u) {
    message_ = u.what();
    unsupported_ = true;
  } catch (const std::exception& x) {
    message_ = x.what();
  } catch (...) {
    message_ = op_ + ": an argument could not be converted";
  }
}

bool CallArgs::reject(pyb::handle exc) {
  if (exc.is_none()) return false;
  if (!PyExceptionInstance_Check(exc.ptr()))
    throw pyb::type_error(op_ + ": reject: expected an exception instance, got " + pyb::str(pyb::type::of(exc)).cast<std::string>());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  remember(std::make_exception_ptr(pyb::error_already_set()));
  return true;
}

namespace {

/// (device_type, device_id) of a producer's __dlpack_device__(), or (kCPU, 0) when it has none.
std::pair<int, int> dlpack_device_of(pyb::handle src, const std::string& op, const std::string& name) {
  if (!pyb::hasattr(src, "__dlpack_device__")) return {dl::kCPU, 0};
  pyb::object d = src.attr("__dlpack_device__")();
  try {
    auto t = d.cast<pyb::tuple>();
    if (t.size() == 2) return {t[0].cast<int>(), t[1].cast<int>()};
  } catch (const pyb::cast_error&) {
  }
  throw InvalidArgument(arg_message(op, name + ".__dlpack_device__()", pyb::repr(d).cast<std::string>(),
                                    "must be a (device_type, device_id) tuple of ints"));
}

bool is_cuda_device_type(int t) { return t == dl::kCUDA || t == dl::kCUDAManaged; }

}  // namespace

TensorView CallArgs::import_dlpack(pyb::handle obj, const std::string& name, std::optional<DType> bits_as, bool writes) {
  pyb::object src = pyb::reinterpret_borrow<pyb::object>(obj);
  std::optional<DType> forced;
  const auto dev = dlpack_device_of(src, op_, name);
  // The Python array API protocol: stream only for CUDA producers (None for CPU ones; numpy refuses
  // any other value), where 1 names the legacy default stream (0 is ambiguous and not allowed);
  // max_version asks for a versioned (DLPack 1.x) capsule, which can say read-only.
  const bool cuda = is_cuda_device_type(dev.first);
  auto call = [&](bool versioned) -> pyb::object {
    pyb::dict k;  // a fresh dict per call (a pyb::dict copy would alias the same Python dict)
    if (cuda) k["stream"] = stream_ == 0 ? int64_t{1} : stream_;
    if (versioned) k["max_version"] = pyb::make_tuple(dl::kMaxMajor, dl::kMaxMinor);
    return src.attr("__dlpack__")(**k);
  };
  pyb::object cap;
  try {
    try {
      cap = call(true);
    } catch (pyb::error_already_set& e) {
      // Producers older than DLPack 1.0 (numpy < 2, torch < 2.4) take no max_version: TypeError.
      if (!e.matches(PyExc_TypeError)) throw;
      cap = call(false);
    }
  } catch (pyb::error_already_set& e) {
    // numpy 1.x cannot export a read-only array through DLPack 0.x: borrow it through the array
    // interface instead, still without a copy.
    bool ro = false;
    if (auto v = from_array_interface(src, op_, name, bits_as, &ro)) {
      if (writes && ro)
        throw InvalidArgument(arg_message(op_, name, "a read-only array", "must be writable: epx writes this output"));
      last_read_only_ = ro;
      return *v;
    }
    // torch exports no float8 through DLPack in some versions: borrow the same bytes as uint8.
    if (!is_torch_fp8(src)) throw InvalidArgument(op_ + ": " + name + ".__dlpack__() failed: " + e.what());
    src = src.attr("view")(pyb::module_::import("torch").attr("uint8"));
    forced = DType::fp8_e4m3;
    try {
      cap = call(true);
    } catch (pyb::error_already_set& e2) {
      if (!e2.matches(PyExc_TypeError)) throw;
      cap = call(false);
    }
  }
  keep_.push_back(std::make_unique<Borrowed>());
  const Imported im = consume_capsule(cap, op_, name, *keep_.back());
  const dl::Tensor& d = *im.tensor;
  if (writes && im.read_only)
    throw InvalidArgument(arg_message(op_, name, "a read-only DLPack tensor", "must be writable: epx writes this output"));
  if (writes && im.is_copied)
    throw InvalidArgument(arg_message(op_, name, "a copy made by its producer (DLPack IS_COPIED)",
                                      "must be the caller's memory: epx writes this output"));
  auto dtype = forced ? forced : from_dl_dtype(d.dtype, bits_as);
  if (!dtype) {
    throw InvalidArgument(arg_message(op_, name + ".dtype", dl_dtype_name(d.dtype),
                                      "epx takes fp32, bf16, fp16, fp8_e4m3, e8m0, int32, int64 or uint8"
                                      " (numpy: bf16 as uint16 bit patterns)"));
  }
  require_arg(op_, name + ".ndim", d.ndim, d.ndim >= 0 && d.ndim <= kMaxDims, "must be in [0, 4]");
  if (d.ndim > 0 && !d.shape) throw InvalidArgument(arg_message(op_, name + ".shape", "NULL", "must be given for ndim > 0"));
  TensorView v;
  v.dtype = *dtype;
  v.ndim = d.ndim;
  if (d.device.device_type == dl::kCPU || d.device.device_type == dl::kCUDAHost) {
    v.device = Device::cpu();  // pinned host memory is host memory
  } else if (is_cuda_device_type(d.device.device_type)) {
    require_arg(op_, name + ".device_id", d.device.device_id, d.device.device_id >= 0, "must be >= 0");
    v.device = Device::cuda(d.device.device_id);
  } else {
    throw InvalidArgument(arg_message(op_, name + ".device", "DLPack device type " + std::to_string(d.device.device_type),
                                      "must be CPU memory (1), CUDA host memory (3), CUDA device memory (2) or CUDA managed memory (13)"));
  }
  int64_t s = 1;
  for (int i = d.ndim - 1; i >= 0; --i) {
    require_arg(op_, name + ".shape[" + std::to_string(i) + "]", d.shape[i], d.shape[i] >= 0, "must be >= 0");
    v.shape[i] = d.shape[i];
    v.strides[i] = d.strides ? d.strides[i] : s;
    s *= d.shape[i];
  }
  v.data = d.data ? static_cast<char*>(d.data) + d.byte_offset : nullptr;
  if (v.numel() == 0) {  // an empty tensor's strides mean nothing (producers disagree on them)
    int64_t c = 1;
    for (int i = v.ndim - 1; i >= 0; --i) {
      v.strides[i] = c;
      c *= std::max<int64_t>(v.shape[i], 1);
    }
  } else {
    if (!v.data) throw InvalidArgument(arg_message(op_, name + ".data", "NULL", "must point to the elements of a non-empty tensor"));
    const auto addr = reinterpret_cast<uintptr_t>(v.data);
    const int64_t align = dtype_size(v.dtype);
    require_arg(op_, name + ".data", "0x" + to_hex(addr), align <= 1 || addr % static_cast<uintptr_t>(align) == 0,
                "must be aligned to the element size (" + std::to_string(align) + " bytes)");
  }
  last_read_only_ = im.read_only;
  return v;
}

dl::DataType to_dl_dtype(DType t, bool as_bits) {
  const uint8_t bits = static_cast<uint8_t>(8 * dtype_size(t));
  if (as_bits) {
    switch (t) {
      case DType::bf16: case DType::fp16: case DType::fp8_e4m3: case DType::e8m0: case DType::fp4_e2m1x2:
        return {dl::kUInt, bits, 1};
      default: break;
    }
  }
  switch (t) {
    case DType::fp32: case DType::fp16: return {dl::kFloat, bits, 1};
    case DType::bf16: return {dl::kBfloat, 16, 1};
    case DType::fp8_e4m3: return {dl::kFloat8_e4m3fn, 8, 1};
    case DType::e8m0: return {dl::kFloat8_e8m0fnu, 8, 1};
    case DType::fp4_e2m1x2: case DType::uint8: return {dl::kUInt, 8, 1};  // fp4 pairs leave as bytes
    case DType::int32: case DType::int64: return {dl::kInt, bits, 1};
  }
  return {dl::kUInt, 8, 1};
}

pyb::object wrap_view(const TensorView& v, pyb::object owner, int64_t stream) {
  PyTensor t;
  t.view = v;
  t.owner = std::move(owner);
  t.stream = stream;
  return pyb::cast(std::move(t));
}

pyb::object wrap_owned(Tensor x, int64_t stream) {
  PyTensor t;
  t.view = x.view();
  t.owned = std::move(x);
  t.stream = stream;
  return pyb::cast(std::move(t));
}

namespace {

/// What a DLPack consumer holds: the exporting epx.Tensor (kept alive) and the shape/strides arrays.
struct ExportCtx {
  pyb::object self;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];
  dl::ManagedTensor legacy;
  dl::ManagedTensorVersioned versioned;
};

void release_ctx(ExportCtx* c) {
  // A deleter called after the interpreter is gone (a consumer's C++ static destructor) leaks
  // rather than touching Python.
  if (!Py_IsInitialized()) return;
  // Consumers may call the deleter without the GIL (DLPack spec).
  PyGILState_STATE s = PyGILState_Ensure();
  delete c;
  PyGILState_Release(s);
}

void legacy_deleter(dl::ManagedTensor* m) { release_ctx(static_cast<ExportCtx*>(m->manager_ctx)); }
void versioned_deleter(dl::ManagedTensorVersioned* m) { release_ctx(static_cast<ExportCtx*>(m->manager_ctx)); }

void legacy_capsule_destructor(PyObject* cap) {
  if (PyCapsule_IsValid(cap, kLegacyName)) {  // never consumed
    auto* m = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(cap, kLegacyName));
    if (m) m->deleter(m);
  }
}
void versioned_capsule_destructor(PyObject* cap) {
  if (PyCapsule_IsValid(cap, kVersionedName)) {
    auto* m = static_cast<dl::ManagedTensorVersioned*>(PyCapsule_GetPointer(cap, kVersionedName));
    if (m) m->deleter(m);
  }
}

int dl_device_type(const Device& d) { return d.is_cpu() ? dl::kCPU : dl::kCUDA; }

/// A __dlpack__ keyword argument of the wrong type is a TypeError naming it (not pybind11's cast error).
template <class T>
T arg_cast(pyb::handle v, const char* name, const char* rule) {
  try {
    return v.cast<T>();
  } catch (const pyb::cast_error&) {
    throw pyb::type_error(std::string("epx.Tensor.__dlpack__: ") + name + " = " + pyb::repr(v).cast<std::string>() + ": must be " + rule);
  }
}

pyb::object export_dlpack(pyb::object self, pyb::object stream, pyb::object max_version, pyb::object dl_device, pyb::object copy) {
  const PyTensor& t = self.cast<const PyTensor&>();
  const Device dev = t.view.device;
  if (!copy.is_none() && arg_cast<bool>(copy, "copy", "None or a bool"))
    throw pyb::buffer_error("epx.Tensor.__dlpack__: copy = True: epx exports without copying only");
  if (!dl_device.is_none()) {
    auto want = arg_cast<std::pair<int, int>>(dl_device, "dl_device", "None or a (device_type, device_id) tuple of ints");
    if (want.first != dl_device_type(dev) || want.second != dev.index)
      throw pyb::buffer_error("epx.Tensor.__dlpack__: dl_device = (" + std::to_string(want.first) + ", " +
                              std::to_string(want.second) + "): the tensor is on " + dev.str() + " and is not copied");
  }
  if (dev.is_cuda() && !stream.is_none()) {
    const int64_t s = arg_cast<int64_t>(stream, "stream", "None or an int (1 = legacy default stream, 2 = per-thread, else a cudaStream_t)");
    if (s != -1) {
      // DLPack: 1 = legacy default stream, 2 = per-thread default stream, else a cudaStream_t.
      const int64_t consumer = s == 1 ? 0 : s;
      order_streams(t.stream, consumer, dev.index);
    }
  }
  // DLPack >= 1.0 when the consumer asks for it, at a version no newer than its max_version (the ABI
  // of 1.0 and 1.1 is the same; 1.1 only added dtype codes).
  bool versioned = false;
  uint32_t minor = dl::kMaxMinor;
  if (!max_version.is_none()) {
    const auto mv = arg_cast<std::pair<int, int>>(max_version, "max_version", "None or a (major, minor) tuple of ints");
    versioned = mv.first >= 1;
    if (mv.first == 1 && mv.second < static_cast<int>(dl::kMaxMinor)) minor = static_cast<uint32_t>(std::max(mv.second, 0));
  }
  // DLPack 0.x has no read-only flag: memory epx borrowed read-only is not handed out as writable.
  if (t.read_only && !versioned)
    throw pyb::buffer_error("epx.Tensor.__dlpack__: the tensor is read-only, which only DLPack >= 1.0 can say: "
                            "pass max_version=(1, 0) or newer");
  auto* c = new ExportCtx();
  c->self = self;
  for (int i = 0; i < t.view.ndim; ++i) {
    c->shape[i] = t.view.shape[i];
    c->strides[i] = t.view.strides[i];
  }
  dl::Tensor d{};
  d.data = t.view.data;
  d.device = {dl_device_type(dev), dev.is_cpu() ? 0 : dev.index};
  d.ndim = t.view.ndim;
  d.dtype = to_dl_dtype(t.view.dtype, t.as_bits);
  d.shape = c->shape;
  d.strides = c->strides;
  d.byte_offset = 0;
  PyObject* cap;
  if (versioned) {
    c->versioned = dl::ManagedTensorVersioned{{dl::kMaxMajor, minor}, c, &versioned_deleter, t.read_only ? dl::kFlagReadOnly : 0, d};
    cap = PyCapsule_New(&c->versioned, kVersionedName, &versioned_capsule_destructor);
  } else {
    c->legacy = dl::ManagedTensor{d, c, &legacy_deleter};
    cap = PyCapsule_New(&c->legacy, kLegacyName, &legacy_capsule_destructor);
  }
  if (!cap) {
    delete c;
    throw pyb::error_already_set();
  }
  return pyb::reinterpret_steal<pyb::object>(cap);
}

/// fp32 copy on the CPU of a float tensor (bf16 / fp16 / fp8_e4m3 / e8m0 / fp32), any device.
Tensor to_float32(const TensorView& v) {
  require_arg("epx.Tensor.float", "dtype", dtype_name(v.dtype),
              v.dtype == DType::fp32 || v.dtype == DType::bf16 || v.dtype == DType::fp16 || v.dtype == DType::fp8_e4m3 ||
                  v.dtype == DType::e8m0,
              "must be a float dtype (fp32, bf16, fp16, fp8_e4m3, e8m0)");
  check_contiguous("epx.Tensor.float", "self", v);
  std::vector<int64_t> dims(v.shape.begin(), v.shape.begin() + v.ndim);
  Tensor host = Tensor::empty(dims, v.dtype);
  copy(host.view(), v);
  Tensor out = Tensor::empty(dims, DType::fp32);
  const int64_t n = v.numel();
  float* o = out.ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    switch (v.dtype) {
      case DType::fp32: o[i] = host.ptr<float>()[i]; break;
      case DType::bf16: o[i] = bf16_bits_to_float(host.ptr<uint16_t>()[i]); break;
      case DType::fp16: o[i] = fp16_bits_to_float(host.ptr<uint16_t>()[i]); break;
      case DType::fp8_e4m3: o[i] = fp8_e4m3_bits_to_float(host.ptr<uint8_t>()[i]); break;
      case DType::e8m0: o[i] = e8m0_bits_to_float(host.ptr<uint8_t>()[i]); break;
      default: break;
    }
  }
  return out;
}

/// New CPU tensor of `dtype` from fp32 values (RNE; fp8 saturating, as epx/dtype.h).
Tensor from_float32(const TensorView& v, DType dtype) {
  require_arg("epx.from_float", "x.dtype", dtype_name(v.dtype), v.dtype == DType::fp32, "must be fp32 (float32)");
  require_arg("epx.from_float", "x.device", v.device.str(), v.device.is_cpu(), "must be cpu");
  check_contiguous("epx.from_float", "x", v);
  require_arg("epx.from_float", "dtype", dtype_name(dtype),
              dtype == DType::fp32 || dtype == DType::bf16 || dtype == DType::fp16 || dtype == DType::fp8_e4m3,
              "must be fp32, bf16, fp16 or fp8_e4m3");
  std::vector<int64_t> dims(v.shape.begin(), v.shape.begin() + v.ndim);
  Tensor out = Tensor::empty(dims, dtype);
  const float* x = v.ptr<float>();
  const int64_t n = v.numel();
  for (int64_t i = 0; i < n; ++i) {
    switch (dtype) {
      case DType::fp32: out.ptr<float>()[i] = x[i]; break;
      case DType::bf16: out.ptr<uint16_t>()[i] = float_to_bf16_bits(x[i]); break;
      case DType::fp16: out.ptr<uint16_t>()[i] = float_to_fp16_bits(x[i]); break;
      case DType::fp8_e4m3: out.ptr<uint8_t>()[i] = float_to_fp8_e4m3_bits(x[i]); break;
      default: break;
    }
  }
  return out;
}

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    try {
      size_t used = 0;
      const int i = std::stoi(s.substr(5), &used);
      if (used == s.size() - 5 && i >= 0) return Device::cuda(i);
    } catch (const std::exception&) {
    }
  }
  throw InvalidArgument(arg_message("epx", "device", s, "must be \"cpu\", \"cuda\" or \"cuda:N\""));
}

}  // namespace

Device device_from_string(const std::string& s) { return parse_device(s); }

void bind_tensor(pyb::module_& m) {
  pyb::class_<PyTensor>(m, "Tensor", R"doc(
A tensor held by epx (its own allocation, or a view into a backend's buffers that keeps the backend
alive). Hand it to any framework without a copy: torch.from_dlpack(t), numpy.from_dlpack(t)
(numpy has no bf16/fp8: use numpy.from_dlpack(t.bits()) for their bit patterns, or t.float()).
Views returned by prepare() stay valid until the next prepare() of the same object.)doc")
      .def_property_readonly("shape", [](const PyTensor& t) {
        pyb::tuple s(t.view.ndim);
        for (int i = 0; i < t.view.ndim; ++i) s[i] = t.view.shape[i];
        return s;
      })
      .def_property_readonly("strides", [](const PyTensor& t) {
        pyb::tuple s(t.view.ndim);
        for (int i = 0; i < t.view.ndim; ++i) s[i] = t.view.strides[i];
        return s;
      }, "Strides in elements.")
      .def_property_readonly("ndim", [](const PyTensor& t) { return t.view.ndim; })
      .def_property_readonly("dtype", [](const PyTensor& t) { return std::string(dtype_name(t.view.dtype)); })
      .def_property_readonly("device", [](const PyTensor& t) { return t.view.device.str(); })
      .def_property_readonly("data_ptr", [](const PyTensor& t) { return reinterpret_cast<intptr_t>(t.view.data); })
      .def_property_readonly("nbytes", [](const PyTensor& t) { return t.view.nbytes(); })
      .def_property_readonly("read_only", [](const PyTensor& t) { return t.read_only; },
                             "Borrowed from a read-only producer (DLPack read-only flag, numpy writeable=False): "
                             "epx never writes it, and exports it read-only (DLPack >= 1.0 only).")
      .def_property_readonly("stream", [](const PyTensor& t) { return t.stream; },
                             "cudaStream_t (int) the data was produced on; 0 = legacy default stream.")
      .def("numel", [](const PyTensor& t) { return t.view.numel(); })
      .def("is_contiguous", [](const PyTensor& t) { return t.view.is_contiguous(); })
      .def("__repr__", [](const PyTensor& t) { return "epx.Tensor(" + t.view.describe() + ")"; })
      .def("__dlpack__", &export_dlpack, pyb::kw_only(), pyb::arg("stream") = pyb::none(), pyb::arg("max_version") = pyb::none(),
           pyb::arg("dl_device") = pyb::none(), pyb::arg("copy") = pyb::none(),
           "DLPack export (Python array API): no copy; on CUDA the data is ordered before `stream`.")
      .def("__dlpack_device__", [](const PyTensor& t) {
        return std::make_pair(dl_device_type(t.view.device), t.view.device.is_cpu() ? 0 : t.view.device.index);
      })
      .def("bits", [](pyb::object self) {
        const PyTensor& t = self.cast<const PyTensor&>();
        PyTensor b;
        b.view = t.view;
        b.owner = self;
        b.stream = t.stream;
        b.as_bits = true;
        b.read_only = t.read_only;
        return b;
      }, "The same memory exported as unsigned integers of the element width (bf16 -> uint16, fp8 -> uint8), for numpy.")
      .def("float", [](const PyTensor& t) { return wrap_owned(to_float32(t.view)); },
           "fp32 copy on the CPU (bf16, fp16, fp8_e4m3, e8m0 decoded exactly).");

  m.def("empty", [](std::vector<int64_t> shape, const std::string& dtype, const std::string& device) {
    return wrap_owned(Tensor::empty(std::move(shape), parse_dtype(dtype), parse_device(device)));
  }, pyb::arg("shape"), pyb::arg("dtype"), pyb::arg("device") = "cpu", "Uninitialised epx.Tensor (dtype name such as \"bf16\").");
  m.def("zeros", [](std::vector<int64_t> shape, const std::string& dtype, const std::string& device) {
    return wrap_owned(Tensor::zeros(std::move(shape), parse_dtype(dtype), parse_device(device)));
  }, pyb::arg("shape"), pyb::arg("dtype"), pyb::arg("device") = "cpu");
  m.def("from_float", [](pyb::handle x, const std::string& dtype) {
    CallArgs a("epx.from_float", 0);
    TensorView v = a.get(x, "x");
    a.rethrow_local();
    return wrap_owned(from_float32(v, parse_dtype(dtype)));
  }, pyb::arg("x"), pyb::arg("dtype"),
        "New CPU epx.Tensor of `dtype` (bf16, fp16, fp8_e4m3, fp32) from a float32 CPU array: round to nearest even, "
        "fp8 saturating at +-448 (epx/dtype.h).");
  m.def("as_tensor", [](pyb::handle x, std::optional<std::string> dtype) {
    CallArgs a("epx.as_tensor", 0);
    std::optional<DType> bits;
    if (dtype) bits = parse_dtype(*dtype);
    TensorView v = a.get(x, "x", bits);
    a.rethrow_local();
    if (bits && v.dtype != *bits)
      throw InvalidArgument(arg_message("epx.as_tensor", "x.dtype", dtype_name(v.dtype), "must be " + *dtype + " or its bit pattern"));
    PyTensor t;
    t.view = v;
    t.owner = pyb::reinterpret_borrow<pyb::object>(x);
    t.read_only = a.last_read_only();
    return t;
  }, pyb::arg("x"), pyb::arg("dtype") = pyb::none(),
        "Borrow an array (no copy) as an epx.Tensor; with dtype, unsigned bit patterns are read as that dtype "
        "(numpy uint16 as bf16). The array must own its memory (numpy, torch), as the view outlives the DLPack capsule.");
}

}  // namespace epx::py
