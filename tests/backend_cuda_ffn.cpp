// The fused CUDA up+down kernel (src/cuda/ffn_from_twell.cu) on what the op harness's shapes do not
// reach: rows with more non-zeros than one pass of its shared list holds, more tiles than one window
// of the block's threads, tiles lost to a too-small spill in the same rows, D at the 8192 limit,
// a skewed (hot-neuron) workload, and bit-identical results across calls; and the dispatch of
// SparseFfn (sparse_ffn.cu) when the workload changes between calls, and its split paths (y added to,
// views of neuron ranges). Skipped without a GPU.
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/ffn_density_book.h"
#include "cuda/timed_choice.h"
#include "cuda_test_support.h"
#include "twell/bench_record.h"
#include "twell/cpu.h"
#include "twell/cuda.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace {

using namespace twell;

class CudaFfnFromTwell : public test::CudaTest<> {};

using test::error_of;

// y of ffn_from_twell, written over bf16 NaN.
std::vector<float> sparse_y(const test::WorkloadOnDevice& d, const cuda::DeviceTwell& packed) {
  const size_t count = d.work.x.size();
  const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(count);
  EXPECT_EQ(cudaMemset(y.get(), 0xff, count * sizeof(bf16)), cudaSuccess);
  cuda::ffn_from_twell(d.x.get(), packed, d.weights, y.get());
  return cuda::download_bf16(y.get(), count);
}

TEST_F(CudaFfnFromTwell, LongRowsManyTileWindowsAndLostTiles) {
  // D = 64: 128 threads per block, so H = 65536 (512 tiles of 128) takes 4 windows; 30% density is
  // ~19700 non-zeros per row, ~39 passes of the list; C = 8 (16 slots) spills most tiles, and the
  // first packing's spill is far too small, so most of them are lost and recomputed.
  for (bool gated : {true, false}) {
    SCOPED_TRACE(testing::Message() << "gated=" << gated);
    const WorkloadSpec spec{.rows = 5, .d_model = 64, .d_hidden = 65536, .density = 0.3, .gated = gated, .seed = 21};
    const test::WorkloadOnDevice d = test::upload_workload(spec);
    cuda::DeviceTwell packed;
    cuda::gate_to_twell(d.x.get(), spec.rows, d.weights, 128, 8, packed);
    ASSERT_GT(cuda::spill_rows_used(packed), packed.spill_capacity) << "this case must lose spill rows";
    const std::vector<float> y_lost = sparse_y(d, packed);
    EXPECT_LT(error_of(d, y_lost), 1e-2);
    cuda::gate_to_twell_complete(d.x.get(), spec.rows, d.weights, 128, 8, packed);
    const std::vector<float> y_complete = sparse_y(d, packed);
    EXPECT_LT(error_of(d, y_complete), 1e-2);
  }
}

TEST_F(CudaFfnFromTwell, WidestModelOneVectorPerThread) {
  const WorkloadSpec spec{.rows = 3, .d_model = 8192, .d_hidden = 300, .density = 0.1, .seed = 22};
  const test::WorkloadOnDevice d = test::upload_workload(spec);
  cuda::DeviceTwell packed;
  cuda::gate_to_twell_complete(d.x.get(), spec.rows, d.weights, 128, 4, packed);
  EXPECT_LT(error_of(d, sparse_y(d, packed)), 1e-2);
}

TEST_F(CudaFfnFromTwell, HotNeuronsWithinDenseErrorAndBitIdenticalAcrossCalls) {
  // 40 neurons active for almost every token, the rest at 2%: the skew of real models.
  const WorkloadSpec spec{.rows = 300, .d_model = 256, .d_hidden = 4097, .density = 0.02, .hot_neurons = 40,
                          .seed = 23};
  const test::WorkloadOnDevice d = test::upload_workload(spec);
  cuda::DeviceTwell packed;
  cuda::gate_to_twell_complete(d.x.get(), spec.rows, d.weights, 256, 8, packed);
  const std::vector<float> first = sparse_y(d, packed), second = sparse_y(d, packed);
  EXPECT_EQ(first, second);
  const size_t count = d.work.x.size();
  const cuda::DeviceArray<bf16> y_dense = cuda::make_device_array<bf16>(count);
  cuda::DenseFfn dense;
  dense.run(d.x.get(), spec.rows, d.weights, y_dense.get());
  const double dense_error = error_of(d, cuda::download_bf16(y_dense.get(), count));
  EXPECT_LT(dense_error, 2e-2);
  EXPECT_LE(error_of(d, first), 1.1 * dense_error + 1e-6) << "dense error " << dense_error;
}

