// The three sparse formats: hand-checked layouts, bit-exact round trips on random data (overflowing
// tiles and rows, partial last tiles), validators that reject every kind of corruption, and bad
// parameters that throw with a message naming the argument.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "twell/convert.h"
#include "twell/error.h"

namespace twell {
namespace {

constexpr uint16_t kNegativeZero = 0x8000;

// Throws twell::Error whose message contains `fragment`.
template <typename Call>
void expect_error(Call&& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "expected a twell::Error mentioning '" << fragment << "', nothing was thrown";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
        << "message '" << error.what() << "' does not mention '" << fragment << "'";
  }
}

// Random bf16 [rows, cols]: each element non-zero with probability `density` (either sign, a wide
// range of magnitudes); the zeros are +0.0 or -0.0 at random.
std::vector<bf16> random_sparse(int64_t rows, int32_t cols, double density, uint64_t seed) {
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<bf16> dense(static_cast<size_t>(rows) * cols);
  for (bf16& value : dense) {
    if (uniform(engine) < density) {
      const uint16_t sign = (engine() & 1) ? 0x8000 : 0;
      const uint16_t exponent = static_cast<uint16_t>(100 + engine() % 50) << 7;  // 2^-27 .. 2^22
      value = bf16{static_cast<uint16_t>(sign | exponent | (engine() & 0x7f))};
    } else {
      value = bf16{(engine() & 1) ? kNegativeZero : uint16_t{0}};
    }
  }
  return dense;
}

// What a round trip must give back: the same bits, with -0.0 as +0.0.
std::vector<uint16_t> canonical_bits(const std::vector<bf16>& dense) {
  std::vector<uint16_t> bits(dense.size());
  for (size_t i = 0; i < dense.size(); ++i) bits[i] = dense[i].bits == kNegativeZero ? 0 : dense[i].bits;
  return bits;
}

std::vector<uint16_t> raw_bits(const std::vector<bf16>& dense) {
  std::vector<uint16_t> bits(dense.size());
  for (size_t i = 0; i < dense.size(); ++i) bits[i] = dense[i].bits;
  return bits;
}

bf16 value(float v) { return to_bf16(v); }

// ---- TwELL ----

TEST(TwellFormat, HandPackedLayout) {
  // M = 2, H = 130: a full tile and a partial one of 2 columns; T = 128, C = 8 -> S = 16 slots.
  const int32_t cols = 130;
  std::vector<bf16> dense(2 * cols, bf16{0});
  dense[5] = value(1.5f);
  dense[3] = value(-2.0f);
  dense[129] = value(0.25f);
  for (int32_t col = 0; col < 17; ++col) dense[cols + 10 + col] = value(static_cast<float>(col + 1));  // 17 > S
  dense[cols + 128] = value(3.0f);

  const TwellMatrix packed = twell_from_dense(dense.data(), 2, cols, 128, 8);
  ASSERT_EQ(packed.shape.n_tiles(), 2);
  ASSERT_EQ(packed.shape.slots(), 16);
  // Row 0, tile 0: columns 3 and 5, ascending.
  EXPECT_EQ(packed.tile_nnz[packed.shape.tile_index(0, 0)], 2);
  EXPECT_EQ(packed.slots[packed.shape.slot_index(0, 0, 0)], twell_make_slot(value(-2.0f).bits, 3));
  EXPECT_EQ(packed.slots[packed.shape.slot_index(0, 0, 1)], twell_make_slot(value(1.5f).bits, 5));
  EXPECT_EQ(packed.slots[packed.shape.slot_index(0, 0, 2)], 0u);
  // Row 0, tile 1 (partial): the global column 129.
  EXPECT_EQ(packed.tile_nnz[packed.shape.tile_index(0, 1)], 1);
  EXPECT_EQ(packed.slots[packed.shape.slot_index(0, 1, 0)], twell_make_slot(value(0.25f).bits, 129));
  // Row 1, tile 0 overflows: spill row 0 holds the whole tile, the slots stay 0.
  EXPECT_EQ(packed.tile_nnz[packed.shape.tile_index(1, 0)], -1);
  EXPECT_EQ(packed.spill_used, 1);
  EXPECT_EQ(packed.spill_capacity(), 1);
  for (int32_t s = 0; s < 16; ++s) EXPECT_EQ(packed.slots[packed.shape.slot_index(1, 0, s)], 0u);
  EXPECT_EQ(packed.spill[10].bits, value(1.0f).bits);
  EXPECT_EQ(packed.spill[26].bits, value(17.0f).bits);
  EXPECT_EQ(packed.spill[9].bits, 0);
  EXPECT_EQ(packed.tile_nnz[packed.shape.tile_index(1, 1)], 1);
  EXPECT_EQ(packed.slots[packed.shape.slot_index(1, 1, 0)], twell_make_slot(value(3.0f).bits, 128));
  EXPECT_NO_THROW(validate(packed));
}

TEST(TwellFormat, PartialLastTileSpillsWithZerosPastH) {
  // H = 130, T = 256, C = 8 -> S = 32: one partial tile of 130 columns, all non-zero, so it spills.
  const int32_t cols = 130;
  std::vector<bf16> dense(cols, value(1.0f));
  const TwellMatrix packed = twell_from_dense(dense.data(), 1, cols, 256, 8);
  ASSERT_EQ(packed.spill_used, 1);
  ASSERT_EQ(packed.spill.size(), 256u);
  for (int32_t col = 0; col < 256; ++col) EXPECT_EQ(packed.spill[col].bits, col < cols ? value(1.0f).bits : 0);
}

struct TwellRoundTrip {
  int64_t rows;
  int32_t cols;
  int32_t tile;
  int32_t compression;
  double density;
};

TEST(TwellFormat, RoundTripIsBitExactOnRandomData) {
  const std::vector<TwellRoundTrip> cases = {
      {1, 1, 128, 2, 1.0},     {3, 127, 128, 4, 0.3},  {5, 128, 128, 8, 0.1},   {7, 129, 256, 2, 0.6},
      {17, 1000, 128, 8, 0.05}, {17, 1000, 256, 4, 0.3}, {4, 4097, 128, 2, 0.5}, {2, 5632, 256, 8, 0.02},
      {3, 65536, 256, 4, 0.01}, {9, 300, 128, 4, 0.0},  {9, 300, 256, 8, 1.0},   {31, 513, 128, 8, 0.12},
  };
  uint64_t seed = 11;
  for (const TwellRoundTrip& c : cases) {
    SCOPED_TRACE(::testing::Message() << "M=" << c.rows << " H=" << c.cols << " T=" << c.tile
                                      << " C=" << c.compression << " density=" << c.density);
    const std::vector<bf16> dense = random_sparse(c.rows, c.cols, c.density, seed++);
    const TwellMatrix packed = twell_from_dense(dense.data(), c.rows, c.cols, c.tile, c.compression);
    EXPECT_NO_THROW(validate(packed));
    EXPECT_TRUE(packed.complete());
    EXPECT_EQ(raw_bits(dense_from_twell(packed)), canonical_bits(dense));

    // Exactly the tiles with more than S non-zeros spill.
    int32_t overflowing = 0;
    for (int64_t m = 0; m < c.rows; ++m)
      for (int32_t t = 0; t < packed.shape.n_tiles(); ++t) {
        int32_t nnz = 0;
        for (int32_t col = t * c.tile; col < std::min(c.cols, (t + 1) * c.tile); ++col)
          nnz += (dense[m * c.cols + col].bits & 0x7fff) != 0;
        const int32_t tile_nnz = packed.tile_nnz[packed.shape.tile_index(m, t)];
        EXPECT_EQ(twell_tile_spilled(tile_nnz), nnz > packed.shape.slots());
        if (!twell_tile_spilled(tile_nnz)) EXPECT_EQ(tile_nnz, nnz);
        overflowing += nnz > packed.shape.slots();
      }
    EXPECT_EQ(packed.spill_used, overflowing);
  }
}

// A valid packing with slots in use, a spilled tile and a partial last tile, to corrupt below.
TwellMatrix corruptible_twell() {
  std::vector<bf16> dense = random_sparse(3, 300, 0.05, 99);  // T = 128, C = 8: S = 16
  for (int32_t col = 128; col < 256; ++col) dense[300 + col] = value(1.0f);  // row 1, tile 1 spills
  TwellMatrix packed = twell_from_dense(dense.data(), 3, 300, 128, 8);
  EXPECT_EQ(packed.spill_used, 1);
  EXPECT_GE(packed.tile_nnz[packed.shape.tile_index(0, 0)], 2);
  return packed;
}

TEST(TwellFormat, ValidateRejectsCorruption) {
  const TwellMatrix good = corruptible_twell();
  ASSERT_NO_THROW(validate(good));
  const TwellShape& shape = good.shape;
  const int64_t used_slot = shape.slot_index(0, 0, 0);
  const int32_t nnz00 = good.tile_nnz[shape.tile_index(0, 0)];
  const int64_t spilled_tile = shape.tile_index(1, 1);

  auto corrupt = [&](auto&& mutate, const std::string& fragment) {
    TwellMatrix bad = good;
    mutate(bad);
    expect_error([&] { validate(bad); }, fragment);
    expect_error([&] { dense_from_twell(bad); }, fragment);
  };
  corrupt([&](TwellMatrix& m) { m.slots[shape.slot_index(0, 0, nnz00)] = twell_make_slot(0x3f80, 7); },
          "is unused");
  corrupt([&](TwellMatrix& m) { std::swap(m.slots[used_slot], m.slots[used_slot + 1]); }, "not after the previous");
  corrupt([&](TwellMatrix& m) { m.slots[used_slot] = twell_make_slot(0x3f80, 200); }, "outside its tile");
  corrupt([&](TwellMatrix& m) { m.tile_nnz[shape.tile_index(2, 0)] = 17; }, "exceeds the S = 16 slots");
  corrupt([&](TwellMatrix& m) { m.tile_nnz[spilled_tile] = twell_spilled_marker(1); }, "spill_used is 1");
  corrupt([&](TwellMatrix& m) { m.tile_nnz[spilled_tile] = INT32_MIN; }, "spill_used is 1");
  corrupt(
      [&](TwellMatrix& m) {
        m.tile_nnz[shape.tile_index(2, 2)] = twell_spilled_marker(0);
        std::fill_n(m.slots.begin() + shape.slot_index(2, 2, 0), shape.slots(), 0u);
      },
      "used by two tiles");
  corrupt([&](TwellMatrix& m) { m.slots[shape.slot_index(1, 1, 0)] = 1; }, "is unused");
  corrupt(
      [&](TwellMatrix& m) {
        m.spill.resize(m.spill.size() + 128, bf16{0});
        m.spill_used = 2;
      },
      "belongs to no tile");
  corrupt([&](TwellMatrix& m) { m.spill_used = 2; }, "incomplete");
  corrupt([&](TwellMatrix& m) { m.spill_used = -1; }, "spill_used must be >= 0");
  corrupt([&](TwellMatrix& m) { m.spill.pop_back(); }, "whole rows of T = 128");
  corrupt([&](TwellMatrix& m) { m.slots.pop_back(); }, "slots must hold M*n_tiles*S = ");
  corrupt([&](TwellMatrix& m) { m.tile_nnz.push_back(0); }, "tile_nnz must hold M*n_tiles = ");
  corrupt([&](TwellMatrix& m) { m.shape.tile = 64; }, "tile (T) must be 128 or 256, got 64");
  corrupt([&](TwellMatrix& m) { m.shape.compression = 3; }, "compression (C) must be 2, 4 or 8, got 3");
  corrupt([&](TwellMatrix& m) { m.shape.rows = 0; }, "rows (M) must be >= 1, got 0");

  // Past H: the last tile covers columns 256..299 only.
  TwellMatrix bad_spill = twell_from_dense(std::vector<bf16>(300, value(2.0f)).data(), 1, 300, 128, 8);
  ASSERT_EQ(bad_spill.spill_used, 3);
  bad_spill.spill[2 * 128 + 50] = value(1.0f);  // column 306
  expect_error([&] { validate(bad_spill); }, "past H = 300");
}

TEST(TwellFormat, BadParametersThrowNamingTheArgument) {
  const std::vector<bf16> dense(2 * 300, value(1.0f));
  expect_error([&] { twell_from_dense(dense.data(), 2, 300, 64, 4); }, "tile (T) must be 128 or 256, got 64");
  expect_error([&] { twell_from_dense(dense.data(), 2, 300, 128, 16); }, "compression (C) must be 2, 4 or 8, got 16");
  expect_error([&] { twell_from_dense(dense.data(), 0, 300, 128, 4); }, "rows (M) must be >= 1, got 0");
  expect_error([&] { twell_from_dense(dense.data(), 1, 65537, 128, 4); }, "cols (H) must lie in [1, 65536]");
  expect_error([&] { twell_from_dense(dense.data(), 1, 0, 128, 4); }, "got 0");
  expect_error([&] { twell_from_dense(nullptr, 2, 300, 128, 4); }, "dense must not be null");
}

// ---- Hybrid ----

TEST(HybridFormat, HandPackedLayout) {
  // M = 3, H = 6, W = 2: row 0 fits, row 1 overflows to backup row 0, row 2 is empty.
  std::vector<bf16> dense(3 * 6, bf16{0});
  dense[4] = value(4.0f);
  dense[1] = value(-1.0f);
  for (int32_t col : {0, 2, 5}) dense[6 + col] = value(static_cast<float>(col + 10));
  const HybridMatrix hybrid = hybrid_from_dense(dense.data(), 3, 6, 2);
  EXPECT_EQ(hybrid.row_nnz, (std::vector<int32_t>{2, 3, 0}));
  EXPECT_EQ(hybrid.backup_slot, (std::vector<int32_t>{-1, 0, -1}));
  EXPECT_EQ(hybrid.ell_cols, (std::vector<int32_t>{1, 4, 0, 0, 0, 0}));
  EXPECT_EQ(raw_bits(hybrid.ell_values),
            (std::vector<uint16_t>{value(-1.0f).bits, value(4.0f).bits, 0, 0, 0, 0}));
  EXPECT_EQ(hybrid.backup_used, 1);
  EXPECT_EQ(hybrid.backup_rows, (std::vector<int32_t>{1}));
  EXPECT_EQ(raw_bits(hybrid.backup), (std::vector<uint16_t>{value(10.0f).bits, 0, value(12.0f).bits, 0, 0,
                                                            value(15.0f).bits}));
  EXPECT_NO_THROW(validate(hybrid));
}

TEST(HybridFormat, RoundTripsAreBitExactAndTwellAgrees) {
  struct Case {
    int64_t rows;
    int32_t cols;
    int32_t ell_width;
    double density;
  };
  const std::vector<Case> cases = {{1, 1, 1, 1.0},    {5, 7, 1, 0.4},      {17, 1000, 8, 0.01}, {17, 1000, 4, 0.3},
                                   {3, 300, 300, 0.9}, {40, 129, 16, 0.1}, {9, 4097, 64, 0.0}};
  uint64_t seed = 500;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "M=" << c.rows << " H=" << c.cols << " W=" << c.ell_width
                                      << " density=" << c.density);
    const std::vector<bf16> dense = random_sparse(c.rows, c.cols, c.density, seed++);
    const HybridMatrix hybrid = hybrid_from_dense(dense.data(), c.rows, c.cols, c.ell_width);
    EXPECT_NO_THROW(validate(hybrid));
    EXPECT_EQ(raw_bits(dense_from_hybrid(hybrid)), canonical_bits(dense));
    EXPECT_EQ(static_cast<size_t>(hybrid.backup_used), hybrid.backup_rows.size()) << "the backup grows to fit";

