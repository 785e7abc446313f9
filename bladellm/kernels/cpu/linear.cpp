// Linear layer for small M (decode): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), the
// semantics of F.linear, fp32 accumulation, one rounding to the dtype at the end.
//
// At M of a few rows this is a GEMV: bound by streaming the weight from memory, so the weight
// stays in its natural row-major [N, K] layout (no packed copy): a block of R weight rows is
// streamed once per tile of up to MT activation rows, each (m, n) pair keeps a vector of
// partial sums along K, reduced horizontally once at the end. A block's R rows (R * K * 2
// bytes in bf16) stay in L1 while further M tiles reuse them.
//
// bf16 with AVX512_BF16: vdpbf16ps multiplies pairs of bf16 exactly and adds them into fp32
// lanes (32 K elements per instruction). Elsewhere bf16 is widened to fp32 and FMA'd.
//
// fp32 activations with bf16 weights (bl_linear_wbf16): an fp32 model whose weights are all
// exactly bf16 values (a bf16 checkpoint served in fp32 on a CPU without native bf16) keeps a
// bf16 copy for this kernel. Widening is exact and the FMA sequence is the fp32 kernel's, so
// the result is bit for bit the fp32 kernel's while half the bytes are streamed.
// Compiled with -ffp-contract=fast (acc += x * w is an FMA); the summation order differs from
// oneDNN's/MKL's like any two GEMMs do.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

#ifndef LINEAR_ROWS
#define LINEAR_ROWS 4
#endif
constexpr int R = LINEAR_ROWS;  // weight rows per block
#ifndef LINEAR_MT
#define LINEAR_MT 4
#endif
constexpr int MT = LINEAR_MT;  // activation rows per tile

// Weight rows are streamed from memory once per call (a model's weights do not stay in cache
// between decode steps): prefetch the rows kPrefetchRows ahead of those being multiplied, at
// the same K offset, so several blocks' cache lines are in flight (the hardware prefetchers
// alone keep too few; docs/kernels.md). Prefetching past the end of w is harmless.
#ifndef LINEAR_PF
#define LINEAR_PF 8
#endif
constexpr int64_t kPrefetchRows = LINEAR_PF;

template <class T>
static inline void prefetch(const T* p) {
  __builtin_prefetch(p, 0, 3);
}

template <class T>
static inline void write_out(T* out, int64_t out_stride, const T* bias, int64_t n0, int rr,
                             int mm, float (*sums)[R]) {
  for (int m = 0; m < mm; ++m)
    for (int r = 0; r < rr; ++r) {
      float v = sums[m][r];
      if (bias) v += to_float(bias[n0 + r]);
      store1(out + m * out_stride + n0 + r, v);
    }
}

