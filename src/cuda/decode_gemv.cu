// The decode step's projections (decode_gemv.h). Each warp owns `rows_per_warp` consecutive rows of
// W and reads each of them once, in 16-byte pieces (lane l takes pieces l, l + 32, ...), two rows at a
// time with every piece of both in flight; x sits in shared memory. The grid is sized to about two
// blocks per SM, so the whole GPU streams W at once.
// Under the programmatic launch the first thing a warp does is ask the TMA unit to pull its rows of W
// into the L2 (cp.async.bulk.prefetch): W is the layer's own constant, so this overlaps the end of
// the previous kernel (attention, the FFN), and the rows are then read from the L2.
#include "cuda/decode_gemv.h"

#include <algorithm>

#include "cuda/cuda_utils.h"
#include "cuda/warp_math.cuh"

namespace twell::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kPiecesInFlight = 8;  // 16-byte pieces per lane and row loaded before any is used

struct GemvParams {
  GemvInput input;
  const bf16* w;  // [N, K]
  void* y;        // [M, N]
  GemvOutput output;
  int32_t rows, n, k, rows_per_warp;
};

__device__ __forceinline__ uint32_t pack_bf16(float low, float high) {
  return uint32_t{float_to_bf16_bits(low)} | uint32_t{float_to_bf16_bits(high)} << 16;
}

__device__ __forceinline__ void prefetch_to_l2(const void* address, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(address), "r"(bytes) : "memory");
}

