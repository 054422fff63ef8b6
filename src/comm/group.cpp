// comm/group.cpp: the parts of epx::Group common to every transport (built on its collectives).
#include <string>

#include "epx/error.h"
#include "epx/group.h"

namespace epx {

std::vector<int64_t> Group::all_gather_i64(int64_t value) {
  std::vector<int64_t> out(static_cast<size_t>(size()));
  all_gather(&value, out.data(), sizeof(int64_t));
  return out;
}

namespace {
// FNV-1a over the field names, so ranks that check different fields are told so instead of
// comparing unrelated values.
int64_t hash_names(const std::vector<std::pair<std::string, int64_t>>& fields) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& f : fields) {
    for (unsigned char c : f.first) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}
}  // namespace

void Group::check_agreement(const std::string& op, const std::vector<std::pair<std::string, int64_t>>& fields) {
  const int R = size();
  // Round 1: the same number and names of fields (fixed size, so it cannot itself mismatch).
  int64_t head[2] = {static_cast<int64_t>(fields.size()), hash_names(fields)};
  std::vector<int64_t> heads(static_cast<size_t>(2 * R));
  all_gather(head, heads.data(), sizeof(head));
  for (int r = 1; r < R; ++r) {
    if (heads[2 * r] != heads[0] || heads[2 * r + 1] != heads[1])
      throw CommError(op + ": checked fields differ between rank 0 (" + std::to_string(heads[0]) + " fields) and rank " +
                      std::to_string(r) + " (" + std::to_string(heads[2 * r]) + " fields): all ranks must check the same fields");
  }
  if (fields.empty()) return;
  // Round 2: the values.
  std::vector<int64_t> mine(fields.size());
  for (size_t i = 0; i < fields.size(); ++i) mine[i] = fields[i].second;
  std::vector<int64_t> all(fields.size() * static_cast<size_t>(R));
  all_gather(mine.data(), all.data(), static_cast<int64_t>(mine.size() * sizeof(int64_t)));
  for (size_t i = 0; i < fields.size(); ++i) {
    for (int r = 1; r < R; ++r) {
      const int64_t v0 = all[i], v = all[static_cast<size_t>(r) * fields.size() + i];
      if (v != v0)
        throw CommError(op + ": " + fields[i].first + " = " + std::to_string(v0) + " on rank 0 but " + std::to_string(v) + " on rank " +
                        std::to_string(r) + ": all ranks must agree");
    }
  }
}

}  // namespace epx