// SparseFfn keys each call by the previous call's density. A TwELL time measured on one density must
// not stand for another: after a change of M and of density, a 50% workload (TwELL many times slower
// than dense) must end on dense.
TEST_F(CudaFfnFromTwell, DispatchEndsOnDenseWhereTwellIsSlowAfterTheWorkloadChanges) {
  cuda::SparseFfn ffn;
  const auto calls = [&](int64_t rows, double density, int count) {
    const WorkloadSpec spec{.rows = rows, .d_model = 512, .d_hidden = 4096, .density = density, .seed = 25};
    const Workload work = make_workload(spec);
    const cuda::DeviceFfnWeights weights = cuda::upload_weights(work.weights);
    const cuda::DeviceArray<bf16> x = cuda::upload_bf16(work.x.data(), work.x.size());
    const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(work.x.size());
    for (int call = 0; call < count; ++call) ffn.run(x.get(), rows, weights, y.get());
  };
  calls(64, 0.5, 6);
  calls(4096, 0.002, 6);
  calls(4096, 0.5, 8);
  EXPECT_TRUE(ffn.last_call_was_dense());
}

TEST_F(CudaFfnFromTwell, AccumulateAddsTheFfnToY) {
  const WorkloadSpec spec{.rows = 37, .d_model = 192, .d_hidden = 1000, .density = 0.05, .seed = 26};
  const test::WorkloadOnDevice d = test::upload_workload(spec);
  const std::vector<float> start = make_normal(d.work.x.size(), 1.0, 27);
  const cuda::DeviceArray<bf16> y = cuda::upload_bf16(start.data(), start.size());
  cuda::DeviceTwell packed;
  cuda::gate_to_twell_complete(d.x.get(), spec.rows, d.weights, 128, 4, packed);
  cuda::ffn_from_twell(d.x.get(), packed, d.weights, y.get(), nullptr, /*accumulate=*/true);
  std::vector<double> expected = d.y_ref;
  for (size_t i = 0; i < expected.size(); ++i) expected[i] += start[i];
  const std::vector<float> got = cuda::download_bf16(y.get(), start.size());
  EXPECT_LT(relative_l2_error(got.data(), expected.data(), got.size()), 1e-2);
}

// DenseFfn fusing from kFusedGateMinRows (the relu gate applied in the up GEMM's epilogue, gated_up_gemm.cu) where it
// applies (M >= kFusedGateMinRows and not a multiple of the 128-row tile; H a multiple of 8 whose last
// 256-column tile is partial) and where it falls back (H odd): within 1.1x of the baseline's error
// against float64; and, as a split runs it, on views of two neuron ranges each added to y.
TEST_F(CudaFfnFromTwell, DenseWithTheGateInTheUpEpilogueMatchesTheBaseline) {
  for (const int32_t hidden : {1000, 1001}) {
    SCOPED_TRACE(testing::Message() << "H " << hidden);
    const WorkloadSpec spec{.rows = cuda::DenseFfn::kFusedGateMinRows + 77, .d_model = 192, .d_hidden = hidden,
                            .density = 0.1, .seed = 40};
    const test::WorkloadOnDevice d = test::upload_workload(spec);
    const size_t count = d.work.x.size();
    const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(count);
    cuda::DenseFfn baseline, fused({.fuse_gate_from_rows = cuda::DenseFfn::kFusedGateMinRows});
    ASSERT_EQ(cudaMemset(y.get(), 0xff, count * sizeof(bf16)), cudaSuccess);
    baseline.run(d.x.get(), spec.rows, d.weights, y.get());
    const double baseline_error = error_of(d, y);
    ASSERT_EQ(cudaMemset(y.get(), 0xff, count * sizeof(bf16)), cudaSuccess);
    fused.run(d.x.get(), spec.rows, d.weights, y.get());
    const double fused_error = error_of(d, y);
    EXPECT_LT(baseline_error, 1e-2);
    EXPECT_LE(fused_error, 1.1 * baseline_error + 1e-6) << "baseline error " << baseline_error;

    const std::vector<float> start = make_normal(count, 1.0, 41);
    const cuda::DeviceArray<bf16> y_sum = cuda::upload_bf16(start.data(), count);
    for (const auto& [first, end] : {std::pair{0, 504}, std::pair{504, hidden}})
      fused.run(d.x.get(), spec.rows, d.weights.view().neurons(first, end), y_sum.get(), nullptr, {}, /*add_to_y=*/true);
    std::vector<double> expected = d.y_ref;
    for (size_t i = 0; i < count; ++i) expected[i] += start[i];
    const std::vector<float> got = cuda::download_bf16(y_sum.get(), count);
    EXPECT_LT(relative_l2_error(got.data(), expected.data(), count), 1e-2);
  }
}