    // Through TwELL: the same hybrid, array for array.
    const TwellMatrix packed = twell_from_dense(dense.data(), c.rows, c.cols, 128, 4);
    const HybridMatrix via_twell = hybrid_from_twell(packed, c.ell_width);
    EXPECT_EQ(raw_bits(via_twell.ell_values), raw_bits(hybrid.ell_values));
    EXPECT_EQ(via_twell.ell_cols, hybrid.ell_cols);
    EXPECT_EQ(via_twell.row_nnz, hybrid.row_nnz);
    EXPECT_EQ(via_twell.backup_slot, hybrid.backup_slot);
    EXPECT_EQ(raw_bits(via_twell.backup), raw_bits(hybrid.backup));
    EXPECT_EQ(via_twell.backup_rows, hybrid.backup_rows);
    EXPECT_EQ(via_twell.backup_used, hybrid.backup_used);
  }
}

TEST(HybridFormat, ValidateRejectsCorruption) {
  // H = 50, W = 4: row 0 holds 2 ELL entries, row 1 one, row 2 (10 non-zeros) lives in the backup, row 3 is empty.
  std::vector<bf16> dense(4 * 50, bf16{0});
  dense[5] = value(1.0f);
  dense[9] = value(-3.0f);
  dense[50 + 1] = value(2.0f);
  for (int32_t col = 0; col < 10; ++col) dense[2 * 50 + 3 * col] = value(1.0f + col);
  const HybridMatrix good = hybrid_from_dense(dense.data(), 4, 50, 4);
  ASSERT_NO_THROW(validate(good));
  ASSERT_EQ(good.backup_used, 1);
  ASSERT_EQ(good.backup_slot[2], 0);
  const int64_t ell_row = 0;
  const int32_t ell_nnz = 2;

  auto corrupt = [&](auto&& mutate, const std::string& fragment) {
    HybridMatrix bad = good;
    mutate(bad);
    expect_error([&] { validate(bad); }, fragment);
    expect_error([&] { dense_from_hybrid(bad); }, fragment);
  };
  corrupt([&](HybridMatrix& h) { h.ell_cols[ell_row * 4 + ell_nnz] = 3; }, "is unused");
  corrupt([&](HybridMatrix& h) { h.ell_values[ell_row * 4 + ell_nnz] = value(1.0f); }, "is unused");
  corrupt([&](HybridMatrix& h) { std::swap(h.ell_cols[ell_row * 4], h.ell_cols[ell_row * 4 + 1]); },
          "not after the previous");
  corrupt([&](HybridMatrix& h) { h.ell_cols[ell_row * 4] = 50; }, "outside [0, H = 50)");
  corrupt([&](HybridMatrix& h) { h.row_nnz[ell_row] = 5; }, "but no backup row");
  corrupt([&](HybridMatrix& h) { h.row_nnz[2] = 11; }, "holds 10 non-zeros");
  corrupt([&](HybridMatrix& h) { h.backup_slot[2] = 1; }, "backup_slot[2] must be -1 or in [0, backup_used = 1)");
  corrupt([&](HybridMatrix& h) { h.backup_rows[0] = 3; }, "backup_rows[0] = 3");
  corrupt([&](HybridMatrix& h) { h.backup_used = 2; }, "an incomplete backup");
  corrupt([&](HybridMatrix& h) { h.backup.pop_back(); }, "backup must hold capacity*H");
  corrupt([&](HybridMatrix& h) { h.row_nnz.pop_back(); }, "row_nnz must hold M = 4");
  corrupt([&](HybridMatrix& h) { h.shape.ell_width = 51; }, "ell_width (W) must lie in [1, H = 50], got 51");
  corrupt(
      [&](HybridMatrix& h) {  // a second backup row that no row claims
        h.backup.resize(h.backup.size() + 50, bf16{0});
        h.backup_rows.push_back(0);
        h.backup_used = 2;
      },
      "does not point back");
}

