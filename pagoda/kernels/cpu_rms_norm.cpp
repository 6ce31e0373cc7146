// RMSNorm and rotary embedding of float32 rows for x86 CPUs with AVX2 and FMA: one call each where torch
// takes six or seven small ops.
//
//   out[r] = (x[r] * (1 / sqrt(mean(x[r]^2) + eps))) * weight
// with the sum of squares a fixed sequence per row (8-lane FMA over the row in order, a fixed horizontal
// sum, then the scalar tail in order), so a row's bits never depend on the other rows or the threads. The
// two products are rounded apart, as in the torch form (pagoda/model/llama.py RMSNorm).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"
#include "cpu_step.h"

#include <cmath>

using pagoda_simd::hsum;

namespace pagoda_step {

void rms_norm_rows(const float* xp, int64_t ldx, const float* wp, float e, int64_t width, float* op, int64_t ldo,
                   int64_t r0, int64_t r1) {
  const int64_t vectors = width / 8;
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = xp + r * ldx;
    float* orow = op + r * ldo;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      const __m256 xv = _mm256_loadu_ps(xr + 8 * v);
      acc = _mm256_fmadd_ps(xv, xv, acc);
    }
    float sum = hsum(acc);
    for (int64_t k = vectors * 8; k < width; ++k) sum = std::fma(xr[k], xr[k], sum);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + e);
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t v = 0; v < vectors; ++v)
      _mm256_storeu_ps(orow + 8 * v, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + 8 * v), iv),
                                                   _mm256_loadu_ps(wp + 8 * v)));
    for (int64_t k = vectors * 8; k < width; ++k) orow[k] = (xr[k] * inv) * wp[k];
  }
}

void rope_units(const float* xp, int64_t s0, int64_t s1, int64_t heads, int64_t dim, const float* cp,
                const float* sp, float* op, int64_t u0, int64_t u1) {
  const int64_t half = dim / 2;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t t = u / heads, h = u % heads;
    const float* xr = xp + t * s0 + h * s1;
    const float* c = cp + t * dim;
    const float* s = sp + t * dim;
    float* o = op + u * dim;
    for (int64_t k = 0; k < dim; k += 8) {
      const float* swapped = xr + (k < half ? k + half : k - half);
      const __m256 rotated = _mm256_mul_ps(_mm256_loadu_ps(swapped), _mm256_loadu_ps(s + k));
      const __m256 straight = _mm256_mul_ps(_mm256_loadu_ps(xr + k), _mm256_loadu_ps(c + k));
      _mm256_storeu_ps(o + k, _mm256_add_ps(straight, rotated));
    }
  }
}

}  // namespace pagoda_step

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [T, H] float32, rows contiguous");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be [H] float32");
  const int64_t rows = x.size(0), width = x.size(1), ldx = x.stride(0);
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    pagoda_step::rms_norm_rows(xp, ldx, wp, e, width, op, width, r0, r1);
  });
  return out;
}

// Rotate-half RoPE: out = x * cos + cat(x[D/2:], x[:D/2]) * sin_signed, each product and the sum rounded
// apart exactly as torch's elementwise form (pagoda/model/llama.py apply_rope) rounds them: the same bits.
// x [T, heads, D] with unit stride along D (a view into the qkv projection); out contiguous.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "x must be [T, heads, D] float32");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin_signed.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin_signed.is_contiguous() && cos.size(0) == tokens && cos.size(1) == dim &&
                  sin_signed.sizes() == cos.sizes(), "cos and sin must be [T, D] float32, contiguous");
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pagoda_step::rope_units(xp, x.stride(0), x.stride(1), heads, dim, cp, sp, op, 0, tokens * heads);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin_signed) -> Tensor", &rope);
}
