// Rotary embedding, SiLU-and-mul and the KV-cache write. Semantics: kernels/ref.py. Compiled with
// -ffp-contract=off and rounding through the dtype after every op torch rounds after, so bf16
// results are bit-identical to the reference (silu's exp is SLEEF's, as torch's on x86).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "vec.h"

#include "kernel_args.h"

namespace {

static inline int64_t index_at(const void* p, int is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin, each product and result rounded to T as torch
// does for `x1 * cos - x2 * sin` on T tensors.
template <typename T>
static void rotate_head(const T* in, T* out, const T* cos, const T* sin, int half, int rest) {
  const T* x1 = in;
  const T* x2 = in + half;
  int c = 0;
  for (; c + VLEN <= half; c += VLEN) {
    vfloat a = loadu(x1 + c), b = loadu(x2 + c), co = loadu(cos + c), si = loadu(sin + c);
    vfloat o1 = round_to(a * co, out) - round_to(b * si, out);
    vfloat o2 = round_to(b * co, out) + round_to(a * si, out);
    storeu(out + c, o1);
    storeu(out + half + c, o2);
  }
  for (; c < half; ++c) {
    float a = to_float(x1[c]), b = to_float(x2[c]), co = to_float(cos[c]), si = to_float(sin[c]);
    float o1 = round_to(a * co, out) - round_to(b * si, out);
    float o2 = round_to(b * co, out) + round_to(a * si, out);
    store1(out + c, o1);
    store1(out + half + c, o2);
  }
  if (out != in && rest > 0) std::memcpy(out + 2 * half, in + 2 * half, rest * sizeof(T));
}

// The interleaved (GPT-J / GLM) layout: pair i is dims (2i, 2i + 1), with frequency i.
template <typename T>
static void rotate_head_interleaved(const T* in, T* out, const T* cos, const T* sin, int half,
                                    int rest) {
  for (int c = 0; c < half; ++c) {
    float a = to_float(in[2 * c]), b = to_float(in[2 * c + 1]);
    float co = to_float(cos[c]), si = to_float(sin[c]);
    float o1 = round_to(a * co, out) - round_to(b * si, out);
    float o2 = round_to(b * co, out) + round_to(a * si, out);
    store1(out + 2 * c, o1);
    store1(out + 2 * c + 1, o2);
  }
  if (out != in && rest > 0) std::memcpy(out + 2 * half, in + 2 * half, rest * sizeof(T));
}

template <typename T>
static void rotary(const RotaryArgs& a) {
  const int half = a.rotary_dim / 2, rest = a.head_dim - a.rotary_dim;
  const bool par = a.num_threads > 1 && a.tokens >= 64;
#pragma omp parallel for num_threads(a.num_threads) if (par) schedule(static)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int64_t pos = index_at(a.positions, a.positions_int64, t);
    const T* cos = static_cast<const T*>(a.cos) + pos * half;
    const T* sin = static_cast<const T*>(a.sin) + pos * half;
    const T* qi = static_cast<const T*>(a.q_in) + t * a.q_in_stride;
    T* qo = static_cast<T*>(a.q_out) + t * a.q_out_stride;
    auto rot = a.interleaved ? rotate_head_interleaved<T> : rotate_head<T>;
    for (int h = 0; h < a.num_q_heads; ++h)
      rot(qi + h * a.head_dim, qo + h * a.head_dim, cos, sin, half, rest);
    const T* ki = static_cast<const T*>(a.k_in) + t * a.k_in_stride;
    T* ko = static_cast<T*>(a.k_out) + t * a.k_out_stride;
    for (int h = 0; h < a.num_k_heads; ++h)
      rot(ki + h * a.head_dim, ko + h * a.head_dim, cos, sin, half, rest);
  }
}

// silu(g) * u: torch computes silu as g / (1 + exp(-g)) in fp32 and rounds it to the dtype,
// then rounds the product again. Its vector loop covers whole chunks of `vec_chunk` elements
// per row with SLEEF's exp and the rest with libm's expf; so do we, to match it bit for bit.
template <typename T>
static inline vfloat silu_mul(vfloat g, vfloat u, T* tag) {
  vfloat s = round_to(g / (splat(1.0f) + exp_sleef(-g)), tag);
  return s * u;
}

template <typename T>
static void silu_and_mul(T* out, const T* x, int64_t x_stride, int64_t rows, int64_t d,
                         int64_t vec_chunk, int num_threads) {
  const int64_t vec_end = d / vec_chunk * vec_chunk;
  const bool par = num_threads > 1 && rows > 1 && rows * d >= (1 << 15);
#pragma omp parallel for num_threads(num_threads) if (par) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * x_stride;
    const T* up = gate + d;
    T* o = out + r * d;
    for (int64_t c = 0; c < vec_end; c += VLEN)
      storeu(o + c, silu_mul(loadu(gate + c), loadu(up + c), o));
    for (int64_t c = vec_end; c < d; ++c) {
      const float g = to_float(gate[c]);
      store1(o + c, round_to(g / (1.0f + std::exp(-g)), o) * to_float(up[c]));
    }
  }
}