TEST(HybridFormat, BadParametersThrowNamingTheArgument) {
  const std::vector<bf16> dense(2 * 10, value(1.0f));
  expect_error([&] { hybrid_from_dense(dense.data(), 2, 10, 0); }, "ell_width (W) must lie in [1, H = 10], got 0");
  expect_error([&] { hybrid_from_dense(dense.data(), 2, 10, 11); }, "got 11");
  expect_error([&] { hybrid_from_dense(dense.data(), 0, 10, 2); }, "rows (M) must be >= 1, got 0");
  expect_error([&] { hybrid_from_dense(nullptr, 2, 10, 2); }, "dense must not be null");
}

// ---- Sign bits ----

TEST(SignBitsFormat, BitsPaddingAndScale) {
  std::mt19937_64 engine(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int32_t cols : {1, 31, 32, 33, 64, 100}) {
    SCOPED_TRACE(::testing::Message() << "K=" << cols);
    const int32_t rows = 3;
    std::vector<float> matrix(static_cast<size_t>(rows) * cols);
    for (float& v : matrix) v = normal(engine);
    matrix[0] = -0.0f;  // not negative
    if (cols > 2) matrix[1] = -std::numeric_limits<float>::infinity();
    if (cols > 3) matrix[2] = 0.0f;
    const SignBits packed = pack_sign_bits(matrix.data(), rows, cols);
    ASSERT_EQ(packed.words_per_row(), (cols + 31) / 32);
    ASSERT_EQ(packed.bits.size(), static_cast<size_t>(rows * packed.words_per_row()));
    for (int32_t r = 0; r < rows; ++r) {
      double abs_sum = 0;
      for (int32_t k = 0; k < packed.words_per_row() * 32; ++k) {
        const bool bit = (packed.bits[r * packed.words_per_row() + k / 32] >> (k % 32)) & 1u;
        const bool expected = k < cols && matrix[r * cols + k] < 0.0f;
        EXPECT_EQ(bit, expected) << "row " << r << " element " << k;
        if (k < cols) abs_sum += std::abs(matrix[r * cols + k]);
      }
      EXPECT_FLOAT_EQ(packed.scale[r], static_cast<float>(abs_sum / cols)) << "row " << r;
    }
  }
}

