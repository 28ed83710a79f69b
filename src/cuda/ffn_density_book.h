// What SparseFfn remembers of the densities its TwELL calls measured, apart from the GPU (host logic
// only, tested without one). Rule and reasons: include/twell/cuda.h, SparseFfn.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <tuple>
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
  };
  // slots: the calls in flight at once (SparseFfn's ring of counter slots).
  explicit FfnDensityBook(int slots);

  void issue(int slot, const Call& call);
  // The non-zeros the call in `slot` packed. A plain TwELL call's density becomes its M bucket's; a
  // split's is compared with the first one the same (bucket, hot, layer) saw, and 2 density buckets
  // off (a factor of 4) marks its M bucket for a recheck.
  void observe(int slot, uint64_t nnz);
  // Non-zeros per row last seen at the M bucket of `rows`; -1 while none was.
  double nnz_per_row(int64_t rows) const;
  // Whether the next call of `rows` runs plain TwELL to see the density again; clears the mark.
  bool take_recheck(int64_t rows);

 private:
  std::vector<Call> calls_;                 // per slot
  std::map<int64_t, double> nnz_per_row_;  // per M bucket
  std::map<std::tuple<int64_t, int32_t, const void*>, int64_t> split_density_buckets_;
  std::set<int64_t> recheck_rows_;  // M buckets
};

}  // namespace twell::cuda
