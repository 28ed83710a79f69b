// Google Benchmark timings of the CPU causal attention (cpu::causal_attention) at the shapes of the
// model forward: the 2B model's (32 heads, MHA, Dh 64) and a GQA one (14 query heads over 2 kv
// heads, Dh 64, the Qwen2-0.5B layout). Prefill of n tokens into an empty cache, and decode steps
// (n = 1) deep into a filled one. Counter: tokens per second.
#include <benchmark/benchmark.h>

#include <utility>
#include <vector>

#include "twell/cpu.h"
#include "twell/workload.h"

namespace {

constexpr int32_t kHeadDim = 64;

// Arguments: tokens n, positions already cached, query heads, kv heads, threads (0 = all cores).
void CausalAttention(benchmark::State& state) {
  const twell::cpu::AttentionShape shape{static_cast<int32_t>(state.range(0)), static_cast<int32_t>(state.range(2)),
                                         static_cast<int32_t>(state.range(3)), kHeadDim,
                                         static_cast<int32_t>(state.range(1))};
  twell::cpu::set_num_threads(static_cast<int>(state.range(4)));
  const int64_t positions = int64_t{shape.start} + shape.tokens;
  const std::vector<float> q = twell::make_normal(size_t{1} * shape.tokens * shape.n_heads * kHeadDim, 1.2, 1);
  const std::vector<float> keys = twell::make_normal(positions * shape.n_kv_heads * kHeadDim, 1.2, 2);
  const std::vector<float> values = twell::make_normal(positions * shape.n_kv_heads * kHeadDim, 1.2, 3);
  std::vector<float> out(q.size());
  twell::cpu::AttentionScratch scratch;
  for (auto _ : state) {
    twell::cpu::causal_attention(q.data(), keys.data(), values.data(), shape, 0.125f, out.data(), scratch);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * shape.tokens);
}

BENCHMARK(CausalAttention)->Apply([](benchmark::internal::Benchmark* bench) {
  bench->ArgNames({"n", "start", "Hq", "Hkv", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
  for (int64_t threads : {1, 0})
    for (auto [n_heads, n_kv_heads] : {std::pair<int64_t, int64_t>{32, 32}, {14, 2}}) {
      bench->Args({512, 0, n_heads, n_kv_heads, threads});    // prefill
      bench->Args({1, 2047, n_heads, n_kv_heads, threads});   // decode step at position 2047
    }
});

}  // namespace
