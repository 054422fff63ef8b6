// dispatch/ll/ll_cuda_test.cpp: the ll backend on CUDA (ll_cuda.h) against the CPU reference LlCpu on
// the same inputs. Multi-rank cases run through tests/cuda_ranks.h run_cuda_ranks: one forked process
// per GPU where the machine has enough GPUs, else R virtual ranks (threads) on GPU 0; at 1 and 2 ranks,
// and at 4 and 8 ranks on small shapes where a case takes a rank count:
//   - prepare: recv_count, every valid row of x (bf16 bits / fp8 codes), x_scales, the handle
//     (src_rank, src_token, topk_column of every valid slot) and layout_range, bit for bit;
//   - finalize: out bit for bit (fp32 column-order sum, one rounding; with the expert-side partial
//     combine modes LlCombine::partial_fp32 / partial_bf16, LlCpu in the same mode, plus the
//     handle's per-message rows msg_count / msg_src_token / msg_rows / msg_weights);
// at the ll-v3 (H 7168, E 256, K 8, fp8) and ll-v4 (E 384, K 6, fp8) shapes and hidden 2048 / 4096
// (bf16, fp8, fp8 + UE8M0, shared route, duplicates, int64 ids) on 1 and 2 ranks, hidden 384 / 512 /
// 1024 on 4 and 8 ranks; T in {0, 1, 7, 128} with -1 selections and different T per rank, three
// rounds per object (both parities, one through the send/recv hooks);
// the fallback protocol (expert expansion, block signals: LlLaunch::expand_message = false, what large
// capacities take) on the partial_fp32 cases; ll.combine_wait = data;
// CUDA graphs (each rank captures on its own stream, cudaStreamCaptureModeThreadLocal): prepare and
// finalize captured separately, replayed with a device-side T that changes between replays and
// differs between ranks, the first replay equal to the eager call on the same inputs; two graphs on
// one object replayed interleaved; one buffer through 20 calls (eager, then graph replays of the
// same inputs, each replay equal to its eager call) with T per call and rank shrinking and growing,
// the fallback and the default, the default with a delayed send block 0 (the stale slot-token regression test) and its
// self-check; errors: T > capacity (InvalidArgument before anything is written; the next round still
// works), a bad device num_tokens (reported, InvalidArgument from that finalize or check(), then
// usable), a finalize refused on one rank (every peer told at once), and a stopped rank that never
// calls (its body sleeps, or on virtual ranks returns early): every other rank gets Timeout within
// the bound, naming it.
// The expert step is the harness's TestExperts on host copies of the prepare outputs. Outputs are
// poisoned before each call; inputs are fresh random values, never zeros. Rank bodies work on their
// own cudaStreamNonBlocking stream and wait on it or on the legacy stream, never on the whole device
// (cuda_ranks.h), and never touch the environment (set before run_cuda_ranks).
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

