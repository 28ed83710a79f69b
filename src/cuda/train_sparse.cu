// The sparse products of the training FFN and the elementwise kernels of its backup rows and of
// its dense path. bf16 operands, fp32 accumulation; rows are read as 16-byte vectors (D % 8 == 0).
#include <cuda_bf16.h>

#include "cuda/train_kernels.cuh"
#include "cuda/warp_math.cuh"
#include "twell/error.h"

namespace twell::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kVector = 8;  // bf16 per 16-byte load

__device__ __forceinline__ void unpack8(const uint4& packed, float (&out)[kVector]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&in)[kVector]) {
  uint4 packed;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return packed;
}

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  float fa[kVector], fb[kVector];
  unpack8(a, fa);
  unpack8(b, fb);
#pragma unroll
  for (int i = 0; i < kVector; ++i) acc = fmaf(fa[i], fb[i], acc);
  return acc;
}

__device__ __forceinline__ void axpy8(float alpha, const uint4& x, float (&acc)[kVector]) {
  float fx[kVector];
  unpack8(x, fx);
#pragma unroll
  for (int i = 0; i < kVector; ++i) acc[i] = fmaf(alpha, fx[i], acc[i]);
}


__device__ __forceinline__ float bf16_at(const bf16* p, int64_t i) { return bf16_to_float(p[i].bits); }
__device__ __forceinline__ float sign_of(float v) { return static_cast<float>((v > 0.0f) - (v < 0.0f)); }

// Sum over the block in a fixed order (deterministic); every thread gets the result.
template <typename T>
__device__ T block_sum(T value, T* shared /* [blockDim.x / 32] */) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}

// ---- Sampled products: block per row, each warp takes entries k = warp, warp + warps, ... ----

constexpr int kSampledWarps = 4;

struct UpEpilogue {
  const uint16_t* g_values;  // [M, W] bf16 bits
  float* u_ell;              // [M, W]
  float* h_ell;              // [M, W]
  __device__ float operator()(int64_t e, float u) const {
    const float h = bf16_to_float(g_values[e]) * u;
    u_ell[e] = u;
    h_ell[e] = h;
    return fabsf(h);
  }
};

struct HiddenGradEpilogue {
  const uint16_t* g_values;  // [M, W]
  const float* u_ell;        // [M, W]
  const float* h_ell;        // [M, W]
  float l1_scale;            // coeff / M
  float* dg_ell;             // [M, W]
  float* du_ell;             // [M, W]
  __device__ float operator()(int64_t e, float dot) const {
    const float g = bf16_to_float(g_values[e]);
    const float dh = dot + l1_scale * sign_of(h_ell[e]);
    dg_ell[e] = g != 0.0f ? dh * u_ell[e] : 0.0f;  // relu' = 1 exactly where g is non-zero
    du_ell[e] = dh * g;
    return 0.0f;
  }
};

// For each ELL entry (r, k): epilogue(r·W + k, dense[r, :]·weight[col, :]); row_stat[r] = Σ epilogue.
template <typename Epilogue>
__global__ void __launch_bounds__(kSampledWarps * kWarp)
    sampled_row_dot_kernel(HybridView gate, const bf16* dense, const bf16* weight, int32_t d_model,
                           Epilogue epilogue, float* row_stat) {
  __shared__ float warp_stat[kSampledWarps];
  const int64_t row = blockIdx.x;
  const int32_t width = gate.shape.ell_width;
  const int32_t nnz = gate.row_nnz[row];
  if (nnz > width) return;  // a backup row: the dense path computes it
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int32_t vectors = d_model / kVector;
  const uint4* dense_row = reinterpret_cast<const uint4*>(dense + row * d_model);  // [D / 8]
  float stat = 0.0f;
  // Two entries per pass: the row of `dense` is loaded once for both, and twice the loads are in flight.
  for (int32_t k = warp; k < nnz; k += 2 * kSampledWarps) {
    const int64_t e0 = row * width + k;
    const bool has_second = k + kSampledWarps < nnz;
    const int64_t e1 = has_second ? e0 + kSampledWarps : e0;
    const uint4* w0 = reinterpret_cast<const uint4*>(weight + static_cast<int64_t>(gate.ell_cols[e0]) * d_model);
    const uint4* w1 = reinterpret_cast<const uint4*>(weight + static_cast<int64_t>(gate.ell_cols[e1]) * d_model);
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 4
    for (int32_t v = lane; v < vectors; v += kWarp) {
      const uint4 xv = __ldg(dense_row + v);
      const uint4 wv0 = __ldg(w0 + v);
      const uint4 wv1 = __ldg(w1 + v);
      acc0 = dot8(xv, wv0, acc0);
      acc1 = dot8(xv, wv1, acc1);
    }
    acc0 = warp_sum(acc0);
    acc1 = warp_sum(acc1);
    if (lane == 0) {
      stat += epilogue(e0, acc0);
      if (has_second) stat += epilogue(e1, acc1);
    }
  }
  if (row_stat == nullptr) return;
  if (lane == 0) warp_stat[warp] = stat;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kSampledWarps; ++w) total += warp_stat[w];
    row_stat[row] = total;
  }
}

