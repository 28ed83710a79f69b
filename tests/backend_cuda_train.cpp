// The CUDA training FFN (include/twell/train.h): its ops in the op-test harness (backend
// "cuda_train"), and tests of the whole op against the float64 reference: TwELL -> hybrid
// conversion (exact), the sparse path with rows far over the ELL width and a backup that must grow,
// the dense path, and the op fed by the CUDA gate kernel. Skipped without a GPU.
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/timed_choice.h"
#include "cuda_test_support.h"
#include "op_harness.h"
#include "twell/convert.h"
#include "twell/cuda.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/train.h"
#include "twell/workload.h"

namespace {

using namespace twell;

std::vector<float> download_floats(const float* device, size_t count) {
  std::vector<float> host(count);
  cuda::copy_to_host(host.data(), device, count * sizeof(float));
  return host;
}

// Gradient buffers on the device, poisoned with NaN (all-ones bytes) so an unwritten element shows.
struct DeviceGrads {
  cuda::DeviceArray<bf16> dx;
  cuda::DeviceArray<float> d_gate, d_up, d_down;
  int64_t rows, d_model, d_hidden;

  DeviceGrads(int64_t m, int32_t d, int32_t h)
      : dx(cuda::make_device_array<bf16>(m * d)),
        d_gate(cuda::make_device_array<float>(int64_t{h} * d)),
        d_up(cuda::make_device_array<float>(int64_t{h} * d)),
        d_down(cuda::make_device_array<float>(int64_t{h} * d)),
        rows(m),
        d_model(d),
        d_hidden(h) {
    EXPECT_EQ(cudaMemset(dx.get(), 0xff, m * d * sizeof(bf16)), cudaSuccess);
    for (float* p : {d_gate.get(), d_up.get(), d_down.get()})
      EXPECT_EQ(cudaMemset(p, 0xff, int64_t{h} * d * sizeof(float)), cudaSuccess);
  }
  cuda::DeviceFfnGrads view() { return {dx.get(), d_gate.get(), d_up.get(), d_down.get()}; }
  void download(const test::GradOutputs& out) const {
    const std::vector<float> dx_host = cuda::download_bf16(dx.get(), rows * d_model);
    std::memcpy(out.dx, dx_host.data(), dx_host.size() * sizeof(float));
    const size_t weights = d_hidden * d_model;
    cuda::copy_to_host(out.d_gate, d_gate.get(), weights * sizeof(float));
    cuda::copy_to_host(out.d_up, d_up.get(), weights * sizeof(float));
    cuda::copy_to_host(out.d_down, d_down.get(), weights * sizeof(float));
  }
};

cuda::DeviceArray<bf16> poisoned_bf16(size_t count) {
  cuda::DeviceArray<bf16> buffer = cuda::make_device_array<bf16>(count);
  EXPECT_EQ(cudaMemset(buffer.get(), 0xff, count * sizeof(bf16)), cudaSuccess);
  return buffer;
}

// TwELL -> hybrid on the device, growing the backup until nothing overflows (the harness contract).
HybridMatrix device_twell_to_hybrid(const TwellMatrix& gate, int32_t ell_width, int32_t first_capacity) {
  cuda::DeviceTwell packed;
  cuda::upload(gate, packed);
  cuda::DeviceHybrid hybrid;
  hybrid.reserve(HybridShape{gate.shape.rows, gate.shape.cols, ell_width}, first_capacity);
  for (;;) {
    cuda::twell_to_hybrid(packed, ell_width, hybrid, nullptr);
    const int32_t used = hybrid.backup_used(nullptr);
    if (used <= hybrid.backup_capacity()) return hybrid.download(nullptr);
    hybrid.reserve(hybrid.shape(), used);
  }
}

// Forward (and backward when `grads` is given) of the sparse path from a host hybrid gate.
void run_from_hybrid(const float* x, const HybridMatrix& gate, const FfnWeights& weights, double l1_coeff,
                     float* y, double* l1, double* l0, const float* dy, const test::GradOutputs* grads) {
  const int64_t rows = gate.shape.rows;
  const int32_t d = weights.d_model;
  const cuda::DeviceFfnWeights device_weights = test::upload_weights_any_width(weights);
  const cuda::DeviceArray<bf16> x_device = cuda::upload_bf16(x, rows * d);
  cuda::DeviceHybrid device_gate;
  device_gate.upload(gate, nullptr);
  cuda::FfnTrainOp op({.l1_coeff = l1_coeff, .path = cuda::TrainPath::sparse});
  cuda::DeviceArray<bf16> y_device = poisoned_bf16(rows * d);
  op.forward(x_device.get(), rows, device_weights, device_gate, y_device.get(), nullptr);
  if (y) {
    const std::vector<float> y_host = cuda::download_bf16(y_device.get(), rows * d);
    std::memcpy(y, y_host.data(), y_host.size() * sizeof(float));
    const cuda::FfnTrainStats stats = op.stats(nullptr);
    *l1 = stats.l1;
    *l0 = stats.l0;
  }
  if (grads) {
    const cuda::DeviceArray<bf16> dy_device = cuda::upload_bf16(dy, rows * d);
    DeviceGrads device_grads(rows, d, weights.d_hidden);
    op.backward(dy_device.get(), device_grads.view(), nullptr);
    device_grads.download(*grads);
  }
}

const bool registered = test::register_backend({
    .name = "cuda_train",
    .skip_reason = [] { return cuda::available() ? std::string() : std::string("no CUDA device"); },
    // The ELL path keeps h in fp32; backup rows feed h to cuBLASLt in bf16. y and dx are bf16.
    .precision = {.hidden_bf16 = true, .output_bf16 = true},
    .twell_to_hybrid = [](const TwellMatrix& gate, int32_t ell_width,
                          HybridMatrix& out) { out = device_twell_to_hybrid(gate, ell_width, 1); },
    .hybrid_forward =
        [](const float* x, const HybridMatrix& gate, const FfnWeights& weights, double l1_coeff, float* y,
           double& l1, double& l0) { run_from_hybrid(x, gate, weights, l1_coeff, y, &l1, &l0, nullptr, nullptr); },
    .hybrid_backward =
        [](const float* x, const HybridMatrix& gate, const FfnWeights& weights, const float* dy, double l1_coeff,
           const test::GradOutputs& grads) {
          run_from_hybrid(x, gate, weights, l1_coeff, nullptr, nullptr, nullptr, dy, &grads);
        },
});

// ---- Whole-op tests ----

struct TrainCase {
  int64_t rows;
  int32_t d_model;
  int32_t d_hidden;
  double density;
  int32_t ell_width;  // 0 = the op's automatic choice
  double l1_coeff;
  int32_t hot_neurons = 0;
  int32_t compression = 4;
};

std::string case_name(const testing::TestParamInfo<TrainCase>& info) {
  const TrainCase& c = info.param;
  return "M" + std::to_string(c.rows) + "_D" + std::to_string(c.d_model) + "_H" + std::to_string(c.d_hidden) +
         "_d" + std::to_string(static_cast<int>(c.density * 1000)) + "permille_W" + std::to_string(c.ell_width) +
         "_hot" + std::to_string(c.hot_neurons) + "_C" + std::to_string(c.compression);
}

// Fresh N(0, 1) values rounded to bf16 (the upstream gradient).
std::vector<float> random_bf16_values(size_t count, uint64_t seed) {
  std::mt19937_64 engine(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = round_to_bf16(normal(engine));
  return values;
}

struct Reference {
  ref::HybridForward forward;
  ref::FfnGrads grads;
};

Reference reference_for(const Workload& w, const HybridMatrix& gate, const std::vector<float>& dy, double l1) {
  return {ref::hybrid_ffn_forward(w.x.data(), gate, w.weights, l1),
          ref::hybrid_ffn_backward(w.x.data(), gate, w.weights, dy.data(), l1)};
}

// y, dx (bf16 outputs) and the fp32 weight gradients against float64; bf16 operands and
// intermediates put the naive bf16 computation near 4e-3 relative L2 (docs/perf-notes.md).
void expect_matches(const Reference& ref, const std::vector<float>& y, const std::vector<float>& dx,
                    const std::vector<float>& d_gate, const std::vector<float>& d_up, const std::vector<float>& d_down,
                    const cuda::FfnTrainStats& stats, double tolerance) {
  EXPECT_TRUE(test::near_relative_l2("y", y.data(), ref.forward.y.data(), y.size(), tolerance));
  EXPECT_TRUE(test::near_relative_l2("dx", dx.data(), ref.grads.dx.data(), dx.size(), tolerance));
  EXPECT_TRUE(test::near_relative_l2("d_gate", d_gate.data(), ref.grads.d_gate.data(), d_gate.size(), tolerance));
  EXPECT_TRUE(test::near_relative_l2("d_up", d_up.data(), ref.grads.d_up.data(), d_up.size(), tolerance));
  EXPECT_TRUE(test::near_relative_l2("d_down", d_down.data(), ref.grads.d_down.data(), d_down.size(), tolerance));
  EXPECT_NEAR(stats.l1, ref.forward.l1, tolerance * std::abs(ref.forward.l1) + 1e-12);
  EXPECT_NEAR(stats.l0, ref.forward.l0, 1e-9 * (1 + ref.forward.l0));
}

// One training step of `op` on the device (from `gate` when given) into poisoned outputs; everything
// back in host floats.
struct StepResult {
  std::vector<float> y, dx, d_gate, d_up, d_down;
  cuda::FfnTrainStats stats;
};
StepResult run_step(cuda::FfnTrainOp& op, const bf16* x, int64_t m, const cuda::DeviceFfnWeights& weights,
                    const bf16* dy, const cuda::DeviceTwell* gate) {
  const int32_t d = weights.d_model, h = weights.d_hidden;
  cuda::DeviceArray<bf16> y = poisoned_bf16(m * d);
  DeviceGrads grads(m, d, h);
  if (gate)
    op.forward(x, m, weights, *gate, y.get(), nullptr);
  else
    op.forward(x, m, weights, y.get(), nullptr);
  op.backward(dy, grads.view(), nullptr);
  StepResult r;
  r.stats = op.stats(nullptr);
  r.y = cuda::download_bf16(y.get(), m * d);
  r.dx = cuda::download_bf16(grads.dx.get(), m * d);
  r.d_gate = download_floats(grads.d_gate.get(), int64_t{h} * d);
  r.d_up = download_floats(grads.d_up.get(), int64_t{h} * d);
  r.d_down = download_floats(grads.d_down.get(), int64_t{h} * d);
  return r;
}

class CudaTrainTest : public test::CudaTest<testing::TestWithParam<TrainCase>> {
 protected:
  Workload workload() const {
    const TrainCase& c = GetParam();
    return make_workload({.rows = c.rows, .d_model = c.d_model, .d_hidden = c.d_hidden, .density = c.density,
                          .hot_neurons = c.hot_neurons, .seed = static_cast<uint64_t>(c.rows * 31 + c.d_hidden)});
  }

  static StepResult step(cuda::FfnTrainOp& op, const Workload& w, const std::vector<float>& dy,
                         const cuda::DeviceTwell* gate) {
    const cuda::DeviceFfnWeights weights = test::upload_weights_any_width(w.weights);
    const cuda::DeviceArray<bf16> x = cuda::upload_bf16(w.x.data(), w.x.size());
    const cuda::DeviceArray<bf16> dy_device = cuda::upload_bf16(dy.data(), dy.size());
    return run_step(op, x.get(), w.spec.rows, weights, dy_device.get(), gate);
  }
};

constexpr double kTolerance = 1e-2;        // sparse path: fp32 h, bf16 outputs
constexpr double kDenseTolerance = 2e-2;   // dense path: every [M, H] intermediate is bf16

TEST_P(CudaTrainTest, TwellToHybridIsExact) {
  const TrainCase& c = GetParam();
  const Workload w = workload();
  const TwellMatrix gate = ref::gate_to_twell(w.x.data(), c.rows, w.weights, 128, c.compression);
  const int32_t width = c.ell_width > 0 ? c.ell_width : 16;
  const HybridMatrix expected = hybrid_from_twell(gate, width);
  const HybridMatrix got = device_twell_to_hybrid(gate, width, 1);
  EXPECT_EQ(got.backup_used, expected.backup_used);
  EXPECT_EQ(got.row_nnz, expected.row_nnz);
  EXPECT_EQ(got.backup_slot, expected.backup_slot);
  EXPECT_EQ(got.backup_rows, expected.backup_rows);
  EXPECT_EQ(got.ell_cols, expected.ell_cols);
  ASSERT_EQ(got.ell_values.size(), expected.ell_values.size());
  for (size_t i = 0; i < got.ell_values.size(); ++i)
    ASSERT_EQ(got.ell_values[i].bits, expected.ell_values[i].bits) << "ELL value " << i;
  ASSERT_EQ(got.backup.size(), expected.backup.size());
  for (size_t i = 0; i < got.backup.size(); ++i)
    ASSERT_EQ(got.backup[i].bits, expected.backup[i].bits) << "backup value " << i;
}

TEST_P(CudaTrainTest, SparsePathMatchesReference) {
  const TrainCase& c = GetParam();
  const Workload w = workload();
  const TwellMatrix gate = ref::gate_to_twell(w.x.data(), c.rows, w.weights, 128, c.compression);
  const std::vector<float> dy = random_bf16_values(w.x.size(), 7 + c.rows);
  cuda::DeviceTwell packed;
  cuda::upload(gate, packed);
  cuda::FfnTrainOp op({.l1_coeff = c.l1_coeff, .path = cuda::TrainPath::sparse, .ell_width = c.ell_width});
  const StepResult r = step(op, w, dy, &packed);
  ASSERT_EQ(r.stats.path, cuda::TrainPath::sparse);
  const HybridMatrix hybrid = hybrid_from_twell(gate, r.stats.ell_width);
  EXPECT_EQ(r.stats.backup_rows, hybrid.backup_used);
  expect_matches(reference_for(w, hybrid, dy, c.l1_coeff), r.y, r.dx, r.d_gate, r.d_up, r.d_down, r.stats,
                 kTolerance);
}

TEST_P(CudaTrainTest, DensePathMatchesReference) {
  const TrainCase& c = GetParam();
  const Workload w = workload();
  const TwellMatrix gate = ref::gate_to_twell(w.x.data(), c.rows, w.weights, 128, c.compression);
  const std::vector<float> dy = random_bf16_values(w.x.size(), 11 + c.rows);
  cuda::FfnTrainOp op({.l1_coeff = c.l1_coeff, .path = cuda::TrainPath::dense});
  const StepResult r = step(op, w, dy, nullptr);
  ASSERT_EQ(r.stats.path, cuda::TrainPath::dense);
  expect_matches(reference_for(w, hybrid_from_twell(gate, 1), dy, c.l1_coeff), r.y, r.dx, r.d_gate, r.d_up,
                 r.d_down, r.stats, kDenseTolerance);
}

// The split step: the first 40% of the neurons (rounded to whole TwELL tiles of 128; at H = 128 that
// is none, and the step runs sparse) dense, the rest sparse, both adding
// into y and dx; each weight-gradient row written by its own part. The dense part beside the sparse
// one on the side stream, and both on one stream.
TEST_P(CudaTrainTest, SplitPathMatchesReference) {
  const TrainCase& c = GetParam();
  if (c.d_model % 64 != 0) GTEST_SKIP() << "the split packs its gate with the gate kernel: D a multiple of 64";
  const Workload w = workload();
  const TwellMatrix gate = ref::gate_to_twell(w.x.data(), c.rows, w.weights, 128, c.compression);
  const std::vector<float> dy = random_bf16_values(w.x.size(), 13 + c.rows);
  const Reference expected = reference_for(w, hybrid_from_twell(gate, 1), dy, c.l1_coeff);
  for (const bool side_stream : {true, false}) {
    SCOPED_TRACE(testing::Message() << "side stream " << side_stream);
    cuda::FfnTrainOp op({.l1_coeff = c.l1_coeff, .path = cuda::TrainPath::sparse, .ell_width = c.ell_width,
                         .hot_fraction = 0.4, .split_side_stream = side_stream});
    const StepResult r = step(op, w, dy, nullptr);
    ASSERT_EQ(r.stats.path, cuda::TrainPath::sparse);
    EXPECT_EQ(r.stats.hot_neurons, cuda::split_hot_neurons(0.4, c.d_hidden, 128));
    expect_matches(expected, r.y, r.dx, r.d_gate, r.d_up, r.d_down, r.stats, kDenseTolerance);
  }
}

// Corners: one row; nothing active; everything active (every row far over W, every tile spilled);
// half active with W = 8 (most rows in a backup far larger than its first capacity); skew; the
// automatic width; odd H; D not a multiple of 64; hot neurons whose lists span several chunks of
// the weight-gradient kernel (1000 entries in chunks of 256).
INSTANTIATE_TEST_SUITE_P(Cases, CudaTrainTest,
                         testing::Values(TrainCase{1, 64, 128, 0.02, 16, 0.01},
                                         TrainCase{3, 64, 1000, 0.0, 1, 0.3},
                                         TrainCase{17, 64, 1500, 1.0, 128, 0.01, 0, 8},
                                         TrainCase{300, 96, 1000, 0.5, 8, 0.3, 0, 2},
                                         TrainCase{300, 512, 1000, 0.005, 32, 0.01, 3},
                                         TrainCase{257, 200, 4097, 0.02, 0, 0.0},
                                         TrainCase{128, 2048, 5632, 0.005, 0, 0.01},
                                         TrainCase{64, 1024, 2048, 0.1, 24, 0.3, 5},
                                         TrainCase{1000, 128, 512, 0.02, 64, 0.01, 4}),
                         case_name);

// One problem for the whole op (M = 200, D = 256, H = 1024, L1 0.01) on the device, with its
// float64 reference on the reference's own gate pattern: the kernel's fp32 gate can differ from it
// only where the gate is within rounding of 0, which moves the results negligibly.
struct OpProblem {
  static constexpr int64_t m = 200;
  static constexpr int32_t d = 256, h = 1024;
  Workload w;
  std::vector<float> dy;
  cuda::DeviceFfnWeights weights;
  cuda::DeviceArray<bf16> x, dy_device;
  TwellMatrix gate;
  Reference ref;

  OpProblem(double density, uint64_t seed, uint64_t dy_seed)
      : w(make_workload({.rows = m, .d_model = d, .d_hidden = h, .density = density, .seed = seed})),
        dy(random_bf16_values(w.x.size(), dy_seed)),
        weights(cuda::upload_weights(w.weights)),
        x(cuda::upload_bf16(w.x.data(), w.x.size())),
        dy_device(cuda::upload_bf16(dy.data(), dy.size())),
        gate(ref::gate_to_twell(w.x.data(), m, w.weights, 128, 4)),
        ref(reference_for(w, hybrid_from_twell(gate, 1), dy, 0.01)) {}

  // One step of `op` (from `packed` when given), checked against the reference; its statistics.
  cuda::FfnTrainStats step(cuda::FfnTrainOp& op, double tolerance, const cuda::DeviceTwell* packed = nullptr) const {
    const StepResult r = run_step(op, x.get(), m, weights, dy_device.get(), packed);
    expect_matches(ref, r.y, r.dx, r.d_gate, r.d_up, r.d_down, r.stats, tolerance);
    return r.stats;
  }
};

// The op as a trainer calls it: gate packed by the CUDA gate kernel, automatic dispatch by the
// threshold rule, several steps (the dispatch and the ELL width follow the measured density).
TEST(CudaTrainOp, GateKernelAndAutomaticDispatch) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  for (double density : {0.005, 0.3}) {
    const OpProblem problem(density, 5, 3);
    cuda::FfnTrainOp op({.l1_coeff = 0.01, .expected_density = 0.01, .dense_above_density = 0.1, .hot_fractions = {}});
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE(testing::Message() << "density " << density << ", step " << step);
      const cuda::FfnTrainStats stats = problem.step(op, kDenseTolerance);
      // The first step trusts expected_density (sparse); later ones the measured density.
      const bool dense_expected = step > 0 && density > 0.1;
      EXPECT_EQ(stats.path, dense_expected ? cuda::TrainPath::dense : cuda::TrainPath::sparse);
    }
  }
}

