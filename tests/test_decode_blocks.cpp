// The CPU predictors score a block of up to kDecodeMaxRows tokens in one pass over each neuron's
// bit words (src/cpu/decode_kernels.h). A token's score must not depend on the block it is scored
// in: every ISA, every predictor kind, bit for bit against scoring the token alone. Also the packed
// size of the sign-bits format (docs/formats.md).
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "twell/convert.h"
#include "twell/cpu.h"
#include "twell/decode.h"
#include "twell/error.h"

namespace twell {
namespace {

TEST(DecodeSignBitsSize, PackedSizeIsTheFormats) {
  for (auto [rows, cols] : {std::pair{1, 1}, std::pair{3, 31}, std::pair{2, 32}, std::pair{5, 33}, std::pair{7, 2048},
                            std::pair{4, 4099}}) {
    std::mt19937 rng(rows * 7919 + cols);
    std::normal_distribution<float> normal;
    std::vector<float> matrix(static_cast<size_t>(rows) * cols);
    for (float& v : matrix) v = normal(rng);
    const SignBits packed = pack_sign_bits(matrix.data(), rows, cols);
    const size_t plane_words = static_cast<size_t>(rows) * ((cols + 31) / 32);
    EXPECT_EQ(packed.bits.size(), plane_words);
    EXPECT_EQ(packed.large.size(), plane_words);
    EXPECT_EQ(packed.bytes(), static_cast<int64_t>(plane_words) * 2 * 4 + static_cast<int64_t>(rows) * 5 * 4)
        << "R " << rows << " K " << cols;
    EXPECT_EQ(packed.bytes(), sign_bits_bytes(rows, cols));
  }
}

class PredictorBlocksTest : public testing::TestWithParam<cpu::Isa> {
 protected:
  void SetUp() override {
    try {
      previous_ = cpu::active_isa();
      cpu::set_isa(GetParam());
    } catch (const Error& error) {
      GTEST_SKIP() << error.what();
    }
  }
  void TearDown() override { cpu::set_isa(previous_); }
  cpu::Isa previous_ = cpu::Isa::scalar;
};

// Bitwise equality of floats (NaN never appears: the inputs are finite and the residuals non-zero).
template <typename Value>
void expect_same_bits(const std::vector<Value>& block, const std::vector<Value>& alone, const char* name) {
  ASSERT_EQ(block.size(), alone.size());
  for (size_t i = 0; i < block.size(); ++i)
    ASSERT_EQ(std::memcmp(&block[i], &alone[i], sizeof(Value)), 0)
        << name << " index " << i << ": " << block[i] << " in the block, " << alone[i] << " alone";
}

TEST_P(PredictorBlocksTest, BlockScoresEqualOneTokenScores) {
  // M across the row-group sizes of every ISA (4, 2, 1) and past one block (17, 40 > kDecodeMaxRows).
  for (auto [rows, cols, hidden] : {std::tuple{2, 64, 19}, std::tuple{3, 33, 17}, std::tuple{5, 1000, 23},
                                    std::tuple{7, 97, 31}, std::tuple{16, 2048, 29}, std::tuple{17, 130, 11},
                                    std::tuple{40, 257, 13}}) {
    SCOPED_TRACE(testing::Message() << "M " << rows << " D " << cols << " H " << hidden);
    std::mt19937 rng(rows * 131 + cols + hidden);
    std::normal_distribution<float> normal;
    std::vector<float> x(static_cast<size_t>(rows) * cols), weights(static_cast<size_t>(hidden) * cols);
    for (float& v : x) v = normal(rng);
    for (float& v : weights) v = normal(rng);
    for (size_t i = 3; i < x.size(); i += 11) x[i] = (i % 2) ? -0.0f : 0.0f;
    const SignBits signs = pack_sign_bits(weights.data(), hidden, cols);
    const size_t pairs = static_cast<size_t>(rows) * hidden;

    std::vector<int32_t> counts(pairs, -7), counts_alone(pairs, -7);
    cpu::negative_sign_products(x.data(), rows, signs, counts.data());
    for (int m = 0; m < rows; ++m)
      cpu::negative_sign_products(x.data() + static_cast<size_t>(m) * cols, 1, signs,
                                  counts_alone.data() + static_cast<size_t>(m) * hidden);
    EXPECT_EQ(counts, counts_alone);

    using Scores = void (*)(const float*, int64_t, const SignBits&, float*);
    for (auto [name, scores_of] : {std::pair<const char*, Scores>{"one-bit", cpu::one_bit_gate},
                                   std::pair<const char*, Scores>{"one-bit-norm", cpu::normalized_one_bit_gate},
                                   std::pair<const char*, Scores>{"two-bit-norm", cpu::two_bit_gate}}) {
      std::vector<float> block(pairs, std::numeric_limits<float>::quiet_NaN()), alone = block;
      scores_of(x.data(), rows, signs, block.data());
      for (int m = 0; m < rows; ++m)
        scores_of(x.data() + static_cast<size_t>(m) * cols, 1, signs, alone.data() + static_cast<size_t>(m) * hidden);
      expect_same_bits(block, alone, name);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, PredictorBlocksTest, testing::Values(cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512),
                         [](const testing::TestParamInfo<cpu::Isa>& info) { return cpu::to_string(info.param); });

}  // namespace
}  // namespace twell
