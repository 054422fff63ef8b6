// dispatch/ll/ll_cuda_testing.h: what the ll CUDA tests share (ll_cuda_test.cpp, ll_calls_cuda_test.cpp,
// ll_errors_cuda_test.cpp): snapshots of a rank's prepare + finalize outputs, the CPU reference run, the
// eager cases and their driver. Test-only; include after the CUDA headers, inside EPX_WITH_CUDA.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>  // setenv (the test bodies' callers only)
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dispatch_harness.h"
#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "cuda_ranks.h"
#include "test_util.h"
#include "forked_ranks.h"

using namespace epx;
using namespace epx::test;

#include <cuda_runtime_api.h>

#include "dispatch/ll/ll.h"
#include "dispatch/ll/ll_cuda.h"

namespace {


using test::RankStream;
using test::per_rank;
using test::throw_failures;
using test::say_where;

/// Waits for this thread's legacy-stream memsets / copies (they do not order a cudaStreamNonBlocking
/// stream, and a pageable upload may return before its DMA lands); not for the device: on virtual
/// ranks a peer's kernel on this GPU may wait for work this rank has yet to queue.
inline void sync_legacy(const char* what) { cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), what); }


/// What one rank's prepare + finalize produced, reduced to the parts both devices define (valid
/// rows only: rows >= recv_count[l] are stale by contract).
struct Snap {
  std::vector<int32_t> recv_count;
  std::vector<uint8_t> x, scales;               ///< valid rows, expert by expert
  std::vector<int32_t> src_rank, src_token, col;  ///< valid slots
  std::vector<int64_t> range;
  std::vector<uint8_t> out;
  std::vector<int32_t> msg_rows, msg_src;  ///< partial modes: rows / source tokens of valid messages
  std::vector<float> msg_w;
};

/// The partial modes' per-message handle (valid messages only: j < msg_count[s]).
inline void take_msgs(Snap& s, const dispatch::LlHandle& h, int K) {
  const std::vector<uint8_t> cnt = host_bytes(h.msg_count), rows = host_bytes(h.msg_rows), src = host_bytes(h.msg_src_token),
                             w = host_bytes(h.msg_weights);
  const int64_t R = h.msg_count.size(0), max_t = h.msg_src_token.size(1);
  for (int64_t r = 0; r < R; ++r) {
    int32_t n;
    std::memcpy(&n, cnt.data() + 4 * r, 4);
    if (n < 0 || n > max_t) throw std::runtime_error("msg_count[" + std::to_string(r) + "] = " + std::to_string(n));
    for (int64_t j = 0; j < n; ++j) {
      int32_t v;
      std::memcpy(&v, src.data() + 4 * (r * max_t + j), 4), s.msg_src.push_back(v);
      for (int k = 0; k < K; ++k) {
        float f;
        std::memcpy(&v, rows.data() + 4 * ((r * max_t + j) * K + k), 4), s.msg_rows.push_back(v);
        std::memcpy(&f, w.data() + 4 * ((r * max_t + j) * K + k), 4), s.msg_w.push_back(f);
      }
    }
  }
}

/// Snapshot of a prepare result (any device) + handle views.
inline Snap take(const PrepareResult& p, const TensorView& src_rank, const TensorView& src_token, const TensorView& col,
          const TensorView& range) {
  Snap s;
  const std::vector<uint8_t> cnt = host_bytes(p.recv_count), x = host_bytes(p.x), sc = host_bytes(p.x_scales);
  const std::vector<uint8_t> sr = host_bytes(src_rank), st = host_bytes(src_token), cl = host_bytes(col), rg = host_bytes(range);
  const int64_t L = p.x.size(0), cap = p.x.size(1);
  const int64_t row_bytes = p.x.size(2) * dtype_size(p.x.dtype), srow = p.x_scales.defined() ? p.x_scales.size(2) * 4 : 0;
  s.recv_count.resize(static_cast<size_t>(L));
  std::memcpy(s.recv_count.data(), cnt.data(), cnt.size());
  for (int64_t l = 0; l < L; ++l) {
    const int64_t n = s.recv_count[static_cast<size_t>(l)];
    if (n < 0 || n > cap) throw std::runtime_error("recv_count[" + std::to_string(l) + "] = " + std::to_string(n));
    s.x.insert(s.x.end(), x.begin() + l * cap * row_bytes, x.begin() + (l * cap + n) * row_bytes);
    if (srow) s.scales.insert(s.scales.end(), sc.begin() + l * cap * srow, sc.begin() + (l * cap + n) * srow);
    for (int64_t j = 0; j < n; ++j) {
      int32_t v;
      std::memcpy(&v, sr.data() + 4 * (l * cap + j), 4), s.src_rank.push_back(v);
      std::memcpy(&v, st.data() + 4 * (l * cap + j), 4), s.src_token.push_back(v);
      std::memcpy(&v, cl.data() + 4 * (l * cap + j), 4), s.col.push_back(v);
    }
  }
  s.range.resize(rg.size() / 8);
  std::memcpy(s.range.data(), rg.data(), rg.size());
  return s;
}

