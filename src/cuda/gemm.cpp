#include "cuda/gemm.h"

#include "cuda/cublas_check.h"
#include "twell/error.h"

namespace twell::cuda {

// The descriptors and algorithm of one (shape, layout, epilogue, batch).
struct RowMajorGemm::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

RowMajorGemm::RowMajorGemm(size_t workspace_bytes) {
  TWELL_CUBLAS_CHECK(cublasLtCreate(&handle_));
  workspace_.resize(workspace_bytes);
}

RowMajorGemm::~RowMajorGemm() {
  plans_.clear();
  if (handle_) cublasLtDestroy(handle_);
}

namespace {

void set_batch(cublasLtMatrixLayout_t layout, int32_t count, int64_t stride) {
  if (count == 1) return;
  TWELL_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
  TWELL_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
}

}  // namespace

// cuBLASLt is column-major. A row-major C [m, n] is a column-major C^T [n, m], and
// C^T = op(B)^T · op(A)^T, so B goes first. A row-major stored matrix [r, c] is a column-major
// [c, r] with the same ld: an operand stored as op(X) itself is read untransposed as op(X)^T.
void RowMajorGemm::run(int64_t m, int64_t n, int64_t k, GemmOperand a, GemmOperand b, void* c, int64_t ldc,
                       GemmOutput c_type, float beta, cudaStream_t stream, GemmEpilogue epilogue,
                       const GemmBatch& batch) {
  TWELL_REQUIRE(m > 0 && n > 0 && k > 0, "GEMM sizes must be positive, got m={} n={} k={}", m, n, k);
  TWELL_REQUIRE(batch.count >= 1, "GEMM batch count must be >= 1, got {}", batch.count);
  const Key key{m, n, k, a.ld, b.ld, ldc, a.transposed, b.transposed, c_type, beta != 0.0f,
                epilogue, batch.count, batch.stride_a, batch.stride_b, batch.stride_c};
  auto found = plans_.find(key);
  if (found == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    TWELL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_first = b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;   // B^T: stored [n, k] when transposed
    const cublasOperation_t op_second = a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;  // A^T
    TWELL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof op_first));
    TWELL_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof op_second));
    const cublasLtEpilogue_t lt_epilogue =
        epilogue == GemmEpilogue::relu ? CUBLASLT_EPILOGUE_RELU : CUBLASLT_EPILOGUE_DEFAULT;
    TWELL_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &lt_epilogue, sizeof lt_epilogue));
    // Column-major shapes of the stored matrices.
    // B stored row-major [k, n] (or [n, k] when transposed) = column-major [n, k] (or [k, n]).
    TWELL_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, b.transposed ? k : n, b.transposed ? n : k, b.ld));
    // A stored row-major [m, k] (or [k, m]) = column-major [k, m] (or [m, k]).
    TWELL_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, a.transposed ? m : k, a.transposed ? k : m, a.ld));
    const cudaDataType_t out_type = c_type == GemmOutput::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    TWELL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, out_type, n, m, ldc));
    set_batch(plan->a, batch.count, batch.stride_b);
    set_batch(plan->b, batch.count, batch.stride_a);
    set_batch(plan->c, batch.count, batch.stride_c);

    cublasLtMatmulPreference_t preference = nullptr;
    TWELL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const size_t workspace = workspace_.bytes();
    cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                         sizeof workspace);
    cublasLtMatmulHeuristicResult_t result{};
    int found_count = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, plan->op, plan->a, plan->b, plan->c,
                                                                 plan->c, preference, 1, &result, &found_count);
    cublasLtMatmulPreferenceDestroy(preference);
    TWELL_CUBLAS_CHECK(status);
    TWELL_REQUIRE(found_count > 0, "cuBLASLt has no algorithm for a {}x{}x{} bf16 GEMM (batch {})", m, n, k,
                  batch.count);
    plan->algo = result.algo;
    found = plans_.emplace(key, std::move(plan)).first;
  }
  const Plan& plan = *found->second;
  const float alpha = 1.0f;
  TWELL_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.op, &alpha, b.data, plan.a, a.data, plan.b, &beta, c, plan.c, c,
                                    plan.c, &plan.algo, workspace_.data(), workspace_.bytes(), stream));
}

}  // namespace twell::cuda