// DenseFfn with gate and up in one batched launch, on one buffer holding Wg before Wu, Wu before Wg,
// and the two 8 bytes off a 16-byte multiple apart (two launches then, Wu 8 bytes off cuBLASLt's
// assumed alignment): each within 1.1x of the baseline's error against float64, y poisoned first.
TEST_F(CudaFfnFromTwell, DenseWithGateAndUpBatchedMatchesTheBaseline) {
  const WorkloadSpec spec{.rows = 301, .d_model = 192, .d_hidden = 1000, .density = 0.1, .seed = 42};
  const test::WorkloadOnDevice d = test::upload_workload(spec);
  const size_t count = d.work.x.size();
  const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(count);
  const auto error_into_poisoned_y = [&](cuda::DenseFfn& ffn, const cuda::DeviceFfnView& weights) {
    EXPECT_EQ(cudaMemset(y.get(), 0xff, count * sizeof(bf16)), cudaSuccess);
    ffn.run(d.x.get(), spec.rows, weights, y.get());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return error_of(d, y);
  };
  cuda::DenseFfn baseline;
  const double baseline_error = error_into_poisoned_y(baseline, d.weights);
  EXPECT_LT(baseline_error, 1e-2);

  const size_t matrix = static_cast<size_t>(spec.d_hidden) * spec.d_model;
  const cuda::DeviceArray<bf16> buffer = cuda::make_device_array<bf16>(3 * matrix + 8);
  const auto place = [&](const bf16* from, size_t offset) {
    EXPECT_EQ(cudaMemcpy(buffer.get() + offset, from, matrix * sizeof(bf16), cudaMemcpyDeviceToDevice), cudaSuccess);
    return buffer.get() + offset;
  };
  const bf16* down = place(d.weights.down.get(), 2 * matrix + 8);
  for (const auto& [gate_offset, up_offset] : {std::pair<size_t, size_t>{0, matrix}, {matrix, 0}, {0, matrix + 4}}) {
    SCOPED_TRACE(testing::Message() << "Wg at " << gate_offset << ", Wu at " << up_offset);
    const cuda::DeviceFfnView weights{spec.d_model, spec.d_hidden, true, place(d.weights.gate.get(), gate_offset),
                                      place(d.weights.up.get(), up_offset), down};
    cuda::DenseFfn batched({.batch_gate_and_up = true});
    EXPECT_LE(error_into_poisoned_y(batched, weights), 1.1 * baseline_error + 1e-6) << "baseline " << baseline_error;
  }
}