// ---- Row-gather products: block per output row, each thread owns 8 consecutive columns ----

constexpr int kMaxBatch = 256;  // entries staged in shared memory at a time (= the largest block)

int row_block_threads(int32_t d_model) {
  const int vectors = d_model / kVector;
  return std::min(kMaxBatch, ((vectors + kWarp - 1) / kWarp) * kWarp);
}

// out[r, :] = Σ_k a[r, k]·Wa[col(r, k), :] (+ b with Wb), ELL rows only.
template <bool kTwoTerms>
__global__ void ell_rows_kernel(HybridView gate, const float* a_ell, const bf16* w_a, const float* b_ell,
                                const bf16* w_b, int32_t d_model, bf16* out) {
  __shared__ int32_t s_col[kMaxBatch];
  __shared__ float s_a[kMaxBatch];
  __shared__ float s_b[kMaxBatch];
  const int64_t row = blockIdx.x;
  const int32_t width = gate.shape.ell_width;
  const int32_t nnz = gate.row_nnz[row];
  if (nnz > width) return;
  const int32_t vectors = d_model / kVector;
  const int batch = blockDim.x;
  for (int32_t v0 = 0; v0 < vectors; v0 += blockDim.x) {
    const int32_t v = v0 + threadIdx.x;
    const bool active = v < vectors;
    float acc[kVector] = {};
    for (int32_t k0 = 0; k0 < nnz; k0 += batch) {
      const int n = min(batch, nnz - k0);
      __syncthreads();
      if (threadIdx.x < n) {
        const int64_t e = row * width + k0 + threadIdx.x;
        s_col[threadIdx.x] = gate.ell_cols[e];
        s_a[threadIdx.x] = a_ell[e];
        if (kTwoTerms) s_b[threadIdx.x] = b_ell[e];
      }
      __syncthreads();
      if (!active) continue;
#pragma unroll 4
      for (int k = 0; k < n; ++k) {
        const int64_t offset = static_cast<int64_t>(s_col[k]) * d_model;
        axpy8(s_a[k], __ldg(reinterpret_cast<const uint4*>(w_a + offset) + v), acc);
        if (kTwoTerms) axpy8(s_b[k], __ldg(reinterpret_cast<const uint4*>(w_b + offset) + v), acc);
      }
    }
    if (active) reinterpret_cast<uint4*>(out + row * d_model)[v] = pack8(acc);
  }
}

// Blocks of the weight-gradient kernel: one chunk of one list per block of 256 threads, a thread
// owning 8 columns of D = 2048 (more columns: it loops). What limits the kernel is the chain of
// dependent loads of each block (its chunk's neuron, the list, the values, then the rows), so small
// blocks, several resident per SM, overlap those chains; 1024-thread blocks (four groups of 256 on
// one chunk) fit once per SM at their 44-58 registers and ran the bulk of the lists at ~2 TB/s.
// kMinNeuronBlocksPerSm caps the registers so that 4 blocks fit.
constexpr int kMinNeuronBlocksPerSm = 4;
constexpr int kNeuronRowsInFlight = 8;  // row loads a thread issues before the first is used

// The chunked neuron lists (NeuronLists) as the kernel reads them.
struct ChunkedLists {
  const int32_t* col_start;
  const int32_t* chunk_start;
  const int32_t* chunk_neuron;
  uint32_t* chunk_tickets;
  const int32_t* sorted_entries;
  int32_t cols;
  int32_t chunk_entries;
};

