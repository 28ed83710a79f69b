#include "cuda/train_gemm.cuh"

#include "twell/error.h"
#include "cuda/cublas_check.h"

namespace twell::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

// Owns the four cuBLASLt descriptors of one call.
struct MatmulDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~MatmulDescriptors() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

RowMajorGemm::RowMajorGemm() {
  TWELL_CUBLAS_CHECK(cublasLtCreate(&handle_));
  workspace_.resize(kWorkspaceBytes);
}

RowMajorGemm::~RowMajorGemm() {
  if (handle_) cublasLtDestroy(handle_);
}

// cuBLASLt is column-major. A row-major C [m, n] is a column-major C^T [n, m], and
// C^T = op(B)^T · op(A)^T, so B goes first. A row-major stored matrix [r, c] is a column-major
// [c, r] with the same ld: an operand stored as op(X) itself is read untransposed as op(X)^T.
void RowMajorGemm::run(int64_t m, int64_t n, int64_t k, GemmOperand a, GemmOperand b, void* c, int64_t ldc,
                       GemmOutput c_type, float beta, cudaStream_t stream) {
  TWELL_REQUIRE(m > 0 && n > 0 && k > 0, "GEMM sizes must be positive, got m={} n={} k={}", m, n, k);
  MatmulDescriptors d;
  TWELL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;   // B^T: stored [n, k] when transposed
  const cublasOperation_t op_second = a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;  // A^T
  TWELL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof op_first));
  TWELL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof op_second));
  // Column-major shapes of the stored matrices.
  // B stored row-major [k, n] (or [n, k] when transposed) = column-major [n, k] (or [k, n]).
  TWELL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_16BF, b.transposed ? k : n, b.transposed ? n : k, b.ld));
  // A stored row-major [m, k] (or [k, m]) = column-major [k, m] (or [m, k]).
  TWELL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_16BF, a.transposed ? m : k, a.transposed ? k : m, a.ld));
  const cudaDataType_t out_type = c_type == GemmOutput::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  TWELL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, out_type, n, m, ldc));

  const Key key{m, n, k, a.ld, b.ld, ldc, a.transposed, b.transposed, static_cast<int>(c_type), beta != 0.0f};
  auto found = algorithms_.find(key);
  if (found == algorithms_.end()) {
    cublasLtMatmulPreference_t preference = nullptr;
    TWELL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const size_t workspace = workspace_.bytes();
    cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                         sizeof workspace);
    cublasLtMatmulHeuristicResult_t result{};
    int found_count = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle_, d.op, d.a, d.b, d.c, d.c, preference, 1, &result, &found_count);
    cublasLtMatmulPreferenceDestroy(preference);
    TWELL_CUBLAS_CHECK(status);
    TWELL_REQUIRE(found_count > 0, "cuBLASLt has no algorithm for a {}x{}x{} bf16 GEMM", m, n, k);
    found = algorithms_.emplace(key, result.algo).first;
  }
  const float alpha = 1.0f;
  TWELL_CUBLAS_CHECK(cublasLtMatmul(handle_, d.op, &alpha, b.data, d.a, a.data, d.b, &beta, c, d.c, c, d.c,
                                    &found->second, workspace_.data(), workspace_.bytes(), stream));
}

}  // namespace twell::cuda
