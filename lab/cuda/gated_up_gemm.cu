// Kernel lab for the up GEMM with the relu gate in its epilogue (src/cuda/gated_up_gemm.cu):
//   h [M, H] = relu(g) ⊙ (x [M, D] · Wu [H, D]^T)
// checked against float64, then timed against what it replaces in DenseFfn: cuBLASLt's up GEMM
// (bf16 out) followed by the elementwise pass activate_multiply, in the same run.
//
//   lab_gated_up_gemm check [quick]              shapes below vs float64, exit 1 on failure (quick:
//                                                 the ones small enough for compute-sanitizer)
//   lab_gated_up_gemm bench M,.. D H [reps] [json]  the table below (+ BenchRecord JSON)
//
// Napkin math (D=2048, H=5632, M=16384): 2·M·D·H = 378 GFLOP, ~0.48 ms at cuBLASLt's ~790 TFLOP/s on
// the H200; the unfused pass after it reads g and u and writes h, 3 · 185 MB ≈ 0.12 ms at HBM speed.
// The fused kernel reads g in its epilogue (185 MB) and writes h once: at best ~0.1 ms saved.
//
// Timing: CUDA events around each call, 5 warm-up rounds, median of `reps` rounds, the
// implementations interleaved call by call with the L2 emptied before each, inputs rotated over 3
// sets of x and g.
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

// Values exactly as the device sees them (rounded to bf16 on the host), g centred on 0 so that
// about half of it is cut by relu.
struct Operands {
  std::vector<float> x, w_up, gate;  // [M, D], [H, D], [M, H]
};

Operands make_operands(int64_t rows, int32_t d, int32_t h, uint64_t seed) {
  const auto rounded = [](std::vector<float> values) {
    for (float& v : values) v = to_float(to_bf16(v));
    return values;
  };
  return {rounded(make_normal(static_cast<size_t>(rows) * d, 1.0, seed)),
          rounded(make_normal(static_cast<size_t>(h) * d, 1.0 / std::sqrt(static_cast<double>(d)), seed + 1)),
          rounded(make_normal(static_cast<size_t>(rows) * h, 1.0, seed + 2))};
}

struct Shape {
  int64_t rows;
  int32_t d, h;
};

// One row, partial last tiles in M (128) and H (256), D not a multiple of the 64-wide K tile, the
// standard H at an odd M, many K tiles.
bool check(bool quick) {
  const Shape shapes[] = {{1, 64, 8},       {17, 512, 1000},    {300, 256, 4104}, {129, 200, 264},
                          {3, 4096, 1000},  {129, 2048, 5632},  {4173, 2048, 5632}};
  bool ok = true;
  for (const Shape& s : shapes) {
    if (quick && s.rows * s.h > 300 * 4104) continue;
    TWELL_REQUIRE(cuda::relu_gated_up_supported(s.h, s.d), "lab shape H = {}, D = {} not supported", s.h, s.d);
    const Operands in = make_operands(s.rows, s.d, s.h, 17 + static_cast<uint64_t>(s.rows));
    const cuda::DeviceArray<bf16> x = cuda::upload_bf16(in.x.data(), in.x.size());
    const cuda::DeviceArray<bf16> w = cuda::upload_bf16(in.w_up.data(), in.w_up.size());
    const cuda::DeviceArray<bf16> g = cuda::upload_bf16(in.gate.data(), in.gate.size());
    const size_t count = static_cast<size_t>(s.rows) * s.h;
    const cuda::DeviceArray<bf16> h = cuda::make_device_array<bf16>(count);
    TWELL_CUDA_CHECK(cudaMemset(h.get(), 0xFF, count * sizeof(bf16)));  // NaN in every element
    cuda::relu_gated_up_gemm(x.get(), s.rows, w.get(), s.h, s.d, g.get(), h.get(), nullptr);
    TWELL_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<bf16> got(count);
    cuda::copy_to_host(got.data(), h.get(), count * sizeof(bf16));

    int64_t unwritten = 0;
    for (const bf16 value : got) unwritten += std::isnan(to_float(value));
    double diff = 0, norm = 0, largest = 0;
    int64_t off = 0, not_zero = 0;
    std::vector<double> want(static_cast<size_t>(s.h));
    for (const int64_t r : reference_rows(s.rows)) {
      for (int32_t j = 0; j < s.h; ++j) {
        double u = 0;
        for (int32_t k = 0; k < s.d; ++k)
          u += static_cast<double>(in.x[r * s.d + k]) * in.w_up[static_cast<size_t>(j) * s.d + k];
        want[j] = std::max(0.0, static_cast<double>(in.gate[r * s.h + j])) * u;
        largest = std::max(largest, std::fabs(want[j]));
      }
      for (int32_t j = 0; j < s.h; ++j) {
        const double value = to_float(got[r * s.h + j]);
        if (in.gate[r * s.h + j] <= 0.0f) {
          not_zero += value != 0.0;  // relu cut: exactly zero
          continue;
        }
        diff += (value - want[j]) * (value - want[j]);
        norm += want[j] * want[j];
        off += std::fabs(value - want[j]) > 8e-3 * std::fabs(want[j]) + 1e-4 * largest;  // bf16 rounding of h
      }
    }
    const double relative = norm > 0 ? std::sqrt(diff / norm) : 0.0;  // 0: relu cut every checked value
    const bool case_ok = unwritten == 0 && off == 0 && not_zero == 0 && relative < 1e-2;
    std::printf("check M=%lld D=%d H=%d: unwritten %lld, values off %lld, cut but not zero %lld, relative L2 %.2e  %s\n",
                static_cast<long long>(s.rows), s.d, s.h, static_cast<long long>(unwritten),
                static_cast<long long>(off), static_cast<long long>(not_zero), relative, case_ok ? "ok" : "FAILED");
    ok = ok && case_ok;
  }
  return ok;
}

