// tools/epx/bench_report.cpp: `epx bench`, the report (bench_internal.h): validation against CPU ranks
// or the identity formula, the table and the JSON.
#include "bench_internal.h"

namespace epx::cli::bench_internal {

namespace {

/// out[t] = round_bf16(sum over valid k of w[t,k] * round_bf16(x~[t])): what any correct backend
/// computes with identity experts, rounded once; a backend that rounds once (ll partial_fp32 /
/// column, the Flat backends with flat_combine partial_fp32) differs from it only in the fp32
/// summation order (within 1 bf16 ulp), one with partial_bf16 rounds each rank's partial first.
Tensor identity_formula(const RankInputs& in, int K, DType dtype) {
  const int64_t T = in.x.size(0), H = in.x.size(1);
  Tensor out = Tensor::empty({T, H}, DType::bf16);
  std::vector<float> row(static_cast<size_t>(H)), acc(static_cast<size_t>(H));
  std::vector<uint8_t> q(static_cast<size_t>(H));
  std::vector<float> sc(static_cast<size_t>(H / kFp8GroupSize + 1));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) row[h] = bf16_bits_to_float(in.x.ptr<const uint16_t>()[t * H + h]);
    if (dtype == DType::fp8_e4m3) {
      quantize_fp8_row(row.data(), H, q.data(), sc.data(), kFp8GroupSize, false);
      dequantize_fp8_row(q.data(), sc.data(), H, row.data(), kFp8GroupSize);
    }
    for (float& v : row) v = round_bf16(v);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      if (in.idx.ptr<const int32_t>()[t * K + k] < 0) continue;
      const float w = in.wts.ptr<const float>()[t * K + k];
      for (int64_t h = 0; h < H; ++h) acc[h] += w * row[h];
    }
    for (int64_t h = 0; h < H; ++h) out.ptr<uint16_t>()[t * H + h] = float_to_bf16_bits(acc[h]);
  }
  return out;
}

/// Fraction of elements of `out` more than `ulps` bf16 ulps from `ref` (both bf16 [.., H]; NaN counts as far).
double fraction_beyond_ulps(const Tensor& out, const Tensor& ref, int ulps) {
  const int64_t n = std::min(out.numel(), ref.numel());
  if (n == 0) return 0.0;
  // bf16 bits as a monotone integer line (negative values mirrored), so adjacent values differ by 1.
  auto ordered = [](uint16_t b) { return (b & 0x8000) ? -static_cast<int32_t>(b & 0x7FFF) : static_cast<int32_t>(b); };
  int64_t far = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t a = out.ptr<const uint16_t>()[i], b = ref.ptr<const uint16_t>()[i];
    const bool nan = std::isnan(bf16_bits_to_float(a)) || std::isnan(bf16_bits_to_float(b));
    far += nan || std::abs(ordered(a) - ordered(b)) > ulps;
  }
  return static_cast<double>(far) / static_cast<double>(n);
}

/// Whether `job` promises one rounding (ll unless ll_combine partial_bf16; the Flat backends with
/// flat_combine partial_fp32), so its output must lie within 1 ulp of the identity formula.
bool rounds_once(const Job& job, const Config& config) {
  if (job.backend == "ll") return config.ll_combine != "partial_bf16";
  return job.flat_combine == FlatCombine::partial_fp32;
}

