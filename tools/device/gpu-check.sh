#!/usr/bin/env bash
# tools/device/gpu-check.sh: build epx with CUDA on the GPU machine and run every test there, in one
# device call. Two steps:
#
#   here (no GPU, Debian 12):   bash tools/device/gpu-check.sh pack
#       writes .carry/deps.tar.xz (the Debian build dependencies the GPU image lacks: gtest, nlohmann-json,
#       CLI11, spdlog + fmt, OpenBLAS + libgfortran) and .carry/src.tar.xz (git archive HEAD: the
#       committed tree, so half-written files of the working tree cannot break the device build).
#   there (device `run`, carry [".carry"]):   bash tools/device/gpu-check.sh run
#       unpacks both, configures with -DEPX_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a against the NCCL
#       2.28.9 of the Python venv's nvidia-nccl-cu13 wheel (the system NCCL there is 2.28.3, whose device
#       API differs: NCCL-DEVICE-API.md §4), builds with all cores, runs `ctest -L gpu` then `ctest -L cpu`,
#       and writes under $OUT (at most 8 files come back):
#         summary.json  what ran, versions, seconds per phase, pass/fail counts per label
#         env.txt       nvidia-smi, topology, compilers, NCCL paths
#         configure.log build.log gpu.log cpu.log   full logs
#         gpu1.log      the GPU label again with CUDA_VISIBLE_DEVICES=0 (the one-GPU machine's view)
#         sanitizer.log compute-sanitizer memcheck + racecheck of the single-process kernel tests
#         results.tar.gz the benchmark step (after the tests): bench-ll-v3.json bench-ht-v3.json
#                       moe-deepseek-v3.json moe-deepseek-v4-pro.json (2 ranks; RESULTS.md JSON, for
#                       bench/results/h200x2/), bench-*-r1.json and moe-deepseek-v3-r1.json (1 rank, for
#                       bench/results/h200x1/), bench.log
#                       (configure.log is then appended to build.log, to stay within 8 files)
#
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0): on the shared GPU hosts it can take the GPUs out of
# service. Options (environment): GPU_CHECK_SRC (a source tree to build instead of .carry/src.tar.xz),
# GPU_CHECK_TARGETS (build only these ninja targets), GPU_CHECK_CPU=0 (skip the CPU label), GPU_CHECK_ONE_GPU=0 (skip the one-GPU pass), GPU_CHECK_SANITIZE=0 (skip compute-sanitizer), GPU_CHECK_FILTER (a ctest -R regex applied to both labels), GPU_CHECK_GPU_JOBS (GPU tests at once, default 1),
# GPU_CHECK_CMAKE_ARGS (more cmake -D arguments, e.g. -DEPX_PYTHON=ON: the module then lands in <build>/python/epx),
# GPU_CHECK_NCCL (an NCCL install with include/ and lib/ instead of the wheel's; for a dry run elsewhere),
# GPU_CHECK_BENCH=0 (skip the benchmark step), GPU_CHECK_MOE_STEPS (steps of the full-size layers, default 3),
# GPU_CHECK_SAN_SINGLE (the single-process kernel tests under memcheck + racecheck; default quant_cuda_test
# routing_cuda_test runtime_cuda_test), GPU_CHECK_SAN_VIRTUAL (space-separated "tool:test:gtest-filter" runs of compute-sanitizer on virtual ranks, e.g.
# "memcheck:ll_cuda_test:*R2*"), GPU_CHECK_TESTS=0 (skip the GPU test label: benchmark-only runs), GPU_CHECK_BENCH_ONE_GPU=0 (skip the 1-rank
# benchmarks; default: as GPU_CHECK_ONE_GPU), GPU_CHECK_DEADLINE_S (seconds since the script started after
# which no benchmark run starts; each is cut to fit).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY="$ROOT/.carry"
MODE="${1:-run}"

