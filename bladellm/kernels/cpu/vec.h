// Portable SIMD helpers on GCC vector extensions: one source compiles to AVX-512 (16 lanes),
// AVX2 (8 lanes) or SSE/NEON (4 lanes) depending on the -m flags, with no intrinsics. The lane
// count follows the widest native register so every vector op is one instruction.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VLEN 16
#elif defined(__AVX2__) || defined(__AVX__)
#define VLEN 8
#else
#define VLEN 4
#endif

typedef float vfloat __attribute__((vector_size(VLEN * 4)));
typedef int32_t vint __attribute__((vector_size(VLEN * 4)));
typedef uint32_t vuint __attribute__((vector_size(VLEN * 4)));
typedef uint16_t vhalf __attribute__((vector_size(VLEN * 2)));

// dtype codes shared with the Python wrapper (kernels/compiled.py).
enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1 };
typedef uint16_t bf16_t;  // raw bits; bf16 is the upper half of an fp32

template <class To, class From>
static inline To bit_cast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "size");
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

// Every lane x. `vfloat{} + x` would say it without intrinsics, but 0 + x is not x for x = -0,
// so GCC must emit the add: a scalar add and a register shuffle per broadcast, in the inner loop
// of every tile (the panel linear kernel ran measurably slower for it, docs/kernels.md). The
// intrinsic is one vbroadcastss from memory, a pure load.
static inline vfloat splat(float x) {
#if defined(__AVX512F__)
  return bit_cast<vfloat>(_mm512_set1_ps(x));
#elif defined(__AVX__)
  return bit_cast<vfloat>(_mm256_set1_ps(x));
#else
  vfloat v;
  for (int i = 0; i < VLEN; ++i) v[i] = x;
  return v;
#endif
}

