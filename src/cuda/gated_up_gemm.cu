// relu_gated_up_gemm (gated_up_gemm.h) on sm_90a: CUTLASS's warp-specialized cooperative GEMM
// (TMA producer, two WGMMA consumer warpgroups on one 128 x 256 tile, clusters of 2 along M sharing
// the weight tile by multicast, persistent scheduler) with an epilogue visitor tree that loads the
// g tile by TMA beside the accumulators and stores bf16(max(g, 0) · acc).
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "cuda/cuda_utils.h"
#include "cuda/cutlass_run.cuh"
#include "cuda/gated_up_gemm.h"

namespace twell::cuda {
namespace {

using Element = cutlass::bfloat16_t;
using cutlass::epilogue::fusion::Sm90AccFetch;
using cutlass::epilogue::fusion::Sm90Compute;
using cutlass::epilogue::fusion::Sm90EVT;
using cutlass::epilogue::fusion::Sm90SrcFetch;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

struct GatedUpKernel {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  // max(g, 0) · acc, the product rounded once to bf16.
  using ReluOfGate = Sm90EVT<Sm90Compute<cutlass::epilogue::thread::ReLu, float, float, kRound>, Sm90SrcFetch<Element>>;
  using Fusion = Sm90EVT<Sm90Compute<cutlass::multiplies, Element, float, kRound>, ReluOfGate, Sm90AccFetch>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::RowMajor, 8, cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace

bool relu_gated_up_supported(int64_t hidden, int64_t d_model) {
  return hidden >= 8 && hidden % 8 == 0 && d_model >= 8 && d_model % 8 == 0 && hidden < (int64_t{1} << 31) &&
         d_model < (int64_t{1} << 31);
}

void relu_gated_up_gemm(const bf16* x, int64_t rows, const bf16* w_up, int64_t hidden, int64_t d_model,
                        const bf16* gate, bf16* h, cudaStream_t stream) {
  TWELL_REQUIRE(rows >= 1 && rows < (int64_t{1} << 31), "relu_gated_up_gemm: rows must be in [1, 2^31), got {}",
                rows);
  TWELL_REQUIRE(relu_gated_up_supported(hidden, d_model),
                "relu_gated_up_gemm: H and D must be multiples of 8, got H={} D={}", hidden, d_model);
  using Gemm = GatedUpKernel::Gemm;
  using Kernel = GatedUpKernel::Kernel;
  const int m = static_cast<int>(rows), n = static_cast<int>(hidden), k = static_cast<int>(d_model);
  // Row-major x [M, D], W [H, D] and g, h [M, H]: unit stride along the last index, one batch.
  const typename Kernel::StrideA stride_x{d_model, cute::Int<1>{}, rows * d_model};
  const typename Kernel::StrideB stride_w{d_model, cute::Int<1>{}, hidden * d_model};
  const typename Kernel::StrideC stride_h{hidden, cute::Int<1>{}, rows * hidden};
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, n, k, 1},
                                {reinterpret_cast<const Element*>(x), stride_x,
                                 reinterpret_cast<const Element*>(w_up), stride_w},
                                {{}, reinterpret_cast<const Element*>(gate), stride_h,
                                 reinterpret_cast<Element*>(h), stride_h}};
  args.epilogue.thread = {{{}, {}}, {}, {}};  // {relu(C): {C, relu}, acc, multiplies}
  run_cutlass_gemm<Gemm>(args, "relu_gated_up_gemm", [&] { return fmt::format("M={} H={} D={}", m, n, k); }, stream);
}

}  // namespace twell::cuda
