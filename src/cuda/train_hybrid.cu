// The hybrid gate on the device: TwELL -> hybrid conversion, and the per-neuron lists (sparse
// transpose) the weight gradients read.
#include <algorithm>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <thrust/iterator/transform_iterator.h>

#include "cuda/train_kernels.cuh"
#include "twell/convert.h"
#include "twell/error.h"

namespace twell::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // one warp per row

__device__ __forceinline__ bool bf16_nonzero(uint16_t bits) { return (bits & 0x7fffu) != 0; }

// Non-zeros of tile t of `row`; a spilled tile is counted from its dense segment. A slot holding a
// bf16 zero (a gate that underflowed) is no non-zero, as in hybrid_from_twell. A spill row past
// the capacity (an incomplete packing) counts 0 and raises the flag; the host then refuses the step.
__device__ int32_t tile_count(const TwellView& gate, int64_t row, int32_t t, HybridCounters* counters) {
  const int32_t code = gate.tile_nnz[gate.shape.tile_index(row, t)];
  if (!twell_tile_spilled(code)) {
    int32_t count = 0;
    for (int32_t s = 0; s < code; ++s)
      count += bf16_nonzero(twell_slot_value_bits(gate.slots[gate.shape.slot_index(row, t, s)])) ? 1 : 0;
    return count;
  }
  const int32_t spill_row = twell_spill_row(code);
  if (spill_row >= gate.spill_capacity) {
    counters->gate_incomplete = 1;
    return 0;
  }
  const uint16_t* segment = reinterpret_cast<const uint16_t*>(gate.spill) + static_cast<int64_t>(spill_row) * gate.shape.tile;
  int32_t count = 0;
  for (int32_t i = 0; i < gate.shape.tile; ++i) count += bf16_nonzero(segment[i]) ? 1 : 0;
  return count;
}

