// LoRA deltas of a step's rows, each row its own adapter's, in one call per projection (x86 CPUs with AVX2 and
// FMA): out[t] += (x[t] A_i^T) B_i^T for row t's adapter i (rows of slot -1 add nothing). The adapters of a step
// are named by a table of addresses (pagoda/model/lora.py's LoraTable), so a recorded step (cpu_graph.cpp) replays
// the same call with whichever adapters the next step holds.
//
// The grouped idea of punica / S-LoRA, for a CPU: rows of many adapters in one call, each row reading its own
// adapter's A [R, K] and B^T [R, N] (B stored transposed so the second product streams rows of it). Every row is
// one fixed instruction sequence over its own inputs:
//   xa[j]    = hsum(sum over k-blocks of 8 of fma(A[j, k..k+8], x[k..k+8])), the tail zero-padded;
//   delta[n] = fma(..., fma(xa[0], Bt[0, n], 0), ...) over j = 0..R-1 in order, 8 n at a time, the tail padded;
//   out[n]  += delta[n], one add.
// Several rows of A (columns of Bt) are worked on at once to keep the FMA units busy; that changes no element's
// sequence.
// Rows are split over threads whole, so a row's bits depend on its inputs and adapter only: batch invariant by
// construction, whatever the other rows, their adapters, the row count or the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"
#include "cpu_step.h"

#include <algorithm>
#include <vector>

namespace {

inline float dot(const float* a, const float* x, int64_t k) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(x + i), acc);
  if (i < k) {  // the tail in zero-padded vectors: the same instructions as a full block
    alignas(32) float pa[8] = {}, px[8] = {};
    std::copy(a + i, a + k, pa);
    std::copy(x + i, x + k, px);
    acc = _mm256_fmadd_ps(_mm256_load_ps(pa), _mm256_load_ps(px), acc);
  }
  return pagoda_simd::hsum(acc);
}

// xa[j] = A[j] . x for j < rank: four rows of A at a time (four independent chains), each row's sum the same
// instructions as `dot`'s
void project_down(const float* x, int64_t k, const float* a, int64_t rank, float* xa) {
  int64_t j = 0;
  const int64_t full = k / 8 * 8;
  alignas(32) float px[8] = {};
  std::copy(x + full, x + k, px);
  for (; j + 4 <= rank; j += 4) {
    const float* a0 = a + j * k;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < full; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x + i);
      for (int m = 0; m < 4; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(a0 + m * k + i), xv, acc[m]);
    }
    if (full < k) {
      for (int m = 0; m < 4; ++m) {
        alignas(32) float pa[8] = {};
        std::copy(a0 + m * k + full, a0 + m * k + k, pa);
        acc[m] = _mm256_fmadd_ps(_mm256_load_ps(pa), _mm256_load_ps(px), acc[m]);
      }
    }
    for (int m = 0; m < 4; ++m) xa[j + m] = pagoda_simd::hsum(acc[m]);
  }
  for (; j < rank; ++j) xa[j] = dot(a + j * k, x, k);
}

// out[c] += sum over j in order of xa[j] * bt[j, c]: eight column vectors at a time (eight independent chains),
// each column's chain the same fma sequence whatever block it falls in
void project_up(const float* xa, const float* bt, int64_t rank, int64_t n, float* out, float* delta) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) {
    __m256 acc[8];
    for (int m = 0; m < 8; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) {
      const __m256 w = _mm256_set1_ps(xa[j]);
      const float* row = bt + j * n + c;
      for (int m = 0; m < 8; ++m) acc[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * m), acc[m]);
    }
    for (int m = 0; m < 8; ++m)
      _mm256_storeu_ps(out + c + 8 * m, _mm256_add_ps(_mm256_loadu_ps(out + c + 8 * m), acc[m]));
  }
  for (; c + 8 <= n; c += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(xa[j]), _mm256_loadu_ps(bt + j * n + c), acc);
    _mm256_storeu_ps(out + c, _mm256_add_ps(_mm256_loadu_ps(out + c), acc));
  }
  if (c < n) {  // the last columns through a padded vector
    __m256 acc = _mm256_setzero_ps();
    alignas(32) float col[8] = {};
    for (int64_t j = 0; j < rank; ++j) {
      std::copy(bt + j * n + c, bt + j * n + n, col);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(xa[j]), _mm256_load_ps(col), acc);
    }
    _mm256_store_ps(delta, acc);
    for (int64_t i = c; i < n; ++i) out[i] += delta[i - c];
  }
}

void lora_row(const float* x, int64_t k, const float* a, const float* bt, int64_t rank, int64_t n, float* out,
              float* xa, float* delta) {
  project_down(x, k, a, rank, xa);
  project_up(xa, bt, rank, n, out, delta);
}

}  // namespace

namespace pagoda_step {

void lora_rows(float* out, int64_t ldo, const float* x, int64_t ldx, int64_t k, int64_t n, const int64_t* table,
               int64_t linear, int64_t num_linears, const int64_t* row_slot, int64_t r0, int64_t r1) {
  int64_t max_rank = 0;
  for (int64_t t = r0; t < r1; ++t)
    if (row_slot[t] >= 0) max_rank = std::max(max_rank, table[(row_slot[t] * num_linears + linear) * 3 + 2]);
  if (max_rank == 0) return;
  std::vector<float> xa(max_rank);
  alignas(32) float delta[8];
  for (int64_t t = r0; t < r1; ++t) {
    if (row_slot[t] < 0) continue;
    const int64_t* entry = table + (row_slot[t] * num_linears + linear) * 3;
    if (entry[2] == 0) continue;  // this adapter leaves the projection alone
    lora_row(x + t * ldx, k, reinterpret_cast<const float*>(entry[0]), reinterpret_cast<const float*>(entry[1]),
             entry[2], n, out + t * ldo, xa.data(), delta);
  }
}

}  // namespace pagoda_step

namespace {

// out [T, N] += each row's delta, in place; x [T, K]; table [slots, num_linears, 3] int64: per slot (an adapter of
// the step) and projection, (A's address [R, K], B^T's address [R, N], R), R 0 where it leaves the projection
// alone; row_slot [T] int64, -1 for a row on the base (and padding).
void lora_apply(at::Tensor out, const at::Tensor& x, const at::Tensor& table, int64_t linear, const at::Tensor& row_slot) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1, "out must be [T, N] float32");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(0) == out.size(0),
              "x must be [T, K] float32 with out's rows");
  TORCH_CHECK(table.dim() == 3 && table.size(2) == 3 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  linear >= 0 && linear < table.size(1), "table must be [slots, linears, 3] int64");
  TORCH_CHECK(row_slot.dim() == 1 && row_slot.size(0) == out.size(0) && row_slot.scalar_type() == at::kLong &&
                  row_slot.is_contiguous(), "row_slot must be [T] int64");
  const int64_t rows = out.size(0), slots = table.size(0);
  const int64_t* which = row_slot.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(which[t] < slots, "row ", t, ": slot ", which[t], " of ", slots);
  float* op = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t ldo = out.stride(0), ldx = x.stride(0), k = x.size(1), n = out.size(1), linears = table.size(1);
  // a grain of enough rows to repay a thread's wake-up (about 64k multiply-adds at rank 16)
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, 16 * (k + n)));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    pagoda_step::lora_rows(op, ldo, xp, ldx, k, n, tp, linear, linears, which, r0, r1);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("lora_apply(Tensor(a!) out, Tensor x, Tensor table, int linear, Tensor row_slot) -> ()", &lora_apply);
}
