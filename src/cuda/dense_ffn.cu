// Dense FFN baseline through cuBLASLt (bf16 operands, fp32 accumulation, bf16 outputs):
//   g = x·Wg^T                                               [M, H]
//   u = x·Wu^T                                               [M, H]
//   h = act(g) ⊙ u    (one elementwise kernel, in place in u) [M, H]
//   y = h·Wd                                                 [M, D]
// Non-gated: u = relu(x·Wu^T) (ReLU fused in the GEMM epilogue), y = u·Wd.
// From fuse_gate_from_rows rows on (cuda.h), a relu gate goes into the up GEMM's epilogue (gated_up_gemm.h):
//   g = x·Wg^T,  h = relu(g) ⊙ (x·Wu^T),  y = h·Wd.
// Below, with batch_gate_and_up, g and u come from one cuBLASLt launch (a batch of two, x shared).
// The activation sits in the elementwise kernel rather than the gate GEMM's epilogue: that kernel
// reads g anyway, so relu costs nothing there, and silu / fatrelu need it.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_utils.h"
#include "cuda/gated_up_gemm.h"
#include "cuda/gemm.h"
#include "twell/cuda.h"

namespace twell::cuda {
namespace {

template <FfnActivation kActivation>
__device__ float activate(float g, float threshold) {
  if constexpr (kActivation == FfnActivation::relu) return fmaxf(g, 0.0f);
  if constexpr (kActivation == FfnActivation::fatrelu) return g > threshold ? g : 0.0f;
  return g / (1.0f + expf(-g));  // silu
}

template <FfnActivation kActivation>
__global__ void activate_multiply_kernel(const __nv_bfloat16* gate, __nv_bfloat16* up, int64_t count, float threshold) {
  const int64_t pairs = count / 2;
  const auto* gate2 = reinterpret_cast<const __nv_bfloat162*>(gate);
  auto* up2 = reinterpret_cast<__nv_bfloat162*>(up);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pairs; i += int64_t{gridDim.x} * blockDim.x) {
    const float2 g = __bfloat1622float2(gate2[i]);
    const float2 u = __bfloat1622float2(up2[i]);
    up2[i] = __floats2bfloat162_rn(activate<kActivation>(g.x, threshold) * u.x,
                                   activate<kActivation>(g.y, threshold) * u.y);
  }
  if (count % 2 == 1 && blockIdx.x == 0 && threadIdx.x == 0)
    up[count - 1] = __float2bfloat16_rn(activate<kActivation>(__bfloat162float(gate[count - 1]), threshold) *
                                        __bfloat162float(up[count - 1]));
}

}  // namespace

void activate_multiply(const bf16* gate, bf16* up, int64_t count, GateActivation activation, cudaStream_t stream) {
  const int threads = 256;
  const auto blocks = static_cast<unsigned>(
      std::min<int64_t>((count / 2 + threads - 1) / threads + 1, int64_t{device_facts().sm_count} * 16));
  const auto* g = reinterpret_cast<const __nv_bfloat16*>(gate);
  auto* u = reinterpret_cast<__nv_bfloat16*>(up);
  switch (activation.kind) {
    case FfnActivation::relu:
      activate_multiply_kernel<FfnActivation::relu><<<blocks, threads, 0, stream>>>(g, u, count, 0.0f);
      break;
    case FfnActivation::fatrelu:
      activate_multiply_kernel<FfnActivation::fatrelu><<<blocks, threads, 0, stream>>>(g, u, count, activation.threshold);
      break;
    case FfnActivation::silu:
      activate_multiply_kernel<FfnActivation::silu><<<blocks, threads, 0, stream>>>(g, u, count, 0.0f);
      break;
  }
  TWELL_CUDA_CHECK_LAUNCH();
}

struct DenseFfn::Impl {
  DenseFfnOptions options;
  RowMajorGemm gemm;
  DeviceBuffer<bf16> hidden;  // g and u (then h), [M, H] each, in the order of Wg and Wu in memory
};

