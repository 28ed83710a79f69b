// A GEMM with an epilogue of twell's own (the TwELL packing, twell_pack_epilogue.cuh): CUTLASS's sm90
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

// A thread's WGMMA accumulators for a CTA tile kBlockN columns wide, in the sm90 64xN layout
// ((2 columns, 2 row halves, atom N / 8 column blocks), MMA_M, MMA_N): lane l holds, in every block of
// 8 columns, the columns 2·(l%4) and +1 of the rows l/4 and l/4 + 8 of its warp's 16 in each MMA row
// block. Indices must be compile-time (unrolled loops): a data-dependent one puts the accumulators in
// local memory.
template <class FrgLayout, int kBlockN>
struct Sm90Accumulators {
  static_assert(cute::size<0, 0>(FrgLayout{}) == 2 && cute::size<0, 1>(FrgLayout{}) == 2, "sm90 64xN accumulator layout");
  static constexpr int kAtomBlocks = cute::size<0, 2>(FrgLayout{});
  static constexpr int kMmaM = cute::size<1>(FrgLayout{});
  static_assert(kAtomBlocks * 8 * cute::size<2>(FrgLayout{}) == kBlockN, "accumulators cover the CTA tile's columns");

  // Column 8·block + 2·(l%4) + col of the row half `half` of MMA row block mm.
  template <class Accumulators>
  CUTLASS_DEVICE static float at(Accumulators const& accumulators, int mm, int half, int block, int col) {
    using cute::make_coord;
    return accumulators(make_coord(make_coord(col, half, block % kAtomBlocks), mm, block / kAtomBlocks));
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
