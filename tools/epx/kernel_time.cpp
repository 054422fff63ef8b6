// tools/epx/kernel_time.cpp: the CUPTI side of `epx bench --kernel-time` (kernel_time.h).
#include "kernel_time.h"

#include <mutex>

#ifdef EPX_WITH_CUPTI
#include <cupti.h>
#endif

namespace epx::cli::kt {

#ifdef EPX_WITH_CUPTI
namespace {

constexpr size_t kBufferBytes = size_t{8} << 20;

/// Records delivered by CUPTI's buffer-completed callback (CUPTI's thread or the flushing one).
struct Sink {
  std::mutex mu;
  std::vector<KernelRecord> kernels;
  std::vector<CorrelationRecord> correlations;
  std::vector<ApiRecord> apis;
  uint64_t dropped = 0;
};
Sink& sink() {
  static Sink s;
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t* buffer, size_t size, size_t valid) {
  Sink& s = sink();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    CUpti_Activity* rec = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
      if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
        // The fields read here (start, end, correlationId, name) sit at the same offsets in every
        // CUpti_ActivityKernel version since 4 (later versions append fields).
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        s.kernels.push_back({k->correlationId, k->start, k->end, k->name ? k->name : "?"});
      } else if (rec->kind == CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION) {
        const auto* c = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(rec);
        if (c->externalKind == CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0) s.correlations.push_back({c->correlationId, c->externalId});
      } else if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME || rec->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        s.apis.push_back({a->correlationId, a->start});
      }
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream_id, &dropped) == CUPTI_SUCCESS) s.dropped += dropped;
  }
  std::free(buffer);
}

std::string cupti_error(const char* what, CUptiResult r) {
  const char* msg = nullptr;
  if (cuptiGetResultString(r, &msg) != CUPTI_SUCCESS || !msg) msg = "unknown CUPTI error";
  return std::string(what) + ": " + msg + " (CUptiResult " + std::to_string(static_cast<int>(r)) + ")";
}

// The kinds collected in a round: kernels, the external correlation records, and the runtime/driver API
// records (CUPTI emits an external-correlation record only next to an API record).
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
                                         CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};

}  // namespace

KernelTimer::KernelTimer() {
  // Registered (and the kernel kind switched on and off once) when the bench starts, before any graph is
  // captured: CUPTI attaching to a context after a capture is what torch's _init_for_cuda_graphs avoids.
  CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  if (r != CUPTI_SUCCESS) {
    reason_ = cupti_error("cuptiActivityRegisterCallbacks", r);
    return;
  }
  r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (r != CUPTI_SUCCESS) {
    reason_ = cupti_error("cuptiActivityEnable(CONCURRENT_KERNEL)", r);
    return;
  }
  (void)cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  (void)cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  available_ = true;
}

bool KernelTimer::begin_rounds() {
  if (!available_) return false;
  {
    Sink& s = sink();
    std::lock_guard<std::mutex> lock(s.mu);
    s.kernels.clear();
    s.correlations.clear();
    s.apis.clear();
    s.dropped = 0;
  }
  windows_.clear();
  for (CUpti_ActivityKind k : kKinds) {
    const CUptiResult r = cuptiActivityEnable(k);
    if (r != CUPTI_SUCCESS) {
      for (CUpti_ActivityKind d : kKinds) (void)cuptiActivityDisable(d);
      available_ = false;
      reason_ = cupti_error("cuptiActivityEnable", r);
      return false;
    }
  }
  collecting_ = true;
  return true;
}

void KernelTimer::begin_call(int64_t iteration, Op op) {
  if (!collecting_) return;
  CallWindow w;
  w.call_id = call_id(iteration, op);
  (void)cuptiGetTimestamp(&w.begin_ns);
  windows_.push_back(w);
  (void)cuptiActivityPushExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, w.call_id);
}

void KernelTimer::end_call() {
  if (!collecting_) return;
  uint64_t last = 0;
  (void)cuptiActivityPopExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, &last);
  if (!windows_.empty()) (void)cuptiGetTimestamp(&windows_.back().end_ns);
}

std::vector<OpTimes> KernelTimer::end_rounds(int64_t iterations) {
  if (!collecting_) return aggregate({}, {}, iterations);
  collecting_ = false;
  const CUptiResult r = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  for (CUpti_ActivityKind k : kKinds) (void)cuptiActivityDisable(k);
  if (r != CUPTI_SUCCESS) {
    available_ = false;
    reason_ = cupti_error("cuptiActivityFlushAll", r);
    return aggregate({}, {}, iterations);
  }
  Sink& s = sink();
  std::lock_guard<std::mutex> lock(s.mu);
  dropped_ = s.dropped;
  stats_ = record_stats(s.kernels, s.correlations, s.apis, windows_);
  std::vector<OpTimes> ops = aggregate(s.kernels, s.correlations, iterations, s.apis, windows_);
  s.kernels.clear();
  s.correlations.clear();
  s.apis.clear();
  windows_.clear();
  return ops;
}

#else  // no CUPTI in this build

KernelTimer::KernelTimer() {
  reason_ = "built without CUPTI (CMake EPX_CUPTI=OFF, no CUDA, or no libcupti found)";
}
bool KernelTimer::begin_rounds() { return false; }
void KernelTimer::begin_call(int64_t, Op) {}
void KernelTimer::end_call() {}
std::vector<OpTimes> KernelTimer::end_rounds(int64_t iterations) { return aggregate({}, {}, iterations); }

#endif

KernelTimer& KernelTimer::instance() {
  static KernelTimer t;
  return t;
}

}  // namespace epx::cli::kt
