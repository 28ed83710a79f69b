// Conversions between dense matrices and the sparse formats (CPU, exact data movement).
// Every round trip dense -> format -> dense is bit-exact, except that -0.0 reads back as +0.0: the
// formats store non-zeros only, and a zero is +0.0 wherever it is written (slots, spill, backup).
#pragma once

#include <cstdint>
#include <vector>

#include "twell/host_tensors.h"

namespace twell {

// Packs a dense bf16 matrix [M, H] into TwELL: every element other than +0.0 and -0.0 is stored
// (negative values too, so the packing is a general one). The spill grows as needed: the result is
// complete. The tile and compression must be supported ones (twell_tile_supported, ...).
TwellMatrix twell_from_dense(const bf16* dense, int64_t rows, int32_t cols, int32_t tile, int32_t compression);
// Unpacks to dense bf16 [M, H]; refuses an incomplete packing.
std::vector<bf16> dense_from_twell(const TwellMatrix& packed);
// Checks every invariant of docs/formats.md (sizes, counts, column order, spill rows); throws on the first violation.
void validate(const TwellMatrix& packed);

// Packs a dense bf16 matrix [M, H] into hybrid with ELL width W (1 <= W <= H): a row with more than
// W non-zeros goes to the backup, which grows to hold every such row (backup_used == capacity).
HybridMatrix hybrid_from_dense(const bf16* dense, int64_t rows, int32_t cols, int32_t ell_width);
// The same rows from a TwELL packing (which it validates first).
HybridMatrix hybrid_from_twell(const TwellMatrix& packed, int32_t ell_width);
// Unpacks to dense bf16 [M, H]; refuses an invalid or incomplete hybrid.
std::vector<bf16> dense_from_hybrid(const HybridMatrix& hybrid);
// Checks every invariant of docs/formats.md; throws on the first violation.
void validate(const HybridMatrix& hybrid);

// Sign bits of A [R, K] (fp32 storage), keeping the columns `exact_columns` exactly
// (formats/sign_bits.h); refuses NaN and a bad column list (validate_exact_columns).
SignBits pack_sign_bits(const float* matrix, int32_t rows, int32_t cols,
                        const std::vector<int32_t>& exact_columns = {});
// Throws naming the problem unless `columns` is a valid exact-column list for K = cols: ascending,
// distinct, each in [0, K), at most kMaxExactColumns, and fewer than K (some column is approximated).
void validate_exact_columns(const std::vector<int32_t>& columns, int32_t cols);
// Throws naming the problem unless `signs` is packed from a [rows, cols] matrix: every array of
// formats/sign_bits.h at its size, and a valid exact-column list. Sizes only: cheap enough for
// every decode call.
void validate_sign_bits(const SignBits& signs, int32_t rows, int32_t cols);

}  // namespace twell
