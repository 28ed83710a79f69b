#include "twell/bench_record.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "twell/error.h"
#include "twell_build_commit.h"  // TWELL_GIT_COMMIT, written at every build (cmake/commit_stamp.cmake)

namespace twell {

std::vector<size_t> round_order(size_t count, int round) {
  std::vector<size_t> order(count);
  std::iota(order.begin(), order.end(), size_t{0});
  std::mt19937 rng(static_cast<uint32_t>(round));
  std::shuffle(order.begin(), order.end(), rng);
  return order;
}

TimingStats summarize_ms(std::vector<double> samples_ms) {
  TWELL_REQUIRE(!samples_ms.empty(), "summarize_ms needs at least one sample");
  std::sort(samples_ms.begin(), samples_ms.end());
  auto rank = [&](double q) {
    size_t index = static_cast<size_t>(std::ceil(q * static_cast<double>(samples_ms.size()))) ;
    return samples_ms[std::min(samples_ms.size() - 1, index == 0 ? 0 : index - 1)];
  };
  TimingStats stats;
  stats.median_ms = samples_ms.size() % 2 ? samples_ms[samples_ms.size() / 2]
                                          : 0.5 * (samples_ms[samples_ms.size() / 2 - 1] + samples_ms[samples_ms.size() / 2]);
  stats.p10_ms = rank(0.10);
  stats.p90_ms = rank(0.90);
  stats.reps = static_cast<int>(samples_ms.size());
  return stats;
}

nlohmann::json to_json(const BenchRecord& r) {
  nlohmann::json j = {
      {"bench", r.bench}, {"device", r.device}, {"gpu_name", r.gpu_name}, {"impl", r.impl},
      {"M", r.M}, {"D", r.D}, {"H", r.H}, {"target_density", r.target_density},
      {"nnz_per_row", r.nnz_per_row}, {"median_ms", r.timing.median_ms}, {"p10_ms", r.timing.p10_ms},
      {"p90_ms", r.timing.p90_ms}, {"reps", r.timing.reps}, {"rel_err", r.rel_err},
      {"peak_bytes", r.peak_bytes}, {"commit", r.commit}, {"date", r.date}};
  for (auto& [key, value] : r.extra.items()) j[key] = value;
  return j;
}

BenchRecord new_bench_record(const std::string& bench, const std::string& device, const std::string& gpu_name,
                             const std::string& impl, int64_t M, int32_t D, int32_t H, double target_density) {
  BenchRecord r;
  r.bench = bench;
  r.device = device;
  r.gpu_name = gpu_name;
  r.impl = impl;
  r.M = M;
  r.D = D;
  r.H = H;
  r.target_density = target_density;
  r.commit = build_commit();
  r.date = today_utc();
  return r;
}

void write_bench_json(const std::string& path, const std::vector<BenchRecord>& records) {
  nlohmann::json array = nlohmann::json::array();
  for (const auto& record : records) array.push_back(to_json(record));
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp);
    TWELL_REQUIRE(out.good(), "cannot open '{}' for writing the benchmark JSON", temp);
    out << array.dump(2) << '\n';
    TWELL_REQUIRE(out.good(), "writing the benchmark JSON to '{}' failed", temp);
  }
  std::filesystem::rename(temp, path);
}

std::string build_commit() { return TWELL_GIT_COMMIT; }

std::string today_utc() {
  std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[16];
  std::strftime(text, sizeof text, "%Y-%m-%d", &utc);
  return text;
}

std::string cpu_model_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line))
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown cpu";
}

double relative_l2_error(const float* got, const double* ref, size_t count) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < count; ++i) {
    double d = static_cast<double>(got[i]) - ref[i];
    diff += d * d;
    norm += ref[i] * ref[i];
  }
  if (norm == 0) return diff == 0 ? 0.0 : INFINITY;
  return std::sqrt(diff / norm);
}

}  // namespace twell
