// TimedChoice: per bucket of similar calls, the fastest of a few interchangeable ways to make a call
// (its candidates), found by timing the calls themselves. Each candidate runs kUntimed + kTimed
// times in a row (the untimed first run takes allocations and plans); a timed call is one or more
// spans on its stream, bracketed by CUDA events and read back without waiting; once every
// candidate's timed calls have arrived the bucket keeps the one of least median time.
//
// The training op uses it with two spans per call, forward and backward, because a model runs its
// other layers between them and those must not count.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include <cuda_runtime.h>

namespace twell::cuda {

// The buckets of similar calls both dispatches (SparseFfn, the training op) keep their choices in:
// floor(log2(1 + non-zeros per row)), -1 while unknown (nnz_per_row < 0); and per call, that with
// ceil(log2 rows).
inline int64_t density_bucket(double nnz_per_row) {
  return nnz_per_row < 0 ? -1 : static_cast<int64_t>(std::floor(std::log2(1.0 + nnz_per_row)));
}
inline int64_t row_bucket(int64_t rows) {
  return static_cast<int64_t>(std::ceil(std::log2(static_cast<double>(rows))));
}
inline int64_t call_bucket(int64_t rows, double nnz_per_row) {
  return row_bucket(rows) * 64 + density_bucket(nnz_per_row) + 1;
}

// The median of timed samples (one of them; the upper middle for an even count).
float median_of(std::vector<float> samples);

// The fastest of per-path times (ms; negative or non-finite: not a candidate) and the second
// fastest when it lies within `close_ratio` of the first, the pair a dispatch times again side by
// side (-1 where there is none).
struct FastestTwo {
  int best = -1, close_second = -1;
};
inline FastestTwo fastest_two(const std::vector<float>& ms, float close_ratio) {
  const auto fastest = [&](int skip) {
    int found = -1;
    for (int i = 0; i < static_cast<int>(ms.size()); ++i)
      if (i != skip && ms[i] >= 0 && std::isfinite(ms[i]) && (found < 0 || ms[i] < ms[found])) found = i;
    return found;
  };
  FastestTwo two;
  two.best = fastest(-1);
  const int second = two.best < 0 ? -1 : fastest(two.best);
  if (second >= 0 && ms[second] <= close_ratio * ms[two.best]) two.close_second = second;
  return two;
}

// Both ops' split candidates: f·H hot neurons rounded to whole TwELL tiles of `tile` columns, so the
// sparse part's packing starts on a tile boundary (and the hot part's GEMMs get whole multiples of
// 64); 0 where that leaves no neuron on either side. On the H200 the 768 this gives for 1/8 of
// H = 5632 (the sparse part 19 whole 256-column tiles of the gate kernel) beat 704 in 7 of 8
// paired training runs, by 0.9% on average (docs/perf-notes.md).
inline int32_t split_hot_neurons(double fraction, int32_t hidden, int32_t tile) {
  const int32_t hot = static_cast<int32_t>(std::lround(fraction * hidden / tile)) * tile;
  return hot > 0 && hot < hidden ? hot : 0;
}

// The bookkeeping of a timed choice apart from the clock: which candidate the next call runs and
// whether it is timed, the times that arrived, the choice. Host logic only.
class TrialBook {
 public:
  static constexpr int kUntimed = 1;
  static constexpr int kTimed = 3;

  explicit TrialBook(int candidates);

  struct Turn {
    int candidate = 0;
    bool timed = false;
  };
  // The next call in `bucket`: a candidate with available[c] true (at least one must be). While
  // candidates have calls to run, the first such; then the least median among the arrived times,
  // which becomes the bucket's choice once every available candidate's times are in.
  Turn next(int64_t bucket, const std::vector<bool>& available);
  void add_time(int64_t bucket, int candidate, float ms);
  // A call begun by next() whose time will not come: its candidate runs once more.
  void forget_call(int64_t bucket, int candidate);
  bool settled(int64_t bucket) const;

 private:
  struct Trials {
    std::vector<int> issued;                  // calls begun per candidate
    std::vector<std::vector<float>> samples;  // arrived timed calls per candidate, ms
    int chosen = -1;
  };
  Trials& trials(int64_t bucket);

  int candidates_;
  std::map<int64_t, Trials> trials_;
};

class TimedChoice {
 public:
  static constexpr int kMaxSpans = 2;

  TimedChoice(int candidates, int spans_per_call);
  ~TimedChoice();
  TimedChoice(const TimedChoice&) = delete;
  TimedChoice& operator=(const TimedChoice&) = delete;

  // The candidate for the next call in `bucket` (TrialBook::next). Collects the times that have
  // arrived; a call begun earlier whose spans were not all recorded is dropped and runs again.
  int choose(int64_t bucket, const std::vector<bool>& available);
  // The chosen call's spans, in order, on the stream they run on; no-ops for an untimed call.
  void begin_span(cudaStream_t stream);
  void end_span(cudaStream_t stream);
  // Ends any call in progress without its time (the caller ran something else).
  void abandon();
  // Whether `bucket` has made its choice: the choose() after the last timed call's time arrived.
  bool settled(int64_t bucket) const { return book_.settled(bucket); }

 private:
  struct Slot {
    std::array<std::array<cudaEvent_t, 2>, kMaxSpans> events{};
    int64_t bucket = 0;
    int candidate = 0;
    int spans_recorded = 0;
    bool in_flight = false;
  };
  static constexpr int kSlots = 4;

  // Takes in every finished timed call; with wait_for_slot, first waits for that slot's call.
  void collect(bool wait_for_slot, int slot_index);

  TrialBook book_;
  int spans_per_call_;
  std::array<Slot, kSlots> slots_{};
  int next_slot_ = 0;
  int current_ = -1;  // slot of the call in progress, -1 when untimed or none
  bool span_open_ = false;
};

}  // namespace twell::cuda
