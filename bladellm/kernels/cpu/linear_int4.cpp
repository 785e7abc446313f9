// Weight-only 4-bit linear for small M (decode), fp32 activations:
//   out[m, n] = sum_g s[n, g] * (sum_{k in g} q[n, k] * x[m, k] - z[n, g] * sum_{k in g} x[m, k])
// which is x @ ((q - z) * s).T regrouped so that the inner loop multiplies the integer codes
// (exact in fp32) by x and the scale and zero point are applied once per group.
//
// Layout (quantization/cpu_kernels.py DequantLinear): codes uint8 [N, G, group/2], byte j of a
// group holding column j in its low nibble and column group/2 + j in its high nibble; scales and
// zeros fp32 [N, G]. The weight is streamed from memory once per call at half a byte per
// element (8x fewer bytes than fp32): at M of a few rows the fp32 GEMV is bound by those bytes,
// so decoding nibbles in registers pays. Rows of x tile the weight block (MT rows reuse each
// decoded code vector).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

constexpr int MT = 4;  // activation rows per pass over a weight row

// Eight codes (bytes b[0..7]) -> their low and high nibbles as 8 floats each.
#if defined(__AVX2__)
static inline void nibbles8(const uint8_t* b, __m256* lo, __m256* hi) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i l = _mm_and_si128(bytes, mask);
  const __m128i h = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  *lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l));
  *hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// One weight row n against rows m0..m0+MM of x (MM a template constant so the accumulators
// stay in registers).
template <int MM>
static inline void row(const uint8_t* codes, const float* scales, const float* zeros,
                       const float* x, int64_t xs, const float* xsum, int64_t G, int64_t group,
                       float* acc) {
  const int64_t half = group / 2;
  float total[MM];  // the scalar part: tails, and -s * z * sum(x) per group
  for (int m = 0; m < MM; ++m) total[m] = 0.f;
#if defined(__AVX2__)
  __m256 vtotal[MM];  // sum over groups of s * (codes . x), reduced once at the end
  for (int m = 0; m < MM; ++m) vtotal[m] = _mm256_setzero_ps();
#endif
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = codes + g * half;
    const float* xg = x + g * group;
    const float s = scales[g], z = zeros[g];
    int64_t j = 0;
#if defined(__AVX2__)
    __m256 vacc[MM];
    for (int m = 0; m < MM; ++m) vacc[m] = _mm256_setzero_ps();
    for (; j + 8 <= half; j += 8) {
      __m256 lo, hi;
      nibbles8(c + j, &lo, &hi);
      for (int m = 0; m < MM; ++m) {
        vacc[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg + m * xs + j), vacc[m]);
        vacc[m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + m * xs + half + j), vacc[m]);
      }
    }
    const __m256 vs = _mm256_set1_ps(s);
    for (int m = 0; m < MM; ++m) vtotal[m] = _mm256_fmadd_ps(vs, vacc[m], vtotal[m]);
#endif
    float dot[MM];
    for (int m = 0; m < MM; ++m) dot[m] = 0.f;
    for (; j < half; ++j) {
      const float lo = static_cast<float>(c[j] & 15), hi = static_cast<float>(c[j] >> 4);
      for (int m = 0; m < MM; ++m) dot[m] += lo * xg[m * xs + j] + hi * xg[m * xs + half + j];
    }
    for (int m = 0; m < MM; ++m) total[m] += s * (dot[m] - z * xsum[m * G + g]);
  }
#if defined(__AVX2__)
  for (int m = 0; m < MM; ++m) total[m] += hsum(vtotal[m]);
#endif
  for (int m = 0; m < MM; ++m) acc[m] = total[m];
}

}  // namespace

extern "C" {
// x: fp32 [M, K], rows x_stride apart; codes uint8 [N, K/2]; scales, zeros fp32 [N, K/group];
// bias fp32 [N] or null; out fp32 [M, N], rows out_stride apart. group even, K % group == 0.
// Returns 0, or 1 on a bad shape.
int bl_linear_int4(float* out, const float* x, const uint8_t* codes, const float* scales,
                   const float* zeros, const float* bias, int64_t M, int64_t N, int64_t K,
                   int64_t group, int64_t x_stride, int64_t out_stride, int32_t num_threads) {
  if (group <= 0 || group % 2 || K % group) return 1;
  const int64_t G = K / group;
  // Per row of x, per group: sum of x (the zero point's term).
  std::vector<float> xsum(static_cast<size_t>(M * G));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += x[m * x_stride + k];
      xsum[m * G + g] = s;
    }
  const bool par = num_threads > 1 && N >= 64;
  const int64_t chunk = std::max<int64_t>(1, N / (8 * int64_t(num_threads)));  // as linear.cpp
#pragma omp parallel for num_threads(num_threads) if (par) schedule(dynamic, chunk)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
      const int mm = static_cast<int>(std::min<int64_t>(MT, M - m0));
      float acc[MT];
      const uint8_t* c = codes + n * (K / 2);
      const float* xm = x + m0 * x_stride;
      const float* xsm = xsum.data() + m0 * G;
      switch (mm) {
        case 4: row<4>(c, scales + n * G, zeros + n * G, xm, x_stride, xsm, G, group, acc); break;
        case 3: row<3>(c, scales + n * G, zeros + n * G, xm, x_stride, xsm, G, group, acc); break;
        case 2: row<2>(c, scales + n * G, zeros + n * G, xm, x_stride, xsm, G, group, acc); break;
        default: row<1>(c, scales + n * G, zeros + n * G, xm, x_stride, xsm, G, group, acc);
      }
      for (int m = 0; m < mm; ++m)
        out[(m0 + m) * out_stride + n] = acc[m] + (bias ? bias[n] : 0.f);
    }
  }
  return 0;
}
}