// Portable path: VLEN-lane vectors (bf16 widened), scalar tail over K % VLEN.
template <class TX, class TW, int RR, int MM>
static inline void tile_generic(const TX* x, int64_t xs, const TW* w, int64_t K,
                                float (*sums)[R]) {
  vfloat acc[MM][RR];
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = vfloat{};
  int64_t k = 0;
  for (; k + VLEN <= K; k += VLEN) {
    vfloat wv[RR];
    for (int r = 0; r < RR; ++r) {
      if (k % (64 / sizeof(TW)) == 0) prefetch(w + r * K + k + kPrefetchRows * K);
      wv[r] = loadu(w + r * K + k);
    }
    for (int m = 0; m < MM; ++m) {
      vfloat xv = loadu(x + m * xs + k);
      for (int r = 0; r < RR; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < RR; ++r) {
      float s = hsum(acc[m][r]);
      // An explicit FMA: whether the compiler contracts this line must not depend on the
      // weight type (the bf16-copy path is bit for bit the fp32 one).
      for (int64_t kk = k; kk < K; ++kk)
        s = __builtin_fmaf(to_float(x[m * xs + kk]), to_float(w[r * K + kk]), s);
      sums[m][r] = s;
    }
}

#if defined(__AVX512BF16__)
// 32 bf16 of K per step; the tail is a zero-filling masked load (masked lanes never fault).
template <int RR, int MM>
static inline void tile_dpbf16(const bf16_t* x, int64_t xs, const bf16_t* w, int64_t K,
                               float (*sums)[R]) {
  __m512 acc[MM][RR];
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k < K; k += 32) {
    __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh wv[RR];
    for (int r = 0; r < RR; ++r) {
      prefetch(w + r * K + k + kPrefetchRows * K);
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
    }
    for (int m = 0; m < MM; ++m) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * xs + k);
      for (int r = 0; r < RR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < RR; ++r) sums[m][r] = hsum(bit_cast<vfloat>(acc[m][r]));
}
#endif

template <class TX, class TW, int RR, int MM>
static inline void tile(const TX* x, int64_t xs, const TW* w, int64_t K, float (*sums)[R]) {
#if defined(__AVX512BF16__)
  if constexpr (sizeof(TX) == 2 && sizeof(TW) == 2) {
    tile_dpbf16<RR, MM>(x, xs, w, K, sums);
    return;
  }
#endif
  tile_generic<TX, TW, RR, MM>(x, xs, w, K, sums);
}

// T: activation, output and bias type; TW: weight type.
template <class T, class TW, int RR>
static inline void block(T* out, int64_t out_stride, const T* x, int64_t xs, const TW* w,
                         const T* bias, int64_t M, int64_t K, int64_t n0) {
  float sums[MT][R];
  for (int64_t m0 = 0; m0 < M; m0 += MT) {
    int mm = int(std::min<int64_t>(MT, M - m0));
    const T* xm = x + m0 * xs;
    if constexpr (MT >= 4) {
      if (mm == 4) { tile<T, TW, RR, 4>(xm, xs, w, K, sums); goto done; }
      if (mm == 3) { tile<T, TW, RR, 3>(xm, xs, w, K, sums); goto done; }
    }
    if (mm >= 2)
      tile<T, TW, RR, 2>(xm, xs, w, K, sums);
    else
      tile<T, TW, RR, 1>(xm, xs, w, K, sums);
    [[maybe_unused]] done:;
    write_out(out + m0 * out_stride, out_stride, bias, n0, RR, mm, sums);
  }
}

template <class T, class TW>
static void linear(T* out, int64_t out_stride, const T* x, int64_t xs, const TW* w,
                   const T* bias, int64_t M, int64_t N, int64_t K, int num_threads) {
  const int64_t full = N / R;
  const int64_t blocks = full + (N % R ? 1 : 0);
  const bool par = num_threads > 1 && blocks >= 2 * num_threads;
  // Chunks of contiguous blocks handed out as threads free up, ~8 per thread: on a shared
  // machine a thread the scheduler sets aside (the API process, a neighbour) no longer holds
  // back the whole GEMV with its static share; each chunk still streams contiguous rows.
  // Every output is computed by one thread in one order: the schedule changes no result.
  const int64_t chunk = std::max<int64_t>(1, blocks / (8 * int64_t(num_threads)));
#pragma omp parallel for num_threads(num_threads) if (par) schedule(dynamic, chunk)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t n0 = b * R;
    if (b < full) {
      block<T, TW, R>(out, out_stride, x, xs, w + n0 * K, bias, M, K, n0);
    } else {
      for (int64_t n = n0; n < N; ++n)
        block<T, TW, 1>(out, out_stride, x, xs, w + n * K, bias, M, K, n);
    }
  }
}

// ---- Panel-packed weights (fp32 activations): M = 1..64 on AVX2 ----
// The weight repacked once at load as [ceil(N / P)][K][P] (P = kPanel outputs, the last panel
// zero-padded): a thread then streams one contiguous run of memory per panel instead of R rows
// at once, which the hardware prefetchers follow better (benchmarks/linear_streamed.py --mode
// panel, docs/kernels.md), and the P outputs sit in the
// vector lanes: no horizontal sums. Each output is one FMA chain along K in order, whatever M
// and the tile: the result of a row does not depend on the other rows of the batch.
//
// Tiles: fp32 weights run over the whole panel (4 vectors) with up to 3 rows: 12 accumulators
// and the weights as memory operands of the FMAs. bf16 weights must be widened into registers:
// one or two rows run over the whole panel, more over each half of it in turn (2 vectors, the
// two halves of one 64-byte line per k) with up to 6 rows, which keeps 12 accumulators and the
// 2 widened vectors within AVX2's 16 registers (3 rows over the whole panel need 17 and spill).
// Halving does not pay for fp32, whose halves are different lines: each pass then streams
// every other line (measured slower, docs/kernels.md).
constexpr int kPanelVecs = 4;
constexpr int kPanel = kPanelVecs * VLEN;
constexpr int kHalfVecs = kPanelVecs / 2;
constexpr int kHalfMT = 6;
constexpr int kFullMT = 3;  // fp32 weights

