// Integer matrix products over GGUF-style Q4_0 / Q4_1 / Q8_0 weight blocks with int8 activations: the
// format, the packed layout and the arithmetic are in cpu_quant.h.
//
// Batch invariance and ISA invariance by construction: every output element is the same integer dot per
// block (exact, so any instruction order gives the same int32) followed by the same float sequence (one
// multiply and one fma per block, two for Q4_1, blocks in order). The variants differ only in how they form
// the exact integer dots: scalar code, AVX2 maddubs/madd, AVX-VNNI dpbusd on 8 columns, AVX512-VNNI dpbusd on
// 16 columns; tiles share the weight loads (and their unpacking) between up to four rows. Threads split the
// output columns, never K.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_quant.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#define PAGODA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define PAGODA_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))

namespace pagoda_quant {
namespace {

enum Isa : int { kPortable = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3 };
const char* const kIsaNames[] = {"portable", "avx2", "avx_vnni", "avx512_vnni"};

bool cpu_runs(int isa) {
  __builtin_cpu_init();  // may run before libgcc's own initializer (g_isa below)
  switch (isa) {
    case kPortable: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvxVnni: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx512vnni");
  }
  return false;
}

int best_isa() {
  for (int isa = kAvx512Vnni; isa > kPortable; --isa)
    if (cpu_runs(isa)) return isa;
  return kPortable;
}

std::atomic<int> g_isa{best_isa()};

constexpr int64_t kAhead = 2048;  // bytes ahead of the weight stream to prefetch
constexpr int kRows = 4;  // rows a tile shares its weight loads between (8-column vectors)
constexpr int kWideRows = 8;  // the same with AVX-512's 32 registers

// What a tile reads: the packed weight and the quantized activations.
struct Operands {
  const uint8_t* qs;
  const float* d;
  const float* m;
  int64_t KB, K;
  const int8_t* xq;
  const float* xd;
  const int32_t* xsum;
};

constexpr int64_t block_bytes(int F) { return F == kQ8_0 ? 512 : 256; }
// The int32 subtracted from sum(q * xq) per unit of xsum: Q4_0's offset 8; Q8_0 in the unsigned (q + 128)
// form that dpbusd takes, 128; none for Q4_1 (and for the signed Q8_0 dots).
constexpr int offset(int F, bool unsigned_q8) { return F == kQ4_0 ? 8 : (F == kQ8_0 && unsigned_q8 ? 128 : 0); }

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- portable: scalar code over the packed layout --------------------------------------------------------

template <int F>
void tile_portable(const Operands& a, int64_t g, int64_t r0, int R, float* out) {
  constexpr int64_t bytes = block_bytes(F);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kGroupN; ++c) {
      const uint8_t* q = a.qs + g * a.KB * bytes;
      float acc = 0.0f;
      for (int64_t b = 0; b < a.KB; ++b, q += bytes) {
        const int8_t* x = a.xq + (r0 + r) * a.K + b * kBlockK;
        const int64_t xb = (r0 + r) * a.KB + b;
        int32_t isum = 0;
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i) {
            int32_t w;
            if (F == kQ8_0) w = static_cast<int8_t>(q[j * 64 + c * 4 + i]);
            else w = j < 4 ? (q[j * 64 + c * 4 + i] & 0x0F) : (q[(j - 4) * 64 + c * 4 + i] >> 4);
            isum += w * static_cast<int32_t>(x[4 * j + i]);
          }
        isum -= offset(F, false) * a.xsum[xb];
        const float dx = a.xd[xb];
        const int64_t s = (g * a.KB + b) * kGroupN + c;
        acc = std::fma(a.d[s] * dx, static_cast<float>(isum), acc);
        if (F == kQ4_1) acc = std::fma(a.m[s], dx * static_cast<float>(a.xsum[xb]), acc);
      }
      out[r * kGroupN + c] = acc;
    }
}

// ---- AVX2: maddubs (unsigned x signed bytes -> int16 pairs) and madd (-> int32), 8 columns a vector ------

