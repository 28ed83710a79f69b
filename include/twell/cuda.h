// CUDA backend (sm_90a, H100/H200): batched sparse FFN inference on bf16 data with fp32 accumulation.
//
//   gate_to_twell   g = relu(x·W^T) on the tensor cores (WGMMA fed by TMA), packed into TwELL in the
//                   GEMM's epilogue: no dense [M, H] gate ever reaches global memory.
//   ffn_from_twell  y = Σ_j g_j·(x·Wu[j])·Wd[j] over the packed non-zeros (gated), or Σ_j g_j·Wd[j]
//                   (non-gated); fp32 accumulation, y written once as bf16.
//   DenseFfn        the baseline: cuBLASLt bf16 GEMMs and one elementwise kernel for act(g) ⊙ u; or,
//                   as SparseFfn runs it, the relu gate applied in the up GEMM's epilogue instead,
//                   or gate and up in one batched launch.
//   SparseFfn       the FFN a model calls: picks TwELL or dense per call (rule in SparseFfn below).
//
// All pointers named x, y are device pointers to bf16 [M, D], row-major. Every op is asynchronous on
// the given stream unless its comment says otherwise. Weights use the canonical neuron-major layout
// [H, D] of host_tensors.h. D must be a multiple of 64 (16-byte TMA rows, whole k-tiles) and at most
// 8192 (ffn_from_twell: one 16-byte vector of y per thread of a block); H <= 65536.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <memory>
#include <set>
#include <vector>

#include <cuda_runtime.h>

#include "twell/bench_record.h"
#include "twell/host_tensors.h"

namespace twell::cuda {

// True when a CUDA device can be used (tests skip cleanly when false).
bool available();
// The GPU's name, as cudaGetDeviceProperties reports it.
const char* device_name();
// The GPU's L2 cache size in bytes.
size_t l2_bytes();

// ---- device memory ------------------------------------------------------------------------------
void* device_allocate(size_t bytes);  // throws twell::Error naming the size when the GPU is full
void device_free(void* pointer) noexcept;
struct DeviceFree {
  void operator()(void* pointer) const noexcept { device_free(pointer); }
};
template <typename T>
using DeviceArray = std::unique_ptr<T[], DeviceFree>;
template <typename T>
DeviceArray<T> make_device_array(size_t count) {
  return DeviceArray<T>(static_cast<T*>(device_allocate(count * sizeof(T))));
}
void copy_to_device(void* device, const void* host, size_t bytes, cudaStream_t stream = nullptr);
// Synchronizes `stream` before returning.
void copy_to_host(void* host, const void* device, size_t bytes, cudaStream_t stream = nullptr);
// Benchmarks: reads a buffer twice the L2's size, so that the call timed next finds nothing an
// earlier call left in the L2 (its weights come from DRAM, as a model's layer finds them). A read:
// a write would leave dirty lines for the timed call to write back.
class L2Evictor {
 public:
  L2Evictor();
  void run(cudaStream_t stream = nullptr) const;

 private:
  size_t words_ = 0;
  DeviceArray<uint4> buffer_;
  DeviceArray<unsigned> sink_;
};
// Benchmarks: the time per call of `calls` calls of run(i, stream) (i = 0 .. calls-1) captured in one
// CUDA graph, over `reps` replays after 3 warm-up replays; `evictor` (if given) empties the L2 before
// each replay. A graph of calls is how a decode step runs them: launch gaps as small as they get,
// the next call's programmatic launch overlapping this one's end.
TimingStats time_graph(const std::function<void(int, cudaStream_t)>& run, int calls, int reps,
                       const L2Evictor* evictor = nullptr);
// Uploads fp32 host values as bf16 (round to nearest even).
DeviceArray<bf16> upload_bf16(const float* host, size_t count, cudaStream_t stream = nullptr);
std::vector<float> download_bf16(const bf16* device, size_t count, cudaStream_t stream = nullptr);

// ---- FFN weights on the device ----------------------------------------------------------------
// What the batched FFN ops read: FFN weights on the device, not owned. The FFN is a sum over its
// neurons, so any range of them (the same rows of all three matrices) is an FFN of its own whose
// outputs add up to the whole: SparseFfn runs the most active neurons densely and the rest sparsely.
struct DeviceFfnView {
  int32_t d_model = 0;   // D
  int32_t d_hidden = 0;  // H (of the view)
  bool gated = true;
  const bf16* gate = nullptr;  // [H, D] (null when !gated)
  const bf16* up = nullptr;    // [H, D]
  const bf16* down = nullptr;  // [H, D]

