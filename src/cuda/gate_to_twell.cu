// Gate GEMM -> TwELL on sm_90a: g = relu(x·W^T) with x [M, D] and W [H, D] both K-major (a "TN"
// GEMM), bf16 operands, fp32 accumulators in registers, packed into TwELL by the epilogue
// (twell_pack_epilogue.cuh). Structure, after CUTLASS's CuTe Hopper tutorial (wgmma_tma_sm90.cu):
//   scheduler  one CTA per [128, T] output tile, grouped raster so a group of M-blocks reuses the
//              weight tiles from L2 (no persistent scheduler yet: the second resident CTA per SM at
//              T=128 hides the epilogue instead)
//   mainloop   thread 0 issues TMA loads of x and W k-tiles into a kStages-deep ring of swizzled
//              shared-memory buffers (mbarrier with transaction bytes per stage); two consumer
//              warpgroups run WGMMA 64xTx16 on their 64 rows each, one k-tile batch in flight; a
//              stage is refilled once all 256 threads have arrived on its "empty" barrier
//   epilogue   accumulators -> relu -> fp32 tile in shared memory (aliasing the drained ring) ->
//              one warp per row packs it
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/cuda_utils.h"
#include "cuda/twell_pack_epilogue.cuh"
#include "twell/cuda.h"

namespace twell::cuda {
namespace {

using cute::_;
using cute::Int;
using Element = cutlass::bfloat16_t;

// Tile policy. Limits behind each number:
//   kBlockM 128: two warpgroups x the 64-row WGMMA atom.
//   kBlockN = T: one CTA column tile is exactly one TwELL tile, so the epilogue packs whole tiles.
//   kBlockK 64: one 128-byte swizzle atom of bf16 per row (D must be a multiple of 64).
//   kStages: T=128 -> 3 stages = 96 KiB, so two CTAs fit one SM (228 KiB) and one's epilogue
//            overlaps the other's mainloop; T=256 -> 4 stages = 192 KiB, one CTA per SM
//            (its 128 fp32 accumulators per thread leave no registers for a second CTA anyway).
//   kGroupM 16: M-blocks per raster group: 16·128 rows of x stay in L2 while all of W streams by.
template <int kTile>
struct GatePolicy {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kTile;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = kTile == 128 ? 3 : 4;
  static constexpr int kMinBlocksPerSm = kTile == 128 ? 2 : 1;
  static constexpr int kThreads = 256;
  static constexpr int kGroupM = 16;
  // Epilogue tile row stride: +4 floats shifts each row by 4 banks, so the accumulator stores of
  // one warp (8 rows x 4 column pairs) hit at most 2 threads per bank.
  static constexpr int kEpilogueStride = kBlockN + 4;

  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::make_shape(Int<kBlockM>{}, Int<kBlockK>{}, Int<kStages>{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::make_shape(Int<kBlockN>{}, Int<kBlockK>{}, Int<kStages>{})));
  using MmaAtom = std::conditional_t<
      kTile == 128, cute::SM90_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>,
      cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>>;
  using TiledMma = decltype(cute::make_tiled_mma(MmaAtom{}, cute::Layout<cute::Shape<Int<2>, Int<1>, Int<1>>>{}));

  static constexpr int kBytesA = kBlockM * kBlockK * kStages * 2;
  static constexpr int kBytesB = kBlockN * kBlockK * kStages * 2;
  static constexpr int kBytesEpilogue = kBlockM * kEpilogueStride * 4;
  static_assert(kBytesEpilogue <= kBytesA + kBytesB, "the epilogue tile must fit in the drained ring");
  static constexpr int kBarrierOffset = kBytesA + kBytesB;
  // +1024: the swizzled buffers need 1024-byte alignment, the dynamic base only guarantees 16.
  static constexpr int kSmemBytes = kBarrierOffset + 2 * kStages * 8 + 1024;
  static constexpr int kTxBytes = (kBlockM + kBlockN) * kBlockK * 2;
  static_assert(cute::size(TiledMma{}) == kThreads, "two consumer warpgroups");
};

struct GateParams {
  int32_t rows;     // M
  int32_t d_model;  // D
  int32_t m_blocks;
  int32_t n_blocks;  // = n_tiles
  TwellPackOutput out;
};

// Grouped raster: linear block -> (m_blk, n_blk). Within a group of kGroupM M-blocks the M-block
// varies fastest, so consecutive CTAs read the same weight tile.
template <int kGroupM>
__device__ __forceinline__ void raster(int block, int m_blocks, int n_blocks, int& m_blk, int& n_blk) {
  const int blocks_per_group = kGroupM * n_blocks;
  const int group = block / blocks_per_group;
  const int first_m = group * kGroupM;
  const int group_rows = min(m_blocks - first_m, kGroupM);
  const int in_group = block - group * blocks_per_group;
  m_blk = first_m + in_group % group_rows;
  n_blk = in_group / group_rows;
}

template <class Policy, class TmaX, class TmaW>
__global__ void __launch_bounds__(Policy::kThreads, Policy::kMinBlocksPerSm)
    gate_to_twell_kernel(CUTE_GRID_CONSTANT TmaX const tma_x, CUTE_GRID_CONSTANT TmaW const tma_w, GateParams params) {
  using namespace cute;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockM = Policy::kBlockM, kBlockN = Policy::kBlockN, kBlockK = Policy::kBlockK;
  constexpr int kStages = Policy::kStages;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  Element* smem_x = reinterpret_cast<Element*>(smem);
  Element* smem_w = reinterpret_cast<Element*>(smem + Policy::kBytesA);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Policy::kBarrierOffset);  // [kStages] TMA landed
  uint64_t* empty = full + kStages;                                              // [kStages] stage consumed

