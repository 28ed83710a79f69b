// Safetensors reader, strict to the format's specification (github.com/huggingface/safetensors):
//   bytes [0, 8)        N, little-endian u64, the header length
//   bytes [8, 8+N)      UTF-8 JSON object: name -> {"dtype", "shape", "data_offsets": [begin, end]},
//                       plus an optional "__metadata__": {string: string}; may end in spaces
//   bytes [8+N, EOF)    the data buffer; offsets are relative to its start
// Checked here: N <= 100 MB and N <= file size - 8, the header is a JSON object that starts with '{',
// no duplicate names, dtype is a known name, every shape dimension >= 0, element count × dtype size
// == end - begin, begin <= end <= buffer size, and the ranges tile the buffer exactly (sorted by
// begin: no overlap, no hole, nothing after the last one), as the specification requires.
// Every violation throws twell::Error naming the file and the tensor.
// Files are memory-mapped; tensors are views into the mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace twell {

enum class Dtype { BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64 };
int64_t dtype_size(Dtype dtype);  // bytes per element
std::string to_string(Dtype dtype);
// Throws twell::Error for a name not in the specification's list.
Dtype dtype_from_name(const std::string& name);

struct TensorView {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // not aligned in general
  int64_t bytes = 0;

  int64_t numel() const;
};

// Converts F32, F16 or BF16 elements to fp32; any other dtype throws naming the tensor.
// `out` holds numel() floats.
void copy_as_float(const TensorView& tensor, float* out);
std::vector<float> to_float_vector(const TensorView& tensor);

class SafetensorsFile {
 public:
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;

  // Memory-maps `path` and validates it.
  static SafetensorsFile open(const std::string& path);
  // Validates an in-memory image (used by the fuzzer and the tests); `label` names it in errors.
  static SafetensorsFile from_bytes(std::vector<std::byte> image, const std::string& label);

  const std::string& label() const { return label_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws naming the tensor and the file when absent.
  const TensorView& get(const std::string& name) const;
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Storage;
  SafetensorsFile(std::shared_ptr<const Storage> storage, std::string label);
  void parse();

  std::shared_ptr<const Storage> storage_;
  std::string label_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: model.safetensors, or the shards named by model.safetensors.index.json
// ({"weight_map": {tensor: shard file}}). The index must name only files inside the directory, and
// each tensor must live in the shard the index says.
class Checkpoint {
 public:
  static Checkpoint open_dir(const std::string& dir);

  bool contains(const std::string& name) const { return shard_of_.count(name) != 0; }
  const TensorView& get(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, size_t> shard_of_;  // tensor name -> index into shards_
};

}  // namespace twell
