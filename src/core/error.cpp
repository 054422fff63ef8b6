#include "epx/error.h"

namespace epx::detail {
void throw_assert(const char* cond, const std::string& values, std::source_location loc) {
  std::string m = "internal invariant failed: ";
  m += cond;
  if (!values.empty()) m += " (" + values + ")";
  m += " at ";
  m += loc.file_name();
  m += ":" + std::to_string(loc.line());
  throw Error(m);
}
}  // namespace epx::detail

// ---- core/binding_error.h ---------------------------------------------------------------------

#include "core/binding_error.h"

namespace epx::detail {
namespace {
thread_local const BindingError* t_binding_error = nullptr;
}  // namespace

const BindingError* pending_binding_error() { return t_binding_error; }

ScopedBindingError::ScopedBindingError(std::string message, bool unsupported)
    : error_{std::move(message), unsupported}, previous_(t_binding_error) {
  t_binding_error = &error_;
}

ScopedBindingError::~ScopedBindingError() { t_binding_error = previous_; }

}  // namespace epx::detail