inline std::string diff(const Snap& got, const Snap& want) {
  std::string d;
  auto cmp = [&](const char* what, const auto& a, const auto& b) {
    if (a.size() != b.size()) {
      d += std::string(what) + ": " + std::to_string(a.size()) + " elements, want " + std::to_string(b.size()) + "; ";
      return;
    }
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i] != b[i]) {
        d += std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(static_cast<long long>(a[i])) + ", want " +
             std::to_string(static_cast<long long>(b[i])) + "; ";
        return;
      }
  };
  cmp("recv_count", got.recv_count, want.recv_count);
  cmp("x", got.x, want.x);
  cmp("x_scales", got.scales, want.scales);
  cmp("src_rank", got.src_rank, want.src_rank);
  cmp("src_token", got.src_token, want.src_token);
  cmp("topk_column", got.col, want.col);
  cmp("layout_range", got.range, want.range);
  cmp("out", got.out, want.out);
  cmp("msg_rows", got.msg_rows, want.msg_rows);
  cmp("msg_src_token", got.msg_src, want.msg_src);
  std::vector<uint32_t> gw(got.msg_w.size()), ww(want.msg_w.size());  // weights as bits
  if (!gw.empty()) std::memcpy(gw.data(), got.msg_w.data(), 4 * gw.size());
  if (!ww.empty()) std::memcpy(ww.data(), want.msg_w.data(), 4 * ww.size());
  cmp("msg_weights", gw, ww);
  return d;
}

inline std::vector<int> local_ids(const Case& c, int rank) {
  std::vector<int> ids;
  const ExpertRange range = expert_range(c.E, c.R, rank);
  for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
  if (c.shared) ids.push_back(c.E);
  return ids;
}

/// The experts step on the host: expert_out [L, cap, H] bf16 from a prepare result (any device).
inline Tensor experts_out(const Case& c, int rank, const PrepareResult& p) {
  const bool fp8 = c.dtype == DType::fp8_e4m3;
  const int64_t L = p.x.size(0), cap = p.x.size(1), H = c.H;
  Tensor x = Tensor::empty({L, cap, H}, fp8 ? DType::fp8_e4m3 : DType::bf16), scales, counts = Tensor::empty({L}, DType::int32);
  copy(x, p.x);
  if (fp8) {
    scales = Tensor::empty({L, cap, H / kFp8GroupSize}, DType::fp32);
    copy(scales, p.x_scales);
  }
  copy(counts, p.recv_count);
  Tensor out = Tensor::empty({L, cap, H}, DType::bf16);
  poison(out);
  if (L == 0) return out;
  TestExperts experts(local_ids(c, rank), H);
  experts.apply({ActivationLayout::ExpertMajor, x, scales, counts, {}, {}}, out, {});
  return out;
}

/// Rows [0, T) of a rank input.
inline RankInput head(const RankInput& ri, int64_t T) {
  RankInput h;
  const int64_t H = ri.x.size(1), K = ri.topk_idx.size(1);
  h.x = Tensor::empty({T, H}, DType::bf16);
  h.topk_idx = Tensor::empty({T, K}, ri.topk_idx.dtype());
  h.topk_weights = Tensor::empty({T, K}, DType::fp32);
  std::memcpy(h.x.data(), ri.x.data(), static_cast<size_t>(h.x.nbytes()));
  std::memcpy(h.topk_idx.data(), ri.topk_idx.data(), static_cast<size_t>(h.topk_idx.nbytes()));
  std::memcpy(h.topk_weights.data(), ri.topk_weights.data(), static_cast<size_t>(h.topk_weights.nbytes()));
  return h;
}

