#include "cuda/timed_choice.h"

#include <algorithm>

#include "cuda/cuda_utils.h"
#include "twell/error.h"

namespace twell::cuda {

float median_of(std::vector<float> samples) {
  std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
  return samples[samples.size() / 2];
}

TrialBook::TrialBook(int candidates) : candidates_(candidates) {
  TWELL_REQUIRE(candidates >= 1, "a timed choice needs a candidate, got {}", candidates);
}

TrialBook::Trials& TrialBook::trials(int64_t bucket) {
  Trials& t = trials_[bucket];
  if (t.issued.empty()) {
    t.issued.assign(static_cast<size_t>(candidates_), 0);
    t.samples.resize(static_cast<size_t>(candidates_));
  }
  return t;
}

TrialBook::Turn TrialBook::next(int64_t bucket, const std::vector<bool>& available) {
  TWELL_REQUIRE(available.size() == static_cast<size_t>(candidates_), "timed choice: {} availabilities for {} candidates",
                available.size(), candidates_);
  Trials& t = trials(bucket);
  if (t.chosen >= 0 && available[static_cast<size_t>(t.chosen)]) return {t.chosen, false};
  for (int c = 0; c < candidates_; ++c) {
    int& issued = t.issued[static_cast<size_t>(c)];
    if (!available[static_cast<size_t>(c)] || issued >= kUntimed + kTimed) continue;
    return {c, issued++ >= kUntimed};
  }
  int best = -1;
  float best_ms = 0;
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
  if (best >= 0) return {best, false};
  for (int c = 0; c < candidates_; ++c)
    if (available[static_cast<size_t>(c)]) return {c, false};
  fail("timed choice: no candidate is available");
}

void TrialBook::add_time(int64_t bucket, int candidate, float ms) {
  trials(bucket).samples[static_cast<size_t>(candidate)].push_back(ms);
}

void TrialBook::forget_call(int64_t bucket, int candidate) { --trials(bucket).issued[static_cast<size_t>(candidate)]; }

bool TrialBook::settled(int64_t bucket) const {
  const auto found = trials_.find(bucket);
  return found != trials_.end() && found->second.chosen >= 0;
}

TimedChoice::TimedChoice(int candidates, int spans_per_call) : book_(candidates), spans_per_call_(spans_per_call) {
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
    book_.add_time(slot.bucket, slot.candidate, total);
    slot.in_flight = false;
  }
}

void TimedChoice::abandon() {
  if (current_ >= 0) {
    Slot& slot = slots_[static_cast<size_t>(current_)];
    if (slot.spans_recorded < spans_per_call_) {
      book_.forget_call(slot.bucket, slot.candidate);  // its time would be incomplete
      slot.in_flight = false;
    }
  }
  current_ = -1;
  span_open_ = false;
}

int TimedChoice::choose(int64_t bucket, const std::vector<bool>& available) {
  abandon();
  collect(false, -1);
  const TrialBook::Turn turn = book_.next(bucket, available);
  if (turn.timed) {
    const int index = next_slot_;
    next_slot_ = (next_slot_ + 1) % kSlots;
    if (slots_[static_cast<size_t>(index)].in_flight) collect(true, index);  // the host is kSlots calls ahead
    Slot& slot = slots_[static_cast<size_t>(index)];
    slot.bucket = bucket;
    slot.candidate = turn.candidate;
    slot.spans_recorded = 0;
    slot.in_flight = true;
    current_ = index;
  }
  return turn.candidate;
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

}  // namespace twell::cuda