// out[m, j] (+)= x[m, :] . panel column j for MM rows and the NV vectors of the panel at wp
// (already offset to its first vector); valid: how many of the NV * VLEN outputs exist.
template <class TW, int MM, int NV>
static inline void panel_tile(float* out, int64_t os, const float* x, int64_t xs, const TW* wp,
                              const float* bias, int64_t K, int64_t valid) {
  vfloat acc[MM][NV];
  for (int m = 0; m < MM; ++m)
    for (int h = 0; h < NV; ++h) acc[m][h] = vfloat{};
  for (int64_t k = 0; k < K; ++k) {
    vfloat w[NV];
    for (int h = 0; h < NV; ++h) w[h] = loadu(wp + k * kPanel + h * VLEN);
    for (int m = 0; m < MM; ++m) {
      const vfloat xb = splat(x[m * xs + k]);
      for (int h = 0; h < NV; ++h) acc[m][h] += xb * w[h];
    }
  }
  for (int m = 0; m < MM; ++m) {
    float* o = out + m * os;
    if (valid == NV * VLEN) {
      for (int h = 0; h < NV; ++h)
        storeu(o + h * VLEN, bias ? acc[m][h] + loadu(bias + h * VLEN) : acc[m][h]);
    } else {  // the last, zero-padded panel
      float tmp[NV * VLEN];
      for (int h = 0; h < NV; ++h) storeu(tmp + h * VLEN, acc[m][h]);
      for (int64_t j = 0; j < valid; ++j) o[j] = bias ? tmp[j] + bias[j] : tmp[j];
    }
  }
}

// A tile of mm rows (1..MM) over NV vectors of the panel.
template <class TW, int MM, int NV>
static inline void tile_n(int mm, float* out, int64_t os, const float* x, int64_t xs,
                          const TW* wp, const float* bias, int64_t K, int64_t valid) {
  if constexpr (MM > 1) {
    if (mm < MM) return tile_n<TW, MM - 1, NV>(mm, out, os, x, xs, wp, bias, K, valid);
  }
  panel_tile<TW, MM, NV>(out, os, x, xs, wp, bias, K, valid);
}

// One panel (valid outputs of kPanel) for all M rows.
template <class TW>
static inline void panel_rows(float* out, int64_t os, const float* x, int64_t xs, const TW* wp,
                              const float* bias, int64_t M, int64_t K, int64_t valid) {
  if (sizeof(TW) == 4 && M == 4)  // one 4-row tile (16 accumulators, one spilled) beat 2 + 2
    return panel_tile<TW, 4, kPanelVecs>(out, os, x, xs, wp, bias, K, valid);  // by ~8%
  // Otherwise M spread evenly over the fewest tiles (8 rows run 3 + 3 + 2, or 4 + 4 in halves).
  if (sizeof(TW) == 4 || M <= 2) {
    const int64_t tiles = (M + kFullMT - 1) / kFullMT, base = M / tiles, extra = M % tiles;
    int64_t m0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int mm = int(base + (t < extra ? 1 : 0));
      tile_n<TW, kFullMT, kPanelVecs>(mm, out + m0 * os, os, x + m0 * xs, xs, wp, bias, K,
                                      valid);
      m0 += mm;
    }
    return;
  }
  const int64_t tiles = (M + kHalfMT - 1) / kHalfMT, base = M / tiles, extra = M % tiles;
  for (int half = 0; half < 2; ++half) {
    const int64_t j0 = int64_t(half) * kHalfVecs * VLEN;
    const int64_t part = std::min<int64_t>(kHalfVecs * VLEN, valid - j0);
    if (part <= 0) break;
    int64_t m0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int mm = int(base + (t < extra ? 1 : 0));
      tile_n<TW, kHalfMT, kHalfVecs>(mm, out + m0 * os + j0, os, x + m0 * xs, xs, wp + j0,
                                     bias ? bias + j0 : nullptr, K, part);
      m0 += mm;
    }
  }
}

