// Dense FFN baseline through cuBLASLt (bf16 operands, fp32 accumulation, bf16 outputs):
//   g = relu(x·Wg^T)  (ReLU fused in the GEMM epilogue)      [M, H]
//   u = x·Wu^T                                              [M, H]
//   h = g ⊙ u         (one elementwise kernel, in place in u) [M, H]
//   y = h·Wd                                                [M, D]
// Non-gated: u = relu(x·Wu^T) (fused ReLU), y = u·Wd.
// cuBLASLt is column-major; a row-major [R, C] matrix is its column-major [C, R], so
//   g^T [H, M] = Wg [H, D] · x^T [D, M]   -> A = Wg viewed [D, H] with op T, B = x viewed [D, M]
//   y^T [D, M] = Wd^T [D, H] · h^T [H, M] -> A = Wd viewed [D, H] with op N, B = h viewed [H, M]
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <memory>

#include <map>
#include <tuple>

#include "cuda/cuda_utils.h"
#include "cuda/cublas_check.h"
#include "twell/cuda.h"

namespace twell::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

__global__ void multiply_in_place_kernel(const __nv_bfloat16* gate, __nv_bfloat16* up, int64_t count) {
  const int64_t pairs = count / 2;
  const auto* gate2 = reinterpret_cast<const __nv_bfloat162*>(gate);
  auto* up2 = reinterpret_cast<__nv_bfloat162*>(up);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pairs; i += int64_t{gridDim.x} * blockDim.x) {
    const float2 g = __bfloat1622float2(gate2[i]);
    const float2 u = __bfloat1622float2(up2[i]);
    up2[i] = __floats2bfloat162_rn(g.x * u.x, g.y * u.y);
  }
  if (count % 2 == 1 && blockIdx.x == 0 && threadIdx.x == 0)
    up[count - 1] = __float2bfloat16_rn(__bfloat162float(gate[count - 1]) * __bfloat162float(up[count - 1]));
}

// One planned matmul D[m, n] = op(A)[m, k] · B[k, n], column-major, bf16 in and out, fp32 compute.
class LtMatmul {
 public:
  LtMatmul(cublasLtHandle_t handle, bool transpose_a, int64_t m, int64_t n, int64_t k, bool relu) {
    TWELL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = CUBLAS_OP_N;
    TWELL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    TWELL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    const cublasLtEpilogue_t epilogue = relu ? CUBLASLT_EPILOGUE_RELU : CUBLASLT_EPILOGUE_DEFAULT;
    TWELL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
    // Stored shapes: A is [m, k] (or [k, m] when transposed), B [k, n], D [m, n].
    TWELL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a_, CUDA_R_16BF, transpose_a ? k : m, transpose_a ? m : k,
                                                  transpose_a ? k : m));
    TWELL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b_, CUDA_R_16BF, k, n, k));
    TWELL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d_, CUDA_R_16BF, m, n, m));
    cublasLtMatmulPreference_t preference;
    TWELL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    TWELL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &kWorkspaceBytes, sizeof kWorkspaceBytes));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    TWELL_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, op_, a_, b_, d_, d_, preference, 1, &result, &found));
    cublasLtMatmulPreferenceDestroy(preference);
    TWELL_REQUIRE(found > 0, "cuBLASLt found no algorithm for a {}x{}x{} bf16 matmul", m, n, k);
    algo_ = result.algo;
  }
  ~LtMatmul() {
    cublasLtMatrixLayoutDestroy(d_);
    cublasLtMatrixLayoutDestroy(b_);
    cublasLtMatrixLayoutDestroy(a_);
    cublasLtMatmulDescDestroy(op_);
  }
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;

  void run(cublasLtHandle_t handle, const void* a, const void* b, void* d, void* workspace, cudaStream_t stream) const {
    const float alpha = 1.f, beta = 0.f;
    TWELL_CUBLAS_CHECK(cublasLtMatmul(handle, op_, &alpha, a, a_, b, b_, &beta, d, d_, d, d_, &algo_, workspace,
                                      kWorkspaceBytes, stream));
  }

 private:
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
};

// The matmuls of one FFN shape.
struct FfnPlan {
  std::unique_ptr<LtMatmul> gate;  // g^T [H, M] (null when non-gated)
  std::unique_ptr<LtMatmul> up;    // u^T [H, M]
  std::unique_ptr<LtMatmul> down;  // y^T [D, M]
};

}  // namespace

struct DenseFfn::Impl {
  cublasLtHandle_t handle = nullptr;
  DeviceBuffer<uint8_t> workspace{kWorkspaceBytes};
  DeviceBuffer<bf16> gate;  // [M, H]
  DeviceBuffer<bf16> up;    // [M, H], then h
  std::map<std::tuple<int64_t, int32_t, int32_t, bool>, FfnPlan> plans;  // (M, D, H, gated)

  Impl() { TWELL_CUBLAS_CHECK(cublasLtCreate(&handle)); }
  ~Impl() {
    plans.clear();
    cublasLtDestroy(handle);
  }
};

DenseFfn::DenseFfn() : impl_(std::make_unique<Impl>()) {}
DenseFfn::~DenseFfn() = default;
DenseFfn::DenseFfn(DenseFfn&&) noexcept = default;
DenseFfn& DenseFfn::operator=(DenseFfn&&) noexcept = default;

int64_t DenseFfn::scratch_bytes() const {
  return static_cast<int64_t>(impl_->workspace.bytes() + impl_->gate.bytes() + impl_->up.bytes());
}

void DenseFfn::run(const bf16* x, int64_t rows, const DeviceFfnWeights& weights, bf16* y, cudaStream_t stream) {
  TWELL_REQUIRE(rows >= 1, "DenseFfn: rows must be >= 1, got {}", rows);
  const int32_t d = weights.d_model, h = weights.d_hidden;
  const auto key = std::make_tuple(rows, d, h, weights.gated);
  auto found = impl_->plans.find(key);
  if (found == impl_->plans.end()) {
    FfnPlan plan;
    if (weights.gated) plan.gate = std::make_unique<LtMatmul>(impl_->handle, true, h, rows, d, true);
    plan.up = std::make_unique<LtMatmul>(impl_->handle, true, h, rows, d, !weights.gated);
    plan.down = std::make_unique<LtMatmul>(impl_->handle, false, d, rows, h, false);
    found = impl_->plans.emplace(key, std::move(plan)).first;
  }
  const FfnPlan& plan = found->second;
  const int64_t hidden_count = rows * h;
  impl_->up.resize(hidden_count);
  void* workspace = impl_->workspace.data();
  plan.up->run(impl_->handle, weights.up.get(), x, impl_->up.data(), workspace, stream);
  if (weights.gated) {
    impl_->gate.resize(hidden_count);
    plan.gate->run(impl_->handle, weights.gate.get(), x, impl_->gate.data(), workspace, stream);
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((hidden_count / 2 + threads - 1) / threads + 1,
                                             int64_t{device_facts().sm_count} * 16);
    multiply_in_place_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(impl_->gate.data()), reinterpret_cast<__nv_bfloat16*>(impl_->up.data()),
        hidden_count);
    TWELL_CUDA_CHECK_LAUNCH();
  }
  plan.down->run(impl_->handle, weights.down.get(), impl_->up.data(), y, workspace, stream);
}

}  // namespace twell::cuda
