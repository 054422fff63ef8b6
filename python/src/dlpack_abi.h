// python/src/dlpack_abi.h: the DLPack C ABI (structs and enum values only), as the DLPack 1.1
// specification defines it (dmlc/dlpack include/dlpack/dlpack.h; Python Array API "__dlpack__").
// Declared here so the bindings build without a dlpack package on either machine; the layout is
// the ABI every producer (torch, numpy) uses, so it must not change.
#pragma once

#include <cstddef>
#include <cstdint>

namespace epx::py::dl {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3, kCUDAManaged = 13 };

enum TypeCode : uint8_t {
  kInt = 0,
  kUInt = 1,
  kFloat = 2,
  kBfloat = 4,
  kBool = 6,
  kFloat8_e4m3fn = 10,
  kFloat8_e8m0fnu = 14,
};

struct Version { uint32_t major; uint32_t minor; };
struct Device { int32_t device_type; int32_t device_id; };
struct DataType { uint8_t code; uint8_t bits; uint16_t lanes; };

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  ///< elements; NULL = compact row-major (legacy producers)
  uint64_t byte_offset;
};

/// Legacy (pre-1.0) managed tensor; capsule name "dltensor", "used_dltensor" once consumed.
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

/// DLPack >= 1.0 managed tensor; capsule name "dltensor_versioned", "used_dltensor_versioned".
struct ManagedTensorVersioned {
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  uint64_t flags;  ///< bit 0 read-only, bit 1 is-copied
  Tensor dl_tensor;
};

constexpr uint64_t kFlagReadOnly = 1;  ///< DLPACK_FLAG_BITMASK_READ_ONLY: the consumer must not write
constexpr uint64_t kFlagIsCopied = 2;  ///< DLPACK_FLAG_BITMASK_IS_COPIED: the producer made a copy (writes are lost)

/// The newest DLPack this side speaks (the ABI of 1.0 and 1.1 is the same; 1.1 added dtype codes).
constexpr uint32_t kMaxMajor = 1;
constexpr uint32_t kMaxMinor = 1;

static_assert(sizeof(Tensor) == 48, "DLTensor is 48 bytes on LP64");
static_assert(sizeof(ManagedTensor) == 64, "DLManagedTensor is 64 bytes on LP64");
static_assert(sizeof(ManagedTensorVersioned) == 80 && offsetof(ManagedTensorVersioned, dl_tensor) == 32,
              "DLManagedTensorVersioned: version, manager_ctx, deleter, flags, then the DLTensor at byte 32");

}  // namespace epx::py::dl