void bench(const std::vector<int64_t>& row_counts, int32_t d, int32_t h, int reps, const std::string& json_path) {
  TWELL_REQUIRE(cuda::relu_gated_up_supported(h, d), "H = {} and D = {} must be multiples of 8", h, d);
  std::vector<BenchRecord> records;
  std::printf("%s, D=%d H=%d, median of %d calls (p10-p90), %d rotated inputs\n", cuda::device_name(), d, h, reps,
              lab::kInputSets);
  std::printf("%6s | %9s %17s %8s | %9s %17s | %9s %17s | %6s\n", "M", "fused ms", "p10-p90", "TFLOP/s",
              "up+pass", "p10-p90", "up alone", "p10-p90", "ratio");
  cuda::RowMajorGemm cublas;
  const Operands weights_only = make_operands(1, d, h, 3);
  const cuda::DeviceArray<bf16> w = cuda::upload_bf16(weights_only.w_up.data(), weights_only.w_up.size());
  for (const int64_t rows : row_counts) {
    std::vector<cuda::DeviceArray<bf16>> x, g;
    for (int i = 0; i < lab::kInputSets; ++i) {
      const Operands in = make_operands(rows, d, h, 100 + 7 * static_cast<uint64_t>(i));
      x.push_back(cuda::upload_bf16(in.x.data(), in.x.size()));
      g.push_back(cuda::upload_bf16(in.gate.data(), in.gate.size()));
    }
    const int64_t count = rows * h;
    const cuda::DeviceArray<bf16> out = cuda::make_device_array<bf16>(static_cast<size_t>(count));
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
         up_gemm});
    const TimingStats &fused = t[0], &unfused = t[1], &up_alone = t[2];
    const double flops = 2.0 * rows * static_cast<double>(d) * h;
    const auto tflops = [&](const TimingStats& s) { return flops / (s.median_ms * 1e-3) * 1e-12; };
    std::printf("%6lld | %9.4f %8.4f-%8.4f %8.1f | %9.4f %8.4f-%8.4f | %9.4f %8.4f-%8.4f | %6.3f\n",
                static_cast<long long>(rows), fused.median_ms, fused.p10_ms, fused.p90_ms, tflops(fused),
                unfused.median_ms, unfused.p10_ms, unfused.p90_ms, up_alone.median_ms, up_alone.p10_ms,
                up_alone.p90_ms, fused.median_ms / unfused.median_ms);
    std::fflush(stdout);
    const auto record_of = [&](const std::string& impl, const TimingStats& s) {
      BenchRecord r = lab::cuda_record("gated_up", impl, rows, d, h, 0.5, s);
      r.extra = {{"tflop_per_s", tflops(s)},
                 {"ratio_to_unfused", s.median_ms / unfused.median_ms},
                 {"input_sets", lab::kInputSets}};
      return r;
    };
    records.push_back(record_of("cublaslt_up_then_activate_multiply", unfused));
    records.push_back(record_of("cublaslt_up_alone", up_alone));
    records.push_back(record_of("relu_gated_up_gemm", fused));
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