template <int F, int R>
void tile_avx2(const Operands& a, int64_t g, int64_t r0, float* out) {
  constexpr int64_t bytes = block_bytes(F);
  const uint8_t* q = a.qs + g * a.KB * bytes;
  const float* dp = a.d + g * a.KB * kGroupN;
  const float* mp = F == kQ4_1 ? a.m + g * a.KB * kGroupN : nullptr;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.KB; ++b, q += bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(q + kAhead + i), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {  // columns 8 h .. 8 h + 7
      __m256i w[8];
      if (F == kQ8_0) {
        for (int j = 0; j < 8; ++j) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64 + h * 32));
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64 + h * 32));
          w[j] = _mm256_and_si256(v, low);
          w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      }
      const __m256 dw = _mm256_loadu_ps(dp + b * kGroupN + h * 8);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.xq + (r0 + r) * a.K + b * kBlockK;
        const int64_t xb = (r0 + r) * a.KB + b;
        __m256i isum;
        if (F == kQ8_0) {  // |q| * sign(x, q): pairs of at most 2 * 128 * 127, no int16 saturation
          isum = _mm256_setzero_si256();
          for (int j = 0; j < 8; ++j) {
            const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(load4(x + 4 * j)), w[j]);
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), xv), ones));
          }
        } else {  // q <= 15: eight int16 pair sums stay within 8 * 2 * 15 * 127 = 30480
          __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load4(x)));
          for (int j = 1; j < 8; ++j)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(load4(x + 4 * j))));
          isum = _mm256_madd_epi16(s16, ones);
          if (F == kQ4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * a.xsum[xb]));
        }
        const float dx = a.xd[xb];
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(isum), acc[r][h]);
        if (F == kQ4_1)
          acc[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(mp + b * kGroupN + h * 8),
                                      _mm256_set1_ps(dx * static_cast<float>(a.xsum[xb])), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kGroupN, acc[r][0]);
    _mm256_storeu_ps(out + r * kGroupN + 8, acc[r][1]);
  }
}

// ---- AVX-VNNI: dpbusd (unsigned x signed bytes -> int32, no saturation) on 8 columns a vector ------------

template <int F, int R>
PAGODA_AVXVNNI void tile_avx_vnni(const Operands& a, int64_t g, int64_t r0, float* out) {
  constexpr int64_t bytes = block_bytes(F);
  const uint8_t* q = a.qs + g * a.KB * bytes;
  const float* dp = a.d + g * a.KB * kGroupN;
  const float* mp = F == kQ4_1 ? a.m + g * a.KB * kGroupN : nullptr;
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.KB; ++b, q += bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(q + kAhead + i), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i w[8];
      if (F == kQ8_0) {  // q + 128, unsigned
        for (int j = 0; j < 8; ++j)
          w[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64 + h * 32)), flip);
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64 + h * 32));
          w[j] = _mm256_and_si256(v, low);
          w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      }
      const __m256 dw = _mm256_loadu_ps(dp + b * kGroupN + h * 8);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.xq + (r0 + r) * a.K + b * kBlockK;
        const int64_t xb = (r0 + r) * a.KB + b;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          s0 = _mm256_dpbusd_avx_epi32(s0, w[j], _mm256_set1_epi32(load4(x + 4 * j)));
          s1 = _mm256_dpbusd_avx_epi32(s1, w[j + 4], _mm256_set1_epi32(load4(x + 16 + 4 * j)));
        }
        __m256i isum = _mm256_add_epi32(s0, s1);
        if (offset(F, true)) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset(F, true) * a.xsum[xb]));
        const float dx = a.xd[xb];
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(isum), acc[r][h]);
        if (F == kQ4_1)
          acc[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(mp + b * kGroupN + h * 8),
                                      _mm256_set1_ps(dx * static_cast<float>(a.xsum[xb])), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kGroupN, acc[r][0]);
    _mm256_storeu_ps(out + r * kGroupN + 8, acc[r][1]);
  }
}

