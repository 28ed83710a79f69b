// The CUDA inference FFN (include/twell/cuda.h): its ops in the op-test harness (backend "cuda"), and
// tests of what the harness cannot see: a spill that must grow, tiles lost to a too-small spill and
// recomputed by the consumer, the error against float64 compared with the dense bf16 FFN's, and the
// dispatching SparseFfn, and one decode layer run many times in a row. Skipped without a GPU.
//
// The kernels need D to be a multiple of 64 (TMA rows, whole k-tiles); the adapters pad x and the
// weights with zero columns up to the next multiple, which changes no dot product, and drop the
// padded columns of y.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/decode_gemv.h"
#include "cuda/model_kernels.h"
#include "cuda_test_support.h"
#include "op_harness.h"
#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/cuda.h"
#include "twell/decode_cuda.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace {

using namespace twell;

int32_t padded_model(int32_t d_model) { return (d_model + 63) / 64 * 64; }

// `count` values to a new device array (an empty one when count is 0).
template <typename T>
cuda::DeviceArray<T> upload_values(const T* host, size_t count) {
  cuda::DeviceArray<T> device = cuda::make_device_array<T>(count);
  cuda::copy_to_device(device.get(), host, count * sizeof(T));
  return device;
}

// [rows, d] -> [rows, d_padded] with zero columns on the right.
std::vector<float> pad_columns(const float* values, int64_t rows, int32_t d, int32_t d_padded) {
  std::vector<float> padded(static_cast<size_t>(rows) * d_padded, 0.f);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&padded[r * d_padded], values + r * d, sizeof(float) * d);
  return padded;
}

FfnWeights pad_weights(const FfnWeights& w) {
  const int32_t d_padded = padded_model(w.d_model);
  FfnWeights padded;
  padded.d_model = d_padded;
  padded.d_hidden = w.d_hidden;
  padded.gated = w.gated;
  if (w.gated) padded.gate = pad_columns(w.gate.data(), w.d_hidden, w.d_model, d_padded);
  padded.up = pad_columns(w.up.data(), w.d_hidden, w.d_model, d_padded);
  padded.down = pad_columns(w.down.data(), w.d_hidden, w.d_model, d_padded);
  return padded;
}

// x uploaded as bf16 with D padded to a multiple of 64.  -> [M, D_padded]
cuda::DeviceArray<bf16> upload_x(const float* x, int64_t rows, int32_t d_model) {
  const int32_t d_padded = padded_model(d_model);
  const std::vector<float> padded = pad_columns(x, rows, d_model, d_padded);
  return cuda::upload_bf16(padded.data(), padded.size());
}

// y [M, D_padded] on the device -> y [M, D] on the host.
void download_y(const bf16* y_device, int64_t rows, int32_t d_model, float* y) {
  const int32_t d_padded = padded_model(d_model);
  const std::vector<float> padded = cuda::download_bf16(y_device, static_cast<size_t>(rows) * d_padded);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * d_model, &padded[r * d_padded], sizeof(float) * d_model);
}

cuda::DeviceArray<bf16> poisoned_y(int64_t rows, int32_t d_model) {
  const size_t count = static_cast<size_t>(rows) * padded_model(d_model);
  cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(count);
  EXPECT_EQ(cudaMemset(y.get(), 0xff, count * sizeof(bf16)), cudaSuccess);  // bf16 NaN everywhere
  return y;
}

std::string cuda_skip_reason() { return cuda::available() ? "" : "no CUDA device is available"; }

// cuda::DenseFfn on the padded shapes.
void dense_ffn_padded(const float* x, int64_t rows, const FfnWeights& weights, float* y, cuda::DenseFfnOptions options) {
  const cuda::DeviceFfnWeights device_weights = cuda::upload_weights(pad_weights(weights));
  const cuda::DeviceArray<bf16> device_x = upload_x(x, rows, weights.d_model);
  const cuda::DeviceArray<bf16> device_y = poisoned_y(rows, weights.d_model);
  cuda::DenseFfn dense(options);
  dense.run(device_x.get(), rows, device_weights, device_y.get());
  download_y(device_y.get(), rows, weights.d_model, y);
}