__device__ __forceinline__ int32_t warp_inclusive_sum(int32_t value) {
  const int lane = threadIdx.x % kWarp;
  for (int offset = 1; offset < kWarp; offset *= 2) {
    const int32_t other = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

// The entries of an ELL row (0 for a row over W, which goes to the backup): the length of the
// row's part of the neuron lists, counted by the conversion and compacted by build_neuron_lists.
struct EllRowEntries {
  int32_t width;
  __host__ __device__ int32_t operator()(int32_t nnz) const { return nnz <= width ? nnz : 0; }
};

// Pass 1: row_nnz[r], the over-W flag (into overflow_flag, scanned next) and the ELL entries.
__global__ void hybrid_row_counts_kernel(TwellView gate, int32_t ell_width, int32_t* row_nnz,
                                         int32_t* overflow_flag, HybridCounters* counters) {
  __shared__ int32_t ell_entries[kRowsPerBlock];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  int32_t count = 0;
  if (row < gate.shape.rows) {
    for (int32_t t = lane; t < gate.shape.n_tiles(); t += kWarp) count += tile_count(gate, row, t, counters);
    for (int offset = kWarp / 2; offset > 0; offset /= 2) count += __shfl_xor_sync(0xffffffffu, count, offset);
    if (lane == 0) {
      row_nnz[row] = count;
      overflow_flag[row] = count > ell_width ? 1 : 0;
    }
  }
  if (lane == 0) ell_entries[warp] = EllRowEntries{ell_width}(count);
  __syncthreads();
  if (threadIdx.x != 0) return;
  int32_t block_entries = 0;
  for (int w = 0; w < kRowsPerBlock; ++w) block_entries += ell_entries[w];
  if (block_entries > 0) atomicAdd(&counters->ell_entries, block_entries);
}

// Writes the non-zeros of tile t (columns ascending) through `store(position, value_bits, column)`.
template <typename Store>
__device__ void for_each_tile_entry(const TwellView& gate, int64_t row, int32_t t, Store store) {
  const int32_t code = gate.tile_nnz[gate.shape.tile_index(row, t)];
  if (!twell_tile_spilled(code)) {
    int32_t position = 0;
    for (int32_t s = 0; s < code; ++s) {
      const TwellSlot slot = gate.slots[gate.shape.slot_index(row, t, s)];
      if (bf16_nonzero(twell_slot_value_bits(slot)))
        store(position++, twell_slot_value_bits(slot), static_cast<int32_t>(twell_slot_column(slot)));
    }
    return;
  }
  const int32_t spill_row = twell_spill_row(code);
  if (spill_row >= gate.spill_capacity) return;  // flagged in pass 1
  const uint16_t* segment = reinterpret_cast<const uint16_t*>(gate.spill) + static_cast<int64_t>(spill_row) * gate.shape.tile;
  int32_t position = 0;
  for (int32_t i = 0; i < gate.shape.tile; ++i)
    if (bf16_nonzero(segment[i])) store(position++, segment[i], t * gate.shape.tile + i);
}

// Pass 2: one warp per row writes its ELL block, or (row over W) its backup row.
__global__ void hybrid_write_kernel(TwellView gate, int32_t ell_width, const int32_t* row_nnz,
                                    const int32_t* overflow_rank, int32_t backup_capacity, uint16_t* ell_values,
                                    int32_t* ell_cols, int32_t* backup_slot, uint16_t* backup, int32_t* backup_rows,
                                    HybridCounters* counters) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= gate.shape.rows) return;
  const int32_t nnz = row_nnz[row];
  const int32_t n_tiles = gate.shape.n_tiles();
  const int32_t cols = gate.shape.cols;
  uint16_t* row_values = ell_values + row * ell_width;
  int32_t* row_cols = ell_cols + row * ell_width;
  const bool in_backup = nnz > ell_width;
  const int32_t slot = in_backup ? overflow_rank[row] : kHybridRowInEll;
  if (lane == 0) {
    backup_slot[row] = slot;
    if (row == gate.shape.rows - 1) counters->backup_used = overflow_rank[row] + (in_backup ? 1 : 0);
  }

  if (!in_backup) {
    int32_t base = 0;  // entries of the tiles before this chunk
    for (int32_t t0 = 0; t0 < n_tiles; t0 += kWarp) {
      const int32_t t = t0 + lane;
      const int32_t count = t < n_tiles ? tile_count(gate, row, t, counters) : 0;
      const int32_t inclusive = warp_inclusive_sum(count);
      const int32_t offset = base + inclusive - count;
      if (t < n_tiles)
        for_each_tile_entry(gate, row, t, [&](int32_t position, uint16_t bits, int32_t column) {
          row_values[offset + position] = bits;
          row_cols[offset + position] = column;
        });
      base += __shfl_sync(0xffffffffu, inclusive, kWarp - 1);
    }
    for (int32_t k = nnz + lane; k < ell_width; k += kWarp) {
      row_values[k] = 0;
      row_cols[k] = 0;
    }
    return;
  }

  for (int32_t k = lane; k < ell_width; k += kWarp) {
    row_values[k] = 0;
    row_cols[k] = 0;
  }
  if (slot >= backup_capacity) return;  // reported through backup_used; the host grows and repeats
  uint16_t* dense = backup + static_cast<int64_t>(slot) * cols;  // [H]
  for (int32_t c = lane; c < cols; c += kWarp) dense[c] = 0;
  if (lane == 0) backup_rows[slot] = static_cast<int32_t>(row);
  __syncwarp();  // the zeros land before the values below, written by other lanes
  for (int32_t t = lane; t < n_tiles; t += kWarp)
    for_each_tile_entry(gate, row, t, [&](int32_t, uint16_t bits, int32_t column) {
      if (column < cols) dense[column] = bits;
    });
}

// One warp per row: its entries' keys (columns) and ELL indices at row_offset[row], compacted.
__global__ void neuron_list_keys_kernel(HybridView gate, const int32_t* row_offset, int32_t* keys, int32_t* entries,
                                        int32_t* col_count) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= gate.shape.rows) return;
  const int32_t width = gate.shape.ell_width;
  const int32_t nnz = EllRowEntries{width}(gate.row_nnz[row]);
  const int32_t first = row_offset[row];
  for (int32_t k = lane; k < nnz; k += kWarp) {
    const int64_t e = row * width + k;
    const int32_t column = gate.ell_cols[e];
    keys[first + k] = column;
    entries[first + k] = static_cast<int32_t>(e);
    atomicAdd(&col_count[column], 1);
  }
}

