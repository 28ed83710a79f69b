// Focused tests of the CPU kernels, beside the op-test sweep (backend_cpu.cpp): spills under skew,
// both gate paths (own dot products for few rows, OpenBLAS blocks for many), independence of the
// thread count, reuse of one TwellMatrix across shapes, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/cpu.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"
#include "cpu/kernels.h"

namespace twell {
namespace {

// Restores the process-wide CPU settings a test changes.
class CpuKernels : public testing::Test {
 protected:
  void TearDown() override {
    cpu::set_isa(cpu::best_isa());
    cpu::set_num_threads(0);
  }
};

// The CPU packing against the float64 reference, element by element: the same non-zeros, each
// value within one bf16 step (a gate near a rounding midpoint may round either way) plus the fp32
// accumulation error. Near-zero gates may fall on
// either side of zero in fp32 and in float64; such elements are allowed to differ by that error.
testing::AssertionResult same_packing(const TwellMatrix& got, const TwellMatrix& want) {
  try {
    validate(got);
  } catch (const Error& error) {
    return testing::AssertionFailure() << "invalid packing: " << error.what();
  }
  if (got.shape.rows != want.shape.rows || got.shape.cols != want.shape.cols || got.shape.tile != want.shape.tile ||
      got.shape.compression != want.shape.compression)
    return testing::AssertionFailure() << "shape differs";
  const std::vector<bf16> got_dense = dense_from_twell(got);
  const std::vector<bf16> want_dense = dense_from_twell(want);
  constexpr double kAccumulationError = 1e-4;  // far above fp32 dot products of N(0, 1.25) gates
  for (size_t i = 0; i < got_dense.size(); ++i) {
    const double a = to_float(got_dense[i]), b = to_float(want_dense[i]);
    if (std::abs(a - b) > std::ldexp(std::abs(b), -7) + kAccumulationError)
      return testing::AssertionFailure() << "element " << i << " (row " << i / got.shape.cols << ", column "
                                         << i % got.shape.cols << "): " << a << " vs reference " << b;
  }
  return testing::AssertionSuccess();
}

Workload skewed_workload(int64_t rows, int32_t d_model, int32_t d_hidden, double density, int32_t hot, uint64_t seed) {
  WorkloadSpec spec;
  spec.rows = rows;
  spec.d_model = d_model;
  spec.d_hidden = d_hidden;
  spec.density = density;
  spec.hot_neurons = hot;
  spec.seed = seed;
  return make_workload(spec);
}

int64_t spilled_tiles(const TwellMatrix& packed) {
  int64_t count = 0;
  for (int32_t nnz : packed.tile_nnz) count += twell_tile_spilled(nnz);
  return count;
}

// Hot neurons fill their tiles past T/C = 16 slots: both gate paths (3 rows: own dot products;
// 300 rows: OpenBLAS blocks) must spill those tiles exactly, on every ISA.
TEST_F(CpuKernels, SpillsHotTilesExactlyOnEveryPathAndIsa) {
  for (int64_t rows : {3, 300}) {
    const Workload work = skewed_workload(rows, 200, 1000, 0.02, 40, 11 + rows);
    const TwellMatrix want = ref::gate_to_twell(work.x.data(), rows, work.weights, 128, 8);
    ASSERT_GT(spilled_tiles(want), 0) << "the workload must make tiles overflow";
    for (cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512}) {
      if (isa == cpu::Isa::avx512 && cpu::best_isa() != cpu::Isa::avx512) continue;
      if (isa == cpu::Isa::avx2 && cpu::best_isa() == cpu::Isa::scalar) continue;
      cpu::set_isa(isa);
      TwellMatrix got;
      cpu::gate_to_twell(work.x.data(), rows, work.weights, 128, 8, got);
      EXPECT_TRUE(same_packing(got, want)) << "rows " << rows << ", isa " << cpu::to_string(isa);
      EXPECT_EQ(spilled_tiles(got), spilled_tiles(want));
      // Spill rows are handed out in (row, tile) order.
      int32_t next_spill_row = 0;
      for (int32_t nnz : got.tile_nnz)
        if (twell_tile_spilled(nnz)) EXPECT_EQ(twell_spill_row(nnz), next_spill_row++);
      EXPECT_EQ(got.spill_used, next_spill_row);
    }
  }
}

// Work is split differently with 1 and 2 threads, but every element is computed in the same order:
// the results must be bit-identical.
TEST_F(CpuKernels, ResultsDoNotDependOnTheThreadCount) {
  for (int64_t rows : {1, 17, 300}) {
    const Workload work = skewed_workload(rows, 96, 1500, 0.1, 5, 20 + rows);
    TwellMatrix packed[2];
    std::vector<float> y[2];
    for (int threads : {1, 2}) {
      cpu::set_num_threads(threads);
      cpu::gate_to_twell(work.x.data(), rows, work.weights, 256, 4, packed[threads - 1]);
      y[threads - 1].assign(work.x.size(), std::numeric_limits<float>::quiet_NaN());
      cpu::ffn_from_twell(work.x.data(), packed[threads - 1], work.weights, y[threads - 1].data());
    }
    EXPECT_EQ(packed[0].slots, packed[1].slots) << "rows " << rows;
    EXPECT_EQ(packed[0].tile_nnz, packed[1].tile_nnz) << "rows " << rows;
    EXPECT_EQ(packed[0].spill_used, packed[1].spill_used) << "rows " << rows;
    EXPECT_EQ(y[0], y[1]) << "rows " << rows;
  }
}

// One TwellMatrix serves calls of different shapes (as in an inference loop): large, small with
// many spills, large again; each result equals a fresh packing and the FFN stays right.
TEST_F(CpuKernels, ReusesOneTwellMatrixAcrossShapes) {
  TwellMatrix reused;
  struct Shape {
    int64_t rows;
    int32_t d_hidden;
    double density;
    int32_t hot;
    int32_t tile;
    int32_t compression;
  };
  for (const Shape& s : {Shape{300, 1000, 0.005, 0, 128, 4}, Shape{3, 4097, 0.5, 7, 256, 8},
                         Shape{17, 1500, 0.02, 0, 128, 2}, Shape{300, 1000, 0.1, 30, 128, 8}}) {
    const Workload work = skewed_workload(s.rows, 64, s.d_hidden, s.density, s.hot, s.rows + s.d_hidden);
    cpu::gate_to_twell(work.x.data(), s.rows, work.weights, s.tile, s.compression, reused);
    TwellMatrix fresh;
    cpu::gate_to_twell(work.x.data(), s.rows, work.weights, s.tile, s.compression, fresh);
    EXPECT_EQ(reused.slots, fresh.slots);
    EXPECT_EQ(reused.tile_nnz, fresh.tile_nnz);
    ASSERT_EQ(reused.spill_used, fresh.spill_used);
    EXPECT_TRUE(std::equal(fresh.spill.begin(), fresh.spill.begin() + int64_t{fresh.spill_used} * s.tile,
                           reused.spill.begin(), [](bf16 a, bf16 b) { return a.bits == b.bits; }));
    EXPECT_TRUE(same_packing(reused, ref::gate_to_twell(work.x.data(), s.rows, work.weights, s.tile, s.compression)));

    std::vector<float> y(work.x.size(), std::numeric_limits<float>::quiet_NaN());
    cpu::ffn_from_twell(work.x.data(), reused, work.weights, y.data());
    const std::vector<double> y_ref = ref::ffn_from_twell(work.x.data(), reused, work.weights);
    EXPECT_LE(relative_l2_error(y.data(), y_ref.data(), y.size()), 1e-5);
  }
}

// The complete sparse FFN against the dense float64 FFN: the only difference allowed is the bf16
// rounding of the gate values (relative 2^-9 per value).
TEST_F(CpuKernels, SparseFfnMatchesTheDenseReference) {
  for (int64_t rows : {1, 3, 40}) {
    const Workload work = skewed_workload(rows, 512, 1000, 0.05, 2, 30 + rows);
    TwellMatrix packed;
    cpu::gate_to_twell(work.x.data(), rows, work.weights, 128, 4, packed);
    std::vector<float> y(work.x.size(), std::numeric_limits<float>::quiet_NaN());
    cpu::ffn_from_twell(work.x.data(), packed, work.weights, y.data());
    const std::vector<double> y_ref = ref::ffn_dense(work.x.data(), rows, work.weights);
    EXPECT_LE(relative_l2_error(y.data(), y_ref.data(), y.size()), 4e-3) << "rows " << rows;

    cpu::DenseScratch scratch;
    std::vector<float> y_dense(work.x.size(), std::numeric_limits<float>::quiet_NaN());
    cpu::ffn_dense(work.x.data(), rows, work.weights, y_dense.data(), scratch);
    EXPECT_LE(relative_l2_error(y_dense.data(), y_ref.data(), y.size()), 1e-5) << "rows " << rows;
  }
}

// count_active_neurons against the float64 projection (rows past one chunk of 256, so the chunks
// add up; a near-zero pre-activation may fall on either side of zero in fp32, hence a slack of 2),
// then sort_neurons_by_activity: counts descending, the FFN unchanged (float64 on both sides).
TEST_F(CpuKernels, NeuronsSortedByActivityGiveTheSameFfn) {
  for (bool gated : {true, false}) {
    SCOPED_TRACE(testing::Message() << "gated=" << gated);
    WorkloadSpec spec{.rows = 300, .d_model = 96, .d_hidden = 333, .density = 0.05, .gated = gated,
                      .hot_neurons = 5, .seed = 41};
    const Workload work = make_workload(spec);
    const std::vector<int64_t> counts = cpu::count_active_neurons(work.x.data(), spec.rows, work.weights);
    const std::vector<double> g = ref::relu_projection(work.x.data(), spec.rows, work.weights);
    int64_t difference = 0;
    for (int32_t j = 0; j < spec.d_hidden; ++j) {
      int64_t want = 0;
      for (int64_t m = 0; m < spec.rows; ++m) want += g[m * spec.d_hidden + j] > 0;
      difference += std::abs(counts[j] - want);
    }
    EXPECT_LE(difference, 2);
    EXPECT_GE(counts[0], 290) << "hot neuron 0";

    const FfnWeights sorted = sort_neurons_by_activity(work.weights, counts);
    const std::vector<int64_t> sorted_counts = cpu::count_active_neurons(work.x.data(), spec.rows, sorted);
    EXPECT_TRUE(std::is_sorted(sorted_counts.rbegin(), sorted_counts.rend()));
    EXPECT_NE(sorted.up, work.weights.up) << "the test needs a permutation that moves rows";
    const std::vector<double> y = ref::ffn_dense(work.x.data(), spec.rows, work.weights);
    const std::vector<double> y_sorted = ref::ffn_dense(work.x.data(), spec.rows, sorted);
    double worst = 0;
    for (size_t i = 0; i < y.size(); ++i) worst = std::max(worst, std::abs(y[i] - y_sorted[i]));
    EXPECT_LT(worst, 1e-9);
  }
  const Workload work = make_workload({.rows = 2, .d_model = 8, .d_hidden = 4, .seed = 42});
  EXPECT_THROW(sort_neurons_by_activity(work.weights, {1, 2, 3}), Error);
}

// paired_dots (the decode FFN's gathered rows) on every ISA: each sum bit-identical to dot_block's
// for that row and neuron alone, and within fp32 accumulation error of float64; counts past one
// tile of kPairedDots, lengths with and without a vector tail, rows scattered in memory.
TEST_F(CpuKernels, PairedDotsAreDotBlocksOfTheirPairs) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512}) {
    try {
      cpu::set_isa(isa);
    } catch (const Error&) {
      continue;  // this CPU lacks it
    }
    const cpu::KernelTable& kernels = cpu::active_kernels();
    for (int32_t d : {1, 7, 16, 17, 100, 2053}) {
      constexpr int32_t kRows = 5, kNeurons = 13;
      std::vector<float> x(static_cast<size_t>(kRows) * d), w(static_cast<size_t>(kNeurons) * d);
      for (float& v : x) v = normal(rng);
      for (float& v : w) v = normal(rng);
      for (int32_t count = 1; count <= 2 * cpu::kPairedDots + 1; ++count) {
        SCOPED_TRACE(testing::Message() << cpu::to_string(isa) << " d " << d << " count " << count);
        std::vector<const float*> x_rows(count), w_rows(count);
        for (int32_t i = 0; i < count; ++i) {
          x_rows[i] = x.data() + static_cast<size_t>(rng() % kRows) * d;
          w_rows[i] = w.data() + static_cast<size_t>(rng() % kNeurons) * d;
        }
        std::vector<float> out(count + 1, std::numeric_limits<float>::quiet_NaN());
        kernels.paired_dots(x_rows.data(), w_rows.data(), count, d, out.data());
        EXPECT_TRUE(std::isnan(out[count])) << "wrote past count";
        for (int32_t i = 0; i < count; ++i) {
          float alone = std::numeric_limits<float>::quiet_NaN();
          kernels.dot_block(x_rows[i], 1, w_rows[i], 1, d, &alone, 1);
          EXPECT_EQ(std::memcmp(&out[i], &alone, sizeof(float)), 0) << "pair " << i << ": " << out[i] << " vs " << alone;
          double exact = 0, magnitude = 0;
          for (int32_t k = 0; k < d; ++k) {
            exact += static_cast<double>(x_rows[i][k]) * w_rows[i][k];
            magnitude += std::abs(static_cast<double>(x_rows[i][k]) * w_rows[i][k]);
          }
          EXPECT_NEAR(out[i], exact, 1e-6 * magnitude + 1e-30) << "pair " << i;
        }
      }
    }
  }
}

