// Gate GEMM + ReLU + TwELL packing, without a dense [M, H] gate buffer.
//
// The gate is computed block by block, a block being (row block) x (a few TwELL tiles), into a
// thread-local buffer small enough to stay in L2; the block is packed while it is still there.
//   few rows:  our own register-blocked dot products (kernels.h dot_block); the op is a stream
//              over Wg and memory-bound, and sgemm's packing of Wg would only add traffic.
//   many rows: single-threaded OpenBLAS sgemm per block (compute-bound; one call per thread).
// Overflowing tiles are collected per thread and given spill rows after the parallel region, in
// (row, tile) order, so the result does not depend on the thread count or timing.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "twell/error.h"

namespace twell::cpu {
namespace {

// From this many rows on the gate is compute-bound and OpenBLAS's sgemm beats dot_block.
constexpr int64_t kBlasMinRows = 32;
// OpenBLAS blocks: 256 rows x 256 columns of gate = 256 KiB of output per block, in L2 (2 MiB).
// Fewer rows per block repack the same Wg slice more often (128 rows: 3-5% slower on Zen 5).
constexpr int64_t kBlasRowBlock = 256;
constexpr int32_t kBlasBlockColumns = 256;

// How the [M, H] gate is cut into blocks; one block = one unit of work for one thread.
struct GateBlocking {
  int64_t row_block;      // rows per block
  int32_t tiles_per_block;
  int64_t row_blocks;
  int32_t column_blocks;
  bool use_blas;

