// Safetensors reader: see include/twell/safetensors.h for the rules checked here.
#include "twell/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <stack>

#include <nlohmann/json.hpp>

#include "twell/bf16.h"
#include "twell/error.h"
#include "model/half.h"

namespace twell {

namespace {

struct DtypeInfo {
  Dtype dtype;
  const char* name;
  int64_t size;
};
constexpr DtypeInfo kDtypes[] = {
    {Dtype::BOOL, "BOOL", 1}, {Dtype::U8, "U8", 1},     {Dtype::I8, "I8", 1},   {Dtype::I16, "I16", 2},
    {Dtype::U16, "U16", 2},   {Dtype::F16, "F16", 2},   {Dtype::BF16, "BF16", 2}, {Dtype::I32, "I32", 4},
    {Dtype::U32, "U32", 4},   {Dtype::F32, "F32", 4},   {Dtype::F64, "F64", 8}, {Dtype::I64, "I64", 8},
    {Dtype::U64, "U64", 8},
};

const DtypeInfo& info(Dtype dtype) {
  for (const DtypeInfo& entry : kDtypes)
    if (entry.dtype == dtype) return entry;
  fail("unknown Dtype value {}", static_cast<int>(dtype));
}

}  // namespace

int64_t dtype_size(Dtype dtype) { return info(dtype).size; }
std::string to_string(Dtype dtype) { return info(dtype).name; }

Dtype dtype_from_name(const std::string& name) {
  for (const DtypeInfo& entry : kDtypes)
    if (name == entry.name) return entry.dtype;
  fail("unknown dtype '{}' (expected one of BOOL U8 I8 I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64)", name);
}

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  return count;
}

void copy_as_float(const TensorView& tensor, float* out) {
  const int64_t count = tensor.numel();
  switch (tensor.dtype) {
    case Dtype::F32:
      std::memcpy(out, tensor.data, static_cast<size_t>(count) * sizeof(float));
      return;
    case Dtype::BF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, tensor.data + 2 * i, 2);
        out[i] = bf16_to_float(bits);
      }
      return;
    case Dtype::F16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, tensor.data + 2 * i, 2);
        out[i] = half_bits_to_float(bits);
      }
      return;
    default:
      fail("tensor '{}' has dtype {}; expected F32, F16 or BF16", tensor.name, to_string(tensor.dtype));
  }
}

std::vector<float> to_float_vector(const TensorView& tensor) {
  std::vector<float> values(static_cast<size_t>(tensor.numel()));
  copy_as_float(tensor, values.data());
  return values;
}

// The bytes of one file: a read-only memory mapping, or an owned vector.
struct SafetensorsFile::Storage {
  const std::byte* data = nullptr;
  size_t size = 0;
  void* mapping = nullptr;
  std::vector<std::byte> owned;

  ~Storage() {
    if (mapping != nullptr) munmap(mapping, size);
  }
};