// cuda::DenseFfn with the relu gate applied in the up GEMM's epilogue (gated_up_gemm.cu) at every M,
// not only from kFusedGateMinRows rows as SparseFfn runs it; H not a multiple of 8 falls back.
const bool registered_fused_gate = test::register_backend({
    .name = "cuda_fused_gate",
    .skip_reason = cuda_skip_reason,
    .precision = {.hidden_bf16 = true, .output_bf16 = true},
    .ffn_dense =
        [](const float* x, int64_t rows, const FfnWeights& weights, float* y) {
          dense_ffn_padded(x, rows, weights, y, {.fuse_gate_from_rows = 1});
        },
});

// cuda::DenseFfn with gate and up in one batched cuBLASLt launch, never fused (as SparseFfn runs it
// below kFusedGateMinRows rows).
const bool registered_batched_gate_up = test::register_backend({
    .name = "cuda_batched_gate_up",
    .skip_reason = cuda_skip_reason,
    .precision = {.hidden_bf16 = true, .output_bf16 = true},
    .ffn_dense =
        [](const float* x, int64_t rows, const FfnWeights& weights, float* y) {
          dense_ffn_padded(x, rows, weights, y, {.batch_gate_and_up = true});
        },
});

const bool registered = test::register_backend({
    .name = "cuda",
    .skip_reason = cuda_skip_reason,
    // The dense path rounds g, u and h to bf16; the TwELL path keeps h in fp32. y is bf16 in both.
    .precision = {.hidden_bf16 = true, .output_bf16 = true},
    .gate_to_twell =
        [](const float* x, int64_t rows, const FfnWeights& weights, int32_t tile, int32_t compression,
           TwellMatrix& out) {
          const cuda::DeviceFfnWeights device_weights = cuda::upload_weights(pad_weights(weights));
          const cuda::DeviceArray<bf16> device_x = upload_x(x, rows, weights.d_model);
          cuda::DeviceTwell packed;
          cuda::gate_to_twell_complete(device_x.get(), rows, device_weights, tile, compression, packed);
          out = cuda::download(packed);
        },
    .ffn_from_twell =
        [](const float* x, const TwellMatrix& gate, const FfnWeights& weights, float* y) {
          const cuda::DeviceFfnWeights device_weights = cuda::upload_weights(pad_weights(weights));
          const int64_t rows = gate.shape.rows;
          const cuda::DeviceArray<bf16> device_x = upload_x(x, rows, weights.d_model);
          cuda::DeviceTwell packed;
          cuda::upload(gate, packed);
          const cuda::DeviceArray<bf16> device_y = poisoned_y(rows, weights.d_model);
          cuda::ffn_from_twell(device_x.get(), packed, device_weights, device_y.get());
          download_y(device_y.get(), rows, weights.d_model, y);
        },
    .ffn_dense =
        [](const float* x, int64_t rows, const FfnWeights& weights, float* y) {
          dense_ffn_padded(x, rows, weights, y, {});
        },
    // Not padded like the ops above: zero columns would change the sign-bit predictions.
    .decode_ffn =
        [](const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
           const PredictorConfig& predictor, float* y, const DecodeOptions& options) {
          const size_t count = static_cast<size_t>(rows) * weights.d_model;
          const cuda::DeviceFfnWeights device_weights = test::upload_weights_any_width(weights);
          cuda::DecodeLayer layer(device_weights, signs);
          const cuda::DeviceArray<bf16> device_x = cuda::upload_bf16(x, count);
          const cuda::DeviceArray<float> device_y = cuda::make_device_array<float>(count);
          cuda::copy_to_device(device_y.get(), y, count * sizeof(float));  // y arrives poisoned
          layer.run(device_x.get(), rows, predictor, device_y.get(), nullptr, options);
          cuda::copy_to_host(y, device_y.get(), count * sizeof(float));
          return layer.stats(nullptr);
        },
    .decode_projection =
        [](const test::DecodeProjectionCall& c) {
          const size_t x_count = static_cast<size_t>(c.rows) * c.k, y_count = static_cast<size_t>(c.rows) * c.n;
          const cuda::DeviceArray<bf16> w = cuda::upload_bf16(c.w, static_cast<size_t>(c.n) * c.k);
          const cuda::DeviceArray<bf16> x = cuda::upload_bf16(c.x, x_count);
          const cuda::DeviceArray<float> hidden = upload_values(c.x, x_count);  // normalized by the kernel
          const cuda::DeviceArray<float> input_norm = upload_values(c.input_norm, c.input_norm ? c.k : 0);
          const cuda::DeviceArray<float> output_norm = upload_values(c.output_norm, c.output_norm ? c.n : 0);
          const cuda::DeviceArray<float> y = upload_values(c.y, y_count);
          const std::vector<float> poison(y_count, std::numeric_limits<float>::quiet_NaN());
          const cuda::DeviceArray<bf16> normed = cuda::upload_bf16(poison.data(), y_count);
          const unsigned int zero = 0;
          const cuda::DeviceArray<unsigned int> arrivals = upload_values(&zero, 1);
          const cuda::GemvInput input = c.input_norm ? cuda::GemvInput::rms_norm(hidden.get(), input_norm.get(), c.eps)
                                                     : cuda::GemvInput::rows(x.get());
          cuda::GemvRmsNormTail tail;
          if (c.output_norm) tail = {output_norm.get(), c.eps, normed.get(), arrivals.get()};
          cuda::decode_gemv(static_cast<int32_t>(c.rows), c.n, c.k, input, w.get(), y.get(), cuda::GemvOutput::f32_add,
                            nullptr, tail);
          cuda::copy_to_host(c.y, y.get(), y_count * sizeof(float));
          if (c.output_norm) {
            const std::vector<float> got = cuda::download_bf16(normed.get(), y_count);
            std::copy(got.begin(), got.end(), c.normed);
          }
        },
    .decode_attention =
        [](const float* qkv, const float* bias, const float* keys, const float* values,
           const ref::CachedAttentionShape& s, float rope_theta, float* out) {
          namespace mk = cuda::model_kernels;
          const mk::AttentionShape shape{s.batch, 1, s.n_heads, s.n_kv_heads, s.head_dim, s.stride};
          const int64_t width = int64_t{s.n_heads + 2 * s.n_kv_heads} * s.head_dim;
          const size_t cache = static_cast<size_t>(s.batch) * s.n_kv_heads * s.stride * s.head_dim;
          const size_t out_count = static_cast<size_t>(s.batch) * s.n_heads * s.head_dim;
          const cuda::DeviceArray<bf16> qkv_device = cuda::upload_bf16(qkv, static_cast<size_t>(s.batch * width));
          const cuda::DeviceArray<float> bias_device = upload_values(bias, bias ? width : 0);
          const cuda::DeviceArray<bf16> keys_device = cuda::upload_bf16(keys, cache);
          const cuda::DeviceArray<bf16> values_device = cuda::upload_bf16(values, cache);
          const cuda::DeviceArray<int32_t> length = upload_values(&s.start, 1);
          const size_t workspace_bytes = mk::decode_attention_workspace_bytes(shape);
          const std::vector<std::byte> zeros(workspace_bytes);  // the workspace starts zeroed
          const cuda::DeviceArray<std::byte> workspace = upload_values(zeros.data(), workspace_bytes);
          const std::vector<float> poison(out_count, std::numeric_limits<float>::quiet_NaN());
          const cuda::DeviceArray<bf16> out_device = cuda::upload_bf16(poison.data(), out_count);
          mk::decode_attention_rope(qkv_device.get(), bias ? bias_device.get() : nullptr, shape, length.get(),
                                    rope_theta, keys_device.get(), values_device.get(),
                                    1.0f / std::sqrt(static_cast<float>(s.head_dim)), out_device.get(),
                                    workspace.get(), workspace_bytes, nullptr);
          const std::vector<float> got = cuda::download_bf16(out_device.get(), out_count);
          std::copy(got.begin(), got.end(), out);
        },
    .residual_norm =
        [](const test::ResidualNormCall& c) {
          const size_t count = static_cast<size_t>(c.rows) * c.d;
          const cuda::DeviceArray<float> hidden = upload_values(c.hidden, count);
          const cuda::DeviceArray<bf16> y = cuda::upload_bf16(c.y, count);
          const cuda::DeviceArray<float> weight = upload_values(c.weight, static_cast<size_t>(c.d));
          const cuda::DeviceArray<bf16> normed = cuda::upload_bf16(c.normed, count);  // poisoned
          cuda::model_kernels::add_rms_norm(hidden.get(), y.get(), c.rows, c.d, weight.get(), c.eps, normed.get(),
                                            nullptr);
          cuda::copy_to_host(c.hidden, hidden.get(), count * sizeof(float));
          const std::vector<float> got = cuda::download_bf16(normed.get(), count);
          std::copy(got.begin(), got.end(), c.normed);
        },
    .decode_d_multiple = 8,  // 16-byte weight rows
    .decode_all_gates = kCudaAllGates,
});