// out[j, :] += the partial rows of neuron j's chunks 1.. in chunk order, read past the L1 (other
// SMs wrote them). A thread owns 8 columns, as in the kernel below.
__device__ void add_chunk_partials(int64_t neuron, int64_t first_partial, int32_t partials, const float* partial,
                                   int32_t d_model, float* out) {
  const int32_t vectors = d_model / kVector;
  for (int32_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    float4* dst = reinterpret_cast<float4*>(out + neuron * d_model) + 2 * v;
    float4 lo = __ldcg(dst), hi = __ldcg(dst + 1);
    for (int32_t c = 0; c < partials; ++c) {
      const float4* src = reinterpret_cast<const float4*>(partial + (first_partial + c) * d_model) + 2 * v;
      const float4 plo = __ldcg(src), phi = __ldcg(src + 1);
      lo = make_float4(lo.x + plo.x, lo.y + plo.y, lo.z + plo.z, lo.w + plo.w);
      hi = make_float4(hi.x + phi.x, hi.y + phi.y, hi.z + phi.z, hi.w + phi.w);
    }
    dst[0] = lo;
    dst[1] = hi;
  }
}

// Σ a[e]·rows[row(e), :] over one chunk of neuron j's list (and the same with b), fp32: chunk 0
// into out_a[j, :], chunk c > 0 into its partial slot (NeuronLists); the neuron's last chunk to
// finish adds the partial rows. Block = one chunk; a thread owns 8 columns.
template <bool kTwoTerms>
__global__ void __launch_bounds__(kMaxBatch, kMinNeuronBlocksPerSm)
    neuron_grad_kernel(ChunkedLists lists, int32_t width, const float* a_ell, const float* b_ell, const bf16* rows,
                       int32_t d_model, float* out_a, float* out_b, float* partial_a, float* partial_b) {
  __shared__ int32_t s_row[kMaxBatch];
  __shared__ float s_a[kMaxBatch];
  __shared__ float s_b[kMaxBatch];
  const int32_t chunk = blockIdx.x;
  if (chunk >= lists.chunk_start[lists.cols]) return;  // the grid is launched for the bound
  const int64_t neuron = lists.chunk_neuron[chunk];
  const int32_t chunk_in_list = chunk - lists.chunk_start[neuron];
  const int32_t begin = lists.col_start[neuron] + chunk_in_list * lists.chunk_entries;
  const int32_t end = min(lists.col_start[neuron + 1], begin + lists.chunk_entries);
  const int64_t first_partial = lists.chunk_start[neuron] - neuron;
  const int64_t dst_row = chunk_in_list == 0 ? neuron : first_partial + chunk_in_list - 1;
  float* dst_rows_a = chunk_in_list == 0 ? out_a : partial_a;
  float* dst_rows_b = chunk_in_list == 0 ? out_b : partial_b;
  const int32_t* sorted_entries = lists.sorted_entries;
  const int32_t vectors = d_model / kVector;
  for (int32_t v0 = 0; v0 < vectors; v0 += blockDim.x) {
    const int32_t v = v0 + threadIdx.x;
    const bool active = v < vectors;
    float acc_a[kVector] = {}, acc_b[kVector] = {};
    for (int32_t k0 = begin; k0 < end; k0 += blockDim.x) {
      const int n = min(static_cast<int32_t>(blockDim.x), end - k0);
      __syncthreads();
      if (threadIdx.x < n) {
        const int32_t e = sorted_entries[k0 + threadIdx.x];
        s_row[threadIdx.x] = e / width;
        s_a[threadIdx.x] = a_ell[e];
        if (kTwoTerms) s_b[threadIdx.x] = b_ell[e];
      }
      __syncthreads();
      if (!active) continue;
#pragma unroll kNeuronRowsInFlight
      for (int k = 0; k < n; ++k) {
        const uint4 r = __ldg(reinterpret_cast<const uint4*>(rows + static_cast<int64_t>(s_row[k]) * d_model) + v);
        axpy8(s_a[k], r, acc_a);
        if (kTwoTerms) axpy8(s_b[k], r, acc_b);
      }
    }
    if (!active) continue;
    float4* dst_a = reinterpret_cast<float4*>(dst_rows_a + dst_row * d_model) + 2 * v;
    dst_a[0] = make_float4(acc_a[0], acc_a[1], acc_a[2], acc_a[3]);
    dst_a[1] = make_float4(acc_a[4], acc_a[5], acc_a[6], acc_a[7]);
    if (kTwoTerms) {
      float4* dst_b = reinterpret_cast<float4*>(dst_rows_b + dst_row * d_model) + 2 * v;
      dst_b[0] = make_float4(acc_b[0], acc_b[1], acc_b[2], acc_b[3]);
      dst_b[1] = make_float4(acc_b[4], acc_b[5], acc_b[6], acc_b[7]);
    }
  }
  const int32_t chunks = lists.chunk_start[neuron + 1] - lists.chunk_start[neuron];
  if (chunks == 1) return;
  __shared__ bool last;
  __threadfence();  // this block's row is visible before its ticket says so
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(lists.chunk_tickets + neuron, 1u) == static_cast<uint32_t>(chunks - 1);
    if (last) lists.chunk_tickets[neuron] = 0;  // every other chunk has taken its ticket
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  add_chunk_partials(neuron, first_partial, chunks - 1, partial_a, d_model, out_a);
  if (kTwoTerms) add_chunk_partials(neuron, first_partial, chunks - 1, partial_b, d_model, out_b);
}

