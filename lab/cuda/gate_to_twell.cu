// Kernel lab for the gate GEMM with the TwELL packing epilogue (src/cuda/gate_to_twell.cu): the
// library kernel checked against the float64 reference, then timed against cuBLASLt's plain gate
// GEMM (bf16, fp32 accumulation, ReLU epilogue, dense [M, H] bf16 output) in the same run.
//
//   lab_gate_to_twell check [quick]                          packings vs float64, exit 1 on failure
//                                                            (quick: the shapes small enough for
//                                                            compute-sanitizer)
//   lab_gate_to_twell bench M,.. D H density T C [reps] [json]  the table below (+ BenchRecord JSON)
//
// Napkin math (D=2048, H=5632, M=16384): 2·M·D·H = 378 GFLOP, 0.48 ms at the ~790 TFLOP/s cuBLASLt
// reaches on the H200; the bytes (x 64 MiB, W 22 MiB, TwELL out ~100 MiB) are ~0.04 ms of HBM, so
// the gate is bound by the tensor cores at large M. At M = 1 it is W's 23 MB from HBM: ~5 us.
//
// Timing: CUDA events around each call, 5 warm-up calls, median of `reps` calls, inputs rotated over
// 3 sets of x.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/gemm.h"
#include "lab_common.h"
#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/cuda.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

using namespace twell;

