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
#                       bench/results/h200x1/), bench.log; and one folder per suite (GPU_CHECK_SUITES, below)
#                       with suites.log
#                       (configure.log is appended to build.log, to stay within 8 files)
#
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0): on the shared GPU hosts it can take the GPUs out of
# service. Options (environment): GPU_CHECK_SRC (a source tree to build instead of .carry/src.tar.xz),
# GPU_CHECK_TARGETS (build only these ninja targets), GPU_CHECK_CPU=0 (skip the CPU label), GPU_CHECK_ONE_GPU=0 (skip the one-GPU pass), GPU_CHECK_SANITIZE=0 (skip compute-sanitizer), GPU_CHECK_FILTER (a ctest -R regex applied to both labels), GPU_CHECK_GPU_JOBS (GPU tests at once, default 1; GPU_CHECK_RERUN=0: no lone rerun of what failed under -j), GPU_CHECK_TEST_LIMIT_S (seconds per GPU test, default 300),
# GPU_CHECK_CMAKE_ARGS (more cmake -D arguments, e.g. -DEPX_PYTHON=ON: the module then lands in <build>/python/epx),
# GPU_CHECK_NCCL (an NCCL install with include/ and lib/ instead of the wheel's; for a dry run elsewhere),
# GPU_CHECK_BENCH=0 (skip the benchmark step), GPU_CHECK_MOE_STEPS (steps of the full-size layers, default 3),
# GPU_CHECK_SAN_SINGLE (the single-process kernel tests under memcheck + racecheck; default quant_cuda_test
# routing_cuda_test runtime_cuda_test), GPU_CHECK_SAN_VIRTUAL (space-separated "tool:test:gtest-filter" runs of compute-sanitizer on virtual ranks, e.g.
# "memcheck:ll_cuda_test:*R2*"), GPU_CHECK_TESTS=0 (skip the GPU test label: benchmark-only runs), GPU_CHECK_BENCH_ONE_GPU=0 (skip the 1-rank
# benchmarks; default: as GPU_CHECK_ONE_GPU), GPU_CHECK_DEADLINE_S (seconds since the script started after
# which no benchmark or suite run starts; each is cut to fit), GPU_CHECK_WORK (the work folder, default /tmp/epx-gpu-check).
#
# Suites: GPU_CHECK_SUITES="ll ht ..." runs these after the benchmark step (also with GPU_CHECK_BENCH=0), each into
# <suite>/ of results.tar.gz, in the order given; the figures of README.md come from them (bench/results/README.md
# names which). Two ranks are two GPUs (one process each); on a one-GPU machine `epx --device cuda` runs them as
# virtual ranks on GPU 0 (one GPU's memory, not NVLink), except in multinode and san2, which need two GPUs.
#   ll         epx bench ll-v3 / ll-v4, ll beside nccl_a2a_raw, CUDA-graph replays (p50 of 200): the defaults and the
#              rows of the other ll.* values (partial_bf16, ll.combine_wait data, column)
#   ht         epx bench ht-v3, ht beside nccl_a2a_raw, at EPX_HT_NUM_SMS 64 (the default), 24, 16, 8, 48
#   multinode  2 virtual nodes of 1 GPU (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, TCP rendezvous): every backend at
#              ll-v3, ll hierarchical under graph replay, ht-v3 fp8, epx moe deepseek-v3-mini; and ll-v3 on one node
#   layer      the full-size DeepSeek-V3 layer, 2 ranks, FP8 dispatch, every backend, shared expert fused vs separate
#              (--compare, --expert-pool 16): decode (128 tokens/rank, 10 steps, ll as a whole-layer graph) and
#              prefill (4096 tokens/rank, 3 steps)
#   fhmoe      the FHMoE gate through the layer: fused vs separate over a routing trace of GPU_CHECK_FHMOE_TOKENS
#              tokens/rank (default 1,8,32,128,512), GPU_CHECK_FHMOE_STEPS (5) steps each, GPU_CHECK_FHMOE_RANKS (2)
#              ranks, backend GPU_CHECK_FHMOE_BACKEND (ll) in mode GPU_CHECK_FHMOE_MODE (decode), for
#              GPU_CHECK_FHMOE_PRESETS ("deepseek-v3:256:8 deepseek-v4-pro:384:6": preset:experts:top-k);
#              fhmoe-sweep.txt has fused / separate - 1 per size (bench/fhmoe_sweep_report.py)
#   gemm       epx-gemm-bench --rounds 5 (the FP8 experts: decode, prefill per layout, cuBLASLt, HBM copy) and
#              bench/gemm_torch.py (torch's grouped GEMMs, own process); with the Python module built
#              (GPU_CHECK_CMAKE_ARGS=-DEPX_PYTHON=ON) also bench/gemm_vs_torch.py (epx and torch in one process,
#              interleaved rounds) and examples/grouped_gemm_contiguous.py --device cuda:0
#   mxfp4      epx-gemm-mxfp4-bench on GPU 0: DeepSeek-V4-Pro MXFP4 decode / prefill, the FHMoE kernel-level sweep
#   python     tools/device/py-check.sh on the same source: pip install ., import, GPU and CPU pytest, the quick start
#   san2       compute-sanitizer memcheck + racecheck on ll and ht with 2 ranks (one process per GPU,
#              --target-processes all): the ll-v3 / ht-v3 benches and the two-rank tests (GPU_CHECK_SAN2_LL_FILTER,
#              GPU_CHECK_SAN2_HT_FILTER: their gtest filters)
#   there, after a `run` on the same machine:   bash tools/device/gpu-check.sh suites
#       runs GPU_CHECK_SUITES on the tree that run built (nothing is rebuilt) and writes $OUT/results.tar.gz.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY="$ROOT/.carry"
MODE="${1:-run}"
WORK="${GPU_CHECK_WORK:-/tmp/epx-gpu-check}"

