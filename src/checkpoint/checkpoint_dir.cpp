// checkpoint/checkpoint_dir.cpp: a checkpoint directory (config.json + one or many safetensors
// files, the latter through model.safetensors.index.json as transformers' save_pretrained writes it:
// {"metadata": {"total_size": ...}, "weight_map": {"<tensor>": "<file>", ...}}).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "epx/checkpoint.h"
#include "epx/error.h"

namespace epx {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
constexpr std::string_view kOp = "checkpoint";

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw InvalidArgument(arg_message(kOp, "file", p.string(), "cannot be read"));
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}
}  // namespace

struct Checkpoint::Impl {
  std::string dir;
  std::string config_text;
  std::string index_path;                       // "" without an index
  std::map<std::string, std::string> weight_map;  // tensor -> file name (relative to dir)
  std::vector<std::string> files;               // every file name
  mutable std::mutex mu;
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> opened;

  const SafetensorsFile& file(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mu);
    auto it = opened.find(name);
    if (it != opened.end()) return *it->second;
    auto f = std::make_unique<SafetensorsFile>(SafetensorsFile::open((fs::path(dir) / name).string()));
    return *opened.emplace(name, std::move(f)).first->second;
  }
  std::string source() const {
    return index_path.empty() ? "checkpoint " + dir : "checkpoint " + dir + " (index " + fs::path(index_path).filename().string() + ")";
  }
};

Checkpoint::Checkpoint() : impl_(std::make_unique<Impl>()) {}
Checkpoint::~Checkpoint() = default;

std::shared_ptr<Checkpoint> Checkpoint::open(const std::string& dir) {
  std::shared_ptr<Checkpoint> c(new Checkpoint());
  Impl& m = *c->impl_;
  m.dir = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw InvalidArgument(arg_message(kOp, "dir", dir, "must be a directory holding a checkpoint"));
  const fs::path root(dir);
  if (fs::exists(root / "config.json")) {
    m.config_text = read_text(root / "config.json");
    try {
      const json parsed = json::parse(m.config_text);
      (void)parsed;
    } catch (const json::exception& e) {
      throw InvalidArgument(arg_message(kOp, (root / "config.json").string(), "(text)", std::string("must be valid JSON: ") + e.what()));
    }
  }
  const fs::path index = root / "model.safetensors.index.json";
  if (fs::exists(index)) {
    m.index_path = index.string();
    json j;
    try {
      j = json::parse(read_text(index));
    } catch (const json::exception& e) {
      throw InvalidArgument(arg_message(kOp, index.string(), "(text)", std::string("must be valid JSON: ") + e.what()));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw InvalidArgument(arg_message(kOp, index.string() + " weight_map", j.is_object() && j.contains("weight_map") ? j["weight_map"].type_name() : "missing",
                                        "must be an object {tensor: file}"));
    std::vector<std::string> files;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        throw InvalidArgument(arg_message(kOp, index.string() + " weight_map[\"" + it.key() + "\"]", it.value().dump(), "must be a file name"));
      const std::string file = it.value().get<std::string>();
      // A file name, never a path: an index must not reach outside the checkpoint directory.
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        throw InvalidArgument(arg_message(kOp, index.string() + " weight_map[\"" + it.key() + "\"]", file,
                                          "must be a file name inside the checkpoint directory"));
      m.weight_map[it.key()] = file;
      files.push_back(file);
    }
    std::sort(files.begin(), files.end());
    files.erase(std::unique(files.begin(), files.end()), files.end());
    m.files = files;
  } else if (fs::exists(root / "model.safetensors")) {
    m.files = {"model.safetensors"};
  } else {
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_regular_file() && e.path().extension() == ".safetensors") m.files.push_back(e.path().filename().string());
    std::sort(m.files.begin(), m.files.end());
  }
  if (m.files.empty())
    throw InvalidArgument(arg_message(kOp, "dir", dir, "holds no model.safetensors.index.json, model.safetensors or *.safetensors file"));
  if (m.index_path.empty()) {
    // Without an index every file's header is read now (cheap: headers only, data stays unmapped
    // until read); a tensor in two files is ambiguous.
    for (const std::string& f : m.files)
      for (const std::string& n : m.file(f).names()) {
        auto [it, fresh] = m.weight_map.emplace(n, f);
        if (!fresh)
          throw InvalidArgument(arg_message(kOp, "tensor", "\"" + n + "\"", "is in both " + it->second + " and " + f + " of " + dir));
      }
  }
  return c;
}

const std::string& Checkpoint::dir() const { return impl_->dir; }
const std::string& Checkpoint::config_json() const { return impl_->config_text; }

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> v;
  for (const auto& kv : impl_->weight_map) v.push_back(kv.first);
  return v;
}

bool Checkpoint::contains(const std::string& name) const { return impl_->weight_map.count(name) > 0; }

std::string Checkpoint::file_of(const std::string& name) const {
  auto it = impl_->weight_map.find(name);
  if (it == impl_->weight_map.end())
    throw InvalidArgument(arg_message("checkpoint.read", "tensor", "\"" + name + "\"", "not in " + impl_->source()));
  const std::string path = (fs::path(impl_->dir) / it->second).string();
  if (!impl_->index_path.empty()) {
    std::error_code ec;
    if (!fs::exists(path, ec))
      throw InvalidArgument(arg_message("checkpoint.read", "tensor", "\"" + name + "\"",
                                        "is mapped by " + impl_->index_path + " to " + path + ", which does not exist"));
    const SafetensorsFile& f = impl_->file(it->second);
    if (!f.contains(name))
      throw InvalidArgument(arg_message("checkpoint.read", "tensor", "\"" + name + "\"",
                                        "is mapped by " + impl_->index_path + " to " + path + ", which does not hold it"));
  }
  return path;
}

const SafetensorsTensorInfo& Checkpoint::info(const std::string& name) const {
  (void)file_of(name);
  return impl_->file(impl_->weight_map.at(name)).info(name);
}

std::span<const uint8_t> Checkpoint::bytes(const std::string& name) const {
  (void)file_of(name);
  return impl_->file(impl_->weight_map.at(name)).bytes(name);
}

Tensor Checkpoint::read(const std::string& name) const {
  (void)file_of(name);
  return impl_->file(impl_->weight_map.at(name)).read(name);
}

}  // namespace epx