// ---- Tests beyond the harness ----

class CudaFfn : public test::CudaTest<> {};

using test::error_of;

// The packing of a dense matrix of the gate, for comparing packings that may order spill rows differently.
std::vector<bf16> unpacked(const TwellMatrix& packed) {
  validate(packed);
  return dense_from_twell(packed);
}

// Unpacked elements of two packings of one gate that differ by more than the bf16 of an fp32 sum may
// differ from the bf16 of the float64 sum: one rounding step near a tie.
int64_t values_off(const TwellMatrix& got, const TwellMatrix& want) {
  const std::vector<bf16> got_dense = unpacked(got), want_dense = unpacked(want);
  int64_t differing = 0;
  for (size_t i = 0; i < got_dense.size(); ++i) {
    const float a = to_float(got_dense[i]), b = to_float(want_dense[i]);
    if (std::fabs(a - b) > 1e-2f * std::fabs(b) + 1e-6f) ++differing;
  }
  return differing;
}

TEST_F(CudaFfn, SpillGrowsUntilThePackingIsCompleteAndMatchesTheReference) {
  // Density 1: every tile overflows every compression, far more spill rows than the default M·n_tiles/16.
  for (int32_t tile : {128, 256}) {
    SCOPED_TRACE(testing::Message() << "T=" << tile);
    const WorkloadSpec spec{.rows = 37, .d_model = 128, .d_hidden = 1000, .density = 1.0, .seed = 11};
    const test::WorkloadOnDevice p = test::upload_workload(spec);
    cuda::DeviceTwell packed;
    cuda::gate_to_twell(p.x.get(), spec.rows, p.weights, tile, 8, packed);
    EXPECT_GT(cuda::spill_rows_used(packed), packed.spill_capacity) << "the first packing should overflow";
    cuda::gate_to_twell_complete(p.x.get(), spec.rows, p.weights, tile, 8, packed);
    const TwellMatrix got = cuda::download(packed);
    ASSERT_TRUE(got.complete());
    const TwellMatrix want = ref::gate_to_twell(p.work.x.data(), spec.rows, p.work.weights, tile, 8);
    EXPECT_EQ(values_off(got, want), 0);
  }
}

