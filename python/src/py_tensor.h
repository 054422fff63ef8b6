// python/src/py_tensor.h: tensors crossing the Python boundary through DLPack, with no copy.
//
// In:  any object with __dlpack__ (torch.Tensor, numpy.ndarray, epx.Tensor, cupy, jax) is borrowed for
//      the duration of one call: its DLPack capsule is consumed, the TensorView points at its memory,
//      and the producer's deleter runs when the call returns. CUDA producers are asked for their data
//      on the call's stream (the __dlpack__(stream=) protocol), so no host synchronisation is needed.
// Out: epx.Tensor (PyTensor) implements __dlpack__ / __dlpack_device__; the DLPack tensor keeps the
//      PyTensor (and through it whatever owns the memory) alive until the consumer's deleter runs.
// numpy has no bf16 / fp8: where an argument must be bf16 (or fp8_e4m3), a uint16 (uint8) array of
// the bit patterns is accepted, and epx.Tensor can export itself as such bits (as_bits).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/binding_error.h"
#include "dlpack_abi.h"
#include "epx/tensor.h"

namespace epx::py {

namespace pyb = pybind11;

/// epx.Tensor.
struct PyTensor {
  TensorView view;
  Tensor owned;          ///< set when epx allocated the memory
  pyb::object owner;     ///< a Python object owning the memory `view` points into (or None)
  int64_t stream = 0;    ///< cudaStream_t (as an integer) the data was produced on; 0 = legacy default
  bool as_bits = false;  ///< export bf16/fp16 as uint16 and fp8_e4m3/e8m0 as uint8 (for numpy)
  bool read_only = false;  ///< borrowed from a read-only producer: never an output, exported read-only
};

/// A DLPack capsule consumed for one call; runs the producer's deleter exactly once, on destruction
/// (GIL held). Legacy (DLPack 0.x, "dltensor") or versioned (DLPack 1.x, "dltensor_versioned"): the two
/// structs differ in layout, so each is kept as its own type and only its own deleter is called.
class Borrowed {
 public:
  Borrowed() = default;
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  ~Borrowed();
  dl::ManagedTensor* legacy = nullptr;
  dl::ManagedTensorVersioned* versioned = nullptr;
};

/// The tensor arguments of one call. A conversion error is remembered instead of thrown, and the
/// argument becomes a view no entry point accepts (uint8, 0-d): a collective call then still joins
/// its peers and fails on every rank (BEHAVIOUR.md: a bad argument on one rank must not hang the
/// others), and this rank reports its own, more precise error (rethrow_local()); the other ranks read
/// that same sentence (call_released sets it as the call's core/binding_error.h error).
class CallArgs {
 public:
  CallArgs(std::string op, int64_t stream) : op_(std::move(op)), stream_(stream) {}
  /// An input. `bits_as`: read a uint array of the same width as this dtype (numpy has no bf16/fp8).
  /// `optional`: None gives an empty view.
  TensorView get(pyb::handle obj, const char* name, std::optional<DType> bits_as = std::nullopt, bool optional = false) {
    return get_impl(obj, name, bits_as, optional, false);
  }
  /// An output epx writes: a read-only (DLPack flag, numpy writeable=False) or copied (DLPack
  /// IS_COPIED) tensor is rejected, as the write would fail or be lost.
  TensorView get_out(pyb::handle obj, const char* name, std::optional<DType> bits_as = std::nullopt, bool optional = false) {
    return get_impl(obj, name, bits_as, optional, true);
  }
  /// Whether the last get() borrowed read-only memory (as_tensor keeps it on the epx.Tensor).
  bool last_read_only() const { return last_read_only_; }
  bool failed() const { return static_cast<bool>(error_); }
  void rethrow_local() const {
    if (error_) std::rethrow_exception(error_);
  }
  /// The sentence of the remembered error ("" when none) and whether it is an Unsupported
  /// (NotImplementedError) rather than an argument error.
  const std::string& local_message() const { return message_; }
  bool local_unsupported() const { return unsupported_; }
  /// A caller (the deepep shim) rejects this call itself: `exc`, an exception instance (e.g.
  /// epx.Unsupported("...")), is remembered as the local error and raised here after the collective
  /// call, which the other ranks leave with the same sentence. None: no rejection. Returns whether
  /// the call is rejected (then pass placeholder() in place of its main tensor).
  bool reject(pyb::handle exc);
  /// The view every entry point rejects (uint8, 0-d).
  static TensorView placeholder();
  int64_t stream() const { return stream_; }

 private:
  TensorView get_impl(pyb::handle obj, const char* name, std::optional<DType> bits_as, bool optional, bool writes);
  TensorView import_dlpack(pyb::handle obj, const std::string& name, std::optional<DType> bits_as, bool writes);

  std::string op_;
  int64_t stream_;
  bool last_read_only_ = false;
  std::exception_ptr error_;
  std::string message_;
  bool unsupported_ = false;
  void remember(std::exception_ptr e);
  std::vector<std::unique_ptr<Borrowed>> keep_;
};

/// Runs `f` without the GIL (it may block on peer ranks). A local conversion error takes
/// precedence over the error the (poisoned) call raised on every rank.
template <class F>
auto call_released(const CallArgs& args, F&& f) -> decltype(f()) {
  using R = decltype(f());
  // The other ranks read this rank's own sentence, not the placeholder's rejection (core/binding_error.h).
  std::optional<detail::ScopedBindingError> binding;
  if (args.failed()) binding.emplace(args.local_message(), args.local_unsupported());
  if constexpr (std::is_void_v<R>) {
    try {
      pyb::gil_scoped_release release;
      f();
    } catch (...) {
      args.rethrow_local();
      throw;
    }
    args.rethrow_local();
  } else {
    std::optional<R> out;
    try {
      pyb::gil_scoped_release release;
      out.emplace(f());
    } catch (...) {
      args.rethrow_local();
      throw;
    }
    args.rethrow_local();
    return std::move(*out);
  }
}

/// Stream argument: None -> 0 (legacy default), else an int handle.
Stream to_stream(int64_t handle);

/// Wraps a view into memory owned by `owner` (e.g. a backend's buffers) as an epx.Tensor.
pyb::object wrap_view(const TensorView& v, pyb::object owner, int64_t stream);
/// Wraps an owning epx::Tensor.
pyb::object wrap_owned(Tensor t, int64_t stream = 0);

/// DLPack dtype of an epx dtype (as_bits: the unsigned integer of the same width).
dl::DataType to_dl_dtype(DType t, bool as_bits);

void bind_tensor(pyb::module_& m);

/// "cpu", "cuda", "cuda:N". Throws InvalidArgument.
Device device_from_string(const std::string& s);

/// Makes the data of `producer_stream` visible on `consumer_stream` (CUDA event record + wait).
void order_streams(int64_t producer_stream, int64_t consumer_stream, int device);

}  // namespace epx::py
