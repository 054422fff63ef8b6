// checkpoint/safetensors.cpp: a validating reader (mmap) and a writer of the safetensors format
// (https://github.com/huggingface/safetensors; the rules are listed in include/epx/checkpoint.h).
// Every check runs at open(), so a later read can only fail for a name that is absent.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "epx/checkpoint.h"
#include "epx/error.h"

namespace epx {

namespace {

using json = nlohmann::json;

/// The reference implementation's cap on N (safetensors/src/tensor.rs MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeBits {
  const char* name;
  int bits;
};
constexpr DTypeBits kDTypes[] = {
    {"BOOL", 8}, {"U8", 8},   {"I8", 8},   {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"I16", 16},
    {"U16", 16}, {"F16", 16}, {"BF16", 16}, {"I32", 32},   {"U32", 32},    {"F32", 32},    {"I64", 64},
    {"U64", 64}, {"F64", 64}, {"F4", 4},
};

std::string known_dtypes() {
  std::string s;
  for (const DTypeBits& d : kDTypes) s += (s.empty() ? "" : " ") + std::string(d.name);
  return s;
}

std::string quote_name(const std::string& s) { return "\"" + s + "\""; }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string range_text(uint64_t a, uint64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + ")"; }

/// numel * bits / 8 with overflow detection; false when it overflows or is not a whole byte count.
bool tensor_bytes(const std::vector<int64_t>& shape, int bits, uint64_t* out) {
  unsigned __int128 n = 1;
  for (int64_t d : shape) {
    n *= static_cast<uint64_t>(d);
    if (n > (static_cast<unsigned __int128>(1) << 64)) return false;
  }
  n *= static_cast<unsigned>(bits);
  if (n % 8 != 0) return false;
  n /= 8;
  if (n > UINT64_MAX) return false;
  *out = static_cast<uint64_t>(n);
  return true;
}

}  // namespace

int64_t SafetensorsTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int safetensors_dtype_bits(std::string_view dtype) {
  for (const DTypeBits& d : kDTypes)
    if (dtype == d.name) return d.bits;
  return 0;
}

DType safetensors_to_dtype(std::string_view dtype) {
  if (dtype == "F32") return DType::fp32;
  if (dtype == "F16") return DType::fp16;
  if (dtype == "BF16") return DType::bf16;
  if (dtype == "F8_E4M3") return DType::fp8_e4m3;
  if (dtype == "F8_E8M0") return DType::e8m0;
  if (dtype == "U8") return DType::uint8;
  if (dtype == "I32") return DType::int32;
  if (dtype == "I64") return DType::int64;
  if (safetensors_dtype_bits(dtype) == 0)
    throw InvalidArgument(arg_message("safetensors", "dtype", std::string(dtype), "unknown; known: " + known_dtypes()));
  throw Unsupported(arg_message("safetensors", "dtype", std::string(dtype),
                                "has no epx DType (F32 F16 BF16 F8_E4M3 F8_E8M0 U8 I32 I64 do); read its bytes instead"));
}

std::string_view dtype_to_safetensors(DType dtype) {
  switch (dtype) {
    case DType::fp32: return "F32";
    case DType::bf16: return "BF16";
    case DType::fp16: return "F16";
    case DType::fp8_e4m3: return "F8_E4M3";
    case DType::e8m0: return "F8_E8M0";
    case DType::fp4_e2m1x2: return "U8";
    case DType::int32: return "I32";
    case DType::int64: return "I64";
    case DType::uint8: return "U8";
  }
  return "U8";
}

// ---- reader ---------------------------------------------------------------------------------------

struct SafetensorsFile::Impl {
  std::string path;
  int fd = -1;
  const uint8_t* map = nullptr;
  uint64_t size = 0;
  uint64_t data_offset = 0;
  std::unordered_map<std::string, SafetensorsTensorInfo> tensors;
  std::map<std::string, std::string> metadata;

  ~Impl() {
    if (map != nullptr && size > 0) munmap(const_cast<uint8_t*>(map), size);
    if (fd >= 0) close(fd);
  }
  [[noreturn]] void fail(const std::string& arg, const std::string& value, const std::string& rule) const {
    throw InvalidArgument(arg_message("safetensors.open", path + ": " + arg, value, rule));
  }
  void parse_header(const std::string& text);
  void check_layout();
};

