// Kernel lab for the relu-gated up GEMM (src/cuda/gated_up_gemm.cu) in its two forms:
//   given: h [M, H] = relu(g) ⊙ (x [M, D] · Wu [H, D]^T), g read by the epilogue;
//   pairs: h = relu(x·Wg^T) ⊙ (x·Wu^T) from one GEMM over the gate and up rows interleaved by 8.
// Each checked against float64, then timed against what it replaces in the same run: the first
// against cuBLASLt's up GEMM (bf16 out) followed by the elementwise pass activate_multiply, the pair
// form against cuBLASLt's relu gate GEMM followed by the first form (DenseFfn's fused path).
//
//   lab_gated_up_gemm check [quick]              shapes below vs float64, exit 1 on failure (quick:
//                                                 the ones small enough for compute-sanitizer)
//   lab_gated_up_gemm bench M,.. D H [reps] [json]  the table below (+ BenchRecord JSON)
//
// Napkin math (D=2048, H=5632, M=16384): 2·M·D·H = 378 GFLOP, ~0.48 ms at cuBLASLt's ~790 TFLOP/s on
// the H200; the unfused pass after it reads g and u and writes h, 3 · 185 MB ≈ 0.12 ms at HBM speed.
// The fused kernel reads g in its epilogue (185 MB) and writes h once: at best ~0.1 ms saved. The
// pair form also drops the gate GEMM's g store (185 MB) and runs both products as one GEMM of 2H
// columns, ~0.96 ms at the same rate.
//
// Timing: CUDA events around each call, 5 warm-up rounds, median of `reps` rounds, the
// implementations interleaved call by call with the L2 emptied before each, inputs rotated over 3
// sets of x and g. `ratio_to_baseline` in the JSON: against the unfused form, or for the two-product
// rows against the gate GEMM + first form.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/gated_up_gemm.h"
#include "cuda/gemm.h"
#include "lab_common.h"
#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/cuda.h"
#include "twell/error.h"
#include "twell/workload.h"

using namespace twell;