// ---- activations (plain and gated) ---------------------------------------------------------
// Codes shared with kernels/compiled.py (ACT_CODES). Each computes in fp32 and is rounded once
// to the dtype; SiLU and ReLU reproduce torch bit for bit, the GELUs follow torch's vector
// formulas (erf: its Abramowitz-Stegun polynomial; tanh from SLEEF's exp) to an ulp or so.
enum Act : int32_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kGeluNew = 3, kRelu = 4 };

static inline vfloat vabs(vfloat x) {
  return bit_cast<vfloat>(bit_cast<vuint>(x) & (vuint{} + 0x7fffffffu));
}

// tanh(y) = sign(y) (1 - 2 / (e^{2|y|} + 1)); e^{2|y|} overflows to inf for large |y|: 1.
static inline vfloat vtanh(vfloat y) {
  vfloat e = exp_sleef(splat(2.0f) * vabs(y));
  vfloat t = splat(1.0f) - splat(2.0f) / (e + splat(1.0f));
  vuint sign = bit_cast<vuint>(y) & (vuint{} + 0x80000000u);
  return bit_cast<vfloat>(bit_cast<vuint>(t) | sign);
}

// torch's Vectorized<float>::erf (Abramowitz-Stegun 7.1.26 with SLEEF's exp).
static inline vfloat verf(vfloat x) {
  vuint sign = bit_cast<vuint>(x) & (vuint{} + 0x80000000u);
  vfloat ax = vabs(x);
  vfloat t = splat(1.0f) / fma_exact(splat(0.3275911f), ax, splat(1.0f));
  vfloat r = fma_exact(splat(1.061405429f), t, splat(-1.453152027f));
  r = fma_exact(r, t, splat(1.421413741f));
  r = fma_exact(r, t, splat(-0.284496736f));
  r = fma_exact(r, t, splat(0.254829592f));
  vfloat e = -exp_sleef(-(x * x));
  vfloat y = fma_exact(e * t, r, splat(1.0f));
  return bit_cast<vfloat>(bit_cast<vuint>(y) ^ sign);
}

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kGeluBeta = 0.79788456080286535588f;  // sqrt(2 / pi)

static inline vfloat act_vec(vfloat x, int act) {
  switch (act) {
    case kSilu: return x / (splat(1.0f) + exp_sleef(-x));
    case kGelu: return x * splat(0.5f) * (splat(1.0f) + verf(x * splat(kSqrt1_2)));
    case kGeluTanh: {
      vfloat inner = splat(kGeluBeta) * (x + splat(0.044715f) * (x * x * x));
      return splat(0.5f) * x * (splat(1.0f) + vtanh(inner));
    }
    case kGeluNew: {
      vfloat inner = splat(kGeluBeta) * (x + splat(0.044715f) * (x * x * x));
      return splat(0.5f) * x * (splat(1.0f) + vtanh(inner));
    }
    default: {  // relu; NaN stays NaN
      vint pos = x > splat(0.0f);
      vint nan = x != x;
      return bit_cast<vfloat>(bit_cast<vint>(x) & (pos | nan));
    }
  }
}