void SafetensorsFile::Impl::parse_header(const std::string& text) {
  // Duplicate top-level keys are an error (the format forbids them); nlohmann would keep the last,
  // so the parser callback sees every key at depth 1 first.
  std::set<std::string> seen;
  std::string duplicate;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      const std::string k = parsed.get<std::string>();
      if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, on_event);
  } catch (const json::exception& e) {
    fail("header", "(" + std::to_string(text.size()) + " bytes of JSON)", std::string("must be valid JSON: ") + e.what());
  }
  if (!duplicate.empty()) fail("header key", quote_name(duplicate), "appears twice; keys must be unique");
  if (!header.is_object()) fail("header", header.type_name(), "must be a JSON object");
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail("__metadata__", v.type_name(), "must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail("__metadata__." + m.key(), m.value().dump(), "must be a string");
        metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor " + quote_name(name);
    if (!v.is_object()) fail(what, v.dump(), "must be an object with dtype, shape and data_offsets");
    SafetensorsTensorInfo info;
    info.name = name;
    if (!v.contains("dtype") || !v["dtype"].is_string()) fail(what + " dtype", v.contains("dtype") ? v["dtype"].dump() : "missing", "must be a string");
    info.dtype = v["dtype"].get<std::string>();
    const int bits = safetensors_dtype_bits(info.dtype);
    if (bits == 0) fail(what + " dtype", info.dtype, "unknown; known: " + known_dtypes());
    if (!v.contains("shape") || !v["shape"].is_array()) fail(what + " shape", v.contains("shape") ? v["shape"].dump() : "missing", "must be an array of sizes");
    for (const json& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail(what + " shape", v["shape"].dump(), "must hold integers >= 0");
      info.shape.push_back(d.get<int64_t>());
    }
    const json* off = v.contains("data_offsets") ? &v["data_offsets"] : nullptr;
    if (off == nullptr || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
      fail(what + " data_offsets", off ? off->dump() : "missing", "must be [begin, end] with integers >= 0");
    info.data_begin = (*off)[0].get<uint64_t>();
    info.data_end = (*off)[1].get<uint64_t>();
    if (info.data_end < info.data_begin) fail(what + " data_offsets", off->dump(), "must have begin <= end");
    uint64_t expect = 0;
    if (!tensor_bytes(info.shape, bits, &expect))
      fail(what + " shape", shape_text(info.shape), "numel * " + std::to_string(bits) + " bits overflows or is not whole bytes (dtype " + info.dtype + ")");
    if (expect != info.nbytes())
      fail(what + " data_offsets", range_text(info.data_begin, info.data_end),
           "span " + std::to_string(info.nbytes()) + " bytes but shape " + shape_text(info.shape) + " x " + info.dtype + " needs " +
               std::to_string(expect));
    tensors.emplace(name, std::move(info));
  }
}

void SafetensorsFile::Impl::check_layout() {
  const uint64_t data_bytes = size - data_offset;
  std::vector<const SafetensorsTensorInfo*> order;
  for (const auto& [name, info] : tensors) {
    if (info.data_end > data_bytes)
      fail("tensor " + quote_name(name) + " data_offsets", range_text(info.data_begin, info.data_end),
           "must lie inside the data section of " + std::to_string(data_bytes) + " bytes (file truncated?)");
    order.push_back(&info);
  }
  std::sort(order.begin(), order.end(), [](const SafetensorsTensorInfo* a, const SafetensorsTensorInfo* b) {
    return a->data_begin != b->data_begin ? a->data_begin < b->data_begin
           : a->data_end != b->data_end   ? a->data_end < b->data_end
                                          : a->name < b->name;
  });
  uint64_t end = 0;
  const SafetensorsTensorInfo* prev = nullptr;
  for (const SafetensorsTensorInfo* t : order) {
    if (t->data_begin < end)
      fail("tensor " + quote_name(t->name) + " data_offsets", range_text(t->data_begin, t->data_end),
           "overlaps tensor " + quote_name(prev->name) + " " + range_text(prev->data_begin, prev->data_end));
    if (t->data_begin > end)
      fail("tensor " + quote_name(t->name) + " data_offsets", range_text(t->data_begin, t->data_end),
           "leaves a hole of " + std::to_string(t->data_begin - end) + " bytes after " +
               (prev ? "tensor " + quote_name(prev->name) : std::string("the start of the data section")) + " (the data must be covered exactly)");
    end = t->data_end;
    prev = t;
  }
  if (end != data_bytes)
    fail("data section", std::to_string(data_bytes) + " bytes",
         "tensors cover only " + std::to_string(end) + " bytes; trailing bytes are not allowed");
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (impl->fd < 0) impl->fail("open", std::strerror(errno), "the file must exist and be readable");
  struct stat st {};
  if (fstat(impl->fd, &st) != 0) impl->fail("stat", std::strerror(errno), "the file must be readable");
  if (!S_ISREG(st.st_mode)) impl->fail("type", "not a regular file", "must be a regular file");
  impl->size = static_cast<uint64_t>(st.st_size);
  if (impl->size < 8)
    impl->fail("size", std::to_string(impl->size) + " bytes", "must be >= 8 (the header length); file truncated or not safetensors");
  void* m = mmap(nullptr, impl->size, PROT_READ, MAP_PRIVATE, impl->fd, 0);
  if (m == MAP_FAILED) impl->fail("mmap", std::strerror(errno), "the file must be mappable");
  impl->map = static_cast<const uint8_t*>(m);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | impl->map[i];  // little-endian, whatever the host order
  if (n > kMaxHeaderBytes) impl->fail("header length", std::to_string(n), "must be <= 100000000 (the format's cap); not a safetensors file?");
  if (n > impl->size - 8)
    impl->fail("header length", std::to_string(n),
               "must be <= file size - 8 = " + std::to_string(impl->size - 8) + " (file truncated or not safetensors)");
  impl->data_offset = 8 + n;
  const std::string text(reinterpret_cast<const char*>(impl->map + 8), static_cast<size_t>(n));
  if (text.empty() || text[0] != '{') impl->fail("header", text.empty() ? "empty" : "starts with byte " + std::to_string(static_cast<int>(static_cast<uint8_t>(text[0]))), "must start with '{'");
  impl->parse_header(text);
  impl->check_layout();
  return SafetensorsFile(std::move(impl));
}

