// A whole Llama-layout decoder stack in one call: for decode-sized batches (every linear within
// the GEMV kernel's row limit) the model's ~10 kernel calls per layer run back to back here
// instead of from Python, where each cost tens of microseconds of wrapper code (argument
// checks, ctypes structs, tensor allocations): a sizeable share of a small model's step
// (docs/kernels.md).
//
// It calls the same entry points, with the same arguments, in the same order as the modules do
// (model/models/llama.py), so its output is bit-identical to theirs; the Python side
// (model/decoder_stack.py) decides when it applies and falls back to the modules otherwise.
#include <cstdint>

#include "kernel_args.h"
#include "vec.h"

extern "C" {
// LinearArgs::kind, as CompiledKernels.linear chose for the layer (kernels/compiled.py).
enum LinearKind : int32_t {
  kRows = 0,       // bl_linear: weight [n, k] of the layer's dtype
  kRowsBf16 = 1,   // bl_linear_wbf16: fp32 activations, the weight's exact bf16 copy
  kPanel = 2,      // bl_linear_panel: fp32, the weight packed in panels
  kPanelBf16 = 3,  // bl_linear_panel: fp32 activations, the exact bf16 copy packed in panels
  kPairs = 4,      // bl_linear_pairs: bf16, the weight packed in pair panels
};

struct LinearArgs {    // out[M, n] = x[M, k] @ weight^T + bias
  const void* weight;  // as kind says
  const void* bias;    // [n] or null
  int64_t n, k;
  int32_t kind;
};

struct DecoderLayerArgs {
  const void* input_norm;  // [hidden]
  const void* post_norm;   // [hidden]
  LinearArgs qkv, o, gate_up, down;  // qkv: q | k | v heads; gate_up: gate | up
  void* k_cache;           // [num_blocks, block_size, num_kv_heads, row]
  void* v_cache;
};

struct DecoderStackArgs {  // mirrored by kernels/compiled.py; buffers contiguous
  void* out;               // [tokens, hidden]: the final norm's output
  const void* hidden;      // [tokens, hidden]: the embeddings (read only)
  const void* positions;   // [tokens], int64 or int32
  const void* slots;       // [tokens], int64 or int32
  const int32_t* block_tables;     // [num_reqs, block_table_stride]
  const int32_t* query_start_loc;  // [num_reqs + 1]
  const int32_t* seq_lens;         // [num_reqs]
  void* normed;            // scratch [tokens, hidden]
  void* residual0;         // scratch [tokens, hidden] x 2 (the residual stream, ping-pong)
  void* residual1;
  void* proj;              // scratch [tokens, hidden]: o_proj / down_proj outputs
  void* qkv;               // scratch [tokens, qkv.n]
  void* attn;              // scratch [tokens, num_heads * head_dim]
  void* gate_up;           // scratch [tokens, gate_up.n]
  void* act;               // scratch [tokens, gate_up.n / 2]
  const DecoderLayerArgs* layers;
  const void* final_norm;  // [hidden]
  const void* cos;         // [max_position, rotary_dim / 2]
  const void* sin;
  int64_t tokens, block_table_stride, max_position, silu_chunk;
  int32_t num_layers, num_reqs, hidden_size, num_heads, num_kv_heads, head_dim, rotary_dim;
  int32_t block_size, dtype, positions_int64, slots_int64, kv_int8, sum_lanes, num_threads;
  float eps, scale;
};
}

namespace {

int linear(const DecoderStackArgs& s, const LinearArgs& l, void* out, const void* x) {
  if (l.kind == kPanel || l.kind == kPanelBf16)
    return bl_linear_panel(static_cast<float*>(out), static_cast<const float*>(x), l.weight,
                           static_cast<const float*>(l.bias), s.tokens, l.n, l.k, l.k, l.n,
                           l.kind == kPanel ? kFloat32 : kBFloat16, s.num_threads);
  if (l.kind == kPairs)
    return bl_linear_pairs(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x),
                           l.weight, static_cast<const uint16_t*>(l.bias), s.tokens, l.n, l.k,
                           l.k, l.n, s.num_threads);
  if (l.kind == kRowsBf16)
    return bl_linear_wbf16(static_cast<float*>(out), static_cast<const float*>(x),
                           static_cast<const uint16_t*>(l.weight),
                           static_cast<const float*>(l.bias), s.tokens, l.n, l.k, l.k, l.n,
                           s.num_threads);
  return bl_linear(out, x, l.weight, l.bias, s.tokens, l.n, l.k, l.k, l.n, s.dtype,
                   s.num_threads);
}