// Chunks per neuron (at least one) from the scanned list starts; the last entry stays 0.
__global__ void neuron_chunk_count_kernel(const int32_t* col_start, int32_t cols, int32_t chunk_entries,
                                          int32_t* chunk_count) {
  for (int32_t j = blockIdx.x * blockDim.x + threadIdx.x; j <= cols; j += gridDim.x * blockDim.x) {
    const int32_t entries = j < cols ? col_start[j + 1] - col_start[j] : 0;
    chunk_count[j] = j < cols ? max(1, (entries + chunk_entries - 1) / chunk_entries) : 0;
  }
}

// chunk_neuron[c] = the neuron owning chunk c, for c < chunk_start[cols].
__global__ void chunk_neuron_kernel(const int32_t* chunk_start, int32_t cols, int32_t* chunk_neuron) {
  for (int32_t j = blockIdx.x * blockDim.x + threadIdx.x; j < cols; j += gridDim.x * blockDim.x)
    for (int32_t c = chunk_start[j]; c < chunk_start[j + 1]; ++c) chunk_neuron[c] = j;
}

int bits_for(int32_t max_value) {
  int bits = 1;
  while ((int64_t{1} << bits) <= max_value) ++bits;
  return bits;
}

}  // namespace

DeviceHybrid::DeviceHybrid() : state_(std::make_unique<State>()) {}
DeviceHybrid::~DeviceHybrid() = default;
DeviceHybrid::DeviceHybrid(DeviceHybrid&&) noexcept = default;
DeviceHybrid& DeviceHybrid::operator=(DeviceHybrid&&) noexcept = default;

const HybridShape& DeviceHybrid::shape() const { return state_->shape; }
int32_t DeviceHybrid::backup_capacity() const { return state_->backup_capacity; }

int32_t DeviceHybrid::backup_used(cudaStream_t stream) const {
  HybridCounters counters{};
  state_->counters.download(&counters, 1, stream);
  return counters.backup_used;
}

void DeviceHybrid::reserve(const HybridShape& shape, int32_t backup_capacity) {
  TWELL_REQUIRE(shape.rows >= 1 && shape.cols >= 1, "hybrid shape must be at least 1x1, got {}x{}", shape.rows,
                shape.cols);
  TWELL_REQUIRE(shape.ell_width >= 1 && shape.ell_width <= shape.cols,
                "ELL width must be in [1, H = {}], got {}", shape.cols, shape.ell_width);
  TWELL_REQUIRE(shape.ell_count() < (int64_t{1} << 31), "M·W must be below 2^31 (int32 entry indices), got {}",
                shape.ell_count());
  TWELL_REQUIRE(backup_capacity >= 0, "backup capacity must be >= 0, got {}", backup_capacity);
  State& s = *state_;
  s.shape = shape;
  s.backup_capacity = std::max(s.backup_capacity, backup_capacity);
  s.ell_values.resize(shape.ell_count());
  s.ell_cols.resize(shape.ell_count());
  s.row_nnz.resize(shape.rows);
  s.backup_slot.resize(shape.rows);
  s.overflow_rank.resize(shape.rows);
  s.backup.resize(std::max<int64_t>(1, int64_t{s.backup_capacity} * shape.cols));
  s.backup_rows.resize(std::max(1, s.backup_capacity));
  s.counters.resize(1);
}

void DeviceHybrid::upload(const HybridMatrix& host, cudaStream_t stream) {
  validate(host);
  reserve(host.shape, host.backup_used);
  State& s = *state_;
  s.ell_values.upload(host.ell_values.data(), host.ell_values.size(), stream);
  s.ell_cols.upload(host.ell_cols.data(), host.ell_cols.size(), stream);
  s.row_nnz.upload(host.row_nnz.data(), host.row_nnz.size(), stream);
  s.backup_slot.upload(host.backup_slot.data(), host.backup_slot.size(), stream);
  const size_t backup_elements = static_cast<size_t>(host.backup_used) * host.shape.cols;
  if (backup_elements > 0) {
    s.backup.upload(host.backup.data(), backup_elements, stream);
    s.backup_rows.upload(host.backup_rows.data(), static_cast<size_t>(host.backup_used), stream);
  }
  int64_t ell_entries = 0;
  for (const int32_t nnz : host.row_nnz) ell_entries += EllRowEntries{host.shape.ell_width}(nnz);
  const HybridCounters counters{host.backup_used, 0, static_cast<int32_t>(ell_entries)};
  s.counters.upload(&counters, 1, stream);
  TWELL_CUDA_CHECK(cudaStreamSynchronize(stream));  // the host arrays may go away after this call
}