// ---- Rows moved between the [M, D] matrices and the dense backup blocks ----

__global__ void gather_rows_kernel(const bf16* src, const int32_t* rows, int32_t d_model, bf16* dense) {
  const int64_t b = blockIdx.x;
  const uint4* from = reinterpret_cast<const uint4*>(src + static_cast<int64_t>(rows[b]) * d_model);
  uint4* to = reinterpret_cast<uint4*>(dense + b * d_model);
  for (int32_t v = threadIdx.x; v < d_model / kVector; v += blockDim.x) to[v] = from[v];
}

__global__ void scatter_rows_kernel(const float* src, const int32_t* rows, int32_t d_model, bf16* dst) {
  const int64_t b = blockIdx.x;
  const float4* from = reinterpret_cast<const float4*>(src + b * d_model);
  uint4* to = reinterpret_cast<uint4*>(dst + static_cast<int64_t>(rows[b]) * d_model);
  for (int32_t v = threadIdx.x; v < d_model / kVector; v += blockDim.x) {
    const float4 lo = from[2 * v], hi = from[2 * v + 1];
    const float values[kVector] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    to[v] = pack8(values);
  }
}

__global__ void scatter_rows_kernel(const bf16* src, const int32_t* rows, int32_t d_model, bf16* dst) {
  const int64_t b = blockIdx.x;
  const uint4* from = reinterpret_cast<const uint4*>(src + b * d_model);
  uint4* to = reinterpret_cast<uint4*>(dst + static_cast<int64_t>(rows[b]) * d_model);
  for (int32_t v = threadIdx.x; v < d_model / kVector; v += blockDim.x) to[v] = from[v];
}

// ---- Elementwise: block per row ----

constexpr int kElementwiseThreads = 256;

// Backup rows: g relu'd bf16, u fp32 (cuBLASLt output).
__global__ void backup_product_kernel(const bf16* g, const float* u, int32_t d_hidden, const int32_t* row_of,
                                      bf16* h, float* l1_row) {
  __shared__ float partial[kElementwiseThreads / kWarp];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * d_hidden;
  float l1 = 0.0f;
  for (int32_t c = threadIdx.x; c < d_hidden; c += blockDim.x) {
    const float gv = bf16_at(g, base + c);
    const float hv = gv != 0.0f ? gv * u[base + c] : 0.0f;
    h[base + c] = to_bf16(hv);
    l1 += fabsf(hv);
  }
  l1 = block_sum(l1, partial);
  if (threadIdx.x == 0) l1_row[row_of[blockIdx.x]] = l1;
}

__global__ void backup_product_grad_kernel(const bf16* g, const float* u, const float* dh, int32_t d_hidden,
                                           float l1_scale, bf16* dg, bf16* du) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * d_hidden;
  for (int32_t c = threadIdx.x; c < d_hidden; c += blockDim.x) {
    const float gv = bf16_at(g, base + c);
    float dgv = 0.0f, duv = 0.0f;
    if (gv != 0.0f) {
      const float uv = u[base + c];
      const float d = dh[base + c] + l1_scale * sign_of(gv * uv);
      dgv = d * uv;
      duv = d * gv;
    }
    dg[base + c] = to_bf16(dgv);
    du[base + c] = to_bf16(duv);
  }
}