// The harness's shapes give the gate kernel at most two output tiles per SM; these give it 4 to 9,
// across several raster groups, with few k-tiles each (so a kernel that reuses its operand ring or
// its blocks over tiles wraps them at odd points), on every tile shape, and check the packer's
// non-zero counter (SparseFfn's density estimate) too.
TEST_F(CudaFfn, GateKernelPacksHundredsOfTilesExactly) {
  struct Shape {
    int64_t rows;
    int32_t d_model, d_hidden, tile;
  };
  for (const Shape shape : {Shape{6001, 192, 3000, 128}, Shape{2500, 128, 5632, 128}, Shape{6001, 320, 3000, 256}}) {
    SCOPED_TRACE(testing::Message() << "M=" << shape.rows << " D=" << shape.d_model << " T=" << shape.tile);
    const WorkloadSpec spec{.rows = shape.rows, .d_model = shape.d_model, .d_hidden = shape.d_hidden,
                            .density = 0.05, .seed = 15};
    const Workload work = make_workload(spec);
    const cuda::DeviceFfnWeights weights = cuda::upload_weights(work.weights);
    const cuda::DeviceArray<bf16> x = cuda::upload_bf16(work.x.data(), work.x.size());
    cuda::DeviceTwell packed;
    cuda::gate_to_twell_complete(x.get(), spec.rows, weights, shape.tile, 4, packed);
    const TwellMatrix got = cuda::download(packed);
    ASSERT_TRUE(got.complete());
    const TwellMatrix want = ref::gate_to_twell(work.x.data(), spec.rows, work.weights, shape.tile, 4);
    EXPECT_EQ(values_off(got, want), 0);
    unsigned long long counted = 0;
    cuda::copy_to_host(&counted, packed.nnz_total.get(), sizeof counted);
    int64_t nonzeros = 0;
    for (const bf16 value : unpacked(got)) nonzeros += to_float(value) != 0.f;
    EXPECT_EQ(static_cast<int64_t>(counted), nonzeros);
  }
}