// The timed choice's bookkeeping (no GPU): each candidate's untimed then timed calls in turn, the
// least median chosen once every available candidate's times are in, a lost call run again,
// unavailable candidates never run, buckets apart.
TEST(TrialBook, RunsEachCandidateThenKeepsTheLeastMedian) {
  using Turn = std::pair<int, bool>;
  cuda::TrialBook book(3);
  const std::vector<bool> all(3, true);
  const auto next = [&](int64_t bucket, const std::vector<bool>& available) {
    const cuda::TrialBook::Turn turn = book.next(bucket, available);
    return Turn{turn.candidate, turn.timed};
  };
  std::vector<Turn> turns;
  for (int i = 0; i < 12; ++i) turns.push_back(next(7, all));
  const std::vector<Turn> expected = {{0, false}, {0, true}, {0, true}, {0, true}, {1, false}, {1, true},
                                      {1, true},  {1, true}, {2, false}, {2, true}, {2, true}, {2, true}};
  EXPECT_EQ(turns, expected);
  EXPECT_EQ(next(7, all), (Turn{0, false}));  // no time yet: the first available, untimed
  for (float ms : {5.f, 6.f, 7.f}) book.add_time(7, 0, ms);
  for (float ms : {3.f, 9.f, 4.f}) book.add_time(7, 1, ms);  // median 4: the least
  EXPECT_EQ(next(7, all), (Turn{1, false}));  // best so far, candidate 2 still out
  EXPECT_FALSE(book.settled(7));
  for (float ms : {4.5f, 4.5f, 4.5f}) book.add_time(7, 2, ms);
  EXPECT_EQ(next(7, all), (Turn{1, false}));
  EXPECT_TRUE(book.settled(7));
  EXPECT_EQ(next(7, {true, false, true}), (Turn{2, false}));  // the choice unavailable: the next best
  EXPECT_FALSE(book.settled(8));

  // Another bucket: candidate 1 unavailable throughout, a timed call of candidate 0 lost.
  const std::vector<bool> no_one = {true, false, true};
  EXPECT_EQ(next(8, no_one), (Turn{0, false}));
  EXPECT_EQ(next(8, no_one), (Turn{0, true}));
  book.forget_call(8, 0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(next(8, no_one), (Turn{0, true}));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(next(8, no_one).first, 2);
  for (float ms : {2.f, 2.f, 2.f}) book.add_time(8, 0, ms);
  for (float ms : {1.f, 1.f, 1.f}) book.add_time(8, 2, ms);
  EXPECT_EQ(next(8, no_one), (Turn{2, false}));
  EXPECT_TRUE(book.settled(8));

  EXPECT_THROW(book.next(9, {true}), Error);  // one availability for three candidates
  EXPECT_THROW(book.next(9, {false, false, false}), Error);
  EXPECT_THROW(cuda::TrialBook(0), Error);
}

// Split candidates (both ops): whole tiles, never all or none of the neurons.
TEST(SplitHotNeurons, WholeTilesAndNeuronsOnBothSides) {
  EXPECT_EQ(cuda::split_hot_neurons(0.125, 5632, 128), 768);  // 5.5 tiles: rounded up
  EXPECT_EQ(cuda::split_hot_neurons(0.45, 5632, 128), 2560);
  EXPECT_EQ(cuda::split_hot_neurons(0.25, 1000, 256), 256);
  EXPECT_EQ(cuda::split_hot_neurons(0.4, 128, 128), 0);   // rounds to no neuron
  EXPECT_EQ(cuda::split_hot_neurons(0.99, 1024, 128), 0);  // rounds to every neuron
}

// The timed dispatch (default options): each candidate (dense, sparse, the four splits) runs its
// steps, every step exact whatever it took; then the op settles on one and stays there.
TEST(CudaTrainOp, TimedDispatchTriesEveryCandidateThenSettles) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  const OpProblem problem(0.02, 7, 9);
  cuda::FfnTrainOp op({.l1_coeff = 0.01});
  ASSERT_EQ(cuda::FfnTrainOptions{}.hot_fractions.size(), 4u);
  std::set<std::pair<cuda::TrainPath, int32_t>> seen;
  std::optional<std::pair<cuda::TrainPath, int32_t>> settled_on;
  int settled_step = 0, step = 0;
  for (; step < 40; ++step) {
    SCOPED_TRACE(testing::Message() << "step " << step);
    const cuda::FfnTrainStats stats = problem.step(op, kDenseTolerance);
    const std::pair<cuda::TrainPath, int32_t> taken{stats.path, stats.hot_neurons};
    seen.insert(taken);
    if (settled_on) EXPECT_EQ(taken, *settled_on);
    if (!settled_on && op.dispatch_settled()) {
      settled_on = taken;
      settled_step = step;
    }
    if (settled_on && step >= settled_step + 3) break;
  }
  ASSERT_TRUE(settled_on.has_value()) << "no choice after " << step << " steps";
  // round(f·1024 / 128)·128 (whole TwELL tiles) for f = 0.11, 0.25, 0.35, 0.45
  const std::set<std::pair<cuda::TrainPath, int32_t>> candidates = {
      {cuda::TrainPath::dense, 0},   {cuda::TrainPath::sparse, 0},   {cuda::TrainPath::sparse, 128},
      {cuda::TrainPath::sparse, 256}, {cuda::TrainPath::sparse, 384}, {cuda::TrainPath::sparse, 512}};
  EXPECT_EQ(seen, candidates);
  // It holds what its choice needs, not what the candidates it tried left behind.
  cuda::FfnTrainOp fixed({.l1_coeff = 0.01, .path = settled_on->first,
                          .hot_fraction = settled_on->second / static_cast<double>(OpProblem::h)});
  ASSERT_EQ(problem.step(fixed, kDenseTolerance).hot_neurons, settled_on->second);
  EXPECT_LE(op.held_bytes(), fixed.held_bytes() * 11 / 10);
}

