// Gate GEMM -> TwELL on sm_90a: g = relu(x·W^T) with x [M, D] and W [H, D] both K-major (a "TN"
// GEMM), bf16 operands, fp32 accumulators in registers, packed into TwELL by the epilogue
// (twell_pack_epilogue.cuh). A persistent, warp-specialised kernel of three warpgroups:
//   scheduler  grid = SM count x resident blocks (read from the device); block b takes the output
//              tiles b, b + grid, ... of a grouped raster, so a group of M-blocks reuses the weight
//              tiles from L2. Every role walks the same tile sequence.
//   producer   warp 0: one thread issues the TMA loads of x and W k-tiles into a kStages-deep ring of
//              64B-swizzled buffers (mbarrier with transaction bytes per stage), running ahead
//              across tiles; it waits only for a stage to be consumed ("empty" barrier).
//   consumers  warpgroups 1 and 2 (setmaxnreg up): WGMMA on their halves of the [BM, T] tile, one
//              k-tile batch in flight; a stage is released once its WGMMAs are done. Then the
//              accumulators go, relu'd, as bf16 into a staging tile in shared memory, and the
//              consumers start the next tile's mainloop at once.
//   packers    warps 1-3 (setmaxnreg down with the producer): pack the staged tile into TwELL while
//              the consumers run the next mainloop. Two named barriers hand the staging tile over
//              (full: consumers -> packers, empty: packers -> consumers).
#include <algorithm>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "cuda/cuda_utils.h"
#include "cuda/twell_pack_epilogue.cuh"
#include "twell/cuda.h"

namespace twell::cuda {
namespace {

using cute::_;
using cute::Int;
using Element = cutlass::bfloat16_t;

// Shared memory a block may use on sm_90 (227 KiB). The stage count is sized against it at compile
// time; the launch checks the device's own limit.
constexpr int kSmemBudget = 232448;

// Tile policy. Limits behind each number:
//   kBlockN = T: one block column tile is exactly one TwELL tile, so a staged row is a whole
//            TwELL tile row.
//   kBlockM: 256 at T=128 (each consumer warpgroup 128x128, two 64-row WGMMA atoms) and 128 at
//            T=256 (each 64x256): 128 fp32 accumulators per thread either way, and 48 KiB of
//            operands per k-tile for 4.2 MFLOP, which keeps the ring's L2 traffic near 9 TB/s at
//            the tensor cores' rate (a 128x128 tile would need about 13). 128 at T=128 for small
//            M, where 256-row tiles would leave SMs idle (choose_block_m).
//   kBlockK 32: one 64-byte swizzle atom of bf16 per row. Half the usual 64 so that the ring has
//            twice the stages in the shared memory the staging tile leaves: with one WGMMA batch in
//            flight, kStages - 2 stages are loading at any time, and 3 stages of 64 (one load in
//            flight) left the tensor cores waiting on L2 (measured: 419 TFLOP/s at T = 128).
//   kStages: as many k-tiles as fit beside the staging tile in kSmemBudget, at most kMaxStages
//            (6 at 24 KiB a stage, 8 at 16 KiB).
//   kGroupM: M-blocks per raster group: 2048 rows of x (8 MiB at D = 2048) stay in L2 while all of
//            W streams by.
//   registers: 384 threads at one block per SM get 168 each; the producer/packer warpgroup gives
//            some up and the consumers take them (80 + 2·208 <= 3·168 at T=128, where a packer lane
//            tracks two rows; 72 + 2·216 at T=256, where a consumer's 64x256 fragment needs 216).
template <int kTile, int kRows>
struct GatePolicy {
  static constexpr int kBlockM = kRows;
  static constexpr int kBlockN = kTile;
  static constexpr int kBlockK = 32;
  static constexpr int kMaxStages = 8;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kPackerWarps = 3;
  static constexpr int kPackerThreads = 32 * kPackerWarps;
  static constexpr int kProducerRegisters = kTile == 128 ? 80 : 72;
  static constexpr int kConsumerRegisters = kTile == 128 ? 208 : 216;
  static constexpr int kGroupM = 2048 / kBlockM;
  // Staging row stride: +8 bf16 shifts each row by 4 banks, so a warp's pair stores (8 rows x 4
  // column pairs) hit 32 different banks.
  static constexpr int kStagingStride = kBlockN + 8;