/// LlCpu on R CPU ranks over `rounds` (each [rank] inputs) on one object: [round][rank].
inline std::vector<std::vector<Snap>> run_cpu(const Case& c, const std::vector<std::vector<RankInput>>& rounds) {
  auto groups = make_cpu_groups(c.R, 60.0);
  std::vector<std::vector<Snap>> snaps(rounds.size(), std::vector<Snap>(static_cast<size_t>(c.R)));
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize("ll", groups[static_cast<size_t>(r)], c.config());
    auto* ll = dynamic_cast<dispatch::LlCpu*>(pf.get());
    for (size_t i = 0; i < rounds.size(); ++i) {
      const RankInput& ri = rounds[i][static_cast<size_t>(r)];
      const PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      const dispatch::LlHandle& h = ll->handle();
      Snap s = take(p, h.src_rank, h.src_token, h.topk_column, h.layout_range);
      if (c.ll_combine != LlCombine::column) take_msgs(s, h, c.K);
      const Tensor eo = experts_out(c, r, p);
      Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      poison(out);
      pf->finalize({eo, out});
      s.out = host_bytes(out);
      snaps[i][static_cast<size_t>(r)] = std::move(s);
    }
  });
  return snaps;
}

/// Device copies of a rank input, with x [rows, H] padded to `rows` >= T (rows beyond T poisoned).
struct DevInput {
  Tensor x, idx, w;
};
inline DevInput upload(const RankInput& ri, int64_t rows, Device dev) {
  DevInput d;
  const int64_t T = ri.x.size(0), H = ri.x.size(1), K = ri.topk_idx.size(1);
  d.x = Tensor::empty({rows, H}, DType::bf16, dev);
  d.idx = Tensor::empty({rows, K}, ri.topk_idx.dtype(), dev);
  d.w = Tensor::empty({rows, K}, DType::fp32, dev);
  cuda_ok(cudaMemset(d.x.data(), 0x7f, static_cast<size_t>(d.x.nbytes())), "poison x");
  cuda_ok(cudaMemset(d.idx.data(), 0x7f, static_cast<size_t>(d.idx.nbytes())), "poison idx");  // invalid ids beyond T
  cuda_ok(cudaMemset(d.w.data(), 0x7f, static_cast<size_t>(d.w.nbytes())), "poison w");
  cuda_ok(cudaMemcpy(d.x.data(), ri.x.data(), static_cast<size_t>(T * H * 2), cudaMemcpyHostToDevice), "x");
  cuda_ok(cudaMemcpy(d.idx.data(), ri.topk_idx.data(), static_cast<size_t>(ri.topk_idx.nbytes()), cudaMemcpyHostToDevice), "idx");
  cuda_ok(cudaMemcpy(d.w.data(), ri.topk_weights.data(), static_cast<size_t>(ri.topk_weights.nbytes()), cudaMemcpyHostToDevice), "w");
  // The memsets run on the legacy stream and a pageable cudaMemcpy may return before its DMA lands;
  // the tests launch on cudaStreamNonBlocking streams, which do not wait for either.
  sync_legacy("sync upload");
  return d;
}

inline void poison_outputs(const PrepareResult& p, dispatch::LlCuda& ll) {
  // Only the receive counts and handle: rows of x beyond the counts are stale by contract, and
  // every valid row is compared.
  cuda_ok(cudaMemset(p.recv_count.data, 0xff, static_cast<size_t>(p.recv_count.nbytes())), "poison recv_count");
  for (const Tensor* t : {&ll.handle().src_rank, &ll.handle().src_token, &ll.handle().topk_column, &ll.handle().layout_range,
                          &ll.handle().msg_count, &ll.handle().msg_src_token, &ll.handle().msg_rows, &ll.handle().msg_weights})
    cuda_ok(cudaMemset(t->data(), 0xff, static_cast<size_t>(t->nbytes())), "poison handle");
  // Landed before the next prepare on the non-blocking stream (graph replays follow at once).
  sync_legacy("sync poison handle");
}

