// Kernels of the sparse training FFN (include/twell/train.h), launched by src/cuda/train_ffn.cu.
// Every launcher is asynchronous on `stream`; none synchronises.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/cuda_utils.h"
#include "twell/train.h"

namespace twell::cuda {

// Counters a conversion leaves on the device, read back at the step's one synchronisation.
struct HybridCounters {
  int32_t backup_used;       // rows with more than W non-zeros (may exceed the capacity)
  int32_t gate_incomplete;   // 1 when the TwELL input referenced a spill row past its capacity
  int32_t ell_entries;       // non-zeros of the rows within W: the length of the neuron lists
};

// Raw device view of a DeviceTwell (cuda.h) that kernels take by value.
struct TwellView {
  TwellShape shape;
  const TwellSlot* slots;    // [M, n_tiles, S]
  const int32_t* tile_nnz;   // [M, n_tiles]
  const bf16* spill;         // [spill_capacity, T]
  int64_t spill_capacity;
};

struct DeviceHybrid::State {
  HybridShape shape;
  int32_t backup_capacity = 0;
  DeviceBuffer<bf16> ell_values;       // [M, W]
  DeviceBuffer<int32_t> ell_cols;      // [M, W]
  DeviceBuffer<int32_t> row_nnz;       // [M]
  DeviceBuffer<int32_t> backup_slot;   // [M]
  DeviceBuffer<bf16> backup;           // [capacity, H]
  DeviceBuffer<int32_t> backup_rows;   // [capacity]
  DeviceBuffer<HybridCounters> counters;  // [1]
  DeviceBuffer<int32_t> overflow_rank;    // [M] scan of the over-W flags (conversion scratch)
  DeviceBuffer<uint8_t> scan_scratch;     // CUB temporary storage

  int64_t bytes() const {
    return static_cast<int64_t>(ell_values.bytes() + ell_cols.bytes() + row_nnz.bytes() + backup_slot.bytes() +
                                backup.bytes() + backup_rows.bytes() + counters.bytes() + overflow_rank.bytes() +
                                scan_scratch.bytes());
  }
};

// Read-only view of a hybrid gate for the product kernels.
struct HybridView {
  HybridShape shape;
  const bf16* ell_values;    // [M, W]
  const int32_t* ell_cols;   // [M, W]
  const int32_t* row_nnz;    // [M]
  const bf16* backup;        // [capacity, H]
  const int32_t* backup_rows;  // [capacity]
};
HybridView view_of(const DeviceHybrid& hybrid);

// Per-neuron list of the ELL entries (rows over W excluded), built on the device: the sparse
// transpose the weight gradients read. Entries of neuron j are entry[col_start[j] .. col_start[j+1])
// in ascending row order (a stable radix sort), each an ELL index r·W + k. Only the E real entries
// are sorted (E = HybridCounters::ell_entries, known on the host from the forward's read-back):
// row r's entries start at row_offset[r], the scan of the rows' counts.
//
// The weight gradients walk each list in chunks of at most `chunk_entries` entries, one block per
// chunk: one neuron's list can be ~30x the mean (hot neurons), and one block walking it alone would
// set the kernel's time. Neuron j owns chunks chunk_start[j] .. chunk_start[j+1] (at least one, so
// every gradient row is written); chunk c > 0 of neuron j leaves its partial row in slot
// chunk_start[j] - j + c - 1 of `partial`. The last of a neuron's chunks to finish (chunk_tickets
// counts them) adds the partial rows in chunk order (deterministic) and sets the ticket back to 0.
struct NeuronLists {
  DeviceBuffer<int32_t> keys[2];     // [E] column, double buffer
  DeviceBuffer<int32_t> entries[2];  // [E] ELL index, double buffer
  DeviceBuffer<int32_t> row_offset;  // [M] first entry of each row
  DeviceBuffer<int32_t> col_count;   // [H + 1] entries, then chunks per neuron
  DeviceBuffer<int32_t> col_start;   // [H + 1]
  DeviceBuffer<int32_t> chunk_start;  // [H + 1]
  DeviceBuffer<int32_t> chunk_neuron;  // [H + max_partials] the neuron owning each chunk
  DeviceBuffer<uint32_t> chunk_tickets;  // [H] finished chunks per neuron, 0 between launches
  DeviceBuffer<uint8_t> sort_scratch;
  DeviceBuffer<float> partial[2];     // [max_partials, D] each: chunk partial sums of the two outputs
  const int32_t* sorted_entries = nullptr;  // points into entries[0] or entries[1]
  int32_t chunk_entries = 0;
  int64_t max_partials = 0;  // bound on chunk_start[H] - H (chunks past each neuron's first): E / chunk_entries