// ---- AVX512-VNNI: dpbusd on 16 columns a vector -----------------------------------------------------------

template <int F, int R>
PAGODA_AVX512 void tile_avx512_vnni(const Operands& a, int64_t g, int64_t r0, float* out) {
  constexpr int64_t bytes = block_bytes(F);
  const uint8_t* q = a.qs + g * a.KB * bytes;
  const float* dp = a.d + g * a.KB * kGroupN;
  const float* mp = F == kQ4_1 ? a.m + g * a.KB * kGroupN : nullptr;
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.KB; ++b, q += bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(q + kAhead + i), _MM_HINT_T0);
    __m512i w[8];
    if (F == kQ8_0) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_xor_si512(_mm512_loadu_si512(q + j * 64), flip);
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(q + j * 64);
        w[j] = _mm512_and_si512(v, low);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    const __m512 dw = _mm512_loadu_ps(dp + b * kGroupN);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.xq + (r0 + r) * a.K + b * kBlockK;
      const int64_t xb = (r0 + r) * a.KB + b;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(load4(x + 4 * j)));
        s1 = _mm512_dpbusd_epi32(s1, w[j + 4], _mm512_set1_epi32(load4(x + 16 + 4 * j)));
      }
      __m512i isum = _mm512_add_epi32(s0, s1);
      if (offset(F, true)) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset(F, true) * a.xsum[xb]));
      const float dx = a.xd[xb];
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum), acc[r]);
      if (F == kQ4_1)
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(mp + b * kGroupN), _mm512_set1_ps(dx * static_cast<float>(a.xsum[xb])),
                                 acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kGroupN, acc[r]);
}

// ---- driver -------------------------------------------------------------------------------------------------

template <int F, int R>
void tile(int isa, const Operands& a, int64_t g, int64_t r0, float* out) {
  switch (isa) {
    case kAvx512Vnni: tile_avx512_vnni<F, R>(a, g, r0, out); return;
    case kAvxVnni: if constexpr (R <= kRows) { tile_avx_vnni<F, R>(a, g, r0, out); return; } break;
    case kAvx2: if constexpr (R <= kRows) { tile_avx2<F, R>(a, g, r0, out); return; } break;
    default: break;
  }
  tile_portable<F>(a, g, r0, R, out);
}

template <int F>
void columns(int isa, const Operands& a, int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  float buf[kWideRows * kGroupN];
  const int64_t wide = isa == kAvx512Vnni ? kWideRows : kRows;  // 32 vector registers: 8 rows a tile
  for (int64_t g = n0 / kGroupN; g * kGroupN < n1; ++g) {
    const int64_t c0 = std::max(n0, g * kGroupN), c1 = std::min(n1, (g + 1) * kGroupN);
    for (int64_t r = 0; r < M;) {
      const int64_t R = M - r >= wide ? wide : std::min<int64_t>(kRows, M - r);
      switch (R) {
        case 8: tile<F, 8>(isa, a, g, r, buf); break;
        case 4: tile<F, 4>(isa, a, g, r, buf); break;
        case 3: tile<F, 3>(isa, a, g, r, buf); break;
        case 2: tile<F, 2>(isa, a, g, r, buf); break;
        default: tile<F, 1>(isa, a, g, r, buf); break;
      }
      for (int64_t rr = 0; rr < R; ++rr)
        std::memcpy(out + (r + rr) * ldo + c0, buf + rr * kGroupN + (c0 - g * kGroupN), (c1 - c0) * sizeof(float));
      r += R;
    }
  }
}

}  // namespace

int64_t activation_blocks(int64_t K) { return K / kBlockK; }
int64_t column_groups(int64_t N) { return (N + kGroupN - 1) / kGroupN; }
int64_t group_block_bytes(int format) { return block_bytes(format); }