template <class TW>
static void linear_panel(float* out, int64_t out_stride, const float* x, int64_t xs,
                         const TW* wp, const float* bias, int64_t M, int64_t N, int64_t K,
                         int num_threads) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const bool par = num_threads > 1 && panels >= 2 * num_threads;
  const int64_t chunk = std::max<int64_t>(1, panels / (8 * int64_t(num_threads)));  // as above
#pragma omp parallel for num_threads(num_threads) if (par) schedule(dynamic, chunk)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel;
    panel_rows<TW>(out + n0, out_stride, x, xs, wp + n0 * K, bias ? bias + n0 : nullptr, M, K,
                   std::min<int64_t>(kPanel, N - n0));
  }
}

template <class TW>
static void pack_panels(TW* dst, const TW* w, int64_t N, int64_t K, int num_threads) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // Row by row within blocks of kPackK: each weight row's block is read once, in order, and
  // written down one lane of the panel's block (kPackK x kPanel: 32-64 KB, resident in L2 while
  // it fills, whatever K). Reading k outer took kPanel rows K apart at once, several times
  // slower at load (docs/kernels.md).
  constexpr int64_t kPackK = 256;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && panels > 1)
  for (int64_t p = 0; p < panels; ++p) {
    TW* panel = dst + p * K * kPanel;
    for (int64_t k0 = 0; k0 < K; k0 += kPackK) {
      const int64_t k1 = std::min(K, k0 + kPackK);
      for (int j = 0; j < kPanel; ++j) {
        const int64_t n = p * kPanel + j;
        if (n < N) {
          const TW* row = w + n * K;
          for (int64_t k = k0; k < k1; ++k) panel[k * kPanel + j] = row[k];
        } else {
          for (int64_t k = k0; k < k1; ++k) panel[k * kPanel + j] = TW(0);
        }
      }
    }
  }
}

// ---- Pair panels (bf16 activations and weights) ----
// The weight repacked once at load as [ceil(N / P)][ceil(K / 2)][P] 32-bit lanes, each lane the
// pair (w[n, 2p], w[n, 2p + 1]) (P = kPairPanel outputs; the last panel and an odd K's last
// pair zero-padded). That is the operand layout of AVX512-BF16's vdpbf16ps, which multiplies a
// lane's two bf16 pairs exactly and adds both into the fp32 lane: with x's pair broadcast, one
// instruction does 2 * VLEN multiply-adds for VLEN outputs, no widening, no horizontal sums.
// Without it the same layout runs on FMAs: a loaded vector widens exactly into its even and odd
// halves (a shift and a mask), and x is widened to fp32 once per call. Every output is one chain
// along K in pair order whatever M and the tile (bit-identical across batch sizes), accumulated
// in fp32, rounded to bf16 once with the bias added, as F.linear does in bf16.
// A pair panel is 2 vectors wide: one 64-byte line per pair on AVX2 (16 outputs), two on
// AVX-512 (32), so a tile streams every line it loads; tiles of up to kPairMT rows fit the
// registers (AVX2: 4 rows x 2 accumulators + 4 widened weights + 2 broadcasts = 14 of 16).
constexpr int kPairVecs = 2;
constexpr int kPairPanel = kPairVecs * VLEN;
#if defined(__AVX512BF16__)
constexpr int kPairMT = 8;
#elif VLEN >= 16
constexpr int kPairMT = 6;
#else
constexpr int kPairMT = 4;
#endif

// What a pair tile reads of x: the bf16 rows themselves (vdpbf16ps broadcasts a raw pair), or
// the rows widened to fp32 (the FMA path broadcasts one value at a time).
struct PairX {
  const bf16_t* bf;  // rows `stride` apart
  int64_t stride;
  const float* f32;  // FMA path: [M, K] fp32, rows K apart
};