TEST_F(CudaFfn, TilesLostToASmallSpillAreRecomputedByTheConsumer) {
  const WorkloadSpec spec{.rows = 19, .d_model = 256, .d_hidden = 700, .density = 0.6, .seed = 12};
  const test::WorkloadOnDevice p = test::upload_workload(spec);
  cuda::DeviceTwell packed;
  cuda::gate_to_twell(p.x.get(), spec.rows, p.weights, 128, 8, packed);
  ASSERT_GT(cuda::spill_rows_used(packed), packed.spill_capacity) << "this case must lose spill rows";
  const cuda::DeviceArray<bf16> y = poisoned_y(spec.rows, spec.d_model);
  cuda::ffn_from_twell(p.x.get(), packed, p.weights, y.get());
  EXPECT_LT(error_of(p, y), 1e-2);
}

// The sparse FFN's error against float64 stays within 1.1x of the dense bf16 FFN's (cuBLASLt).
TEST_F(CudaFfn, SparseErrorIsWithinTenPercentOfDenseBf16Error) {
  for (bool gated : {true, false})
    for (double density : {0.005, 0.1, 0.5}) {
      SCOPED_TRACE(testing::Message() << "gated=" << gated << " density=" << density);
      const WorkloadSpec spec{.rows = 67, .d_model = 512, .d_hidden = 1500, .density = density, .gated = gated,
                              .seed = 13};
      const test::WorkloadOnDevice p = test::upload_workload(spec);
      const cuda::DeviceArray<bf16> y_dense = poisoned_y(spec.rows, spec.d_model);
      cuda::DenseFfn dense;
      dense.run(p.x.get(), spec.rows, p.weights, y_dense.get());
      const cuda::DeviceArray<bf16> y_sparse = poisoned_y(spec.rows, spec.d_model);
      cuda::DeviceTwell packed;
      cuda::gate_to_twell(p.x.get(), spec.rows, p.weights, 128, 4, packed);
      cuda::ffn_from_twell(p.x.get(), packed, p.weights, y_sparse.get());
      const double dense_error = error_of(p, y_dense), sparse_error = error_of(p, y_sparse);
      EXPECT_LT(dense_error, 2e-2);
      EXPECT_LE(sparse_error, 1.1 * dense_error + 1e-6) << "dense error " << dense_error;
    }
}

TEST_F(CudaFfn, DispatchingFfnIsRightOnEveryPath) {
  const WorkloadSpec spec{.rows = 45, .d_model = 256, .d_hidden = 1000, .density = 0.05, .seed = 14};
  const test::WorkloadOnDevice p = test::upload_workload(spec);
  cuda::SparseFfn ffn;
  bool saw_dense = false, saw_twell = false;
  for (int call = 0; call < 5; ++call) {
    const cuda::DeviceArray<bf16> y = poisoned_y(spec.rows, spec.d_model);
    ffn.run(p.x.get(), spec.rows, p.weights, y.get());
    (ffn.last_call_was_dense() ? saw_dense : saw_twell) = true;
    EXPECT_LT(error_of(p, y), 1e-2) << "call " << call;
  }
  EXPECT_TRUE(saw_dense && saw_twell) << "the first calls of a bucket time both paths";
}