// Dense path: kVec = 8 when H % 8 == 0 (16-byte vectors), else 1.
template <int kVec>
__device__ __forceinline__ void load_row_values(const bf16* p, float (&out)[kVec]) {
  if constexpr (kVec == kVector) {
    unpack8(*reinterpret_cast<const uint4*>(p), out);
  } else {
    out[0] = bf16_to_float(p->bits);
  }
}
template <int kVec>
__device__ __forceinline__ void store_row_values(bf16* p, const float (&in)[kVec]) {
  if constexpr (kVec == kVector) {
    *reinterpret_cast<uint4*>(p) = pack8(in);
  } else {
    *p = to_bf16(in[0]);
  }
}

template <int kVec>
__global__ void dense_product_kernel(const bf16* gate_up, int64_t stride, int32_t d_hidden, bf16* h, float* l1_row,
                                     int32_t* nnz_row) {
  __shared__ float partial[kElementwiseThreads / kWarp];
  __shared__ int32_t partial_count[kElementwiseThreads / kWarp];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * d_hidden;
  const bf16* g_pre = gate_up + static_cast<int64_t>(blockIdx.x) * 2 * stride;
  const bf16* u = g_pre + stride;
  float l1 = 0.0f;
  int32_t count = 0;
  for (int32_t c = threadIdx.x * kVec; c < d_hidden; c += blockDim.x * kVec) {
    float gv[kVec], uv[kVec], hv[kVec];
    load_row_values(g_pre + c, gv);
    load_row_values(u + c, uv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const bool on = gv[i] > 0.0f;
      hv[i] = on ? gv[i] * uv[i] : 0.0f;
      l1 += fabsf(hv[i]);
      count += on ? 1 : 0;
    }
    store_row_values(h + base + c, hv);
  }
  l1 = block_sum(l1, partial);
  count = block_sum(count, partial_count);
  if (threadIdx.x == 0) {
    l1_row[blockIdx.x] = l1;
    nnz_row[blockIdx.x] = count;
  }
}

template <int kVec>
__global__ void dense_product_grad_kernel(bf16* gate_up, int64_t stride, const bf16* dh, int32_t d_hidden,
                                          float l1_scale) {
  bf16* g_then_dg = gate_up + static_cast<int64_t>(blockIdx.x) * 2 * stride;
  bf16* u_then_du = g_then_dg + stride;
  const bf16* dh_row = dh + static_cast<int64_t>(blockIdx.x) * d_hidden;
  for (int32_t c = threadIdx.x * kVec; c < d_hidden; c += blockDim.x * kVec) {
    float gv[kVec], uv[kVec], dhv[kVec], dg[kVec], du[kVec];
    load_row_values(g_then_dg + c, gv);
    load_row_values(u_then_du + c, uv);
    load_row_values(dh_row + c, dhv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const bool on = gv[i] > 0.0f;
      const float d = dhv[i] + l1_scale * sign_of(gv[i] * uv[i]);
      dg[i] = on ? d * uv[i] : 0.0f;
      du[i] = on ? d * gv[i] : 0.0f;
    }
    store_row_values(g_then_dg + c, dg);
    store_row_values(u_then_du + c, du);
  }
}

constexpr int kStatsThreads = 256;

