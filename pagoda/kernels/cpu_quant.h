// Integer matrix products over GGUF-style 4-bit and 8-bit weight blocks with int8 activations
// (cpu_quant_matmul.cpp): the building blocks, for callers that split the work across threads themselves.
//
// Formats (blocks of 32 inputs along K, K % 32 == 0):
//   kQ4_0  w = (q - 8) * d       q in 0..15, d float16 in the file
//   kQ4_1  w = q * d + m         q in 0..15, d and m float16 in the file
//   kQ8_0  w = q * d             q int8, d float16 in the file
//
// Packed layout (made once at load from the file's blocks, pagoda/model/quantize.py block_weight_from_gguf).
// Output columns go in groups of kGroupN = 16 (N padded up to G = ceil(N / 16) groups with zero weights and
// scales); KB = K / 32 blocks.
//   qs  uint8 [G, KB, 256] (4-bit) or [G, KB, 512] (8-bit). Within one group and block, 64-byte chunks of
//       16 columns x 4 consecutive inputs: byte j * 64 + c * 4 + i belongs to column 16 g + c.
//         8-bit: chunk j (0..7) holds q (int8) of inputs 4 j + i.
//         4-bit: chunk j (0..3) holds inputs 4 j + i in its low nibbles and 4 (j + 4) + i in its high ones.
//   d   float32 [G, KB, 16]: d[16 g + c, b] at (g, b, c) (the file's float16, converted exactly)
//   m   float32 [G, KB, 16] for kQ4_1, else unused (may be null)
//
// Activations, per row and block of 32 (quantize_rows): amax = max |x|, xd = amax / 127,
// id = xd != 0 ? 1 / xd : 0, xq = nearbyint(x * id) (half to even, clamped to [-127, 127]),
// xsum = sum of the block's xq (int32).
//
// Each output element, one fixed sequence in every ISA variant, tile and thread split:
//   acc = 0
//   for b = 0 .. KB - 1:
//     isum = sum_k qw[k] * xq[k]          (exact int32; kQ4_0: sum_k q[k] * xq[k] - 8 * xsum)
//     acc = fma(d[n, b] * xd[r, b], (float) isum, acc)
//     kQ4_1 only: acc = fma(m[n, b], xd[r, b] * (float) xsum[r, b], acc)
//   out[r, n] = acc
// so the bits of a row never depend on the other rows, the row count, the column split or the ISA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pagoda_quant {

constexpr int kQ4_0 = 0;
constexpr int kQ4_1 = 1;
constexpr int kQ8_0 = 2;
constexpr int64_t kBlockK = 32;  // inputs per block
constexpr int64_t kGroupN = 16;  // output columns per packed group

// K / 32: the blocks per row (xd and xsum are [M, activation_blocks(K)]).
int64_t activation_blocks(int64_t K);
// ceil(N / 16): the column groups of a packed weight.
int64_t column_groups(int64_t N);
// Bytes of qs per group and block: 256 (4-bit) or 512 (8-bit).
int64_t group_block_bytes(int format);

// Quantizes rows [r0, r1) of x (row r at x + r * ldx, K floats) into xq + r * K (int8), xd + r * KB and
// xsum + r * KB (KB = K / 32). The same code on every ISA variant.
void quantize_rows(const float* x, int64_t ldx, int64_t K, int64_t r0, int64_t r1, int8_t* xq, float* xd,
                   int32_t* xsum);

// out[r * ldo + n] for all M rows and the output columns n in [n0, n1) (any bounds, 0 <= n0 <= n1 <= N), on the
// active ISA variant. qs, d, m in the packed layout above for an [N, K] weight; xq, xd, xsum from quantize_rows
// (rows 0 .. M-1). Runs on the calling thread.
void product_columns(int format, const uint8_t* qs, const float* d, const float* m, int64_t N, int64_t K,
                     const int8_t* xq, const float* xd, const int32_t* xsum, int64_t M, float* out, int64_t ldo,
                     int64_t n0, int64_t n1);

// ISA variants: "portable", "avx2", "avx_vnni", "avx512_vnni". The best one this CPU runs is active by default.
std::vector<std::string> isa_variants();  // those this CPU runs, best last
std::string active_isa();
// Makes `name` active ("best" for the default) and returns the previous one; throws on a variant this CPU lacks.
std::string set_isa(const std::string& name);

}  // namespace pagoda_quant
