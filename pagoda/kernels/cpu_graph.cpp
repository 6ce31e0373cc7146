// A recorded CPU step replayed in one call: pagoda/model/cpu_graphs.py records the kernel calls of a decode
// step once (what each reads and writes: fixed buffers), and `graph_run` replays the list in ONE OpenMP
// parallel region, with the GIL released.
//
// - Every thread walks every node: a node splits its work into units (rows, channel blocks, attention
//   tiles) and a thread takes its contiguous share; then all threads meet at a spinning barrier before the
//   next node. No thread sleeps or wakes inside a step; the pool spins only while a step runs.
// - A node runs pagoda_step's building blocks (cpu_step.h), the same functions the eager torch ops run,
//   and each output element is the same instructions whichever share holds it: a replay gives the eager
//   step's bits, whatever the number of threads.
//
// The program is an int64 tensor [nodes, kSlots] (an op code, then pointers and sizes; the layouts below)
// and a float64 tensor [nodes, kParams] (scales, epsilons). The buffers the pointers name are owned by the
// recording, which outlives every replay.

#include <ATen/ATen.h>
#include <Python.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>

#include "cpu_quant.h"
#include "cpu_step.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kSlots = 20, kParams = 4;

enum Op : int64_t {
  GATHER = 0,  // table, ld_table, idx (int64), rows, width, out, ldo: out[r] = table[idx[r]]
  RMS_NORM = 1,  // x, ldx, weight, rows, width, out, ldo; eps
  ROPE = 2,  // x, s0, s1, tokens, heads, dim, cos, sin_signed, out
  WRITE_KV = 3,  // k_cache, v_cache, heads, dim, k, ks0, ks1, v, vs0, vs1, slots (int64), tokens
  ATTENTION = 4,  // q, k_cache, v_cache, tables, starts, lens, num_seqs, heads, kv_heads, dim, block_size,
                  // table_width, window, out; scale, softcap
  INT8_LINEAR = 5,  // x, ldx, M, q, K, scale, out, ldo, N
  ACT_MUL = 6,  // gate_up, ldg, inter, kind, out, ldo, rows
  ADD = 7,  // a, lda, b, ldb, out, ldo, rows, width: out = a + b (ldb 0: one row for all)
  COPY = 8,  // src, d0, d1, d2, s0, s1, s2, dst (contiguous)
  SCALE = 9,  // x, n, out; factor: out = x * factor
  QUANT_ROWS = 10,  // x, ldx, K, M, xq, xd, xsum (cpu_quant.h)
  BLOCK_PRODUCT = 11,  // format, qs, d, m, N, K, xq, xd, xsum, M, out, ldo
  SHIFT = 12,  // x, n, out; addend: out = x + addend
  LORA_DOWN = 13,  // x, ldx, K, table, linear, linears, row_slot, rows, xa, ldxa (cpu_lora.cpp)
  LORA_UP = 14,  // out, ldo, table, linear, linears, row_slot, rows, xa, ldxa
};

template <typename T>
T* ptr(int64_t v) {
  return reinterpret_cast<T*>(v);
}

// The share [begin, end) of `units` that thread `t` of `n` takes.
inline void share(int64_t units, int t, int n, int64_t& begin, int64_t& end) {
  begin = units * t / n;
  end = units * (t + 1) / n;
}

// A barrier whose waiters spin (with a pause) on a generation counter: no futex, no sleep. A waiter that has
// spun kYieldAfter pauses (tens of microseconds) yields its core between polls, so that another thread of the
// process (the server's event loop) runs while a share of work waits for a slower one.
constexpr int kYieldAfter = 1 << 12;
struct SpinBarrier {
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  void wait(int n) {
    if (n == 1) return;
    const int gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      arrived.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_release);
    } else {
      for (int spins = 0; generation.load(std::memory_order_acquire) == gen; ++spins) {
        if (spins < kYieldAfter)
          _mm_pause();
        else
          std::this_thread::yield();
      }
    }
  }
};