__global__ void __launch_bounds__(kStatsThreads) finish_stats_kernel(const float* l1_row, const int32_t* nnz_row,
                                                                     int64_t rows, double l1_scale, double* stats,
                                                                     uint32_t* ticket) {
  __shared__ double partial[kStatsThreads / kWarp];
  __shared__ bool last;
  double l1 = 0.0, nnz = 0.0;
  const int64_t step = int64_t{kStepStatsBlocks} * kStatsThreads;
  for (int64_t r = blockIdx.x * int64_t{kStatsThreads} + threadIdx.x; r < rows; r += step) {
    l1 += l1_row[r];
    nnz += nnz_row[r];
  }
  l1 = block_sum(l1, partial);
  nnz = block_sum(nnz, partial);
  double* block_sums = stats + 2;
  if (threadIdx.x == 0) {
    block_sums[2 * blockIdx.x] = l1;
    block_sums[2 * blockIdx.x + 1] = nnz;
    __threadfence();  // the sums are visible before the ticket says so
    last = atomicAdd(ticket, 1u) == kStepStatsBlocks - 1;
  }
  __syncthreads();
  if (!last || threadIdx.x != 0) return;
  __threadfence();
  double l1_total = 0.0, nnz_total = 0.0;
  for (int b = 0; b < kStepStatsBlocks; ++b) {
    l1_total += __ldcg(block_sums + 2 * b);  // past the L1: other SMs wrote them
    nnz_total += __ldcg(block_sums + 2 * b + 1);
  }
  stats[0] = l1_scale * l1_total;
  stats[1] = nnz_total / static_cast<double>(rows);
  *ticket = 0;
}

unsigned grid_of(int64_t blocks) {
  TWELL_REQUIRE(blocks >= 1 && blocks < (int64_t{1} << 31), "grid of {} blocks is out of range", blocks);
  return static_cast<unsigned>(blocks);
}

}  // namespace

void sampled_up_projection(const HybridView& gate, const bf16* x, const bf16* w_up, int32_t d_model, float* u_ell,
                           float* h_ell, float* l1_row, cudaStream_t stream) {
  const UpEpilogue epilogue{reinterpret_cast<const uint16_t*>(gate.ell_values), u_ell, h_ell};
  sampled_row_dot_kernel<<<grid_of(gate.shape.rows), kSampledWarps * kWarp, 0, stream>>>(gate, x, w_up, d_model,
                                                                                       epilogue, l1_row);
  TWELL_CUDA_CHECK_LAUNCH();
}

void sampled_hidden_grad(const HybridView& gate, const bf16* dy, const bf16* w_down, int32_t d_model,
                         const float* u_ell, const float* h_ell, float l1_scale, float* dg_ell, float* du_ell,
                         cudaStream_t stream) {
  const HiddenGradEpilogue epilogue{reinterpret_cast<const uint16_t*>(gate.ell_values), u_ell, h_ell, l1_scale,
                                    dg_ell, du_ell};
  sampled_row_dot_kernel<<<grid_of(gate.shape.rows), kSampledWarps * kWarp, 0, stream>>>(gate, dy, w_down, d_model,
                                                                                       epilogue, nullptr);
  TWELL_CUDA_CHECK_LAUNCH();
}

void ell_rows_times_weights(const HybridView& gate, const float* a_ell, const bf16* w_a, const float* b_ell,
                            const bf16* w_b, int32_t d_model, bf16* out, cudaStream_t stream) {
  const int threads = row_block_threads(d_model);
  if (b_ell)
    ell_rows_kernel<true><<<grid_of(gate.shape.rows), threads, 0, stream>>>(gate, a_ell, w_a, b_ell, w_b, d_model, out);
  else
    ell_rows_kernel<false><<<grid_of(gate.shape.rows), threads, 0, stream>>>(gate, a_ell, w_a, nullptr, nullptr,
                                                                             d_model, out);
  TWELL_CUDA_CHECK_LAUNCH();
}

void neuron_weight_grads(NeuronLists& lists, const HybridShape& shape, const float* a_ell, const float* b_ell,
                         const bf16* rows, int32_t d_model, float* out_a, float* out_b, cudaStream_t stream) {
  const int64_t partial_count = lists.max_partials * d_model;
  lists.partial[0].resize(partial_count);
  if (b_ell) lists.partial[1].resize(partial_count);
  const ChunkedLists chunked{lists.col_start.data(), lists.chunk_start.data(), lists.chunk_neuron.data(),
                             lists.chunk_tickets.data(), lists.sorted_entries, shape.cols, lists.chunk_entries};
  const int threads = row_block_threads(d_model);
  const unsigned chunk_bound = grid_of(shape.cols + lists.max_partials);  // every neuron has at least one chunk
  if (b_ell)
    neuron_grad_kernel<true><<<chunk_bound, threads, 0, stream>>>(
        chunked, shape.ell_width, a_ell, b_ell, rows, d_model, out_a, out_b, lists.partial[0].data(),
        lists.partial[1].data());
  else
    neuron_grad_kernel<false><<<chunk_bound, threads, 0, stream>>>(
        chunked, shape.ell_width, a_ell, nullptr, rows, d_model, out_a, nullptr, lists.partial[0].data(), nullptr);
  TWELL_CUDA_CHECK_LAUNCH();
}