// The worked example of docs/formats.md, "Sign bits".
TEST(SignBitsFormat, WorkedExampleOfTheDocs) {
  std::vector<float> row(35, 1.0f);
  row[0] = -1.0f;
  row[1] = 2.0f;
  row[2] = -0.0f;
  row[3] = -0.5f;
  row[33] = -3.0f;
  const SignBits packed = pack_sign_bits(row.data(), 1, 35);
  EXPECT_EQ(packed.bits, (std::vector<uint32_t>{0x00000009u, 0x00000002u}));
  EXPECT_FLOAT_EQ(packed.scale[0], 1.0428571f);
  EXPECT_FLOAT_EQ(packed.residual[0], 0.4203983f);
  EXPECT_EQ(packed.large, (std::vector<uint32_t>{0x00000002u, 0x00000002u}));
  EXPECT_FLOAT_EQ(packed.small_scale[0], 0.9545455f);
  EXPECT_FLOAT_EQ(packed.large_scale[0], 2.5f);
  EXPECT_FLOAT_EQ(packed.two_bit_residual[0], 0.2192075f);
  EXPECT_EQ(packed.bytes(), 36);  // 2 planes x 2 words x 4 bytes + 5 floats
  EXPECT_TRUE(packed.exact_columns.empty() && packed.exact_weights.empty());

  // The same row with column 33 kept exactly.
  const SignBits exact = pack_sign_bits(row.data(), 1, 35, {33});
  EXPECT_EQ(exact.bits, packed.bits) << "the sign plane holds every column";
  EXPECT_EQ(exact.exact_columns, (std::vector<int32_t>{33}));
  EXPECT_EQ(exact.exact_weights, (std::vector<float>{-3.0f}));
  EXPECT_FLOAT_EQ(exact.scale[0], 0.9852941f);
  EXPECT_FLOAT_EQ(exact.residual[0], 0.2568272f);
  EXPECT_EQ(exact.large, (std::vector<uint32_t>{0x00000002u, 0x00000000u}));
  EXPECT_FLOAT_EQ(exact.small_scale[0], 0.9545455f);
  EXPECT_FLOAT_EQ(exact.large_scale[0], 2.0f);
  EXPECT_FLOAT_EQ(exact.two_bit_residual[0], 0.1864386f);
  EXPECT_EQ(exact.bytes(), 44);
  EXPECT_EQ(exact.bytes(), sign_bits_bytes(1, 35, 1));
}