void run_node(const int64_t* c, const double* p, int t, int n) {
  int64_t b, e;
  switch (c[0]) {
    case GATHER: {
      share(c[4], t, n, b, e);
      const float* table = ptr<const float>(c[1]);
      const int64_t* idx = ptr<const int64_t>(c[3]);
      float* out = ptr<float>(c[6]);
      for (int64_t r = b; r < e; ++r) std::memcpy(out + r * c[7], table + idx[r] * c[2], c[5] * sizeof(float));
      break;
    }
    case RMS_NORM:
      share(c[4], t, n, b, e);
      pagoda_step::rms_norm_rows(ptr<const float>(c[1]), c[2], ptr<const float>(c[3]), static_cast<float>(p[0]), c[5],
                                 ptr<float>(c[6]), c[7], b, e);
      break;
    case ROPE:
      share(c[4] * c[5], t, n, b, e);
      pagoda_step::rope_units(ptr<const float>(c[1]), c[2], c[3], c[5], c[6], ptr<const float>(c[7]),
                              ptr<const float>(c[8]), ptr<float>(c[9]), b, e);
      break;
    case WRITE_KV:
      share(c[12], t, n, b, e);
      pagoda_step::write_kv_tokens(ptr<float>(c[1]), ptr<float>(c[2]), c[3], c[4], ptr<const float>(c[5]), c[6], c[7],
                                   ptr<const float>(c[8]), c[9], c[10], ptr<const int64_t>(c[11]), b, e);
      break;
    case ATTENTION: {
      const pagoda_step::AttentionArgs a{ptr<const float>(c[1]), ptr<const float>(c[2]), ptr<const float>(c[3]),
                                         ptr<const int32_t>(c[4]), ptr<const int32_t>(c[5]), ptr<const int32_t>(c[6]),
                                         c[7], c[8], c[9], c[10], c[11], c[12], static_cast<float>(p[0]), c[13],
                                         static_cast<float>(p[1]), ptr<float>(c[14])};
      const std::vector<pagoda_step::AttentionTile> tiles = pagoda_step::attention_tiles(a);
      share(static_cast<int64_t>(tiles.size()), t, n, b, e);
      pagoda_step::attend_tiles(a, tiles, b, e);
      break;
    }
    case INT8_LINEAR: {
      const int64_t blocks = (c[9] + pagoda_step::kInt8Columns - 1) / pagoda_step::kInt8Columns;
      share(blocks, t, n, b, e);
      if (b < e)
        pagoda_step::int8_columns(ptr<const float>(c[1]), c[2], c[3], ptr<const int8_t>(c[4]), c[5],
                                  ptr<const float>(c[6]), ptr<float>(c[7]), c[8], b * pagoda_step::kInt8Columns,
                                  std::min(c[9], e * pagoda_step::kInt8Columns));
      break;
    }
    case ACT_MUL:
      share(c[7], t, n, b, e);
      pagoda_step::act_mul_rows(ptr<const float>(c[1]), c[2], c[3], c[4], ptr<float>(c[5]), c[6], b, e);
      break;
    case ADD: {
      share(c[7], t, n, b, e);
      const float* a = ptr<const float>(c[1]);
      const float* bb = ptr<const float>(c[3]);
      float* out = ptr<float>(c[5]);
      for (int64_t r = b; r < e; ++r)
        for (int64_t k = 0; k < c[8]; ++k) out[r * c[6] + k] = a[r * c[2] + k] + bb[r * c[4] + k];
      break;
    }
    case COPY: {
      share(c[2], t, n, b, e);
      const float* src = ptr<const float>(c[1]);
      float* dst = ptr<float>(c[8]);
      for (int64_t i = b; i < e; ++i)
        for (int64_t j = 0; j < c[3]; ++j)
          for (int64_t k = 0; k < c[4]; ++k) dst[(i * c[3] + j) * c[4] + k] = src[i * c[5] + j * c[6] + k * c[7]];
      break;
    }
    case SCALE: {
      share(c[2], t, n, b, e);
      const float* x = ptr<const float>(c[1]);
      float* out = ptr<float>(c[3]);
      const float f = static_cast<float>(p[0]);
      for (int64_t i = b; i < e; ++i) out[i] = x[i] * f;
      break;
    }
    case SHIFT: {
      share(c[2], t, n, b, e);
      const float* x = ptr<const float>(c[1]);
      float* out = ptr<float>(c[3]);
      const float addend = static_cast<float>(p[0]);
      for (int64_t i = b; i < e; ++i) out[i] = x[i] + addend;
      break;
    }
    case QUANT_ROWS:
      share(c[4], t, n, b, e);
      pagoda_quant::quantize_rows(ptr<const float>(c[1]), c[2], c[3], b, e, ptr<int8_t>(c[5]), ptr<float>(c[6]),
                                  ptr<int32_t>(c[7]));
      break;
    case BLOCK_PRODUCT: {
      const int64_t groups = pagoda_quant::column_groups(c[5]), width = pagoda_quant::kGroupN;
      share(groups, t, n, b, e);
      if (b < e)
        pagoda_quant::product_columns(static_cast<int>(c[1]), ptr<const uint8_t>(c[2]), ptr<const float>(c[3]),
                                      ptr<const float>(c[4]), c[5], c[6], ptr<const int8_t>(c[7]),
                                      ptr<const float>(c[8]), ptr<const int32_t>(c[9]), c[10], ptr<float>(c[11]), c[12],
                                      b * width, std::min(c[5], e * width));
      break;
    }
    case LORA_DOWN:  // every thread counts the units of this step's rows (a few per row), then takes its share
      share(pagoda_step::lora_units(ptr<const int64_t>(c[4]), c[5], c[6], ptr<const int64_t>(c[7]), c[8], false), t, n,
            b, e);
      pagoda_step::lora_down(ptr<const float>(c[1]), c[2], c[3], ptr<const int64_t>(c[4]), c[5], c[6],
                             ptr<const int64_t>(c[7]), c[8], ptr<float>(c[9]), c[10], b, e);
      break;
    case LORA_UP:
      share(pagoda_step::lora_units(ptr<const int64_t>(c[3]), c[4], c[5], ptr<const int64_t>(c[6]), c[7], true), t, n,
            b, e);
      pagoda_step::lora_up(ptr<float>(c[1]), c[2], ptr<const int64_t>(c[3]), c[4], c[5], ptr<const int64_t>(c[6]),
                           c[7], ptr<const float>(c[8]), c[9], b, e);
      break;
    default:
      break;  // validated before the region
  }
}

