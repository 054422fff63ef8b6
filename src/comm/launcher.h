// comm/launcher.h: the epx launcher: one process per rank (per local GPU), forked from a parent that
// has not initialised CUDA, meeting through a file rendezvous (epx/group.h exchange_unique_id).
//
// The parent only forks, watches and reports: it polls every child with waitpid, and when one dies
// (a signal) or fails (a non-zero exit) while others still run, it gives the others `grace_s` to
// finish on their own (a failed peer's collectives time out or agree on the failure), then kills
// them with SIGKILL. It returns well inside the group timeout and names the rank that failed first,
// so a dead rank can never hang the caller. Host-only, no CUDA: CPU-only builds have it too.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace epx::comm {

struct LaunchOptions {
  int num_ranks = 1;
  /// After the first failed rank: how long the others may run on before they are killed.
  double grace_s = 10.0;
  /// Prefix of the run directory under the system temp dir (holds the rendezvous file).
  std::string tag = "epx";
  /// When >= 0: the rank that reports (validates, prints, writes files) after the others finished
  /// their part and exited 0. Its exit code is then the result, with no failure text.
  int reporter_rank = -1;
};

/// What one child knows about its place in the run.
struct RankEnv {
  int rank = 0;
  int world = 1;
  /// pass to make_nccl_group(rendezvous_path, rank, world, device): a fresh file of this run, or
  /// EPX_RENDEZVOUS when the parent's environment sets it to tcp://host:port
  std::string rendezvous_path;
  std::string run_dir;          ///< a private directory of this run, removed by the parent at the end
};

struct RankExit {
  int rank = 0;
  bool exited = false;   ///< exited normally (exit_code valid)
  int exit_code = 0;
  int signal = 0;        ///< the signal that ended it (when !exited)
  bool killed_by_launcher = false;
  double seconds = 0;    ///< since launch, when the parent saw it end
};

struct LaunchResult {
  /// 0: every rank exited 0. Otherwise the exit code every rank agreed on, or, when they did not
  /// agree or a rank died, the first failed rank's exit code (1 for a signal).
  int exit_code = 0;
  /// Empty when every rank exited with the same code; else one sentence naming the first failed
  /// rank and how it ended, and the ranks the launcher stopped, e.g.
  /// "rank 1 was killed by signal 9 (Killed) after 2.1 s; ranks 0 were still running and were stopped (SIGKILL) 10 s later".
  std::string failure;
  std::vector<RankExit> ranks;
  double seconds = 0;
};

/// Forks options.num_ranks children; child r runs fn(env) and exits with its return value (an
/// exception escaping fn is printed to stderr as "epx: rank r: error: <what>" and exits 1, 2 for
/// InvalidArgument). stdout and stderr are flushed before forking and in each child before it
/// exits; children skip static destructors (_exit). Call it before this process initialises CUDA:
/// a child of a process that did cannot use its GPU. Throws Error when the run directory or a fork
/// cannot be made (already-forked children are killed first).
LaunchResult launch_ranks(const LaunchOptions& options, const std::function<int(const RankEnv&)>& fn);

}  // namespace epx::comm
