// dispatch/dispatch_padded_cuda_test.cpp: naive, allgather_reducescatter and all2allv in their padded form
// on CUDA groups (use_worst_case_sizing: C rows per rank's block, counts on the device) against the CPU
// padded form, bit for bit, also with a device token count; a count above the bound and a bad device count
// refused on every rank. Through tests/cuda_ranks.h at R = 2, 4 and 8 (virtual ranks where GPUs are short);
// snapshots and comparison: dispatch_cuda_testing.h.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_ranks.h"
#include "test_util.h"
#include "dispatch/hier/hier.h"
#include "dispatch_harness.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "forked_ranks.h"

using namespace epx;
using namespace epx::test;

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "dispatch/dispatch_cuda_testing.h"

namespace {

// ---- the padded form (DispatchConfig::use_worst_case_sizing) of naive, agrs and all2allv -----------
//
// Every rank's block has C = num_max_dispatch_tokens_per_rank rows behind its plan record, in one
// collective; the counts stay on the device (no host wait, Capabilities::graph_safe). Checked against
// the CPU backends in their padded form (prepare_finalize_cpu.h pad_flat) bit for bit: every prepare
// output incl. the padding rows (x 0, scales 0, topk_idx -1, weights 0), every finalize output, the
// bytes (the CUDA form reports num_valid_selections and num_rank_dedup_rows as -1: only the device
// knows them). Ranks have different real counts (0, 1, 7 and 128 at C = 128), -1 selections,
// duplicates, the shared route, int64 ids, bf16 and FP8, both flat_combine modes, ranks without an
// expert, and a device token count (DispatchArgs::num_tokens) below x.shape[0]; two rounds per object.

DispatchConfig padded_config(const Case& c) {
  DispatchConfig cfg = c.config();
  cfg.use_worst_case_sizing = true;
  return cfg;
}

struct PaddedCase {
  Case c;
  Rounds rounds;
  std::vector<std::vector<int64_t>> counts;  ///< [round][rank] DispatchArgs::num_tokens, -1 = none (all x rows)
  std::vector<std::vector<std::vector<Snapshot>>> want;  ///< [backend][round][rank] from the CPU padded form
};

/// Rows of out a round defines: the device count, else every row of x.
int64_t defined_rows(const PaddedCase& pc, size_t round, int rank) {
  const int64_t n = pc.counts[round][static_cast<size_t>(rank)];
  return n >= 0 ? n : pc.rounds[round][static_cast<size_t>(rank)].x.size(0);
}

std::vector<PaddedCase> make_padded_cases(int R) {
  struct Spec {
    DType dtype;
    int E, K;
    std::vector<int64_t> T;  ///< tokens per rank (cycled); round 2 reverses them
    bool shared, idx64, with_counts;
    FlatCombine combine;
  };
  constexpr int kC = 128;
  const std::vector<Spec> specs = {
      {DType::bf16, 16, 4, {0, 1, 7, 128}, false, false, false, FlatCombine::partial_fp32},
      {DType::fp8_e4m3, 8, 4, {128, 7, 0, 1}, true, true, false, FlatCombine::partial_fp32},
      // E = 3: at R >= 4 ranks without an expert (N = 0 there, zeros back).
      {DType::bf16, 3, 2, {1, 0, 128, 7}, false, false, false, FlatCombine::partial_bf16},
      // x has C rows on every rank; the device count picks T (0, 1, 7, 128) of them.
      {DType::fp8_e4m3, 8, 3, {7, 128, 1, 0}, false, false, true, FlatCombine::partial_fp32},
  };
  std::vector<PaddedCase> cases;
  uint64_t seed = 301;
  for (const Spec& sp : specs) {
    PaddedCase pc;
    Case& c = pc.c;
    c.R = R;
    c.E = sp.E;
    c.K = sp.K;
    c.H = 2048;
    c.cap = kC;
    c.dtype = sp.dtype;
    c.shared = sp.shared;
    c.dups = true;
    c.idx64 = sp.idx64;
    c.masked = 0.2;
    c.flat_combine = sp.combine;
    c.seed = seed++;
    const std::vector<int64_t> real = per_rank(R, sp.T);
    std::vector<int64_t> real2(real.rbegin(), real.rend());
    c.T = sp.with_counts ? std::vector<int64_t>(static_cast<size_t>(R), kC) : real;
    Case c2 = c;
    if (!sp.with_counts) c2.T = real2;
    c2.seed = c.seed + 1000;
    pc.rounds = {make_inputs(c), make_inputs(c2)};
    if (sp.with_counts) {
      pc.counts = {real, real2};
    } else {
      pc.counts.assign(2, std::vector<int64_t>(static_cast<size_t>(R), -1));
    }
    cases.push_back(std::move(pc));
  }
  return cases;
}

/// The CPU backend `name` in its padded form over every round of one object: [round][rank]. out holds
/// the defined rows only (the CPU leaves rows past a device count as they were).
std::vector<std::vector<Snapshot>> run_cpu_padded(const std::string& name, const PaddedCase& pc) {
  const Case& c = pc.c;
  auto groups = make_cpu_groups(c.R, 30.0);
  std::vector<std::vector<Snapshot>> snaps(pc.rounds.size(), std::vector<Snapshot>(static_cast<size_t>(c.R)));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], padded_config(c));
    for (size_t i = 0; i < pc.rounds.size(); ++i) {
      const RankInput& ri = pc.rounds[i][static_cast<size_t>(r)];
      Snapshot& s = snaps[i][static_cast<size_t>(r)];
      DispatchArgs a{ri.x, ri.topk_idx, ri.topk_weights};
      Tensor count = Tensor::empty({1}, DType::int32);
      if (pc.counts[i][static_cast<size_t>(r)] >= 0) {
        count.ptr<int32_t>()[0] = static_cast<int32_t>(pc.counts[i][static_cast<size_t>(r)]);
        a.num_tokens = count.view();
      }
      take_prepare(pf->prepare(a), s);
      const Tensor eo = experts_out(c, r, s);
      Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      poison(out);
      pf->finalize({eo, out});
      s.out = host_bytes(out.view().slice_rows(0, defined_rows(pc, i, r)));
      s.stats = pf->stats();
      s.stats.num_valid_selections = -1;  // the CUDA form knows these on the device only
      s.stats.num_rank_dedup_rows = -1;
    }
  });
  return snaps;
}