  static constexpr int kBytesStageA = kBlockM * kBlockK * 2;
  static constexpr int kBytesStageB = kBlockN * kBlockK * 2;
  static constexpr int kBytesStaging = kBlockM * kStagingStride * 2;
  // +1024: the swizzled buffers need 1024-byte alignment, the dynamic base only guarantees 16.
  static constexpr int kStages =
      std::min(kMaxStages, (kSmemBudget - kBytesStaging - 1024 - 2 * kMaxStages * 8) / (kBytesStageA + kBytesStageB));
  static_assert(kStages >= 3, "the ring needs at least 3 stages");
  static constexpr int kBytesA = kBytesStageA * kStages;
  static constexpr int kBytesB = kBytesStageB * kStages;
  static constexpr int kStagingOffset = kBytesA + kBytesB;
  static constexpr int kBarrierOffset = kStagingOffset + kBytesStaging;
  static constexpr int kSmemBytes = kBarrierOffset + 2 * kStages * 8 + 1024;
  static_assert(kSmemBytes <= kSmemBudget, "the ring, staging tile and barriers must fit");
  static constexpr int kTxBytes = kBytesStageA + kBytesStageB;

  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW64_Atom<Element>{},
                                                   cute::make_shape(Int<kBlockM>{}, Int<kBlockK>{}, Int<kStages>{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW64_Atom<Element>{},
                                                   cute::make_shape(Int<kBlockN>{}, Int<kBlockK>{}, Int<kStages>{})));
  using MmaAtom = std::conditional_t<
      kTile == 128, cute::SM90_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>,
      cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>>;
  // Two warpgroups stacked along M; at kBlockM = 256 each repeats its atom over two 64-row slabs.
  using TiledMma = decltype(cute::make_tiled_mma(MmaAtom{}, cute::Layout<cute::Shape<Int<2>, Int<1>, Int<1>>>{}));
  static_assert(cute::size(TiledMma{}) == kConsumerThreads, "two consumer warpgroups");
};

// Named barriers that hand the staging tile between consumers and packers (ids after CUTLASS's
// reserved ones).
enum StagingBarrier : uint32_t { kStagingFull = 0, kStagingEmpty = 1 };

struct GateParams {
  int32_t rows;     // M
  int32_t d_model;  // D
  int32_t m_blocks;
  int32_t n_blocks;  // = n_tiles
  int32_t tiles;     // m_blocks · n_blocks
  TwellPackOutput out;
};

// Grouped raster: linear tile -> (m_blk, n_blk). Within a group of kGroupM M-blocks the M-block
// varies fastest, so tiles taken at the same time by neighbouring blocks read the same weight tile.
template <int kGroupM>
__device__ __forceinline__ void raster(int tile, int m_blocks, int n_blocks, int& m_blk, int& n_blk) {
  const int tiles_per_group = kGroupM * n_blocks;
  const int group = tile / tiles_per_group;
  const int first_m = group * kGroupM;
  const int group_rows = min(m_blocks - first_m, kGroupM);
  const int in_group = tile - group * tiles_per_group;
  m_blk = first_m + in_group % group_rows;
  n_blk = in_group / group_rows;
}

// Position in the ring: stage and the parity of its current use.
template <int kStages>
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

template <class Policy, class TmaX, class TmaW>
__global__ void __launch_bounds__(Policy::kThreads, 1)
    gate_to_twell_kernel(CUTE_GRID_CONSTANT TmaX const tma_x, CUTE_GRID_CONSTANT TmaW const tma_w, GateParams params) {
  using namespace cute;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  using cutlass::arch::NamedBarrier;
  constexpr int kBlockM = Policy::kBlockM, kBlockN = Policy::kBlockN, kBlockK = Policy::kBlockK;
  constexpr int kStages = Policy::kStages;
  constexpr int kHandoverThreads = Policy::kConsumerThreads + Policy::kPackerThreads;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  Element* smem_x = reinterpret_cast<Element*>(smem);
  Element* smem_w = reinterpret_cast<Element*>(smem + Policy::kBytesA);
  uint16_t* staging = reinterpret_cast<uint16_t*>(smem + Policy::kStagingOffset);  // [BLK_M, kStagingStride]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Policy::kBarrierOffset);  // [kStages] TMA landed
  uint64_t* empty = full + kStages;                                              // [kStages] stage consumed

  Tensor sX = make_tensor(make_smem_ptr(smem_x), typename Policy::SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
  Tensor sW = make_tensor(make_smem_ptr(smem_w), typename Policy::SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
  const int k_tiles = params.d_model / kBlockK;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      FullBarrier::init(&full[stage], 1);
      EmptyBarrier::init(&empty[stage], Policy::kConsumerThreads / 32);  // one arrival per consumer warp
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp < 4) {
    cutlass::arch::warpgroup_reg_dealloc<Policy::kProducerRegisters>();
    if (warp == 0) {
      if (threadIdx.x != 0) return;
      Tensor mX = tma_x.get_tma_tensor(make_shape(params.rows, params.d_model));      // (M,K)
      Tensor mW = tma_w.get_tma_tensor(make_shape(params.out.cols, params.d_model));  // (N,K)
      RingPosition<kStages> ring;
      for (int tile = blockIdx.x; tile < params.tiles; tile += gridDim.x) {
        int m_blk, n_blk;
        raster<Policy::kGroupM>(tile, params.m_blocks, params.n_blocks, m_blk, n_blk);
        Tensor gX = local_tile(mX, make_shape(Int<kBlockM>{}, Int<kBlockK>{}), make_coord(m_blk, _));  // (BLK_M,BLK_K,k)
        Tensor gW = local_tile(mW, make_shape(Int<kBlockN>{}, Int<kBlockK>{}), make_coord(n_blk, _));  // (BLK_N,BLK_K,k)
        auto [tXgX, tXsX] = tma_partition(tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
        auto [tWgW, tWsW] = tma_partition(tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sW), group_modes<0, 2>(gW));
        for (int k = 0; k < k_tiles; ++k, ring.advance()) {
          EmptyBarrier::wait(&empty[ring.stage], ring.phase ^ 1u);  // a fresh barrier passes parity 1
          FullBarrier::arrive_and_expect_tx(&full[ring.stage], Policy::kTxBytes);
          copy(tma_x.with(full[ring.stage]), tXgX(_, k), tXsX(_, ring.stage));
          copy(tma_w.with(full[ring.stage]), tWgW(_, k), tWsW(_, ring.stage));
        }
      }
    } else {
      const int packer_warp = warp - 1;
      unsigned long long found = 0;
      for (int tile = blockIdx.x; tile < params.tiles; tile += gridDim.x) {
        int m_blk, n_blk;
        raster<Policy::kGroupM>(tile, params.m_blocks, params.n_blocks, m_blk, n_blk);
        NamedBarrier::sync(kHandoverThreads, kStagingFull);
        found += pack_staged_tile<kBlockM, kBlockN, Policy::kStagingStride, Policy::kPackerWarps>(
            staging, static_cast<int64_t>(m_blk) * kBlockM, n_blk, params.out, packer_warp);
        // The consumers wait for this before staging the next tile; after the last tile nobody does.
        if (tile + static_cast<int>(gridDim.x) < params.tiles) NamedBarrier::arrive(kHandoverThreads, kStagingEmpty);
      }
      if (threadIdx.x % (kBlockN / 8) == 0 && found > 0) atomicAdd(params.out.nnz_total, found);  // one lane a row group
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Policy::kConsumerRegisters>();
    const int consumer = threadIdx.x - 128;
    typename Policy::TiledMma mma;
    ThrMMA thr_mma = mma.get_thread_slice(consumer);
    Tensor tCsX = thr_mma.partition_A(sX);        // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCsW = thr_mma.partition_B(sW);        // (MMA,MMA_N,MMA_K,PIPE)
    Tensor tCrX = thr_mma.make_fragment_A(tCsX);  // descriptors
    Tensor tCrW = thr_mma.make_fragment_B(tCsW);
    Tensor accum = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA,MMA_M,MMA_N) fp32
    Tensor tCcC = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kBlockM>{}, Int<kBlockN>{})));  // -> (m,n)
    RingPosition<kStages> ring;
    bool staging_in_use = false;
    for (int tile = blockIdx.x; tile < params.tiles; tile += gridDim.x) {
      clear(accum);
      // One WGMMA batch stays in flight: k-tile k is issued before k-1's stage is released.
      int previous_stage = -1;
      for (int k = 0; k < k_tiles; ++k, ring.advance()) {
        FullBarrier::wait(&full[ring.stage], ring.phase);
        warpgroup_fence_operand(accum);
        warpgroup_arrive();
        gemm(mma, tCrX(_, _, _, ring.stage), tCrW(_, _, _, ring.stage), accum);
        warpgroup_commit_batch();
        warpgroup_wait<1>();
        warpgroup_fence_operand(accum);
        if (previous_stage >= 0 && lane == 0) EmptyBarrier::arrive(&empty[previous_stage]);
        previous_stage = ring.stage;
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(accum);
      if (lane == 0) EmptyBarrier::arrive(&empty[previous_stage]);

      if (staging_in_use) NamedBarrier::sync(kHandoverThreads, kStagingEmpty);
      // Accumulator elements i, i+1 are columns c, c+1 of one row (the WGMMA C fragment holds
      // column pairs), so each pair is one 4-byte store.
      CUTE_UNROLL
      for (int i = 0; i < size(accum); i += 2) {
        const int r = get<0>(tCcC(i));
        const int c = get<1>(tCcC(i));
        *reinterpret_cast<uint32_t*>(staging + r * Policy::kStagingStride + c) = stage_relu_bf16x2(accum(i), accum(i + 1));
      }
      NamedBarrier::arrive(kHandoverThreads, kStagingFull);
      staging_in_use = true;
    }
  }
}

// Rows per block tile at T = 128: 256 when waves of 256-row tiles take no longer than waves of
// 128-row tiles, counting a 256-row tile as 1.8 128-row tiles (its operands are reused more); so at
// small M, where 256-row tiles would leave SMs idle, 128 (M = 256, H = 5632: 88 tiles, not 44).
int choose_block_m(int64_t rows, int32_t n_tiles, int sm_count) {
  const auto waves = [&](int block_m) {
    const int64_t tiles = (rows + block_m - 1) / block_m * n_tiles;
    return (tiles + sm_count - 1) / sm_count;
  };
  return 18 * waves(256) <= 10 * waves(128) ? 256 : 128;
}

template <int kTile, int kRows>
void launch_gate_to_twell(const bf16* x, int64_t rows, const bf16* weight, int32_t d_model, const TwellPackOutput& out,
                          cudaStream_t stream) {
  using namespace cute;
  using Policy = GatePolicy<kTile, kRows>;
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
  static const int blocks_per_sm = [&] {
    TWELL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Policy::kSmemBytes));
    int resident = 0;
    TWELL_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, Policy::kThreads, Policy::kSmemBytes));
    TWELL_REQUIRE(resident >= 1, "gate_to_twell with T={}: no block fits on a multiprocessor", kTile);
    return resident;
  }();

  GateParams params{};
  params.rows = m;
  params.d_model = d_model;
  params.m_blocks = (m + Policy::kBlockM - 1) / Policy::kBlockM;
  params.n_blocks = out.n_tiles;
  const int64_t tiles = static_cast<int64_t>(params.m_blocks) * params.n_blocks;
  TWELL_REQUIRE(tiles < (int64_t{1} << 31) - (int64_t{facts.sm_count} * blocks_per_sm),
                "gate_to_twell: {} output tiles exceed the scheduler's range", tiles);
  params.tiles = static_cast<int32_t>(tiles);
  params.out = out;
  const int64_t grid = std::min<int64_t>(tiles, int64_t{facts.sm_count} * blocks_per_sm);
  kernel<<<static_cast<unsigned>(grid), Policy::kThreads, Policy::kSmemBytes, stream>>>(tma_x, tma_w, params);
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
  const bf16* weight = weights.relu_projection();
  if (tile == 256) {
    launch_gate_to_twell<256, 128>(x, rows, weight, weights.d_model, pack, stream);
  } else if (choose_block_m(rows, pack.n_tiles, device_facts().sm_count) == 256) {
    launch_gate_to_twell<128, 256>(x, rows, weight, weights.d_model, pack, stream);
  } else {
    launch_gate_to_twell<128, 128>(x, rows, weight, weights.d_model, pack, stream);
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