/// One eager round on the GPU: prepare (fused or split), host experts, finalize (fused or split).
/// `align`: a group barrier right before the prepare (the ranks launch it together). `late_error`: no
/// check() between prepare and finalize, and an InvalidArgument of the finalize (thrown after its launch)
/// or of the check() after it is appended there instead of thrown.
inline Snap gpu_round(const Case& c, dispatch::LlCuda& ll, const RankInput& ri, int rank, cudaStream_t s, bool split, Group* align = nullptr,
               std::string* late_error = nullptr) {
  const Device dev = ll.handle().src_rank.device();
  const int64_t T = ri.x.size(0);
  const DevInput in = upload(ri, T, dev);
  const DispatchArgs a{in.x, in.idx, in.w, Stream{s}};
  if (align) align->barrier();
  PrepareResult p;
  if (split) {
    p = ll.prepare_send(a);
    ll.prepare_recv(Stream{s});
  } else {
    p = ll.prepare(a);
  }
  cuda_ok(cudaStreamSynchronize(s), "sync prepare");
  if (!late_error) ll.check(Stream{s});
  Snap snap = take(p, ll.handle().src_rank, ll.handle().src_token, ll.handle().topk_column, ll.handle().layout_range);
  if (c.ll_combine != LlCombine::column) take_msgs(snap, ll.handle(), c.K);
  const Tensor eo = experts_out(c, rank, p).to(dev);
  Tensor out = Tensor::empty({T, c.H}, DType::bf16, dev);
  cuda_ok(cudaMemset(out.data(), 0xff, static_cast<size_t>(out.nbytes())), "poison out");
  // Legacy-stream memset: done before the non-blocking stream's combine (a combine that ran first
  // would have its output overwritten by the poison).
  sync_legacy("sync poison out");
  try {
    if (split) {
      ll.finalize_send({eo, out, Stream{s}});
      ll.finalize_recv(Stream{s});
    } else {
      ll.finalize({eo, out, Stream{s}});
    }
    cuda_ok(cudaStreamSynchronize(s), "sync finalize");
    ll.check(Stream{s});
  } catch (const InvalidArgument& e) {
    if (!late_error) throw;
    *late_error += e.what();
    cuda_ok(cudaStreamSynchronize(s), "sync finalize");
    ll.check(Stream{s});  // thrown once
  }
  snap.out = host_bytes(out);
  // Poison the outputs for the next round (recv_count / handle must be rewritten).
  poison_outputs(p, ll);
  cuda_ok(cudaMemset(p.x.data, 0xff, static_cast<size_t>(p.x.nbytes())), "poison x");
  if (p.x_scales.defined()) cuda_ok(cudaMemset(p.x_scales.data, 0xff, static_cast<size_t>(p.x_scales.nbytes())), "poison scales");
  sync_legacy("sync poison");
  return snap;
}

struct EagerCase {
  Case c;
  std::vector<std::vector<RankInput>> rounds;  ///< [round][rank]
  std::vector<std::vector<Snap>> want;
};

inline Case make_case(int R, int64_t H, int E, int K, DType dt, bool ue8m0, bool shared, bool dups, bool idx64, double masked, int cap,
               std::vector<int64_t> T, uint64_t seed) {
  Case c;
  c.R = R, c.H = H, c.E = E, c.K = K, c.dtype = dt, c.ue8m0 = ue8m0, c.shared = shared, c.dups = dups, c.idx64 = idx64;
  c.masked = masked, c.cap = cap, c.T = std::move(T), c.seed = seed;
  return c;
}

inline std::vector<EagerCase> cases_of(std::vector<Case> cs, LlCombine mode);

/// The eager cases at R ranks: the shapes below on 1 and 2 ranks; on 4 and 8 ranks small ones (hidden
/// 1024 bf16 with duplicates, 512 fp8, 384 fp8 + UE8M0 with the shared route, int64 ids and an uneven
/// expert split), each with T in {0, 1, 7, 128} (or the capacity 16) across the ranks.
inline std::vector<EagerCase> eager_cases(int R, LlCombine mode, bool all) {
  if (R > 2) {
    std::vector<Case> cs = {
        make_case(R, 1024, 4 * R, 8, DType::bf16, false, false, true, false, 0.2, 128, per_rank(R, {128, 0, 7, 1}), 121),
        make_case(R, 512, 2 * R, 4, DType::fp8_e4m3, false, false, false, false, 0.15, 128, per_rank(R, {1, 128, 0, 7}), 122),
        make_case(R, 384, R + 3, 3, DType::fp8_e4m3, true, true, false, true, 0.25, 16, per_rank(R, {7, 16, 0, 1}), 123),
    };
    if (!all) cs = mode == LlCombine::partial_bf16 ? std::vector<Case>{cs[0]} : std::vector<Case>{cs[1], cs[2]};
    return cases_of(std::move(cs), mode);
  }
  auto t = [&](std::vector<int64_t> two) { return R == 2 ? two : std::vector<int64_t>{two[0]}; };
  std::vector<Case> cs = {
      // ll-v3: DeepSeek-V3 decode
      make_case(R, 7168, 256, 8, DType::fp8_e4m3, false, false, false, false, 0.1, 128, t({128, 7}), 21),
      // ll-v4: DeepSeek-V4-Pro decode (6 routed), and with the shared route as a 7th column
      make_case(R, 7168, 384, 6, DType::fp8_e4m3, false, false, false, false, 0.1, 128, t({1, 128}), 22),
      make_case(R, 7168, 384, 7, DType::fp8_e4m3, true, true, false, false, 0.1, 128, t({7, 0}), 23),
      make_case(R, 4096, 64, 8, DType::bf16, false, false, true, true, 0.2, 128, t({128, 1}), 24),
      make_case(R, 4096, 64, 4, DType::fp8_e4m3, true, false, true, false, 0.15, 16, t({0, 16}), 25),
      make_case(R, 2048, 32, 8, DType::bf16, false, true, true, false, 0.3, 128, t({7, 128}), 26),
      make_case(R, 2048, 8, 2, DType::fp8_e4m3, false, false, false, true, 0.0, 8, t({0, 0}), 27),
      make_case(R, 2048, 3, 2, DType::bf16, false, false, false, false, 0.25, 40, t({33, 1}), 28),  // R = 2: E odd
  };
  // Partial modes: ll-v3 (T 128 / 7), ll-v4 (T 1 / 128), hidden 4096 (fp8, T 0 / 16) and 2048 (bf16,
  // shared route, duplicates); partial_bf16 only the two small ones (the GPU test label's time).
  // One rank (nothing crosses NVLink): the ll-v3 shape, shared route + UE8M0, hidden 4096 fp8 with
  // T 0 / 16, and 2048 with T 0; the GPU test label's time.
  if (all && R == 1) cs = {cs[0], cs[2], cs[4], cs[6]};
  if (!all) cs = mode == LlCombine::partial_bf16 ? std::vector<Case>{cs[4], cs[5]} : std::vector<Case>{cs[0], cs[1], cs[4], cs[5]};
  return cases_of(std::move(cs), mode);
}

