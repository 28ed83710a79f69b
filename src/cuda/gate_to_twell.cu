// Gate GEMM -> TwELL on sm_90a: g = relu(x·W^T) with x [M, D] and W [H, D] both K-major (a "TN"
// GEMM), bf16 operands, fp32 accumulators, packed into TwELL by the epilogue
// (twell_pack_epilogue.cuh). The mainloop and the persistent tile scheduler are CUTLASS's sm90
// warp-specialized ones (a TMA producer warp, WGMMA consumer warpgroups, clusters of 2 CTAs along M
// sharing each weight tile through TMA multicast); only the epilogue is twell's.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/epilogue/collective/detail.hpp>

#include "cuda/cuda_utils.h"
#include "cuda/cutlass_run.cuh"
#include "cuda/twell_pack_epilogue.cuh"
#include "twell/cuda.h"

namespace twell::cuda {
namespace {

using Element = cutlass::bfloat16_t;

// The kernel for TwELL tiles of kTile columns. Configuration measured on the H200 against the
// alternatives (docs/perf-notes.md, "Gate GEMM on CUTLASS's mainloop"): ping-pong schedule (two
// consumer warpgroups take turns, so one's packing epilogue overlaps the other's WGMMAs), a 64 x 256
// tile per warpgroup, clusters of 2 along M multicasting the weight tile, as many stages as shared
// memory holds beside the epilogue's slot buffers.
template <int kTile>
struct GateKernel {
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using PackEpilogue = TwellPackEpilogue<kTile, /*kMmaWarps=*/4>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<PackEpilogue>;
  using TileShape = cute::Shape<cute::_64, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename PackEpilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Config>
void launch_gate_to_twell(const bf16* x, int64_t rows, const bf16* weight, int32_t d_model, const TwellPackOutput& out,
                          cudaStream_t stream) {
  using Gemm = typename Config::Gemm;
  const int m = static_cast<int>(rows);
  const int64_t k = d_model;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, out.cols, d_model, 1},
      {reinterpret_cast<const Element*>(x), {k, cute::Int<1>{}, k * m},
       reinterpret_cast<const Element*>(weight), {k, cute::Int<1>{}, k * out.cols}},
      out};
  run_cutlass_gemm<Gemm>(
      args, "gate_to_twell",
      [&] { return fmt::format("M={} D={} H={} with S={}", m, d_model, out.cols, out.slots_per_tile); }, stream);
}

}  // namespace

void gate_to_twell(const bf16* x, int64_t rows, const DeviceFfnView& weights, int32_t tile, int32_t compression,
                   DeviceTwell& out, cudaStream_t stream) {
  TWELL_REQUIRE(rows >= 1 && rows <= (int64_t{1} << 30), "gate_to_twell: rows must be in [1, 2^30], got {}", rows);
  TWELL_REQUIRE(weights.d_model % 64 == 0, "gate_to_twell: d_model must be a multiple of 64, got {}", weights.d_model);
  TwellShape shape{rows, weights.d_hidden, tile, compression};
  // Default spill: one row per 16 tiles (memory ~ T·2/16 bytes per tile, under the slots' own size).
  reserve(out, shape, std::max<int64_t>(out.spill_capacity, shape.tile_count() / 16 + 1));
  TWELL_CUDA_CHECK(cudaMemsetAsync(out.spill_used.get(), 0, sizeof(int32_t), stream));
  TWELL_CUDA_CHECK(cudaMemsetAsync(out.nnz_total.get(), 0, sizeof(unsigned long long), stream));

  TwellPackOutput pack{};
  pack.slots = out.slots.get();
  pack.tile_nnz = out.tile_nnz.get();
  pack.spill = reinterpret_cast<uint16_t*>(out.spill.get());
  pack.spill_used = out.spill_used.get();
  pack.nnz_total = out.nnz_total.get();
  pack.spill_capacity = out.spill_capacity;
  pack.rows = rows;
  pack.cols = shape.cols;
  pack.n_tiles = shape.n_tiles();
  pack.slots_per_tile = shape.slots();
  if (tile == 128) {
    launch_gate_to_twell<GateKernel<128>>(x, rows, weights.relu_projection(), weights.d_model, pack, stream);
  } else {
    launch_gate_to_twell<GateKernel<256>>(x, rows, weights.relu_projection(), weights.d_model, pack, stream);
  }
}

void gate_to_twell_complete(const bf16* x, int64_t rows, const DeviceFfnView& weights, int32_t tile,
                            int32_t compression, DeviceTwell& out, cudaStream_t stream) {
  gate_to_twell(x, rows, weights, tile, compression, out, stream);
  for (int32_t used = spill_rows_used(out, stream); used > out.spill_capacity; used = spill_rows_used(out, stream)) {
    reserve(out, out.shape, used + used / 4);
    gate_to_twell(x, rows, weights, tile, compression, out, stream);
  }
}

}  // namespace twell::cuda