pack() {
  mkdir -p "$CARRY"
  if [ -f "$CARRY/deps.tar.xz" ] && [ "${GPU_CHECK_REPACK_DEPS:-0}" = 0 ]; then
    echo "keeping $CARRY/deps.tar.xz (GPU_CHECK_REPACK_DEPS=1 rebuilds it)"
  else
    pack_deps
  fi
  git -C "$ROOT" archive --format=tar HEAD | xz -T2 -6 >"$CARRY/src.tar.xz"
  git -C "$ROOT" rev-parse --short=12 HEAD >"$CARRY/commit.txt"
  echo "packed $(git -C "$ROOT" rev-parse --short HEAD): $(du -h "$CARRY/deps.tar.xz" | cut -f1) deps, $(du -h "$CARRY/src.tar.xz" | cut -f1) source"
}

pack_deps() {
  local pkgs=(libgtest-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
              libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0)
  # Regular files and links of those packages, without docs and without the big static archives
  # (gtest/gmock are only static).
  dpkg -L "${pkgs[@]}" | sort -u | while read -r f; do
    [ -f "$f" ] || [ -L "$f" ] || continue
    case "$f" in
      /usr/share/doc/*|/usr/share/man/*|/usr/share/lintian/*|/etc/*) continue ;;
      *.a) case "$f" in */libgtest*.a|*/libgmock*.a) ;; *) continue ;; esac ;;
    esac
    echo "${f#/}"
  done >"$CARRY/deps.list"
  tar -C / -cf - -T "$CARRY/deps.list" | xz -T2 -6 >"$CARRY/deps.tar.xz"
}

