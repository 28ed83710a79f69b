// One schema for every benchmark of the project: `twell bench <name> --json FILE` writes a JSON
// array of these records. Keep the keys stable: the JSON is re-measured and compared elsewhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace twell {

struct TimingStats {
  double median_ms = 0;
  double p10_ms = 0;
  double p90_ms = 0;
  int reps = 0;
};

// Percentiles of the samples (nearest rank); throws on an empty sample.
TimingStats summarize_ms(std::vector<double> samples_ms);
// The order in which a benchmark round times `count` implementations that take turns: a fixed
// pseudo-random permutation per round, so that each follows each other about equally often (a
// rotation keeps the same neighbours; on the H200 a call right after a split's two streams ran
// 2-4% slower at M <= 256, docs/perf-notes.md).
std::vector<size_t> round_order(size_t count, int round);

struct BenchRecord {
  std::string bench;     // "ffn", "decode", ...
  std::string device;    // "cpu" or "cuda"
  std::string gpu_name;  // GPU name, or the CPU model on the CPU
  std::string impl;      // "dense", "twell", "predict", ...
  int64_t M = 0;
  int32_t D = 0;
  int32_t H = 0;
  double target_density = 0;
  double nnz_per_row = 0;  // achieved mean non-zeros per row of the relu projection
  TimingStats timing;
  double rel_err = 0;      // ||y - y_ref|| / ||y_ref|| against the float64 reference
  int64_t peak_bytes = 0;  // peak extra memory of the implementation
  std::string commit;
  std::string date;
  nlohmann::json extra = nlohmann::json::object();  // bench-specific fields (speedup, GB/s, ...)
};

// A record of what was measured (bench, impl), where (device, gpu_name) and on which shape, with
// this binary's commit and today's date; the caller adds the timing, errors, memory and extras.
BenchRecord new_bench_record(const std::string& bench, const std::string& device, const std::string& gpu_name,
                             const std::string& impl, int64_t M, int32_t D, int32_t H, double target_density = 0);

nlohmann::json to_json(const BenchRecord& record);
// Writes atomically (temp file + rename).
void write_bench_json(const std::string& path, const std::vector<BenchRecord>& records);

std::string build_commit();   // git commit the binary was built from ("-dirty" when the tree had changes)
std::string today_utc();      // YYYY-MM-DD
std::string cpu_model_name();

// ||got - ref||_2 / ||ref||_2 (0 when both are 0); NaN anywhere gives NaN.
double relative_l2_error(const float* got, const double* ref, size_t count);

}  // namespace twell
