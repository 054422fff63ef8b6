// src/moe/trace_npy.cpp: a tiny NumPy .npy reader/writer and the directory form of a trace.
//
// .npy (NumPy NEP 1, format versions 1.0-3.0): magic "\x93NUMPY", major, minor, header length
// (uint16 LE for 1.0, uint32 LE for 2.0/3.0), then a Python dict literal
//   {'descr': '<i4', 'fortran_order': False, 'shape': (T, K), }
// padded with spaces to a multiple of 64 bytes and ended by '\n', then the raw C-order data.
// We read and write only what a trace needs: little-endian int32/int64/fp32/uint16, C order.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/topk_message.h"
#include "epx/error.h"
#include "epx/trace.h"
#include "moe/trace_npy.h"

namespace epx {

namespace {
int64_t itemsize(const std::string& descr) {
  if (descr == "<i4" || descr == "<f4") return 4;
  if (descr == "<i8") return 8;
  if (descr == "<u2") return 2;
  return 0;
}

// Value of 'key' in the header dict: the text after "'key':" up to the matching end.
std::string header_value(const std::string& header, const std::string& key) {
  const std::string k = "'" + key + "'";
  size_t p = header.find(k);
  if (p == std::string::npos) return {};
  p = header.find(':', p + k.size());
  if (p == std::string::npos) return {};
  ++p;
  while (p < header.size() && header[p] == ' ') ++p;
  if (p >= header.size()) return {};
  if (header[p] == '\'') {
    size_t e = header.find('\'', p + 1);
    return e == std::string::npos ? std::string() : header.substr(p + 1, e - p - 1);
  }
  if (header[p] == '(') {
    size_t e = header.find(')', p);
    return e == std::string::npos ? std::string() : header.substr(p, e - p + 1);
  }
  size_t e = header.find_first_of(",}", p);
  return header.substr(p, e == std::string::npos ? std::string::npos : e - p);
}
}  // namespace

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

NpyArray read_npy(const std::string& path) {
  const std::string op = "npy " + path;
  std::ifstream f(path, std::ios::binary);
  require_arg(op, "path", path, f.good(), "must name a readable file");
  char magic[8] = {};
  f.read(magic, 8);
  require_arg(op, "magic", "not \\x93NUMPY", f.good() && std::memcmp(magic, "\x93NUMPY", 6) == 0, "must start a .npy file");
  const int major = static_cast<unsigned char>(magic[6]);
  require_arg(op, "version", major, major >= 1 && major <= 3, "must be 1, 2 or 3");
  uint32_t header_len = 0;
  unsigned char len_bytes[4] = {};
  f.read(reinterpret_cast<char*>(len_bytes), major == 1 ? 2 : 4);
  header_len = len_bytes[0] | (len_bytes[1] << 8) | (static_cast<uint32_t>(len_bytes[2]) << 16) | (static_cast<uint32_t>(len_bytes[3]) << 24);
  require_arg(op, "header_len", header_len, f.good() && header_len < (1u << 20), "must be a readable header under 1 MiB");
  std::string header(header_len, '\0');
  f.read(header.data(), header_len);
  require_arg(op, "header", "truncated", f.good(), "must be complete");

  NpyArray a;
  a.descr = header_value(header, "descr");
  require_arg(op, "descr", a.descr, itemsize(a.descr) > 0, "must be one of <i4, <i8, <f4, <u2 (little-endian)");
  const std::string fortran = header_value(header, "fortran_order");
  require_arg(op, "fortran_order", fortran, fortran == "False", "must be False (C order)");
  const std::string shape = header_value(header, "shape");
  require_arg(op, "shape", shape, shape.size() >= 2 && shape.front() == '(' && shape.back() == ')', "must be a tuple");
  std::string dims = shape.substr(1, shape.size() - 2);
  std::replace(dims.begin(), dims.end(), ',', ' ');
  std::istringstream is(dims);
  for (int64_t d; is >> d;) {
    require_arg(op, "shape", shape, d >= 0, "must hold sizes >= 0");
    a.shape.push_back(d);
  }
  require_arg(op, "shape", shape, is.eof(), "must hold integers only");
  // A corrupt or crafted header: the product must not wrap (2^54 x 256 x 4 bytes wrapped to 0 and was read as a
  // 2^54-row tensor), and no more bytes are allocated than the file holds after the header.
  int64_t bytes = itemsize(a.descr);
  for (int64_t d : a.shape)
    require_arg(op, "shape", shape, !__builtin_mul_overflow(bytes, d, &bytes), "product(shape) * itemsize must fit in int64");
  std::error_code ec;
  const auto file_bytes = std::filesystem::file_size(path, ec);
  const int64_t left = ec ? bytes : static_cast<int64_t>(file_bytes) - static_cast<int64_t>(f.tellg());
  require_arg(op, "data", "short", bytes <= left, "must hold product(shape) * itemsize = " + std::to_string(bytes) + " bytes");
  a.data.resize(static_cast<size_t>(bytes));
  f.read(reinterpret_cast<char*>(a.data.data()), bytes);
  require_arg(op, "data", "short", f.gcount() == bytes, "must hold product(shape) * itemsize = " + std::to_string(bytes) + " bytes");
  return a;
}

void write_npy(const std::string& path, const NpyArray& a) {
  const std::string op = "npy " + path;
  require_arg(op, "descr", a.descr, itemsize(a.descr) > 0, "must be one of <i4, <i8, <f4, <u2");
  require_arg(op, "data.size", a.data.size(), static_cast<int64_t>(a.data.size()) == a.numel() * itemsize(a.descr),
              "must equal product(shape) * itemsize");
  std::string dict = "{'descr': '" + a.descr + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < a.shape.size(); ++i) dict += std::to_string(a.shape[i]) + (a.shape.size() == 1 ? "," : (i + 1 < a.shape.size() ? ", " : ""));
  dict += "), }";
  // Pad so that magic (6) + version (2) + length (2) + header is a multiple of 64; end with '\n'.
  size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  require_arg(op, "header", dict.size(), dict.size() < 65536, "must fit a version 1.0 header");
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  require_arg(op, "path", path, f.good(), "must be writable");
  const unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, static_cast<unsigned char>(dict.size() & 0xff),
                                 static_cast<unsigned char>(dict.size() >> 8)};
  f.write(reinterpret_cast<const char*>(pre), 10);
  f.write(dict.data(), static_cast<std::streamsize>(dict.size()));
  f.write(reinterpret_cast<const char*>(a.data.data()), static_cast<std::streamsize>(a.data.size()));
  require_arg(op, "path", path, f.good(), "write failed");
}