  int m_blk, n_blk;
  raster<Policy::kGroupM>(blockIdx.x, params.m_blocks, params.n_blocks, m_blk, n_blk);

  Tensor mX = tma_x.get_tma_tensor(make_shape(params.rows, params.d_model));          // (M,K)
  Tensor mW = tma_w.get_tma_tensor(make_shape(params.out.cols, params.d_model));      // (N,K)
  auto cta_tiler = make_shape(Int<kBlockM>{}, Int<kBlockN>{}, Int<kBlockK>{});
  auto cta_coord = make_coord(m_blk, n_blk, _);
  Tensor gX = local_tile(mX, cta_tiler, cta_coord, Step<_1, X, _1>{});  // (BLK_M,BLK_K,k)
  Tensor gW = local_tile(mW, cta_tiler, cta_coord, Step<X, _1, _1>{});  // (BLK_N,BLK_K,k)
  Tensor sX = make_tensor(make_smem_ptr(smem_x), typename Policy::SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
  Tensor sW = make_tensor(make_smem_ptr(smem_w), typename Policy::SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
  auto [tXgX, tXsX] = tma_partition(tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
  auto [tWgW, tWsW] = tma_partition(tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sW), group_modes<0, 2>(gW));

  const int k_tiles = params.d_model / kBlockK;
  const bool producer = threadIdx.x == 0;
  if (producer) {
    for (int stage = 0; stage < kStages; ++stage) {
      FullBarrier::init(&full[stage], 1);
      EmptyBarrier::init(&empty[stage], Policy::kThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (producer) {
    for (int k = 0; k < kStages && k < k_tiles; ++k) {
      FullBarrier::arrive_and_expect_tx(&full[k], Policy::kTxBytes);
      copy(tma_x.with(full[k]), tXgX(_, k), tXsX(_, k));
      copy(tma_w.with(full[k]), tWgW(_, k), tWsW(_, k));
    }
  }

  typename Policy::TiledMma mma;
  ThrMMA thr_mma = mma.get_thread_slice(threadIdx.x);
  Tensor tCsX = thr_mma.partition_A(sX);              // (MMA,MMA_M,MMA_K,PIPE)
  Tensor tCsW = thr_mma.partition_B(sW);              // (MMA,MMA_N,MMA_K,PIPE)
  Tensor tCrX = thr_mma.make_fragment_A(tCsX);        // descriptors
  Tensor tCrW = thr_mma.make_fragment_B(tCsW);
  Tensor accum = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA,MMA_M,MMA_N) fp32
  clear(accum);

  // One WGMMA batch stays in flight: k-tile k is issued before k-1's stage is released and refilled.
  for (int k = 0; k < k_tiles; ++k) {
    const int stage = k % kStages;
    FullBarrier::wait(&full[stage], (k / kStages) & 1);
    warpgroup_fence_operand(accum);
    warpgroup_arrive();
    gemm(mma, tCrX(_, _, _, stage), tCrW(_, _, _, stage), accum);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // k-1's WGMMAs are done reading their stage
    warpgroup_fence_operand(accum);
    if (k > 0) {
      const int done = k - 1;
      const int done_stage = done % kStages;
      EmptyBarrier::arrive(&empty[done_stage]);
      if (producer && done + kStages < k_tiles) {
        EmptyBarrier::wait(&empty[done_stage], (done / kStages) & 1);
        FullBarrier::arrive_and_expect_tx(&full[done_stage], Policy::kTxBytes);
        copy(tma_x.with(full[done_stage]), tXgX(_, done + kStages), tXsX(_, done_stage));
        copy(tma_w.with(full[done_stage]), tWgW(_, done + kStages), tWsW(_, done_stage));
      }
    }
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(accum);

  // Every load was consumed and every WGMMA waited for: the ring can hold the epilogue tile.
  __syncthreads();
  float* gate_tile = reinterpret_cast<float*>(smem);  // [BLK_M, kEpilogueStride]
  Tensor cC = make_identity_tensor(make_shape(Int<kBlockM>{}, Int<kBlockN>{}));  // (BLK_M,BLK_N) -> (m,n)
  Tensor tCcC = thr_mma.partition_C(cC);
  CUTE_UNROLL
  for (int i = 0; i < size(accum); ++i) {
    const int r = get<0>(tCcC(i));
    const int c = get<1>(tCcC(i));
    const float gate = accum(i);
    gate_tile[r * Policy::kEpilogueStride + c] = gate > 0.f ? gate : 0.f;
  }
  __syncthreads();
  pack_gate_tile<kBlockM, kBlockN, Policy::kEpilogueStride, Policy::kThreads>(
      gate_tile, static_cast<int64_t>(m_blk) * kBlockM, n_blk, params.out);
}

template <int kTile>
void launch_gate_to_twell(const bf16* x, int64_t rows, const bf16* weight, int32_t d_model, const TwellPackOutput& out,
                          cudaStream_t stream) {
  using namespace cute;
  using Policy = GatePolicy<kTile>;
  const int m = static_cast<int>(rows);
  Tensor mX = make_tensor(make_gmem_ptr(reinterpret_cast<const Element*>(x)), make_shape(m, d_model),
                          make_stride(d_model, Int<1>{}));  // (M,K) row-major
  Tensor mW = make_tensor(make_gmem_ptr(reinterpret_cast<const Element*>(weight)), make_shape(out.cols, d_model),
                          make_stride(d_model, Int<1>{}));  // (H,K) neuron-major
  typename Policy::SmemLayoutA smem_layout_x;
  typename Policy::SmemLayoutB smem_layout_w;
  auto tma_x = make_tma_atom(SM90_TMA_LOAD{}, mX, smem_layout_x(_, _, 0), make_shape(Int<Policy::kBlockM>{}, Int<Policy::kBlockK>{}));
  auto tma_w = make_tma_atom(SM90_TMA_LOAD{}, mW, smem_layout_w(_, _, 0), make_shape(Int<Policy::kBlockN>{}, Int<Policy::kBlockK>{}));
  auto kernel = gate_to_twell_kernel<Policy, decltype(tma_x), decltype(tma_w)>;

  const DeviceFacts& facts = device_facts();
  TWELL_REQUIRE(Policy::kSmemBytes <= facts.max_smem_per_block_optin,
                "gate_to_twell with T={} needs {} bytes of shared memory per block; this GPU allows {}", kTile,
                Policy::kSmemBytes, facts.max_smem_per_block_optin);
  static const bool configured = [&] {
    TWELL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Policy::kSmemBytes));
    return true;
  }();
  (void)configured;

  GateParams params{};
  params.rows = m;
  params.d_model = d_model;
  params.m_blocks = (m + Policy::kBlockM - 1) / Policy::kBlockM;
  params.n_blocks = out.n_tiles;
  params.out = out;
  const int64_t blocks = static_cast<int64_t>(params.m_blocks) * params.n_blocks;
  TWELL_REQUIRE(blocks < (int64_t{1} << 31), "gate_to_twell: {} output tiles exceed the grid limit", blocks);
  kernel<<<static_cast<unsigned>(blocks), Policy::kThreads, Policy::kSmemBytes, stream>>>(tma_x, tma_w, params);
  TWELL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void gate_to_twell(const bf16* x, int64_t rows, const DeviceFfnWeights& weights, int32_t tile, int32_t compression,
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
    launch_gate_to_twell<128>(x, rows, weights.relu_projection(), weights.d_model, pack, stream);
  } else {
    launch_gate_to_twell<256>(x, rows, weights.relu_projection(), weights.d_model, pack, stream);
  }
}

void gate_to_twell_complete(const bf16* x, int64_t rows, const DeviceFfnWeights& weights, int32_t tile,
                            int32_t compression, DeviceTwell& out, cudaStream_t stream) {
  gate_to_twell(x, rows, weights, tile, compression, out, stream);
  for (int32_t used = spill_rows_used(out, stream); used > out.spill_capacity; used = spill_rows_used(out, stream)) {
    reserve(out, out.shape, used + used / 4);
    gate_to_twell(x, rows, weights, tile, compression, out, stream);
  }
}

}  // namespace twell::cuda
