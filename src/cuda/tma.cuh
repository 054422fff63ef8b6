// cuda/tma.cuh: sm_90a asynchronous copies and their barriers, shared by the expert GEMMs (FP8 and
// MXFP4): cp.async (with its mbarrier arrival), the bulk copies of the TMA engine (with and without a
// tensor map, multicast to a cluster), mbarriers with transaction counts, cluster barriers. Compiled
// for sm_90a device code only (EPX_CUDA_SM90A); PTX semantics: the PTX ISA (cp.async,
// cp.async.bulk, cp.async.bulk.tensor, mbarrier, barrier.cluster).
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EPX_CUDA_SM90A 1
#endif

namespace epx::cuda::sm90 {

#ifdef EPX_CUDA_SM90A

// ---- cp.async --------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
/// cp.async.wait_group with a run-time count (0..3; larger counts wait for fewer groups: never wrong).
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  if (n >= 3) cp_async_wait<3>();
  else if (n == 2) cp_async_wait<2>();
  else if (n == 1) cp_async_wait<1>();
  else cp_async_wait<0>();
}

// ---- bulk copies (TMA engine) ----------------------------------------------------------------------
/// Bulk copy (TMA engine, no tensor map) of `bytes` (multiple of 16, 16-byte aligned ends) from
/// shared memory to global memory, in this thread's bulk group; PTX ISA 8.0 cp.async.bulk.
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/// Waits until this thread's bulk groups have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
/// Waits until this thread's bulk groups have completed (their writes done).
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
/// cp.async.bulk global -> shared, completing `bytes` (multiple of 16, both addresses 16-byte aligned) on `bar`.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst), "l"(src),
               "r"(bytes), "r"(bar)
               : "memory");
}
/// Box (x = K byte offset, y = row) of the 2-D tensor map `map` (a CUtensorMap) into shared `dst`
/// (1024-byte aligned); completes the box's bytes on mbarrier `bar`. Rows past the map's extent land
/// as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int32_t x, int32_t y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
/// The same box written at the same shared offset of every CTA of the cluster in `mask` (cluster ranks), the mbarrier at
/// offset `bar` of each of them completing the box's bytes (PTX ISA 8.0, .multicast::cluster).
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const void* map, int32_t x, int32_t y, uint32_t bar,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], "
      "%5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(mask)
      : "memory");
}

// ---- mbarriers ---------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/// Blocks until the phase with the given parity of `bar` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
/// Arrives on `bar` once every cp.async this thread issued so far has landed (no pending-count
/// increment: the barrier's expected count includes this arrival).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
/// Arrives on `bar` and adds `bytes` to the transaction count its phase waits for (the TMA copies' bytes).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
/// Makes the mbarrier initialisations of this thread visible to the async proxy and the cluster.
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// ---- clusters ---------------------------------------------------------------------------------------
/// Arrives on the mbarrier at shared offset `bar` of the CTA of cluster rank `cta`, with the instruction's default
/// semantics (release at CTA scope, as CUTLASS's and DeepGEMM's cluster pipelines arrive on a peer's `empty`): the
/// arriving warp's reads of the stage are complete (wgmma.wait_group 0, the ldmatrix results consumed), so the peer's
/// TMA refill has no earlier access of this thread to be ordered after. Not `.release.cluster`: a cluster-scope
/// release is a fence on the consumer's serial chain in every K block (with it both 30 and 31 take ~45 % more time
/// than the one-CTA kernel; bench/NOTES.md, 'the weight tile shared by a 2-CTA cluster').
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\nmbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
               "r"(cta)
               : "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
/// Every thread of every CTA of the cluster (release / acquire at cluster scope).
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

#endif  // EPX_CUDA_SM90A

}  // namespace epx::cuda::sm90
