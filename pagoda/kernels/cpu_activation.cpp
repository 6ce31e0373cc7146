// The gated activation of an MLP for x86 CPUs with AVX2 and FMA: out = act(gate) * up, one call where torch
// takes a split, the activation and a product.
//
//   silu(g)      = g / (1 + exp(-g)), as (g >= 0 ? g : g * e) / (1 + e) with e = exp(-|g|)
//   gelu_tanh(g) = 0.5 * g * (1 + tanh(y)), y = sqrt(2 / pi) * (g + 0.044715 g^3),
//                  tanh(y) = sign(y) * (1 - e) / (1 + e) with e = exp(-2 |y|)
// exp is cpu_simd.h's polynomial. Every element takes the same instructions (a row's tail runs in a padded
// vector), so its bits depend on its own inputs only: batch invariant by construction.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"
#include "cpu_step.h"

#include <algorithm>

namespace {

using pagoda_simd::exp_nonpositive;

inline __m256 silu(__m256 g) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_nonpositive(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)));
  const __m256 negative = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
  const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), negative);
  return _mm256_div_ps(num, _mm256_add_ps(one, e));
}

inline __m256 gelu_tanh(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f), sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
  const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign_bit, y)));
  const __m256 t = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), _mm256_and_ps(sign_bit, y));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
}

inline __m256 act_mul(__m256 gate, __m256 up, int64_t kind) {
  return _mm256_mul_ps(kind == pagoda_step::ACT_SILU ? silu(gate) : gelu_tanh(gate), up);
}

at::Tensor act_mul_op(const at::Tensor& gate_up, int64_t kind) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I] float32, rows contiguous");
  TORCH_CHECK(kind == pagoda_step::ACT_SILU || kind == pagoda_step::ACT_GELU_TANH, "unknown activation ", kind);
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldg = gate_up.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(inter, 1)), [&](int64_t r0, int64_t r1) {
    pagoda_step::act_mul_rows(gp, ldg, inter, kind, op, inter, r0, r1);
  });
  return out;
}

}  // namespace

namespace pagoda_step {

void act_mul_rows(const float* gu, int64_t ldg, int64_t inter, int64_t kind, float* out, int64_t ldo, int64_t r0,
                  int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* gate = gu + r * ldg;
    const float* up = gate + inter;
    float* o = out + r * ldo;
    int64_t k = 0;
    for (; k + 8 <= inter; k += 8)
      _mm256_storeu_ps(o + k, act_mul(_mm256_loadu_ps(gate + k), _mm256_loadu_ps(up + k), kind));
    if (k < inter) {  // the tail in a zero-padded vector: the same instructions as every other element
      alignas(32) float g[8] = {}, u[8] = {}, res[8];
      std::copy(gate + k, gate + inter, g);
      std::copy(up + k, up + inter, u);
      _mm256_store_ps(res, act_mul(_mm256_load_ps(g), _mm256_load_ps(u), kind));
      std::copy(res, res + (inter - k), o + k);
    }
  }
}

}  // namespace pagoda_step

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("act_mul(Tensor gate_up, int kind) -> Tensor", &act_mul_op);
}
