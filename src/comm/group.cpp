// comm/group.cpp: the parts of epx::Group common to every transport (built on its collectives).
#include <algorithm>
#include <string>

#include "epx/error.h"
#include "epx/group.h"

namespace epx {

NodeLayout NodeLayout::from_keys(const std::vector<int64_t>& keys, int rank) {
  const int R = static_cast<int>(keys.size());
  require_arg("NodeLayout.from_keys", "rank", rank, rank >= 0 && rank < R, "must be in [0, keys.size() = " + std::to_string(R) + ")");
  NodeLayout l;
  l.node_of_rank.assign(static_cast<size_t>(R), -1);
  std::vector<int64_t> node_keys;  // node n's key, in order of each node's lowest rank
  for (int r = 0; r < R; ++r) {
    const auto it = std::find(node_keys.begin(), node_keys.end(), keys[static_cast<size_t>(r)]);
    l.node_of_rank[static_cast<size_t>(r)] = static_cast<int>(it - node_keys.begin());
    if (it == node_keys.end()) node_keys.push_back(keys[static_cast<size_t>(r)]);
  }
  l.num_nodes = static_cast<int>(node_keys.size());
  l.node = l.node_of_rank[static_cast<size_t>(rank)];
  l.local_rank = 0;
  l.local_size = 0;
  for (int r = 0; r < R; ++r) {
    if (l.node_of_rank[static_cast<size_t>(r)] != l.node) continue;
    if (r < rank) ++l.local_rank;
    ++l.local_size;
  }
  return l;
}

int NodeLayout::ranks_per_node() const {
  std::vector<int> count(static_cast<size_t>(num_nodes), 0);
  for (int n : node_of_rank) ++count[static_cast<size_t>(n)];
  if (node_of_rank.empty()) return local_size;
  for (int c : count)
    if (c != count[0]) return 0;
  return count[0];
}

bool NodeLayout::contiguous() const {
  for (size_t r = 1; r < node_of_rank.size(); ++r)
    if (node_of_rank[r] != node_of_rank[r - 1] && node_of_rank[r] != node_of_rank[r - 1] + 1) return false;
  return true;
}

std::vector<int> NodeLayout::ranks_of_node(int n) const {
  require_arg("NodeLayout.ranks_of_node", "n", n, n >= 0 && n < num_nodes, "must be in [0, num_nodes = " + std::to_string(num_nodes) + ")");
  std::vector<int> out;
  for (size_t r = 0; r < node_of_rank.size(); ++r)
    if (node_of_rank[r] == n) out.push_back(static_cast<int>(r));
  return out;
}

std::string NodeLayout::describe() const {
  auto plural = [](int n, const char* word) { return std::to_string(n) + " " + word + (n == 1 ? "" : "s"); };
  const int per = ranks_per_node();
  if (per > 0) return plural(num_nodes, "node") + " x " + plural(per, "rank");
  std::string sizes;
  for (int n = 0; n < num_nodes; ++n) sizes += (n ? "+" : "") + std::to_string(ranks_of_node(n).size());
  return plural(num_nodes, "node") + " of " + sizes + " ranks";
}

NodeLayout Group::node_layout() const {
  NodeLayout l;
  const int R = size();
  l.num_nodes = 1;
  l.node = 0;
  l.local_rank = rank();
  l.local_size = R;
  l.node_of_rank.assign(static_cast<size_t>(R), 0);
  l.lsa_size = R;
  return l;
}

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

void Group::check_agreement(const std::string& op, const std::vector<std::pair<std::string, int64_t>>& fields,
                            const std::function<std::string(size_t field, int64_t value)>& show) {
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
      if (v != v0) {
        auto text = [&](int64_t value) {
          std::string s = show ? show(i, value) : std::string();
          return s.empty() ? std::to_string(value) : s;
        };
        throw CommError(op + ": " + fields[i].first + " = " + text(v0) + " on rank 0 but " + text(v) + " on rank " + std::to_string(r) +
                        ": all ranks must agree");
      }
    }
  }
}

}  // namespace epx