  const bf16* relu_projection() const { return gated ? gate : up; }
  // Neurons [begin, end) of this view.
  DeviceFfnView neurons(int32_t begin, int32_t end) const;
};

struct DeviceFfnWeights {
  int32_t d_model = 0;   // D
  int32_t d_hidden = 0;  // H
  bool gated = true;
  DeviceArray<bf16> gate;  // [H, D] (null when !gated)
  DeviceArray<bf16> up;    // [H, D]
  DeviceArray<bf16> down;  // [H, D]

  // The projection whose relu is packed: gate when gated, up otherwise (host_tensors.h).
  const bf16* relu_projection() const { return gated ? gate.get() : up.get(); }
  DeviceFfnView view() const { return {d_model, d_hidden, gated, gate.get(), up.get(), down.get()}; }
  operator DeviceFfnView() const { return view(); }  // NOLINT: the ops take views of whole layers too
};
// Validates and uploads (every value rounded to bf16); synchronous.
DeviceFfnWeights upload_weights(const FfnWeights& weights);

// ---- TwELL on the device (layout: include/twell/formats/twell.h) -----------------------------
struct DeviceTwell {
  TwellShape shape;
  int64_t spill_capacity = 0;          // spill rows allocated
  DeviceArray<TwellSlot> slots;        // [M, n_tiles, S]
  DeviceArray<int32_t> tile_nnz;       // [M, n_tiles]
  DeviceArray<bf16> spill;             // [spill_capacity, T]
  DeviceArray<int32_t> spill_used;     // [1] spill rows the last packing asked for
  DeviceArray<unsigned long long> nnz_total;  // [1] non-zeros the last packing found (for SparseFfn)
  int64_t slot_capacity = 0;           // slots allocated (>= shape.slot_count())
  int64_t tile_capacity = 0;           // tile_nnz entries allocated

