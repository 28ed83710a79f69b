// twell's GEMMs with their own epilogues (TwELL packing, the relu-gated pair product): CUTLASS's sm90
// mainloop and persistent scheduler, with an operator-style epilogue (the interface of
// cutlass::epilogue::collective::DefaultEpilogue, run through Sm90TmaWarpSpecializedAdapter) that
// reads the WGMMA accumulators in registers and writes its own outputs.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

namespace twell::cuda {

// What the sm90 kernels read from an epilogue type beyond operator() and SharedStorage: C and D are
// not used, the arguments are the parameters, and there is no workspace.
template <class Output>
struct OperatorEpilogueBase {
  using ElementC = void;
  using ElementD = cutlass::bfloat16_t;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using Arguments = Output;
  using Params = Output;
  using ThreadEpilogueOp = void;  // GemmUniversalAdapter names it

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
};

// The GEMM around such an epilogue: bf16 x [M, K] and W [N, K] both K-major, fp32 accumulators.
// Configuration measured on the H200 against the alternatives (docs/perf-notes.md, "Gate GEMM on
// CUTLASS's mainloop"): ping-pong schedule (two consumer warpgroups take turns, so one's epilogue
// overlaps the other's WGMMAs), a 64 x 256 tile per warpgroup, clusters of 2 along M multicasting the
// weight tile, as many stages as shared memory holds beside the epilogue's own storage.
template <class OperatorEpilogue>
struct PingpongGemm {
  using Element = cutlass::bfloat16_t;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<OperatorEpilogue>;
  using TileShape = cute::Shape<cute::_64, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename OperatorEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace twell::cuda