namespace detail {

namespace {
using nlohmann::json;

NpyArray to_npy(const Tensor& t, const std::string& descr) {
  NpyArray a;
  a.descr = descr;
  a.shape = {t.size(0), t.size(1)};
  a.data.resize(static_cast<size_t>(t.nbytes()));
  if (t.nbytes() > 0) std::memcpy(a.data.data(), t.data(), a.data.size());
  return a;
}

// Loads a [rows, cols] array into a Tensor of `dtype`, converting the accepted on-disk types.
Tensor from_npy(const std::string& op, const std::string& what, const std::string& file, int64_t rows, int64_t cols, DType dtype) {
  NpyArray a = read_npy(file);
  require_arg(op, what + ".shape", a.shape.size() == 2 ? "[" + std::to_string(a.shape[0]) + ", " + std::to_string(a.shape[1]) + "]" : "rank " + std::to_string(a.shape.size()),
              a.shape.size() == 2 && a.shape[0] == rows && a.shape[1] == cols,
              "must be [" + std::to_string(rows) + ", " + std::to_string(cols) + "] (num_tokens x columns)");
  Tensor t = Tensor::empty({rows, cols}, dtype);
  const int64_t n = rows * cols;
  if (dtype == DType::int32) {
    require_arg(op, what + ".descr", a.descr, a.descr == "<i4" || a.descr == "<i8", "must be <i4 or <i8");
    int32_t* out = t.ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      int64_t v;
      if (a.descr == "<i4") { int32_t x; std::memcpy(&x, &a.data[i * 4], 4); v = x; }
      else std::memcpy(&v, &a.data[i * 8], 8);
      require_arg(op, detail::topk_elem(what, i / cols, i % cols), v, v >= INT32_MIN && v <= INT32_MAX, "must fit in int32");
      out[i] = static_cast<int32_t>(v);
    }
  } else if (dtype == DType::fp32) {
    require_arg(op, what + ".descr", a.descr, a.descr == "<f4", "must be <f4");
    if (n > 0) std::memcpy(t.data(), a.data.data(), static_cast<size_t>(n * 4));
  } else {  // bf16 hidden states: raw bf16 bits (<u2), or fp32 rounded to nearest even
    require_arg(op, what + ".descr", a.descr, a.descr == "<u2" || a.descr == "<f4", "must be <u2 (bf16 bits) or <f4");
    uint16_t* out = t.ptr<uint16_t>();
    for (int64_t i = 0; i < n; ++i) {
      if (a.descr == "<u2") std::memcpy(&out[i], &a.data[i * 2], 2);
      else { float x; std::memcpy(&x, &a.data[i * 4], 4); out[i] = float_to_bf16_bits(x); }
    }
  }
  return t;
}

std::string file_name(size_t step, size_t rank, const char* tensor) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "s%06zu_r%04zu.%s.npy", step, rank, tensor);
  return buf;
}
}  // namespace