static inline float act_scalar(float x, int act) {
  switch (act) {
    case kSilu: return x / (1.0f + std::exp(-x));
    case kGelu: return x * 0.5f * (1.0f + std::erf(x * kSqrt1_2));
    case kGeluTanh:
    case kGeluNew: {
      const float inner = kGeluBeta * (x + 0.044715f * (x * x * x));
      return 0.5f * x * (1.0f + std::tanh(inner));
    }
    default: return x != x ? x : (x > 0.0f ? x : 0.0f);
  }
}

// out[r] = act(x[r][0:d]) (gated: rounded, times up = x[r][d:2d]). torch's vector loop covers
// whole chunks of `vec_chunk` elements per row and finishes with scalar code; so do we.
template <typename T>
static void act_rows(T* out, const T* x, int64_t x_stride, int64_t rows, int64_t d, int act,
                     bool gated, int64_t vec_chunk, int num_threads) {
  const int64_t vec_end = d / vec_chunk * vec_chunk;
  const bool par = num_threads > 1 && rows > 1 && rows * d >= (1 << 15);
#pragma omp parallel for num_threads(num_threads) if (par) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * x_stride;
    T* o = out + r * d;
    for (int64_t c = 0; c < vec_end; c += VLEN) {
      vfloat y = act_vec(loadu(in + c), act);
      if (gated) y = round_to(y, o) * loadu(in + d + c);
      storeu(o + c, y);
    }
    for (int64_t c = vec_end; c < d; ++c) {
      float y = act_scalar(to_float(in[c]), act);
      if (gated) y = round_to(y, o) * to_float(in[d + c]);
      store1(o + c, y);
    }
  }
}

}  // namespace

// Plain (gated = 0: x [rows, d] -> out [rows, d]) or gated (x [rows, 2d] -> out [rows, d])
// activation `act` (enum Act). 0: done; 2: unsupported dtype; 3: bad vec_chunk; 4: bad act.
extern "C" int bl_activation(void* out, const void* x, int64_t x_stride, int64_t rows,
                             int64_t d, int32_t act, int32_t gated, int64_t vec_chunk,
                             int32_t dtype, int32_t num_threads) {
  if (vec_chunk <= 0 || vec_chunk % VLEN != 0) return 3;
  if (act < kSilu || act > kRelu) return 4;
  if (dtype == kFloat32)
    return act_rows(static_cast<float*>(out), static_cast<const float*>(x), x_stride, rows, d,
                    act, gated != 0, vec_chunk, num_threads), 0;
  if (dtype == kBFloat16)
    return act_rows(static_cast<bf16_t*>(out), static_cast<const bf16_t*>(x), x_stride, rows,
                    d, act, gated != 0, vec_chunk, num_threads), 0;
  return 2;
}

// 0: done; 1: a position outside [0, max_position) (nothing written); 2: unsupported dtype.
extern "C" int bl_rotary_embedding(const RotaryArgs* a) {
  for (int64_t t = 0; t < a->tokens; ++t) {
    const int64_t pos = index_at(a->positions, a->positions_int64, t);
    if (pos < 0 || pos >= a->max_position) return 1;
  }
  if (a->dtype == kFloat32) return rotary<float>(*a), 0;
  if (a->dtype == kBFloat16) return rotary<bf16_t>(*a), 0;
  return 2;
}