DenseFfn::DenseFfn(DenseFfnOptions options) : impl_(std::make_unique<Impl>()) { impl_->options = options; }
DenseFfn::~DenseFfn() = default;
DenseFfn::DenseFfn(DenseFfn&&) noexcept = default;
DenseFfn& DenseFfn::operator=(DenseFfn&&) noexcept = default;

int64_t DenseFfn::scratch_bytes() const {
  return impl_->gemm.workspace_bytes() + static_cast<int64_t>(impl_->hidden.bytes());
}

void DenseFfn::run(const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y, cudaStream_t stream,
                   GateActivation activation, bool add_to_y, cudaEvent_t y_ready) {
  TWELL_REQUIRE(rows >= 1, "DenseFfn: rows must be >= 1, got {}", rows);
  TWELL_REQUIRE(weights.gated || activation.kind == FfnActivation::relu,
                "DenseFfn: a non-gated FFN takes relu only");
  const int64_t d = weights.d_model, h = weights.d_hidden;
  const int64_t hidden_count = rows * h;
  // The second half starts on a 256-byte boundary: activate_multiply reads bf16 pairs, and cuBLASLt's
  // kernels run fastest on aligned matrices.
  const int64_t second_half = (hidden_count + 127) / 128 * 128;
  impl_->hidden.resize(weights.gated ? second_half + hidden_count : hidden_count);
  RowMajorGemm& gemm = impl_->gemm;
  const DenseFfnOptions& options = impl_->options;
  const bool fused = weights.gated && activation.kind == FfnActivation::relu && rows >= options.fuse_gate_from_rows &&
                     relu_gated_up_supported(h, d);
  // Wg and Wu in memory order, their outputs in the same order in `hidden`: a batch of the two then
  // has positive strides. Non-gated: u alone, at the start.
  const auto address = [](const bf16* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const bool up_first = !weights.gated || address(weights.up) < address(weights.gate);
  const bf16* const first_weights = up_first ? weights.up : weights.gate;
  const std::uintptr_t gap_bytes = address(up_first ? weights.gate : weights.up) - address(first_weights);
  bf16* const gate_out = impl_->hidden.data() + (up_first ? second_half : 0);
  bf16* const up_out = impl_->hidden.data() + (up_first ? 0 : second_half);
  if (weights.gated && !fused && options.batch_gate_and_up && gap_bytes % 16 == 0) {
    gemm.run(rows, h, d, {x, d, false}, {first_weights, d, true}, impl_->hidden.data(), h, GemmOutput::bf16, 0.0f,
             stream, GemmEpilogue::none,
             {.count = 2, .stride_a = 0, .stride_b = static_cast<int64_t>(gap_bytes / sizeof(bf16)), .stride_c = second_half});
  } else {
    if (weights.gated)
      gemm.run(rows, h, d, {x, d, false}, {weights.gate, d, true}, gate_out, h, GemmOutput::bf16, 0.0f, stream);
    if (fused) {
      relu_gated_up_gemm(x, rows, weights.up, h, d, gate_out, up_out, stream);
    } else {
      gemm.run(rows, h, d, {x, d, false}, {weights.up, d, true}, up_out, h, GemmOutput::bf16, 0.0f, stream,
               weights.gated ? GemmEpilogue::none : GemmEpilogue::relu);
    }
  }
  if (weights.gated && !fused) activate_multiply(gate_out, up_out, hidden_count, activation, stream);
  // y [M, D] (+)= h [M, H] · Wd [H, D]
  if (y_ready) TWELL_CUDA_CHECK(cudaStreamWaitEvent(stream, y_ready));
  gemm.run(rows, d, h, {up_out, h, false}, {weights.down, d, false}, y, d, GemmOutput::bf16, add_to_y ? 1.0f : 0.0f,
           stream);
}

}  // namespace twell::cuda
