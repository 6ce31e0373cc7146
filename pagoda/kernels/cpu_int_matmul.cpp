// Weight-only int8 matrix products for x86 CPUs with AVX2 and FMA: float32 activations,
// float32 accumulation, the weights converted to float32 in registers as they stream past.
//
// Batch invariance by construction: out[r, n] is always the same instruction sequence,
//   acc = 0; for k in 0, 8, 16, ...: acc = fma(x[r, k:k+8], w[n, k:k+8], acc); out = hsum(acc) ...
// whichever tile (4 rows x 2 channels, or 1 row x 4 channels) and whichever thread computes it.
// Tiles only share the loads of x and of the converted weights between rows and channels.
// Threads split the output channels, never a reduction.
//
//   int8: w[n, k] = q[n, k] * scale[n]       q [N, K] int8, scale [N] float32; out = hsum(acc) * scale[n]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"
#include "cpu_step.h"

#include <algorithm>

namespace {

constexpr int64_t kAhead = 2;  // tiles ahead to prefetch

using pagoda_simd::hsum;

// Eight int8 weights as float32.
inline __m256 int8_weights(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int R, int C>
void int8_tile(const float* x, int64_t ldx, const int8_t* q, int64_t K, const float* scale, float* out,
               int64_t ldo) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int8_t* ahead = q + kAhead * C * K;  // the weights of a later tile: a decode streams them from memory
  for (int64_t k = 0; k < K; k += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + k * C), _MM_HINT_T0);
    __m256 w[C];
    for (int c = 0; c < C; ++c) w[c] = int8_weights(q + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum(acc[r][c]) * scale[c];
}

// Runs tile(r, n) over rows [0, M) and channels [n0, n1): rows four at a time (C4 channels a tile), the
// remainder rows one at a time (four channels).
template <int C4, typename Tile4xC, typename Tile4x1, typename Tile1x4, typename Tile1x1>
void run_tiles(int64_t M, int64_t n_begin, int64_t n_end, Tile4xC t4c, Tile4x1 t41, Tile1x4 t14, Tile1x1 t11) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) {
    int64_t n = n_begin;
    for (; n + C4 <= n_end; n += C4) t4c(r, n);
    for (; n < n_end; ++n) t41(r, n);
  }
  for (; r < M; ++r) {
    int64_t n = n_begin;
    for (; n + 4 <= n_end; n += 4) t14(r, n);
    for (; n < n_end; ++n) t11(r, n);
  }
}

void check_x(const at::Tensor& x, int64_t K, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [T, K] float32, rows contiguous");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs, the weight ", K);
  TORCH_CHECK(K % multiple == 0, "the input size (", K, ") must be a multiple of ", multiple);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "q must be [N, K] int8, contiguous");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == q.size(0),
              "scale must be [N] float32");
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  check_x(x, K, 8);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), blocks = (N + pagoda_step::kInt8Columns - 1) / pagoda_step::kInt8Columns;
  // threads split the channels in blocks
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    pagoda_step::int8_columns(xp, ldx, M, qp, K, sp, op, N, b0 * pagoda_step::kInt8Columns,
                              std::min(N, b1 * pagoda_step::kInt8Columns));
  });
  return out;
}

}  // namespace

namespace pagoda_step {

void int8_columns(const float* x, int64_t ldx, int64_t M, const int8_t* q, int64_t K, const float* scale, float* out,
                  int64_t ldo, int64_t n0, int64_t n1) {
  auto tile = [&](auto R, auto C) {
    return [&, R, C](int64_t r, int64_t n) {
      int8_tile<decltype(R)::value, decltype(C)::value>(x + r * ldx, ldx, q + n * K, K, scale + n, out + r * ldo + n,
                                                        ldo);
    };
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  for (int64_t b = n0; b < n1; b += kInt8Columns)  // a block at a time: the 4-row tiles reuse its weights from cache
    run_tiles<2>(M, b, std::min(n1, b + kInt8Columns), tile(I4{}, I2{}), tile(I4{}, I1{}), tile(I1{}, I4{}),
                 tile(I1{}, I1{}));
}

}  // namespace pagoda_step

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor", &int8_linear);
}
