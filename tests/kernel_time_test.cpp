// tests/kernel_time_test.cpp: the CPU side of `epx bench --kernel-time` (tools/epx/kernel_time.h): CUPTI
// kernel records sorted into calls through the external correlation ids, the per-call sum and span, the
// slowest rank per iteration, percentiles over finite values, short kernel names. No GPU needed.
#include <gtest/gtest.h>

#include <cmath>

#include "../tools/epx/kernel_time.h"

namespace kt = epx::cli::kt;

namespace {

TEST(KernelTime, CallIdsAreOneBasedAndDistinctPerOp) {
  EXPECT_EQ(kt::call_id(0, kt::Op::dispatch), 1u);
  EXPECT_EQ(kt::call_id(0, kt::Op::combine), 2u);
  EXPECT_EQ(kt::call_id(3, kt::Op::dispatch), 7u);
  EXPECT_EQ(kt::call_id(3, kt::Op::combine), 8u);
}

TEST(KernelTime, RecordsAreSortedIntoCallsBySumAndSpan) {
  // Iteration 0: dispatch = two kernels (API calls 10 and 11), combine = one (12). Iteration 1: dispatch one
  // kernel (20), combine none. API call 30 belongs to no region (the alignment all-reduce) and is ignored;
  // correlation 99 has no external id at all.
  const std::vector<kt::CorrelationRecord> corr = {{10, kt::call_id(0, kt::Op::dispatch)},
                                                   {11, kt::call_id(0, kt::Op::dispatch)},
                                                   {12, kt::call_id(0, kt::Op::combine)},
                                                   {20, kt::call_id(1, kt::Op::dispatch)},
                                                   {30, 0}};
  const std::vector<kt::KernelRecord> k = {
      {10, 1000, 3000, "_ZN3epx8dispatch11ll_dispatchEPKvi"},   // 2.0 us
      {11, 4000, 4500, "_ZN3epx8dispatch11ll_dispatchEPKvi"},   // 0.5 us; span 1000 -> 4500 = 3.5 us
      {12, 10000, 17000, "ncclDevKernel_SendRecv"},             // 7.0 us
      {20, 50000, 52250, "_ZN3epx8dispatch11ll_dispatchEPKvi"}, // 2.25 us
      {30, 0, 100000, "ncclDevKernel_AllReduce"},               // outside the regions
      {99, 0, 100000, "stray"},
  };
  const auto ops = kt::aggregate(k, corr, 2);
  ASSERT_EQ(ops.size(), 2u);
  const auto& d = ops[0].calls;
  const auto& c = ops[1].calls;
  ASSERT_EQ(d.size(), 2u);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(d[0].kernels, 2);
  EXPECT_DOUBLE_EQ(d[0].sum_us, 2.5);
  EXPECT_DOUBLE_EQ(d[0].span_us, 3.5);
  EXPECT_EQ(d[1].kernels, 1);
  EXPECT_DOUBLE_EQ(d[1].sum_us, 2.25);
  EXPECT_DOUBLE_EQ(d[1].span_us, 2.25);
  EXPECT_EQ(c[0].kernels, 1);
  EXPECT_DOUBLE_EQ(c[0].sum_us, 7.0);
  EXPECT_EQ(c[1].kernels, 0);
  EXPECT_TRUE(std::isnan(c[1].sum_us));
  EXPECT_TRUE(std::isnan(c[1].span_us));
  // Names: demangled, parameters dropped; counted over all calls of the op.
  ASSERT_EQ(ops[0].names.size(), 1u);
  EXPECT_EQ(ops[0].names.begin()->first, "epx::dispatch::ll_dispatch");
  EXPECT_EQ(ops[0].names.begin()->second, 3);
  ASSERT_EQ(ops[1].names.size(), 1u);
  EXPECT_EQ(ops[1].names.at("ncclDevKernel_SendRecv"), 1);
  const std::string stats = kt::record_stats(k, corr);
  EXPECT_NE(stats.find("6 kernel records (4 in calls, 0 of them by window), 5 external correlations"), std::string::npos) << stats;
  EXPECT_NE(stats.find("ncclDevKernel_AllReduce x1; stray x1;"), std::string::npos) << stats;
}

TEST(KernelTime, KernelsLaunchedByAnotherThreadGoByTheCallsHostWindow) {
  // NCCL's own thread launches kernel 40 (API call at t = 5500, inside iteration 0's combine window [5000, 6000])
  // and kernel 41 (API call at t = 7000, between the windows: the alignment). Kernel 42's API call has an
  // external id and also sits in a window: the external id wins.
  const std::vector<kt::CallWindow> windows = {{kt::call_id(0, kt::Op::dispatch), 1000, 2000}, {kt::call_id(0, kt::Op::combine), 5000, 6000},
                                               {kt::call_id(1, kt::Op::dispatch), 8000, 9000}};
  const std::vector<kt::ApiRecord> apis = {{40, 5500}, {41, 7000}, {42, 5600}, {43, 9000}};
  const std::vector<kt::CorrelationRecord> corr = {{42, kt::call_id(0, kt::Op::dispatch)}};
  const std::vector<kt::KernelRecord> k = {{40, 10000, 13000, "ncclDevKernel_SendRecv"},
                                           {41, 14000, 15000, "ncclDevKernel_AllReduce"},
                                           {42, 20000, 21000, "d"},
                                           {43, 30000, 30500, "ncclDevKernel_SendRecv"}};
  const auto ops = kt::aggregate(k, corr, 2, apis, windows);
  EXPECT_DOUBLE_EQ(ops[1].calls[0].sum_us, 3.0);
  EXPECT_EQ(ops[1].calls[0].kernels, 1);
  EXPECT_DOUBLE_EQ(ops[0].calls[0].sum_us, 1.0);
  EXPECT_EQ(ops[0].names.count("d"), 1u);
  EXPECT_DOUBLE_EQ(ops[0].calls[1].sum_us, 0.5);  // t = 9000: the window's end is inside
  EXPECT_EQ(ops[1].calls[1].kernels, 0);
  EXPECT_EQ(ops[1].names.count("ncclDevKernel_AllReduce"), 0u);
  // Without the windows kernel 40 belongs to no call.
  EXPECT_EQ(kt::aggregate(k, corr, 2, apis, {})[1].calls[0].kernels, 0);
  const std::string stats = kt::record_stats(k, corr, apis, windows);
  EXPECT_NE(stats.find("4 kernel records (3 in calls, 2 of them by window)"), std::string::npos) << stats;
}

TEST(KernelTime, IdsPastTheIterationsAndIncompleteRecordsAreIgnored) {
  const std::vector<kt::CorrelationRecord> corr = {{1, kt::call_id(0, kt::Op::dispatch)}, {2, kt::call_id(5, kt::Op::dispatch)},
                                                   {3, kt::call_id(0, kt::Op::combine)}};
  const std::vector<kt::KernelRecord> k = {{1, 100, 1100, "a"}, {2, 0, 5000, "b"}, {3, 900, 0, "c"}};
  const auto ops = kt::aggregate(k, corr, 1);
  EXPECT_DOUBLE_EQ(ops[0].calls[0].sum_us, 1.0);
  EXPECT_EQ(ops[0].names.count("b"), 0u);
  EXPECT_EQ(ops[1].calls[0].kernels, 0);  // end < start: CUPTI had no end timestamp
  EXPECT_TRUE(kt::aggregate(k, corr, 0)[0].calls.empty());
}

TEST(KernelTime, PercentilesSkipNaNAndInterpolate) {
  EXPECT_DOUBLE_EQ(kt::percentile_finite({3, 1, 2}, 50), 2.0);
  EXPECT_DOUBLE_EQ(kt::percentile_finite({4, 1, 3, 2}, 50), 2.5);
  EXPECT_DOUBLE_EQ(kt::percentile_finite({1, NAN, 3, 2, INFINITY}, 50), 2.0);
  // p90 of 1..11: position 0.9 * 10 = 9 -> 10.
  std::vector<double> v;
  for (int i = 11; i >= 1; --i) v.push_back(i);
  EXPECT_DOUBLE_EQ(kt::percentile_finite(v, 90), 10.0);
  EXPECT_DOUBLE_EQ(kt::percentile_finite({10, 20}, 90), 19.0);
  EXPECT_TRUE(std::isnan(kt::percentile_finite({NAN, NAN}, 50)));
  EXPECT_TRUE(std::isnan(kt::percentile_finite({}, 50)));
  EXPECT_DOUBLE_EQ(kt::mean_finite({1, 2, NAN, 6}), 3.0);
  EXPECT_TRUE(std::isnan(kt::mean_finite({NAN})));
}

TEST(KernelTime, SlowestRankPerIterationAndUnknownWhenARankMissedTheCall) {
  const std::vector<std::vector<double>> per_rank = {{1.0, 5.0, 2.0, 7.0}, {3.0, 4.0, NAN, 8.0}, {2.0, 4.5, 1.0}};
  const std::vector<double> s = kt::slowest_rank(per_rank);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_DOUBLE_EQ(s[0], 3.0);
  EXPECT_DOUBLE_EQ(s[1], 5.0);
  EXPECT_TRUE(std::isnan(s[2]));  // rank 1 saw no kernel
  EXPECT_TRUE(std::isnan(s[3]));  // rank 2 has no 4th iteration
  EXPECT_TRUE(kt::slowest_rank({}).empty());
  EXPECT_DOUBLE_EQ(kt::percentile_finite(s, 50), 4.0);
}

TEST(KernelTime, ShortNames) {
  EXPECT_EQ(kt::short_kernel_name("ncclDevKernel_SendRecv(ncclDevKernelArgs4K)"), "ncclDevKernel_SendRecv");
  EXPECT_EQ(kt::short_kernel_name("_ZN3epx8dispatch11ll_dispatchEPKvi"), "epx::dispatch::ll_dispatch");
  // A template instance: "void epx::k<8>(int)" -> the name without its arguments.
  EXPECT_EQ(kt::short_kernel_name("_ZN3epx1kILi8EEEvi"), "epx::k");
  EXPECT_EQ(kt::short_kernel_name("plain"), "plain");
  EXPECT_EQ(kt::short_kernel_name("d"), "d");  // a C name that is also a mangled type (double)
  // "void epx::(anonymous namespace)::k<8>(int)"
  EXPECT_EQ(kt::short_kernel_name("_ZN3epx12_GLOBAL__N_11kILi8EEEvi"), "epx::{anon}::k");
}

}  // namespace

