// The decode step's projections (decode_gemv.h). A block owns a contiguous range of W's rows and
// streams it through shared memory in loads of kWarps rows: one bulk copy (TMA, cp.async.bulk) per
// load into a ring of stages, each with an mbarrier; warp w takes row w of a load, lane l its 16-byte
// pieces l, l + 32, ... against x in shared memory. A bulk copy keeps tens of KB in flight for one
// instruction, so the weights stream at the copy rate with few warps (the first version, 16-byte
// loads from registers with an L2 prefetch, reached 2.1-2.5 TB/s on the H200: docs/perf-notes.md).
// Under the programmatic launch the first loads are issued before waiting for the previous kernel:
// W is the layer's own constant, so its first bytes arrive while attention or the FFN ends.
#include "cuda/decode_gemv.h"

#include <algorithm>

#include "cuda/cuda_utils.h"
#include "cuda/warp_math.cuh"

namespace twell::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxStages = 4;  // loads of kWarps rows in flight per block

struct GemvParams {
  GemvInput input;
  const bf16* w;  // [N, K]
  void* y;        // [M, N]
  GemvOutput output;
  GemvRmsNormTail tail;  // arrivals null: none
  int32_t rows, n, k, rows_per_block, stages;
};

__device__ __forceinline__ uint32_t pack_bf16(float low, float high) {
  return uint32_t{float_to_bf16_bits(low)} | uint32_t{float_to_bf16_bits(high)} << 16;
}

__device__ __forceinline__ void init_barrier(uint64_t* barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(barrier)) : "memory");
}
// `bytes` of global memory at `source` into shared memory at `target` (both 16-byte aligned, bytes a
// multiple of 16); `barrier`'s phase completes when they have arrived.
__device__ __forceinline__ void bulk_copy(void* target, const void* source, uint32_t bytes, uint64_t* barrier) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(target)),
      "l"(source), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
}
__device__ __forceinline__ void wait_barrier(uint64_t* barrier, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(shared_address(barrier)),
      "r"(phase)
      : "memory");
}

// inv_rms[m] = 1 / sqrt(mean(h[m]²) + eps) for the fp32 rows h [rows, K] (each block computes the same
// sums, in the same order: a row is 4·K bytes out of the L2). __ldcg: rows that other blocks of this
// grid added to are read from the L2, never from a stale L1 line.
template <int kMaxRows>
__device__ void rows_inv_rms(const float* hidden, int rows, int k, float eps, float* inv_rms) {
  __shared__ float warp_sums[kWarps][kMaxRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int m = 0; m < rows; ++m) {
    const auto* row = reinterpret_cast<const float4*>(hidden + static_cast<int64_t>(m) * k);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < k / 4; i += kThreads) {
      const float4 v = __ldcg(row + i);
      sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    sum = warp_sum(sum);
    if (lane == 0) warp_sums[warp][m] = sum;
  }
  __syncthreads();
  if (threadIdx.x < rows) {
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += warp_sums[w][threadIdx.x];
    inv_rms[threadIdx.x] = 1.0f / sqrtf(sum / k + eps);
  }
  __syncthreads();
}