namespace {

int64_t count_nonzeros(const TwellMatrix& packed) {
  int64_t count = 0;
  for (const bf16 value : dense_from_twell(packed)) count += to_float(value) != 0.f;
  return count;
}

// Shapes that reach every kernel path: 128- and 256-row tiles (T = 128), T = 256, partial last
// tiles in M and H, one row, every tile spilled, a spill too small at first (the _complete loop),
// and several tiles per persistent block with the ring wrapping at odd points (few k-tiles).
bool check(bool quick) {
  std::vector<lab::GateCase> cases = lab::small_gate_cases();
  cases.insert(cases.end(), {
      {{.rows = 6001, .d_model = 192, .d_hidden = 3000, .density = 0.05, .seed = 6}, 128, 4},
      {{.rows = 6001, .d_model = 320, .d_hidden = 3000, .density = 0.3, .seed = 7}, 256, 4},
      {{.rows = 2500, .d_model = 128, .d_hidden = 5632, .density = 0.02, .seed = 8}, 128, 8},
      {{.rows = 1000, .d_model = 64, .d_hidden = 2000, .density = 1.0, .seed = 9}, 128, 2},
  });
  bool ok = true;
  for (const lab::GateCase& c : cases) {
    if (quick && c.spec.rows * c.spec.d_model > 2500 * 128) continue;
    const Workload work = make_workload(c.spec);
    const cuda::DeviceFfnWeights weights = cuda::upload_weights(work.weights);
    const cuda::DeviceArray<bf16> x = cuda::upload_bf16(work.x.data(), work.x.size());
    cuda::DeviceTwell packed;
    cuda::gate_to_twell_complete(x.get(), c.spec.rows, weights, c.tile, c.compression, packed);
    const TwellMatrix got = cuda::download(packed);
    validate(got);
    const TwellMatrix want = ref::gate_to_twell(work.x.data(), c.spec.rows, work.weights, c.tile, c.compression);
    const int64_t differing = lab::differing_values(got, want);
    unsigned long long counted = 0;
    cuda::copy_to_host(&counted, packed.nnz_total.get(), sizeof counted);
    const int64_t nonzeros = count_nonzeros(got);
    const bool case_ok = differing == 0 && static_cast<int64_t>(counted) == nonzeros;
    std::printf("check M=%lld D=%d H=%d density=%g T=%d C=%d: spill rows %d, values off %lld, non-zeros %lld "
                "(counter %llu)  %s\n",
                static_cast<long long>(c.spec.rows), c.spec.d_model, c.spec.d_hidden, c.spec.density, c.tile,
                c.compression, got.spill_used, static_cast<long long>(differing), static_cast<long long>(nonzeros),
                counted, case_ok ? "ok" : "FAILED");
    ok = ok && case_ok;
  }
  return ok;
}

void bench(const std::vector<int64_t>& row_counts, int32_t d, int32_t h, double density, int32_t tile,
           int32_t compression, int reps, const std::string& json_path) {
  std::vector<BenchRecord> records;
  std::printf("%s, D=%d H=%d density=%g T=%d C=%d, median of %d calls (p10-p90), %d rotated inputs\n", cuda::device_name(), d,
              h, density, tile, compression, reps, lab::kInputSets);
  std::printf("%6s | %9s %17s %8s | %9s %17s %8s | %6s\n", "M", "gate ms", "p10-p90", "TFLOP/s", "cublas ms",
              "p10-p90", "TFLOP/s", "ratio");
  cuda::RowMajorGemm cublas;
  for (const int64_t rows : row_counts) {
    const WorkloadSpec spec{.rows = rows, .d_model = d, .d_hidden = h, .density = density, .seed = 7};
    const Workload work = make_workload(spec);
    const cuda::DeviceFfnWeights weights = cuda::upload_weights(work.weights);
    const std::vector<cuda::DeviceArray<bf16>> x = lab::upload_input_sets(work);
    cuda::DeviceTwell packed;
    cuda::gate_to_twell_complete(x[0].get(), rows, weights, tile, compression, packed);
    const TimingStats gate_t = lab::time_calls(
        reps, lab::kInputSets, [&](int i) { cuda::gate_to_twell(x[i].get(), rows, weights, tile, compression, packed); });
    const int32_t spill_used = cuda::spill_rows_used(packed);

    const cuda::DeviceArray<bf16> dense_gate = cuda::make_device_array<bf16>(static_cast<size_t>(rows) * h);
    const TimingStats cublas_t = lab::time_calls(reps, lab::kInputSets, [&](int i) {
      cublas.run(rows, h, d, {x[i].get(), d, false}, {weights.relu_projection(), d, true}, dense_gate.get(), h,
                 cuda::GemmOutput::bf16, 0.f, nullptr, cuda::GemmEpilogue::relu);
    });

    const double flops = 2.0 * rows * static_cast<double>(d) * h;
    const auto tflops = [&](const TimingStats& t) { return flops / (t.median_ms * 1e-3) * 1e-12; };
    std::printf("%6lld | %9.4f %8.4f-%8.4f %8.1f | %9.4f %8.4f-%8.4f %8.1f | %6.3f%s\n", static_cast<long long>(rows),
                gate_t.median_ms, gate_t.p10_ms, gate_t.p90_ms, tflops(gate_t), cublas_t.median_ms, cublas_t.p10_ms,
                cublas_t.p90_ms, tflops(cublas_t), gate_t.median_ms / cublas_t.median_ms,
                spill_used > packed.spill_capacity ? "  (spill overflowed)" : "");
    std::fflush(stdout);

    auto record_of = [&](const std::string& impl, const TimingStats& t) {
      BenchRecord r = lab::cuda_record("gate", impl, rows, d, h, density, t);
      r.extra = {{"tflop_per_s", tflops(t)},
                 {"ratio_to_cublaslt", t.median_ms / cublas_t.median_ms},
                 {"input_sets", lab::kInputSets},
                 {"tile", tile},
                 {"compression", compression}};
      return r;
    };
    records.push_back(record_of("cublaslt_gate_relu", cublas_t));
    BenchRecord gate_record = record_of("gate_to_twell", gate_t);
    gate_record.extra["spill_rows"] = spill_used;
    records.push_back(std::move(gate_record));
  }
  if (!json_path.empty()) write_bench_json(json_path, records);
}

}  // namespace

int main(int argc, char** argv) {
  return lab::run_main("lab_gate_to_twell", [&] {
    const std::string mode = argc > 1 ? argv[1] : "check";
    if (mode == "check") return check(argc > 2 && std::string(argv[2]) == "quick") ? 0 : 1;
    if (mode == "bench" && argc >= 8) {
      bench(lab::parse_list_int(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), std::atof(argv[5]), std::atoi(argv[6]),
            std::atoi(argv[7]), argc > 8 ? std::atoi(argv[8]) : 50, argc > 9 ? argv[9] : "");
      return 0;
    }
    std::fprintf(stderr, "usage: %s check [quick] | bench M,.. D H density T C [reps] [json]\n", argv[0]);
    return 2;
  });
}