#ifdef EPX_WITH_CUDA
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
void sync_legacy(const char* what) { cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), what); }


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
void take_msgs(Snap& s, const dispatch::LlHandle& h, int K) {
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
Snap take(const PrepareResult& p, const TensorView& src_rank, const TensorView& src_token, const TensorView& col,
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

std::string diff(const Snap& got, const Snap& want) {
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

std::vector<int> local_ids(const Case& c, int rank) {
  std::vector<int> ids;
  const ExpertRange range = expert_range(c.E, c.R, rank);
  for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
  if (c.shared) ids.push_back(c.E);
  return ids;
}

/// The experts step on the host: expert_out [L, cap, H] bf16 from a prepare result (any device).
Tensor experts_out(const Case& c, int rank, const PrepareResult& p) {
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
RankInput head(const RankInput& ri, int64_t T) {
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
std::vector<std::vector<Snap>> run_cpu(const Case& c, const std::vector<std::vector<RankInput>>& rounds) {
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
DevInput upload(const RankInput& ri, int64_t rows, Device dev) {
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

void poison_outputs(const PrepareResult& p, dispatch::LlCuda& ll) {
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
Snap gpu_round(const Case& c, dispatch::LlCuda& ll, const RankInput& ri, int rank, cudaStream_t s, bool split, Group* align = nullptr,
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

Case make_case(int R, int64_t H, int E, int K, DType dt, bool ue8m0, bool shared, bool dups, bool idx64, double masked, int cap,
               std::vector<int64_t> T, uint64_t seed) {
  Case c;
  c.R = R, c.H = H, c.E = E, c.K = K, c.dtype = dt, c.ue8m0 = ue8m0, c.shared = shared, c.dups = dups, c.idx64 = idx64;
  c.masked = masked, c.cap = cap, c.T = std::move(T), c.seed = seed;
  return c;
}

std::vector<EagerCase> cases_of(std::vector<Case> cs, LlCombine mode);

/// The eager cases at R ranks: the shapes below on 1 and 2 ranks; on 4 and 8 ranks small ones (hidden
/// 1024 bf16 with duplicates, 512 fp8, 384 fp8 + UE8M0 with the shared route, int64 ids and an uneven
/// expert split), each with T in {0, 1, 7, 128} (or the capacity 16) across the ranks.
std::vector<EagerCase> eager_cases(int R, LlCombine mode, bool all) {
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
std::vector<EagerCase> cases_of(std::vector<Case> cs, LlCombine mode) {
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
void run_eager(int R, LlCombine mode = LlCombine::column, const dispatch::LlLaunch* launch = nullptr) {
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

// ---- graphs ------------------------------------------------------------------------------------

struct GraphPair {
  cudaGraphExec_t prepare = nullptr, finalize = nullptr;
};

void capture(cudaStream_t s, cudaGraphExec_t& exec, const std::function<void()>& body) {
  cudaGraph_t graph;
  cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
  body();
  cuda_ok(cudaStreamEndCapture(s, &graph), "end capture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cuda_ok(cudaGraphDestroy(graph), "graph destroy");
}

/// Graph A: x [cap, H] with a device num_tokens; graph B: x [5, H] (host T = 5). Replays of A
/// with T per (replay, rank) from `ta`, interleaved with B; every replay checked against LlCpu, and
/// the first against an eager call on the same inputs made before the captures (bit for bit). Each
/// rank captures on its own stream (cudaStreamCaptureModeThreadLocal: the peers' threads go on).
/// The ll-v3 shape on 1 and 2 ranks, hidden 1024 with 4 experts per rank on 4 and 8.
void run_graphs(int R, LlCombine mode = LlCombine::column) {
  say_where(R);
  Case c = R <= 2 ? make_case(R, 7168, 256, 8, DType::fp8_e4m3, false, false, false, false, 0.1, 128, {}, 31)
                  : make_case(R, 1024, 4 * R, 8, DType::fp8_e4m3, false, false, false, false, 0.1, 128, {}, 31);
  c.ll_combine = mode;
  Case cb = c;
  cb.T.assign(static_cast<size_t>(R), 5);
  cb.seed = 32;
  const std::vector<std::vector<int64_t>> ta = {{128, 3}, {0, 128}, {7, 1}, {1, 0}, {64, 100}};  // [replay][rank], ranks 0 and 1
  const std::vector<int64_t> spread = {0, 1, 7, 128, 33};
  // T of graph A's replay `a` on rank r: ta for ranks 0 and 1, `spread` shifted per replay for the others.
  auto t_of = [&](int a, int r) -> int64_t {
    return r < 2 ? ta[static_cast<size_t>(a)][static_cast<size_t>(r)] : spread[static_cast<size_t>(a + r) % spread.size()];
  };
  Case cfull = c;
  cfull.T.assign(static_cast<size_t>(R), 128);
  const std::vector<RankInput> full = make_inputs(cfull), inb = make_inputs(cb);
  // Schedule: A0 B A1 A2 B A3 A4 (B replays with the same inputs)
  const std::vector<int> schedule = {0, -1, 1, 2, -1, 3, 4};
  std::vector<std::vector<RankInput>> rounds;
  for (int sidx : schedule) {
    std::vector<RankInput> ranks_in;
    for (int r = 0; r < R; ++r)
      ranks_in.push_back(sidx < 0 ? inb[static_cast<size_t>(r)] : head(full[static_cast<size_t>(r)], t_of(sidx, r)));
    rounds.push_back(std::move(ranks_in));
  }
  const auto want = run_cpu(c, rounds);
  const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    auto pf = make_prepare_finalize("ll", g, c.config());
    auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get());
    if (!ll) throw std::runtime_error("make_prepare_finalize(ll) on a CUDA group is not LlCuda");
    std::string failures;
    // The eager call on replay 0's inputs (schedule[0] is graph A): replay 0 must give the same bits.
    const Snap eager = gpu_round(c, *ll, rounds[0][static_cast<size_t>(rank)], rank, s, false);
    const std::string de = diff(eager, want[0][static_cast<size_t>(rank)]);
    if (!de.empty()) failures += "eager call before the captures: " + de + "\n";
    const DevInput a = upload(full[static_cast<size_t>(rank)], 128, dev), b = upload(inb[static_cast<size_t>(rank)], 5, dev);
    Tensor nt = Tensor::zeros({1}, DType::int32, dev);
    const int64_t L = num_local_experts(c.config(), R, rank), cap = static_cast<int64_t>(R) * c.cap;
    Tensor eo_a = Tensor::empty({L, cap, c.H}, DType::bf16, dev), eo_b = Tensor::empty({L, cap, c.H}, DType::bf16, dev);
    Tensor out_a = Tensor::empty({128, c.H}, DType::bf16, dev), out_b = Tensor::empty({5, c.H}, DType::bf16, dev);
    GraphPair ga, gb;
    PrepareResult pa, pb;
    DispatchArgs args_a{a.x, a.idx, a.w, Stream{s}};
    args_a.num_tokens = nt;
    capture(s, ga.prepare, [&] { pa = pf->prepare(args_a); });
    capture(s, ga.finalize, [&] { pf->finalize({eo_a, out_a, Stream{s}}); });
    capture(s, gb.prepare, [&] { pb = pf->prepare({b.x, b.idx, b.w, Stream{s}}); });
    capture(s, gb.finalize, [&] { pf->finalize({eo_b, out_b, Stream{s}}); });
    for (size_t i = 0; i < schedule.size(); ++i) {
      const bool is_a = schedule[i] >= 0;
      const int32_t T = is_a ? static_cast<int32_t>(t_of(schedule[i], rank)) : 5;
      if (is_a) cuda_ok(cudaMemcpyAsync(nt.data(), &T, 4, cudaMemcpyHostToDevice, s), "num_tokens");
      cuda_ok(cudaStreamSynchronize(s), "sync");
      cuda_ok(cudaGraphLaunch(is_a ? ga.prepare : gb.prepare, s), "replay prepare");
      cuda_ok(cudaStreamSynchronize(s), "sync prepare");
      ll->check(Stream{s});
      const PrepareResult& p = is_a ? pa : pb;
      Snap snap = take(p, ll->handle().src_rank, ll->handle().src_token, ll->handle().topk_column, ll->handle().layout_range);
      if (mode != LlCombine::column) take_msgs(snap, ll->handle(), c.K);
      Tensor& eo = is_a ? eo_a : eo_b;
      copy(eo, experts_out(c, rank, p));
      Tensor& out = is_a ? out_a : out_b;
      cuda_ok(cudaMemset(out.data(), 0xff, static_cast<size_t>(out.nbytes())), "poison out");
      sync_legacy("sync poison out");  // see gpu_round
      cuda_ok(cudaGraphLaunch(is_a ? ga.finalize : gb.finalize, s), "replay finalize");
      cuda_ok(cudaStreamSynchronize(s), "sync finalize");
      ll->check(Stream{s});
      std::vector<uint8_t> ob = host_bytes(out);
      // Rows >= T are not written (still poison); compare rows [0, T).
      for (size_t k = static_cast<size_t>(T) * c.H * 2; k < ob.size(); ++k)
        if (ob[k] != 0xff) {
          failures += "replay " + std::to_string(i) + ": out row beyond T written; ";
          break;
        }
      ob.resize(static_cast<size_t>(T) * c.H * 2);
      snap.out = ob;
      poison_outputs(p, *ll);
      std::string d = diff(snap, want[i][static_cast<size_t>(rank)]);
      if (i == 0) {
        const std::string dv = diff(snap, eager);
        if (!dv.empty()) d += "vs the eager call: " + dv;
      }
      if (!d.empty()) failures += "replay " + std::to_string(i) + (is_a ? " (graph A, T=" + std::to_string(T) + ")" : " (graph B)") + ": " + d + "\n";
      if (rank == 0) std::printf("graph replay %zu: graph %s, T = %d on rank 0: %s\n", i, is_a ? "A" : "B", T, d.empty() ? "bit-exact" : "DIFFERS");
    }
    for (cudaGraphExec_t e : {ga.prepare, ga.finalize, gb.prepare, gb.finalize}) cuda_ok(cudaGraphExecDestroy(e), "exec destroy");
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

// ---- many calls on one buffer ------------------------------------------------------------------

/// Per call, per rank T of the many-calls test: 0, 1, 7 and 128, different on the two ranks, dropping
/// back to 0 and up again, so a rank's message count to a peer shrinks and grows between calls of one
/// parity (calls 0 / 2 / 4 of rank 0: 128, 0, 128).
const std::vector<std::vector<int64_t>> kManyCallsT = {{128, 1}, {7, 128}, {0, 7}, {1, 0}, {128, 0},
                                                       {128, 128}, {0, 128}, {0, 1}, {7, 0}, {128, 7}};

/// Fresh random inputs for every call of kManyCallsT, with rank 0's first two
/// rows routed away from rank 1 in call 0 and its row 0 routed to rank 1 in call 4: message slot 0
/// from rank 0 at rank 1 then names a token of a later send block in call 0, nothing in call 2 (T = 0),
/// token 0 (send block 0) in call 4, the pattern in which a stale slot-token word could pass as current.
std::vector<std::vector<RankInput>> many_calls_inputs(const Case& c) {
  std::vector<std::vector<RankInput>> rounds;
  const ExpertRange r1 = expert_range(c.E, c.R, 1);
  for (size_t i = 0; i < kManyCallsT.size(); ++i) {
    Case ci = c;
    ci.T = kManyCallsT[i];
    ci.seed = c.seed + 100 * i;
    std::vector<RankInput> in = make_inputs(ci);
    RankInput& r0 = in[0];
    const int64_t T0 = r0.x.size(0);
    int32_t* id = r0.topk_idx.ptr<int32_t>();  // int32 ids (Case::idx64 false)
    if (i == 0)
      for (int64_t t = 0; t < 2 && t < T0; ++t)
        for (int k = 0; k < c.K; ++k)
          if (id[t * c.K + k] >= r1.begin && id[t * c.K + k] < r1.end) id[t * c.K + k] = -1;
    if (i == 4 && T0 > 0) {
      bool to_r1 = false;
      for (int k = 0; k < c.K; ++k) to_r1 = to_r1 || (id[k] >= r1.begin && id[k] < r1.end);
      for (int e = r1.begin; !to_r1 && e < r1.end; ++e) {  // column 0 := an expert of rank 1 the row does not name yet
        bool named = false;
        for (int k = 0; k < c.K; ++k) named = named || id[k] == e;
        if (!named) id[0] = e, to_r1 = true;
      }
    }
    rounds.push_back(std::move(in));
  }
  return rounds;
}

/// One ll buffer, kManyCallsT's calls eager (call 3 through the send/recv hooks), then the same
/// calls as replays of one captured prepare / finalize graph pair with the token count on the device:
/// 2 x 10 consecutive calls on one object, each checked bit for bit against LlCpu (outputs poisoned
/// before each call), and each replay against the eager call on the same inputs. `launch` per rank
/// (rank 0's may carry the debug delay). The ranks are aligned by a group barrier before each prepare.
/// Returns the failures of both ranks ("" = all exact, every rank finished) and prints one line per
/// call and rank.
std::string run_many_calls(const std::string& name, const std::vector<dispatch::LlLaunch>& launch) {
  constexpr int R = 2;
  // ll-v3's hidden size, dtype, top-k and capacity (so the send items map to blocks as at ll-v3: 14
  // chunks per token, 16 warps per block), 32 experts (16 local: the host's copies stay small).
  static const Case c = [] {
    Case k = make_case(R, 7168, 32, 8, DType::fp8_e4m3, false, false, false, false, 0.1, 128, {}, 61);
    k.ll_combine = LlCombine::partial_fp32;
    return k;
  }();
  static const std::vector<std::vector<RankInput>> rounds = many_calls_inputs(c);
  static const std::vector<std::vector<Snap>> want = run_cpu(c, rounds);  // all three: read-only in the ranks
  say_where(R);
  const std::string dir = fresh_dir();
  const std::string status = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    dispatch::LlCuda ll(g, c.config(), launch[static_cast<size_t>(rank)]);
    std::string failures;
    auto record = [&](const std::string& what, size_t i, const std::string& d) {
      const int64_t T = kManyCallsT[i][static_cast<size_t>(rank)];
      if (!d.empty()) failures += name + " " + what + " call " + std::to_string(i) + " rank " + std::to_string(rank) + " T=" + std::to_string(T) + ": " + d + "\n";
      std::printf("%s %s call %zu rank %d T = %lld: %s\n", name.c_str(), what.c_str(), i, rank, static_cast<long long>(T),
                  d.empty() ? "bit-exact vs LlCpu" : "DIFFERS");
      std::fflush(stdout);  // a step cut by a time limit keeps its lines
    };
    // 1. Eager calls 0..9.
    std::vector<Snap> eager;
    for (size_t i = 0; i < rounds.size(); ++i) {
      eager.push_back(gpu_round(c, ll, rounds[i][static_cast<size_t>(rank)], rank, s, i == 3, g.get()));
      record("eager", i, diff(eager.back(), want[i][static_cast<size_t>(rank)]));
    }
    // 2. Calls 10..19: graph replays, x [cap, H] with the token count on the device, fresh inputs per replay.
    const int64_t L = num_local_experts(c.config(), R, rank), cap = static_cast<int64_t>(R) * c.cap;
    DevInput in;
    in.x = Tensor::empty({c.cap, c.H}, DType::bf16, dev);
    in.idx = Tensor::empty({c.cap, c.K}, DType::int32, dev);
    in.w = Tensor::empty({c.cap, c.K}, DType::fp32, dev);
    Tensor nt = Tensor::zeros({1}, DType::int32, dev);
    Tensor eo = Tensor::empty({L, cap, c.H}, DType::bf16, dev), out = Tensor::empty({c.cap, c.H}, DType::bf16, dev);
    GraphPair gp;
    PrepareResult p;
    DispatchArgs args{in.x, in.idx, in.w, Stream{s}};
    args.num_tokens = nt;
    capture(s, gp.prepare, [&] { p = ll.prepare(args); });
    capture(s, gp.finalize, [&] { ll.finalize({eo, out, Stream{s}}); });
    for (size_t i = 0; i < rounds.size(); ++i) {
      const RankInput& ri = rounds[i][static_cast<size_t>(rank)];
      const int32_t T = static_cast<int32_t>(ri.x.size(0));
      for (const Tensor* t : {&in.x, &in.idx, &in.w}) cuda_ok(cudaMemset(t->data(), 0x7f, static_cast<size_t>(t->nbytes())), "poison inputs");
      cuda_ok(cudaMemcpy(in.x.data(), ri.x.data(), static_cast<size_t>(ri.x.nbytes()), cudaMemcpyHostToDevice), "x");
      cuda_ok(cudaMemcpy(in.idx.data(), ri.topk_idx.data(), static_cast<size_t>(ri.topk_idx.nbytes()), cudaMemcpyHostToDevice), "idx");
      cuda_ok(cudaMemcpy(in.w.data(), ri.topk_weights.data(), static_cast<size_t>(ri.topk_weights.nbytes()), cudaMemcpyHostToDevice), "w");
      cuda_ok(cudaMemcpy(nt.data(), &T, 4, cudaMemcpyHostToDevice), "num_tokens");
      sync_legacy("sync inputs");  // legacy-stream memsets, pageable copies (see upload)
      g->barrier();
      cuda_ok(cudaGraphLaunch(gp.prepare, s), "replay prepare");
      cuda_ok(cudaStreamSynchronize(s), "sync prepare");
      ll.check(Stream{s});
      Snap snap = take(p, ll.handle().src_rank, ll.handle().src_token, ll.handle().topk_column, ll.handle().layout_range);
      take_msgs(snap, ll.handle(), c.K);
      copy(eo, experts_out(c, rank, p));
      cuda_ok(cudaMemset(out.data(), 0xff, static_cast<size_t>(out.nbytes())), "poison out");
      sync_legacy("sync poison out");
      cuda_ok(cudaGraphLaunch(gp.finalize, s), "replay finalize");
      cuda_ok(cudaStreamSynchronize(s), "sync finalize");
      ll.check(Stream{s});
      std::vector<uint8_t> ob = host_bytes(out);
      std::string extra;
      for (size_t k = static_cast<size_t>(T) * c.H * 2; k < ob.size(); ++k)
        if (ob[k] != 0xff) {
          extra = "out row beyond T written; ";
          break;
        }
      ob.resize(static_cast<size_t>(T) * c.H * 2);
      snap.out = ob;
      poison_outputs(p, ll);
      cuda_ok(cudaMemset(p.x.data, 0xff, static_cast<size_t>(p.x.nbytes())), "poison x");
      cuda_ok(cudaMemset(p.x_scales.data, 0xff, static_cast<size_t>(p.x_scales.nbytes())), "poison scales");
      sync_legacy("sync poison");
      const std::string vs_eager = diff(snap, eager[i]);  // the replay of call i gives the eager call's bits
      record("graph", i, extra + diff(snap, want[i][static_cast<size_t>(rank)]) + (vs_eager.empty() ? "" : "vs the eager call: " + vs_eager));
    }
    for (cudaGraphExec_t e : {gp.prepare, gp.finalize}) cuda_ok(cudaGraphExecDestroy(e), "exec destroy");
    g->barrier();
    std::fflush(stdout);
    FILE* f = std::fopen((dir + "/failures-" + std::to_string(rank)).c_str(), "w");  // read by the parent
    if (!f) throw std::runtime_error("cannot write " + dir);
    std::fputs(failures.c_str(), f);
    std::fclose(f);
  });
  std::string failures;
  for (int r = 0; r < R; ++r) {
    FILE* f = std::fopen((dir + "/failures-" + std::to_string(r)).c_str(), "r");
    if (!f) {
      failures += "rank " + std::to_string(r) + " wrote no result; ";
      continue;
    }
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) failures.append(buf, n);
    std::fclose(f);
  }
  return status + failures;
}

dispatch::LlLaunch many_calls_launch(bool message) {
  dispatch::LlLaunch l;
  l.expand_message = message;
  l.timeout_s = Config::load().timeout_s;  // EPX_TIMEOUT_S bounds a hang
  return l;
}

// ---- errors ------------------------------------------------------------------------------------

void run_errors(int R) {
  const Case c = make_case(R, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, {}, 41);
  Case c8 = c;
  c8.T.assign(static_cast<size_t>(R), 8);
  const std::vector<RankInput> in = make_inputs(c8);
  Case c17 = c;
  c17.T.assign(static_cast<size_t>(R), 17);
  const std::vector<RankInput> big = make_inputs(c17);
  const auto want = run_cpu(c, {in, in});
  say_where(R);
  const std::string failed = run_cuda_ranks(R, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    auto pf = make_prepare_finalize("ll", g, c.config());
    auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get());
    std::string failures;
    // 1. T = 17 > capacity 16: InvalidArgument naming both numbers, nothing launched.
    {
      const DevInput d = upload(big[static_cast<size_t>(rank)], 17, dev);
      std::string what;
      try {
        pf->prepare({d.x, d.idx, d.w, Stream{s}});
      } catch (const InvalidArgument& e) {
        what = e.what();
      }
      if (what.find("17") == std::string::npos || what.find("16") == std::string::npos) failures += "capacity error: '" + what + "'; ";
      if (rank == 0) std::printf("capacity: %s\n", what.c_str());
    }
    // 2. The object still works (no call number was used by the failed call).
    {
      const Snap got = gpu_round(c, *ll, in[static_cast<size_t>(rank)], rank, s, false);
      const std::string d = diff(got, want[0][static_cast<size_t>(rank)]);
      if (!d.empty()) failures += "after capacity error: " + d + "; ";
    }
    // 3. A device num_tokens beyond x.shape[0] on the last rank: that rank sends nothing, its finalize
    //    (after its launch) or check() throws InvalidArgument there, and the next round is exact again.
    {
      const DevInput d = upload(in[static_cast<size_t>(rank)], 8, dev);
      Tensor nt = Tensor::empty({1}, DType::int32, dev);
      const int32_t v = rank == R - 1 ? 9 : 8;
      test::upload_device(nt.data(), &v, 4, "nt");
      DispatchArgs a{d.x, d.idx, d.w, Stream{s}};
      a.num_tokens = nt;
      const PrepareResult p = pf->prepare(a);
      cuda_ok(cudaStreamSynchronize(s), "sync");
      const int64_t L = p.x.size(0);
      Tensor eo = Tensor::zeros({L, p.x.size(1), c.H}, DType::bf16, dev), out = Tensor::empty({8, c.H}, DType::bf16, dev);
      std::string what;
      try {  // thrown by the finalize after its launch when its host already sees the report, else by check()
        pf->finalize({eo, out, Stream{s}});
        ll->check(Stream{s});
      } catch (const InvalidArgument& e) {
        what = e.what();
      }
      if (rank == R - 1 && what.find("num_tokens") == std::string::npos) failures += "bad num_tokens: '" + what + "'; ";
      if (rank != R - 1 && !what.empty()) failures += "bad num_tokens on another rank threw here: '" + what + "'; ";
      if (rank == R - 1) std::printf("bad device num_tokens: %s\n", what.c_str());
      const Snap got = gpu_round(c, *ll, in[static_cast<size_t>(rank)], rank, s, false);
      const std::string dd = diff(got, want[1][static_cast<size_t>(rank)]);
      if (!dd.empty()) failures += "after bad num_tokens: " + dd + "; ";
    }
    // 4. Another backend rejects num_tokens.
    if (rank == 0) {
      std::string what;
      try {
        auto groups = make_cpu_groups(1);
        auto cpu = make_prepare_finalize("ll", groups[0], c.config());
        DispatchArgs a{in[0].x, in[0].topk_idx, in[0].topk_weights};
        Tensor nt = Tensor::zeros({1}, DType::int32);
        a.num_tokens = nt;
        cpu->prepare(a);
      } catch (const InvalidArgument& e) {
        what = e.what();
      }
      if (what.find("num_tokens") == std::string::npos) failures += "CPU ll accepted num_tokens: '" + what + "'; ";
    }
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

// ---- a stopped rank ------------------------------------------------------------------------------

/// How the stopped rank of the timeout tests does not take part.
enum class Stop {
  sleeps,   ///< alive, but never makes the call: sleeps past the others' timeout
  returns,  ///< its body returns at once (virtual ranks only: on real GPUs it sleeps, see stop_mode)
};

/// `want` where the ranks are virtual; on real GPUs always Stop::sleeps: a process that exits while its
/// peers still store into its symmetric memory over NVLink is not what these tests are about.
Stop stop_mode(int R, Stop want) { return virtual_ranks_for(R) ? want : Stop::sleeps; }

/// The group timeout of the stopped-rank tests: short on virtual ranks (every host wait of the test
/// ends within it); on real GPUs the NCCL start-up of R processes needs more.
double stop_group_timeout(int R) { return virtual_ranks_for(R) ? 5.0 : 60.0; }

/// The stopped rank's part: wait past `secs` (Stop::sleeps) or nothing (Stop::returns).
void stopped_rank(Stop stop, double secs) {
  if (stop == Stop::sleeps) std::this_thread::sleep_for(std::chrono::duration<double>(secs));  // alive, but never calls
}

/// The end of a stopped-rank test's body. Real form (one process per GPU): the process exits here
/// without teardown (messages to the stopped rank were never consumed); on virtual ranks the body
/// returns (or throws the failures) like any other, and its objects are destroyed: their waits are over.
void end_stopped_test(int rank, const std::string& failures, bool real) {
  std::fflush(stdout);
  if (real) {
    if (!failures.empty()) std::fprintf(stderr, "[rank %d] FAILED: %s\n", rank, failures.c_str());
    std::fflush(stderr);
    _exit(failures.empty() ? 0 : 1);
  }
  throw_failures(rank, failures);
}

/// Rank `stopped` never calls: every other rank's prepare fails within timeout_s (+ slack) with
/// Timeout naming the stopped rank, and its next call throws that too. Never a hang.
void run_timeout(int R, int stopped, Stop want_stop) {
  const Stop stop = stop_mode(R, want_stop);
  const bool real = !virtual_ranks_for(R);
  say_where(R);
  std::printf("rank %d stopped (%s)\n", stopped, stop == Stop::sleeps ? "sleeps" : "returns at once");
  const Case c = make_case(R, 2048, 16, 4, DType::bf16, false, false, false, false, 0.0, 8, std::vector<int64_t>(static_cast<size_t>(R), 4), 51);
  const std::vector<RankInput> in = make_inputs(c);
  constexpr double kTimeout = 3.0;
  const std::string who = "rank " + std::to_string(stopped);
  const std::string failed = run_cuda_ranks(
      R, 60.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        const RankStream rs;
        const cudaStream_t s = rs.s;
        dispatch::LlCuda ll(g, c.config(), {.warps_per_block = 8, .num_blocks = 0, .timeout_s = kTimeout});
        std::string failures;
        if (rank == stopped) {
          stopped_rank(stop, kTimeout + 2.0);
          return end_stopped_test(rank, failures, real);
        }
        const DevInput d = upload(in[static_cast<size_t>(rank)], 4, g->device());
        const auto t0 = std::chrono::steady_clock::now();
        std::string what;
        try {
          ll.prepare({d.x, d.idx, d.w, Stream{s}});
          ll.check(Stream{s});
        } catch (const Timeout& e) {
          what = e.what();
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: timeout after %.2f s (bound %.1f s): %s\n", rank, secs, kTimeout, what.c_str());
        if (what.find(who) == std::string::npos || what.find("prepare") == std::string::npos)
          failures += "timeout message does not name " + who + " and the prepare: '" + what + "'; ";
        if (secs < kTimeout * 0.9 || secs > kTimeout + 5.0) failures += "timeout took " + std::to_string(secs) + " s; ";
        std::string again;
        try {
          ll.prepare({d.x, d.idx, d.w, Stream{s}});
        } catch (const Timeout& e) {
          again = e.what();
        }
        if (again.find(who) == std::string::npos) failures += "the next call did not throw Timeout naming " + who + ": '" + again + "'; ";
        end_stopped_test(rank, failures, real);
      },
      stop_group_timeout(R));
  EXPECT_EQ(failed, "");
}

/// ll.combine_wait = data, partial_fp32: every rank prepares, rank `stopped` never finalizes: every
/// other rank's finalize (its receive polls the stopped rank's partial rows: each rank's token 0 is
/// routed there) ends within timeout_s (+ slack) and check() throws Timeout naming the stopped rank and
/// the finalize. Never a hang.
void run_combine_timeout(int R, int stopped, Stop want_stop) {
  const Stop stop = stop_mode(R, want_stop);
  const bool real = !virtual_ranks_for(R);
  say_where(R);
  std::printf("rank %d stopped after its prepare (%s)\n", stopped, stop == Stop::sleeps ? "sleeps" : "returns at once");
  Case c = make_case(R, 2048, 16, 4, DType::bf16, false, false, false, false, 0.0, 8, std::vector<int64_t>(static_cast<size_t>(R), 4), 52);
  c.ll_combine = LlCombine::partial_fp32;
  std::vector<RankInput> in = make_inputs(c);
  // Token 0 of every rank selects an expert of the stopped rank (column 0 := one it does not name yet),
  // so every other rank's combine waits for a row from it (combine_wait = data waits for rows only).
  const ExpertRange sr = expert_range(c.E, c.R, stopped);
  for (RankInput& ri : in) {
    int32_t* id = ri.topk_idx.ptr<int32_t>();  // int32 ids (Case::idx64 false)
    bool there = false;
    for (int k = 0; k < c.K; ++k) there = there || (id[k] >= sr.begin && id[k] < sr.end);
    for (int e = sr.begin; !there && e < sr.end; ++e) {
      bool named = false;
      for (int k = 0; k < c.K; ++k) named = named || id[k] == e;
      if (!named) id[0] = e, there = true;
    }
  }
  constexpr double kTimeout = 3.0;
  const std::string who = "rank " + std::to_string(stopped);
  const std::string failed = run_cuda_ranks(
      R, 60.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        const Device dev = g->device();
        const RankStream rs;
        const cudaStream_t s = rs.s;
        dispatch::LlLaunch launch;
        launch.timeout_s = kTimeout;
        launch.combine_data = true;
        dispatch::LlCuda ll(g, c.config(), launch);
        std::string failures;
        const DevInput d = upload(in[static_cast<size_t>(rank)], 4, dev);
        const PrepareResult p = ll.prepare({d.x, d.idx, d.w, Stream{s}});
        ll.check(Stream{s});
        if (rank == stopped) {
          stopped_rank(stop, kTimeout + 2.0);
          return end_stopped_test(rank, failures, real);
        }
        const int64_t L = p.x.size(0);
        Tensor eo = Tensor::zeros({L, p.x.size(1), c.H}, DType::bf16, dev), out = Tensor::empty({4, c.H}, DType::bf16, dev);
        const auto t0 = std::chrono::steady_clock::now();
        std::string what;
        try {
          ll.finalize({eo, out, Stream{s}});
          ll.check(Stream{s});
        } catch (const Timeout& e) {
          what = e.what();
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: combine timeout after %.2f s (bound %.1f s): %s\n", rank, secs, kTimeout, what.c_str());
        if (what.find(who) == std::string::npos || what.find("finalize") == std::string::npos)
          failures += "timeout message does not name " + who + " and the finalize: '" + what + "'; ";
        if (secs < kTimeout * 0.9 || secs > kTimeout + 5.0) failures += "timeout took " + std::to_string(secs) + " s; ";
        end_stopped_test(rank, failures, real);
      },
      stop_group_timeout(R));
  EXPECT_EQ(failed, "");
}

/// A finalize refused on one rank reaches every rank at once (the abort marker, kLlFlagRejected): rank 0
/// passes out with T + 1 rows, so it throws InvalidArgument at the call; every other rank's combine of that
/// call ends long before timeout_s with its out all NaN (poisoned with a finite pattern first), and each
/// gets one InvalidArgument naming rank 0: from that finalize (after its launch) or its check(); rank 0's
/// check() throws nothing; the rounds before and after are exact on every rank (every object stays usable).
/// `split`: all ranks use the hooks (rank 0's refused call is finalize_send). `peers_check` false: the
/// other ranks call no check() after the refused call (only a stream sync, so the report is on their host)
/// and go on to the next round: their prepare must not throw (that would leave rank 0's dispatch waiting),
/// the error comes from that round's finalize after its launch (or the check() after it), and the round is
/// exact. Without the marker the peers would get Timeout after timeout_s and every object would break.
std::string run_combine_rejected(int R, const std::string& name, LlCombine mode, const dispatch::LlLaunch& launch, bool split,
                                 bool peers_check = true) {
  say_where(R);
  Case c = make_case(R, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, {}, 61);
  c.ll_combine = mode;
  Case ca = c, cb = c;
  ca.T = per_rank(R, {8, 5, 0, 1});
  cb.T = per_rank(R, {7, 16, 1, 0});  // rank 0's T >= 1 (its refused out has T + 1 rows)
  cb.seed = 62;
  const std::vector<RankInput> in = make_inputs(ca), mid = make_inputs(cb);
  const auto want = run_cpu(c, {in, in});
  const double timeout_s = launch.timeout_s;
  return run_cuda_ranks(R, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    dispatch::LlCuda ll(g, c.config(), launch);
    std::string failures;
    const std::string d0 = diff(gpu_round(c, ll, in[static_cast<size_t>(rank)], rank, s, split), want[0][static_cast<size_t>(rank)]);
    if (!d0.empty()) failures += "round before: " + d0 + "; ";
    std::string at_call, at_check;
    double secs = 0.0;
    {
      const RankInput& ri = mid[static_cast<size_t>(rank)];
      const int64_t T = ri.x.size(0);
      const DevInput d = upload(ri, T, dev);
      const PrepareResult p = ll.prepare({d.x, d.idx, d.w, Stream{s}});
      cuda_ok(cudaStreamSynchronize(s), "sync prepare");
      ll.check(Stream{s});
      const Tensor eo = experts_out(c, rank, p).to(dev);
      Tensor out = Tensor::empty({T + (rank == 0 ? 1 : 0), c.H}, DType::bf16, dev);
      cuda_ok(cudaMemset(out.data(), 0x11, static_cast<size_t>(out.nbytes())), "poison out (finite)");
      sync_legacy("sync poison out");
      g->barrier();
      const auto t0 = std::chrono::steady_clock::now();
      try {
        if (split) {
          ll.finalize_send({eo, out, Stream{s}});
          ll.finalize_recv(Stream{s});
        } else {
          ll.finalize({eo, out, Stream{s}});
        }
      } catch (const InvalidArgument& e) {
        at_call = e.what();
      }
      try {
        if (peers_check || rank == 0) ll.check(Stream{s});
        else cuda_ok(cudaStreamSynchronize(s), "sync");  // the report is on the host before the next prepare
      } catch (const InvalidArgument& e) {
        at_check = std::string("InvalidArgument: ") + e.what();
      } catch (const Timeout& e) {
        at_check = std::string("Timeout: ") + e.what();
      }
      secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%s rank %d after %.3f s (timeout_s %.0f): call '%s', check '%s'\n", name.c_str(), rank, secs, timeout_s, at_call.c_str(),
                  at_check.c_str());
      if (rank != 0) {
        const std::vector<uint8_t> bytes = host_bytes(out);
        int64_t finite = 0;
        for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
          const uint16_t v = static_cast<uint16_t>(bytes[i] | bytes[i + 1] << 8);
          if ((v & 0x7f80) != 0x7f80 || (v & 0x7f) == 0) ++finite;
        }
        if (finite != 0) failures += "out: " + std::to_string(finite) + " of " + std::to_string(bytes.size() / 2) + " not NaN; ";
      }
      if (secs > timeout_s / 2) failures += "took " + std::to_string(secs) + " s (timeout_s " + std::to_string(timeout_s) + "); ";
    }
    std::string late;
    const bool late_here = !peers_check && rank != 0;
    const std::string d1 = diff(gpu_round(c, ll, in[static_cast<size_t>(rank)], rank, s, split, nullptr, late_here ? &late : nullptr),
                                want[1][static_cast<size_t>(rank)]);
    if (!d1.empty()) failures += "round after: " + d1 + "; ";
    if (late_here) std::printf("%s rank %d, round after without a check before it: '%s'\n", name.c_str(), rank, late.c_str());
    if (rank == 0) {
      if (at_call.find("out.shape") == std::string::npos) failures += "rank 0's refusal: '" + at_call + "'; ";
      if (!at_check.empty()) failures += "rank 0's check threw: '" + at_check + "'; ";
    } else {
      const std::vector<std::string> got_all = {at_call, at_check, late};
      int n = 0;
      std::string got;
      for (const std::string& e : got_all)
        if (!e.empty()) ++n, got = e;
      if (n != 1) failures += "threw " + std::to_string(n) + " times: '" + at_call + "', '" + at_check + "', '" + late + "'; ";
      if (at_check.rfind("Timeout", 0) == 0 || got.find("rank 0") == std::string::npos ||
          got.find("refused its finalize arguments") == std::string::npos)
        failures += "error: '" + got + "'; ";
    }
    g->barrier();
    if (!failures.empty()) throw_failures(rank, name + ": " + failures);
  });
}

int gpus() { return cuda::device_count(); }

/// The only skip for want of GPUs: none at all. With fewer GPUs than ranks the ranks run as virtual
/// ranks on GPU 0 (cuda_ranks.h).
constexpr const char* kNoGpu = "no CUDA GPU on this machine";

// A refused finalize is that prepare's finalize (ll_cuda.h): retrying it with good arguments must be refused
// on the host ("no prepare to finalize") rather than launch a second combine for one dispatch (the call
// numbers would drift until a timeout), and the object must stay usable: the next round matches LlCpu.
// One rank, so it runs on the one-GPU machine too (the peers' side is CombineRefusedOnOneRank...TwoRanks).
TEST(LlCuda, RefusedFinalizeIsNotRetriedOneRank) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  Case c = make_case(1, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, {}, 63);
  Case ca = c, cb = c;
  ca.T = {8};
  cb.T = {7};
  cb.seed = 64;
  const std::vector<RankInput> in = make_inputs(ca), mid = make_inputs(cb);
  const auto want = run_cpu(c, {in, in});
  say_where(1);
  const std::string failed = run_cuda_ranks(1, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    dispatch::LlLaunch launch;
    launch.timeout_s = 4.0;
    dispatch::LlCuda ll(g, c.config(), launch);
    std::string failures;
    const std::string d0 = diff(gpu_round(c, ll, in[0], rank, s, false), want[0][0]);
    if (!d0.empty()) failures += "round before: " + d0 + "; ";
    const RankInput& ri = mid[0];
    const int64_t T = ri.x.size(0);
    const DevInput d = upload(ri, T, dev);
    const PrepareResult p = ll.prepare({d.x, d.idx, d.w, Stream{s}});
    cuda_ok(cudaStreamSynchronize(s), "sync prepare");
    ll.check(Stream{s});
    const Tensor eo = experts_out(c, rank, p).to(dev);
    Tensor bad = Tensor::empty({T + 1, c.H}, DType::bf16, dev), good = Tensor::empty({T, c.H}, DType::bf16, dev);
    std::string refused, retried;
    try {
      ll.finalize({eo, bad, Stream{s}});
    } catch (const InvalidArgument& e) {
      refused = e.what();
    }
    try {
      ll.finalize({eo, good, Stream{s}});
    } catch (const InvalidArgument& e) {
      retried = e.what();
    }
    cuda_ok(cudaStreamSynchronize(s), "sync");
    std::printf("refused: '%s'\nretried: '%s'\n", refused.c_str(), retried.c_str());
    if (refused.find("out.shape") == std::string::npos) failures += "the bad finalize: '" + refused + "'; ";
    if (retried.find("no prepare to finalize") == std::string::npos) failures += "the retried finalize: '" + retried + "'; ";
    const std::string d1 = diff(gpu_round(c, ll, in[0], rank, s, false), want[1][0]);
    if (!d1.empty()) failures += "round after: " + d1 + "; ";
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

// Finalize twice for one prepare (dispatch.h: finalize is the combine "for the last prepare"; LlCpu, ht and the
// hierarchical backends give a correct second result): the combine's call numbers count combines, not
// dispatches, so a second combine of the same handle must give the CPU's answer for its own expert_out, and the
// next round must still match (the call sequence stayed the same on every rank: here the one rank). The second
// finalize takes -expert_out, so out2 = -out1 element by element (a stale out1 cannot pass). One rank (ll
// loopback), so it runs on the one-GPU machine; the column combine and the fp32 partial combine (fused and
// split finalize).
TEST(LlCuda, FinalizeTwicePerPrepareOneRank) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  for (const LlCombine mode : {LlCombine::column, LlCombine::partial_fp32}) {
    for (const bool split : {false, true}) {
      SCOPED_TRACE(std::string(mode == LlCombine::column ? "column" : "partial_fp32") + (split ? " split" : " fused"));
      Case c = make_case(1, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, {}, 71);
      c.ll_combine = mode;
      Case ca = c, cb = c;
      ca.T = {8};
      cb.T = {13};
      cb.seed = 72;
      const std::vector<RankInput> in = make_inputs(ca), mid = make_inputs(cb);
      const auto want = run_cpu(c, {in, mid, in});
      say_where(1);
      const std::string failed = run_cuda_ranks(1, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
        const Device dev = g->device();
        const RankStream rs;
        const cudaStream_t s = rs.s;
        dispatch::LlLaunch launch;
        launch.timeout_s = 4.0;
        dispatch::LlCuda ll(g, c.config(), launch);
        std::string failures;
        const std::string d0 = diff(gpu_round(c, ll, in[0], rank, s, split), want[0][0]);
        if (!d0.empty()) failures += "round before: " + d0 + "; ";
        const RankInput& ri = mid[0];
        const int64_t T = ri.x.size(0);
        const DevInput d = upload(ri, T, dev);
        const PrepareResult p = ll.prepare({d.x, d.idx, d.w, Stream{s}});
        cuda_ok(cudaStreamSynchronize(s), "sync prepare");
        ll.check(Stream{s});
        const Tensor eo_host = experts_out(c, rank, p);
        Tensor neg = Tensor::empty({eo_host.size(0), eo_host.size(1), eo_host.size(2)}, DType::bf16);
        for (int64_t i = 0; i < eo_host.numel(); ++i) neg.ptr<uint16_t>()[i] = eo_host.ptr<const uint16_t>()[i] ^ 0x8000u;
        const Tensor eo = eo_host.to(dev), eo_neg = neg.to(dev);
        std::vector<Tensor> outs;
        for (const Tensor* e : {&eo, &eo_neg}) {
          Tensor out = Tensor::empty({T, c.H}, DType::bf16, dev);
          cuda_ok(cudaMemset(out.data(), 0xff, static_cast<size_t>(out.nbytes())), "poison out");
          sync_legacy("sync poison out");
          try {
            if (split) {
              ll.finalize_send({*e, out, Stream{s}});
              ll.finalize_recv(Stream{s});
            } else {
              ll.finalize({*e, out, Stream{s}});
            }
            cuda_ok(cudaStreamSynchronize(s), "sync finalize");
            ll.check(Stream{s});
          } catch (const std::exception& ex) {
            failures += std::string(outs.empty() ? "first" : "second") + " finalize threw: " + ex.what() + "; ";
          }
          outs.push_back(out);
        }
        const std::vector<uint8_t> o1 = host_bytes(outs[0]), o2 = host_bytes(outs[1]);
        if (o1 != want[1][0].out) failures += "first finalize's out differs from LlCpu's; ";
        int64_t bad = 0, first_bad = -1;
        for (size_t i = 0; i + 1 < want[1][0].out.size() && i + 1 < o2.size(); i += 2) {
          uint16_t w16, g16;
          std::memcpy(&w16, want[1][0].out.data() + i, 2);
          std::memcpy(&g16, o2.data() + i, 2);
          const float wv = bf16_bits_to_float(w16), gv = bf16_bits_to_float(g16);
          if (!(gv == -wv)) {  // NaN (poison) fails; -0 / +0 compare equal (a sum to zero is +0 either way)
            if (first_bad < 0) first_bad = static_cast<int64_t>(i / 2);
            ++bad;
          }
        }
        if (o2.size() != want[1][0].out.size() || bad != 0)
          failures += "second finalize (-expert_out): " + std::to_string(bad) + " elements not -out1 (first " + std::to_string(first_bad) + "); ";
        const std::string d1 = diff(gpu_round(c, ll, in[0], rank, s, split), want[2][0]);
        if (!d1.empty()) failures += "round after: " + d1 + "; ";
        throw_failures(rank, failures);
      });
      EXPECT_EQ(failed, "");
    }
  }
}

// ll on CUDA made without a caller Config: make_prepare_finalize loads it (Config::load()) inside its verdict
// gather, so a bad EPX_* variable stops every rank there instead of one rank alone after the agreement. The bad
// variable is set in this process before the ranks start (a rank body never touches the environment), so every
// rank sees it: each refuses naming it, and the gather leaves the group usable: an ll made with the caller's
// Config (loaded before the variable was set) gives a round that matches LlCpu. On two ranks also one rank's
// bad caller Config (ll.combine_wait "flags", built in C++): that rank throws the rule's sentence, the other names it.
// The per-process difference of the environment itself (one process bad, its peer naming it) needs one
// process per GPU; the same gather is covered here through the caller's Config.
TEST(LlCuda, CreateWithoutACallerConfigLoadsItInTheVerdictGather) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  const Config good = Config::load();
  for (const int R : {1, 2}) {
    SCOPED_TRACE(std::to_string(R) + " ranks");
    Case c = make_case(R, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, per_rank(R, {8, 3}), 81);
    const std::vector<RankInput> in = make_inputs(c);
    const auto want = run_cpu(c, {in});
    say_where(R);
    const test::ScopedEnv bad_env("EPX_LL_COMBINE_WAIT", "flags");
    const std::string failed = run_cuda_ranks(R, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
      const RankStream rs;
      const cudaStream_t s = rs.s;
      std::string failures;
      try {
        auto bad = make_prepare_finalize("ll", g, c.config());
        failures += "created with EPX_LL_COMBINE_WAIT=flags; ";
      } catch (const InvalidArgument& e) {
        if (std::string(e.what()).find("EPX_LL_COMBINE_WAIT") == std::string::npos) failures += std::string("the refusal: '") + e.what() + "'; ";
      }
      if (R == 2) {  // rank 1's caller Config breaks a rule; rank 0's is good
        Config mine = good;
        if (rank == 1) mine.ll_combine_wait = "flags";
        std::string what;
        try {
          auto bad = make_prepare_finalize("ll", g, c.config(), mine);
          failures += "created with rank 1's ll.combine_wait = flags; ";
        } catch (const InvalidArgument& e) {
          what = e.what();
        }
        if (rank == 1 && what.find("ll.combine_wait") == std::string::npos) failures += "rank 1's refusal: '" + what + "'; ";
        if (rank == 0 && what.find("rank 1") == std::string::npos) failures += "rank 0's refusal does not name rank 1: '" + what + "'; ";
      }
      auto pf = make_prepare_finalize("ll", g, c.config(), good);
      auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get());
      if (ll == nullptr) throw std::runtime_error("make_prepare_finalize(\"ll\") on a CUDA group is not an LlCuda");
      const std::string d = diff(gpu_round(c, *ll, in[static_cast<size_t>(rank)], rank, s, false), want[0][static_cast<size_t>(rank)]);
      if (!d.empty()) failures += "round: " + d + "; ";
      throw_failures(rank, failures);
    });
    EXPECT_EQ(failed, "");
  }
}

TEST(LlCuda, MatchesCpuOneRank) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(1);
}

TEST(LlCuda, MatchesCpuTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(2);
}

// Small shapes (eager_cases): bf16 with duplicates, fp8, fp8 + UE8M0 with the shared route and int64 ids;
// T in {0, 1, 7, 128} across the ranks.
TEST(LlCuda, MatchesCpuFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(4);
}

TEST(LlCuda, MatchesCpuEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(8);
}

TEST(LlCuda, GraphsWithDeviceTokenCountOneRank) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(1);
}

TEST(LlCuda, GraphsWithDeviceTokenCountTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(2);
}

// Small shape (run_graphs), column and partial_fp32 combine.
TEST(LlCuda, GraphsWithDeviceTokenCountFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(4);
  run_graphs(4, LlCombine::partial_fp32);
}

TEST(LlCuda, GraphsWithDeviceTokenCountEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(8);
  run_graphs(8, LlCombine::partial_fp32);
}

// Expert-side partial combine (LlCombine::partial_fp32 / partial_bf16) against LlCpu in the same mode.
TEST(LlCuda, PartialCombineMatchesCpuTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(2, LlCombine::partial_fp32);
  run_eager(2, LlCombine::partial_bf16);
}

TEST(LlCuda, PartialCombineMatchesCpuFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(4, LlCombine::partial_fp32);
  run_eager(4, LlCombine::partial_bf16);
}

TEST(LlCuda, PartialCombineMatchesCpuEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(8, LlCombine::partial_fp32);
  run_eager(8, LlCombine::partial_bf16);
}

// The fallback protocol (the expert expansion with block signals, LlLaunch::expand_message = false),
// which capacities whose message bitmaps do not fit in shared memory take: partial_fp32 cases, at R ranks.
void run_other_protocol(int R) {
  dispatch::LlLaunch launch;
  launch.expand_message = false;
  std::printf("ll: the expert expansion with block signals\n");
  run_eager(R, LlCombine::partial_fp32, &launch);
}

TEST(LlCuda, OtherProtocolMatchesCpuTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_protocol(2);
}

TEST(LlCuda, OtherProtocolMatchesCpuFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_protocol(4);
}

TEST(LlCuda, OtherProtocolMatchesCpuEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_protocol(8);
}

// ll.combine_wait, the value the Config does not choose (flag <-> data; ll_cuda.h): partial_fp32 and
// partial_bf16 eager (three rounds per object: both parities, a parity region reused, the hooks).
void run_other_combine_wait(int R) {
  const Config defaults;
  dispatch::LlLaunch launch;
  launch.combine_data = defaults.ll_combine_wait != "data";
  launch.timeout_s = Config::load().timeout_s;  // EPX_TIMEOUT_S bounds a hang
  std::printf("ll.combine_wait = %s\n", launch.combine_data ? "data" : "flag");
  run_eager(R, LlCombine::partial_fp32, &launch);
  run_eager(R, LlCombine::partial_bf16, &launch);
}

TEST(LlCuda, OtherCombineWaitTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_combine_wait(2);
}

TEST(LlCuda, OtherCombineWaitFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_combine_wait(4);
}

// The same, partial_fp32 graphs (seven replays on one object, T changing per replay and rank); the
// Config's value is set in this process before the ranks start (run_graphs builds through the Config).
TEST(LlCuda, OtherCombineWaitGraphsTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  const char* wait = Config().ll_combine_wait != "data" ? "data" : "flag";
  std::printf("ll.combine_wait = %s\n", wait);
  const test::ScopedEnv env("EPX_LL_COMBINE_WAIT", wait);
  run_graphs(2, LlCombine::partial_fp32);
}

TEST(LlCuda, PartialCombineGraphsTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(2, LlCombine::partial_fp32);
}

// One buffer, 20 consecutive calls (10 eager, 10 graph replays with the token count on the device), T
// per call and rank in {0, 1, 7, 128} shrinking and growing, fresh inputs, every call against LlCpu and
// every replay against its eager call: the fallback (block signals) and the default (chunk signals); the
// default also with rank 0's block 0
// delayed (3 ms before its tagged stores and again before its items), so rank 1 reads rank 0's
// slot-token words of call 4 while they still hold call 0's token (with a two-valued tag such a stale
// word passed as current and the expansion read message slot 0 before it was written). Two ranks: the
// inputs are built around rank 0's messages to rank 1.
TEST(LlCuda, ManyCallsVaryingTokensTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  const dispatch::LlLaunch block = many_calls_launch(false), chunk = many_calls_launch(true);
  dispatch::LlLaunch delayed = chunk;
  delayed.debug_block0_delay_ns = 3'000'000;
  EXPECT_EQ(run_many_calls("fallback (block signals)", {block, block}), "");
  EXPECT_EQ(run_many_calls("chunk signals", {chunk, chunk}), "");
  EXPECT_EQ(run_many_calls("chunk signals rank0-delayed", {delayed, chunk}), "");
}

// The self-check of the test above: with the slot-token tag cut to 2 bits (calls n and n - 4 share one)
// and rank 0's block 0 delayed, rank 1's call 4 (eager) and 14 (graph) must differ from LlCpu: the test
// catches the bug it is for.
TEST(LlCuda, ManyCallsCatchesAStaleSlotTokenTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  dispatch::LlLaunch weak = many_calls_launch(true);
  weak.debug_token_tag_mask = 3;
  dispatch::LlLaunch delayed = weak;
  delayed.debug_block0_delay_ns = 3'000'000;
  const std::string failed = run_many_calls("chunk signals tag-mask-3 rank0-delayed", {delayed, weak});
  std::printf("self-check failures (expected on rank 1, eager and graph call 4):\n%s", failed.c_str());
  EXPECT_NE(failed.find("eager call 4 rank 1"), std::string::npos) << failed;
  EXPECT_NE(failed.find("graph call 4 rank 1"), std::string::npos) << failed;
}

TEST(LlCuda, ErrorsTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_errors(2);
}

TEST(LlCuda, ErrorsFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_errors(4);
}

TEST(LlCuda, ErrorsEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_errors(8);
}

// A finalize refused on one rank stops every rank's combine at once (kLlFlagRejected; ll_cuda.h "Errors"):
// column (fused), partial_fp32 through the hooks, and partial_bf16 after the fallback dispatch (expert
// expansion, block signals); on 4 and 8 ranks the column case.
TEST(LlCuda, CombineRefusedOnOneRankReachesEveryRankTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  dispatch::LlLaunch dflt;
  dflt.timeout_s = 4.0;  // the refusal must arrive in well under timeout_s / 2; without the marker the peers wait 4 s
  dispatch::LlLaunch other = dflt;
  other.expand_message = false;
  EXPECT_EQ(run_combine_rejected(2, "column", LlCombine::column, dflt, false), "");
  EXPECT_EQ(run_combine_rejected(2, "partial_fp32 hooks", LlCombine::partial_fp32, dflt, true), "");
  EXPECT_EQ(run_combine_rejected(2, "partial_bf16 fallback expansion", LlCombine::partial_bf16, other, false), "");
  EXPECT_EQ(run_combine_rejected(2, "column, rank 1 without check", LlCombine::column, dflt, false, false), "");
}

TEST(LlCuda, CombineRefusedOnOneRankReachesEveryRankFourAndEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  dispatch::LlLaunch dflt;
  dflt.timeout_s = 4.0;
  EXPECT_EQ(run_combine_rejected(4, "column", LlCombine::column, dflt, false), "");
  EXPECT_EQ(run_combine_rejected(4, "column, peers without check", LlCombine::column, dflt, false, false), "");
  EXPECT_EQ(run_combine_rejected(8, "column", LlCombine::column, dflt, false), "");
}

// A stopped rank (it never calls; ll timeout_s 3 s, the group's 5 s on virtual ranks): every other rank's
// call ends with Timeout naming it. Two ranks: the stopped one sleeps; four: it returns at once (on
// virtual ranks; on real GPUs it sleeps); eight: rank 5 of 8 sleeps.
TEST(LlCuda, TimeoutNamesThePeerTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_timeout(2, 1, Stop::sleeps);
}

TEST(LlCuda, TimeoutNamesThePeerFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_timeout(4, 2, Stop::returns);
}

TEST(LlCuda, TimeoutNamesThePeerEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_timeout(8, 5, Stop::sleeps);
}

TEST(LlCuda, CombineWaitDataTimeoutNamesThePeerTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_combine_timeout(2, 1, Stop::sleeps);
}

TEST(LlCuda, CombineWaitDataTimeoutNamesThePeerFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_combine_timeout(4, 1, Stop::returns);
}

}  // namespace

#else

TEST(LlCuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif  // EPX_WITH_CUDA