HybridMatrix DeviceHybrid::download(cudaStream_t stream) const {
  const State& s = *state_;
  HybridCounters counters{};
  s.counters.download(&counters, 1, stream);
  TWELL_REQUIRE(counters.gate_incomplete == 0, "the TwELL gate was an incomplete packing (spill_used > capacity)");
  TWELL_REQUIRE(counters.backup_used <= s.backup_capacity,
                "the hybrid backup overflowed: {} rows over the ELL width, capacity {}", counters.backup_used,
                s.backup_capacity);
  HybridMatrix host;
  host.shape = s.shape;
  host.backup_used = counters.backup_used;
  host.ell_values.resize(s.shape.ell_count());
  host.ell_cols.resize(s.shape.ell_count());
  host.row_nnz.resize(s.shape.rows);
  host.backup_slot.resize(s.shape.rows);
  host.backup.resize(static_cast<size_t>(counters.backup_used) * s.shape.cols);
  host.backup_rows.resize(counters.backup_used);
  s.ell_values.download(host.ell_values.data(), host.ell_values.size(), stream);
  s.ell_cols.download(host.ell_cols.data(), host.ell_cols.size(), stream);
  s.row_nnz.download(host.row_nnz.data(), host.row_nnz.size(), stream);
  s.backup_slot.download(host.backup_slot.data(), host.backup_slot.size(), stream);
  if (counters.backup_used > 0) {
    s.backup.download(host.backup.data(), host.backup.size(), stream);
    s.backup_rows.download(host.backup_rows.data(), host.backup_rows.size(), stream);
  }
  return host;
}

HybridView view_of(const DeviceHybrid& hybrid) {
  const DeviceHybrid::State& s = hybrid.state();
  return HybridView{s.shape, s.ell_values.data(), s.ell_cols.data(), s.row_nnz.data(), s.backup.data(),
                    s.backup_rows.data()};
}

void twell_to_hybrid(const DeviceTwell& packed, int32_t ell_width, DeviceHybrid& out, cudaStream_t stream) {
  const TwellView gate{packed.shape, packed.slots.get(), packed.tile_nnz.get(), packed.spill.get(),
                       packed.spill_capacity};
  TWELL_REQUIRE(gate.shape.rows >= 1, "TwELL gate must have at least one row, got {}", gate.shape.rows);
  TWELL_REQUIRE(twell_tile_supported(gate.shape.tile) && twell_compression_supported(gate.shape.compression),
                "TwELL gate tile/compression unsupported: T={} C={}", gate.shape.tile, gate.shape.compression);
  TWELL_REQUIRE(gate.slots && gate.tile_nnz, "TwELL gate has no device arrays (empty DeviceTwell)");
  out.reserve(HybridShape{gate.shape.rows, gate.shape.cols, ell_width}, out.backup_capacity());
  DeviceHybrid::State& s = out.state();
  const int64_t rows = gate.shape.rows;
  TWELL_CUDA_CHECK(cudaMemsetAsync(s.counters.data(), 0, sizeof(HybridCounters), stream));
  const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  // backup_slot holds the over-W flags until pass 2 overwrites it with the slots.
  hybrid_row_counts_kernel<<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(gate, ell_width, s.row_nnz.data(),
                                                                        s.backup_slot.data(), s.counters.data());
  TWELL_CUDA_CHECK_LAUNCH();
  size_t scratch_bytes = 0;
  TWELL_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scratch_bytes, s.backup_slot.data(), s.overflow_rank.data(),
                                                 static_cast<int>(rows), stream));
  s.scan_scratch.resize(scratch_bytes);
  TWELL_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(s.scan_scratch.data(), scratch_bytes, s.backup_slot.data(),
                                                 s.overflow_rank.data(), static_cast<int>(rows), stream));
  hybrid_write_kernel<<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(
      gate, ell_width, s.row_nnz.data(), s.overflow_rank.data(), s.backup_capacity,
      reinterpret_cast<uint16_t*>(s.ell_values.data()), s.ell_cols.data(), s.backup_slot.data(),
      reinterpret_cast<uint16_t*>(s.backup.data()), s.backup_rows.data(), s.counters.data());
  TWELL_CUDA_CHECK_LAUNCH();
}

