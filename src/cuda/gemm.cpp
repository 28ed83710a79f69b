#include "cuda/gemm.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>

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

// GEMMs of at least this many flops time cuBLASLt's first kCandidates algorithms on their first
// call and keep the fastest: on the H200 the tuned choices made the training step 2-6% faster, the
// dense one and the split alike (docs/perf-notes.md), and a few ms once per shape is nothing against
// the calls that follow. Smaller GEMMs (decode, most tests) take the heuristic's first choice.
constexpr double kTunedFlops = 8e9;
constexpr int kCandidates = 8;
constexpr int kTimedRuns = 5;

// The events around the timed runs of one candidate, released however the timing ends.
struct TimingMarks {
  cudaEvent_t events[kTimedRuns + 1] = {};
  TimingMarks() {
    for (cudaEvent_t& event : events) TWELL_CUDA_CHECK(cudaEventCreate(&event));
  }
  ~TimingMarks() {
    for (cudaEvent_t event : events)
      if (event) cudaEventDestroy(event);
  }
  TimingMarks(const TimingMarks&) = delete;
  TimingMarks& operator=(const TimingMarks&) = delete;
};

void set_batch(cublasLtMatrixLayout_t layout, int32_t count, int64_t stride) {
  if (count == 1) return;
  TWELL_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
  TWELL_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
}

// The largest power of two up to 256 that divides the address of every batch entry of a matrix.
uint32_t alignment_bytes(const void* data, int64_t stride_elements, size_t element_bytes) {
  const auto bits = reinterpret_cast<std::uintptr_t>(data) | static_cast<std::uintptr_t>(stride_elements) * element_bytes |
                    std::uintptr_t{256};
  return static_cast<uint32_t>(bits & (~bits + 1));
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
  const size_t c_element_bytes = c_type == GemmOutput::bf16 ? 2 : 4;
  const uint32_t align_a = alignment_bytes(a.data, batch.stride_a, sizeof(bf16));
  const uint32_t align_b = alignment_bytes(b.data, batch.stride_b, sizeof(bf16));
  const uint32_t align_c = alignment_bytes(c, batch.stride_c, c_element_bytes);
  const Key key{m, n, k, a.ld, b.ld, ldc, a.transposed, b.transposed, c_type, beta != 0.0f,
                epilogue, batch.count, batch.stride_a, batch.stride_b, batch.stride_c,
                align_a | align_b << 9 | align_c << 18};
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
    // cuBLASLt's A is our B (see above), its B our A; C and D are both our C.
    for (const auto& [attribute, bytes] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b},
                                           std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a},
                                           std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
                                           std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c}})
      TWELL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof bytes));
    cublasLtMatmulHeuristicResult_t results[kCandidates]{};
    int found_count = 0;
    const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) * batch.count;
    const int wanted = tuning_ && flops >= kTunedFlops ? kCandidates : 1;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle_, plan->op, plan->a, plan->b, plan->c, plan->c, preference, wanted, results, &found_count);
    cublasLtMatmulPreferenceDestroy(preference);
    TWELL_CUBLAS_CHECK(status);
    TWELL_REQUIRE(found_count > 0, "cuBLASLt has no algorithm for a {}x{}x{} bf16 GEMM (batch {})", m, n, k,
                  batch.count);
    plan->algo = results[0].algo;
    if (found_count > 1) {
      const int64_t c_elements = int64_t{batch.count - 1} * batch.stride_c + (m - 1) * ldc + n;
      const size_t c_bytes = static_cast<size_t>(c_elements) * c_element_bytes;
      // Shared by every instance of the process: two instances timing the same GEMM would otherwise
      // keep different algorithms by the timing's noise, and the dense baseline and a dispatch's
      // dense path (instances of their own) must run the same GEMMs.
      static std::mutex tuned_mutex;
      static std::map<std::tuple<Key, size_t, int>, cublasLtMatmulAlgo_t> tuned;
      int device = 0;
      TWELL_CUDA_CHECK(cudaGetDevice(&device));
      const std::tuple<Key, size_t, int> tuned_key{key, workspace_.bytes(), device};
      const std::lock_guard<std::mutex> lock(tuned_mutex);
      if (const auto known = tuned.find(tuned_key); known != tuned.end()) {
        plan->algo = known->second;
      } else if (const auto timed = fastest(*plan, results, found_count, a.data, b.data, c, beta, c_bytes, stream)) {
        plan->algo = *timed;
        tuned.emplace(tuned_key, *timed);
      }
    }
    found = plans_.emplace(key, std::move(plan)).first;
  }
  const Plan& plan = *found->second;
  const float alpha = 1.0f;
  TWELL_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.op, &alpha, b.data, plan.a, a.data, plan.b, &beta, c, plan.c, c,
                                    plan.c, &plan.algo, workspace_.data(), workspace_.bytes(), stream));
}

std::optional<cublasLtMatmulAlgo_t> RowMajorGemm::fastest(const Plan& plan,
                                                          const cublasLtMatmulHeuristicResult_t* results, int count,
                                                          const void* a, const void* b, void* c, float beta,
                                                          size_t c_bytes, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TWELL_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return std::nullopt;  // no timing inside a graph
  // Where beta adds to C the timing runs go to a scratch C of the same layout, so the caller's C is
  // added to once; without one (no memory to spare) the heuristic's choice stands. With beta = 0 the
  // caller's C is the scratch: the real call overwrites it next.
  DeviceBuffer<uint8_t> scratch;
  if (beta != 0.0f) {
    try {
      scratch.resize(c_bytes);
    } catch (const Error&) {
      return std::nullopt;
    }
    TWELL_CUDA_CHECK(cudaMemsetAsync(scratch.data(), 0, scratch.bytes(), stream));
    c = scratch.data();
  }
  // Alone on the device: work of other streams (a training split runs its two parts side by side)
  // would share the SMs with the timed runs and could make a slower algorithm look faster.
  TWELL_CUDA_CHECK(cudaDeviceSynchronize());
  const TimingMarks timing;
  const cudaEvent_t* marks = timing.events;
  const float alpha = 1.0f;
  int best = 0;
  float best_ms = -1;
  for (int i = 0; i < count; ++i) {
    const auto launch = [&] {
      return cublasLtMatmul(handle_, plan.op, &alpha, b, plan.a, a, plan.b, &beta, c, plan.c, c, plan.c,
                            &results[i].algo, workspace_.data(), workspace_.bytes(), stream);
    };
    if (launch() != CUBLAS_STATUS_SUCCESS) continue;  // an algorithm these pointers do not suit
    TWELL_CUDA_CHECK(cudaEventRecord(marks[0], stream));
    for (int run = 0; run < kTimedRuns; ++run) {
      TWELL_CUBLAS_CHECK(launch());
      TWELL_CUDA_CHECK(cudaEventRecord(marks[run + 1], stream));
    }
    TWELL_CUDA_CHECK(cudaEventSynchronize(marks[kTimedRuns]));
    float runs[kTimedRuns];
    for (int run = 0; run < kTimedRuns; ++run)
      TWELL_CUDA_CHECK(cudaEventElapsedTime(&runs[run], marks[run], marks[run + 1]));
    std::sort(runs, runs + kTimedRuns);
    const float median = runs[kTimedRuns / 2];
    if (best_ms < 0 || median < best_ms) {
      best_ms = median;
      best = i;
    }
  }
  return results[best].algo;
}

}  // namespace twell::cuda
