// comm/launcher.cpp: fork one process per rank, watch them, stop the rest when one fails; see
// launcher.h.
#include "comm/launcher.h"

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "epx/config.h"
#include "epx/error.h"

namespace epx::comm {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string fixed1(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", s);
  return buf;
}

std::string how_it_ended(const RankExit& e) {
  if (e.exited) return "exited with status " + std::to_string(e.exit_code);
  const char* name = ::strsignal(e.signal);
  return "was killed by signal " + std::to_string(e.signal) + " (" + (name ? name : "?") + ")";
}

void flush_all() {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(stdout);
  std::fflush(stderr);
}

[[noreturn]] void run_child(const RankEnv& env, const std::function<int(const RankEnv&)>& fn) {
  int code = 1;
  try {
    code = fn(env);
  } catch (const InvalidArgument& e) {
    std::fprintf(stderr, "epx: rank %d: error: %s\n", env.rank, e.what());
    code = 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx: rank %d: error: %s\n", env.rank, e.what());
    code = 1;
  } catch (...) {
    std::fprintf(stderr, "epx: rank %d: error: unknown exception\n", env.rank);
    code = 1;
  }
  flush_all();
  ::_exit(code);
}

}  // namespace

LaunchResult launch_ranks(const LaunchOptions& options, const std::function<int(const RankEnv&)>& fn) {
  constexpr std::string_view kOp = "launch_ranks";
  require_arg(kOp, "num_ranks", options.num_ranks, options.num_ranks >= 1, "must be >= 1");
  require_arg(kOp, "grace_s", options.grace_s, options.grace_s >= 0, "must be >= 0");
  std::string tmpl = (std::filesystem::temp_directory_path() / (options.tag + "-launch-XXXXXX")).string();
  if (!::mkdtemp(tmpl.data())) throw Error(std::string(kOp) + ": mkdtemp(" + tmpl + ") failed: " + ::strerror(errno));
  const std::string run_dir = tmpl;

  const int R = options.num_ranks;
  // EPX_RENDEZVOUS=tcp://host:port makes the ranks meet over TCP (rank 0 listens) instead of the
  // run directory's file; a file path there is ignored (each run needs a fresh file).
  const std::string tcp = env_or("EPX_RENDEZVOUS", "");
  const std::string rendezvous = tcp.rfind("tcp://", 0) == 0 ? tcp : run_dir + "/rendezvous";
  std::vector<pid_t> pids;
  flush_all();
  const auto t0 = Clock::now();
  for (int r = 0; r < R; ++r) {
    RankEnv env{r, R, rendezvous, run_dir};
    const pid_t pid = ::fork();
    if (pid == 0) run_child(env, fn);
    if (pid < 0) {
      const std::string why = ::strerror(errno);
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      std::error_code ec;
      std::filesystem::remove_all(run_dir, ec);
      throw Error(std::string(kOp) + ": fork of rank " + std::to_string(r) + " failed: " + why);
    }
    pids.push_back(pid);
  }

  LaunchResult res;
  res.ranks.resize(static_cast<size_t>(R));
  std::vector<bool> done(static_cast<size_t>(R), false);
  int remaining = R;
  int first_failed = -1;           // the first rank seen ending by a signal or a non-zero exit
  Clock::time_point kill_at{};
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < R; ++r) {
      if (done[r]) continue;
      int status = 0;
      const pid_t got = ::waitpid(pids[r], &status, WNOHANG);
      if (got != pids[r]) continue;
      done[r] = true;
      --remaining;
      progressed = true;
      RankExit& e = res.ranks[r];
      e.rank = r;
      e.seconds = since(t0);
      e.exited = WIFEXITED(status);
      e.exit_code = e.exited ? WEXITSTATUS(status) : 0;
      e.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      const bool failed = !e.exited || e.exit_code != 0;
      if (failed && first_failed < 0) {
        first_failed = r;
        kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options.grace_s));
      }
    }
    if (remaining > 0 && first_failed >= 0 && Clock::now() >= kill_at) {
      for (int r = 0; r < R; ++r) {
        if (done[r]) continue;
        ::kill(pids[r], SIGKILL);
        int status = 0;
        while (::waitpid(pids[r], &status, 0) < 0 && errno == EINTR) {
        }
        RankExit& e = res.ranks[r];
        e.rank = r;
        e.seconds = since(t0);
        e.exited = false;
        e.signal = SIGKILL;
        e.killed_by_launcher = true;
        done[r] = true;
        --remaining;
      }
    }
    if (!progressed && remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  res.seconds = since(t0);
  std::error_code ec;
  std::filesystem::remove_all(run_dir, ec);

  // Every rank exited with one code: that code (0 success, 1 agreed failure, 2 agreed bad input).
  // Or: every rank but the reporter exited 0 and the reporter exited on its own: its code.
  bool agreed = true;
  for (const RankExit& e : res.ranks) agreed = agreed && e.exited && e.exit_code == res.ranks[0].exit_code;
  if (agreed) {
    res.exit_code = res.ranks[0].exit_code;
    return res;
  }
  if (options.reporter_rank >= 0 && options.reporter_rank < R) {
    bool others_ok = res.ranks[options.reporter_rank].exited;
    for (const RankExit& e : res.ranks)
      if (e.rank != options.reporter_rank) others_ok = others_ok && e.exited && e.exit_code == 0;
    if (others_ok) {
      res.exit_code = res.ranks[options.reporter_rank].exit_code;
      return res;
    }
  }
  const RankExit& f = res.ranks[first_failed];
  res.exit_code = f.exited && f.exit_code != 0 ? f.exit_code : 1;
  res.failure = "rank " + std::to_string(first_failed) + " " + how_it_ended(f) + " after " + fixed1(f.seconds) + " s";
  std::string stopped;
  for (const RankExit& e : res.ranks)
    if (e.killed_by_launcher) stopped += (stopped.empty() ? "" : ", ") + std::to_string(e.rank);
  if (!stopped.empty())
    res.failure += "; ranks " + stopped + " were still running and were stopped (SIGKILL) " + fixed1(options.grace_s) + " s later";
  for (const RankExit& e : res.ranks)
    if (!e.killed_by_launcher && static_cast<int>(&e - res.ranks.data()) != first_failed && (!e.exited || e.exit_code != 0))
      res.failure += "; rank " + std::to_string(e.rank) + " " + how_it_ended(e);
  return res;
}

}  // namespace epx::comm