/// The same backend on CPU ranks (threads) with identity experts, on the same inputs.
std::vector<Tensor> cpu_backend_outputs(const Job& job, const BenchCase& c, int64_t T, const std::vector<RankInputs>& ins,
                                        double timeout_s) {
  const int R = static_cast<int>(ins.size());
  auto groups = make_cpu_groups(R, timeout_s);
  std::vector<Tensor> outs(static_cast<size_t>(R));
  run_ranks(groups, [&](int r) {
    const DispatchConfig cfg = dispatch_config(c, T, job);
    auto pf = make_prepare_finalize(job.backend, groups[r], cfg);
    auto experts = make_identity_experts(num_local_experts(cfg, R, r), c.hidden, Device::cpu());
    DispatchArgs a;
    a.x = ins[r].x;
    a.topk_idx = ins[r].idx;
    a.topk_weights = ins[r].wts;
    const PrepareResult p = pf->prepare(a);
    std::vector<int64_t> dims(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
    Tensor eo = Tensor::empty(dims, expert_out_dtype(p.layout, cfg));
    experts->apply(p.experts_input(), eo, {});
    outs[r] = Tensor::empty({T, c.hidden}, DType::bf16);
    FinalizeArgs f;
    f.expert_out = eo;
    f.out = outs[r];
    pf->finalize(f);
  });
  return outs;
}

std::string fixed(double v, int digits) {
  if (!std::isfinite(v)) return "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

int64_t bytes_per_selection(const BenchCase& c, DType dtype, const std::string& op) {
  const int64_t H = c.hidden;
  if (op == "combine") return 2 * H;
  return dtype == DType::fp8_e4m3 ? H + H / kFp8GroupSize * 4 + (c.accounting == "deepep-ll" ? 16 : 0) : 2 * H;
}

}  // namespace

/// Validation, table, JSON. Returns the exit code.
int report(const BenchOptions& o, const std::vector<BenchCase>& cases, const std::vector<Job>& jobs, std::vector<JobResult>& results,
           bool cuda, int R, const Config& config, const std::string& command) {
  using json = nlohmann::ordered_json;
  // Virtual ranks (R threads on one GPU): the times are one GPU's memory, not NVLink.
  const bool virtual_ranks = cuda && o.ranks_per_gpu_for_report > 1;
  const json ranks_per_gpu = cuda ? json(o.ranks_per_gpu_for_report) : json(nullptr);
  // Inputs of every rank, regenerated here (deterministic per (seed, case, rank)) for the references.
  std::vector<std::vector<RankInputs>> inputs(cases.size());
  auto inputs_of = [&](size_t ci) -> const std::vector<RankInputs>& {
    if (inputs[ci].empty())
      for (int r = 0; r < R; ++r) inputs[ci].push_back(make_inputs(cases[ci], ci, tokens_for(cases[ci], o, cuda), r, R, o));
    return inputs[ci];
  };
  json rows = json::array();
  bool ok = true;
  std::ostringstream table;
  // Wide enough for "nccl_raw:allgather_reducescatter" and "allgather_reducescatter [padded]".
  constexpr int kBackendWidth = 34;
  table << std::left << std::setw(7) << "case" << std::setw(9) << "dtype" << std::setw(kBackendWidth) << "backend" << std::setw(9) << "op"
        << std::right << std::setw(10) << "p50 us" << std::setw(10) << "p10 us" << std::setw(10) << "p90 us" << std::setw(9) << "GB/s"
        << std::setw(11) << "predicted" << std::setw(7) << "ratio" << std::setw(10) << "kern p50" << std::setw(10) << "kern p90"
        << std::setw(10) << "span p50" << std::setw(8) << "kGB/s" << "  " << std::left << "validated\n";
  std::ostringstream kernel_lines;  // the kernels seen, per (job, op)
  std::string kernel_state;         // the first row's kernel_time, for the footer
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    const BenchCase& c = cases[job.case_idx];
    JobResult& jr = results[j];
    const int64_t T = tokens_for(c, o, cuda);
    int64_t status = 0;
    std::string message;
    for (const RankJobResult& r : jr.ranks)
      if (r.status > status) status = r.status, message = r.message;
    // Validation of an epx backend's round trip.
    bool validated = false, passed = true;
    double max_rel = 0, rel_l2 = 0, beyond_ulp = 0, mismatch = 0;
    std::string reference;
    if (status == 0 && !is_raw(job.backend)) {
      try {
        const auto& ins = inputs_of(job.case_idx);
        std::vector<Tensor> refs;
        if (cuda) {
          refs = cpu_backend_outputs(job, c, T, ins, config.timeout_s);
          reference = "cpu backend " + job.backend + " + identity experts, same inputs";
        } else {
          for (const RankInputs& in : ins) refs.push_back(identity_formula(in, c.top_k, job.dtype));
          reference = "identity formula sum_k w * round_bf16(x~)";
        }
        for (int r = 0; r < R; ++r) {
          double a = 0, b = 0;
          errors_against(jr.ranks[r].out, refs[r], &a, &b);
          max_rel = std::max(max_rel, a);
          rel_l2 = std::max(rel_l2, b);
          beyond_ulp = std::max(beyond_ulp, fraction_beyond_ulps(jr.ranks[r].out, refs[r], 1));
          mismatch = std::max(mismatch, fraction_beyond_ulps(jr.ranks[r].out, refs[r], 0));
        }
        validated = true;
        if (!(rel_l2 <= kRelL2Tolerance)) {
          passed = false;
          message = "rel L2 error " + std::to_string(rel_l2) + " > " + std::to_string(kRelL2Tolerance) + " against the " + reference;
        } else if (!cuda && rounds_once(job, config) && !(beyond_ulp <= kOneRoundingFarFraction)) {
          // One rounding: only the fp32 summation order differs from the formula.
          passed = false;
          message = "one rounding promised, but " + std::to_string(100 * beyond_ulp) + " % of elements are more than 1 ulp from the " +
                    reference + " (at most " + std::to_string(100 * kOneRoundingFarFraction) + " %)";
        }
        ok = ok && passed;
      } catch (const std::exception& e) {
        ok = passed = false;
        message = std::string("validation failed: ") + e.what();
      }
    }
    if (status == 2) ok = false;
    const bool has_1tok = status == 0 && !jr.ranks.empty() && !jr.ranks[0].dispatch_us_1tok.empty();
    for (const bool one_token : {false, true})
    for (const char* op_name : {"dispatch", "combine"}) {
      if (one_token && !has_1tok) continue;
      const std::string op = op_name;
      std::vector<double> per_iter;
      double bytes = 0, moved = 0;
      if (status == 0) {
        const size_t n = one_token ? jr.ranks[0].dispatch_us_1tok.size() : jr.ranks[0].dispatch_us.size();
        per_iter.assign(n, 0.0);
        for (const RankJobResult& r : jr.ranks) {
          const auto& v = one_token ? (op == "dispatch" ? r.dispatch_us_1tok : r.combine_us_1tok) : (op == "dispatch" ? r.dispatch_us : r.combine_us);
          for (size_t i = 0; i < n && i < v.size(); ++i) per_iter[i] = std::max(per_iter[i], v[i]);
          const int64_t count = c.accounting == "deepep-ll" ? r.valid_selections : r.dedup_rows;
          if (!one_token) bytes += static_cast<double>(count * bytes_per_selection(c, job.dtype, op)) / R;
          moved += static_cast<double>(op == "dispatch" ? r.moved_bytes_dispatch : r.moved_bytes_combine) / R;
        }
      }
      const bool ran = !per_iter.empty();
      const double p50 = ran ? percentile(per_iter, 50) : NAN;
      const double gbps = ran && p50 > 0 ? bytes / (p50 * 1e3) : NAN;
      const Prediction pred = predict(c.name, job.dtype, job.backend, op, R);
      // Predictions were written for the GPUs at the case's own shape and uniform routing.
      // None for the padded form (its bytes and host work differ from what they were written for).
      const bool has_pred = !one_token && !job.padded && pred.predicted_us > 0 && cuda && !virtual_ranks && T == c.tokens_per_rank &&
                            o.routing == "uniform";
      // Host wall time of the timed calls (eager rounds): per iteration the slowest rank's.
      std::vector<double> host_iter;
      if (status == 0 && !one_token && !jr.ranks.empty() && !jr.ranks[0].host_dispatch_us.empty()) {
        host_iter.assign(jr.ranks[0].host_dispatch_us.size(), 0.0);
        for (const RankJobResult& r : jr.ranks) {
          const auto& v = op == "dispatch" ? r.host_dispatch_us : r.host_combine_us;
          for (size_t i = 0; i < host_iter.size() && i < v.size(); ++i) host_iter[i] = std::max(host_iter[i], v[i]);
        }
      }
      const bool row_validated = validated && !one_token;
      // --kernel-time (KernelRun): each rank's own p50 / p90 / mean of its calls' kernel sums (and spans), the
      // largest over the ranks; the per-iteration slowest rank's p50 beside it (it also holds the iterations
      // where one rank's kernel waited for a peer that started late).
      const int opi = op == "dispatch" ? 0 : 1;
      const KernelRun* kr0 = status == 0 && !jr.ranks.empty() ? (one_token ? &jr.ranks[0].kernel_1tok : &jr.ranks[0].kernel) : nullptr;
      const bool kran = kr0 && kr0->ran;
      std::vector<std::vector<double>> ksum, kspan, kev;
      json kper_rank = json::array();
      if (kran)
        for (const RankJobResult& r : jr.ranks) {
          const KernelRun& k = one_token ? r.kernel_1tok : r.kernel;
          ksum.push_back(k.sum_us[opi]);
          kspan.push_back(k.span_us[opi]);
          kev.push_back(k.events_us[opi]);
          const double v = kt::percentile_finite(k.sum_us[opi], 50);
          kper_rank.push_back(std::isfinite(v) ? json(v) : json(nullptr));
        }
      const std::vector<double> kit = kran ? kt::slowest_rank(ksum) : std::vector<double>{};
      const std::vector<double> ksp = kran ? kt::slowest_rank(kspan) : std::vector<double>{};
      const std::vector<double> kevs = kran ? kt::slowest_rank(kev) : std::vector<double>{};
      auto num = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
      auto worst = [](double a, double b) { return std::isnan(a) ? b : std::isnan(b) ? a : std::max(a, b); };
      double k50 = NAN, k90 = NAN, kmean = NAN, s50 = NAN, s90 = NAN;
      for (size_t q = 0; q < ksum.size(); ++q) {
        k50 = worst(k50, kt::percentile_finite(ksum[q], 50));
        k90 = worst(k90, kt::percentile_finite(ksum[q], 90));
        kmean = worst(kmean, kt::mean_finite(ksum[q]));
        s50 = worst(s50, kt::percentile_finite(kspan[q], 50));
        s90 = worst(s90, kt::percentile_finite(kspan[q], 90));
      }
      const double kgbps = std::isfinite(k50) && k50 > 0 && !one_token && status == 0 ? bytes / (k50 * 1e3) : NAN;
      const std::string kstate = kran ? "cupti" : kr0 ? kr0->reason : status == 0 ? "unavailable" : "n/a (the job did not run)";
      if (const std::string why = kr0 ? kt::kernel_time_failure(o.kernel_time, kran, kr0->reason) : ""; !why.empty()) {
        ok = false;  // a runtime CUPTI failure ran as auto and exited 0
        if (message.empty()) message = why;
      }
      if (kernel_state.empty() && kr0) kernel_state = kstate;
      json kernels = json::object();
      if (kran)
        for (const auto& [name, n] : kr0->per_call[opi]) kernels[name] = n;
      if (kran)
        kernel_lines << "  kernels of " << job.backend << (one_token ? " (T=1) " : " ") << op << ": "
                     << (kr0->names[opi].empty() ? std::string("none seen") : kr0->names[opi]) << " (per call, rank 0)\n";
      json row = {
          {"case", c.name},
          {"backend", job.backend},
          {"op", op},
          {"tokens_per_rank", one_token ? int64_t{1} : T},
          {"hidden", c.hidden},
          {"top_k", c.top_k},
          {"num_experts", c.num_experts},
          {"ranks", R},
          {"ranks_per_gpu", ranks_per_gpu},
          {"dtype", std::string(dtype_name(op == "dispatch" ? job.dtype : DType::bf16))},
          {"dispatch_dtype", std::string(dtype_name(job.dtype))},
          {"routing", o.routing == "zipf" ? "zipf(s=" + fixed(o.zipf_s, 2) + ")" : o.routing},
          {"ll_combine", job.backend == "ll" ? json(config.ll_combine) : json(nullptr)},
          {"ll_combine_wait", job.backend == "ll" ? json(config.ll_combine_wait) : json(nullptr)},
          {"latency_us_p50", ran ? json(p50) : json(nullptr)},
          {"latency_us_p10", ran ? json(percentile(per_iter, 10)) : json(nullptr)},
          {"latency_us_p90", ran ? json(percentile(per_iter, 90)) : json(nullptr)},
          {"gbps", std::isfinite(gbps) && !one_token ? json(gbps) : json(nullptr)},
          {"accounting", c.accounting},
          {"bytes_per_rank", ran ? json(bytes) : json(nullptr)},
          {"tflops", nullptr},
          {"fraction_of_peak", nullptr},
          {"sms", status == 0 && jr.ranks[0].sms > 0 ? json(jr.ranks[0].sms) : json(nullptr)},
          {"timing", status == 0 && jr.ranks[0].graph ? "cuda-graph replay" : "eager"},
          {"path", status == 0 && jr.ranks[0].hierarchical ? "hierarchical (inter-node NCCL blocks, then the backend inside each node)"
                                                           : "flat"},
          {"iterations", ran ? json(per_iter.size()) : json(0)},
          {"warmup", o.warmup},
          {"validated", row_validated},
          {"max_rel_error", row_validated ? json(max_rel) : json(nullptr)},
          {"rel_l2_error", row_validated ? json(rel_l2) : json(nullptr)},
          {"mismatch_fraction", row_validated ? json(mismatch) : json(nullptr)},
          {"beyond_1ulp_fraction", row_validated ? json(beyond_ulp) : json(nullptr)},
          {"flat_combine", job.backend == "ll" || job.backend == kRaw ? json(nullptr) : json(flat_combine_name(job.flat_combine))},
          {"form", has_padded_form(job.backend) ? json(job.padded ? "padded" : "dynamic") : json(nullptr)},
          {"host_enqueue_us_p50", host_iter.empty() ? json(nullptr) : json(percentile(host_iter, 50))},
          {"host_enqueue_us_p90", host_iter.empty() ? json(nullptr) : json(percentile(host_iter, 90))},
          {"ratio_to_nccl_raw", nullptr},                        // padded rows: set below, against the twin
          {"prepare_plus_finalize_ratio_to_nccl_raw", nullptr},  // the same
          {"raw_calls", is_padded_raw(job.backend) ? json(padded_raw_plan(c, T, job, R).describe(op == "dispatch")) : json(nullptr)},
          {"remote_bytes_rank0", status == 0 && !is_raw(job.backend) && !one_token && !jr.ranks.empty() &&
                                         (op == "dispatch" ? jr.ranks[0].remote_bytes_dispatch : jr.ranks[0].remote_bytes_combine) >= 0
                                     ? json(op == "dispatch" ? jr.ranks[0].remote_bytes_dispatch : jr.ranks[0].remote_bytes_combine)
                                     : json(nullptr)},
          {"reference", row_validated ? json(reference)
                                      : json(is_raw(job.backend) ? "none: data movement only"
                                                                 : one_token ? "none: latency floor (same graphs, device-side T = 1)" : "none")},
          {"predicted_us", has_pred ? json(pred.predicted_us) : json(nullptr)},
          {"prediction", has_pred ? json(pred.derivation) : json(nullptr)},
          {"ratio_to_predicted", has_pred && ran ? json(p50 / pred.predicted_us) : json(nullptr)},
          {"status", status == 0 ? (validated && !passed ? "FAIL" : "ran") : status == 1 ? "unsupported" : "error"},
          {"kernel_time", kstate},
          {"kernel_us_p50", num(k50)},
          {"kernel_us_p90", num(k90)},
          {"kernel_us_mean", num(kmean)},
          {"kernel_us_p50_slowest_rank_per_iteration", kran ? num(kt::percentile_finite(kit, 50)) : json(nullptr)},
          {"kernel_span_us_p50", num(s50)},
          {"kernel_span_us_p90", num(s90)},
          {"kernel_us_p50_per_rank", kran ? kper_rank : json(nullptr)},
          {"kernel_gbps", num(kgbps)},
          {"kernels", kran ? kernels : json(nullptr)},
          {"kernel_iterations", kran ? json(kit.size()) : json(nullptr)},
          {"latency_us_p50_cupti_rounds", kran ? num(kt::percentile_finite(kevs, 50)) : json(nullptr)},
          {"kernel_records_dropped", kran ? json(kr0->dropped) : json(nullptr)},
      };
      if (is_raw(job.backend) && ran) row["moved_bytes_per_rank"] = moved;
      if (one_token) row["note"] = "1 token per rank: the fixed floor, the same captured graphs replayed with num_tokens = 1 on the device";
      if (!message.empty()) row["message"] = message;
      rows.push_back(row);
      const std::string label = job.backend + (job.padded && !is_raw(job.backend) ? " [padded]" : "");
      table << std::left << std::setw(7) << c.name << std::setw(9) << dtype_name(job.dtype) << std::setw(kBackendWidth)
            << (one_token ? label + " (T=1)" : label) << std::setw(9) << op << std::right << std::setw(10) << (ran ? fixed(p50, 1) : "-") << std::setw(10)
            << (ran ? fixed(percentile(per_iter, 10), 1) : "-") << std::setw(10) << (ran ? fixed(percentile(per_iter, 90), 1) : "-")
            << std::setw(9) << (one_token ? std::string("-") : fixed(gbps, 1)) << std::setw(11) << (has_pred ? fixed(pred.predicted_us, 0) : "-") << std::setw(7)
            << (has_pred && ran ? fixed(p50 / pred.predicted_us, 2) : "-") << std::setw(10) << fixed(k50, 1) << std::setw(10)
            << fixed(k90, 1) << std::setw(10) << fixed(s50, 1)
            << std::setw(8) << fixed(kgbps, 0) << "  " << std::left
            << (status == 1 ? "unsupported" : status == 2 ? "ERROR" : validated ? (passed ? "yes" : "FAIL") : "n/a")
            << "\n";
    }
    if (!message.empty()) table << "  " << job.backend << ": " << message << "\n";
  }
  // --padded: each padded row against its nccl_raw twin, timed in the same iterations (same case, dtype, op).
  std::ostringstream padded_lines;
  auto p50_of = [](const json& r) { return r["latency_us_p50"].is_number() ? r["latency_us_p50"].get<double>() : NAN; };
  auto twin_of = [&](const json& row, const std::string& op) -> const json* {
    for (const auto& raw : rows)
      if (raw["backend"] == std::string(kPaddedRawPrefix) + row["backend"].get<std::string>() && raw["case"] == row["case"] &&
          raw["dispatch_dtype"] == row["dispatch_dtype"] && raw["op"] == op && raw["tokens_per_rank"] == row["tokens_per_rank"])
        return &raw;
    return nullptr;
  };
  auto pair_of = [&](const json& row, const std::string& op) -> const json* {
    for (const auto& r : rows)
      if (r["backend"] == row["backend"] && r["form"] == row["form"] && r["case"] == row["case"] &&
          r["dispatch_dtype"] == row["dispatch_dtype"] && r["op"] == op && r["tokens_per_rank"] == row["tokens_per_rank"])
        return &r;
    return nullptr;
  };
  for (auto& row : rows) {
    if (row["form"] != "padded") continue;
    const json* raw = twin_of(row, row["op"]);
    const json* other = pair_of(row, row["op"] == "dispatch" ? "combine" : "dispatch");
    const json* raw_other = other ? twin_of(*other, (*other)["op"]) : nullptr;
    const double mine = p50_of(row), theirs = raw ? p50_of(*raw) : NAN;
    row["ratio_to_nccl_raw"] = std::isfinite(mine) && std::isfinite(theirs) && theirs > 0 ? json(mine / theirs) : json(nullptr);
    const double sum = other ? mine + p50_of(*other) : NAN, raw_sum = raw && raw_other ? theirs + p50_of(*raw_other) : NAN;
    row["prepare_plus_finalize_ratio_to_nccl_raw"] = std::isfinite(sum) && std::isfinite(raw_sum) && raw_sum > 0 ? json(sum / raw_sum) : json(nullptr);
    if (std::isfinite(mine) && std::isfinite(theirs)) {
      auto host = [&](const json& r) { return r["host_enqueue_us_p50"].is_number() ? fixed(r["host_enqueue_us_p50"].get<double>(), 1) : "-"; };
      padded_lines << "  " << row["case"].get<std::string>() << " " << row["dispatch_dtype"].get<std::string>() << " "
                   << row["backend"].get<std::string>() << " " << (row["op"] == "dispatch" ? "prepare " : "finalize") << ": p50 "
                   << fixed(mine, 1) << " us vs " << fixed(theirs, 1) << " us raw (" << fixed(mine / theirs, 2) << "x"
                   << (row["prepare_plus_finalize_ratio_to_nccl_raw"].is_number()
                           ? "; prepare + finalize " + fixed(row["prepare_plus_finalize_ratio_to_nccl_raw"].get<double>(), 2) + "x"
                           : std::string())
                   << "); host enqueue p50 " << host(row) << " us (raw " << host(*raw) << " us); raw: "
                   << (*raw)["raw_calls"].get<std::string>() << "\n";
    }
  }
  // Ratio to NCCL's raw all-to-all measured in the same run (same case, dispatch dtype, op, tokens).
  for (auto& row : rows) {
    if (is_raw(row["backend"].get<std::string>()) || row["latency_us_p50"].is_null()) continue;
    for (const auto& raw : rows)
      if (raw["backend"] == kRaw && raw["case"] == row["case"] && raw["dispatch_dtype"] == row["dispatch_dtype"] && raw["op"] == row["op"] &&
          raw["tokens_per_rank"] == row["tokens_per_rank"] && !raw["latency_us_p50"].is_null())
        row["speedup_vs_nccl_a2a_raw"] = raw["latency_us_p50"].get<double>() / row["latency_us_p50"].get<double>();
  }
  std::cout << "node layout: " << o.node_layout_for_report.describe()
            << (virtual_ranks ? std::string(" (virtual ranks: threads on one GPU)")
                              : " (NCCL LSA team " + std::to_string(o.node_layout_for_report.lsa_size) + ")")
            << "\n" << table.str() << kernel_lines.str();
  if (!padded_lines.str().empty())
    std::cout << "padded form against the raw collectives it makes (nccl_raw:<backend>, same iterations, order alternating):\n"
              << padded_lines.str();
  if (virtual_ranks)
    std::cout << virtual_ranks_note(R) << ": epx bench measures one GPU's memory, not NVLink; " << kRaw
              << (o.padded ? " and nccl_raw:<backend> are the virtual group's collectives" : " is the virtual group's all_to_allv")
              << " (copies on the GPU, no NCCL); no predictions (written for NVLink)\n";
  std::cout << "GB/s: bytes per rank (mean over ranks) / p50; accounting per case (ANCHORS.md): ";
  for (const BenchCase& c : cases) std::cout << c.name << " " << c.accounting << "  ";
  std::cout << "\nlatency: per iteration the slowest rank's, " << (cuda ? (o.graph ? "CUDA events around CUDA-graph replays" : "CUDA events") : "host clock") << ", after " << o.warmup
            << " warm-up iterations; expert step = identity (untimed)\n";
  if (kernel_state == "cupti")
    std::cout << "kernel time: CUPTI activity records (CONCURRENT_KERNEL) in " << o.iters
              << " separate iterations after the event ones; kern = sum of a call's kernel durations, span = first start to last end,"
                 " each rank's percentile, the largest over the ranks; kGB/s on kern p50\n";
  else if (!kernel_state.empty())
    std::cout << "kernel time: " << (kernel_state.rfind("unavailable: ", 0) == 0 ? "unavailable (" + kernel_state.substr(13) + ")" : kernel_state)
              << "\n";

  if (!o.json.empty()) {
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    ::gmtime_r(&now, &tm);
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json doc = {{"tool", "epx bench"},
                {"command", command},
                {"git_commit", git_commit()},
                {"date", date},
                {"device", cuda ? o.device_name_for_report : cpu_device_name()},
                {"nccl_version", cuda && !virtual_ranks ? json(nccl_version_string()) : json(nullptr)},
                {"ranks_per_gpu", ranks_per_gpu},
                {"epx_version", EPX_VERSION},
                {"results", std::move(rows)}};
    doc["config"] = config.describe();
    doc["node_layout"] = node_layout_json(o.node_layout_for_report);
    const auto parent = std::filesystem::path(o.json).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    std::ofstream f(o.json, std::ios::trunc);
    require_arg(kOp, "--json", o.json, f.good(), "must be a writable file path");
    f << doc.dump(2) << "\n";
    std::cout << "wrote " << o.json << "\n";
  }
  std::cout << "repro: " << command << "\n" << std::flush;
  return ok ? 0 : 1;
}

}  // namespace epx::cli::bench_internal