pack() {
  mkdir -p "$CARRY"
  if [ -f "$CARRY/deps.tar.xz" ] && [ "${GPU_CHECK_REPACK_DEPS:-0}" = 0 ]; then
    echo "keeping $CARRY/deps.tar.xz (GPU_CHECK_REPACK_DEPS=1 rebuilds it)"
  else
    pack_deps
  fi
  git -C "$ROOT" archive --format=tar "${GPU_CHECK_REF:-HEAD}" | xz -T2 -6 >"$CARRY/src.tar.xz"
  git -C "$ROOT" rev-parse --short=12 "${GPU_CHECK_REF:-HEAD}" >"$CARRY/commit.txt"
  echo "packed $(git -C "$ROOT" rev-parse --short "${GPU_CHECK_REF:-HEAD}"): $(du -h "$CARRY/deps.tar.xz" | cut -f1) deps, $(du -h "$CARRY/src.tar.xz" | cut -f1) source"
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

device_env() {  # NVLink multicast off; the NCCL wheel and the unpacked deps on LD_LIBRARY_PATH (sets nccl)
  export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  nccl="${GPU_CHECK_NCCL:-$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)}"
  [ -f "$nccl/include/nccl.h" ] || { echo "no NCCL wheel found (python3 -c 'import nvidia.nccl')"; return 1; }
  local arch_lib="$WORK/deps/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$nccl/lib:$arch_lib:$arch_lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

run() {
  local out="${OUT:-/tmp/epx-gpu-check-out}"
  mkdir -p "$out"
  local work="$WORK" deps="$WORK/deps"
  rm -rf "$work" && mkdir -p "$work/src" "$deps"
  local t0=$SECONDS
  tar -C "$deps" -xJf "$CARRY/deps.tar.xz" || { echo "cannot unpack $CARRY/deps.tar.xz (run 'pack' first)"; return 1; }
  local src="${GPU_CHECK_SRC:-}"
  if [ -z "$src" ]; then
    tar -C "$work/src" -xJf "$CARRY/src.tar.xz" || { echo "cannot unpack $CARRY/src.tar.xz"; return 1; }
    src="$work/src"
  fi
  local nccl
  device_env || return 1
  local arch_lib="$deps/usr/lib/x86_64-linux-gnu"

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
  local filter=() test_limit="${GPU_CHECK_TEST_LIMIT_S:-300}"
  [ -n "${GPU_CHECK_FILTER:-}" ] && filter=(-R "$GPU_CHECK_FILTER")
  if [ $conf_rc -eq 0 ] && [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
    # GPU_CHECK_GPU_JOBS=N runs N GPU tests at once (the rendezvous dirs are mkdtemp-unique); a test
    # that fails under -j is rerun alone before it counts as failed (contention must not decide).
    (cd "$bdir" && ctest -L gpu -V -j "${GPU_CHECK_GPU_JOBS:-1}" --timeout "$test_limit" "${filter[@]}") >"$out/gpu.log" 2>&1
    gpu_rc=$?
    if [ $gpu_rc -ne 0 ] && [ "${GPU_CHECK_GPU_JOBS:-1}" != 1 ] && [ "${GPU_CHECK_RERUN:-1}" != 0 ]; then
      (cd "$bdir" && ctest --rerun-failed -V --timeout "$test_limit") >>"$out/gpu.log" 2>&1
      gpu_rc=$?
    fi
  fi
  t_gpu1=$SECONDS
  if [ $conf_rc -eq 0 ] && [ "${GPU_CHECK_ONE_GPU:-1}" != 0 ]; then
    (cd "$bdir" && CUDA_VISIBLE_DEVICES=0 ctest -L gpu -V --timeout "$test_limit" "${filter[@]}") >"$out/gpu1.log" 2>&1
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
  local bench_rc=-1 t_bench=$SECONDS res="$work/results"
  mkdir -p "$res"
  if [ $build_rc -eq 0 ] && [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
    bench_rc=0
    local epx="$bdir/epx" steps="${GPU_CHECK_MOE_STEPS:-3}"
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
  fi
  local t_bench_end=$SECONDS suites_rc=-1
  if [ $build_rc -eq 0 ] && [ -n "${GPU_CHECK_SUITES:-}" ]; then
    run_suites "$src" "$bdir" "$res" "$out"
    suites_rc=$SUITES_RC
  fi
  local t_suites_end=$SECONDS
  if [ $bench_rc -ge 0 ] || [ $suites_rc -ge 0 ]; then
    [ -z "${GPU_CHECK_SRC:-}" ] && stamp_commit "$res"
    tar -C "$res" -czf "$out/results.tar.gz" .
  fi
  # Stay within the 8 files that come back.
  [ -f "$out/configure.log" ] && cat "$out/configure.log" >>"$out/build.log" && rm -f "$out/configure.log"

  CONF_RC=$conf_rc BUILD_RC=$build_rc GPU_RC=$gpu_rc GPU1_RC=$gpu1_rc CPU_RC=$cpu_rc \
  S_UNPACK=$((t_conf - t0)) S_CONF=$((t_build - t_conf)) S_BUILD=$((t_gpu - t_build)) S_GPU=$((t_gpu1 - t_gpu)) \
  S_GPU1=$((t_cpu - t_gpu1)) \
  S_CPU=$((t_san - t_cpu)) S_SAN=$((t_end - t_san)) SAN_RC=$san_rc BENCH_RC=$bench_rc S_BENCH=$((t_bench_end - t_bench)) \
  SUITES_RC=$suites_rc S_SUITES=$((t_suites_end - t_bench_end)) python3 - "$out" "$src" "$nccl" <<'PY'
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
  "rc": {k: int(os.environ[v]) for k, v in [("configure", "CONF_RC"), ("build", "BUILD_RC"), ("gpu_tests", "GPU_RC"), ("gpu_tests_one_gpu", "GPU1_RC"), ("cpu_tests", "CPU_RC"), ("sanitizer", "SAN_RC"), ("bench", "BENCH_RC"), ("suites", "SUITES_RC")]},
  "seconds": {k: int(os.environ[v]) for k, v in [("unpack", "S_UNPACK"), ("configure", "S_CONF"), ("build", "S_BUILD"), ("gpu_tests", "S_GPU"), ("gpu_tests_one_gpu", "S_GPU1"), ("cpu_tests", "S_CPU"), ("sanitizer", "S_SAN"), ("bench", "S_BENCH"), ("suites", "S_SUITES")]},
  "gpu": tally("gpu.log"), "gpu_one_gpu": tally("gpu1.log"), "cpu": tally("cpu.log"),
  "suites": os.environ.get("GPU_CHECK_SUITES", ""),
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
  [ -f "$res/suites.log" ] && { echo "== suites (results.tar.gz)"; suites_digest "$res"; }
  [ $conf_rc -eq 0 ] && [ $build_rc -eq 0 ] && [ $gpu_rc -le 0 ] && [ $gpu1_rc -le 0 ] && [ $cpu_rc -le 0 ] && [ $san_rc -le 0 ] \
    && [ $bench_rc -le 0 ] && [ $suites_rc -le 0 ]
}

stamp_commit() {  # <folder>: the packed commit into every RESULTS.md JSON below it that lacks one
  # The source came from `git archive`, so epx cannot see its commit: name the packed one.
  [ -f "$CARRY/commit.txt" ] || return 0
  python3 - "$1" "$(cat "$CARRY/commit.txt")" <<'PY'
import glob, json, os, sys
for p in glob.glob(os.path.join(sys.argv[1], "**", "*.json"), recursive=True):
    try:
        d = json.load(open(p))
    except (OSError, ValueError):
        continue  # a run cut by its time limit
    if isinstance(d, dict) and d.get("git_commit") in (None, "unknown"):
        d["git_commit"] = sys.argv[2]
        json.dump(d, open(p, "w"), indent=2)
PY
}

# ---- suites (GPU_CHECK_SUITES): each a function suite_<name> <folder>; src, bdir, epx and commit come from run_suites ----
step() {  # <limit_s> <log> <cmd...>: one command from the source root, output to <log>, cut to GPU_CHECK_DEADLINE_S
  local limit=$1 log=$2 left=$(( ${GPU_CHECK_DEADLINE_S:-100000} - SECONDS )) t=$SECONDS rc
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then echo "== skipped (GPU_CHECK_DEADLINE_S): $*"; SUITES_RC=1; return 1; fi
  echo "== $(date -u +%T) $* (limit ${limit} s)"
  (cd "$src" && timeout -k 5 "$limit" "$@") >"$log" 2>&1
  rc=$?
  echo "   exit $rc after $((SECONDS - t)) s: $log"
  [ $rc -eq 0 ] || SUITES_RC=1
  return $rc
}

suite_ll() {
  local o=$1 b=(bench --device cuda --backend "ll,nccl_a2a_raw" --ranks 2 --graph --iters 200 --warmup 20)
  row() { local name=$1 case=$2; shift 2; step 30 "$o/$name.log" env "$@" "$epx" "${b[@]}" --case "$case" --json "$o/$name.json"; }
  row ll-v3 ll-v3
  row ll-v3-partial_bf16 ll-v3 EPX_LL_COMBINE=partial_bf16
  row ll-v3-wait_data ll-v3 EPX_LL_COMBINE_WAIT=data
  row ll-v4 ll-v4
  row ll-v3-column ll-v3 EPX_LL_COMBINE=column
}

suite_ht() {
  local o=$1 sms
  for sms in 64 24 16 8 48; do
    step 30 "$o/ht-v3-sms$sms.log" env EPX_HT_NUM_SMS=$sms "$epx" bench --device cuda --case ht-v3 --backend ht,nccl_a2a_raw --ranks 2 \
      --warmup 5 --iters 50 --json "$o/ht-v3-sms$sms.json"
  done
}

suite_multinode() {
  local o=$1 nodes=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
  local b=(bench --device cuda --case ll-v3 --backend "naive,allgather_reducescatter,all2allv,ll,ht,nccl_a2a_raw" --ranks 2 --iters 50 --warmup 5)
  step 40 "$o/multinode-ll-v3-2x1.log" "${nodes[@]}" EPX_RENDEZVOUS=tcp://127.0.0.1:29531 "$epx" "${b[@]}" \
    --json "$o/multinode-ll-v3-2x1.json"
  step 30 "$o/multinode-ll-v3-1x2.log" "$epx" "${b[@]}" --json "$o/multinode-ll-v3-1x2.json"
  step 40 "$o/multinode-ll-v3-2x1-graph.log" "${nodes[@]}" EPX_RENDEZVOUS=tcp://127.0.0.1:29532 "$epx" bench --device cuda --case ll-v3 \
    --backend ll --ranks 2 --iters 50 --warmup 5 --graph --json "$o/multinode-ll-v3-2x1-graph.json"
  step 60 "$o/multinode-moe-deepseek-v3-mini-2x1.log" "${nodes[@]}" "$epx" moe --device cuda --ranks 2 \
    --preset deepseek-v3-mini --backend all --steps 2 --tokens-per-rank 24 --json "$o/multinode-moe-deepseek-v3-mini-2x1.json"
  step 60 "$o/multinode-ht-v3-2x1.log" "${nodes[@]}" EPX_RENDEZVOUS=tcp://127.0.0.1:29533 "$epx" bench --device cuda --case ht-v3 \
    --backend ht,all2allv --dtype fp8 --ranks 2 --iters 10 --warmup 2 --json "$o/multinode-ht-v3-2x1.json"
}

suite_layer() {
  # --expert-pool 16: the host builds 16 distinct experts per rank (~4 s instead of 13-41 s); the device still holds
  # one copy of every expert and the reference uses the same values.
  local o=$1 c=(--device cuda --ranks 2 --preset deepseek-v3 --backend all --compare --dispatch-dtype fp8 --validate-tokens 2
                --expert-pool 16)
  step 120 "$o/moe-decode-deepseek-v3.log" "$epx" moe "${c[@]}" --mode decode --steps 10 --json "$o/moe-decode-deepseek-v3.json"
  step 120 "$o/moe-prefill-deepseek-v3.log" "$epx" moe "${c[@]}" --mode prefill --steps 3 --json "$o/moe-prefill-deepseek-v3.json"
}

suite_fhmoe() {
  local o=$1 ranks=${GPU_CHECK_FHMOE_RANKS:-2} tokens=${GPU_CHECK_FHMOE_TOKENS:-1,8,32,128,512} steps=${GPU_CHECK_FHMOE_STEPS:-5}
  local backend=${GPU_CHECK_FHMOE_BACKEND:-ll} mode=${GPU_CHECK_FHMOE_MODE:-decode} spec preset experts topk name
  for spec in ${GPU_CHECK_FHMOE_PRESETS:-deepseek-v3:256:8 deepseek-v4-pro:384:6}; do
    IFS=: read -r preset experts topk <<<"$spec"
    name="moe-$preset-sweep-$backend-$mode-compare"
    python3 "$src/bench/fhmoe_sweep_trace.py" --experts "$experts" --top-k "$topk" --ranks "$ranks" --tokens "$tokens" \
      --steps "$steps" -o "$o/trace-$preset.json" >"$o/trace-$preset.log" 2>&1 || { echo "== trace for $preset failed"; SUITES_RC=1; continue; }
    step 180 "$o/$name.log" "$epx" moe --device cuda --ranks "$ranks" --preset "$preset" --dispatch-dtype fp8 --validate-tokens 1 \
      --expert-pool 16 --backend "$backend" --mode "$mode" --compare --trace "$o/trace-$preset.json" --json "$o/$name.json"
    rm -f "$o/trace-$preset.json"
    [ -f "$o/$name.json" ] && python3 "$src/bench/fhmoe_sweep_report.py" "$o/$name.json" --tokens "$tokens" --steps "$steps" \
      >>"$o/fhmoe-sweep.txt" 2>&1
  done
}

suite_gemm() {
  local o=$1
  step 90 "$o/gemm-bench.log" env GEMM_BENCH_COMMIT="$commit" "$bdir/epx-gemm-bench" --iters 10 --rounds 5 --no-simt \
    --json "$o/gemm-bench.json"
  step 60 "$o/gemm-torch.log" python3 bench/gemm_torch.py --iters 10 --uneven --json "$o/gemm-torch.json"
  if [ -d "$bdir/python/epx" ]; then
    step 180 "$o/gemm-vs-torch.log" env PYTHONPATH="$bdir/python" GEMM_BENCH_COMMIT="$commit" CUDA_VISIBLE_DEVICES=0 \
      python3 bench/gemm_vs_torch.py --rounds 9 --iters 10 --uneven --cool 10 --json "$o/gemm-vs-torch.json"
    step 60 "$o/example-contiguous.log" env PYTHONPATH="$bdir/python" CUDA_VISIBLE_DEVICES=0 \
      python3 examples/grouped_gemm_contiguous.py --device cuda:0
  else
    echo "== gemm_vs_torch.py and grouped_gemm_contiguous.py skipped: no Python module (GPU_CHECK_CMAKE_ARGS=-DEPX_PYTHON=ON)"
  fi
}

suite_mxfp4() {
  local o=$1
  step 90 "$o/gemm-mxfp4.log" env CUDA_VISIBLE_DEVICES=0 GEMM_BENCH_COMMIT="$commit" "$bdir/epx-gemm-mxfp4-bench" --iters 10 \
    --no-simt --stamps --fhmoe-experts 192,48 --json "$o/gemm-mxfp4.json"
}

suite_python() {
  local o=$1
  step 300 "$o/py-check.log" env OUT="$o" PYTEST_EPX_COMMIT="$commit" bash tools/device/py-check.sh "$src" "$CARRY/deps.tar.xz"
}

suite_san2() {
  local o=$1 cs=(env EPX_TIMEOUT_S=900 compute-sanitizer --target-processes all --report-api-errors no --error-exitcode 9) tool
  local ll_filter=${GPU_CHECK_SAN2_LL_FILTER:-LlCuda.PartialCombineMatchesCpuTwoRanks:LlCuda.GraphsWithDeviceTokenCountTwoRanks}
  for tool in memcheck racecheck; do
    step 120 "$o/$tool-ll-bench.log" "${cs[@]}" --tool $tool "$epx" bench --device cuda --case ll-v3 --backend ll --ranks 2 --iters 3 --warmup 1 \
      --kernel-time off --json "$o/$tool-ll-bench.json"
    step 150 "$o/$tool-ht-bench.log" "${cs[@]}" --tool $tool "$epx" bench --device cuda --case ht-v3 --backend ht --ranks 2 --iters 2 --warmup 1 \
      --kernel-time off --json "$o/$tool-ht-bench.json"
    step 150 "$o/$tool-ll-test.log" "${cs[@]}" --tool $tool "$bdir/ll_cuda_test" --gtest_filter="$ll_filter"
  done
  step 150 "$o/memcheck-ht-test.log" "${cs[@]}" --tool memcheck "$bdir/ht_cuda_test" \
    --gtest_filter="${GPU_CHECK_SAN2_HT_FILTER:-HtCuda.MatchesHtCpuTwoRanks}"
}

run_suites() {  # <src> <build> <results> <out>: GPU_CHECK_SUITES into <results>/<suite>/, the log in <results>/suites.log
  local src=$1 bdir=$2 res=$3 out=$4 epx="$2/epx" name commit
  commit="$(cat "$CARRY/commit.txt" 2>/dev/null || git -C "$src" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
  SUITES_RC=0
  for name in $GPU_CHECK_SUITES; do
    if ! declare -F "suite_$name" >/dev/null; then echo "== unknown suite $name"; SUITES_RC=1; continue; fi
    mkdir -p "$res/$name"
    echo "== suite $name"
    "suite_$name" "$res/$name"
    tar -C "$res" -czf "$out/results.tar.gz" .  # after every suite: a later time limit keeps what ran
  done >>"$res/suites.log" 2>&1
}

suites_digest() {  # <results>: the suites' verdict lines
  grep -E "^== (suite|skipped|unknown)|exit [1-9]" "$1/suites.log" | head -60
  grep -hE "^(ll|ht)-v[34] |backends pass|FAIL" "$1"/{ll,ht,multinode,layer}/*.log 2>/dev/null | head -60
  cat "$1/fhmoe/fhmoe-sweep.txt" 2>/dev/null | head -40
  grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$1"/san2/*.log 2>/dev/null | sort | uniq -c
  grep -E "rc=" "$1/python/py-env.txt" 2>/dev/null
}

suites_only() {  # GPU_CHECK_SUITES on the tree an earlier `run` built on this machine
  local out="${OUT:-/tmp/epx-gpu-check-out}" src="${GPU_CHECK_SRC:-$WORK/src}" bdir="$WORK/build" nccl
  [ -x "$bdir/epx" ] || { echo "no $bdir/epx: run 'bash tools/device/gpu-check.sh run' on this machine first"; return 1; }
  [ -n "${GPU_CHECK_SUITES:-}" ] || { echo "GPU_CHECK_SUITES names no suite"; return 2; }
  mkdir -p "$out" && device_env || return 1
  local res="$WORK/results-suites"
  rm -rf "$res" && mkdir -p "$res"
  run_suites "$src" "$bdir" "$res" "$out"
  [ -z "${GPU_CHECK_SRC:-}" ] && stamp_commit "$res"
  tar -C "$res" -czf "$out/results.tar.gz" .
  suites_digest "$res"
  return $SUITES_RC
}

case "$MODE" in
  pack) pack ;;
  run) run ;;
  suites) suites_only ;;
  *) echo "usage: $0 pack|run|suites" >&2; exit 2 ;;
esac
