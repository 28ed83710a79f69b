// libFuzzer target: any byte string is a valid safetensors file or a twell::Error, never a crash.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "twell/error.h"
#include "twell/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> image(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
  try {
    twell::SafetensorsFile file = twell::SafetensorsFile::from_bytes(std::move(image), "fuzz");
    for (const auto& [name, tensor] : file.tensors()) {
      if (tensor.dtype == twell::Dtype::F32 || tensor.dtype == twell::Dtype::F16 || tensor.dtype == twell::Dtype::BF16)
        twell::to_float_vector(tensor);  // reads every byte of the range: out-of-file ranges would trip ASan
    }
  } catch (const twell::Error&) {
  }
  return 0;
}
