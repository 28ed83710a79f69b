// What SparseFfn remembers of the densities its TwELL calls measured, apart from the GPU (host logic
// only, tested without one). Rule and reasons: include/twell/cuda.h, SparseFfn.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace twell::cuda {

class FfnDensityBook {
 public:
  // A TwELL call as the dispatch issued it.
  struct Call {
    int64_t rows = 0;
    int32_t hot = 0;              // > 0: a split's packing (its density is not the layer's)
    int64_t bucket = 0;           // the dispatch bucket it ran in
    const void* layer = nullptr;  // the weights it ran on
    // > 0: a probe, packing a few rows of a dense call of this many rows (density_probe_due): its
    // density is compared with the layer's at that call's M bucket, never kept.
    int64_t probe_of_rows = 0;
  };
  // Dense calls of one (M bucket, layer) per probe of their density. A probe costs about a third of
  // a dense call at M = 1 (the gate GEMM reads all of Wg) and ~1% at M = 16384 (256 rows): at most
  // 0.5% of the dense calls' time.
  static constexpr int kDenseCallsPerProbe = 64;
  // slots: the calls in flight at once (SparseFfn's ring of counter slots).
  explicit FfnDensityBook(int slots);

  void issue(int slot, const Call& call);
  // The non-zeros the call in `slot` packed. A plain TwELL call's density becomes its layer's at its
  // M bucket (and that M bucket's newest). A split's is compared with the first one the same
  // (bucket, hot, layer) saw; a layer's first split in a bucket, while the layer has no density of
  // its own at that M bucket (it runs on another layer's), with the first split any layer ran there.
  // 2 density buckets off (a factor of 4) marks (M bucket, layer) for a recheck. A probe 2 buckets
  // off the density its call was keyed by (the layer's, else borrowed) marks its call's (M bucket,
  // layer) the same way.
  void observe(int slot, uint64_t nnz);
  // Counts a dense call of `rows` on `layer`; true on every kDenseCallsPerProbe-th of that (M bucket,
  // layer), and on the first while the layer runs on another layer's density, after which the caller
  // probes the call's density. While dense runs nothing else packs, so without probes a layer whose
  // input became sparse stayed dense for good (M = 16384: dense at 0.5% after 10%, 0.99x where a
  // split runs 1.63x; docs/perf-notes.md), and so did new weights keyed by a denser layer's density.
  bool density_probe_due(int64_t rows, const void* layer);
  // Non-zeros per row last seen on `layer` at the M bucket of `rows`, else the newest any layer showed
  // at that M bucket; -1 while none was.
  double nnz_per_row(int64_t rows, const void* layer) const;
  // Whether the next call of `rows` on `layer` runs plain TwELL to see the density again; clears the
  // mark.
  bool take_recheck(int64_t rows, const void* layer);

 private:
  using LayerAtRows = std::pair<int64_t, const void*>;  // (M bucket, layer)
  std::vector<Call> calls_;                              // per slot
  std::map<int64_t, double> newest_nnz_per_row_;         // per M bucket, any layer
  std::map<LayerAtRows, double> layer_nnz_per_row_;
  std::map<std::tuple<int64_t, int32_t, const void*>, int64_t> split_density_buckets_;  // first per layer
  std::map<std::pair<int64_t, int32_t>, int64_t> first_split_density_buckets_;         // first of any layer
  std::set<LayerAtRows> rechecks_;
  std::map<LayerAtRows, int64_t> dense_calls_;
};

}  // namespace twell::cuda