Trace load_trace_dir(const std::string& dir) {
  const std::string op = "trace " + dir;
  const std::filesystem::path root(dir);
  std::ifstream f(root / "manifest.json");
  require_arg(op, "manifest.json", (root / "manifest.json").string(), f.good(), "must exist in a trace directory");
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    throw InvalidArgument(arg_message(op, "manifest.json", "unparsable", std::string("must be valid JSON (") + e.what() + ")"));
  }
  require_arg(op, "format", j.value("format", json()).dump(), j.is_object() && j.value("format", json()) == "epx-trace", "must be \"epx-trace\"");
  require_arg(op, "version", j.value("version", json()).dump(), j.value("version", json()) == 1, "must be 1");
  for (const char* key : {"num_ranks", "num_experts", "top_k"}) {
    require_arg(op, key, j.contains(key) ? j[key].dump() : "(missing)", j.contains(key) && j[key].is_number_integer(), "must be an integer");
    // get<int>() below would wrap: num_experts = 2^32 + 4 read as 4.
    require_arg(op, key, j[key].dump(), j[key].is_number_unsigned() ? j[key].get<uint64_t>() <= INT32_MAX : j[key].get<int64_t>() >= INT32_MIN,
                "must fit in a 32-bit int (at most 2147483647)");
  }
  require_arg(op, "steps", j.contains("steps") ? j["steps"].type_name() : "(missing)", j.contains("steps") && j["steps"].is_array(), "must be an array");
  Trace t;
  t.num_ranks = j["num_ranks"].get<int>();
  t.num_experts = j["num_experts"].get<int>();
  t.top_k = j["top_k"].get<int>();
  // Optional fields, each with its rule (nlohmann's value() threw its own type_error, naming no field, and read 1.5 as 1).
  if (j.contains("hidden")) {
    const json& h = j["hidden"];
    require_arg(op, "hidden", h.dump(), h.is_number_integer() && (h.is_number_unsigned() || h.get<int64_t>() >= 0),
                "must be an integer >= 0 (0 = no hidden states)");
    t.hidden = h.get<int64_t>();
  }
  if (j.contains("source")) {
    require_arg(op, "source", j["source"].dump(), j["source"].is_string(), "must be a string");
    t.source = j["source"].get<std::string>();
  }
  require_arg(op, "top_k", t.top_k, t.top_k >= 1, "must be >= 1");
  for (size_t s = 0; s < j["steps"].size(); ++s) {
    const json& js = j["steps"][s];
    const std::string sname = "steps[" + std::to_string(s) + "]";
    require_arg(op, sname + ".ranks.size", js.contains("ranks") ? js["ranks"].size() : 0,
                js.contains("ranks") && js["ranks"].is_array() && static_cast<int>(js["ranks"].size()) == t.num_ranks,
                "must equal num_ranks = " + std::to_string(t.num_ranks));
    TraceStep step;
    for (size_t r = 0; r < js["ranks"].size(); ++r) {
      const json& jr = js["ranks"][r];
      const std::string rname = sname + ".ranks[" + std::to_string(r) + "]";
      require_arg(op, rname + ".num_tokens", jr.value("num_tokens", json()).dump(),
                  jr.contains("num_tokens") && jr["num_tokens"].is_number_integer() && jr["num_tokens"].get<int64_t>() >= 0, "must be an integer >= 0");
      for (const char* key : {"topk_idx", "topk_weights"})
        require_arg(op, rname + "." + key, "(missing)", jr.contains(key) && jr[key].is_string(), "must name a .npy file in the directory");
      const int64_t T = jr["num_tokens"].get<int64_t>();
      TraceRank tr;
      tr.topk_idx = from_npy(op, rname + ".topk_idx", (root / jr["topk_idx"].get<std::string>()).string(), T, t.top_k, DType::int32);
      tr.topk_weights = from_npy(op, rname + ".topk_weights", (root / jr["topk_weights"].get<std::string>()).string(), T, t.top_k, DType::fp32);
      if (jr.contains("hidden_states")) {
        require_arg(op, rname + ".hidden_states", jr["hidden_states"].dump(), jr["hidden_states"].is_string(),
                    "must name a .npy file in the directory");
        require_arg(op, "hidden", t.hidden, t.hidden > 0, "must be > 0 when ranks carry hidden_states");
        tr.hidden_states = from_npy(op, rname + ".hidden_states", (root / jr["hidden_states"].get<std::string>()).string(), T, t.hidden, DType::bf16);
      }
      step.ranks.push_back(std::move(tr));
    }
    t.steps.push_back(std::move(step));
  }
  t.validate(dir);
  return t;
}

