// The building blocks of a CPU step, each over a share of its work: what the torch ops of this library run
// under at::parallel_for, and what a recorded step (cpu_graph.cpp) runs inside its one parallel region.
// Each output element is computed by the same instructions whichever share holds it, so a split never
// changes a bit.
#pragma once

#include <cstdint>
#include <vector>

namespace pagoda_step {

// int8 weight-only products (cpu_int_matmul.cpp): out[r, n] for rows [0, M), channels [n0, n1).
constexpr int64_t kInt8Columns = 16;  // the channel block a share should be a multiple of
void int8_columns(const float* x, int64_t ldx, int64_t M, const int8_t* q, int64_t K, const float* scale, float* out,
                  int64_t ldo, int64_t n0, int64_t n1);

// RMSNorm of rows [r0, r1) (cpu_rms_norm.cpp).
void rms_norm_rows(const float* x, int64_t ldx, const float* weight, float eps, int64_t width, float* out,
                   int64_t ldo, int64_t r0, int64_t r1);

// Rotate-half RoPE of units [u0, u1), unit = token * heads + head; out [T, heads, D] contiguous.
void rope_units(const float* x, int64_t s0, int64_t s1, int64_t heads, int64_t dim, const float* cos,
                const float* sin_signed, float* out, int64_t u0, int64_t u1);

// out[r, :I] = act(gu[r, :I]) * gu[r, I:2I] for rows [r0, r1) (cpu_activation.cpp); kind: ACT_*.
enum Activation : int64_t { ACT_SILU = 0, ACT_GELU_TANH = 1 };
void act_mul_rows(const float* gu, int64_t ldg, int64_t inter, int64_t kind, float* out, int64_t ldo, int64_t r0,
                  int64_t r1);

// The new tokens' K and V rows [t0, t1) into their cache slots (cpu_paged_attention.cpp).
void write_kv_tokens(float* k_cache, float* v_cache, int64_t heads, int64_t dim, const float* k, int64_t ks0,
                     int64_t ks1, const float* v, int64_t vs0, int64_t vs1, const int64_t* slots, int64_t t0,
                     int64_t t1);

// Causal paged attention (cpu_paged_attention.cpp): the work is a list of tiles (tokens of one sequence,
// one kv head), in the order the shares take them.
struct AttentionArgs {
  const float* q;  // [T, heads, D] contiguous
  const float* k_cache;
  const float* v_cache;  // [blocks, block_size, kv_heads, D] contiguous
  const int32_t* tables;  // [B, table_width]
  const int32_t* starts;  // [B + 1]
  const int32_t* lens;  // [B]
  int64_t num_seqs, heads, kv_heads, dim, block_size, table_width;
  float scale;
  int64_t window;
  float softcap;
  float* out;  // [T, heads, D]
};
struct AttentionTile {
  int64_t seq, t0, n, pos0, kv_head;
};
std::vector<AttentionTile> attention_tiles(const AttentionArgs& a);
void attend_tiles(const AttentionArgs& a, const std::vector<AttentionTile>& tiles, int64_t i0, int64_t i1);

// LoRA deltas (cpu_lora.cpp), in two phases over units of work: `lora_units` counts a phase's units over the
// rows; lora_down writes each row's xa (its rank rows' dot products with x), lora_up adds xa's product with B^T to
// out. table [slots, linears, 3]: per slot and projection (segments, count, total rank); row_slot [rows], -1: none.
int64_t lora_units(const int64_t* table, int64_t linear, int64_t linears, const int64_t* row_slot, int64_t rows,
                   bool up);
void lora_down(const float* x, int64_t ldx, int64_t k, const int64_t* table, int64_t linear, int64_t linears,
               const int64_t* row_slot, int64_t rows, float* xa, int64_t ldxa, int64_t u0, int64_t u1);
void lora_up(float* out, int64_t ldo, const int64_t* table, int64_t linear, int64_t linears, const int64_t* row_slot,
             int64_t rows, const float* xa, int64_t ldxa, int64_t u0, int64_t u1);

}  // namespace pagoda_step
