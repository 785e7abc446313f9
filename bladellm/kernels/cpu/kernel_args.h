// Argument structs of the kernels' C entry points (mirrored by kernels/compiled.py) and the
// entry points themselves, so one kernel (decoder.cpp) can call the others in-process.
#pragma once

#include <cstdint>

extern "C" {
struct PagedAttentionArgs {  // mirrored by kernels/compiled.py; all strides in elements
  void* out;                 // [T, num_heads, head_dim] contiguous
  const void* query;         // [T, num_heads, head_dim], last dim contiguous
  const void* k_cache;       // [num_blocks, block_size, num_kv_heads, row] contiguous; row =
  const void* v_cache;       // head_dim, or head_dim int8 + fp32 scale bytes if kv_int8
  const int32_t* block_tables;     // [num_reqs, block_table_stride]
  const int32_t* query_start_loc;  // [num_reqs + 1]
  const int32_t* seq_lens;         // [num_reqs], including this step's tokens
  int64_t q_stride_token;
  int64_t q_stride_head;
  int64_t block_table_stride;
  int32_t num_reqs, num_heads, num_kv_heads, head_dim, block_size, dtype, num_threads;
  float scale;
  int32_t kv_int8;  // caches hold int8 rows + their fp32 scale (kernels/kv_int8.py)
  // Per-layer features (ref.attention_scores); zero / nullptr: off, the plain causal kernel.
  int32_t sliding_window;     // a query sees keys with pos - key < sliding_window
  float soft_cap;             // scores -> soft_cap * tanh(scores / soft_cap)
  const float* alibi_slopes;  // [num_heads]: scores += slope * (key - pos)
};

struct RotaryArgs {     // mirrored by kernels/compiled.py; strides in elements
  const void* positions;  // [tokens], int64 or int32
  const void* q_in;       // [tokens, num_q_heads * head_dim] rows, last dim contiguous
  void* q_out;            // may equal q_in (in place)
  const void* k_in;
  void* k_out;
  const void* cos;        // [max_position, rotary_dim / 2], the dtype of q
  const void* sin;
  int64_t q_in_stride, q_out_stride, k_in_stride, k_out_stride, tokens, max_position;
  int32_t num_q_heads, num_k_heads, head_dim, rotary_dim, dtype, positions_int64, num_threads;
  int32_t interleaved;  // 0: neox (i, i + rotary_dim / 2); 1: GPT-J / GLM pairs (2i, 2i + 1)
};

struct CacheWriteArgs {  // mirrored by kernels/compiled.py; strides in elements
  const void* key;       // [tokens, num_kv_heads, head_dim], last dim contiguous
  const void* value;
  void* k_cache;         // [num_slots, num_kv_heads, row] contiguous (row: head_dim, or
  void* v_cache;         // head_dim int8 + 4 scale bytes if kv_int8)
  const void* slots;     // [tokens] int64 or int32; negative: skip (padding)
  int64_t k_token_stride, k_head_stride, v_token_stride, v_head_stride, tokens;
  int32_t num_kv_heads, head_dim, element_size, slots_int64, num_threads;
  int32_t kv_int8;       // quantize each row (kernels/kv_int8.py); element_size: of key/value
};

struct RmsNormArgs {  // mirrored by kernels/compiled.py; strides in elements
  void* out;            // [rows, hidden] contiguous
  void* residual_out;   // [rows, hidden] contiguous, x + residual (fused variant only)
  const void* x;        // row (o, i) at o * x_outer_stride + i * x_inner_stride
  const void* residual; // nullptr: plain rms_norm
  const void* weight;   // [hidden], same dtype as x
  int64_t x_outer_stride, x_inner_stride, r_outer_stride, r_inner_stride;
  int64_t outer, inner;  // rows = outer * inner
  int32_t hidden, dtype, sum_lanes, num_threads;  // sum_lanes: the vector width torch sums with
  float eps;
  int32_t kind;         // NormKind: RMSNorm, RMSNorm by (1 + weight) in fp32, LayerNorm
  const void* bias;     // LayerNorm's bias (dtype of x) or nullptr
};

int bl_paged_attention(const PagedAttentionArgs* a);
int bl_rotary_embedding(const RotaryArgs* a);
int bl_reshape_and_cache(const CacheWriteArgs* a);
int bl_rms_norm(const RmsNormArgs* a);
int bl_silu_and_mul(void* out, const void* x, int64_t x_stride, int64_t rows, int64_t d,
                    int64_t vec_chunk, int32_t dtype, int32_t num_threads);
int bl_linear(void* out, const void* x, const void* w, const void* bias, int64_t M, int64_t N,
              int64_t K, int64_t x_stride, int64_t out_stride, int32_t dtype,
              int32_t num_threads);
int bl_linear_wbf16(float* out, const float* x, const uint16_t* w, const float* bias, int64_t M,
                    int64_t N, int64_t K, int64_t x_stride, int64_t out_stride,
                    int32_t num_threads);
int bl_linear_panel(float* out, const float* x, const void* wp, const float* bias, int64_t M,
                    int64_t N, int64_t K, int64_t x_stride, int64_t out_stride, int32_t wdtype,
                    int32_t num_threads);
int bl_linear_pairs(uint16_t* out, const uint16_t* x, const void* wp, const uint16_t* bias,
                    int64_t M, int64_t N, int64_t K, int64_t x_stride, int64_t out_stride,
                    int32_t num_threads);
}