  int64_t bytes() const {
    return static_cast<int64_t>(keys[0].bytes() + keys[1].bytes() + entries[0].bytes() + entries[1].bytes() +
                                row_offset.bytes() + col_count.bytes() + col_start.bytes() + chunk_start.bytes() +
                                chunk_neuron.bytes() + chunk_tickets.bytes() + sort_scratch.bytes() +
                                partial[0].bytes() + partial[1].bytes());
  }
};
// `ell_entries`: E above, the gate's HybridCounters::ell_entries.
void build_neuron_lists(const HybridView& gate, int32_t ell_entries, NeuronLists& lists, cudaStream_t stream);

// ---- Sparse products (one launch each) ----

// Forward, ELL rows: u = x·Wu^T at g's pattern, h = g·u (fp32, [M, W]); l1_row[r] = Σ_k |h[r, k]|.
void sampled_up_projection(const HybridView& gate, const bf16* x, const bf16* w_up, int32_t d_model, float* u_ell,
                           float* h_ell, float* l1_row, cudaStream_t stream);
// Backward, ELL rows: dh = dy·Wd^T at h's pattern + l1_scale·sign(h); dg = dh·u, du = dh·g ([M, W]).
void sampled_hidden_grad(const HybridView& gate, const bf16* dy, const bf16* w_down, int32_t d_model,
                         const float* u_ell, const float* h_ell, float l1_scale, float* dg_ell, float* du_ell,
                         cudaStream_t stream);
// out[r, :] = Σ_k a[r, k]·Wa[col, :] (+ Σ_k b[r, k]·Wb[col, :] when b != nullptr), bf16 [M, D],
// for the ELL rows only (rows over W are written by the backup path).
void ell_rows_times_weights(const HybridView& gate, const float* a_ell, const bf16* w_a, const float* b_ell,
                            const bf16* w_b, int32_t d_model, bf16* out, cudaStream_t stream);
// out_a[j, :] = Σ_{(r,k) in list j} a[r, k]·rows[r, :] (and out_b with b), fp32 [H, D], every row written.
// Grows the lists' partial-row scratch on first use.
void neuron_weight_grads(NeuronLists& lists, const HybridShape& shape, const float* a_ell, const float* b_ell,
                         const bf16* rows, int32_t d_model, float* out_a, float* out_b, cudaStream_t stream);

// ---- Backup rows and the dense path ----

// dense[b, :] = src[rows[b], :] for b < count; bf16 [count, D].
void gather_rows(const bf16* src, const int32_t* rows, int32_t count, int32_t d_model, bf16* dense,
                 cudaStream_t stream);
// dst[rows[b], :] = bf16(src[b, :]).
void scatter_rows(const float* src, const int32_t* rows, int32_t count, int32_t d_model, bf16* dst,
                  cudaStream_t stream);
void scatter_rows(const bf16* src, const int32_t* rows, int32_t count, int32_t d_model, bf16* dst,
                  cudaStream_t stream);

// h = g·u where g != 0 (bf16 [count, H]); l1_row[row_of[b]] = Σ|h| (fp32 product). g is relu'd.
// `g` and `u` have leading dimension H; u is fp32 for the backup, bf16 on the dense path.
void gated_product_rows(const bf16* g, const float* u, int32_t count, int32_t d_hidden, const int32_t* row_of,
                        bf16* h, float* l1_row, cudaStream_t stream);
// Dense path: gate_up row r holds the gate pre-activation g_pre at [0, H) and u at [S, S + H)
// (row length 2·S, S a multiple of 8); also counts nnz_row[r] = #{g_pre > 0}.
void gated_product_rows(const bf16* gate_up, int64_t stride, int64_t rows, int32_t d_hidden, bf16* h, float* l1_row,
                        int32_t* nnz_row, cudaStream_t stream);
// Where g != 0: d = dh + l1_scale·sign(g·u); dg = d·u, du = d·g; elsewhere both 0.  bf16 [count, H].
void gated_product_grad_rows(const bf16* g, const float* u, const float* dh, int64_t count, int32_t d_hidden,
                             float l1_scale, bf16* dg, bf16* du, cudaStream_t stream);
// Dense path, in place in gate_up (layout above): dg over g_pre, du over u.
void gated_product_grad_rows_in_place(bf16* gate_up, int64_t stride, const bf16* dh, int64_t rows, int32_t d_hidden,
                                      float l1_scale, cudaStream_t stream);

// stats[0] = l1_scale·Σ l1_row, stats[1] = Σ nnz_row / M. Blocks sum fixed ranges into stats[2..]
// and the last block to finish adds those in block order (deterministic); `ticket` counts the
// finished blocks and is 0 again afterwards (0 before the first call).
constexpr int kStepStatsBlocks = 32;
constexpr int kStepStatsDoubles = 2 + 2 * kStepStatsBlocks;  // the size of `stats`
void finish_step_stats(const float* l1_row, const int32_t* nnz_row, int64_t rows, double l1_scale, double* stats,
                       uint32_t* ticket, cudaStream_t stream);

}  // namespace twell::cuda
