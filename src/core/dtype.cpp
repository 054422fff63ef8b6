#include "epx/dtype.h"

#include <string>

#include "epx/error.h"

namespace epx {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::fp32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
    case DType::fp8_e4m3: return "fp8_e4m3";
    case DType::e8m0: return "e8m0";
    case DType::fp4_e2m1x2: return "fp4_e2m1x2";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
    case DType::uint8: return "uint8";
  }
  return "?";
}

DType parse_dtype(std::string_view n) {
  if (n == "fp32" || n == "float32") return DType::fp32;
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "fp16" || n == "float16") return DType::fp16;
  if (n == "fp8" || n == "fp8_e4m3" || n == "e4m3") return DType::fp8_e4m3;
  if (n == "e8m0") return DType::e8m0;
  if (n == "fp4" || n == "fp4_e2m1x2" || n == "mxfp4") return DType::fp4_e2m1x2;
  if (n == "int32") return DType::int32;
  if (n == "int64") return DType::int64;
  if (n == "uint8") return DType::uint8;
  throw InvalidArgument(arg_message("parse_dtype", "name", std::string(n),
                                    "must be one of fp32, bf16, fp16, fp8_e4m3, e8m0, fp4_e2m1x2, int32, int64, uint8"));
}

}  // namespace epx
