// The one cuBLASLt wrapper of twell: row-major bf16 GEMMs with fp32 accumulation, used by the
// dense FFN baseline, the training FFN's dense parts and the model runtime's projections and
// attention. Each shape's descriptors and algorithm are planned once and reused, so a call costs
// only the cublasLtMatmul launch (and can be captured in a CUDA graph once planned).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <tuple>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "cuda/cuda_utils.h"
#include "twell/bf16.h"

namespace twell::cuda {

enum class GemmOutput { bf16, f32 };
enum class GemmEpilogue { none, relu };

// One operand in row-major storage: `transposed` = false means the stored matrix is op(X) itself
// ([rows of op, cols of op]); true means it is stored as op(X)^T. `ld` counts elements per stored row.
struct GemmOperand {
  const bf16* data;
  int64_t ld;
  bool transposed;
};

// `count` independent GEMMs of one shape; operand i starts `stride_*` elements after operand i-1.
struct GemmBatch {
  int32_t count = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

class RowMajorGemm {
 public:
  // cuBLASLt may use up to workspace_bytes of device memory per call (split-K partials and the like).
  static constexpr size_t kDefaultWorkspaceBytes = 32u << 20;
  explicit RowMajorGemm(size_t workspace_bytes = kDefaultWorkspaceBytes);
  ~RowMajorGemm();
  RowMajorGemm(const RowMajorGemm&) = delete;
  RowMajorGemm& operator=(const RowMajorGemm&) = delete;

  // C [m, n] (row-major, ldc) = epilogue(op(A) [m, k] · op(B) [k, n] + beta · C), per batch entry.
  // beta = 0 ignores C's contents.
  void run(int64_t m, int64_t n, int64_t k, GemmOperand a, GemmOperand b, void* c, int64_t ldc, GemmOutput c_type,
           float beta, cudaStream_t stream, GemmEpilogue epilogue = GemmEpilogue::none, const GemmBatch& batch = {});

  int64_t workspace_bytes() const { return static_cast<int64_t>(workspace_.bytes()); }

  // While one lives, the instance plans new shapes with the heuristic's first choice, untimed: for
  // shapes that change from call to call (a training step's count of backup rows), where timing
  // each new one would cost more than it saves.
  class HeuristicOnly {
   public:
    explicit HeuristicOnly(RowMajorGemm& gemm) : gemm_(gemm), was_tuning_(gemm.tuning_) { gemm.tuning_ = false; }
    ~HeuristicOnly() { gemm_.tuning_ = was_tuning_; }
    HeuristicOnly(const HeuristicOnly&) = delete;
    HeuristicOnly& operator=(const HeuristicOnly&) = delete;

   private:
    RowMajorGemm& gemm_;
    bool was_tuning_;
  };

 private:
  struct Plan;
  // The last member: the operands' alignments (bytes, up to 256) packed, since cuBLASLt's heuristic
  // otherwise assumes 256-byte aligned matrices and may pick a kernel that faults on others.
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, GemmOutput, bool,
                         GemmEpilogue, int32_t, int64_t, int64_t, int64_t, uint32_t>;
  // The fastest of `results` for `plan` on these operands; none while `stream` is being captured or
  // where beta != 0 and no scratch C fits in memory.
  std::optional<cublasLtMatmulAlgo_t> fastest(const Plan& plan, const cublasLtMatmulHeuristicResult_t* results,
                                              int count, const void* a, const void* b, void* c, float beta,
                                              size_t c_bytes, cudaStream_t stream);
  bool tuning_ = true;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer<uint8_t> workspace_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace twell::cuda
