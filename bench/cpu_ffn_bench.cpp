// Google Benchmark timings of the CPU FFN kernels, one at a time, at the standard shapes
// (D = 2048, H = 5632, M in {1, 16, 256}, densities 0.5%, 2%, 10%; TwELL T = 128, C = 4).
// `twell bench ffn` times the complete FFNs and checks them; this splits the sparse FFN into its
// two kernels so each can be tuned. Counters: rows per second and the weight bytes each kernel
// has to stream (bytes_per_second).
#include <benchmark/benchmark.h>

#include <map>
#include <memory>
#include <tuple>

#include "twell/cpu.h"
#include "twell/workload.h"

namespace {

constexpr int32_t kModel = 2048;
constexpr int32_t kHidden = 5632;
constexpr int32_t kTile = 128;
constexpr int32_t kCompression = 4;

// Workloads are expensive to generate (three 46 MB matrices): one per (M, density), kept.
const twell::Workload& workload(int64_t rows, double density) {
  static std::map<std::tuple<int64_t, double>, std::unique_ptr<twell::Workload>> cache;
  auto& slot = cache[{rows, density}];
  if (!slot) {
    twell::WorkloadSpec spec;
    spec.rows = rows;
    spec.d_model = kModel;
    spec.d_hidden = kHidden;
    spec.density = density;
    slot = std::make_unique<twell::Workload>(twell::make_workload(spec));
  }
  return *slot;
}

double density_of(const benchmark::State& state) { return static_cast<double>(state.range(1)) / 1000.0; }

// Every benchmark's last argument is the thread count (0 = all cores).
void use_threads(const benchmark::State& state) { twell::cpu::set_num_threads(static_cast<int>(state.range(2))); }

void GateToTwell(benchmark::State& state) {
  const twell::Workload& work = workload(state.range(0), density_of(state));
  use_threads(state);
  twell::TwellMatrix packed;
  for (auto _ : state) {
    twell::cpu::gate_to_twell(work.x.data(), work.spec.rows, work.weights, kTile, kCompression, packed);
    benchmark::DoNotOptimize(packed.tile_nnz.data());
  }
  state.SetItemsProcessed(state.iterations() * work.spec.rows);
  state.SetBytesProcessed(state.iterations() * int64_t{kHidden} * kModel * 4);  // all of Wg
}

void FfnFromTwell(benchmark::State& state) {
  const twell::Workload& work = workload(state.range(0), density_of(state));
  use_threads(state);
  twell::TwellMatrix packed;
  twell::cpu::gate_to_twell(work.x.data(), work.spec.rows, work.weights, kTile, kCompression, packed);
  std::vector<float> y(work.x.size());  // [M, D]
  for (auto _ : state) {
    twell::cpu::ffn_from_twell(work.x.data(), packed, work.weights, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * work.spec.rows);
}

void FfnDense(benchmark::State& state) {
  const twell::Workload& work = workload(state.range(0), density_of(state));
  use_threads(state);
  twell::cpu::DenseScratch scratch;
  std::vector<float> y(work.x.size());  // [M, D]
  for (auto _ : state) {
    twell::cpu::ffn_dense(work.x.data(), work.spec.rows, work.weights, y.data(), scratch);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * work.spec.rows);
  state.SetBytesProcessed(state.iterations() * 3 * int64_t{kHidden} * kModel * 4);  // Wg, Wu, Wd
}

// Densities in thousandths: 5 = 0.5%. One thread and all cores.
void StandardShapes(benchmark::internal::Benchmark* bench) {
  bench->ArgNames({"M", "density_permille", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
  for (int64_t threads : {1, 0})
    for (int64_t rows : {1, 16, 256})
      for (int64_t permille : {5, 20, 100}) bench->Args({rows, permille, threads});
}

BENCHMARK(GateToTwell)->Apply(StandardShapes);
BENCHMARK(FfnFromTwell)->Apply(StandardShapes);
BENCHMARK(FfnDense)->Apply([](benchmark::internal::Benchmark* bench) {
  bench->ArgNames({"M", "density_permille", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
  for (int64_t threads : {1, 0})
    for (int64_t rows : {1, 16, 256}) bench->Args({rows, 5, threads});  // density does not matter to dense
});

}  // namespace