// vec_chunk: a multiple of VLEN (torch's 2 x Vectorized<float>::size()).
extern "C" int bl_silu_and_mul(void* out, const void* x, int64_t x_stride, int64_t rows,
                               int64_t d, int64_t vec_chunk, int32_t dtype, int32_t num_threads) {
  if (vec_chunk <= 0 || vec_chunk % VLEN != 0) return 3;
  if (dtype == kFloat32)
    return silu_and_mul(static_cast<float*>(out), static_cast<const float*>(x), x_stride, rows,
                        d, vec_chunk, num_threads), 0;
  if (dtype == kBFloat16)
    return silu_and_mul(static_cast<bf16_t*>(out), static_cast<const bf16_t*>(x), x_stride,
                        rows, d, vec_chunk, num_threads), 0;
  return 2;
}

// One row into the int8 format, with the fp32 operations of kv_int8.quantize in its order:
// scale = amax / 127, q = round_half_even(x * (127 / amax)) clamped; scale bytes after q.
template <typename S>
static void quantize_row(const S* src, int d, int8_t* dst) {
  float amax = 0.0f;
  for (int c = 0; c < d; ++c) amax = std::max(amax, std::fabs(to_float(src[c])));
  const float scale = amax / 127.0f;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int c = 0; c < d; ++c) {
    const float y = std::nearbyint(to_float(src[c]) * inv);  // default mode: half to even
    dst[c] = int8_t(std::min(127.0f, std::max(-127.0f, y)));
  }
  std::memcpy(dst + d, &scale, sizeof scale);
}

template <typename S>
static void quantize_rows(const CacheWriteArgs* a) {
  const int d = a->head_dim;
  const int64_t slot_bytes = int64_t(d + 4) * a->num_kv_heads;
  const bool par = a->num_threads > 1 && a->tokens * slot_bytes >= (1 << 18);
#pragma omp parallel for num_threads(a->num_threads) if (par) schedule(static)
  for (int64_t t = 0; t < a->tokens; ++t) {
    const int64_t slot = index_at(a->slots, a->slots_int64, t);
    if (slot < 0) continue;
    int8_t* kd = static_cast<int8_t*>(a->k_cache) + slot * slot_bytes;
    int8_t* vd = static_cast<int8_t*>(a->v_cache) + slot * slot_bytes;
    const S* ks = static_cast<const S*>(a->key) + t * a->k_token_stride;
    const S* vs = static_cast<const S*>(a->value) + t * a->v_token_stride;
    for (int h = 0; h < a->num_kv_heads; ++h) {
      quantize_row(ks + h * a->k_head_stride, d, kd + h * (d + 4));
      quantize_row(vs + h * a->v_head_stride, d, vd + h * (d + 4));
    }
  }
}

// 0: done; 2: unsupported source dtype for an int8 cache. A copy of whole head rows (or their
// quantization); a token with a negative slot (padding) is skipped.
extern "C" int bl_reshape_and_cache(const CacheWriteArgs* a) {
  if (a->kv_int8) {
    if (a->element_size == 4) return quantize_rows<float>(a), 0;
    if (a->element_size == 2) return quantize_rows<bf16_t>(a), 0;
    return 2;
  }
  const int64_t es = a->element_size, row = int64_t(a->head_dim) * es;
  const int64_t slot_bytes = row * a->num_kv_heads;
  const bool par = a->num_threads > 1 && a->tokens * slot_bytes >= (1 << 20);
#pragma omp parallel for num_threads(a->num_threads) if (par) schedule(static)
  for (int64_t t = 0; t < a->tokens; ++t) {
    const int64_t slot = index_at(a->slots, a->slots_int64, t);
    if (slot < 0) continue;
    char* kd = static_cast<char*>(a->k_cache) + slot * slot_bytes;
    char* vd = static_cast<char*>(a->v_cache) + slot * slot_bytes;
    const char* ks = static_cast<const char*>(a->key) + t * a->k_token_stride * es;
    const char* vs = static_cast<const char*>(a->value) + t * a->v_token_stride * es;
    for (int h = 0; h < a->num_kv_heads; ++h) {
      std::memcpy(kd + h * row, ks + h * a->k_head_stride * es, row);
      std::memcpy(vd + h * row, vs + h * a->v_head_stride * es, row);
    }
  }
  return 0;
}