SafetensorsFile::SafetensorsFile(std::shared_ptr<const Storage> storage, std::string label)
    : storage_(std::move(storage)), label_(std::move(label)) {
  parse();
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TWELL_REQUIRE(fd >= 0, "cannot open safetensors file '{}': {}", path, std::strerror(errno));
  struct stat file_stat {};
  if (fstat(fd, &file_stat) != 0) {
    ::close(fd);
    fail("cannot stat '{}': {}", path, std::strerror(errno));
  }
  auto storage = std::make_shared<Storage>();
  storage->size = static_cast<size_t>(file_stat.st_size);
  if (storage->size > 0) {
    void* mapping = mmap(nullptr, storage->size, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    TWELL_REQUIRE(mapping != MAP_FAILED, "cannot memory-map '{}': {}", path, std::strerror(errno));
    storage->mapping = mapping;
    storage->data = static_cast<const std::byte*>(mapping);
  } else {
    ::close(fd);
  }
  return SafetensorsFile(std::move(storage), path);
}

SafetensorsFile SafetensorsFile::from_bytes(std::vector<std::byte> image, const std::string& label) {
  auto storage = std::make_shared<Storage>();
  storage->owned = std::move(image);
  storage->data = storage->owned.data();
  storage->size = storage->owned.size();
  return SafetensorsFile(std::move(storage), label);
}

namespace {

// nlohmann::json keeps the last of duplicate keys silently; the specification's JSON has none, so
// the parse callback records the first duplicate of any object.
nlohmann::json parse_json_refusing_duplicates(const char* begin, const char* end, const std::string& label) {
  std::stack<std::set<std::string>> keys_per_object;
  std::string duplicate;
  auto callback = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) keys_per_object.emplace();
    if (event == Event::object_end && !keys_per_object.empty()) keys_per_object.pop();
    if (event == Event::key && !keys_per_object.empty()) {
      const std::string key = parsed.get<std::string>();
      if (!keys_per_object.top().insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(begin, end, callback);
  } catch (const nlohmann::json::exception& error) {
    fail("{}: the header is not valid JSON: {}", label, error.what());
  }
  TWELL_REQUIRE(duplicate.empty(), "{}: the header has the key '{}' twice", label, duplicate);
  return header;
}

uint64_t read_u64_le(const std::byte* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(bytes[i]);
  return value;
}

}  // namespace

void SafetensorsFile::parse() {
  const std::byte* file = storage_->data;
  const uint64_t file_size = storage_->size;
  TWELL_REQUIRE(file_size >= 8, "{}: file is {} bytes, shorter than the 8-byte header length", label_, file_size);
  const uint64_t header_bytes = read_u64_le(file);
  TWELL_REQUIRE(header_bytes <= kMaxHeaderBytes, "{}: header length {} exceeds the limit {}", label_, header_bytes,
                kMaxHeaderBytes);
  TWELL_REQUIRE(header_bytes <= file_size - 8, "{}: header length {} exceeds the {} bytes after the length field",
                label_, header_bytes, file_size - 8);
  const char* header_begin = reinterpret_cast<const char*>(file + 8);
  TWELL_REQUIRE(header_bytes > 0 && header_begin[0] == '{', "{}: the header must start with '{{'", label_);
  const nlohmann::json header = parse_json_refusing_duplicates(header_begin, header_begin + header_bytes, label_);
  TWELL_REQUIRE(header.is_object(), "{}: the header must be a JSON object", label_);

  const std::byte* buffer = file + 8 + header_bytes;
  const uint64_t buffer_size = file_size - 8 - header_bytes;
  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      TWELL_REQUIRE(entry.is_object(), "{}: __metadata__ must be an object of strings", label_);
      for (const auto& [key, value] : entry.items()) {
        TWELL_REQUIRE(value.is_string(), "{}: __metadata__ value of '{}' must be a string, got {}", label_, key,
                      value.type_name());
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    TWELL_REQUIRE(entry.is_object(), "{}: tensor '{}': entry must be an object, got {}", label_, name,
                  entry.type_name());
    for (const auto& [key, value] : entry.items())
      TWELL_REQUIRE(key == "dtype" || key == "shape" || key == "data_offsets",
                    "{}: tensor '{}': unknown key '{}' (expected dtype, shape, data_offsets)", label_, name, key);
    TWELL_REQUIRE(entry.contains("dtype") && entry["dtype"].is_string(), "{}: tensor '{}': missing string 'dtype'",
                  label_, name);
    TWELL_REQUIRE(entry.contains("shape") && entry["shape"].is_array(), "{}: tensor '{}': missing array 'shape'",
                  label_, name);
    TWELL_REQUIRE(entry.contains("data_offsets") && entry["data_offsets"].is_array() &&
                      entry["data_offsets"].size() == 2,
                  "{}: tensor '{}': 'data_offsets' must be an array [begin, end]", label_, name);

    TensorView view;
    view.name = name;
    try {
      view.dtype = dtype_from_name(entry["dtype"].get<std::string>());
    } catch (const Error& error) {
      fail("{}: tensor '{}': {}", label_, name, error.what());
    }
    int64_t numel = 1;
    for (const nlohmann::json& extent : entry["shape"]) {
      TWELL_REQUIRE(extent.is_number_unsigned() && extent.get<uint64_t>() <= uint64_t{1} << 62,
                    "{}: tensor '{}': shape entries must be non-negative integers, got {}", label_, name,
                    extent.dump());
      const int64_t value = static_cast<int64_t>(extent.get<uint64_t>());
      view.shape.push_back(value);
      TWELL_REQUIRE(!__builtin_mul_overflow(numel, value, &numel), "{}: tensor '{}': element count overflows",
                    label_, name);
    }
    int64_t expected_bytes = 0;
    TWELL_REQUIRE(!__builtin_mul_overflow(numel, dtype_size(view.dtype), &expected_bytes),
                  "{}: tensor '{}': byte size overflows", label_, name);
    const nlohmann::json& offsets = entry["data_offsets"];
    TWELL_REQUIRE(offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned(),
                  "{}: tensor '{}': data_offsets must be non-negative integers, got {}", label_, name,
                  offsets.dump());
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    TWELL_REQUIRE(begin <= end, "{}: tensor '{}': data_offsets [{}, {}] end before begin", label_, name, begin, end);
    TWELL_REQUIRE(end <= buffer_size, "{}: tensor '{}': data_offsets [{}, {}] reach past the {}-byte data buffer",
                  label_, name, begin, end, buffer_size);
    TWELL_REQUIRE(end - begin == static_cast<uint64_t>(expected_bytes),
                  "{}: tensor '{}': shape {} of {} needs {} bytes, data_offsets [{}, {}] hold {}", label_, name,
                  entry["shape"].dump(), to_string(view.dtype), expected_bytes, begin, end, end - begin);
    view.data = buffer + begin;
    view.bytes = expected_bytes;
    auto [where, inserted] = tensors_.emplace(name, std::move(view));
    ranges.push_back({begin, end, &where->first});
  }

  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  uint64_t covered = 0;
  for (const Range& range : ranges) {
    TWELL_REQUIRE(range.begin >= covered, "{}: tensor '{}': data_offsets [{}, {}] overlap the previous tensor (ends at {})",
                  label_, *range.name, range.begin, range.end, covered);
    TWELL_REQUIRE(range.begin == covered, "{}: tensor '{}': data_offsets [{}, {}] leave a hole after byte {}", label_,
                  *range.name, range.begin, range.end, covered);
    covered = range.end;
  }
  TWELL_REQUIRE(covered == buffer_size, "{}: the data buffer has {} bytes but the tensors cover only {}", label_,
                buffer_size, covered);
}

const TensorView& SafetensorsFile::get(const std::string& name) const {
  auto found = tensors_.find(name);
  TWELL_REQUIRE(found != tensors_.end(), "{}: no tensor named '{}'", label_, name);
  return found->second;
}

Checkpoint Checkpoint::open_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  Checkpoint checkpoint;
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index_path)) {
    std::ifstream stream(index_path);
    TWELL_REQUIRE(stream.good(), "cannot read '{}'", index_path.string());
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(stream);
    } catch (const nlohmann::json::exception& error) {
      fail("{}: not valid JSON: {}", index_path.string(), error.what());
    }
    TWELL_REQUIRE(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
                  "{}: expected an object with a 'weight_map' object", index_path.string());
    std::map<std::string, size_t> shard_index;  // file name -> index into shards_
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      TWELL_REQUIRE(file.is_string(), "{}: weight_map['{}'] must be a file name", index_path.string(), tensor);
      const std::string file_name = file.get<std::string>();
      TWELL_REQUIRE(fs::path(file_name).filename().string() == file_name && file_name != ".." && file_name != ".",
                    "{}: weight_map['{}'] = '{}' must be a plain file name in the directory", index_path.string(),
                    tensor, file_name);
      auto [where, inserted] = shard_index.emplace(file_name, checkpoint.shards_.size());
      if (inserted) checkpoint.shards_.push_back(SafetensorsFile::open((fs::path(dir) / file_name).string()));
      const SafetensorsFile& shard = checkpoint.shards_[where->second];
      TWELL_REQUIRE(shard.contains(tensor), "{}: tensor '{}' is mapped to '{}', which does not contain it",
                    index_path.string(), tensor, file_name);
      checkpoint.shard_of_[tensor] = where->second;
    }
  } else {
    TWELL_REQUIRE(fs::exists(single), "checkpoint directory '{}' has neither model.safetensors nor "
                  "model.safetensors.index.json", dir);
    checkpoint.shards_.push_back(SafetensorsFile::open(single.string()));
    for (const auto& [name, view] : checkpoint.shards_[0].tensors()) checkpoint.shard_of_[name] = 0;
  }
  return checkpoint;
}

const TensorView& Checkpoint::get(const std::string& name) const {
  auto found = shard_of_.find(name);
  TWELL_REQUIRE(found != shard_of_.end(), "checkpoint has no tensor named '{}'", name);
  return shards_[found->second].get(name);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> result;
  for (const auto& [name, shard] : shard_of_) result.push_back(name);
  return result;
}

}  // namespace twell
