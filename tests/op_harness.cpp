#include "op_harness.h"

#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <fmt/format.h>

#include "twell/bench_record.h"
#include "twell/error.h"

namespace twell::test {
namespace {

std::vector<FfnBackend>& backend_registry() {
  static std::vector<FfnBackend> backends;  // function-local: filled during static initialisation
  return backends;
}

bool is_test_name_safe(const std::string& name) {
  if (name.empty()) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

// "0.005" -> "0p005": the density as a fraction, readable and gtest-safe.
std::string decimal_name(double value) {
  std::string text = fmt::format("{:g}", value);
  for (char& c : text)
    if (c == '.') c = 'p';
  return text;
}

// Cost of the float64 reference and of generating the workload, to keep the sweep fast.
constexpr double kMaxRowHiddenModel = 6.0e7;  // M·H·D
constexpr double kMaxHiddenModel = 4.5e6;     // H·D (three weight matrices of normals)

bool affordable(const OpCase& c) {
  const double hd = static_cast<double>(c.d_hidden) * c.d_model;
  return hd <= kMaxHiddenModel && hd * static_cast<double>(c.rows) <= kMaxRowHiddenModel;
}

// A seeded sample from the sweep grid. std::mt19937_64 is the same everywhere; distributions are
// not, so values are picked with a plain modulo.
class GridSampler {
 public:
  explicit GridSampler(uint64_t seed) : engine_(seed) {}
  template <typename T>
  T pick(const std::vector<T>& values) {
    return values[engine_() % values.size()];
  }

 private:
  std::mt19937_64 engine_;
};

const std::vector<int64_t> kRows = {1, 3, 17, 300};
const std::vector<int32_t> kModel = {64, 96, 200, 512, 1024, 2048, 4096};
// None of 1000, 4097, 5632 + 64 is a multiple of 256; 1000 and 4097 are not of 128 either.
const std::vector<int32_t> kHidden = {128, 1000, 1500, 4097, 5632};
const std::vector<double> kDensity = {0.0, 0.005, 0.02, 0.1, 0.5, 1.0};
const std::vector<int32_t> kTiles = {128, 256};
const std::vector<int32_t> kCompressions = {2, 4, 8};

std::vector<OpCase> sample_cases(uint64_t seed, int count, const OpCase& base, bool vary_gated) {
  GridSampler sampler(seed);
  std::vector<OpCase> cases;
  while (static_cast<int>(cases.size()) < count) {
    OpCase c = base;
    c.rows = sampler.pick(kRows);
    c.d_model = sampler.pick(kModel);
    c.d_hidden = sampler.pick(kHidden);
    c.density = sampler.pick(kDensity);
    c.hot_neurons = sampler.pick(std::vector<int32_t>{0, 0, 0, 5});
    if (vary_gated) c.gated = sampler.pick(std::vector<bool>{true, false});
    c.tile = sampler.pick(kTiles);
    c.compression = sampler.pick(kCompressions);
    c.seed = 100 + cases.size();
    if (affordable(c)) cases.push_back(c);
  }
  return cases;
}

}  // namespace

bool register_backend(FfnBackend backend) {
  TWELL_REQUIRE(is_test_name_safe(backend.name),
                "backend name must be non-empty letters, digits and '_' (it names tests), got '{}'", backend.name);
  for (const FfnBackend& existing : backend_registry())
    TWELL_REQUIRE(existing.name != backend.name, "backend '{}' is registered twice", backend.name);
  backend_registry().push_back(std::move(backend));
  return true;
}

const std::vector<FfnBackend>& registered_backends() { return backend_registry(); }

const FfnBackend& find_backend(const std::string& name) {
  for (const FfnBackend& backend : backend_registry())
    if (backend.name == name) return backend;
  fail("no backend named '{}' is registered", name);
}

WorkloadSpec OpCase::workload_spec() const {
  WorkloadSpec spec;
  spec.rows = rows;
  spec.d_model = d_model;
  spec.d_hidden = d_hidden;
  spec.density = density;
  spec.gated = gated;
  spec.hot_neurons = hot_neurons;
  spec.seed = seed;
  return spec;
}

std::string OpCase::name() const {
  return fmt::format("M{}_D{}_H{}_d{}_hot{}_{}_T{}_C{}_W{}_l1{}_s{}", rows, d_model, d_hidden, decimal_name(density),
                     hot_neurons, gated ? "gated" : "plain", tile, compression, ell_width, decimal_name(l1_coeff),
                     seed);
}

std::vector<OpCase> twell_cases() {
  std::vector<OpCase> cases = {
      // Corners: one exact tile; nothing active; everything active (every tile spills); half
      // active with few slots (about half the tiles spill); the largest H a uint16 column allows;
      // skew; the decode shape of the standard workload.
      {.rows = 1, .d_model = 64, .d_hidden = 128, .density = 0.02, .tile = 128, .compression = 4, .seed = 1},
      {.rows = 3, .d_model = 64, .d_hidden = 1000, .density = 0.0, .tile = 128, .compression = 4, .seed = 2},
      {.rows = 17, .d_model = 256, .d_hidden = 4097, .density = 1.0, .tile = 256, .compression = 8, .seed = 3},
      {.rows = 300, .d_model = 64, .d_hidden = 1000, .density = 0.5, .tile = 128, .compression = 2, .seed = 4},
      {.rows = 3, .d_model = 64, .d_hidden = 65536, .density = 0.1, .tile = 256, .compression = 8, .seed = 5},
      {.rows = 17, .d_model = 512, .d_hidden = 5632, .density = 0.005, .hot_neurons = 8, .tile = 128,
       .compression = 8, .seed = 6},
      {.rows = 1, .d_model = 2048, .d_hidden = 5632, .density = 0.005, .tile = 128, .compression = 4, .seed = 7},
      {.rows = 300, .d_model = 96, .d_hidden = 1000, .density = 0.02, .gated = false, .tile = 256,
       .compression = 4, .seed = 8},
      {.rows = 3, .d_model = 4096, .d_hidden = 1000, .density = 0.1, .tile = 256, .compression = 4, .seed = 9},
  };
  for (const OpCase& c : sample_cases(0x7e11, 24, OpCase{}, /*vary_gated=*/true)) cases.push_back(c);
  return cases;
}

std::vector<OpCase> dense_cases() {
  std::vector<OpCase> cases = {
      {.rows = 1, .d_model = 4096, .d_hidden = 1000, .density = 0.02, .seed = 1},
      {.rows = 300, .d_model = 64, .d_hidden = 1000, .density = 0.5, .gated = false, .seed = 2},
      {.rows = 3, .d_model = 2048, .d_hidden = 2000, .density = 0.0, .seed = 3},
  };
  for (const OpCase& c : sample_cases(0xde25e, 12, OpCase{}, /*vary_gated=*/true)) cases.push_back(c);
  return cases;
}

std::vector<OpCase> hybrid_cases() {
  // Training shapes: W from 1 (almost every active row goes to the backup) to 128.
  std::vector<OpCase> cases;
  const std::vector<int32_t> widths = {1, 8, 32, 128};
  GridSampler sampler(0x4b1d);
  while (cases.size() < 16) {
    OpCase c;
    c.rows = sampler.pick(kRows);
    c.d_model = sampler.pick(std::vector<int32_t>{64, 96, 200, 512});
    c.d_hidden = sampler.pick(std::vector<int32_t>{128, 1000, 1500});
    c.density = sampler.pick(kDensity);
    c.hot_neurons = sampler.pick(std::vector<int32_t>{0, 0, 3});
    c.tile = sampler.pick(kTiles);
    c.compression = sampler.pick(kCompressions);
    c.ell_width = sampler.pick(widths);
    c.l1_coeff = sampler.pick(std::vector<double>{0.0, 0.01, 0.3});
    c.seed = 200 + cases.size();
    if (c.rows * static_cast<double>(c.d_hidden) * c.d_model <= 2.0e7) cases.push_back(c);
  }
  return cases;
}

std::string cannot_run_reason(const FfnBackend& backend) { return backend.skip_reason ? backend.skip_reason() : ""; }

void poison(std::vector<float>& buffer, size_t count) {
  buffer.assign(count, std::numeric_limits<float>::quiet_NaN());
}

void poison(TwellMatrix& out, const TwellShape& shape, int64_t spill_rows) {
  out.shape = TwellShape{.rows = -7, .cols = -7, .tile = -7, .compression = -7};
  out.slots.assign(static_cast<size_t>(shape.slot_count()), 0xdeadbeefu);
  out.tile_nnz.assign(static_cast<size_t>(shape.tile_count()), 0x7eadbeef);
  out.spill.assign(static_cast<size_t>(spill_rows * shape.tile), bf16{0x7fc1});  // NaN
  out.spill_used = 0x7eadbeef;
}

void poison(HybridMatrix& out, const HybridShape& shape, int64_t backup_rows) {
  out.shape = HybridShape{.rows = -7, .cols = -7, .ell_width = -7};
  out.ell_values.assign(static_cast<size_t>(shape.ell_count()), bf16{0x7fc1});
  out.ell_cols.assign(static_cast<size_t>(shape.ell_count()), 0x7eadbeef);
  out.row_nnz.assign(static_cast<size_t>(shape.rows), 0x7eadbeef);
  out.backup_slot.assign(static_cast<size_t>(shape.rows), 0x7eadbeef);
  out.backup.assign(static_cast<size_t>(backup_rows * shape.cols), bf16{0x7fc1});
  out.backup_rows.assign(static_cast<size_t>(backup_rows), 0x7eadbeef);
  out.backup_used = 0x7eadbeef;
}

testing::AssertionResult near_relative_l2(const std::string& what, const float* got, const double* ref,
                                          size_t count, double tolerance) {
  for (size_t i = 0; i < count; ++i)
    if (!std::isfinite(got[i]))
      return testing::AssertionFailure() << what << "[" << i << "] = " << got[i]
                                         << " (unwritten or non-finite; reference " << ref[i] << ")";
  const double error = relative_l2_error(got, ref, count);
  testing::Test::RecordProperty(what + "_rel_err", fmt::format("{:.3g}", error));  // margins, in --gtest_output
  testing::Test::RecordProperty(what + "_tolerance", fmt::format("{:.3g}", tolerance));
  if (error <= tolerance) return testing::AssertionSuccess();
  size_t worst = 0;
  for (size_t i = 1; i < count; ++i)
    if (std::abs(got[i] - ref[i]) > std::abs(got[worst] - ref[worst])) worst = i;
  return testing::AssertionFailure() << what << ": relative L2 error " << error << " > tolerance " << tolerance
                                     << "; worst element [" << worst << "] = " << got[worst] << ", reference "
                                     << ref[worst];
}

}  // namespace twell::test