/// Backend `name` in its padded form on this rank's group over every round of one object (odd rounds on
/// the legacy default stream with x and out 2 bytes off alignment, as run_gpu).
std::vector<Snapshot> run_gpu_padded(const std::string& name, const PaddedCase& pc, const std::shared_ptr<Group>& g, cudaStream_t stream) {
  const Case& c = pc.c;
  const int r = g->rank();
  const Device dev = g->device();
  auto pf = make_prepare_finalize(name, g, padded_config(c));
  if (!pf->capabilities().graph_safe) throw std::runtime_error(name + " padded: capabilities().graph_safe is false");
  std::vector<Snapshot> snaps(pc.rounds.size());
  for (size_t i = 0; i < pc.rounds.size(); ++i) {
    const RankInput& ri = pc.rounds[i][static_cast<size_t>(r)];
    const int64_t T = ri.x.size(0);
    const bool odd = i % 2 == 1;
    const cudaStream_t s = odd ? nullptr : stream;
    const Tensor x_store = Tensor::empty({T * c.H + 1}, DType::bf16, dev);
    const TensorView x(x_store.ptr<uint16_t>() + (odd ? 1 : 0), DType::bf16, {T, c.H}, dev);
    copy(x, ri.x);
    const Tensor idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
    DispatchArgs a{x, idx, w, Stream{s}};
    Tensor count_host = Tensor::empty({1}, DType::int32), count;
    if (pc.counts[i][static_cast<size_t>(r)] >= 0) {
      count_host.ptr<int32_t>()[0] = static_cast<int32_t>(pc.counts[i][static_cast<size_t>(r)]);
      count = count_host.to(dev);
      a.num_tokens = count.view();
    }
    if (auto why = pf->why_unsupported(a)) throw std::runtime_error(name + " padded: " + *why);
    const PrepareResult p = pf->prepare(a);
    cuda_ok(cudaStreamSynchronize(s), "sync after prepare");
    Snapshot& snap = snaps[i];
    take_prepare(p, snap);
    const Tensor eo = experts_out(c, r, snap).to(dev);
    const Tensor out_store = Tensor::empty({T * c.H + 1}, DType::bf16, dev);
    test::poison_device(out_store.data(), static_cast<size_t>(out_store.nbytes()), "poison out");
    const TensorView out(out_store.ptr<uint16_t>() + (odd ? 1 : 0), DType::bf16, {T, c.H}, dev);
    pf->finalize({eo, out, Stream{s}});
    cuda_ok(cudaStreamSynchronize(s), "sync after finalize");
    snap.out = host_bytes(out.slice_rows(0, defined_rows(pc, i, r)));
    snap.stats = pf->stats();
  }
  return snaps;
}