// The split paths of SparseFfn: on weights whose neurons are sorted by activity, each path the
// dispatch times (TwELL, dense, the neurons [0, f·H) dense and the rest TwELL, for three f, the last
// tile partial) gives the float64 FFN of the unsorted weights within bf16 tolerance, call by call.
TEST_F(CudaFfnFromTwell, SplitPathsOnSortedWeightsGiveTheFfn) {
  const WorkloadSpec spec{.rows = 300, .d_model = 256, .d_hidden = 1100, .density = 0.02, .hot_neurons = 40,
                          .seed = 28};
  const test::WorkloadOnDevice d = test::upload_workload(spec);
  const std::vector<float> calibration = make_activations(512, spec.d_model, 29);
  const cuda::DeviceFfnWeights sorted = cuda::upload_weights(sort_neurons_by_activity(
      d.work.weights, cpu::count_active_neurons(calibration.data(), 512, d.work.weights)));
  const size_t count = d.work.x.size();
  const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(count);
  for (const bool side_stream : {true, false}) {
    cuda::SparseFfn ffn({.tile = 128, .compression = 4, .allow_dense = true, .hot_fractions = {0.125, 0.5, 0.95},
                         .split_side_stream = side_stream});
    std::set<int32_t> hot_seen;
    for (int call = 0; call < 7; ++call) {
      ASSERT_EQ(cudaMemset(y.get(), 0xff, count * sizeof(bf16)), cudaSuccess);
      ffn.run(d.x.get(), spec.rows, sorted, y.get());
      SCOPED_TRACE(testing::Message() << "side stream " << side_stream << ", call " << call << ", hot neurons "
                                      << ffn.last_hot_neurons());
      EXPECT_LT(error_of(d, y), 1e-2);
      hot_seen.insert(ffn.last_hot_neurons());
    }
    EXPECT_EQ(hot_seen, (std::set<int32_t>{0, 128, 512, 1024}));  // whole tiles of 128
  }
  EXPECT_THROW(cuda::SparseFfn({.hot_fractions = {1.0}}), Error);
}

