// The ISA-specific inner loops of the decode predictors (include/twell/decode.h), one table per ISA.
// The exact dot products and the down axpy are the CPU backend's own (kernels.h); only the loops
// over packed sign bits live here. decode_ffn.cpp holds the blocking and threading once.
//
// Every loop scores up to kDecodeMaxRows tokens against one neuron in one pass over the neuron's
// bit words: each word is loaded (and turned into lane masks) once for all rows. The gates' sums are
// of x quantized to 16-bit integers (decode.h, gate_inputs): exact, so a row's score depends neither
// on M nor on the ISA, and 32 columns fit one AVX-512 register.
#pragma once

#include <cstdint>
#include <type_traits>

namespace twell::cpu {

struct DecodeKernelTable {
  // For rows r < rows (1..kDecodeMaxRows), token r's quantized x (decode.h, gate_inputs) is
  // x_quantized + r·32·words, |values| <= kGateInputLevels, zero past the real columns and at the
  // exact columns (the padding bits are 0 as well, so the padded tail adds nothing either way).
  // large == nullptr (the one-bit gates): sums[r] = Σ x_r[k] over the set bits k of bits[0:words].
  // Otherwise the two-bit gate's two signed sums, with s_k = −1 where bit k of `bits` is set, else +1:
  // sums[r] = Σ_k s_k·x_r[k] over every column, sums[rows + r] = Σ s_k·x_r[k] over the set bits of
  // large. (x negated once where the sign bit is set serves both: two adds, one of them masked.)
  // Integer sums, exact: every ISA and every grouping of rows gives the same values.
  void (*masked_sums)(const int16_t* x_quantized, int32_t rows, const uint32_t* bits, const uint32_t* large,
                      int32_t words, int32_t* sums);
  // counts[r] = popcount(x_signs_r XOR bits) over words, the sign rule's N_neg; x_signs_r = x_signs + r·words.
  void (*negative_counts)(const uint32_t* x_signs, int32_t rows, const uint32_t* bits, int32_t words,
                          int32_t* counts);
};

// Calls block(std::integral_constant<int, n>{}, first_row) over rows in groups of n = kGroup rows
// while they last, then of kGroup/2, ..., 1: the row count of each group is a compile-time constant,
// so its accumulators can live in registers.
template <int kGroup, typename Block>
void for_each_row_group(int32_t rows, int32_t first_row, Block&& block) {
  for (; first_row + kGroup <= rows; first_row += kGroup) block(std::integral_constant<int, kGroup>{}, first_row);
  if constexpr (kGroup > 1) for_each_row_group<kGroup / 2>(rows, first_row, block);
}

// DecodeKernelTable::masked_sums from an ISA's Group::run<kRows, kTwoBit>(x of the group's first
// row, x row stride, bits, large, words, sums of the first row, sums stride between the two-bit
// gate's two sums): groups of up to kOneBitRows rows (large == nullptr) or kTwoBitRows rows, as many
// as the ISA's registers hold accumulators for.
template <typename Group, int kOneBitRows, int kTwoBitRows>
void masked_sums_in_groups(const int16_t* x_quantized, int32_t rows, const uint32_t* bits, const uint32_t* large,
                           int32_t words, int32_t* sums) {
  const int32_t x_stride = 32 * words;
  const auto group_sums = [&](auto group, auto two_bit, int32_t row) {
    Group::template run<decltype(group)::value, decltype(two_bit)::value>(x_quantized + row * x_stride, x_stride,
                                                                           bits, large, words, sums + row, rows);
  };
  if (large == nullptr)
    for_each_row_group<kOneBitRows>(rows, 0,
                                    [&](auto group, int32_t row) { group_sums(group, std::false_type{}, row); });
  else
    for_each_row_group<kTwoBitRows>(rows, 0, [&](auto group, int32_t row) { group_sums(group, std::true_type{}, row); });
}

// Each defined in decode_kernels_<isa>.cpp, whose functions carry that ISA's target attribute.
const DecodeKernelTable& scalar_decode_kernels();
const DecodeKernelTable& avx2_decode_kernels();
const DecodeKernelTable& avx512_decode_kernels();  // VPOPCNTDQ popcounts where the CPU has them

// The table of active_isa().
const DecodeKernelTable& active_decode_kernels();

}  // namespace twell::cpu