TEST_F(CpuKernels, RejectsBadInput) {
  const Workload work = skewed_workload(3, 64, 300, 0.1, 0, 5);
  TwellMatrix packed;
  EXPECT_THROW(cpu::gate_to_twell(work.x.data(), 3, work.weights, 64, 4, packed), Error);
  EXPECT_THROW(cpu::gate_to_twell(work.x.data(), 3, work.weights, 128, 3, packed), Error);
  EXPECT_THROW(cpu::gate_to_twell(work.x.data(), 0, work.weights, 128, 4, packed), Error);

  std::vector<float> x_nan = work.x;
  x_nan[64 + 5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(cpu::gate_to_twell(x_nan.data(), 3, work.weights, 128, 4, packed), Error);

  cpu::gate_to_twell(work.x.data(), 3, work.weights, 128, 4, packed);
  std::vector<float> y(work.x.size());
  FfnWeights other = work.weights;
  other.d_hidden = 299;
  EXPECT_THROW(cpu::ffn_from_twell(work.x.data(), packed, other, y.data()), Error);  // sizes mismatch

  TwellMatrix incomplete = packed;
  incomplete.spill_used = static_cast<int32_t>(incomplete.spill_capacity()) + 1;
  EXPECT_THROW(cpu::ffn_from_twell(work.x.data(), incomplete, work.weights, y.data()), Error);

  TwellMatrix bad_column = packed;
  bad_column.tile_nnz[0] = 1;
  bad_column.slots[0] = twell_make_slot(0x3f80, 200);  // column 200 is in tile 1, not tile 0
  EXPECT_THROW(cpu::ffn_from_twell(work.x.data(), bad_column, work.weights, y.data()), Error);

  TwellMatrix too_many = packed;
  too_many.tile_nnz[0] = too_many.shape.slots() + 1;
  EXPECT_THROW(cpu::ffn_from_twell(work.x.data(), too_many, work.weights, y.data()), Error);

  EXPECT_THROW(cpu::set_num_threads(-1), Error);
}

}  // namespace
}  // namespace twell
