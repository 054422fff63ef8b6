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