  bool empty() const { return !slots; }
};
// Shapes `packed` for `shape` with at least `spill_rows` spill rows; reallocates only to grow.
void reserve(DeviceTwell& packed, const TwellShape& shape, int64_t spill_rows);
// Host copy (slots, counts, spill rows in use, spill_used); synchronous.
TwellMatrix download(const DeviceTwell& packed, cudaStream_t stream = nullptr);
// Device copy of a host packing (any valid one, e.g. twell_from_dense's); synchronous.
void upload(const TwellMatrix& packed, DeviceTwell& out, cudaStream_t stream = nullptr);
// The spill rows the last packing asked for (synchronous read of spill_used).
int32_t spill_rows_used(const DeviceTwell& packed, cudaStream_t stream = nullptr);

// ---- ops ---------------------------------------------------------------------------------------
// Packs g = relu(x·W^T), W = weights.relu_projection(), x [M, D]. Reserves `out` for
// (M, H, tile, compression); keeps its spill capacity (at least M·n_tiles/16 rows). Asynchronous:
// afterwards spill_used may exceed the capacity (an incomplete packing, twell.h); then either call
// gate_to_twell_complete, or hand it to ffn_from_twell, which recomputes the lost tiles exactly.
void gate_to_twell(const bf16* x, int64_t rows, const DeviceFfnView& weights, int32_t tile,
                   int32_t compression, DeviceTwell& out, cudaStream_t stream = nullptr);
// As gate_to_twell, then (synchronously) while the spill was too small: grow it and pack again.
void gate_to_twell_complete(const bf16* x, int64_t rows, const DeviceFfnView& weights, int32_t tile,
                            int32_t compression, DeviceTwell& out, cudaStream_t stream = nullptr);

// y [M, D] from the packed relu projection: gated -> up and down only at non-zero gates, non-gated
// -> down only. A tile whose spill row was lost to a too-small spill (row >= capacity) is recomputed
// from x and W (the same relu(x·W^T) the packer saw, fp32 accumulation), so no input is ever wrong.
// accumulate: y += the FFN (y's bf16 value is the sum's starting point; one rounding at the end).
void ffn_from_twell(const bf16* x, const DeviceTwell& gate, const DeviceFfnView& weights, bf16* y,
                    cudaStream_t stream = nullptr, bool accumulate = false);

// Dense baseline through cuBLASLt: gate GEMM, up GEMM, h = act(g) ⊙ u (one elementwise kernel),
// down GEMM (non-gated: up GEMM with ReLU epilogue, down GEMM). Holds the GEMM plans, a workspace and
// the [M, H] intermediates (grown, never shrunk: a call allocates only when M grows).
struct GateActivation {
  FfnActivation kind = FfnActivation::relu;
  float threshold = 0.0f;  // fatrelu only
};
// What DenseFfn does beyond the baseline's cuBLASLt GEMMs (the baseline: the defaults).
struct DenseFfnOptions {
  static constexpr int64_t kNeverFused = INT64_MAX;
  // Calls of at least this many rows with a relu gate (H and D multiples of 8) apply the gate in the
  // up GEMM's epilogue (twell's CUTLASS kernel: h = relu(g) ⊙ (x·Wu^T)) instead of cuBLASLt's up
  // GEMM and an elementwise pass over g, u and h (cuBLASLt has no such epilogue).
  int64_t fuse_gate_from_rows = kNeverFused;
  // Calls not fused run the gate and up GEMMs as one cuBLASLt launch, a batch of two sharing x (where
  // the two weight matrices lie a multiple of 8 elements apart): below a wave of output tiles, two
  // launches leave most SMs idle twice.
  bool batch_gate_and_up = false;
};
class DenseFfn {
 public:
  // SparseFfn's dense path and a split's dense part (twell_options()) fuse from kFusedGateMinRows:
  // the whole dense FFN at D = 2048, H = 5632 on an H100 is 0.95x the baseline at M = 1024, 1.05x at
  // 4096, 1.06x at 16384 (docs/perf-notes.md); below, they batch gate and up.
  static constexpr int64_t kFusedGateMinRows = 4096;
  static constexpr int64_t kNeverFused = DenseFfnOptions::kNeverFused;
  static DenseFfnOptions twell_options() { return {.fuse_gate_from_rows = kFusedGateMinRows, .batch_gate_and_up = true}; }
  explicit DenseFfn(DenseFfnOptions options = {});
  ~DenseFfn();
  DenseFfn(DenseFfn&&) noexcept;
  DenseFfn& operator=(DenseFfn&&) noexcept;