static inline vfloat loadu(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}
static inline void storeu(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// bf16 -> fp32 is a shift into the upper half. GCC splits the generic widening of 16 lanes
// into two halves plus an insert (5 instructions, the hottest part of bf16 attention), so the
// x86 builds say vpmovzxwd directly.
static inline vfloat loadu(const bf16_t* p) {
#if defined(__AVX512F__)
  // The maskz form: the plain one trips GCC 12's -Wmaybe-uninitialized inside immintrin.h.
  __m512i w = _mm512_maskz_cvtepu16_epi32(
      0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return bit_cast<vfloat>(bit_cast<vuint>(w) << 16);
#elif defined(__AVX2__)
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return bit_cast<vfloat>(bit_cast<vuint>(w) << 16);
#else
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  return bit_cast<vfloat>(__builtin_convertvector(h, vuint) << 16);
#endif
}

// int8 -> fp32 (the int8 KV cache): VLEN bytes sign-extended and converted exactly.
static inline vfloat loadu(const int8_t* p) {
#if defined(__AVX512F__)
  // maskz forms: the plain ones trip GCC 12's -Wmaybe-uninitialized (as in loadu(bf16)).
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return bit_cast<vfloat>(_mm512_maskz_cvtepi32_ps(0xffff, _mm512_maskz_cvtepi8_epi32(0xffff, b)));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return bit_cast<vfloat>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
#else
  typedef int8_t vbyte __attribute__((vector_size(VLEN)));
  vbyte b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vfloat);
#endif
}

// Round to nearest even exactly as c10::BFloat16 does (NaN -> 0x7fc0), so results match torch.
static inline void storeu(bf16_t* p, vfloat x) {
  vuint u = bit_cast<vuint>(x);
  vuint r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  r = (x != x) ? vuint{} + 0x7fc0u : r;
  vhalf h = __builtin_convertvector(r, vhalf);
  std::memcpy(p, &h, sizeof h);
}

static inline float to_float(float x) { return x; }
static inline float to_float(bf16_t x) { return bit_cast<float>(uint32_t(x) << 16); }
static inline void store1(float* p, float x) { *p = x; }
static inline void store1(bf16_t* p, float x) {
  uint32_t u = bit_cast<uint32_t>(x);
  *p = x != x ? bf16_t(0x7fc0) : bf16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// The value a float has once stored in T (rounding through bf16 where T is bf16).
static inline float round_to(float x, float*) { return x; }
static inline float round_to(float x, bf16_t*) {
  bf16_t h;
  store1(&h, x);
  return to_float(h);
}
static inline vfloat round_to(vfloat x, float*) { return x; }
static inline vfloat round_to(vfloat x, bf16_t*) {
  vuint u = bit_cast<vuint>(x);
  vuint r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
  return (x != x) ? x : bit_cast<vfloat>(r);
}

// ---- horizontal reductions ------------------------------------------------------------------

constexpr int xor_lane(int h, int lane) { return lane ^ h; }
template <int H, int... L>
constexpr vint xor_mask(std::integer_sequence<int, L...>) { return vint{xor_lane(H, L)...}; }

template <int H = VLEN / 2>
static inline float hsum(vfloat v) {
  if constexpr (H == 0) {
    return v[0];
  } else {
    constexpr vint m = xor_mask<H>(std::make_integer_sequence<int, VLEN>{});
    return hsum<H / 2>(v + __builtin_shuffle(v, m));
  }
}

template <int H = VLEN / 2>
static inline float hmax(vfloat v) {
  if constexpr (H == 0) {
    return v[0];
  } else {
    constexpr vint m = xor_mask<H>(std::make_integer_sequence<int, VLEN>{});
    vfloat w = __builtin_shuffle(v, m);
    return hmax<H / 2>(v > w ? v : w);
  }
}

// transpose_sum: x[0..VLEN) -> y with y[i] = sum of the lanes of x[i]. A tree of 2-source
// shuffles (log2(VLEN) levels, VLEN-1 adds) instead of VLEN separate horizontal sums. Each level
// halves the lanes per vector: out lane L of the pair (a, b) at half-width H takes block
// L / 2H of a (first H lanes of the output block) or of b (second H lanes).
constexpr int pair_lane(int h, int lane) {
  return lane % (2 * h) < h ? lane / (2 * h) * 2 * h + lane % (2 * h)
                            : VLEN + lane / (2 * h) * 2 * h + lane % (2 * h) - h;
}
template <int H, int... L>
constexpr vint pair_mask(std::integer_sequence<int, L...>) { return vint{pair_lane(H, L)...}; }

constexpr int bit_reverse(int i) {
  int r = 0;
  for (int b = 1; b < VLEN; b <<= 1) r = (r << 1) | ((i & b) ? 1 : 0);
  return r;
}

template <int H>
static inline void transpose_sum_level(vfloat* x) {
  if constexpr (H >= 1) {
    constexpr vint lo = pair_mask<H>(std::make_integer_sequence<int, VLEN>{});
    constexpr vint hi = lo + H;
    for (int i = 0; i < H; ++i)  // 2H vectors left: H pairs
      x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo) +
             __builtin_shuffle(x[2 * i], x[2 * i + 1], hi);
    transpose_sum_level<H / 2>(x);
  }
}

// The tree leaves lane L holding input bit_reverse(L); feeding inputs in bit-reversed order
// (x[i] = part[bit_reverse(i)]) makes lane L the sum of part[L].
static inline vfloat transpose_sum(const vfloat* part) {
  vfloat x[VLEN];
  for (int i = 0; i < VLEN; ++i) x[i] = part[bit_reverse(i)];
  transpose_sum_level<VLEN / 2>(x);
  return x[0];
}

// ---- exponentials ---------------------------------------------------------------------------

// 2^x for x <= 0 (softmax after subtracting the running max); Cephes exp2f polynomial, ~2 ulp.
// x < -126 (including -inf from masked keys) gives exactly 0.
static inline vfloat exp2_neg(vfloat x) {
  const vfloat lo = splat(-126.0f);
  vint keep = x >= lo;
  x = x < lo ? lo : x;
  const vfloat magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vfloat t = x + magic;
  vfloat n = t - magic;
  vfloat f = x - n;  // [-0.5, 0.5]
  vint e = (bit_cast<vint>(t) - bit_cast<vint>(magic)) << 23;
  vfloat p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  vfloat r = bit_cast<vfloat>(bit_cast<vint>(p) + e);
  return keep ? r : vfloat{};
}

// Fused multiply-add in every build: the elementwise files are compiled with -ffp-contract=off
// (so `a * b + c` rounds twice, like torch's separate ops), yet torch's SLEEF exp uses FMA.
// GCC turns the lane loop into one vfmadd where FMA exists.
static inline vfloat fma_exact(vfloat a, vfloat b, vfloat c) {
  vfloat r;
  for (int i = 0; i < VLEN; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
}

// e^x exactly as SLEEF's expf_u10 (torch's Vectorized<float>::exp on x86), so silu rounds
// like torch's bit for bit: Cody-Waite reduction by ln 2, a degree-6 polynomial, 2^q applied
// in two halves; x < -104 -> 0, x > 100 -> inf.
static inline vfloat exp_sleef(vfloat d) {
  const vfloat magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to nearest even
  vfloat t = d * 1.442695040888963407359924681001892137426645954152985934135449406931f + magic;
  vfloat qf = t - magic;
  vint q = bit_cast<vint>(t) - bit_cast<vint>(magic);
  vfloat s = fma_exact(qf, splat(-0.693145751953125f), d);
  s = fma_exact(qf, splat(-1.428606765330187045e-06f), s);
  vfloat u = splat(0.000198527617612853646278381f);
  u = fma_exact(u, s, splat(0.00139304355252534151077271f));
  u = fma_exact(u, s, splat(0.00833336077630519866943359f));
  u = fma_exact(u, s, splat(0.0416664853692054748535156f));
  u = fma_exact(u, s, splat(0.166666671633720397949219f));
  u = fma_exact(u, s, splat(0.5f));
  u = splat(1.0f) + fma_exact(s * s, u, s);
  vint h = q >> 1;
  u = u * bit_cast<vfloat>((h + 0x7f) << 23) * bit_cast<vfloat>((q - h + 0x7f) << 23);
  u = d < splat(-104.0f) ? vfloat{} : u;
  return d > splat(100.0f) ? splat(__builtin_inff()) : u;
}
