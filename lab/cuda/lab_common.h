// What every kernel lab shares: comma-separated argument lists, the rotated input sets and their
// CUDA-event timing (warm-up first, then one event pair per call; median and spread), the small
// gate shapes both checks start from, the comparison of a packed gate with the float64
// reference's, bench records and main's frame.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "cuda/cuda_utils.h"
#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/cuda.h"
#include "twell/workload.h"

namespace twell::lab {

inline std::vector<int64_t> parse_list_int(const char* text) {
  std::vector<int64_t> values;
  for (const char* p = text; *p;) {
    values.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return values;
}

inline std::vector<double> parse_list_double(const char* text) {
  std::vector<double> values;
  for (const char* p = text; *p;) {
    values.push_back(std::strtod(p, const_cast<char**>(&p)));
    if (*p == ',') ++p;
  }
  return values;
}

// Inputs rotated over this many sets of x so the L2 cache does not hold them between calls.
constexpr int kInputSets = 3;

// The workload's kInputSets rotated inputs (twell/workload.h) on the device, [M, D] each.
inline std::vector<cuda::DeviceArray<bf16>> upload_input_sets(const Workload& work) {
  std::vector<cuda::DeviceArray<bf16>> x;
  for (const std::vector<float>& input : rotated_inputs(work, kInputSets))
    x.push_back(cuda::upload_bf16(input.data(), input.size()));
  return x;
}

// A gate -> TwELL shape with its tile size T and compression C.
struct GateCase {
  WorkloadSpec spec;
  int32_t tile, compression;
};

// The small shapes every lab check starts from: one row, a partial last tile in H, T = 256 with hot
// neurons, a non-gated FFN, every value active.
inline std::vector<GateCase> small_gate_cases() {
  return {
      {{.rows = 1, .d_model = 64, .d_hidden = 128, .density = 0.05, .seed = 1}, 128, 4},
      {{.rows = 17, .d_model = 512, .d_hidden = 1000, .density = 0.1, .seed = 2}, 128, 2},
      {{.rows = 300, .d_model = 256, .d_hidden = 4097, .density = 0.02, .hot_neurons = 5, .seed = 3}, 256, 8},
      {{.rows = 129, .d_model = 2048, .d_hidden = 5632, .density = 0.5, .gated = false, .seed = 4}, 256, 4},
      {{.rows = 3, .d_model = 4096, .d_hidden = 1000, .density = 1.0, .seed = 5}, 128, 8},
  };
}

// calls[k](i) runs implementation k on input set i (0 .. input_sets-1). 5 warm-up rounds, then `reps`
// timed rounds; a round times each implementation once, in turn (round_order: none always follows
// the same one), so that drift of the clocks over
// the run falls on all of them alike (sequential blocks of identical cuBLASLt calls were seen to
// differ by up to 9%). Before each timed call cuda::L2Evictor empties the L2: otherwise an
// implementation timed right after one that read the same weights finds them there (a layer of a
// model finds them in DRAM). One TimingStats per implementation.
inline std::vector<TimingStats> time_interleaved(int reps, int input_sets,
                                                 const std::vector<std::function<void(int)>>& calls) {
  cudaEvent_t start, stop;
  TWELL_CUDA_CHECK(cudaEventCreate(&start));
  TWELL_CUDA_CHECK(cudaEventCreate(&stop));
  const cuda::L2Evictor evictor;
  for (int i = 0; i < 5; ++i)
    for (const auto& call : calls) call(i % input_sets);
  std::vector<std::vector<double>> samples(calls.size());
  for (int i = 0; i < reps; ++i)
    for (size_t k : round_order(calls.size(), i)) {
      evictor.run();
      TWELL_CUDA_CHECK(cudaEventRecord(start));
      calls[k](i % input_sets);
      TWELL_CUDA_CHECK(cudaEventRecord(stop));
      TWELL_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      TWELL_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      samples[k].push_back(ms);
    }
  TWELL_CUDA_CHECK(cudaEventDestroy(start));
  TWELL_CUDA_CHECK(cudaEventDestroy(stop));
  std::vector<TimingStats> stats;
  for (const auto& s : samples) stats.push_back(summarize_ms(s));
  return stats;
}

// One implementation: call(i) runs it on input set i.
template <typename Fn>
TimingStats time_calls(int reps, int input_sets, Fn&& call) {
  return time_interleaved(reps, input_sets, {std::function<void(int)>(std::forward<Fn>(call))})[0];
}

// Elements of the two unpacked gates that differ by more than bf16 rounding of an fp32 sum against
// bf16 of the float64 sum (one rounding step; a gate within fp32 rounding of 0 may fall either side).
inline int64_t differing_values(const TwellMatrix& got, const TwellMatrix& want) {
  const std::vector<bf16> got_dense = dense_from_twell(got), want_dense = dense_from_twell(want);
  float largest = 0.f;
  for (const bf16 value : want_dense) largest = std::max(largest, std::fabs(to_float(value)));
  int64_t differing = 0;
  for (size_t i = 0; i < got_dense.size(); ++i)
    if (std::fabs(to_float(got_dense[i]) - to_float(want_dense[i])) >
        1e-2f * std::fabs(to_float(want_dense[i])) + 1e-4f * largest)
      ++differing;
  return differing;
}

// A record on this GPU with its timing (new_bench_record); the caller adds errors, memory and extras.
inline BenchRecord cuda_record(const std::string& bench, const std::string& impl, int64_t rows, int32_t d_model,
                               int32_t d_hidden, double density, const TimingStats& timing) {
  BenchRecord r = new_bench_record(bench, "cuda", cuda::device_name(), impl, rows, d_model, d_hidden, density);
  r.timing = timing;
  return r;
}

// A lab's main: `body` returns the exit code; without a CUDA device nothing runs (exit 0), and an
// exception becomes one line "NAME: error: ..." and exit 1.
template <typename Body>
int run_main(const char* name, Body&& body) {
  try {
    if (!cuda::available()) {
      std::printf("no CUDA device: nothing to do\n");
      return 0;
    }
    return body();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s: error: %s\n", name, error.what());
    return 1;
  }
}

}  // namespace twell::lab
