// SIMDe stand-in for immintrin.h: AVX-512 intrinsics emulated on any x86, so the AVX-512 and
// AVX512-BF16 builds of the kernels can be tested on AVX2 machines (correctness only).
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <cstdint>
#include <cstring>

// What SIMDe 0.7.4 lacks of what the kernels use (scalar; exact).
typedef uint32_t __mmask32;
static inline __m512i _mm512_maskz_cvtepu16_epi32(simde__mmask16 k, __m256i a) {
  uint16_t in[16]; int32_t out[16]; std::memcpy(in, &a, 32);
  for (int i = 0; i < 16; ++i) out[i] = ((k >> i) & 1) ? (int32_t)in[i] : 0;
  __m512i r; std::memcpy(&r, out, 64); return r;
}
static inline __m512i _mm512_maskz_cvtepi8_epi32(simde__mmask16 k, __m128i a) {
  int8_t in[16]; int32_t out[16]; std::memcpy(in, &a, 16);
  for (int i = 0; i < 16; ++i) out[i] = ((k >> i) & 1) ? (int32_t)in[i] : 0;
  __m512i r; std::memcpy(&r, out, 64); return r;
}
static inline __m512 _mm512_maskz_cvtepi32_ps(simde__mmask16 k, __m512i a) {
  int32_t in[16]; float out[16]; std::memcpy(in, &a, 64);
  for (int i = 0; i < 16; ++i) out[i] = ((k >> i) & 1) ? (float)in[i] : 0.0f;
  __m512 r; std::memcpy(&r, out, 64); return r;
}
// Masked-off lanes are not read (the kernels rely on it at row ends).
static inline __m512i _mm512_maskz_loadu_epi16(__mmask32 k, const void* p) {
  const uint16_t* in = static_cast<const uint16_t*>(p); uint16_t out[32];
  for (int i = 0; i < 32; ++i) out[i] = ((k >> i) & 1) ? in[i] : 0;
  __m512i r; std::memcpy(&r, out, 64); return r;
}
