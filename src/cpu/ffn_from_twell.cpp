// The FFN from the packed gate: up and down projections only at the non-zero gates.
//
//   1. gather  the non-zeros neuron by neuron (a counting sort over H): neuron j's list holds the
//              rows that use it, so each weight row is read from memory once per call, however
//              many rows of the batch share the neuron.
//   2. up      (gated only) h = g·(x[row]·Wu[j]) for every entry, threads split the neurons.
//   3. down    y[row] += h·Wd[j], threads split the D columns of y: no two threads write the same
//              element, no reduction, and each thread reads only its slice of every Wd row.
// Neuron-major weights make Wu[j] and Wd[j] contiguous rows.
#include <omp.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "kernels.h"
#include "twell/error.h"

namespace twell::cpu {
namespace {

// The non-zeros of the packed gate grouped by neuron, rows ascending within a neuron.
struct NeuronLists {
  std::vector<int64_t> offsets;  // [H + 1] neuron j's entries are [offsets[j], offsets[j + 1])
  std::vector<int32_t> rows;     // [E]
  std::vector<float> values;     // [E] g, then h after the up step
  std::vector<int32_t> active;   // neurons with at least one entry, ascending
};

void check_packing(const TwellMatrix& gate, const FfnWeights& weights) {
  const TwellShape& shape = gate.shape;
  TWELL_REQUIRE(shape.cols == weights.d_hidden, "ffn_from_twell: gate.shape.cols must equal H = {}, got {}",
                weights.d_hidden, shape.cols);
  TWELL_REQUIRE(shape.rows >= 1, "ffn_from_twell: gate.shape.rows (M) must be >= 1, got {}", shape.rows);
  TWELL_REQUIRE(twell_tile_supported(shape.tile), "ffn_from_twell: gate.shape.tile must be 128 or 256, got {}",
                shape.tile);
  TWELL_REQUIRE(twell_compression_supported(shape.compression),
                "ffn_from_twell: gate.shape.compression must be 2, 4 or 8, got {}", shape.compression);
  TWELL_REQUIRE(static_cast<int64_t>(gate.slots.size()) == shape.slot_count(),
                "ffn_from_twell: gate.slots must hold {} slots, got {}", shape.slot_count(), gate.slots.size());
  TWELL_REQUIRE(static_cast<int64_t>(gate.tile_nnz.size()) == shape.tile_count(),
                "ffn_from_twell: gate.tile_nnz must hold {} counts, got {}", shape.tile_count(), gate.tile_nnz.size());
  TWELL_REQUIRE(gate.spill_used >= 0 && gate.complete(),
                "ffn_from_twell: the packing is incomplete: spill_used = {} rows but the spill holds {}",
                gate.spill_used, gate.spill_capacity());
}

// Calls visit(row, column, value) for every non-zero, row by row; checks each entry it reads, so a
// malformed packing fails with a message instead of reading out of bounds.
template <typename Visit>
void for_each_nonzero(const TwellMatrix& gate, Visit&& visit) {
  const TwellShape& shape = gate.shape;
  for (int64_t row = 0; row < shape.rows; ++row)
    for (int32_t tile = 0; tile < shape.n_tiles(); ++tile) {
      const int32_t first_column = tile * shape.tile;
      const int32_t width = std::min(shape.tile, shape.cols - first_column);
      const int32_t nnz = gate.tile_nnz[shape.tile_index(row, tile)];
      if (twell_tile_spilled(nnz)) {
        const int32_t spill_row = twell_spill_row(nnz);
        TWELL_REQUIRE(spill_row < gate.spill_used, "ffn_from_twell: row {} tile {} names spill row {}, but spill_used = {}",
                      row, tile, spill_row, gate.spill_used);
        const bf16* values = gate.spill.data() + static_cast<int64_t>(spill_row) * shape.tile;  // [T]
        for (int32_t c = 0; c < width; ++c)
          if (values[c].bits != 0) visit(row, first_column + c, to_float(values[c]));
        continue;
      }
      TWELL_REQUIRE(nnz <= shape.slots(), "ffn_from_twell: row {} tile {} has tile_nnz = {}, more than the {} slots",
                    row, tile, nnz, shape.slots());
      const TwellSlot* slots = gate.slots.data() + shape.slot_index(row, tile, 0);  // [S]
      for (int32_t s = 0; s < nnz; ++s) {
        const int32_t column = static_cast<int32_t>(twell_slot_column(slots[s]));
        TWELL_REQUIRE(column >= first_column && column < first_column + width,
                      "ffn_from_twell: row {} tile {} slot {} has column {}, outside the tile's [{}, {})", row, tile, s,
                      column, first_column, first_column + width);
        visit(row, column, twell_slot_value(slots[s]));
      }
    }
}

void gather_by_neuron(const TwellMatrix& gate, NeuronLists& lists) {
  const int32_t h = gate.shape.cols;
  lists.offsets.assign(h + 1, 0);
  for_each_nonzero(gate, [&](int64_t, int32_t column, float) { ++lists.offsets[column + 1]; });
  lists.active.clear();
  for (int32_t j = 0; j < h; ++j) {
    if (lists.offsets[j + 1] > 0) lists.active.push_back(j);
    lists.offsets[j + 1] += lists.offsets[j];
  }
  lists.rows.resize(lists.offsets[h]);
  lists.values.resize(lists.offsets[h]);
  std::vector<int64_t> next(lists.offsets.begin(), lists.offsets.end() - 1);  // [H] fill position
  for_each_nonzero(gate, [&](int64_t row, int32_t column, float value) {
    const int64_t entry = next[column]++;
    lists.rows[entry] = static_cast<int32_t>(row);
    lists.values[entry] = value;
  });
}

// Asks for a weight row ahead of use: active neurons are scattered over H, so every row starts a
// new stream that the hardware prefetchers would only pick up after a few misses.
void prefetch_row(const float* row, int32_t count) {
  constexpr int32_t kFloatsPerLine = 16;
  for (int32_t k = 0; k < count; k += kFloatsPerLine) __builtin_prefetch(row + k);
}

}  // namespace

void ffn_from_twell(const float* x, const TwellMatrix& gate, const FfnWeights& weights, float* y) {
  validate(weights);
  check_packing(gate, weights);
  TWELL_REQUIRE(x != nullptr && y != nullptr, "ffn_from_twell: x and y must not be null");
  const int64_t rows = gate.shape.rows;
  const int32_t d = weights.d_model;

  TWELL_REQUIRE(rows <= INT32_MAX, "ffn_from_twell: gate.shape.rows (M) must be < 2^31, got {}", rows);

  // Reused across calls of the calling thread: at small M the call is short and fresh allocations
  // would show. Bound to a reference so the parallel region below shares the caller's instance.
  thread_local NeuronLists calling_thread_lists;
  NeuronLists& lists = calling_thread_lists;
  gather_by_neuron(gate, lists);

  const KernelTable& kernels = active_kernels();
  const float* w_up = weights.up.data();      // [H, D]
  const float* w_down = weights.down.data();  // [H, D]
  const int64_t active_count = static_cast<int64_t>(lists.active.size());
  // Column slices of y rounded to 16 floats (one cache line) so threads never share a line.
  constexpr int32_t kColumnAlign = 16;
  const int threads = std::max(1, std::min(num_threads(), (d + kColumnAlign - 1) / kColumnAlign));
  const int32_t slice = ((d + threads - 1) / threads + kColumnAlign - 1) / kColumnAlign * kColumnAlign;

#pragma omp parallel num_threads(threads)
  {
    if (weights.gated) {
#pragma omp for schedule(dynamic, 4)
      for (int64_t a = 0; a < active_count; ++a) {
        const int32_t j = lists.active[a];
        if (a + 1 < active_count) prefetch_row(w_up + static_cast<int64_t>(lists.active[a + 1]) * d, d);
        const int64_t first = lists.offsets[j];
        kernels.scale_by_dots(w_up + static_cast<int64_t>(j) * d, x, d, lists.rows.data() + first,
                              lists.offsets[j + 1] - first, lists.values.data() + first);
      }
    }
    const int32_t first_column = std::min(d, omp_get_thread_num() * slice);
    const int32_t columns = std::min(d, first_column + slice) - first_column;
    if (columns > 0) {
      for (int64_t row = 0; row < rows; ++row) std::fill_n(y + row * d + first_column, columns, 0.0f);
      for (int64_t a = 0; a < active_count; ++a) {
        const int32_t j = lists.active[a];
        if (a + 1 < active_count)
          prefetch_row(w_down + static_cast<int64_t>(lists.active[a + 1]) * d + first_column, columns);
        const int64_t first = lists.offsets[j];
        kernels.scatter_axpy(w_down + static_cast<int64_t>(j) * d + first_column, columns, lists.rows.data() + first,
                             lists.values.data() + first, lists.offsets[j + 1] - first, y + first_column, d);
      }
    }
  }
}

}  // namespace twell::cpu