void quantize_rows(const float* x, int64_t ldx, int64_t K, int64_t r0, int64_t r1, int8_t* xq, float* xd,
                   int32_t* xsum) {
  const int64_t KB = K / kBlockK;
  const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < KB; ++b) {
      const float* p = x + r * ldx + b * kBlockK;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
      __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float d = _mm_cvtss_f32(m4) / 127.0f;
      const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      __m256i q[4];
      __m256i total = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        __m256 s = _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        s = _mm256_max_ps(_mm256_min_ps(s, hi), lo);
        q[i] = _mm256_cvttps_epi32(s);
        total = _mm256_add_epi32(total, q[i]);
      }
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + b * kBlockK),
                          _mm256_permutevar8x32_epi32(packed, order));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      xd[r * KB + b] = d;
      xsum[r * KB + b] = _mm_cvtsi128_si32(t);
    }
}

void product_columns(int format, const uint8_t* qs, const float* d, const float* m, int64_t N, int64_t K,
                     const int8_t* xq, const float* xd, const int32_t* xsum, int64_t M, float* out, int64_t ldo,
                     int64_t n0, int64_t n1) {
  n1 = std::min(n1, N);
  if (M <= 0 || n0 >= n1) return;
  const Operands a{qs, d, m, K / kBlockK, K, xq, xd, xsum};
  const int isa = g_isa.load(std::memory_order_relaxed);
  switch (format) {
    case kQ4_0: columns<kQ4_0>(isa, a, M, out, ldo, n0, n1); return;
    case kQ4_1: columns<kQ4_1>(isa, a, M, out, ldo, n0, n1); return;
    case kQ8_0: columns<kQ8_0>(isa, a, M, out, ldo, n0, n1); return;
  }
}

std::vector<std::string> isa_variants() {
  std::vector<std::string> names;
  for (int isa = kPortable; isa <= kAvx512Vnni; ++isa)
    if (cpu_runs(isa)) names.emplace_back(kIsaNames[isa]);
  return names;
}

std::string active_isa() { return kIsaNames[g_isa.load()]; }

std::string set_isa(const std::string& name) {
  int isa = -1;
  if (name == "best") isa = best_isa();
  for (int i = kPortable; i <= kAvx512Vnni; ++i)
    if (name == kIsaNames[i]) isa = i;
  TORCH_CHECK(isa >= 0, "unknown ISA variant '", name, "' (portable, avx2, avx_vnni, avx512_vnni or best)");
  TORCH_CHECK(cpu_runs(isa), "this CPU cannot run the ", name, " variant");
  return kIsaNames[g_isa.exchange(isa)];
}

}  // namespace pagoda_quant

namespace {

using namespace pagoda_quant;

struct Checked {
  int64_t M, N, K;
};

Checked check(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t format,
              int64_t n) {
  TORCH_CHECK(format == kQ4_0 || format == kQ4_1 || format == kQ8_0, "format must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [T, K] float32, rows contiguous");
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  qs.size(2) == group_block_bytes(format), "qs must be [G, K/32, ", group_block_bytes(format),
              "] uint8, contiguous");
  const int64_t G = qs.size(0), KB = qs.size(1);
  TORCH_CHECK(n > 0 && column_groups(n) == G, "qs holds ", G, " groups of 16 columns, not ceil(", n, " / 16)");
  TORCH_CHECK(x.size(1) == KB * kBlockK, "x has ", x.size(1), " inputs, the weight ", KB * kBlockK);
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == G * KB * kGroupN,
              "d must be [G, K/32, 16] float32");
  if (format == kQ4_1)
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.numel() == G * KB * kGroupN,
                "m must be [G, K/32, 16] float32");
  return {x.size(0), n, KB * kBlockK};
}

// The activations as the products see them, in one allocation: xq [M, K] int8, then xd [M, K/32] float32 and
// xsum [M, K/32] int32.
struct Quantized {
  at::Tensor storage;
  const int8_t* xq;
  const float* xd;
  const int32_t* xsum;
};