void gather_rows(const bf16* src, const int32_t* rows, int32_t count, int32_t d_model, bf16* dense,
                 cudaStream_t stream) {
  gather_rows_kernel<<<grid_of(count), row_block_threads(d_model), 0, stream>>>(src, rows, d_model, dense);
  TWELL_CUDA_CHECK_LAUNCH();
}

void scatter_rows(const float* src, const int32_t* rows, int32_t count, int32_t d_model, bf16* dst,
                  cudaStream_t stream) {
  scatter_rows_kernel<<<grid_of(count), row_block_threads(d_model), 0, stream>>>(src, rows, d_model, dst);
  TWELL_CUDA_CHECK_LAUNCH();
}

void scatter_rows(const bf16* src, const int32_t* rows, int32_t count, int32_t d_model, bf16* dst,
                  cudaStream_t stream) {
  scatter_rows_kernel<<<grid_of(count), row_block_threads(d_model), 0, stream>>>(src, rows, d_model, dst);
  TWELL_CUDA_CHECK_LAUNCH();
}

void gated_product_rows(const bf16* g, const float* u, int32_t count, int32_t d_hidden, const int32_t* row_of,
                        bf16* h, float* l1_row, cudaStream_t stream) {
  backup_product_kernel<<<grid_of(count), kElementwiseThreads, 0, stream>>>(g, u, d_hidden, row_of, h, l1_row);
  TWELL_CUDA_CHECK_LAUNCH();
}

void gated_product_rows(const bf16* gate_up, int64_t stride, int64_t rows, int32_t d_hidden, bf16* h, float* l1_row,
                        int32_t* nnz_row, cudaStream_t stream) {
  TWELL_REQUIRE(stride % kVector == 0 && stride >= d_hidden, "gate_up row stride {} for H = {}", stride, d_hidden);
  if (d_hidden % kVector == 0)
    dense_product_kernel<kVector><<<grid_of(rows), kElementwiseThreads, 0, stream>>>(gate_up, stride, d_hidden, h,
                                                                                     l1_row, nnz_row);
  else
    dense_product_kernel<1><<<grid_of(rows), kElementwiseThreads, 0, stream>>>(gate_up, stride, d_hidden, h, l1_row,
                                                                               nnz_row);
  TWELL_CUDA_CHECK_LAUNCH();
}

void gated_product_grad_rows(const bf16* g, const float* u, const float* dh, int64_t count, int32_t d_hidden,
                             float l1_scale, bf16* dg, bf16* du, cudaStream_t stream) {
  backup_product_grad_kernel<<<grid_of(count), kElementwiseThreads, 0, stream>>>(g, u, dh, d_hidden, l1_scale, dg,
                                                                                 du);
  TWELL_CUDA_CHECK_LAUNCH();
}

void gated_product_grad_rows_in_place(bf16* gate_up, int64_t stride, const bf16* dh, int64_t rows, int32_t d_hidden,
                                      float l1_scale, cudaStream_t stream) {
  TWELL_REQUIRE(stride % kVector == 0 && stride >= d_hidden, "gate_up row stride {} for H = {}", stride, d_hidden);
  if (d_hidden % kVector == 0)
    dense_product_grad_kernel<kVector><<<grid_of(rows), kElementwiseThreads, 0, stream>>>(gate_up, stride, dh,
                                                                                          d_hidden, l1_scale);
  else
    dense_product_grad_kernel<1><<<grid_of(rows), kElementwiseThreads, 0, stream>>>(gate_up, stride, dh, d_hidden,
                                                                                    l1_scale);
  TWELL_CUDA_CHECK_LAUNCH();
}

void finish_step_stats(const float* l1_row, const int32_t* nnz_row, int64_t rows, double l1_scale, double* stats,
                       uint32_t* ticket, cudaStream_t stream) {
  finish_stats_kernel<<<kStepStatsBlocks, kStatsThreads, 0, stream>>>(l1_row, nnz_row, rows, l1_scale, stats, ticket);
  TWELL_CUDA_CHECK_LAUNCH();
}

}  // namespace twell::cuda