// x [rows, K] as bf16 into shared memory: copied, or normalized from the fp32 rows (each block
// computes the same sums; a row is 4·K bytes out of the L2).
template <int kMaxRows>
__device__ void stage_x(const GemvParams& p, uint4* x_shared) {
  const int pieces = p.k / 8;
  if (p.input.x != nullptr) {
    const auto* x = reinterpret_cast<const uint4*>(p.input.x);
    for (int i = threadIdx.x; i < p.rows * pieces; i += kThreads) x_shared[i] = x[i];
    return;
  }
  __shared__ float warp_sums[kWarps][kMaxRows];
  __shared__ float inv_rms[kMaxRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int m = 0; m < p.rows; ++m) {
    const auto* row = reinterpret_cast<const float4*>(p.input.hidden + static_cast<int64_t>(m) * p.k);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < p.k / 4; i += kThreads) {
      const float4 v = row[i];
      sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    sum = warp_sum(sum);
    if (lane == 0) warp_sums[warp][m] = sum;
  }
  __syncthreads();
  if (threadIdx.x < p.rows) {
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += warp_sums[w][threadIdx.x];
    inv_rms[threadIdx.x] = 1.0f / sqrtf(sum / p.k + p.input.eps);
  }
  __syncthreads();
  const auto* weight = reinterpret_cast<const float4*>(p.input.norm_weight);
  for (int i = threadIdx.x; i < p.rows * pieces; i += kThreads) {
    const int m = i / pieces, piece = i % pieces;
    const auto* h = reinterpret_cast<const float4*>(p.input.hidden + static_cast<int64_t>(m) * p.k) + 2 * piece;
    const float scale = inv_rms[m];
    uint32_t packed[4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float4 v = h[half], g = weight[2 * piece + half];
      packed[2 * half] = pack_bf16(g.x * (v.x * scale), g.y * (v.y * scale));
      packed[2 * half + 1] = pack_bf16(g.z * (v.z * scale), g.w * (v.w * scale));
    }
    x_shared[i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

template <int kMaxRows>
__global__ void __launch_bounds__(kThreads) decode_gemv_kernel(GemvParams p) {
  extern __shared__ uint4 x_shared[];  // [rows, K / 8]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int pieces = p.k / 8;
  const int first_row = (blockIdx.x * kWarps + warp) * p.rows_per_warp;
  const int end_row = min(p.n, first_row + p.rows_per_warp);
  const auto* w = reinterpret_cast<const uint4*>(p.w);
  if (lane == 0 && first_row < end_row)
    prefetch_to_l2(w + static_cast<int64_t>(first_row) * pieces, static_cast<uint32_t>((end_row - first_row) * p.k * 2));
  wait_for_previous_grid();
  stage_x<kMaxRows>(p, x_shared);
  __syncthreads();
  allow_dependent_grids();

  for (int row = first_row; row < end_row; row += 2) {
    const bool has_second = row + 1 < end_row;
    const uint4* first = w + static_cast<int64_t>(row) * pieces;
    const uint4* second = has_second ? first + pieces : first;
    float sums[2][kMaxRows] = {};
    for (int base = lane; base < pieces; base += 32 * kPiecesInFlight) {
      uint4 a[kPiecesInFlight], b[kPiecesInFlight];
#pragma unroll
      for (int u = 0; u < kPiecesInFlight; ++u) {
        const int piece = base + 32 * u;
        const bool inside = piece < pieces;
        a[u] = inside ? __ldg(first + piece) : make_uint4(0u, 0u, 0u, 0u);
        b[u] = inside && has_second ? __ldg(second + piece) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < kPiecesInFlight; ++u) {
        const int piece = base + 32 * u;
        if (piece >= pieces) break;
#pragma unroll
        for (int m = 0; m < kMaxRows; ++m) {
          if (m >= p.rows) break;
          const uint4 x = x_shared[m * pieces + piece];
          sums[0][m] += dot8(a[u], x);
          sums[1][m] += dot8(b[u], x);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (r == 1 && !has_second) break;
#pragma unroll
      for (int m = 0; m < kMaxRows; ++m) {
        if (m >= p.rows) break;
        const float sum = warp_sum(sums[r][m]);
        if (lane != m) continue;
        const int64_t at = static_cast<int64_t>(m) * p.n + row + r;
        if (p.output == GemvOutput::bf16)
          static_cast<bf16*>(p.y)[at] = to_bf16(sum);
        else
          static_cast<float*>(p.y)[at] += sum;
      }
    }
  }
}

template <int kMaxRows>
void launch(const GemvParams& p, int blocks, cudaStream_t stream) {
  const size_t shared = static_cast<size_t>(p.rows) * p.k * sizeof(bf16);
  static const bool configured = [] {
    TWELL_CUDA_CHECK(cudaFuncSetAttribute(decode_gemv_kernel<kMaxRows>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          device_facts().max_smem_per_block_optin - 4 * 1024));
    return true;
  }();
  (void)configured;
  launch_programmatic(decode_gemv_kernel<kMaxRows>, dim3(blocks), dim3(kThreads), shared, stream, p);
}

}  // namespace

void decode_gemv(int32_t rows, int32_t n, int32_t k, const GemvInput& input, const bf16* w, void* y,
                 GemvOutput output, cudaStream_t stream) {
  TWELL_REQUIRE(rows >= 1 && rows <= kDecodeGemvMaxRows, "decode_gemv: rows must lie in [1, {}], got {}",
                kDecodeGemvMaxRows, rows);
  TWELL_REQUIRE(n >= 1 && k >= 8 && k % 8 == 0,
                "decode_gemv: needs N >= 1 and K a positive multiple of 8, got N = {}, K = {}", n, k);
  TWELL_REQUIRE((input.x != nullptr) != (input.hidden != nullptr && input.norm_weight != nullptr),
                "decode_gemv: give either bf16 rows or fp32 rows with a norm weight");
  const auto aligned = [](const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; };
  TWELL_REQUIRE(aligned(w) && aligned(input.x) && aligned(input.hidden) && aligned(input.norm_weight),
                "decode_gemv: W, x, the fp32 rows and the norm weight must be 16-byte aligned");
  const int64_t shared = int64_t{rows} * k * static_cast<int64_t>(sizeof(bf16));
  TWELL_REQUIRE(shared <= device_facts().max_smem_per_block_optin - 4 * 1024,
                "decode_gemv: {} rows of K = {} do not fit in a block's shared memory", rows, k);
  // About two blocks per SM in all; fewer rows per warp when N is small.
  const int64_t warps_wanted = int64_t{2} * device_facts().sm_count * kWarps;
  const auto rows_per_warp = static_cast<int32_t>(std::max<int64_t>(1, (n + warps_wanted - 1) / warps_wanted));
  const int64_t rows_per_block = int64_t{rows_per_warp} * kWarps;
  const auto blocks = static_cast<int>((n + rows_per_block - 1) / rows_per_block);
  const GemvParams p{input, w, y, output, rows, n, k, rows_per_warp};
  if (rows == 1)
    launch<1>(p, blocks, stream);
  else
    launch<kDecodeGemvMaxRows>(p, blocks, stream);
}

}  // namespace twell::cuda