void build_neuron_lists(const HybridView& gate, int32_t ell_entries, NeuronLists& lists, cudaStream_t stream) {
  const int64_t rows = gate.shape.rows;
  const int32_t cols = gate.shape.cols;
  TWELL_REQUIRE(ell_entries >= 0 && ell_entries <= gate.shape.ell_count(),
                "hybrid gate claims {} ELL entries, more than M·W = {}", ell_entries, gate.shape.ell_count());
  const int64_t count = ell_entries;
  for (int i = 0; i < 2; ++i) {
    lists.keys[i].resize(std::max<int64_t>(1, count));
    lists.entries[i].resize(std::max<int64_t>(1, count));
  }
  lists.row_offset.resize(rows);
  lists.col_count.resize(cols + 1);
  lists.col_start.resize(cols + 1);
  if (lists.chunk_tickets.size() < static_cast<size_t>(cols)) {
    lists.chunk_tickets.resize(cols);
    TWELL_CUDA_CHECK(cudaMemsetAsync(lists.chunk_tickets.data(), 0, sizeof(uint32_t) * cols, stream));
  }
  TWELL_CUDA_CHECK(cudaMemsetAsync(lists.col_count.data(), 0, sizeof(int32_t) * (cols + 1), stream));

  const auto row_entries = thrust::make_transform_iterator(gate.row_nnz, EllRowEntries{gate.shape.ell_width});
  cub::DoubleBuffer<int32_t> keys(lists.keys[0].data(), lists.keys[1].data());
  cub::DoubleBuffer<int32_t> entries(lists.entries[0].data(), lists.entries[1].data());
  size_t sort_bytes = 0, scan_bytes = 0, row_scan_bytes = 0;
  const int end_bit = bits_for(cols - 1);  // keys are in [0, H)
  TWELL_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, row_scan_bytes, row_entries, lists.row_offset.data(),
                                                 static_cast<int>(rows), stream));
  TWELL_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys, entries, static_cast<int>(count), 0,
                                                   end_bit, stream));
  TWELL_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, lists.col_count.data(),
                                                 lists.col_start.data(), cols + 1, stream));
  lists.sort_scratch.resize(std::max({sort_bytes, scan_bytes, row_scan_bytes}));
  TWELL_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(lists.sort_scratch.data(), row_scan_bytes, row_entries,
                                                 lists.row_offset.data(), static_cast<int>(rows), stream));
  const unsigned row_blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  neuron_list_keys_kernel<<<row_blocks, kRowsPerBlock * kWarp, 0, stream>>>(
      gate, lists.row_offset.data(), lists.keys[0].data(), lists.entries[0].data(), lists.col_count.data());
  TWELL_CUDA_CHECK_LAUNCH();
  TWELL_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(lists.sort_scratch.data(), sort_bytes, keys, entries,
                                                   static_cast<int>(count), 0, end_bit, stream));
  TWELL_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(lists.sort_scratch.data(), scan_bytes, lists.col_count.data(),
                                                 lists.col_start.data(), cols + 1, stream));
  lists.sorted_entries = entries.Current();

  // Chunks small enough that the hottest neuron no longer sets the time, large enough that the
  // partial rows stay under 2048 per output (16 MiB at D = 2048).
  constexpr int64_t kMinChunkEntries = 256, kMaxPartialRows = 2048;
  lists.chunk_entries =
      static_cast<int32_t>(std::max(kMinChunkEntries, (count + kMaxPartialRows - 1) / kMaxPartialRows));
  lists.max_partials = count / lists.chunk_entries;
  const int threads = 256;
  lists.chunk_start.resize(cols + 1);
  neuron_chunk_count_kernel<<<(cols + threads) / threads, threads, 0, stream>>>(
      lists.col_start.data(), cols, lists.chunk_entries, lists.col_count.data());
  TWELL_CUDA_CHECK_LAUNCH();
  TWELL_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(lists.sort_scratch.data(), scan_bytes, lists.col_count.data(),
                                                 lists.chunk_start.data(), cols + 1, stream));
  lists.chunk_neuron.resize(cols + lists.max_partials);
  chunk_neuron_kernel<<<(cols + threads - 1) / threads, threads, 0, stream>>>(lists.chunk_start.data(), cols,
                                                                             lists.chunk_neuron.data());
  TWELL_CUDA_CHECK_LAUNCH();
}

}  // namespace twell::cuda