/// Three rounds per case (the second with the ranks' T reversed), with LlCpu's results.
inline std::vector<EagerCase> cases_of(std::vector<Case> cs, LlCombine mode) {
  std::vector<EagerCase> out;
  for (Case c : cs) {
    c.ll_combine = mode;
    EagerCase e;
    e.c = c;
    Case c2 = c;
    c2.T.assign(c.T.rbegin(), c.T.rend());
    c2.seed += 1000;
    Case c3 = c;
    c3.seed += 2000;
    e.rounds = {make_inputs(c), make_inputs(c2), make_inputs(c3)};
    e.want = run_cpu(c, e.rounds);
    out.push_back(std::move(e));
  }
  return out;
}

/// `launch`: construct LlCuda with this launch shape / protocol instead of make_prepare_finalize's
/// (the Config's).
inline void run_eager(int R, LlCombine mode = LlCombine::column, const dispatch::LlLaunch* launch = nullptr) {
  say_where(R);
  const std::vector<EagerCase> cases = eager_cases(R, mode, mode == LlCombine::column);
  const std::string failed = run_cuda_ranks(R, 400.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t s = rs.s;
    std::string failures;
    for (const EagerCase& ec : cases) {
      std::unique_ptr<PrepareFinalize> pf =
          launch ? std::make_unique<dispatch::LlCuda>(g, ec.c.config(), *launch) : make_prepare_finalize("ll", g, ec.c.config());
      auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get());
      if (!ll) throw std::runtime_error("make_prepare_finalize(ll) on a CUDA group is not LlCuda");
      if (!ll->capabilities().graph_safe || !ll->capabilities().static_buffers) throw std::runtime_error("capabilities");
      for (size_t i = 0; i < ec.rounds.size(); ++i) {
        const bool split = i == 2;  // the third round through the send/recv hooks
        const Snap got = gpu_round(ec.c, *ll, ec.rounds[i][static_cast<size_t>(rank)], rank, s, split);
        const std::string d = diff(got, ec.want[i][static_cast<size_t>(rank)]);
        if (!d.empty()) failures += "round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + ec.c.describe() + ": " + d + "\n";
        if (rank == 0)
          std::printf("ll cuda %s round %zu%s: %s\n", ec.c.describe().c_str(), i, split ? " (send/recv hooks)" : "",
                      d.empty() ? "bit-exact vs LlCpu" : "DIFFERS");
      }
    }
    g->barrier();
    if (!failures.empty()) throw_failures(rank, "mismatches:\n" + failures);
  });
  EXPECT_EQ(failed, "");
}


inline int gpus() { return cuda::device_count(); }

/// The only skip for want of GPUs: none at all. With fewer GPUs than ranks the ranks run as virtual
/// ranks on GPU 0 (cuda_ranks.h).
constexpr const char* kNoGpu = "no CUDA GPU on this machine";

struct GraphPair {
  cudaGraphExec_t prepare = nullptr, finalize = nullptr;
};

inline void capture(cudaStream_t s, cudaGraphExec_t& exec, const std::function<void()>& body) {
  cudaGraph_t graph;
  cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
  body();
  cuda_ok(cudaStreamEndCapture(s, &graph), "end capture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cuda_ok(cudaGraphDestroy(graph), "graph destroy");
}

}  // namespace