// --kernel-time on with CUPTI failing at run time (refused by begin_rounds, or a flush error) reported
// "unavailable" and exited 0, as auto does; now that job fails, naming why. auto / off, a run that
// measured, and rounds that did not run for another reason (the job failed first) are not failures here.
TEST(KernelTime, OnFailsAJobWhoseKernelRoundsWereUnavailable) {
  const std::string why = kt::kernel_time_failure("on", false, "unavailable: cuptiActivityEnable: CUPTI_ERROR_NOT_INITIALIZED");
  EXPECT_EQ(why, "--kernel-time = on: no kernel time was measured (unavailable: cuptiActivityEnable: CUPTI_ERROR_NOT_INITIALIZED); "
                 "use auto to run without it");
  EXPECT_NE(kt::kernel_time_failure("on", false, "unavailable: CUPTI refused on another rank (see its stderr)"), "");
  EXPECT_EQ(kt::kernel_time_failure("auto", false, "unavailable: cuptiActivityEnable: CUPTI_ERROR_NOT_INITIALIZED"), "");
  EXPECT_EQ(kt::kernel_time_failure("off", false, "off"), "");
  EXPECT_EQ(kt::kernel_time_failure("on", true, ""), "");
  EXPECT_EQ(kt::kernel_time_failure("on", false, ""), "");
}