SafetensorsFile::SafetensorsFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

const std::string& SafetensorsFile::path() const { return impl_->path; }

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> v;
  for (const auto& kv : impl_->tensors) v.push_back(kv.first);
  std::sort(v.begin(), v.end());
  return v;
}

bool SafetensorsFile::contains(const std::string& name) const { return impl_->tensors.count(name) > 0; }

const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = impl_->tensors.find(name);
  if (it == impl_->tensors.end())
    throw InvalidArgument(arg_message("safetensors.read", impl_->path + ": tensor", quote_name(name),
                                      "not in this file (it holds " + std::to_string(impl_->tensors.size()) + " tensors)"));
  return it->second;
}

std::span<const uint8_t> SafetensorsFile::bytes(const std::string& name) const {
  const SafetensorsTensorInfo& t = info(name);
  return {impl_->map + impl_->data_offset + t.data_begin, static_cast<size_t>(t.nbytes())};
}

Tensor SafetensorsFile::read(const std::string& name) const {
  const SafetensorsTensorInfo& t = info(name);
  DType dtype;
  try {
    dtype = safetensors_to_dtype(t.dtype);
  } catch (const Unsupported&) {
    throw Unsupported(arg_message("safetensors.read", impl_->path + ": tensor " + quote_name(name) + " dtype", t.dtype,
                                  "has no epx DType; read its bytes instead"));
  }
  if (t.shape.size() > static_cast<size_t>(kMaxDims))
    throw InvalidArgument(arg_message("safetensors.read", impl_->path + ": tensor " + quote_name(name) + " shape", shape_text(t.shape),
                                      "has more than " + std::to_string(kMaxDims) + " dims (an epx Tensor's limit)"));
  std::vector<int64_t> shape = t.shape.empty() ? std::vector<int64_t>{1} : t.shape;
  Tensor out = Tensor::empty(shape, dtype);
  const std::span<const uint8_t> b = bytes(name);
  if (!b.empty()) std::memcpy(out.data(), b.data(), b.size());
  return out;
}

const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return impl_->metadata; }
uint64_t SafetensorsFile::data_offset() const { return impl_->data_offset; }

// ---- writer -----------------------------------------------------------------------------------

SafetensorsEntry SafetensorsEntry::from(std::string name, const TensorView& t, std::string dtype) {
  check_contiguous("SafetensorsEntry::from", name, t);
  require_arg("SafetensorsEntry::from", name + " device", t.device.str(), t.device.is_cpu(), "must be a CPU tensor");
  SafetensorsEntry e;
  e.name = std::move(name);
  e.dtype = dtype.empty() ? std::string(dtype_to_safetensors(t.dtype)) : std::move(dtype);
  for (int d = 0; d < t.ndim; ++d) e.shape.push_back(t.shape[d]);
  e.data = t.data;
  e.nbytes = static_cast<uint64_t>(t.nbytes());
  return e;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  constexpr std::string_view kOp = "write_safetensors";
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsEntry& t : tensors) {
    require_arg(kOp, "tensor name", quote_name(t.name), !t.name.empty() && t.name != "__metadata__", "must be non-empty and not __metadata__");
    require_arg(kOp, "tensor name", quote_name(t.name), !header.contains(t.name), "appears twice");
    const int bits = safetensors_dtype_bits(t.dtype);
    require_arg(kOp, "tensor " + quote_name(t.name) + " dtype", t.dtype, bits > 0, "unknown; known: " + known_dtypes());
    uint64_t expect = 0;
    for (int64_t d : t.shape) require_arg(kOp, "tensor " + quote_name(t.name) + " shape", shape_text(t.shape), d >= 0, "sizes must be >= 0");
    require_arg(kOp, "tensor " + quote_name(t.name) + " shape", shape_text(t.shape), tensor_bytes(t.shape, bits, &expect), "overflows or is not whole bytes");
    require_arg(kOp, "tensor " + quote_name(t.name) + " nbytes", t.nbytes, t.nbytes == expect,
                "must equal numel * bits / 8 = " + std::to_string(expect));
    require_arg(kOp, "tensor " + quote_name(t.name) + " data", "null", t.data != nullptr || t.nbytes == 0, "must be set");
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw Error(arg_message(kOp, "path", path, "cannot be opened for writing"));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const SafetensorsEntry& t : tensors)
    if (t.nbytes > 0) f.write(static_cast<const char*>(t.data), static_cast<std::streamsize>(t.nbytes));
  f.close();
  if (!f) throw Error(arg_message(kOp, "path", path, "write failed (disk full?)"));
}

}  // namespace epx