// Columns 8·piece .. + 7 of bf16(weight ⊙ h_row · inv_rms), packed.
__device__ __forceinline__ uint4 normalized_piece(const float* h_row, const float* weight, float inv_rms, int piece) {
  const auto* h = reinterpret_cast<const float4*>(h_row) + 2 * piece;
  const auto* g = reinterpret_cast<const float4*>(weight) + 2 * piece;
  uint32_t packed[4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float4 v = __ldcg(h + half), w = g[half];
    packed[2 * half] = pack_bf16(w.x * (v.x * inv_rms), w.y * (v.y * inv_rms));
    packed[2 * half + 1] = pack_bf16(w.z * (v.z * inv_rms), w.w * (v.w * inv_rms));
  }
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// x [rows, K] as bf16 into shared memory: copied, or normalized from the fp32 rows.
template <int kMaxRows>
__device__ void stage_x(const GemvParams& p, uint4* x_shared) {
  const int pieces = p.k / 8;
  if (p.input.x != nullptr) {
    const auto* x = reinterpret_cast<const uint4*>(p.input.x);
    for (int i = threadIdx.x; i < p.rows * pieces; i += kThreads) x_shared[i] = x[i];
    return;
  }
  __shared__ float inv_rms[kMaxRows];
  rows_inv_rms<kMaxRows>(p.input.hidden, p.rows, p.k, p.input.eps, inv_rms);
  for (int i = threadIdx.x; i < p.rows * pieces; i += kThreads) {
    const int m = i / pieces;
    x_shared[i] = normalized_piece(p.input.hidden + static_cast<int64_t>(m) * p.k, p.input.norm_weight, inv_rms[m],
                                   i % pieces);
  }
}

// The tail of an f32_add call: the last block to finish normalizes the rows of y that all blocks added to.
template <int kMaxRows>
__device__ void rms_norm_tail(const GemvParams& p) {
  __shared__ bool is_last;
  __threadfence();  // this block's additions to y are visible before its arrival is counted
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(p.tail.arrivals, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  if (threadIdx.x == 0) *p.tail.arrivals = 0;  // for the next call or replay
  const auto* y = static_cast<const float*>(p.y);
  __shared__ float inv_rms[kMaxRows];
  rows_inv_rms<kMaxRows>(y, p.rows, p.n, p.tail.eps, inv_rms);
  const int pieces = p.n / 8;
  for (int i = threadIdx.x; i < p.rows * pieces; i += kThreads) {
    const int m = i / pieces;
    reinterpret_cast<uint4*>(p.tail.normed)[i] =
        normalized_piece(y + static_cast<int64_t>(m) * p.n, p.tail.weight, inv_rms[m], i % pieces);
  }
}

// At most two blocks an SM (the shared budget's plan) for the multi-row kernel: left to itself, ptxas
// gave it 32 registers and a 16-byte spill once the RMSNorm tail came in. 0 keeps the one-row
// kernel as it was measured (40 registers; the same SASS).
template <int kMaxRows>
__global__ void __launch_bounds__(kThreads, kMaxRows == 1 ? 0 : 2) decode_gemv_kernel(GemvParams p) {
  // [stages][kWarps rows][K] bf16, then x [rows][K] bf16
  extern __shared__ __align__(128) uint4 shared[];
  __shared__ uint64_t stage_full[kMaxStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int pieces = p.k / 8;
  const int64_t row_bytes = int64_t{p.k} * 2;
  const int first_row = blockIdx.x * p.rows_per_block, end_row = min(p.n, first_row + p.rows_per_block);
  const int loads = (end_row - first_row + kWarps - 1) / kWarps;
  uint4* x_shared = shared + p.stages * kWarps * pieces;
  const auto* w = reinterpret_cast<const uint4*>(p.w);
  auto issue = [&](int load) {  // rows first_row + kWarps·load .. into stage load % stages
    const int row = first_row + load * kWarps, count = min(kWarps, end_row - row);
    bulk_copy(shared + (load % p.stages) * kWarps * pieces, w + int64_t{row} * pieces,
              static_cast<uint32_t>(count * row_bytes), &stage_full[load % p.stages]);
  };
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < p.stages; ++stage) init_barrier(&stage_full[stage]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int load = 0; load < min(loads, p.stages); ++load) issue(load);
  }
  wait_for_previous_grid();
  stage_x<kMaxRows>(p, x_shared);
  __syncthreads();  // x and the initialized barriers
  allow_dependent_grids();

  for (int load = 0; load < loads; ++load) {
    wait_barrier(&stage_full[load % p.stages], (load / p.stages) & 1);
    const int row = first_row + load * kWarps + warp;
    if (row < end_row) {
      const uint4* weights = shared + ((load % p.stages) * kWarps + warp) * pieces;
      float sums[kMaxRows] = {};
      for (int piece = lane; piece < pieces; piece += 32) {
        const uint4 weight = weights[piece];
#pragma unroll
        for (int m = 0; m < kMaxRows; ++m)
          if (m < p.rows) sums[m] += dot8(weight, x_shared[m * pieces + piece]);
      }
#pragma unroll
      for (int m = 0; m < kMaxRows; ++m) {
        if (m >= p.rows) break;
        const float sum = warp_sum(sums[m]);
        if (lane != m) continue;
        const int64_t at = static_cast<int64_t>(m) * p.n + row;
        if (p.output == GemvOutput::bf16)
          static_cast<bf16*>(p.y)[at] = to_bf16(sum);
        else if (p.output == GemvOutput::f32)
          static_cast<float*>(p.y)[at] = sum;
        else
          static_cast<float*>(p.y)[at] += sum;
      }
    }
    if (load + p.stages < loads) {
      __syncthreads();  // every warp is done with the stage before the copy overwrites it
      if (threadIdx.x == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        issue(load + p.stages);
      }
    }
  }
  if (p.tail.arrivals != nullptr) rms_norm_tail<kMaxRows>(p);
}

// Shared memory a block takes: two blocks share an SM, so one block's loads stream while the other
// computes and exits.
int32_t shared_budget() { return device_facts().max_smem_per_block_optin / 2; }

int64_t stage_bytes(int32_t k) { return int64_t{kWarps} * k * 2; }

template <int kMaxRows>
void launch(const GemvParams& p, int blocks, cudaStream_t stream) {
  const size_t shared = static_cast<size_t>((p.stages * stage_bytes(p.k)) + int64_t{p.rows} * p.k * 2);
  static const bool configured = [] {
    TWELL_CUDA_CHECK(cudaFuncSetAttribute(decode_gemv_kernel<kMaxRows>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          device_facts().max_smem_per_block_optin - 4 * 1024));
    return true;
  }();
  (void)configured;
  launch_programmatic(decode_gemv_kernel<kMaxRows>, dim3(blocks), dim3(kThreads), shared, stream, p);
}

}  // namespace