/// A bad call in the padded form, on every backend: (1) rank 1 passes x with C + 1 rows: its host
/// refuses it (InvalidArgument naming num_max_dispatch_tokens_per_rank) after sending its record and its
/// share of the finalize's collectives; the peers' prepare moves nothing (every row padding) and their
/// finalize throws InvalidArgument naming rank 1, after its launch. (2) The last rank's device count is
/// above its x.shape[0]: every rank's finalize throws InvalidArgument naming num_tokens and that rank.
/// After each, the object runs a good round bit for bit against the CPU padded form.
void check_padded_bad_calls(const std::string& name, const PaddedCase& good, size_t backend, const std::shared_ptr<Group>& g,
                            cudaStream_t stream, std::string& failures) {
  const Case& c = good.c;
  const int r = g->rank(), R = c.R;
  const Device dev = g->device();
  auto pf = make_prepare_finalize(name, g, padded_config(c));
  const RankInput& ri = good.rounds[0][static_cast<size_t>(r)];
  const int64_t T = ri.x.size(0);
  const std::string where = name + " padded rank " + std::to_string(r) + ": ";
  // One call on device copies of rows [0, rows) (rows > T: the last row repeated), device count `count` (-1: none).
  auto call = [&](int64_t rows, int64_t count, std::string& prepare_what, std::string& finalize_what) {
    Tensor xh = Tensor::empty({rows, c.H}, DType::bf16), ih = Tensor::empty({rows, c.K}, ri.topk_idx.dtype());
    Tensor wh = Tensor::empty({rows, c.K}, DType::fp32);
    const int64_t ib = dtype_size(ri.topk_idx.dtype()) * c.K;
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t src = T == 0 ? -1 : std::min(t, T - 1);
      if (src < 0) {  // no rows to copy: a fresh token, no selection
        std::fill_n(xh.ptr<uint16_t>() + t * c.H, c.H, float_to_bf16_bits(0.5f));
        std::memset(static_cast<uint8_t*>(ih.data()) + t * ib, 0xff, static_cast<size_t>(ib));
        std::fill_n(wh.ptr<float>() + t * c.K, c.K, 0.0f);
        continue;
      }
      std::memcpy(xh.ptr<uint16_t>() + t * c.H, ri.x.ptr<uint16_t>() + src * c.H, static_cast<size_t>(2 * c.H));
      std::memcpy(static_cast<uint8_t*>(ih.data()) + t * ib, static_cast<const uint8_t*>(ri.topk_idx.data()) + src * ib, static_cast<size_t>(ib));
      std::memcpy(wh.ptr<float>() + t * c.K, ri.topk_weights.ptr<float>() + src * c.K, static_cast<size_t>(4 * c.K));
    }
    const Tensor x = xh.to(dev), idx = ih.to(dev), w = wh.to(dev);
    DispatchArgs a{x, idx, w, Stream{stream}};
    Tensor n_host = Tensor::empty({1}, DType::int32), n_dev;
    if (count >= 0) {
      n_host.ptr<int32_t>()[0] = static_cast<int32_t>(count);
      n_dev = n_host.to(dev);
      a.num_tokens = n_dev.view();
    }
    PrepareResult p;
    bool prepared = false;
    try {
      p = pf->prepare(a);
      prepared = true;
    } catch (const InvalidArgument& e) {
      prepare_what = e.what();
    }
    // The device report of a bad record is written by the prepare's unpack kernel: finalize reads it
    // (host-mapped, no sync of its own) once the stream has passed that kernel.
    cuda_ok(cudaStreamSynchronize(stream), "sync after prepare");
    if (!prepared) return;
    const Tensor eo = Tensor::zeros({p.num_recv_tokens, c.H}, c.expert_out_dtype(ActivationLayout::Flat), dev);
    const Tensor out = Tensor::empty({rows, c.H}, DType::bf16, dev);
    try {
      pf->finalize({eo, out, Stream{stream}});
    } catch (const InvalidArgument& e) {
      finalize_what = e.what();
    }
    cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
  };
  auto good_round = [&](const char* after) {
    const RankInput& gi = good.rounds[0][static_cast<size_t>(r)];
    const Tensor x = gi.x.to(dev), idx = gi.topk_idx.to(dev), w = gi.topk_weights.to(dev);
    Snapshot snap;
    take_prepare(pf->prepare({x, idx, w, Stream{stream}}), snap);
    cuda_ok(cudaStreamSynchronize(stream), "sync after prepare");
    const Tensor eo = experts_out(c, r, snap).to(dev);
    const Tensor out = Tensor::empty({gi.x.size(0), c.H}, DType::bf16, dev);
    test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison out");
    pf->finalize({eo, out, Stream{stream}});
    cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
    snap.out = host_bytes(out);
    snap.stats = pf->stats();
    const std::string d = compare(snap, good.want[backend][0][static_cast<size_t>(r)]);
    if (!d.empty()) failures += where + "the round after " + after + ": " + d + "\n";
  };

  // (1) A count above the bound on rank 1.
  std::string pw, fw;
  call(r == 1 ? c.cap + 1 : std::min<int64_t>(T, c.cap), -1, pw, fw);
  if (r == 1) {
    if (pw.find("num_max_dispatch_tokens_per_rank = " + std::to_string(c.cap)) == std::string::npos)
      failures += where + "x with C + 1 rows: prepare threw '" + pw + "'; ";
  } else if (!pw.empty() || !names_rank(fw, 1) || fw.find("rejected its arguments") == std::string::npos) {
    failures += where + "rank 1 above the bound: prepare threw '" + pw + "', finalize '" + fw + "' (want finalize naming rank 1); ";
  }
  if (r == 0) std::printf("%s padded, rank 1 above the bound: rank 0's finalize threw: %s\n", name.c_str(), fw.c_str());
  good_round("a count above the bound");

  // (2) The last rank's device count above its x.shape[0] (4 rows, count 5; the others 3 of 4).
  pw.clear();
  fw.clear();
  call(4, r == R - 1 ? 5 : 3, pw, fw);
  if (!pw.empty() || fw.find("num_tokens = 5") == std::string::npos || !names_rank(fw, R - 1))
    failures += where + "device count 5 > x.shape[0] = 4 on rank " + std::to_string(R - 1) + ": prepare threw '" + pw + "', finalize '" + fw + "'; ";
  if (r == 0) std::printf("%s padded, a device count above x.shape[0]: rank 0's finalize threw: %s\n", name.c_str(), fw.c_str());
  good_round("a device count above x.shape[0]");
}

