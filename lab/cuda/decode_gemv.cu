// Kernel lab for the decode step's GEMV (src/cuda/decode_gemv.cu): checked against float64 on each
// shape, then timed against cuBLASLt (the same product through cuda::RowMajorGemm) in the same run.
//
//   lab_decode_gemv [M reps]     default: 1 50
//
// Shapes: the 2B model's projections (D = 2048, H = 5632, 32 heads of 64): QKV [6144, 2048], O
// [2048, 2048], the FFN gate [5632, 2048] and the LM head [49152, 2048]. Napkin math: W is N·K·2
// bytes (25 / 8.4 / 23 / 201 MB), so at the H200's ~4.2 TB/s copy rate 6.0 / 2.0 / 5.5 / 48 us.
//
// Timing: graphs of 20 calls (as a decode step runs them) with as many copies of W, taken in turn, as
// make 20 calls read more than twice the L2, so every call reads its W from DRAM as a layer does;
// median over `reps` replays, us per call.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/decode_gemv.h"
#include "cuda/gemm.h"
#include "lab_common.h"

using namespace twell;

namespace {

constexpr int kGraphCalls = 20;

struct Shape {
  const char* name;
  int32_t n, k;
};

int run(int32_t m, int reps) {
  const Shape shapes[] = {{"qkv", 6144, 2048}, {"o", 2048, 2048}, {"gate", 5632, 2048}, {"lm_head", 49152, 2048}};
  cuda::RowMajorGemm gemm;
  bool ok = true;
  std::printf("%s, M = %d: us per call in a graph of %d, W from DRAM\n", cuda::device_name(), m, kGraphCalls);
  std::printf("%-8s %7s %7s %9s %9s %8s %9s %10s\n", "shape", "N", "K", "gemv us", "cuBLASLt", "speedup", "gemv TB/s",
              "rel err");
  for (const Shape& shape : shapes) {
    const int64_t w_bytes = int64_t{shape.n} * shape.k * 2;
    const int copies = static_cast<int>(
        std::min<int64_t>(kGraphCalls, 2 * int64_t{cuda::device_facts().l2_bytes} / w_bytes + 2));
    std::vector<cuda::DeviceArray<bf16>> w;
    std::vector<float> w_host;
    for (int c = 0; c < copies; ++c) {
      const std::vector<float> values = make_normal(static_cast<size_t>(shape.n) * shape.k, 0.05, 100 + c);
      if (c == 0) w_host = values;
      w.push_back(cuda::upload_bf16(values.data(), values.size()));
    }
    const std::vector<float> x_host = make_normal(static_cast<size_t>(m) * shape.k, 1.0, 7);
    const cuda::DeviceArray<bf16> x = cuda::upload_bf16(x_host.data(), x_host.size());
    cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(static_cast<size_t>(m) * shape.n);

    cuda::decode_gemv(m, shape.n, shape.k, cuda::GemvInput::rows(x.get()), w[0].get(), y.get(),
                      cuda::GemvOutput::bf16, nullptr);
    const std::vector<float> got = cuda::download_bf16(y.get(), static_cast<size_t>(m) * shape.n);
    std::vector<double> expected(got.size());
    for (int32_t row = 0; row < m; ++row)
      for (int32_t n = 0; n < shape.n; ++n) {
        double sum = 0;
        for (int32_t k = 0; k < shape.k; ++k)
          sum += double{round_to_bf16(x_host[row * shape.k + k])} * round_to_bf16(w_host[int64_t{n} * shape.k + k]);
        expected[int64_t{row} * shape.n + n] = sum;
      }
    const double error = relative_l2_error(got.data(), expected.data(), expected.size());
    ok = ok && error < 5e-3;  // bf16 output rounding, ~1e-3

    const double gemv_ms = cuda::time_graph(
        [&](int call, cudaStream_t stream) {
          cuda::decode_gemv(m, shape.n, shape.k, cuda::GemvInput::rows(x.get()), w[call % copies].get(), y.get(),
                            cuda::GemvOutput::bf16, stream);
        },
        kGraphCalls, reps).median_ms;
    const auto cublas = [&](int call, cudaStream_t stream) {
      gemm.run(m, shape.n, shape.k, {x.get(), shape.k, false}, {w[call % copies].get(), shape.k, true}, y.get(),
               shape.n, cuda::GemmOutput::bf16, 0.0f, stream);
    };
    cublas(0, nullptr);  // plans outside the capture
    TWELL_CUDA_CHECK(cudaDeviceSynchronize());
    const double cublas_ms = cuda::time_graph(cublas, kGraphCalls, reps).median_ms;
    std::printf("%-8s %7d %7d %9.2f %9.2f %7.2fx %9.2f %10.2e\n", shape.name, shape.n, shape.k, gemv_ms * 1e3,
                cublas_ms * 1e3, cublas_ms / gemv_ms, w_bytes / (gemv_ms * 1e-3) * 1e-12, error);
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return lab::run_main("lab_decode_gemv", [&] {
    const auto arg = [&](int index, int fallback) { return argc > index ? std::atoi(argv[index]) : fallback; };
    return run(arg(1, 1), arg(2, 50));
  });
}