// One pair p of K for MM rows: acc[m] += x[m, 2p] * w_even + x[m, 2p + 1] * w_odd. Tail: K is
// odd and this is its last pair (x has no element 2p + 1; the weight's odd lanes are 0).
template <int MM, bool Tail>
static inline void pair_step(vfloat (*acc)[kPairVecs], const PairX& x, int64_t m0,
                             const uint32_t* wr, int64_t K, int64_t p) {
#if defined(__AVX512BF16__)
  __m512bh w[kPairVecs];
  for (int h = 0; h < kPairVecs; ++h)
    w[h] = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(wr + h * VLEN));
  for (int m = 0; m < MM; ++m) {
    const bf16_t* xr = x.bf + (m0 + m) * x.stride + 2 * p;
    uint32_t pair;
    if constexpr (Tail)
      pair = xr[0];
    else
      std::memcpy(&pair, xr, sizeof pair);  // x[2p] in the low half, as the weight's lanes
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(pair));
    for (int h = 0; h < kPairVecs; ++h)
      // Vector casts, not bit_cast: its memcpy kept the accumulators on the stack (GCC 12).
      acc[m][h] = (vfloat)_mm512_dpbf16_ps((__m512)acc[m][h], xb, w[h]);
  }
#else
  vfloat we[kPairVecs], wo[kPairVecs];
  for (int h = 0; h < kPairVecs; ++h) {
    vuint u;
    std::memcpy(&u, wr + h * VLEN, sizeof u);
    we[h] = bit_cast<vfloat>(u << 16);
    wo[h] = bit_cast<vfloat>(u & 0xffff0000u);
  }
  for (int m = 0; m < MM; ++m) {
    const float* xr = x.f32 + (m0 + m) * K + 2 * p;
    const vfloat xe = splat(xr[0]);
    for (int h = 0; h < kPairVecs; ++h) acc[m][h] += xe * we[h];
    if constexpr (!Tail) {
      const vfloat xo = splat(xr[1]);
      for (int h = 0; h < kPairVecs; ++h) acc[m][h] += xo * wo[h];
    }
  }
#endif
}

template <int MM>
static inline void pair_tile(bf16_t* out, int64_t os, const PairX& x, int64_t m0,
                             const uint32_t* wp, const bf16_t* bias, int64_t K, int64_t valid) {
  vfloat acc[MM][kPairVecs];
  for (int m = 0; m < MM; ++m)
    for (int h = 0; h < kPairVecs; ++h) acc[m][h] = vfloat{};
  const int64_t full = K / 2;
  for (int64_t p = 0; p < full; ++p) pair_step<MM, false>(acc, x, m0, wp + p * kPairPanel, K, p);
  if (K & 1) pair_step<MM, true>(acc, x, m0, wp + full * kPairPanel, K, full);
  for (int m = 0; m < MM; ++m) {
    bf16_t* o = out + (m0 + m) * os;
    if (valid == kPairPanel) {
      for (int h = 0; h < kPairVecs; ++h)
        storeu(o + h * VLEN, bias ? acc[m][h] + loadu(bias + h * VLEN) : acc[m][h]);
    } else {  // the last, zero-padded panel
      float tmp[kPairPanel];
      for (int h = 0; h < kPairVecs; ++h) storeu(tmp + h * VLEN, acc[m][h]);
      for (int64_t j = 0; j < valid; ++j) store1(o + j, bias ? tmp[j] + to_float(bias[j]) : tmp[j]);
    }
  }
}

template <int MM>
static inline void pair_tile_n(int mm, bf16_t* out, int64_t os, const PairX& x, int64_t m0,
                               const uint32_t* wp, const bf16_t* bias, int64_t K,
                               int64_t valid) {
  if constexpr (MM > 1) {
    if (mm < MM) return pair_tile_n<MM - 1>(mm, out, os, x, m0, wp, bias, K, valid);
  }
  pair_tile<MM>(out, os, x, m0, wp, bias, K, valid);
}

