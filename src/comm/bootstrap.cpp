// comm/bootstrap.cpp: how the ranks of an NCCL group find each other (transport-independent parts,
// built in every configuration): the UniqueId text form, the file and TCP rendezvous, the node key
// (which ranks share a node, by NCCL's rules), and group creation from a launcher's environment. The NCCL calls themselves live in group_nccl.cpp (CUDA builds) or
// group_nccl_stub.cpp (CPU-only builds).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <algorithm>
#include <array>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/timeout.h"
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
  require_timeout(op, "timeout_s", timeout_s);
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

// ---- TCP rendezvous ------------------------------------------------------------------------------
//
// Wire format (host byte order; every rank of one group runs the same build on the same kind of host):
//   hello (rank r -> rank 0): magic, version, rank, world                      4 x int32
//   reply (rank 0 -> rank r): magic, status, rank 0's world, 0, then the id    4 x int32 + 128 bytes
// status: 0 ok, 1 world differs, 2 rank outside [1, world), 3 rank already connected.
namespace {

using Clock = std::chrono::steady_clock;
constexpr int32_t kMagic = 0x52585045;  // "EPXR"
constexpr int32_t kVersion = 1;

struct Hello {
  int32_t magic = kMagic, version = kVersion, rank = 0, world = 0;
};
struct Reply {
  int32_t magic = kMagic, status = 0, world = 0, reserved = 0;
  std::array<uint8_t, UniqueId::kBytes> id{};
};

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// The full n bytes, or false on EOF, error or deadline (errno-free: the caller names what it waited for).
bool io_full(int fd, void* buf, size_t n, Clock::time_point deadline, bool write) {
  auto* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    pollfd pfd{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    const int left = ms_left(deadline);
    if (left == 0) return false;
    const int pr = ::poll(&pfd, 1, left);
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return false;
    const ssize_t k = write ? ::send(fd, p + done, n - done, MSG_NOSIGNAL) : ::recv(fd, p + done, n - done, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (k <= 0) return false;
    done += static_cast<size_t>(k);
  }
  return true;
}

std::string endpoint(const std::string& host, int port) {
  return "tcp://" + (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// Rank 0: a listening socket on every interface (IPv6 dual-stack where the host has IPv6, else IPv4).
Fd listen_on(int port, int backlog, const std::string& where) {
  std::string why;
  for (int family : {AF_INET6, AF_INET}) {
    Fd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (fd.get() < 0) {
      why = std::strerror(errno);
      continue;
    }
    const int one = 1, zero = 0;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc = 0;
    if (family == AF_INET6) {
      (void)::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    if (rc != 0 || ::listen(fd.get(), backlog) != 0) {
      why = std::strerror(errno);
      if (errno == EADDRINUSE) break;  // the other family would fail the same way
      continue;
    }
    set_nonblocking(fd.get());
    return fd;
  }
  throw CommError("group.rendezvous: rank 0 cannot listen on port " + std::to_string(port) + " for " + where + ": " + why +
                  " (pick a free port for EPX_RENDEZVOUS)");
}

// Ranks > 0: a connected socket to host:port, retrying (rank 0 may not listen yet) until the deadline.
Fd connect_to(const std::string& host, int port, Clock::time_point deadline, int rank, double timeout_s) {
  const std::string where = endpoint(host, port);
  std::string last = "no answer";
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai == EAI_NONAME)
      throw InvalidArgument(arg_message("group.rendezvous", "host", host, "cannot be resolved (" + std::string(gai_strerror(gai)) + ")"));
    if (gai != 0) last = gai_strerror(gai);
    for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
      if (fd.get() < 0) continue;
      set_nonblocking(fd.get());
      int rc = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd pfd{fd.get(), POLLOUT, 0};
        const int pr = ::poll(&pfd, 1, std::min(ms_left(deadline), 1000));
        int err = ETIMEDOUT;
        socklen_t len = sizeof err;
        if (pr > 0) (void)::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      }
      if (rc == 0) {
        ::freeaddrinfo(res);
        const int one = 1;
        (void)::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return fd;
      }
      last = std::strerror(errno);
    }
    if (res) ::freeaddrinfo(res);
    if (Clock::now() >= deadline) {
      std::ostringstream os;
      os << "group.rendezvous: rank " << rank << " could not reach rank 0 at " << where << " within timeout_s = " << timeout_s
         << " (last error: " << last << "): rank 0 is dead, late, or listens elsewhere";
      throw Timeout(os.str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

UniqueId exchange_unique_id_tcp(const std::string& host, int port, int rank, int world, double timeout_s, const UniqueId* id) {
  constexpr std::string_view op = "group.rendezvous";
  require_arg(op, "host", host, !host.empty(), "must name rank 0's host");
  require_arg(op, "port", port, port >= 1 && port <= 65535, "must be in [1, 65535]");
  require_arg(op, "world", world, world >= 1, "must be >= 1");
  require_arg(op, "rank", rank, rank >= 0 && rank < world, "must be in [0, world = " + std::to_string(world) + ")");
  require_timeout(op, "timeout_s", timeout_s);
  const std::string where = endpoint(host, port);
  const Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));

  if (rank != 0) {
    Fd fd = connect_to(host, port, deadline, rank, timeout_s);
    Hello h;
    h.rank = rank;
    h.world = world;
    Reply rep;
    if (!io_full(fd.get(), &h, sizeof h, deadline, true) || !io_full(fd.get(), &rep, sizeof rep, deadline, false)) {
      std::ostringstream os;
      os << op << ": rank " << rank << " connected to " << where << " but got no unique id within timeout_s = " << timeout_s
         << ": rank 0 failed, or other ranks never connected (rank 0 answers once all world = " << world << " ranks have)";
      if (Clock::now() >= deadline) throw Timeout(os.str());
      throw CommError(os.str());
    }
    if (rep.magic != kMagic) throw CommError(std::string(op) + ": " + where + " answered rank " + std::to_string(rank) + " with something else than an epx rendezvous");
    if (rep.status == 1)
      throw CommError(std::string(op) + ": world = " + std::to_string(world) + " on rank " + std::to_string(rank) + " but " +
                      std::to_string(rep.world) + " on rank 0 (" + where + "): all ranks must agree");
    if (rep.status == 3)
      throw CommError(std::string(op) + ": rank " + std::to_string(rank) + " connected to " + where + " twice: two processes were given rank " +
                      std::to_string(rank));
    if (rep.status != 0)
      throw CommError(std::string(op) + ": rank 0 at " + where + " refused rank " + std::to_string(rank) + " (status " + std::to_string(rep.status) + ")");
    UniqueId out;
    out.bytes = rep.id;
    return out;
  }

  const UniqueId mine = id ? *id : UniqueId::create();
  if (world == 1) return mine;
  Fd listener = listen_on(port, world, where);
  std::vector<Fd> peers(static_cast<size_t>(world));  // by rank; [0] unused
  int joined = 0;
  while (joined < world - 1) {
    pollfd pfd{listener.get(), POLLIN, 0};
    const int left = ms_left(deadline);
    const int pr = left == 0 ? 0 : ::poll(&pfd, 1, left);
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) {
      std::string missing;
      for (int r = 1; r < world; ++r)
        if (peers[static_cast<size_t>(r)].get() < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      std::ostringstream os;
      os << op << ": rank 0 at " << where << " heard from " << joined << " of " << world - 1 << " ranks within timeout_s = " << timeout_s
         << ": rank(s) " << missing << " never connected (dead, late, or given another EPX_RENDEZVOUS)";
      throw Timeout(os.str());
    }
    Fd c(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (c.get() < 0) continue;
    Hello h{};
    Reply rep;
    rep.world = world;
    // A connection that says nothing within a second is not an epx rank (a port scanner): drop it.
    if (!io_full(c.get(), &h, sizeof h, std::min(deadline, Clock::now() + std::chrono::seconds(1)), false) || h.magic != kMagic ||
        h.version != kVersion)
      continue;
    if (h.world != world) rep.status = 1;
    else if (h.rank < 1 || h.rank >= world) rep.status = 2;
    else if (peers[static_cast<size_t>(h.rank)].get() >= 0) rep.status = 3;
    if (rep.status != 0) {
      (void)io_full(c.get(), &rep, sizeof rep, deadline, true);
      std::ostringstream os;
      os << op << ": rank 0 at " << where << ": ";
      if (rep.status == 1) os << "world = " << world << " on rank 0 but " << h.world << " on rank " << h.rank << ": all ranks must agree";
      else if (rep.status == 2) os << "a peer says it is rank " << h.rank << ", outside [1, world = " << world << ")";
      else os << "rank " << h.rank << " connected twice: two processes were given rank " << h.rank;
      throw CommError(os.str());
    }
    peers[static_cast<size_t>(h.rank)] = std::move(c);
    ++joined;
  }
  Reply rep;
  rep.world = world;
  rep.id = mine.bytes;
  for (int r = 1; r < world; ++r)
    if (!io_full(peers[static_cast<size_t>(r)].get(), &rep, sizeof rep, deadline, true))
      throw CommError(std::string(op) + ": rank 0 at " + where + " could not send the unique id to rank " + std::to_string(r) +
                      " (it closed the connection)");
  return mine;
}

RendezvousAddress RendezvousAddress::parse(std::string_view text) {
  constexpr std::string_view op = "group.rendezvous";
  constexpr std::string_view rule = "must be a file path or tcp://host:port (IPv6 as tcp://[addr]:port), port in [1, 65535]";
  RendezvousAddress a;
  require_arg(op, "EPX_RENDEZVOUS", std::string(text), !text.empty(), rule);
  constexpr std::string_view scheme = "tcp://";
  if (text.substr(0, scheme.size()) != scheme) {
    require_arg(op, "EPX_RENDEZVOUS", std::string(text), text.find("://") == std::string_view::npos, rule);
    a.path = std::string(text);
    return a;
  }
  a.tcp = true;
  std::string_view rest = text.substr(scheme.size());
  std::string_view host, port;
  if (!rest.empty() && rest.front() == '[') {
    const size_t close = rest.find(']');
    require_arg(op, "EPX_RENDEZVOUS", std::string(text), close != std::string_view::npos && close + 1 < rest.size() && rest[close + 1] == ':', rule);
    host = rest.substr(1, close - 1);
    port = rest.substr(close + 2);
  } else {
    const size_t colon = rest.rfind(':');
    require_arg(op, "EPX_RENDEZVOUS", std::string(text), colon != std::string_view::npos && rest.find(':') == colon, rule);
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  bool digits = !port.empty() && port.size() <= 5;
  for (char c : port) digits = digits && c >= '0' && c <= '9';
  const int p = digits ? std::stoi(std::string(port)) : 0;
  require_arg(op, "EPX_RENDEZVOUS", std::string(text), !host.empty() && p >= 1 && p <= 65535, rule);
  a.host = std::string(host);
  a.port = p;
  return a;
}

UniqueId RendezvousAddress::exchange(int rank, int world, double timeout_s) const {
  return tcp ? exchange_unique_id_tcp(host, port, rank, world, timeout_s) : exchange_unique_id(path, rank, timeout_s);
}

// ---- node key (NCCL's notion of a node, NCCL-DEVICE-API.md §1.4) ---------------------------------

int64_t node_key_from_env(int rank) {
  auto truthy = [](const char* name) {
    const std::string v = env_or(name, "");
    if (v.empty()) return false;
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 0);
    return end != v.c_str() && x != 0;
  };
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;
  };
  const std::string hostid = env_or("NCCL_HOSTID", "");
  if (!hostid.empty()) {
    mix("hostid:" + hostid);
  } else {
    char host[256] = {};
    (void)gethostname(host, sizeof host - 1);
    mix(host);
    std::ifstream boot("/proc/sys/kernel/random/boot_id");
    std::string id;
    if (boot >> id) mix(id);
  }
  // No intra-node transport: NCCL puts every GPU in its own node (network transport between all).
  if (truthy("NCCL_P2P_DISABLE") && truthy("NCCL_SHM_DISABLE")) mix("rank:" + std::to_string(rank));
  return static_cast<int64_t>(h);
}

std::shared_ptr<Group> make_nccl_group(const std::string& rendezvous, int rank, int world, int device, double timeout_s) {
  const RendezvousAddress where = RendezvousAddress::parse(rendezvous);
  const UniqueId id = where.exchange(rank, world, timeout_s);
  auto group = make_nccl_group(id, rank, world, device, timeout_s);
  // Every rank has read the id once the communicator exists (its init needed all of them).
  if (rank == 0 && !where.tcp) std::remove(where.path.c_str());
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
  if (rendezvous.empty())
    throw InvalidArgument(std::string(op) + ": EPX_RENDEZVOUS is not set: the launcher must name a fresh file or tcp://host:port");
  int device = int_var("EPX_LOCAL_RANK", false, -1);
  if (device < 0) {
    const int n = cuda::device_count();
    if (n <= 0) throw Unsupported(std::string(op) + ": no CUDA device visible to rank " + std::to_string(rank));
    device = rank % n;
  }
  return make_nccl_group(rendezvous, rank, world, device, timeout_s);
}

}  // namespace epx