  // Non-gated weights take relu only. add_to_y: y += the FFN (beta = 1 in the down GEMM). y_ready
  // (if given): an event the down GEMM waits for, the only product that touches y, so that y's other
  // producer (a split's TwELL part on another stream) runs beside the gate and up GEMMs.
  void run(const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y, cudaStream_t stream = nullptr,
           GateActivation activation = {}, bool add_to_y = false, cudaEvent_t y_ready = nullptr);
  // Device bytes held beyond the inputs and outputs (workspace + intermediates).
  int64_t scratch_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The FFN with dispatch. Rule: for each (M bucket = ceil(log2 M), density bucket = floor(log2(1 +
// non-zeros per row)) of the latest plain TwELL packing of that M bucket on the same weights whose
// counters have arrived, else of the latest on any weights: a model shares one SparseFfn), the
// first call of a bucket runs TwELL and the second runs dense, each once untimed (one-time costs
// such as plans and allocations) and then 5 times timed with CUDA events, the median kept (one
// synchronization each; the median, not the fastest, because one lucky TwELL run flipped M = 16 to a
// path 14% slower); a TwELL time counts for the bucket of the density that call measured. Later
// calls in the bucket take the faster, so a call is never slower than dense by more than the timing
// noise of those runs. Once every path of a bucket is timed, the two fastest, if within kCloseRatio
// (10%) of each other, are timed once more in one call, taking turns, and those medians decide: timed
// in calls of their own, one after the other, close paths swapped places with the GPU's clock drift
// (dense chosen over a 5% faster split at D = 4096).
// The packer's counters come back asynchronously through a ring of kCounterSlots pinned slots: a call
// reads every slot whose copy has finished, oldest first, without waiting; only when the GPU is a
// whole ring behind does a call wait for the oldest, so the density a call is keyed by is at most
// kCounterSlots TwELL calls old even when the host runs far ahead (with one slot, a host that stays
// ahead never saw a density change). Dense calls pack nothing: every
// FfnDensityBook::kDenseCallsPerProbe-th dense call of an (M bucket, layer), and the first of a layer
// keyed by another's density, also packs kProbeRows of its rows (from the middle of the batch), and a
// probe 2 density buckets off the call's key makes a later call a plain TwELL recheck (without it, a
// layer whose input turned from 10% to 0.5% stayed dense, 0.99x where a split ran 1.63x). The spill
// grows (for the next call) when a packing overflowed it.
//
// Split paths (hot_fractions): the neurons [0, f·H) (rounded to whole TwELL tiles) run through
// DenseFfn and the rest through TwELL, which adds its part into y. A path of its own per fraction,
// timed like the others (after TwELL and dense) and taken when fastest. It pays when the weights'
// neurons are sorted by how often they are active (sort_neurons_by_activity, host_tensors.h): the
// few neurons active for many tokens then cost a dense GEMM's share instead of two weight rows per
// non-zero. A split call measures only its sparse part's density, so it does not update the layer's;
// it is compared with the one its path saw when first run in the bucket on the same weights (a model
// shares one SparseFfn among its layers, whose densities differ) or, while those weights run on
// another layer's density (new weights), with the first split any weights ran in the bucket. When
// its density bucket differs by 2 or more (the input changed by a factor of 4; one bucket is the
// call-to-call noise of few rows), the next call of that M bucket on those weights runs plain TwELL
// to observe their density again. (Without the second comparison, new weights 20x denser kept the
// split chosen at 0.5%: 0.24x dense at 10%.)
// The two parts of a split run side by side (split_side_stream): TwELL writes y on the caller's
// stream while the dense part's gate and up GEMMs run on a second stream of the op's own; only its
// down GEMM waits for TwELL's y and adds to it. The tensor-core GEMMs and the L2-bound up+down kernel
// then share the GPU instead of taking turns. The caller's stream waits for both before it goes on.
class SideStream;      // src/cuda/cuda_utils.h
class FfnDensityBook;  // src/cuda/ffn_density_book.h
struct SparseFfnOptions {
  int32_t tile = 128;
  int32_t compression = 4;
  bool allow_dense = true;  // false: never the all-dense path (benchmarks of the kernels themselves)
  std::vector<double> hot_fractions;  // each in (0, 1); empty: no split paths
  bool split_side_stream = true;      // false: a split's parts one after the other on one stream

  // The split fractions timed on weights whose neurons are sorted by activity (twell bench ffn's
  // twell_split and twell_auto, a CudaModel built from an ordered Model); docs/perf-notes.md has
  // which one the dispatch takes per (M, density).
  static inline const std::vector<double> kSortedNeuronHotFractions = {0.125, 0.25, 0.375, 0.5};
};
class SparseFfn {
 public:
  explicit SparseFfn(SparseFfnOptions options = {});
  ~SparseFfn();

  void run(const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y, cudaStream_t stream = nullptr);
  bool last_call_was_dense() const { return last_path_ == kDensePath; }
  // Neurons the last call ran densely ahead of TwELL (0: plain TwELL, or all-dense).
  int32_t last_hot_neurons() const { return last_hot_neurons_; }
  // Whether the last call was one of the dispatch's own measurements (a path's timed runs, or
  // TwELL run to see the density again) rather than the chosen path: a benchmark of the steady
  // state warms up until such calls stop.
  bool last_call_measured() const { return last_call_measured_; }
  // What the dispatch chose the last call's path from: its median ms per path in that call's
  // (M, density) bucket, named "twell", "dense" or "hot_F" (the split whose hot fraction of H is F);
  // paths not measured yet or not available are left out.
  std::vector<std::pair<std::string, float>> last_bucket_times() const;
  const DeviceTwell& packed() const { return packed_; }
  int64_t scratch_bytes() const;

 private:
  // Paths: kTwellPath, kDensePath, then one split per hot fraction.
  static constexpr int kTwellPath = 0, kDensePath = 1, kFirstSplitPath = 2;
  int path_count() const { return kFirstSplitPath + static_cast<int>(options_.hot_fractions.size()); }
  // Neurons a path runs densely ahead of TwELL (0 for TwELL and dense).
  int32_t hot_neurons(int path, int32_t hidden) const;
  bool path_available(int path, int32_t hidden) const;
  static constexpr int kTimedRuns = 5;  // per path and measurement, after one untimed run
  // The two fastest paths are timed again in alternation when within this ratio of each other.
  static constexpr float kCloseRatio = 1.1f;
  float time_once(int path, const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y, cudaStream_t stream);
  float timed_run(int path, const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y, cudaStream_t stream);
  // Times both paths kTimedRuns times, taking turns, and stores their medians in `timing`.
  void time_in_turns(const int (&paths)[2], const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y,
                     cudaStream_t stream, std::vector<float>& timing);
  void run_path(int path, const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y, cudaStream_t stream);

  // One TwELL call's counters, copied from the device at its end.
  struct Counters {
    unsigned long long nnz;
    int32_t spill_used;
  };
  static constexpr int kCounterSlots = 4;
  // Reads the finished slots (waits for the oldest only when all kCounterSlots are in flight and
  // unread) into densities_, and grows the spill when a packing overflowed it.
  void read_counters();
  // Copies the packing's counters into the next slot, described to densities_ as a call of `rows` on
  // `layer` (FfnDensityBook::Call: `hot` neurons ran densely; a probe of a call of probe_of_rows).
  void copy_counters(int64_t rows, int32_t hot, const void* layer, int64_t probe_of_rows, cudaStream_t stream);
  // Packs up to kProbeRows rows of a dense call, for their density only (FfnDensityBook).
  static constexpr int64_t kProbeRows = 256;
  void probe_density(const bf16* x, int64_t rows, const DeviceFfnView& weights, cudaStream_t stream);

  SparseFfnOptions options_;
  DeviceTwell packed_;
  DenseFfn dense_{DenseFfn::twell_options()};  // the dense path and a split's dense part
  std::map<int64_t, std::vector<float>> timings_;  // per bucket: median ms per path, < 0 unmeasured
  std::set<int64_t> compared_buckets_;  // buckets whose two fastest paths were timed in alternation
  // The densities seen, per M bucket and weights: a call is keyed by its own M's. One density for
  // all M let a batch-1 decode step's single row (noisy, often a bucket off) key the next prefill
  // into a bucket whose TwELL time never arrives (it goes to the bucket of the density the timed run
  // measures), so every such prefill ran a timed TwELL call: ~50 ms of the 2B forward
  // (docs/perf-notes.md).
  std::unique_ptr<FfnDensityBook> densities_;
  int64_t current_bucket_ = 0;  // of the call being issued
  int last_path_ = kTwellPath;
  int32_t last_hot_neurons_ = 0;
  bool last_call_measured_ = false;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  // The split's dense part runs here, its down GEMM after twell_done_ (TwELL's y on the caller's stream).
  std::unique_ptr<SideStream> side_;
  cudaEvent_t twell_done_ = nullptr;
  Counters* counters_host_ = nullptr;             // pinned [kCounterSlots]
  cudaEvent_t counters_ready_[kCounterSlots] = {};  // recorded after each slot's copy
  int64_t twell_calls_ = 0;  // TwELL calls issued; call c uses slot c % kCounterSlots
  int64_t newest_read_ = -1;  // the newest call whose counters were read
};

}  // namespace twell::cuda