void graph_run(const at::Tensor& code, const at::Tensor& params, int64_t threads) {
  TORCH_CHECK(code.dim() == 2 && code.size(1) == kSlots && code.scalar_type() == at::kLong && code.is_contiguous(),
              "code must be [nodes, ", kSlots, "] int64");
  TORCH_CHECK(params.dim() == 2 && params.size(1) == kParams && params.size(0) == code.size(0) &&
                  params.scalar_type() == at::kDouble && params.is_contiguous(),
              "params must be [nodes, ", kParams, "] float64");
  const int64_t nodes = code.size(0);
  const int64_t* c = code.data_ptr<int64_t>();
  const double* p = params.data_ptr<double>();
  for (int64_t i = 0; i < nodes; ++i)
    TORCH_CHECK(c[i * kSlots] >= GATHER && c[i * kSlots] <= LORA_UP, "node ", i, ": unknown op ", c[i * kSlots]);
  PyThreadState* saved = Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr;
  SpinBarrier barrier;
#pragma omp parallel num_threads(static_cast<int>(std::max<int64_t>(1, threads)))
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    for (int64_t i = 0; i < nodes; ++i) {
      run_node(c + i * kSlots, p + i * kParams, t, n);
      barrier.wait(n);
    }
  }
  if (saved != nullptr) PyEval_RestoreThread(saved);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("graph_run(Tensor code, Tensor params, int threads) -> ()", &graph_run);
}