/// The padded form of every backend on every case at R ranks (run_cuda_ranks: one GPU per rank where
/// the machine has R, else virtual ranks), then the bad calls.
void run_padded_world(int R) {
  std::vector<PaddedCase> cases = make_padded_cases(R);
  for (PaddedCase& pc : cases)
    for (const std::string& name : kBackends) pc.want.push_back(run_cpu_padded(name, pc));
  say_where(R);
  const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    std::string failures;
    int checked = 0;
    for (const PaddedCase& pc : cases) {
      for (size_t b = 0; b < kBackends.size(); ++b) {
        const auto got = run_gpu_padded(kBackends[b], pc, g, rs.s);
        for (size_t i = 0; i < got.size(); ++i) {
          const Snapshot& want = pc.want[b][i][static_cast<size_t>(rank)];
          const std::string d = compare(got[i], want);
          if (!d.empty())
            failures += kBackends[b] + " padded round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + pc.c.describe() + ": " + d + "\n";
          ++checked;
          if (rank == 0 && i + 1 == got.size())
            std::printf("%-24s padded %s%s: N=%lld %s, prepare + finalize %s vs CPU\n", kBackends[b].c_str(), pc.c.describe().c_str(),
                        pc.counts[i][0] >= 0 ? " (device counts)" : "", static_cast<long long>(got[i].num_recv_tokens),
                        got[i].layout.c_str(), d.empty() ? "bit-exact" : "DIFFER");
        }
      }
    }
    for (size_t b = 0; b < kBackends.size(); ++b) check_padded_bad_calls(kBackends[b], cases[0], b, g, rs.s, failures);
    g->barrier();
    if (rank == 0 && failures.empty()) std::printf("padded form OK at R = %d: %d rounds bit-exact vs the CPU padded form\n", R, checked);
    test::throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "") << "padded form, R = " << R;
}

// The padded form (use_worst_case_sizing) of naive / allgather_reducescatter / all2allv.
TEST(DispatchCuda, PaddedFormMatchesCpuTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_padded_world(2);
}

TEST(DispatchCuda, PaddedFormMatchesCpuFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_padded_world(4);
}

TEST(DispatchCuda, PaddedFormMatchesCpuEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_padded_world(8);
}

}  // namespace

#endif  // EPX_WITH_CUDA