namespace {

// Rows of M the float64 reference checks (its loops are slow on a CPU): all of a small M, else
// this many spread over M, the last row among them.
constexpr int64_t kReferenceRows = 24;

std::vector<int64_t> reference_rows(int64_t rows) {
  std::vector<int64_t> picked;
  const int64_t count = std::min(rows, kReferenceRows);
  for (int64_t i = 0; i < count; ++i) picked.push_back(i * (rows - 1) / std::max<int64_t>(count - 1, 1));
  return picked;
}

// Values exactly as the device sees them (rounded to bf16 on the host). g is centred on 0 so that about
// half of it is cut by relu: given directly to the first form, computed from x and Wg by the pair form.
struct Operands {
  std::vector<float> x, w_gate, w_up, gate;  // [M, D], [H, D], [H, D], [M, H]
};

Operands make_operands(int64_t rows, int32_t d, int32_t h, uint64_t seed) {
  const auto rounded = [](std::vector<float> values) {
    for (float& v : values) v = to_float(to_bf16(v));
    return values;
  };
  const double weight_scale = 1.0 / std::sqrt(static_cast<double>(d));
  return {rounded(make_normal(static_cast<size_t>(rows) * d, 1.0, seed)),
          rounded(make_normal(static_cast<size_t>(h) * d, weight_scale, seed + 3)),
          rounded(make_normal(static_cast<size_t>(h) * d, weight_scale, seed + 1)),
          rounded(make_normal(static_cast<size_t>(rows) * h, 1.0, seed + 2))};
}

struct Shape {
  int64_t rows;
  int32_t d, h;
};

double dot(const float* a, const float* b, int32_t count) {
  double sum = 0;
  for (int32_t k = 0; k < count; ++k) sum += static_cast<double>(a[k]) * b[k];
  return sum;
}

// Checks h against float64 on reference_rows: where relu cuts the gate (by more than the fp32 sums
// can move it, for the pair form) h must be exactly zero; elsewhere each value within bf16 rounding.
// gate_of(r, j) is the float64 gate the device form should see.
template <class GateOf>
bool compare(const char* form, const Shape& s, const Operands& in, const std::vector<bf16>& got, GateOf gate_of,
             double cut_margin) {
  int64_t unwritten = 0;
  for (const bf16 value : got) unwritten += std::isnan(to_float(value));
  double diff = 0, norm = 0, largest = 0;
  int64_t off = 0, not_zero = 0;
  std::vector<double> gate(static_cast<size_t>(s.h)), want(static_cast<size_t>(s.h));
  for (const int64_t r : reference_rows(s.rows)) {
    for (int32_t j = 0; j < s.h; ++j) {
      gate[j] = gate_of(r, j);
      want[j] = std::max(0.0, gate[j]) * dot(&in.x[r * s.d], &in.w_up[static_cast<size_t>(j) * s.d], s.d);
      largest = std::max(largest, std::fabs(want[j]));
    }
    for (int32_t j = 0; j < s.h; ++j) {
      const double value = to_float(got[r * s.h + j]);
      if (gate[j] <= -cut_margin) {
        not_zero += value != 0.0;  // relu cut: exactly zero
        continue;
      }
      diff += (value - want[j]) * (value - want[j]);
      norm += want[j] * want[j];
      off += std::fabs(value - want[j]) > 8e-3 * std::fabs(want[j]) + 1e-4 * largest;  // bf16 rounding of h
    }
  }
  const double relative = norm > 0 ? std::sqrt(diff / norm) : 0.0;  // 0: relu cut every checked value
  const bool ok = unwritten == 0 && off == 0 && not_zero == 0 && relative < 1e-2;
  std::printf("check %-5s M=%lld D=%d H=%d: unwritten %lld, values off %lld, cut but not zero %lld, relative L2 %.2e  %s\n",
              form, static_cast<long long>(s.rows), s.d, s.h, static_cast<long long>(unwritten),
              static_cast<long long>(off), static_cast<long long>(not_zero), relative, ok ? "ok" : "FAILED");
  return ok;
}

// One row, partial last tiles in M (128) and H (256 columns: 128 neurons of the pair form), D not a
// multiple of the 64-wide K tile, the standard H at an odd M, many K tiles.
bool check(bool quick) {
  const Shape shapes[] = {{1, 64, 8},       {17, 512, 1000},    {300, 256, 4104}, {129, 200, 264},
                          {3, 4096, 1000},  {129, 2048, 5632},  {4173, 2048, 5632}};
  bool ok = true;
  for (const Shape& s : shapes) {
    if (quick && s.rows * s.h > 300 * 4104) continue;
    TWELL_REQUIRE(cuda::relu_gated_up_supported(s.h, s.d) && cuda::relu_gate_up_pairs_supported(s.h, s.d),
                  "lab shape H = {}, D = {} not supported", s.h, s.d);
    const Operands in = make_operands(s.rows, s.d, s.h, 17 + static_cast<uint64_t>(s.rows));
    const cuda::DeviceArray<bf16> x = cuda::upload_bf16(in.x.data(), in.x.size());
    const cuda::DeviceArray<bf16> w_gate = cuda::upload_bf16(in.w_gate.data(), in.w_gate.size());
    const cuda::DeviceArray<bf16> w_up = cuda::upload_bf16(in.w_up.data(), in.w_up.size());
    const cuda::DeviceArray<bf16> g = cuda::upload_bf16(in.gate.data(), in.gate.size());
    const cuda::DeviceArray<bf16> pairs = cuda::make_device_array<bf16>(2 * in.w_up.size());
    cuda::interleave_gate_up(w_gate.get(), w_up.get(), s.h, s.d, pairs.get(), nullptr);
    const size_t count = static_cast<size_t>(s.rows) * s.h;
    const cuda::DeviceArray<bf16> h = cuda::make_device_array<bf16>(count);
    const auto run = [&](auto&& call) {
      TWELL_CUDA_CHECK(cudaMemset(h.get(), 0xFF, count * sizeof(bf16)));  // NaN in every element
      call();
      TWELL_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<bf16> got(count);
      cuda::copy_to_host(got.data(), h.get(), count * sizeof(bf16));
      return got;
    };
    const std::vector<bf16> given = run([&] {
      cuda::relu_gated_up_gemm(x.get(), s.rows, w_up.get(), s.h, s.d, g.get(), h.get(), nullptr);
    });
    ok = compare("given", s, in, given, [&](int64_t r, int32_t j) { return double{in.gate[r * s.h + j]}; }, 0.0) && ok;
    const std::vector<bf16> paired = run([&] {
      cuda::relu_gate_up_pairs_gemm(x.get(), s.rows, pairs.get(), s.h, s.d, h.get(), nullptr);
    });
    // The gate is a sum of D products of size ~1/sqrt(D) in fp32: its sign is certain beyond 1e-4.
    ok = compare("pairs", s, in, paired,
                 [&](int64_t r, int32_t j) { return dot(&in.x[r * s.d], &in.w_gate[static_cast<size_t>(j) * s.d], s.d); },
                 1e-4) && ok;
  }
  return ok;
}

void bench(const std::vector<int64_t>& row_counts, int32_t d, int32_t h, int reps, const std::string& json_path) {
  TWELL_REQUIRE(cuda::relu_gated_up_supported(h, d) && cuda::relu_gate_up_pairs_supported(h, d),
                "H = {} and D = {} must be multiples of 8", h, d);
  std::vector<BenchRecord> records;
  std::printf("%s, D=%d H=%d, median of %d calls (p10-p90), %d rotated inputs; up+pass and up alone: cuBLASLt\n",
              cuda::device_name(), d, h, reps, lab::kInputSets);
  std::printf("%6s | %9s %17s | %9s %17s | %9s %17s | %9s %17s %8s | %9s %17s\n", "M", "fused ms", "p10-p90",
              "up+pass", "p10-p90", "up alone", "p10-p90", "pairs ms", "p10-p90", "TFLOP/s", "gate+fused", "p10-p90");
  cuda::RowMajorGemm cublas;
  const Operands weights_only = make_operands(1, d, h, 3);
  const cuda::DeviceArray<bf16> w_gate = cuda::upload_bf16(weights_only.w_gate.data(), weights_only.w_gate.size());
  const cuda::DeviceArray<bf16> w = cuda::upload_bf16(weights_only.w_up.data(), weights_only.w_up.size());
  const cuda::DeviceArray<bf16> pairs = cuda::make_device_array<bf16>(2 * weights_only.w_up.size());
  cuda::interleave_gate_up(w_gate.get(), w.get(), h, d, pairs.get(), nullptr);
  for (const int64_t rows : row_counts) {
    std::vector<cuda::DeviceArray<bf16>> x, g;
    for (int i = 0; i < lab::kInputSets; ++i) {
      const Operands in = make_operands(rows, d, h, 100 + 7 * static_cast<uint64_t>(i));
      x.push_back(cuda::upload_bf16(in.x.data(), in.x.size()));
      g.push_back(cuda::upload_bf16(in.gate.data(), in.gate.size()));
    }
    const int64_t count = rows * h;
    const cuda::DeviceArray<bf16> out = cuda::make_device_array<bf16>(static_cast<size_t>(count));
    const cuda::DeviceArray<bf16> gate_out = cuda::make_device_array<bf16>(static_cast<size_t>(count));
    const auto up_gemm = [&](int i) {
      cublas.run(rows, h, d, {x[i].get(), d, false}, {w.get(), d, true}, out.get(), h, cuda::GemmOutput::bf16, 0.0f,
                 nullptr);
    };
    const std::vector<TimingStats> t = lab::time_interleaved(
        reps, lab::kInputSets,
        {[&](int i) { cuda::relu_gated_up_gemm(x[i].get(), rows, w.get(), h, d, g[i].get(), out.get(), nullptr); },
         [&](int i) {
           up_gemm(i);
           cuda::activate_multiply(g[i].get(), out.get(), count, {}, nullptr);
         },
         up_gemm,
         [&](int i) { cuda::relu_gate_up_pairs_gemm(x[i].get(), rows, pairs.get(), h, d, out.get(), nullptr); },
         [&](int i) {  // DenseFfn's fused form whole: cuBLASLt's relu gate GEMM, then the gated up GEMM
           cublas.run(rows, h, d, {x[i].get(), d, false}, {w_gate.get(), d, true}, gate_out.get(), h,
                      cuda::GemmOutput::bf16, 0.0f, nullptr, cuda::GemmEpilogue::relu);
           cuda::relu_gated_up_gemm(x[i].get(), rows, w.get(), h, d, gate_out.get(), out.get(), nullptr);
         }});
    const TimingStats &fused = t[0], &unfused = t[1], &up_alone = t[2], &paired = t[3], &gate_fused = t[4];
    const double flops = 2.0 * rows * static_cast<double>(d) * h;
    const auto tflops = [&](const TimingStats& s, double products) {
      return products * flops / (s.median_ms * 1e-3) * 1e-12;
    };
    std::printf("%6lld | %9.4f %8.4f-%8.4f | %9.4f %8.4f-%8.4f | %9.4f %8.4f-%8.4f | %9.4f %8.4f-%8.4f %8.1f | %9.4f "
                "%8.4f-%8.4f\n",
                static_cast<long long>(rows), fused.median_ms, fused.p10_ms, fused.p90_ms, unfused.median_ms,
                unfused.p10_ms, unfused.p90_ms, up_alone.median_ms, up_alone.p10_ms, up_alone.p90_ms, paired.median_ms,
                paired.p10_ms, paired.p90_ms, tflops(paired, 2), gate_fused.median_ms, gate_fused.p10_ms,
                gate_fused.p90_ms);
    std::fflush(stdout);
    const auto record_of = [&](const std::string& impl, const TimingStats& s, double products, const TimingStats& base) {
      BenchRecord r = lab::cuda_record("gated_up", impl, rows, d, h, 0.5, s);
      r.extra = {{"tflop_per_s", tflops(s, products)},
                 {"ratio_to_baseline", s.median_ms / base.median_ms},
                 {"input_sets", lab::kInputSets}};
      return r;
    };
    records.push_back(record_of("cublaslt_up_then_activate_multiply", unfused, 1, unfused));
    records.push_back(record_of("cublaslt_up_alone", up_alone, 1, unfused));
    records.push_back(record_of("relu_gated_up_gemm", fused, 1, unfused));
    records.push_back(record_of("cublaslt_gate_then_relu_gated_up_gemm", gate_fused, 2, gate_fused));
    records.push_back(record_of("relu_gate_up_pairs_gemm", paired, 2, gate_fused));
  }
  if (!json_path.empty()) write_bench_json(json_path, records);
}

}  // namespace

int main(int argc, char** argv) {
  return lab::run_main("lab_gated_up_gemm", [&] {
    const std::string mode = argc > 1 ? argv[1] : "check";
    if (mode == "check") return check(argc > 2 && std::string(argv[2]) == "quick") ? 0 : 1;
    if (mode == "bench" && argc >= 5) {
      bench(lab::parse_list_int(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), argc > 5 ? std::atoi(argv[5]) : 50,
            argc > 6 ? argv[6] : "");
      return 0;
    }
    std::fprintf(stderr, "usage: %s check [quick] | bench M,.. D H [reps] [json]\n", argv[0]);
    return 2;
  });
}