// Rows of x [m0, m0 + M) against every panel.
static void pairs_rows(bf16_t* out, int64_t out_stride, const PairX& px, int64_t m0, int64_t M,
                       const uint32_t* wp, const bf16_t* bias, int64_t N, int64_t K,
                       int num_threads) {
  const int64_t panels = (N + kPairPanel - 1) / kPairPanel;
  const int64_t pairs = (K + 1) / 2;
  const bool par = num_threads > 1 && panels >= 2 * num_threads;
  const int64_t chunk = std::max<int64_t>(1, panels / (8 * int64_t(num_threads)));  // as above
  // M spread evenly over the fewest tiles of up to kPairMT rows.
  const int64_t tiles = (M + kPairMT - 1) / kPairMT, base = M / tiles, extra = M % tiles;
#pragma omp parallel for num_threads(num_threads) if (par) schedule(dynamic, chunk)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPairPanel;
    const int64_t valid = std::min<int64_t>(kPairPanel, N - n0);
    int64_t m = m0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int mm = int(base + (t < extra ? 1 : 0));
      pair_tile_n<kPairMT>(mm, out + n0, out_stride, px, m, wp + p * pairs * kPairPanel,
                           bias ? bias + n0 : nullptr, K, valid);
      m += mm;
    }
  }
}

static void linear_pairs(bf16_t* out, int64_t out_stride, const bf16_t* x, int64_t xs,
                         const uint32_t* wp, const bf16_t* bias, int64_t M, int64_t N, int64_t K,
                         int num_threads) {
  if (M <= 0 || N <= 0) return;  // (the tiling below divides by the number of tiles)
#if defined(__AVX512BF16__)
  pairs_rows(out, out_stride, PairX{x, xs, nullptr}, 0, M, wp, bias, N, K, num_threads);
#else
  // x widened (exactly) once for all panels, a block of rows at a time so the buffer stays
  // at most ~4 MB whatever the step (a prefill of thousands of rows); the calling thread's
  // buffer, kept between calls. Each further block streams the weight again: at hundreds of
  // rows per block the tiles are compute-bound, so that costs little.
  const int64_t budget_rows =
      std::max<int64_t>(kPairMT, (int64_t(1) << 20) / std::max<int64_t>(K, 1));
  const int64_t block = std::min<int64_t>(M, budget_rows / kPairMT * kPairMT);
  static thread_local std::vector<float> widened;
  if (widened.size() < size_t(block * K)) widened.resize(size_t(block * K));
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k) widened[m * K + k] = to_float(x[(m0 + m) * xs + k]);
    // Tiles index x from the block's first row: the buffer's row 0 is row m0 of x.
    pairs_rows(out + m0 * out_stride, out_stride, PairX{nullptr, 0, widened.data()}, 0, rows,
               wp, bias, N, K, num_threads);
  }
#endif
}

static void pack_pairs(uint32_t* dst, const bf16_t* w, int64_t N, int64_t K, int num_threads) {
  const int64_t panels = (N + kPairPanel - 1) / kPairPanel;
  const int64_t pairs = (K + 1) / 2;
  constexpr int64_t kPackPairs = 128;  // blocks along K, as pack_panels
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && panels > 1)
  for (int64_t p = 0; p < panels; ++p) {
    uint32_t* panel = dst + p * pairs * kPairPanel;
    for (int64_t q0 = 0; q0 < pairs; q0 += kPackPairs) {
      const int64_t q1 = std::min(pairs, q0 + kPackPairs);
      for (int j = 0; j < kPairPanel; ++j) {
        const int64_t n = p * kPairPanel + j;
        for (int64_t q = q0; q < q1; ++q) {
          uint32_t v = 0;
          if (n < N) {
            v = w[n * K + 2 * q];
            if (2 * q + 1 < K) v |= uint32_t(w[n * K + 2 * q + 1]) << 16;
          }
          panel[q * kPairPanel + j] = v;
        }
      }
    }
  }
}

}  // namespace