void save_trace_dir(const Trace& t, const std::string& dir) {
  t.validate();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  require_arg("trace.save", "path", dir, std::filesystem::is_directory(dir, ec), "must be a directory we can create");
  const std::filesystem::path root(dir);
  json steps = json::array();
  for (size_t s = 0; s < t.steps.size(); ++s) {
    json ranks = json::array();
    for (size_t r = 0; r < t.steps[s].ranks.size(); ++r) {
      const TraceRank& tr = t.steps[s].ranks[r];
      json jr = {{"num_tokens", tr.num_tokens()}, {"topk_idx", file_name(s, r, "topk_idx")}, {"topk_weights", file_name(s, r, "topk_weights")}};
      write_npy((root / file_name(s, r, "topk_idx")).string(), to_npy(tr.topk_idx, "<i4"));
      write_npy((root / file_name(s, r, "topk_weights")).string(), to_npy(tr.topk_weights, "<f4"));
      if (t.hidden > 0) {
        jr["hidden_states"] = file_name(s, r, "hidden_states");
        write_npy((root / file_name(s, r, "hidden_states")).string(), to_npy(tr.hidden_states, "<u2"));
      }
      ranks.push_back(std::move(jr));
    }
    steps.push_back({{"ranks", std::move(ranks)}});
  }
  json m = {{"format", "epx-trace"}, {"version", 1}, {"layout", "npy-dir"}, {"num_ranks", t.num_ranks},
            {"num_experts", t.num_experts}, {"top_k", t.top_k}, {"hidden", t.hidden}, {"source", t.source}, {"steps", std::move(steps)}};
  std::ofstream f(root / "manifest.json", std::ios::trunc);
  require_arg("trace.save", "path", (root / "manifest.json").string(), f.good(), "must be writable");
  f << m.dump(1) << "\n";
}

}  // namespace detail
}  // namespace epx