bool decode_gemv_supports(int32_t rows, int32_t k) {
  return rows >= 1 && rows <= kDecodeGemvMaxRows && k >= 8 && k % 8 == 0 &&
         stage_bytes(k) + int64_t{rows} * k * 2 <= device_facts().max_smem_per_block_optin - 4 * 1024;
}

void decode_gemv(int32_t rows, int32_t n, int32_t k, const GemvInput& input, const bf16* w, void* y,
                 GemvOutput output, cudaStream_t stream, const GemvRmsNormTail& tail) {
  TWELL_REQUIRE(rows >= 1 && rows <= kDecodeGemvMaxRows, "decode_gemv: rows must lie in [1, {}], got {}",
                kDecodeGemvMaxRows, rows);
  TWELL_REQUIRE(n >= 1 && k >= 8 && k % 8 == 0,
                "decode_gemv: needs N >= 1 and K a positive multiple of 8, got N = {}, K = {}", n, k);
  TWELL_REQUIRE(decode_gemv_supports(rows, k),
                "decode_gemv: {} rows of W and {} of x at K = {} do not fit in a block's shared memory", kWarps, rows,
                k);
  TWELL_REQUIRE((input.x != nullptr) != (input.hidden != nullptr && input.norm_weight != nullptr),
                "decode_gemv: give either bf16 rows or fp32 rows with a norm weight");
  const auto aligned = [](const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; };
  TWELL_REQUIRE(aligned(w) && aligned(input.x) && aligned(input.hidden) && aligned(input.norm_weight),
                "decode_gemv: W, x, the fp32 rows and the norm weight must be 16-byte aligned");
  if (tail.arrivals != nullptr) {
    TWELL_REQUIRE(output == GemvOutput::f32_add && n % 8 == 0,
                  "decode_gemv: the RMSNorm tail needs the f32_add output and N a multiple of 8, got N = {}", n);
    TWELL_REQUIRE(tail.weight != nullptr && tail.normed != nullptr && aligned(tail.weight) && aligned(tail.normed) &&
                      aligned(y),
                  "decode_gemv: the RMSNorm tail needs a norm weight and an output, 16-byte aligned like y");
  }
  const int64_t x_bytes = int64_t{rows} * k * 2;
  const auto stages = static_cast<int32_t>(
      std::clamp<int64_t>((shared_budget() - x_bytes) / stage_bytes(k), 1, kMaxStages));
  // About two blocks per SM in all, each a whole number of loads.
  const int64_t blocks_wanted = int64_t{2} * device_facts().sm_count;
  const int64_t loads_per_block = std::max<int64_t>(1, (n + blocks_wanted * kWarps - 1) / (blocks_wanted * kWarps));
  const auto rows_per_block = static_cast<int32_t>(loads_per_block * kWarps);
  const auto blocks = static_cast<int>((n + rows_per_block - 1) / rows_per_block);
  const GemvParams p{input, w, y, output, tail, rows, n, k, rows_per_block, stages};
  if (rows == 1)
    launch<1>(p, blocks, stream);
  else
    launch<kDecodeGemvMaxRows>(p, blocks, stream);
}

}  // namespace twell::cuda