extern "C" {
// Outputs per panel of the packed layout (bl_linear_pack).
int bl_linear_panel_width() { return kPanel; }

// w: [N, K] contiguous, of wdtype (0 fp32, 1 bf16); dst: ceil(N / width) * width * K elements
// of the same type. Returns 0, or 1 for an unknown dtype.
int bl_linear_pack(void* dst, const void* w, int64_t N, int64_t K, int32_t wdtype,
                   int32_t num_threads) {
  if (wdtype == kFloat32)
    pack_panels(static_cast<float*>(dst), static_cast<const float*>(w), N, K, num_threads);
  else if (wdtype == kBFloat16)
    pack_panels(static_cast<bf16_t*>(dst), static_cast<const bf16_t*>(w), N, K, num_threads);
  else
    return 1;
  return 0;
}

// fp32 x [M, K] (rows x_stride apart), bias [N] or null, out [M, N] (rows out_stride apart);
// wp: the weight packed by bl_linear_pack, fp32 or (wdtype 1) its exact bf16 copy. Returns 0.
int bl_linear_panel(float* out, const float* x, const void* wp, const float* bias, int64_t M,
                    int64_t N, int64_t K, int64_t x_stride, int64_t out_stride, int32_t wdtype,
                    int32_t num_threads) {
  if (wdtype == kFloat32)
    linear_panel(out, out_stride, x, x_stride, static_cast<const float*>(wp), bias, M, N, K,
                 num_threads);
  else if (wdtype == kBFloat16)
    linear_panel(out, out_stride, x, x_stride, static_cast<const bf16_t*>(wp), bias, M, N, K,
                 num_threads);
  else
    return 1;
  return 0;
}

// x: [M, K] rows x_stride apart (last dim contiguous); w: [N, K] contiguous; bias: [N] or
// null; out: [M, N] rows out_stride apart. All of dtype (0 fp32, 1 bf16). Returns 0.
int bl_linear(void* out, const void* x, const void* w, const void* bias, int64_t M, int64_t N,
              int64_t K, int64_t x_stride, int64_t out_stride, int32_t dtype,
              int32_t num_threads) {
  if (dtype == kBFloat16)
    linear(static_cast<bf16_t*>(out), out_stride, static_cast<const bf16_t*>(x), x_stride,
           static_cast<const bf16_t*>(w), static_cast<const bf16_t*>(bias), M, N, K,
           num_threads);
  else if (dtype == kFloat32)
    linear(static_cast<float*>(out), out_stride, static_cast<const float*>(x), x_stride,
           static_cast<const float*>(w), static_cast<const float*>(bias), M, N, K,
           num_threads);
  else
    return 1;
  return 0;
}

// fp32 x, bias and out; w: [N, K] bf16 (see the top of the file). Returns 0.
int bl_linear_wbf16(float* out, const float* x, const bf16_t* w, const float* bias, int64_t M,
                    int64_t N, int64_t K, int64_t x_stride, int64_t out_stride,
                    int32_t num_threads) {
  linear(out, out_stride, x, x_stride, w, bias, M, N, K, num_threads);
  return 0;
}

// Outputs per panel of the pair layout (bl_linear_pack_pairs).
int bl_linear_pair_panel_width() { return kPairPanel; }

// w: [N, K] bf16, contiguous; dst: ceil(N / width) * ceil(K / 2) * width 32-bit lanes (twice
// as many bf16). Returns 0.
int bl_linear_pack_pairs(void* dst, const bf16_t* w, int64_t N, int64_t K, int32_t num_threads) {
  pack_pairs(static_cast<uint32_t*>(dst), w, N, K, num_threads);
  return 0;
}

// bf16 x [M, K] (rows x_stride apart), bias [N] bf16 or null, out [M, N] bf16 (rows out_stride
// apart); wp: the weight packed by bl_linear_pack_pairs. Returns 0.
int bl_linear_pairs(bf16_t* out, const bf16_t* x, const void* wp, const bf16_t* bias, int64_t M,
                    int64_t N, int64_t K, int64_t x_stride, int64_t out_stride,
                    int32_t num_threads) {
  linear_pairs(out, out_stride, x, x_stride, static_cast<const uint32_t*>(wp), bias, M, N, K,
               num_threads);
  return 0;
}

// 1 when bf16 runs on vdpbf16ps in this build.
int bl_linear_dpbf16() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}
}