TEST(SignBitsFormat, RefusesNanAndBadShapes) {
  std::vector<float> matrix(2 * 40, 1.0f);
  matrix[40 + 33] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { pack_sign_bits(matrix.data(), 2, 40); }, "element [1, 33] is NaN");
  expect_error([&] { pack_sign_bits(matrix.data(), 0, 40); }, "rows (R) must be >= 1, got 0");
  expect_error([&] { pack_sign_bits(matrix.data(), 2, 0); }, "cols (K) must be >= 1, got 0");
}

TEST(SignBitsFormat, RefusesBadExactColumns) {
  std::vector<float> matrix(2 * 40, 1.0f);
  const auto pack = [&](std::vector<int32_t> columns, int32_t cols = 40) {
    return [&matrix, columns, cols] { pack_sign_bits(matrix.data(), 2, cols, columns); };
  };
  expect_error(pack({3, 3}), "ascending and distinct: entry 1 is 3 after 3");
  expect_error(pack({5, 2}), "ascending and distinct: entry 1 is 2 after 5");
  expect_error(pack({0, 40}), "column 40 (entry 1) lies outside [0, K = 40)");
  expect_error(pack({-1}), "column -1 (entry 0) lies outside [0, K = 40)");
  expect_error(pack({0, 1, 2, 3, 4, 5, 6, 7, 8}), "at most 8 (kMaxExactColumns), got 9");
  expect_error(pack({0, 1}, 2), "2 of K = 2 columns leaves none to approximate");
  EXPECT_NO_THROW(pack({0, 39})());
  EXPECT_NO_THROW(pack({0}, 2)());
}

}  // namespace
}  // namespace twell