// One layer run many times, M, the predictor and the gate selection changing from call to call (so
// the fused, the given-gates and the streamed-gates kernels take turns on the layer's call
// numbering), into fresh NaN-poisoned outputs, every neuron predicted: each call's y is that call's
// exact FFN (a kernel zeroes y itself, once per call, before any block adds to it).
TEST_F(CudaFfn, DecodeLayerCallsInARowEachMatchTheReference) {
  const WorkloadSpec spec{.rows = kDecodeMaxRows, .d_model = 264, .d_hidden = 700, .density = 0.05, .seed = 21};
  const Workload work = make_workload(spec);
  const SignBits signs = pack_sign_bits(work.weights.relu_projection().data(), spec.d_hidden, spec.d_model, {0, 9});
  const cuda::DeviceFfnWeights device_weights = test::upload_weights_any_width(work.weights);
  const cuda::DecodeLayer layer(device_weights, signs);
  int call = 0;
  for (int64_t rows : {1, 16, 3, 9, 1, 16})
    for (PredictorKind kind : {PredictorKind::sign_rule, PredictorKind::one_bit_gate,
                               PredictorKind::normalized_one_bit_gate, PredictorKind::two_bit_gate}) {
      const GateSelection gates = call % 3 != 2 ? GateSelection::all_neurons : GateSelection::predicted;
      const AllGatesKernel kernel = call % 3 == 0 ? AllGatesKernel::product : AllGatesKernel::streamed;
      const char* path = gates == GateSelection::predicted       ? ""
                         : kernel == AllGatesKernel::product ? ", every gate"
                                                             : ", every gate streamed";
      SCOPED_TRACE(testing::Message() << "call " << call << ", M = " << rows << ", " << to_string(kind) << path);
      const float* x = work.x.data() + (call++ % (kDecodeMaxRows + 1 - rows)) * spec.d_model;
      const size_t count = static_cast<size_t>(rows) * spec.d_model;
      const std::vector<double> expected = ref::ffn_dense(x, rows, work.weights);
      const cuda::DeviceArray<bf16> device_x = cuda::upload_bf16(x, count);
      std::vector<float> y;
      test::poison(y, count);
      const cuda::DeviceArray<float> device_y = cuda::make_device_array<float>(count);
      cuda::copy_to_device(device_y.get(), y.data(), count * sizeof(float));
      layer.run(device_x.get(), rows, PredictorConfig{kind, 1e30, 1e30}, device_y.get(), nullptr,
                {.gates = gates, .all_gates_kernel = kernel});
      cuda::copy_to_host(y.data(), device_y.get(), count * sizeof(float));
      EXPECT_TRUE(test::near_relative_l2("y", y.data(), expected.data(), count, 2e-5));
    }
}

TEST_F(CudaFfn, RejectsBadArguments) {
  FfnWeights odd;
  odd.d_model = 100;
  odd.d_hidden = 4;
  odd.gated = false;
  odd.up.assign(400, 0.5f);
  odd.down.assign(400, 0.5f);
  EXPECT_THROW(cuda::upload_weights(odd), Error);
  const WorkloadSpec spec{.rows = 2, .d_model = 64, .d_hidden = 130, .density = 0.1, .seed = 15};
  const test::WorkloadOnDevice p = test::upload_workload(spec);
  cuda::DeviceTwell packed;
  EXPECT_THROW(cuda::gate_to_twell(p.x.get(), spec.rows, p.weights, 64, 4, packed), Error);
  EXPECT_THROW(cuda::gate_to_twell(p.x.get(), spec.rows, p.weights, 128, 3, packed), Error);
}

}  // namespace
