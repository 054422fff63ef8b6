// comm/bootstrap.cpp: how the ranks of an NCCL group find each other (transport-independent parts,
// built in every configuration): the UniqueId text form, the file rendezvous, and group creation
// from a launcher's environment. The NCCL calls themselves live in group_nccl.cpp (CUDA builds) or
// group_nccl_stub.cpp (CPU-only builds).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/group.h"

namespace epx {

std::string UniqueId::hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(2 * kBytes);
  for (uint8_t b : bytes) {
    s.push_back(kDigits[b >> 4]);
    s.push_back(kDigits[b & 15]);
  }
  return s;
}

UniqueId UniqueId::parse(std::string_view hex) {
  require_arg("UniqueId.parse", "hex.size", hex.size(), hex.size() == 2 * kBytes, "must be 256 hex digits");
  auto nibble = [&](size_t i) {
    const char c = hex[i];
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    throw InvalidArgument(arg_message("UniqueId.parse", "hex[" + std::to_string(i) + "]", std::string(1, c),
                                      "must be a hex digit"));
  };
  UniqueId id;
  for (size_t i = 0; i < static_cast<size_t>(kBytes); ++i)
    id.bytes[i] = static_cast<uint8_t>(nibble(2 * i) * 16 + nibble(2 * i + 1));
  return id;
}

UniqueId exchange_unique_id(const std::string& path, int rank, double timeout_s) {
  constexpr std::string_view op = "group.rendezvous";
  require_arg(op, "path", path, !path.empty(), "must name a file all ranks can reach");
  require_arg(op, "rank", rank, rank >= 0, "must be >= 0");
  if (rank == 0) {
    const UniqueId id = UniqueId::create();
    const std::string tmp = path + ".tmp." + std::to_string(getpid());
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << id.hex() << "\n";
      f.flush();
      if (!f) throw CommError(arg_message(op, "path", tmp, "cannot be written"));
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw CommError(arg_message(op, "path", path, "cannot be created (rename from " + tmp + " failed)"));
    }
    return id;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    std::ifstream f(path);
    std::string text;
    if (f && (f >> text) && text.size() == 2 * UniqueId::kBytes) return UniqueId::parse(text);
    if (std::chrono::steady_clock::now() > deadline) {
      std::ostringstream os;
      os << op << ": no unique id in " << path << " within timeout_s = " << timeout_s
         << ": rank 0 is dead, late, or was given another path (rank " << rank << " waited)";
      throw Timeout(os.str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::shared_ptr<Group> make_nccl_group(const std::string& rendezvous_path, int rank, int world, int device,
                                       double timeout_s) {
  const UniqueId id = exchange_unique_id(rendezvous_path, rank, timeout_s);
  auto group = make_nccl_group(id, rank, world, device, timeout_s);
  // Every rank has read the id once the communicator exists (its init needed all of them).
  if (rank == 0) std::remove(rendezvous_path.c_str());
  return group;
}

std::shared_ptr<Group> make_nccl_group_from_env(double timeout_s) {
  constexpr std::string_view op = "group.from_env";
  auto int_var = [&](const char* name, bool required, int fallback) {
    const std::string v = env_or(name, "");
    if (v.empty()) {
      if (required) throw InvalidArgument(std::string(op) + ": " + name + " is not set: the launcher must set it");
      return fallback;
    }
    size_t used = 0;
    int x = 0;
    try {
      x = std::stoi(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    require_arg(op, name, v, used == v.size() && x >= 0, "must be a non-negative integer");
    return x;
  };
  const int rank = int_var("EPX_RANK", true, 0);
  const int world = int_var("EPX_WORLD_SIZE", true, 0);
  require_arg(op, "EPX_RANK", rank, rank < world, "must be < EPX_WORLD_SIZE = " + std::to_string(world));
  const std::string rendezvous = env_or("EPX_RENDEZVOUS", "");
  if (rendezvous.empty()) throw InvalidArgument(std::string(op) + ": EPX_RENDEZVOUS is not set: the launcher must name a fresh file");
  int device = int_var("EPX_LOCAL_RANK", false, -1);
  if (device < 0) {
    const int n = cuda::device_count();
    if (n <= 0) throw Unsupported(std::string(op) + ": no CUDA device visible to rank " + std::to_string(rank));
    device = rank % n;
  }
  return make_nccl_group(rendezvous, rank, world, device, timeout_s);
}

}  // namespace epx