run() {
  local out="${OUT:-/tmp/epx-gpu-check-out}"
  mkdir -p "$out"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  local work=/tmp/epx-gpu-check deps=/tmp/epx-gpu-check/deps
  rm -rf "$work" && mkdir -p "$work/src" "$deps"
  local t0=$SECONDS
  tar -C "$deps" -xJf "$CARRY/deps.tar.xz" || { echo "cannot unpack $CARRY/deps.tar.xz (run 'pack' first)"; return 1; }
  local src="${GPU_CHECK_SRC:-}"
  if [ -z "$src" ]; then
    tar -C "$work/src" -xJf "$CARRY/src.tar.xz" || { echo "cannot unpack $CARRY/src.tar.xz"; return 1; }
    src="$work/src"
  fi
  local nccl
  nccl="${GPU_CHECK_NCCL:-$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)}"
  [ -f "$nccl/include/nccl.h" ] || { echo "no NCCL wheel found (python3 -c 'import nvidia.nccl')"; return 1; }
  local arch_lib="$deps/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$nccl/lib:$arch_lib:$arch_lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

  {
    echo "== date"; date -u
    echo "== nvidia-smi"; nvidia-smi
    echo "== topology"; nvidia-smi topo -m
    echo "== compilers"; nvcc --version | tail -2; c++ --version | head -1; cmake --version | head -1; ninja --version
    echo "== NCCL"; echo "wheel: $nccl"; grep -m1 "define NCCL_VERSION_CODE" "$nccl/include/nccl.h"; ls -l "$nccl/lib"
    echo "== environment"; env | grep -E '^(NCCL_|CUDA_|LD_LIBRARY_PATH|TORCH_SYMM|NVSHMEM_)' | sort
  } >"$out/env.txt" 2>&1

  local bdir="$work/build" jobs
  jobs="$(nproc)"
  local t_conf=$SECONDS
  cmake -S "$src" -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DEPX_FP8_PREFILL_STAMPS=ON \
    -DEPX_NCCL_ROOT="$nccl" -DCMAKE_PREFIX_PATH="$deps/usr" -DBLA_VENDOR=OpenBLAS -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
    -DCMAKE_LIBRARY_PATH="$arch_lib/openblas-pthread;$arch_lib" \
    -DEPX_CBLAS_INCLUDE="$deps/usr/include/x86_64-linux-gnu/openblas-pthread" ${GPU_CHECK_CMAKE_ARGS:-} >"$out/configure.log" 2>&1
  local conf_rc=$?
  local t_build=$SECONDS build_rc=1
  if [ $conf_rc -eq 0 ]; then
    # GPU_CHECK_TARGETS (space-separated ninja targets, e.g. "epx ll_cuda_test") builds only those.
    cmake --build "$bdir" -j "$jobs" -- -k 0 ${GPU_CHECK_TARGETS:-} >"$out/build.log" 2>&1
    build_rc=$?
  fi
  local t_gpu=$SECONDS gpu_rc=-1 gpu1_rc=-1 cpu_rc=-1 t_gpu1 t_cpu t_end
  local filter=()
  [ -n "${GPU_CHECK_FILTER:-}" ] && filter=(-R "$GPU_CHECK_FILTER")
  if [ $conf_rc -eq 0 ] && [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
    # GPU_CHECK_GPU_JOBS=N runs N GPU tests at once (the rendezvous dirs are mkdtemp-unique); a test
    # that fails under -j is rerun alone before it counts as failed (contention must not decide).
    (cd "$bdir" && ctest -L gpu -V -j "${GPU_CHECK_GPU_JOBS:-1}" --timeout 300 "${filter[@]}") >"$out/gpu.log" 2>&1
    gpu_rc=$?
    if [ $gpu_rc -ne 0 ] && [ "${GPU_CHECK_GPU_JOBS:-1}" != 1 ]; then
      (cd "$bdir" && ctest --rerun-failed -V --timeout 300) >>"$out/gpu.log" 2>&1
      gpu_rc=$?
    fi
  fi
  t_gpu1=$SECONDS
  if [ $conf_rc -eq 0 ] && [ "${GPU_CHECK_ONE_GPU:-1}" != 0 ]; then
    (cd "$bdir" && CUDA_VISIBLE_DEVICES=0 ctest -L gpu -V --timeout 300 "${filter[@]}") >"$out/gpu1.log" 2>&1
    gpu1_rc=$?
  fi
  t_cpu=$SECONDS
  if [ $conf_rc -eq 0 ] && [ "${GPU_CHECK_CPU:-1}" != 0 ]; then
    (cd "$bdir" && ctest -L cpu --output-on-failure -j "$jobs" --timeout 240 "${filter[@]}") >"$out/cpu.log" 2>&1
    cpu_rc=$?
  fi
  local t_san=$SECONDS san_rc=-1
  if [ $build_rc -eq 0 ] && [ "${GPU_CHECK_SANITIZE:-1}" != 0 ] && command -v compute-sanitizer >/dev/null; then
    san_rc=0
    {
      for t in ${GPU_CHECK_SAN_SINGLE-quant_cuda_test routing_cuda_test runtime_cuda_test}; do
        for tool in memcheck racecheck; do
          echo "== compute-sanitizer --tool $tool $t"
          (cd "$bdir" && timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 "./$t") || san_rc=1
        done
      done
      # The multi-rank suites on virtual ranks (every rank a thread of one process on this GPU, so a
      # rank writing past a peer's buffer is seen): "tool:test:gtest filter" entries, each under a
      # time limit (GPU_CHECK_SAN_LIMIT_S, default 300). The ranks' children are followed
      # (--target-processes all).
      for entry in ${GPU_CHECK_SAN_VIRTUAL:-}; do
        IFS=: read -r tool t filt <<<"$entry"
        echo "== compute-sanitizer --tool $tool $t --gtest_filter=$filt (EPX_TEST_VIRTUAL_RANKS=1)"
        (cd "$bdir" && EPX_TEST_VIRTUAL_RANKS=1 timeout "${GPU_CHECK_SAN_LIMIT_S:-300}" compute-sanitizer --tool "$tool" \
          --target-processes all --error-exitcode 9 "./$t" --gtest_filter="$filt") || san_rc=1
      done
    } >"$out/sanitizer.log" 2>&1
  fi
  t_end=$SECONDS

  # ---- benchmark step: epx bench + the full-size layers, after the tests (results.tar.gz) ----
  local bench_rc=-1 t_bench=$SECONDS
  if [ $build_rc -eq 0 ] && [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
    bench_rc=0
    local res="$work/results" epx="$bdir/epx" steps="${GPU_CHECK_MOE_STEPS:-3}"
    mkdir -p "$res"
    bench_one() {  # <limit_s> <epx args...>: one run, logged; a failure or timeout is counted, not fatal
      local limit=$1 left=$(( ${GPU_CHECK_DEADLINE_S:-100000} - SECONDS )); shift
      [ "$left" -lt "$limit" ] && limit=$left
      if [ "$limit" -lt 30 ]; then echo "== skipped (GPU_CHECK_DEADLINE_S): epx $*"; bench_rc=1; return; fi
      echo "== $(date -u +%T) epx $* (limit ${limit} s)"
      (cd "$src" && timeout -k 5 "$limit" "$epx" "$@") || { echo "== exit status $?"; bench_rc=1; }
      tar -C "$res" -czf "$out/results.tar.gz" .  # after every run: a later timeout keeps what ran
    }
    {
      bench_one 120 bench --case ll-v3 --backend all --ranks 2 --iters 200 --warmup 20 --json "$res/bench-ll-v3.json"
      bench_one 180 bench --case ht-v3 --backend all --ranks 2 --iters 100 --warmup 10 --json "$res/bench-ht-v3.json"
      bench_one 240 moe --device cuda --ranks 2 --preset deepseek-v3 --backend all --tokens-per-rank 128 --steps "$steps" \
        --validate-tokens 8 --json "$res/moe-deepseek-v3.json"
      bench_one 240 moe --device cuda --ranks 2 --preset deepseek-v4-pro --backend all --tokens-per-rank 128 --steps "$steps" \
        --validate-tokens 8 --json "$res/moe-deepseek-v4-pro.json"
      if [ "${GPU_CHECK_BENCH_ONE_GPU:-${GPU_CHECK_ONE_GPU:-1}}" != 0 ]; then
        bench_one 60 bench --case ll-v3 --backend all --ranks 1 --iters 200 --warmup 20 --json "$res/bench-ll-v3-r1.json"
        bench_one 120 bench --case ht-v3 --backend all --ranks 1 --iters 100 --warmup 10 --json "$res/bench-ht-v3-r1.json"
        bench_one 180 moe --device cuda --ranks 1 --preset deepseek-v3 --backend all --tokens-per-rank 128 --steps 2 \
          --validate-tokens 8 --json "$res/moe-deepseek-v3-r1.json"
      fi
    } >"$res/bench.log" 2>&1
    # The source came from `git archive`, so epx cannot see its commit: name the packed one.
    if [ -z "${GPU_CHECK_SRC:-}" ] && [ -f "$CARRY/commit.txt" ]; then
      python3 - "$res" "$(cat "$CARRY/commit.txt")" <<'PY'
import glob, json, os, sys
for p in glob.glob(os.path.join(sys.argv[1], "*.json")):
    d = json.load(open(p))
    if d.get("git_commit") in (None, "unknown"):
        d["git_commit"] = sys.argv[2]
        json.dump(d, open(p, "w"), indent=2)
PY
    fi
    tar -C "$res" -czf "$out/results.tar.gz" .
    # Stay within the 8 files that come back.
    cat "$out/configure.log" >>"$out/build.log" && rm -f "$out/configure.log"
  fi
  local t_bench_end=$SECONDS

  CONF_RC=$conf_rc BUILD_RC=$build_rc GPU_RC=$gpu_rc GPU1_RC=$gpu1_rc CPU_RC=$cpu_rc \
  S_UNPACK=$((t_conf - t0)) S_CONF=$((t_build - t_conf)) S_BUILD=$((t_gpu - t_build)) S_GPU=$((t_gpu1 - t_gpu)) \
  S_GPU1=$((t_cpu - t_gpu1)) \
  S_CPU=$((t_san - t_cpu)) S_SAN=$((t_end - t_san)) SAN_RC=$san_rc BENCH_RC=$bench_rc S_BENCH=$((t_bench_end - t_bench)) python3 - "$out" "$src" "$nccl" <<'PY'
import json, re, sys, os
out, src, nccl = sys.argv[1:4]
def tally(name):
    p = os.path.join(out, name)
    if not os.path.exists(p): return None
    text = open(p, errors="replace").read()
    m = re.search(r"(\d+)% tests passed(?:, (\d+) tests? failed)? out of (\d+)", text)
    failed = re.findall(r"^\s*\d+ - (\S+) \(([^)]*)\)", text.split("The following tests FAILED:")[-1], re.M) if "The following tests FAILED:" in text else []
    skipped = re.findall(r"^(?:\d+: )?\[  SKIPPED \] (\S+)$", text, re.M)
    return {"passed_pct": int(m.group(1)) if m else None, "failed": int(m.group(2) or 0) if m else None,
            "total": int(m.group(3)) if m else None, "failed_tests": [f"{a} ({b})" for a, b in failed],
            "skipped_cases": sorted(set(skipped)),
            "cases_ok": len(re.findall(r"^(?:\d+: )?\[       OK \] ", text, re.M)),
            "cases_failed": sorted(set(re.findall(r"^(?:\d+: )?\[  FAILED  \] (\S+) \(", text, re.M)))}
hdr = open(os.path.join(nccl, "include", "nccl.h")).read()
code = re.search(r"#define NCCL_VERSION_CODE (\d+)", hdr)
summary = {
  "what": "tools/device/gpu-check.sh run",
  "source": src,
  "nccl_wheel": nccl, "nccl_header_version": int(code.group(1)) if code else None,
  "rc": {k: int(os.environ[v]) for k, v in [("configure", "CONF_RC"), ("build", "BUILD_RC"), ("gpu_tests", "GPU_RC"), ("gpu_tests_one_gpu", "GPU1_RC"), ("cpu_tests", "CPU_RC"), ("sanitizer", "SAN_RC"), ("bench", "BENCH_RC")]},
  "seconds": {k: int(os.environ[v]) for k, v in [("unpack", "S_UNPACK"), ("configure", "S_CONF"), ("build", "S_BUILD"), ("gpu_tests", "S_GPU"), ("gpu_tests_one_gpu", "S_GPU1"), ("cpu_tests", "S_CPU"), ("sanitizer", "S_SAN"), ("bench", "S_BENCH")]},
  "gpu": tally("gpu.log"), "gpu_one_gpu": tally("gpu1.log"), "cpu": tally("cpu.log"),
}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
  echo "== build errors (first 30 lines)"; grep -E "error|FAILED" "$out/build.log" | head -30
  echo "== gpu tests"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[ RUN|OK \]|FAILED\]|FAILED:|NCCL (headers|version)|OK on|OK:|near-ties|expected|tests passed|rank [0-9].*(FAILED|exited|still)" "$out/gpu.log" | head -150
  echo "== gpu tests, CUDA_VISIBLE_DEVICES=0"; grep -E "OK \]|FAILED|tests passed|SKIPPED \]" "$out/gpu1.log" | head -40
  echo "== cpu tests"; grep -E "tests passed|\*\*\*Failed|Not Run|Timeout" "$out/cpu.log" | head -40
  echo "== sanitizer"; grep -E "^== compute-sanitizer|ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/sanitizer.log" 2>/dev/null | head -40
  echo "== bench (results.tar.gz)"; [ -f "$work/results/bench.log" ] && grep -E "^== |validated|backends pass|wrote|error|rank [0-9]|^(ll|ht)-v" "$work/results/bench.log" | head -120
  [ $conf_rc -eq 0 ] && [ $build_rc -eq 0 ] && [ $gpu_rc -le 0 ] && [ $gpu1_rc -le 0 ] && [ $cpu_rc -le 0 ] && [ $san_rc -le 0 ] && [ $bench_rc -le 0 ]
}

case "$MODE" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