  int64_t units() const { return row_blocks * column_blocks; }
};

GateBlocking plan_blocking(int64_t rows, const TwellShape& shape) {
  GateBlocking plan{};
  plan.use_blas = rows >= kBlasMinRows;
  // dot_block streams one tile of Wg per block: a tile is already plenty of work (T·D floats).
  plan.row_block = plan.use_blas ? std::min(rows, kBlasRowBlock) : rows;
  plan.tiles_per_block = plan.use_blas ? std::max(1, kBlasBlockColumns / shape.tile) : 1;
  plan.row_blocks = (rows + plan.row_block - 1) / plan.row_block;
  plan.column_blocks = (shape.n_tiles() + plan.tiles_per_block - 1) / plan.tiles_per_block;
  return plan;
}

// A tile with more non-zeros than slots, waiting for its spill row.
struct PendingSpill {
  int64_t tile_index;         // shape.tile_index(row, tile): (row, tile) order
  std::vector<bf16> values;   // [T] relu'd values, 0 past H
};

// Per-thread state of the packing loop.
struct PackScratch {
  std::vector<float> gate_block;  // [row_block, tiles_per_block·T]
  std::vector<int32_t> positive;  // [T] columns (within the tile) of the positive values
  std::vector<PendingSpill> spills;
  bool has_nan = false;
  int64_t nan_row = -1;
};

// Packs one (row, tile) whose fp32 gate values are gate[0:width], width = the tile's column count.
void pack_tile(const KernelTable& kernels, const float* gate, int32_t width, int64_t row, int32_t tile,
               TwellMatrix& out, PackScratch& scratch) {
  const TwellShape& shape = out.shape;
  const int32_t slots = shape.slots();
  const uint32_t first_column = static_cast<uint32_t>(tile) * shape.tile;
  bool nan_here = false;
  const int32_t count = kernels.find_positive(gate, width, scratch.positive.data(), &nan_here);
  if (nan_here && !scratch.has_nan) {
    scratch.has_nan = true;
    scratch.nan_row = row;
  }
  TwellSlot* tile_slots = out.slots.data() + shape.slot_index(row, tile, 0);  // [S]
  int32_t& tile_nnz = out.tile_nnz[shape.tile_index(row, tile)];
  if (count <= slots) {
    for (int32_t i = 0; i < count; ++i) {
      const int32_t column = scratch.positive[i];
      tile_slots[i] = twell_make_slot(float_to_bf16_bits(gate[column]), first_column + column);
    }
    std::fill(tile_slots + count, tile_slots + slots, TwellSlot{0});
    tile_nnz = count;
    return;
  }
  std::fill(tile_slots, tile_slots + slots, TwellSlot{0});
  tile_nnz = 0;  // replaced by the spill marker once the spill rows are assigned
  PendingSpill spill{shape.tile_index(row, tile), std::vector<bf16>(shape.tile, bf16{0})};
  for (int32_t i = 0; i < count; ++i) spill.values[scratch.positive[i]] = to_bf16(gate[scratch.positive[i]]);
  scratch.spills.push_back(std::move(spill));
}

// Gives every pending spill its row, in (row, tile) order, growing out.spill when needed.
void assign_spill_rows(std::vector<PackScratch>& per_thread, TwellMatrix& out) {
  std::vector<PendingSpill*> pending;
  for (PackScratch& scratch : per_thread)
    for (PendingSpill& spill : scratch.spills) pending.push_back(&spill);
  std::sort(pending.begin(), pending.end(),
            [](const PendingSpill* a, const PendingSpill* b) { return a->tile_index < b->tile_index; });
  const int32_t tile = out.shape.tile;
  const size_t needed = pending.size() * static_cast<size_t>(tile);
  if (out.spill.size() < needed) out.spill.resize(needed);
  for (size_t spill_row = 0; spill_row < pending.size(); ++spill_row) {
    std::copy(pending[spill_row]->values.begin(), pending[spill_row]->values.end(),
              out.spill.begin() + static_cast<int64_t>(spill_row) * tile);
    out.tile_nnz[pending[spill_row]->tile_index] = twell_spilled_marker(static_cast<int32_t>(spill_row));
  }
  out.spill_used = static_cast<int32_t>(pending.size());
}

}  // namespace

void gate_to_twell(const float* x, int64_t rows, const FfnWeights& weights, int32_t tile, int32_t compression,
                   TwellMatrix& out) {
  validate(weights);
  TWELL_REQUIRE(x != nullptr, "gate_to_twell: x must not be null");
  TWELL_REQUIRE(rows >= 1, "gate_to_twell: rows (M) must be >= 1, got {}", rows);
  TWELL_REQUIRE(twell_tile_supported(tile), "gate_to_twell: tile must be 128 or 256, got {}", tile);
  TWELL_REQUIRE(twell_compression_supported(compression), "gate_to_twell: compression must be 2, 4 or 8, got {}",
                compression);
  TWELL_REQUIRE(weights.d_hidden <= kTwellMaxColumns, "gate_to_twell: H must be <= {} for TwELL, got {}",
                kTwellMaxColumns, weights.d_hidden);

  const int32_t d = weights.d_model;
  const int32_t h = weights.d_hidden;
  const float* w = weights.relu_projection().data();  // [H, D]
  out.shape = TwellShape{rows, h, tile, compression};
  out.slots.resize(out.shape.slot_count());
  out.tile_nnz.resize(out.shape.tile_count());

  const GateBlocking plan = plan_blocking(rows, out.shape);
  const KernelTable& kernels = active_kernels();
  const int threads = static_cast<int>(std::min<int64_t>(num_threads(), plan.units()));
  std::vector<PackScratch> per_thread(threads);
  set_blas_threads(1);  // every sgemm below runs on the OpenMP thread that calls it

#pragma omp parallel num_threads(threads)
  {
    PackScratch& scratch = per_thread[omp_get_thread_num()];
    const int32_t block_columns = plan.tiles_per_block * tile;
    scratch.gate_block.resize(plan.row_block * block_columns);
    scratch.positive.resize(tile);
    // Column blocks outer: consecutive units share the same slice of Wg. Dynamic: a thread that
    // loses its core for a while (a shared machine) does not hold the others up at the barrier.
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < plan.units(); ++unit) {
      const int64_t first_row = (unit % plan.row_blocks) * plan.row_block;
      const int64_t block_rows = std::min(plan.row_block, rows - first_row);
      const int32_t first_tile = static_cast<int32_t>(unit / plan.row_blocks) * plan.tiles_per_block;
      const int32_t first_neuron = first_tile * tile;
      const int32_t neurons = std::min(block_columns, h - first_neuron);
      const float* x_block = x + first_row * d;                       // [block_rows, D]
      const float* w_block = w + static_cast<int64_t>(first_neuron) * d;  // [neurons, D]
      float* gate = scratch.gate_block.data();                        // [block_rows, block_columns]
      if (plan.use_blas)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(block_rows), neurons, d, 1.0f, x_block,
                    d, w_block, d, 0.0f, gate, block_columns);
      else
        kernels.dot_block(x_block, block_rows, w_block, neurons, d, gate, block_columns);
      for (int64_t r = 0; r < block_rows; ++r)
        for (int32_t t = 0; t * tile < neurons; ++t)
          pack_tile(kernels, gate + r * block_columns + t * tile, std::min(tile, neurons - t * tile), first_row + r,
                    first_tile + t, out, scratch);
    }
  }

  for (const PackScratch& scratch : per_thread)
    TWELL_REQUIRE(!scratch.has_nan,
                  "gate_to_twell: the gate of row {} is NaN: x or the relu projection weights hold a non-finite value",
                  scratch.nan_row);
  assign_spill_rows(per_thread, out);
}

}  // namespace twell::cpu