// out = norm(x (+ residual)); residual_out = x + residual when residual is given.
int norm(const DecoderStackArgs& s, void* out, void* residual_out, const void* x,
         const void* residual, const void* weight) {
  RmsNormArgs a{out, residual_out, x, residual, weight, s.hidden_size, 0, s.hidden_size, 0,
                s.tokens, 1, s.hidden_size, s.dtype, s.sum_lanes, s.num_threads, s.eps};
  return bl_rms_norm(&a);
}

int layer(const DecoderStackArgs& s, const DecoderLayerArgs& l, const void** residual,
          int* spare) {
  void* res_bufs[2] = {s.residual0, s.residual1};
  const int64_t es = s.dtype == kFloat32 ? 4 : 2;
  const int64_t q_size = int64_t(s.num_heads) * s.head_dim;
  const int64_t kv_size = int64_t(s.num_kv_heads) * s.head_dim;
  const int64_t width = l.qkv.n;
  char* q = static_cast<char*>(s.qkv);
  char* k = q + q_size * es;
  char* v = k + kv_size * es;
  int rc;
  if (*residual == nullptr) {  // first layer: the embeddings are the residual stream
    if ((rc = norm(s, s.normed, nullptr, s.hidden, nullptr, l.input_norm))) return rc;
    *residual = s.hidden;
  } else {
    if ((rc = norm(s, s.normed, res_bufs[*spare], s.proj, *residual, l.input_norm))) return rc;
    *residual = res_bufs[*spare];
    *spare ^= 1;
  }
  if ((rc = linear(s, l.qkv, s.qkv, s.normed))) return rc;
  RotaryArgs rot{s.positions, q, q, k, k, s.cos, s.sin, width, width, width, width, s.tokens,
                 s.max_position, s.num_heads, s.num_kv_heads, s.head_dim, s.rotary_dim, s.dtype,
                 s.positions_int64, s.num_threads};
  if ((rc = bl_rotary_embedding(&rot))) return 10 + rc;
  CacheWriteArgs cw{k, v, l.k_cache, l.v_cache, s.slots, width, s.head_dim, width, s.head_dim,
                    s.tokens, s.num_kv_heads, s.head_dim, int32_t(es), s.slots_int64,
                    s.num_threads, s.kv_int8};
  if ((rc = bl_reshape_and_cache(&cw))) return 20 + rc;
  PagedAttentionArgs at{s.attn, q, l.k_cache, l.v_cache, s.block_tables, s.query_start_loc,
                        s.seq_lens, width, s.head_dim, s.block_table_stride, s.num_reqs,
                        s.num_heads, s.num_kv_heads, s.head_dim, s.block_size, s.dtype,
                        s.num_threads, s.scale, s.kv_int8};
  if ((rc = bl_paged_attention(&at))) return 30 + rc;
  if ((rc = linear(s, l.o, s.proj, s.attn))) return rc;
  if ((rc = norm(s, s.normed, res_bufs[*spare], s.proj, *residual, l.post_norm))) return rc;
  *residual = res_bufs[*spare];
  *spare ^= 1;
  if ((rc = linear(s, l.gate_up, s.gate_up, s.normed))) return rc;
  const int64_t d = l.gate_up.n / 2;
  if ((rc = bl_silu_and_mul(s.act, s.gate_up, l.gate_up.n, s.tokens, d, s.silu_chunk, s.dtype,
                            s.num_threads)))
    return 40 + rc;
  return linear(s, l.down, s.proj, s.act);
}

}  // namespace

// 0: done; otherwise the failing step's code (10+: rotary, 20+: cache write, 30+: attention,
// 40+: silu; below 10: a norm or linear). The caller checked shapes and dtypes.
extern "C" int bl_decoder_stack(const DecoderStackArgs* s) {
  if (s->num_layers < 1 || s->tokens < 1) return 1;
  const void* residual = nullptr;
  int spare = 0;
  for (int i = 0; i < s->num_layers; ++i) {
    int rc = layer(*s, s->layers[i], &residual, &spare);
    if (rc) return rc;
  }
  return norm(*s, s->out, (spare ? s->residual1 : s->residual0), s->proj, residual,
              s->final_norm);
}
