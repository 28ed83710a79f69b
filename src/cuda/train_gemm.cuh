// Row-major bf16 GEMMs through cuBLASLt (fp32 accumulation), for the training FFN's dense parts:
// the backup rows of the hybrid format and the whole dense path.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "cuda/cuda_utils.h"
#include "twell/bf16.h"

namespace twell::cuda {

enum class GemmOutput { bf16, f32 };

// One operand in row-major storage: `transposed` = false means the stored matrix is op(X) itself
// ([rows of op, cols of op]); true means it is stored as op(X)^T. `ld` counts elements per stored row.
struct GemmOperand {
  const bf16* data;
  int64_t ld;
  bool transposed;
};

class RowMajorGemm {
 public:
  RowMajorGemm();
  ~RowMajorGemm();
  RowMajorGemm(const RowMajorGemm&) = delete;
  RowMajorGemm& operator=(const RowMajorGemm&) = delete;

  // C [m, n] (row-major, ldc) = op(A) [m, k] · op(B) [k, n] + beta · C. beta = 0 ignores C's contents.
  void run(int64_t m, int64_t n, int64_t k, GemmOperand a, GemmOperand b, void* c, int64_t ldc,
           GemmOutput c_type, float beta, cudaStream_t stream);

  int64_t workspace_bytes() const { return static_cast<int64_t>(workspace_.bytes()); }

 private:
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, int, bool>;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer<uint8_t> workspace_;
  std::map<Key, cublasLtMatmulAlgo_t> algorithms_;
};

}  // namespace twell::cuda