Quantized quantize(const at::Tensor& x, int64_t M, int64_t K) {
  const int64_t KB = activation_blocks(K), head = (M * K + 63) / 64 * 64;
  at::Tensor storage = at::empty({head + 8 * M * KB}, x.options().dtype(at::kByte));
  uint8_t* base = storage.data_ptr<uint8_t>();
  int8_t* xq = reinterpret_cast<int8_t*>(base);
  float* xd = reinterpret_cast<float*>(base + head);
  int32_t* xs = reinterpret_cast<int32_t*>(base + head + 4 * M * KB);
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(K, 1));  // rows a thread takes
  if (M <= grain) quantize_rows(xp, ldx, K, 0, M, xq, xd, xs);
  else at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) { quantize_rows(xp, ldx, K, r0, r1, xq, xd, xs); });
  return {storage, xq, xd, xs};
}

// x [T, K] float32 @ the packed weight [N, K] -> [T, N] float32: all rows quantized once, then threads take
// ranges of column groups.
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                        int64_t format, int64_t n) {
  const Checked c = check(x, qs, d, m, format, n);
  const Quantized q = quantize(x, c.M, c.K);
  at::Tensor out = at::empty({c.M, c.N}, x.options());
  if (c.M == 0) return out;
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = format == kQ4_1 ? m.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, column_groups(c.N), 1, [&](int64_t g0, int64_t g1) {
    product_columns(static_cast<int>(format), qp, dp, mp, c.N, c.K, q.xq, q.xd, q.xsum, c.M, op, c.N, g0 * kGroupN,
                    std::min(c.N, g1 * kGroupN));
  });
  return out;
}

// The same product, one column range [bounds[i], bounds[i+1]) after another on the calling thread: the
// column split made explicit (tests compare it with block_linear).
at::Tensor block_linear_columns(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                                int64_t format, int64_t n, at::IntArrayRef bounds) {
  const Checked c = check(x, qs, d, m, format, n);
  const Quantized q = quantize(x, c.M, c.K);
  at::Tensor out = at::zeros({c.M, c.N}, x.options());
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    TORCH_CHECK(0 <= bounds[i] && bounds[i] <= bounds[i + 1] && bounds[i + 1] <= c.N, "bad column bounds");
    product_columns(static_cast<int>(format), qs.data_ptr<uint8_t>(), d.data_ptr<float>(),
                    format == kQ4_1 ? m.data_ptr<float>() : nullptr, c.N, c.K, q.xq, q.xd, q.xsum, c.M,
                    out.data_ptr<float>(), c.N, bounds[i], bounds[i + 1]);
  }
  return out;
}

// (xq [T, K] int8, xd [T, K/32] float32, xsum [T, K/32] int32): the activations as the products see them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [T, K] float32, rows contiguous");
  TORCH_CHECK(x.size(1) % kBlockK == 0, "the input size (", x.size(1), ") must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), KB = activation_blocks(K);
  const Quantized q = quantize(x, M, K);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar)), xd = at::empty({M, KB}, x.options()),
             xsum = at::empty({M, KB}, x.options().dtype(at::kInt));
  std::memcpy(xq.data_ptr<int8_t>(), q.xq, M * K);
  std::memcpy(xd.data_ptr<float>(), q.xd, 4 * M * KB);
  std::memcpy(xsum.data_ptr<int32_t>(), q.xsum, 4 * M * KB);
  return {xq, xd, xsum};
}

std::string quant_isa(const std::string& name) { return name.empty() ? active_isa() : set_isa(name); }

std::vector<std::string> quant_isas() { return isa_variants(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("block_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int format, int n) -> Tensor", &block_linear);
  m.def("block_linear_columns(Tensor x, Tensor qs, Tensor d, Tensor m, int format, int n, int[] bounds) -> Tensor",
        &block_linear_columns);
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)", &quantize_activations);
  m.def("quant_isa(str name) -> str", &quant_isa);
  m.def("quant_isas() -> str[]", &quant_isas);
}
