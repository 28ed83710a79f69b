// relu_gated_up_gemm (gated_up_gemm.h) on sm_90a: CUTLASS's warp-specialized cooperative GEMM
// (TMA producer, two WGMMA consumer warpgroups on one 128 x 256 tile, clusters of 2 along M sharing
// the weight tile by multicast, persistent scheduler) with an epilogue visitor tree that loads the
// g tile by TMA beside the accumulators and stores bf16(max(g, 0) · acc). And the pair form: one
// GEMM over the gate and up rows interleaved by 8, whose operator-style epilogue (the interface
// TwellPackEpilogue uses) multiplies neighbouring accumulator columns.
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
#include "cuda/operator_epilogue.cuh"

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

// Epilogue of the pair GEMM. With the rows interleaved by 8, the sm90 64xN accumulator layout gives a
// lane, in column block 2p, the gate of neurons 8p + 2·(l%4) and +1 and, in block 2p + 1, the up
// product of the same two neurons (rows l/4 and l/4 + 8 of the warp's 16): each lane multiplies its
// own registers and stores the two bf16 results as one 32-bit word. No shared memory, no barrier.
struct GatePairOutput {
  bf16* h;  // [rows, hidden]
  int64_t rows;
  int32_t hidden;
};

class ReluGatePairEpilogue : public OperatorEpilogueBase<GatePairOutput> {
 public:
  struct SharedStorage {};

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.hidden % kGateUpPairRows == 0;
  }

  CUTLASS_HOST_DEVICE explicit ReluGatePairEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK blk_shape_mnk, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    constexpr int kBlockN = size<1>(BlockShapeMNK{});
    using Acc = Sm90Accumulators<FrgLayout, kBlockN>;
    static_assert(Acc::kAtomBlocks % 2 == 0, "a gate block and its up block lie in one MMA atom");
    constexpr int kPairs = kBlockN / (2 * kGateUpPairRows);

    const int quad_lane = thread_idx % 4;
    Tensor tile_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(
        make_identity_tensor(take<0, 2>(blk_shape_mnk)));  // (MMA, MMA_M, MMA_N) -> (row, col) in the tile
    const int64_t first_row = static_cast<int64_t>(get<0>(blk_coord_mnkl)) * size<0>(BlockShapeMNK{});
    const int64_t first_neuron = static_cast<int64_t>(get<1>(blk_coord_mnkl)) * (kBlockN / 2) + 2 * quad_lane;
    CUTE_UNROLL
    for (int mm = 0; mm < Acc::kMmaM; ++mm) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        const int64_t row = first_row + get<0>(tile_coords(make_coord(make_coord(0, half, 0), mm, 0)));
        if (row >= params_.rows) continue;
        uint32_t* out = reinterpret_cast<uint32_t*>(params_.h + row * params_.hidden + first_neuron);
        CUTE_UNROLL
        for (int p = 0; p < kPairs; ++p) {
          if (first_neuron + kGateUpPairRows * p >= params_.hidden) break;  // the tile's neurons past H
          uint32_t word = 0;
          CUTE_UNROLL
          for (int c = 0; c < 2; ++c) {
            const float gate = Acc::at(accumulators, mm, half, 2 * p, c);
            const float up = Acc::at(accumulators, mm, half, 2 * p + 1, c);
            word |= uint32_t{float_to_bf16_bits(gate > 0.f ? gate * up : 0.f)} << (16 * c);
          }
          out[kGateUpPairRows / 2 * p] = word;
        }
      }
    }
  }

 private:
  Params params_;
};

// The same GEMM configuration as the TwELL gate's (operator_epilogue.cuh): 64 x 256 tiles are 128 neurons.
using GatePairKernel = PingpongGemm<ReluGatePairEpilogue>;

}  // namespace

bool relu_gate_up_pairs_supported(int64_t hidden, int64_t d_model) {
  return hidden >= kGateUpPairRows && hidden % kGateUpPairRows == 0 && d_model >= 8 && d_model % 8 == 0 &&
         2 * hidden < (int64_t{1} << 31) && d_model < (int64_t{1} << 31);
}

void interleave_gate_up(const bf16* w_gate, const bf16* w_up, int64_t hidden, int64_t d_model, bf16* pairs,
                        cudaStream_t stream) {
  TWELL_REQUIRE(relu_gate_up_pairs_supported(hidden, d_model),
                "interleave_gate_up: H must be a multiple of {} and D of 8, got H={} D={}", kGateUpPairRows, hidden,
                d_model);
  // Blocks of 8 rows: from a pitch of 8 rows in W to a pitch of 16 in pairs, the gate's first.
  const size_t block_bytes = static_cast<size_t>(kGateUpPairRows * d_model) * sizeof(bf16);
  const auto blocks = static_cast<size_t>(hidden / kGateUpPairRows);
  TWELL_CUDA_CHECK(cudaMemcpy2DAsync(pairs, 2 * block_bytes, w_gate, block_bytes, block_bytes, blocks,
                                     cudaMemcpyDeviceToDevice, stream));
  TWELL_CUDA_CHECK(cudaMemcpy2DAsync(reinterpret_cast<std::byte*>(pairs) + block_bytes, 2 * block_bytes, w_up,
                                     block_bytes, block_bytes, blocks, cudaMemcpyDeviceToDevice, stream));
}

void relu_gate_up_pairs_gemm(const bf16* x, int64_t rows, const bf16* pairs, int64_t hidden, int64_t d_model, bf16* h,
                             cudaStream_t stream) {
  TWELL_REQUIRE(rows >= 1 && rows < (int64_t{1} << 31),
                "relu_gate_up_pairs_gemm: rows must be in [1, 2^31), got {}", rows);
  TWELL_REQUIRE(relu_gate_up_pairs_supported(hidden, d_model),
                "relu_gate_up_pairs_gemm: H must be a multiple of {} and D of 8, got H={} D={}", kGateUpPairRows,
                hidden, d_model);
  using Gemm = GatePairKernel::Gemm;
  const int m = static_cast<int>(rows), n = static_cast<int>(2 * hidden), k = static_cast<int>(d_model);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, n, k, 1},
                                {reinterpret_cast<const Element*>(x), {d_model, cute::Int<1>{}, rows * d_model},
                                 reinterpret_cast<const Element*>(pairs), {d_model, cute::Int<1>{}, 2 * hidden * d_model}},
                                {h, rows, static_cast<int32_t>(hidden)}};
  run_cutlass_gemm<Gemm>(args, "relu_gate_up_pairs_gemm", [&] { return fmt::format("M={} H={} D={}", m, hidden, k); },
                         stream);
}

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