// A forward from a given gate packing after automatic steps that split: the given gate covers
// every neuron, so nothing of the split (its hot part, its gradient-row offset) may carry over.
TEST(CudaTrainOp, GivenGateAfterASplitStep) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  const OpProblem problem(0.005, 11, 13);
  cuda::DeviceTwell packed;
  cuda::upload(problem.gate, packed);
  cuda::FfnTrainOp op({.l1_coeff = 0.01});
  int32_t hot = 0;
  for (int step = 0; step < 30 && hot == 0; ++step) hot = problem.step(op, kDenseTolerance).hot_neurons;
  ASSERT_GT(hot, 0) << "the timed dispatch never tried a split";
  const cuda::FfnTrainStats stats = problem.step(op, kTolerance, &packed);
  EXPECT_EQ(stats.path, cuda::TrainPath::sparse);
  EXPECT_EQ(stats.hot_neurons, 0);
}

TEST(CudaTrainOp, RefusesBadInput) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  const Workload w = make_workload({.rows = 4, .d_model = 64, .d_hidden = 128, .density = 0.1, .gated = false});
  const cuda::DeviceFfnWeights weights = test::upload_weights_any_width(w.weights);
  const cuda::DeviceArray<bf16> x = cuda::upload_bf16(w.x.data(), w.x.size());
  cuda::DeviceArray<bf16> y = poisoned_bf16(w.x.size());
  cuda::FfnTrainOp op;
  EXPECT_THROW(op.forward(x.get(), 4, weights, y.get(), nullptr), Error);  // non-gated weights
  DeviceGrads grads(4, 64, 128);
  EXPECT_THROW(op.backward(x.get(), grads.view(), nullptr), Error);  // no forward yet
  EXPECT_THROW(cuda::FfnTrainOp({.l1_coeff = -1}), Error);
  EXPECT_THROW(cuda::FfnTrainOp({.hot_fraction = 1.0}), Error);
  EXPECT_THROW(cuda::FfnTrainOp({.hot_fractions = {0.2, 1.0}}), Error);
  EXPECT_THROW(cuda::FfnTrainOp({.hot_fraction = 0.5}), Error);  // automatic: fixed split and timed splits both
  cuda::FfnTrainOp split({.path = cuda::TrainPath::sparse, .hot_fraction = 0.5});
  const Workload gated = make_workload({.rows = 4, .d_model = 64, .d_hidden = 128, .density = 0.1});
  const cuda::DeviceFfnWeights gated_weights = test::upload_weights_any_width(gated.weights);
  cuda::DeviceTwell packed;
  cuda::upload(ref::gate_to_twell(gated.x.data(), 4, gated.weights, 128, 4), packed);
  EXPECT_THROW(split.forward(x.get(), 4, gated_weights, packed, y.get(), nullptr), Error);  // packing of every neuron
}

}  // namespace
