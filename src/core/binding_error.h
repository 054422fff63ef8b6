// core/binding_error.h: an argument error a language binding found before a collective call.
//
// The Python bindings (python/src/py_tensor.h, call_released) turn an argument they cannot convert
// (a float64 array, a list, a rejection by the deepep shim) into a placeholder that every entry point
// rejects, and still make the collective call, so every rank raises instead of the others hanging.
// Without this, the sentence the other ranks read would be the placeholder's own rejection
// ("x.dtype = uint8: must be bf16") instead of the real problem. While a ScopedBindingError lives on
// a thread, the status exchange of that thread's failing call (dispatch/prepare_finalize_base.h
// exchange_status) publishes the binding's sentence instead.
#pragma once

#include <string>

namespace epx::detail {

struct BindingError {
  std::string message;       ///< the binding's sentence
  bool unsupported = false;  ///< Unsupported rather than InvalidArgument
};

/// The binding's error for the call running on this thread, or nullptr.
const BindingError* pending_binding_error();

/// Sets the error for this thread while it lives (the previous one is restored after).
class ScopedBindingError {
 public:
  ScopedBindingError(std::string message, bool unsupported);
  ~ScopedBindingError();
  ScopedBindingError(const ScopedBindingError&) = delete;
  ScopedBindingError& operator=(const ScopedBindingError&) = delete;

 private:
  BindingError error_;
  const BindingError* previous_;
};

}  // namespace epx::detail