// Rewrites a layer's weights in place, so that the dispatch still sees the same layer.
void overwrite(cuda::DeviceFfnWeights& layer, const FfnWeights& weights) {
  const cuda::DeviceFfnWeights source = cuda::upload_weights(weights);
  const size_t bytes = static_cast<size_t>(layer.d_hidden) * layer.d_model * sizeof(bf16);
  for (const auto& [to, from] : {std::pair{layer.gate.get(), source.gate.get()},
                                 std::pair{layer.up.get(), source.up.get()},
                                 std::pair{layer.down.get(), source.down.get()}})
    ASSERT_EQ(cudaMemcpy(to, from, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
}

// A split path taken at one density is not kept blindly when the layer's input changes: its sparse
// part's density moves to another bucket, so a call runs plain TwELL to observe the layer's density
// (the split calls alone would leave the dispatch keyed by the old density for good).
TEST_F(CudaFfnFromTwell, SplitIsRecheckedWhenTheDensityChanges) {
  cuda::SparseFfn ffn({.tile = 128, .compression = 4, .allow_dense = false, .hot_fractions = {0.9}});
  const auto spec = [](double density) {
    return WorkloadSpec{.rows = 4096, .d_model = 512, .d_hidden = 4096, .density = density, .seed = 31};
  };
  const Workload dense_input = make_workload(spec(0.3)), sparse_input = make_workload(spec(0.002));
  cuda::DeviceFfnWeights layer = cuda::upload_weights(dense_input.weights);
  const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(dense_input.x.size());
  const auto calls = [&](const Workload& work, int count) {
    overwrite(layer, work.weights);
    const cuda::DeviceArray<bf16> x = cuda::upload_bf16(work.x.data(), work.x.size());
    std::set<int32_t> hot_seen;
    for (int call = 0; call < count; ++call) {
      ffn.run(x.get(), work.spec.rows, layer, y.get());
      hot_seen.insert(ffn.last_hot_neurons());
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return std::pair{hot_seen, ffn.last_hot_neurons()};
  };
  // At 30% TwELL is several times slower than a split running 90% of H densely (29 tiles of 128).
  EXPECT_EQ(calls(dense_input, 6).second, 3712);
  EXPECT_TRUE(calls(sparse_input, 8).first.contains(0));
}

// A layer that runs dense packs nothing, so its density was never seen again: an input turned
// sparse kept it dense for good. Every kDenseCallsPerProbe-th dense call packs a few of its rows; a
// density 2 buckets off makes a later call a plain TwELL recheck, and the paths are timed anew at
// the new density.
TEST_F(CudaFfnFromTwell, DenseLayerWhoseInputTurnsSparseIsLookedAtAgain) {
  cuda::SparseFfn ffn({.tile = 128, .compression = 4});
  const auto spec = [](double density) {
    return WorkloadSpec{.rows = 4096, .d_model = 512, .d_hidden = 4096, .density = density, .seed = 35};
  };
  const Workload dense_input = make_workload(spec(0.3)), sparse_input = make_workload(spec(0.002));
  cuda::DeviceFfnWeights layer = cuda::upload_weights(dense_input.weights);
  const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(dense_input.x.size());
  const cuda::DeviceArray<bf16> x_dense = cuda::upload_bf16(dense_input.x.data(), dense_input.x.size());
  for (int call = 0; call < 8; ++call) ffn.run(x_dense.get(), 4096, layer, y.get());
  ASSERT_TRUE(ffn.last_call_was_dense()) << "at 30% TwELL was expected several times slower than dense";
  ASSERT_FALSE(ffn.last_call_measured());

  overwrite(layer, sparse_input.weights);
  const cuda::DeviceArray<bf16> x_sparse = cuda::upload_bf16(sparse_input.x.data(), sparse_input.x.size());
  // The probe comes by the kDenseCallsPerProbe-th dense call and the recheck on the call after. Its
  // counters are read once it has finished: dense calls never wait for the GPU, so each call here
  // does (unsynchronized, the host ran ~100 calls ahead of the H100 and the probe was never read).
  constexpr int kLatest = cuda::FfnDensityBook::kDenseCallsPerProbe + 1;
  int first_measured = -1;
  for (int call = 0; call < kLatest + 30; ++call) {
    ffn.run(x_sparse.get(), 4096, layer, y.get());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (first_measured < 0 && ffn.last_call_measured()) first_measured = call;
  }
  EXPECT_GE(first_measured, 0) << "the layer stayed dense without a look at its new density";
  EXPECT_LE(first_measured, kLatest);
  EXPECT_FALSE(ffn.last_call_measured());
  std::map<std::string, float> times;
  for (const auto& [path, ms] : ffn.last_bucket_times()) times[path] = ms;
  ASSERT_TRUE(times.contains("twell") && times.contains("dense")) << "the new density's bucket was not timed";
  EXPECT_EQ(ffn.last_call_was_dense(), times["dense"] < times["twell"]);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// A model shares one SparseFfn among its layers: a split call's sparse density is compared with its
// own layer's earlier calls, not another layer's. Two layers whose sparse parts lie 2 buckets apart
// (a factor of 4), both taking the split, run it call after call once the paths are timed. Compared
// across layers, every other call here was a recheck of plain TwELL.
// Layers of one shape (4096 rows, D 512, H 4096) at the given densities for the dispatch tests, run
// through a SparseFfn that chooses between TwELL and a split at 90% of H (no all-dense path).
struct DispatchLayers {
  static constexpr int64_t kRows = 4096;
  std::vector<cuda::DeviceFfnWeights> weights;
  std::vector<cuda::DeviceArray<bf16>> xs;
  cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(kRows * 512);
  cuda::SparseFfn ffn{{.tile = 128, .compression = 4, .allow_dense = false, .hot_fractions = {0.9}}};

  DispatchLayers(std::initializer_list<double> densities, uint64_t seed) {
    for (const double density : densities) {
      const Workload work =
          make_workload({.rows = kRows, .d_model = 512, .d_hidden = 4096, .density = density, .seed = seed});
      weights.push_back(cuda::upload_weights(work.weights));
      xs.push_back(cuda::upload_bf16(work.x.data(), work.x.size()));
    }
  }
  void run(size_t layer) { ffn.run(xs[layer].get(), kRows, weights[layer], y.get()); }
};

TEST_F(CudaFfnFromTwell, LayersOfDifferentDensitiesKeepTheirSplitsWithoutRechecks) {
  DispatchLayers layers({0.4, 0.1}, 32);
  cuda::SparseFfn& ffn = layers.ffn;
  for (int call = 0; call < 40; ++call) {
    const size_t layer = call % 2;
    layers.run(layer);
    if (call < 30) continue;
    SCOPED_TRACE(testing::Message() << "call " << call << ", layer " << layer);
    EXPECT_FALSE(ffn.last_call_measured());
    EXPECT_EQ(ffn.last_hot_neurons(), 3712);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// A call is keyed by the density last seen at its own M. Here batch-1 calls of a row far denser than
// the large calls' (the negated row: the workload's threshold input flips too, ~98% of H) come
// between the large calls. Keyed by the newest density of any M, a large call landed in the bucket
// of the single row's density, whose TwELL time never arrives (it is stored under the density the
// timed run measures), so every large call was a timed run again.
TEST_F(CudaFfnFromTwell, DensityIsKeptPerRowCount) {
  cuda::SparseFfn ffn({.tile = 128, .compression = 4, .allow_dense = false, .hot_fractions = {0.9}});
  const Workload work =
      make_workload({.rows = 4096, .d_model = 512, .d_hidden = 4096, .density = 0.02, .seed = 33});
  const cuda::DeviceFfnWeights weights = cuda::upload_weights(work.weights);
  std::vector<float> negated(work.x.begin(), work.x.begin() + work.spec.d_model);
  for (float& value : negated) value = -value;
  const cuda::DeviceArray<bf16> x = cuda::upload_bf16(work.x.data(), work.x.size());
  const cuda::DeviceArray<bf16> row = cuda::upload_bf16(negated.data(), negated.size());
  const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(work.x.size());
  for (int call = 0; call < 24; ++call) {
    const bool large = call % 2 == 0;
    ffn.run(large ? x.get() : row.get(), large ? 4096 : 1, weights, y.get());
    if (call < 16) continue;
    EXPECT_FALSE(ffn.last_call_measured()) << "call " << call << (large ? " (4096 rows)" : " (one row)");
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The dispatch's memory of densities (no GPU): a plain TwELL call's density keys later calls of its
// own M bucket on its own weights (others borrow the newest of that M bucket); a split's sparse
// density is compared with its own weights' first, or, while they borrow, with the first split of
// any weights in the bucket; 2 buckets off marks a recheck of those weights at that M bucket, taken
// once.
TEST(FfnDensityBook, DensitiesPerRowCountAndSplitsPerLayer) {
  using Call = cuda::FfnDensityBook::Call;
  cuda::FfnDensityBook book(4);
  const int layer_a = 0, layer_b = 0, layer_c = 0, layer_d = 0;
  EXPECT_EQ(book.nnz_per_row(4096, &layer_a), -1.0);
  book.issue(0, Call{.rows = 4096, .hot = 0, .bucket = 1, .layer = &layer_a});
  book.issue(1, Call{.rows = 1, .hot = 0, .bucket = 2, .layer = &layer_a});
  book.observe(0, 4096 * 82);
  book.observe(1, 4014);  // a batch-1 row far denser than the 4096 rows' average
  EXPECT_EQ(book.nnz_per_row(4096, &layer_a), 82.0);
  EXPECT_EQ(book.nnz_per_row(3000, &layer_a), 82.0);  // the same M bucket (ceil log2)
  EXPECT_EQ(book.nnz_per_row(1, &layer_a), 4014.0);
  EXPECT_EQ(book.nnz_per_row(16, &layer_a), -1.0);
  EXPECT_EQ(book.nnz_per_row(4096, &layer_c), 82.0);  // borrowed: layer c was never seen plain
  // A call of 4096 rows on `layer` (hot > 0: a split's) with `per_row` non-zeros per row.
  const auto seen = [&](const int* layer, int32_t hot, uint64_t per_row) {
    book.issue(2, Call{.rows = 4096, .hot = hot, .bucket = hot > 0 ? 7 : 1, .layer = layer});
    book.observe(2, 4096 * per_row);
  };
  seen(&layer_b, 0, 20);
  EXPECT_EQ(book.nnz_per_row(4096, &layer_b), 20.0);
  EXPECT_EQ(book.nnz_per_row(4096, &layer_a), 82.0);  // its own, not the newest
  EXPECT_EQ(book.nnz_per_row(4096, &layer_c), 20.0);  // the newest

  // Two layers with densities of their own whose split parts lie 2 buckets apart (160 and 40 per
  // row): no recheck.
  seen(&layer_a, 512, 160);
  seen(&layer_b, 512, 40);
  EXPECT_FALSE(book.take_recheck(4096, &layer_a));
  EXPECT_FALSE(book.take_recheck(4096, &layer_b));
  // One bucket off on its own layer (160 -> 80): call-to-call noise, no recheck.
  seen(&layer_a, 512, 80);
  EXPECT_FALSE(book.take_recheck(4096, &layer_a));
  // Two buckets off on its own layer (160 -> 40): the next call of that M bucket on it rechecks, once.
  seen(&layer_a, 512, 40);
  EXPECT_FALSE(book.take_recheck(1, &layer_a));
  EXPECT_FALSE(book.take_recheck(4096, &layer_b));
  EXPECT_TRUE(book.take_recheck(4096, &layer_a));
  EXPECT_FALSE(book.take_recheck(4096, &layer_a));
  EXPECT_EQ(book.nnz_per_row(4096, &layer_a), 82.0);  // a split's density is not the layer's

  // Borrowing layers (new weights): one whose first split is 2 buckets from the bucket's first
  // (layer a's 160 -> 640) is rechecked; one within a bucket of it (160 -> 200) is not.
  seen(&layer_c, 512, 640);
  seen(&layer_d, 512, 200);
  EXPECT_TRUE(book.take_recheck(4096, &layer_c));
  EXPECT_FALSE(book.take_recheck(4096, &layer_d));
  // Its later splits compare with its own first: no recheck again at the same density.
  seen(&layer_c, 512, 640);
  EXPECT_FALSE(book.take_recheck(4096, &layer_c));

  EXPECT_THROW(cuda::FfnDensityBook(0), Error);
}

// Dense calls are probed on every kDenseCallsPerProbe-th of their (M bucket, layer), and on the
// first while the layer borrows its density. A probe 2 density buckets off the density its call was
// keyed by (the layer's own, else the one it borrows) marks that call's M bucket for a recheck; one
// bucket off does not; a probe's density is not kept.
TEST(FfnDensityBook, ProbesOfDenseCalls) {
  using Book = cuda::FfnDensityBook;
  Book book(4);
  const int layer = 0, other = 0, third = 0;
  book.issue(0, Book::Call{.rows = 4096, .layer = &layer});
  book.observe(0, 4096 * 500);  // density bucket floor(log2(501)) = 8
  for (int call = 1; call <= 2 * Book::kDenseCallsPerProbe; ++call)
    EXPECT_EQ(book.density_probe_due(4096, &layer), call % Book::kDenseCallsPerProbe == 0) << "call " << call;
  // Counted per M bucket and layer; the first dense call of a layer without a density of its own at
  // that M bucket is probed.
  EXPECT_TRUE(book.density_probe_due(16, &layer));
  EXPECT_FALSE(book.density_probe_due(16, &layer));
  EXPECT_TRUE(book.density_probe_due(4096, &third));
  EXPECT_FALSE(book.density_probe_due(4096, &third));

  const auto probe = [&](const int* probed_layer, uint64_t per_row) {
    book.issue(1, Book::Call{.rows = 256, .layer = probed_layer, .probe_of_rows = 4096});
    book.observe(1, 256 * per_row);
  };
  probe(&layer, 200);  // bucket 7
  EXPECT_FALSE(book.take_recheck(4096, &layer));
  probe(&layer, 100);  // bucket 6
  EXPECT_FALSE(book.take_recheck(256, &layer));  // the probed call's M bucket, not the probe's
  EXPECT_TRUE(book.take_recheck(4096, &layer));
  EXPECT_FALSE(book.take_recheck(4096, &layer));
  EXPECT_EQ(book.nnz_per_row(4096, &layer), 500.0);
  EXPECT_EQ(book.nnz_per_row(256, &layer), -1.0);
  probe(&other, 2000);  // bucket 10 against the borrowed 8
  EXPECT_TRUE(book.take_recheck(4096, &other));
  probe(&other, 700);  // bucket 9
  EXPECT_FALSE(book.take_recheck(4096, &other));
}

// What SparseFfn times again side by side once every path of a bucket has its time (no GPU):
// unmeasured (negative) and unavailable (infinite) paths are no candidates; the runner-up counts only
// within the ratio, inclusive.
TEST(FastestTwo, RunnerUpOnlyWithinTheRatio) {
  const float unavailable = std::numeric_limits<float>::infinity();
  cuda::FastestTwo two = cuda::fastest_two({-1.0f, 2.0f, unavailable, 1.9f, 2.5f}, 1.1f);
  EXPECT_EQ(two.best, 3);
  EXPECT_EQ(two.close_second, 1);
  two = cuda::fastest_two({1.0f, 1.25f}, 1.1f);
  EXPECT_EQ(two.best, 0);
  EXPECT_EQ(two.close_second, -1);
  two = cuda::fastest_two({1.1f, 1.0f}, 1.1f);
  EXPECT_EQ(two.best, 1);
  EXPECT_EQ(two.close_second, 0);
  two = cuda::fastest_two({unavailable, 3.0f}, 1.1f);
  EXPECT_EQ(two.best, 1);
  EXPECT_EQ(two.close_second, -1);
  two = cuda::fastest_two({-1.0f, unavailable}, 1.1f);
  EXPECT_EQ(two.best, -1);
  EXPECT_EQ(two.close_second, -1);
}

// One SparseFfn over new weights of another density (as the bench's grid ran before it made a
// dispatch per cell). Weights 10x denser than the ones the split was chosen on, keyed by the earlier weights' density, ran that split for good
// (0.24x dense at 10%): now their first split, far from the bucket's first, makes the next call a
// plain TwELL recheck, and their own density keys them from then on.
TEST_F(CudaFfnFromTwell, NewWeightsOfAnotherDensityAreLookedAtAgain) {
  DispatchLayers layers({0.05, 0.5}, 34);
  cuda::SparseFfn& ffn = layers.ffn;
  for (int call = 0; call < 20; ++call) layers.run(0);
  ASSERT_FALSE(ffn.last_call_measured()) << "the first weights never settled";
  ASSERT_EQ(ffn.last_hot_neurons(), 3712) << "expected the split on the first weights";
  // The counters of a call arrive while the host runs ahead: a call reads the newest that finished,
  // and waits only when kCounterSlots (4) calls are unread, so the first split on the denser
  // weights is seen by the fifth call at the latest, which then rechecks.
  int first_measured = -1;
  for (int call = 0; call < 30; ++call) {
    layers.run(1);
    if (first_measured < 0 && ffn.last_call_measured()) first_measured = call;
    if (call >= 24) EXPECT_FALSE(ffn.last_call_measured()) << "call " << call << " on the denser weights";
  }
  EXPECT_GE(first_measured, 0) << "the denser weights ran the first weights' choice without a look";
  EXPECT_LE(first_measured, 4) << "the recheck came later than the counters allow";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_F(CudaFfnFromTwell, ViewsOfNeuronRangesStayInside) {
  const WorkloadSpec spec{.rows = 2, .d_model = 64, .d_hidden = 300, .density = 0.1, .seed = 30};
  const test::WorkloadOnDevice d = test::upload_workload(spec);
  const cuda::DeviceFfnView view = d.weights;
  EXPECT_EQ(view.neurons(100, 300).d_hidden, 200);
  EXPECT_EQ(view.neurons(100, 300).down, view.down + 100 * 64);
  EXPECT_THROW(view.neurons(0, 301), Error);
  EXPECT_THROW(view.neurons(7, 7), Error);
}

TEST_F(CudaFfnFromTwell, RejectsModelsWiderThanTheKernel) {
  const WorkloadSpec spec{.rows = 2, .d_model = 8256, .d_hidden = 130, .density = 0.1, .seed = 24};
  const Workload work = make_workload(spec);
  const cuda::DeviceFfnWeights weights = cuda::upload_weights(work.weights);
  const cuda::DeviceArray<bf16> x = cuda::upload_bf16(work.x.data(), work.x.size());
  cuda::DeviceTwell packed;
  cuda::upload(ref::gate_to_twell(work.x.data(), spec.rows, work.weights, 128, 4), packed);
  const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(work.x.size());
  EXPECT_THROW(cuda::ffn_from_twell(x.get(), packed, weights, y.get()), Error);
}

}  // namespace
