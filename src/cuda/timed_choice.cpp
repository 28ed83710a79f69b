#include "cuda/timed_choice.h"

#include <algorithm>
#include <limits>

#include "cuda/cuda_utils.h"
#include "twell/error.h"

namespace twell::cuda {
namespace {

float median_of(std::vector<float> samples) {
  std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
  return samples[samples.size() / 2];
}

}  // namespace

TimedChoice::TimedChoice(int candidates, int spans_per_call)
    : candidates_(candidates), spans_per_call_(spans_per_call) {
  TWELL_REQUIRE(candidates >= 1, "TimedChoice needs a candidate, got {}", candidates);
  TWELL_REQUIRE(spans_per_call >= 1 && spans_per_call <= kMaxSpans, "TimedChoice: 1 to {} spans per call, got {}",
                kMaxSpans, spans_per_call);
  for (Slot& slot : slots_)
    for (auto& span : slot.events)
      for (cudaEvent_t& event : span) TWELL_CUDA_CHECK(cudaEventCreate(&event));
}

TimedChoice::~TimedChoice() {
  for (Slot& slot : slots_)
    for (auto& span : slot.events)
      for (cudaEvent_t event : span) cudaEventDestroy(event);
}

TimedChoice::Trials& TimedChoice::trials(int64_t bucket) {
  Trials& t = trials_[bucket];
  if (t.issued.empty()) {
    t.issued.assign(static_cast<size_t>(candidates_), 0);
    t.samples.resize(static_cast<size_t>(candidates_));
  }
  return t;
}

// Takes in every finished timed call; with wait_for_slot, first waits for that slot's call.
void TimedChoice::collect(bool wait_for_slot, int slot_index) {
  for (int i = 0; i < kSlots; ++i) {
    Slot& slot = slots_[static_cast<size_t>(i)];
    if (!slot.in_flight || i == current_) continue;
    const cudaEvent_t last = slot.events[static_cast<size_t>(spans_per_call_ - 1)][1];
    if (wait_for_slot && i == slot_index) TWELL_CUDA_CHECK(cudaEventSynchronize(last));
    const cudaError_t state = cudaEventQuery(last);
    if (state == cudaErrorNotReady) continue;
    TWELL_CUDA_CHECK(state);
    float total = 0;
    for (int span = 0; span < spans_per_call_; ++span) {
      float ms = 0;
      const auto& events = slot.events[static_cast<size_t>(span)];
      TWELL_CUDA_CHECK(cudaEventElapsedTime(&ms, events[0], events[1]));
      total += ms;
    }
    trials(slot.bucket).samples[static_cast<size_t>(slot.candidate)].push_back(total);
    slot.in_flight = false;
  }
}

void TimedChoice::abandon() {
  if (current_ >= 0) {
    Slot& slot = slots_[static_cast<size_t>(current_)];
    if (slot.spans_recorded < spans_per_call_) {
      // Its time would be incomplete: the candidate runs once more instead.
      --trials(slot.bucket).issued[static_cast<size_t>(slot.candidate)];
      slot.in_flight = false;
    }
  }
  current_ = -1;
  span_open_ = false;
}

int TimedChoice::choose(int64_t bucket, const std::vector<bool>& available) {
  TWELL_REQUIRE(available.size() == static_cast<size_t>(candidates_), "TimedChoice: {} availabilities for {} candidates",
                available.size(), candidates_);
  abandon();
  collect(false, -1);
  Trials& t = trials(bucket);
  if (t.chosen >= 0 && available[static_cast<size_t>(t.chosen)]) return t.chosen;
  for (int c = 0; c < candidates_; ++c) {
    if (!available[static_cast<size_t>(c)] || t.issued[static_cast<size_t>(c)] >= kUntimed + kTimed) continue;
    if (t.issued[static_cast<size_t>(c)]++ >= kUntimed) {
      const int index = next_slot_;
      next_slot_ = (next_slot_ + 1) % kSlots;
      if (slots_[static_cast<size_t>(index)].in_flight) collect(true, index);  // the host is kSlots calls ahead
      Slot& slot = slots_[static_cast<size_t>(index)];
      slot.bucket = bucket;
      slot.candidate = c;
      slot.spans_recorded = 0;
      slot.in_flight = true;
      current_ = index;
    }
    return c;
  }
  // Every candidate has run its calls: the least median among those whose times have arrived.
  int best = -1;
  float best_ms = std::numeric_limits<float>::infinity();
  bool all_arrived = true;
  for (int c = 0; c < candidates_; ++c) {
    if (!available[static_cast<size_t>(c)]) continue;
    const std::vector<float>& samples = t.samples[static_cast<size_t>(c)];
    if (samples.size() < static_cast<size_t>(kTimed)) all_arrived = false;
    if (samples.empty()) continue;
    const float ms = median_of(samples);
    if (best < 0 || ms < best_ms) {
      best = c;
      best_ms = ms;
    }
  }
  if (all_arrived) t.chosen = best;
  if (best >= 0) return best;
  for (int c = 0; c < candidates_; ++c)
    if (available[static_cast<size_t>(c)]) return c;
  fail("TimedChoice: no candidate is available");
}

void TimedChoice::begin_span(cudaStream_t stream) {
  if (current_ < 0) return;
  Slot& slot = slots_[static_cast<size_t>(current_)];
  TWELL_REQUIRE(!span_open_ && slot.spans_recorded < spans_per_call_, "TimedChoice: span begun out of order");
  TWELL_CUDA_CHECK(cudaEventRecord(slot.events[static_cast<size_t>(slot.spans_recorded)][0], stream));
  span_open_ = true;
}

void TimedChoice::end_span(cudaStream_t stream) {
  if (current_ < 0) return;
  Slot& slot = slots_[static_cast<size_t>(current_)];
  TWELL_REQUIRE(span_open_, "TimedChoice: span ended before it began");
  TWELL_CUDA_CHECK(cudaEventRecord(slot.events[static_cast<size_t>(slot.spans_recorded)][1], stream));
  span_open_ = false;
  if (++slot.spans_recorded == spans_per_call_) current_ = -1;  // complete: collected once it has run
}

bool TimedChoice::settled(int64_t bucket) const {
  const auto found = trials_.find(bucket);
  return found != trials_.end() && found->second.chosen >= 0;
}

}  // namespace twell::cuda
