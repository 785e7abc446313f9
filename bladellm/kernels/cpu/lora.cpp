// Batched multi-LoRA delta (Punica's SGMV shrink + expand, fused, in place):
//   out[t, o[j] : o[j+1]] += (x[t] @ a[s][:, j*r : (j+1)*r]) @ b[s][j*r : (j+1)*r, o[j] : o[j+1]]
// for every token t of every segment (tokens sharing adapter slot s), for each output slice j
// of a fused layer (q/k/v, gate/up: n slices, slice j reads only its r rank columns of A and
// its diagonal block of B, so the block-diagonal zeros of the stacks are never multiplied).
//
// One call per layer replaces the PyTorch path's gather, two batched matmuls, padding and
// scatter-add. The tokens come grouped by slot (``order``, ``seg_start``, computed once per
// step): a work item is up to MT tokens of one segment, which load each A row / B row once for
// all of them (the slot's weights stay in L1/L2 while its tokens are processed). Shrink keeps
// MT x (up to NV vectors of the rank) sums in registers over the K loop; expand keeps MT x NV
// vectors of output columns over the r loop, then adds them to ``out`` (rounded once to its
// dtype). fp32 accumulation throughout.
//
// Threads: decode-sized calls do a few MFLOP; forking the OpenMP team for them costs more than
// it saves when the cores are shared (a parked worker stalls the whole step), so the team is
// only used above kParallelMacs multiply-adds (prefill chunks).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

constexpr int MT = 4;  // tokens per work item
constexpr int NV = 4;  // vectors of rank (shrink) / output columns (expand) kept in registers
constexpr int64_t kParallelMacs = int64_t(16) << 20;

template <class W>
static inline vfloat loadw(const W* p) { return loadu(p); }

// h[m][0:W] = x[tok[m]] @ A  (A: [K, Wd] row-major, columns c0 .. c0 + nv*VLEN)
template <class T, class W, int MM, int NVV>
static inline void shrink_chunk(float* h, int64_t Wd, const T* const* xr, const W* A, int64_t K,
                                int64_t c0) {
  vfloat acc[MM][NVV];
  for (int m = 0; m < MM; ++m)
    for (int v = 0; v < NVV; ++v) acc[m][v] = vfloat{};
  for (int64_t k = 0; k < K; ++k) {
    const W* arow = A + k * Wd + c0;
    vfloat av[NVV];
    for (int v = 0; v < NVV; ++v) av[v] = loadw(arow + v * VLEN);
    for (int m = 0; m < MM; ++m) {
      vfloat xv = splat(to_float(xr[m][k]));
      for (int v = 0; v < NVV; ++v) acc[m][v] += xv * av[v];
    }
  }
  for (int m = 0; m < MM; ++m)
    for (int v = 0; v < NVV; ++v) storeu(h + m * Wd + c0 + v * VLEN, acc[m][v]);
}

template <class T, class W, int MM>
static void shrink(float* h, int64_t Wd, const T* const* xr, const W* A, int64_t K) {
  int64_t c0 = 0;
  for (; c0 + NV * VLEN <= Wd; c0 += NV * VLEN) shrink_chunk<T, W, MM, NV>(h, Wd, xr, A, K, c0);
  switch ((Wd - c0) / VLEN) {
    case 3: shrink_chunk<T, W, MM, 3>(h, Wd, xr, A, K, c0); c0 += 3 * VLEN; break;
    case 2: shrink_chunk<T, W, MM, 2>(h, Wd, xr, A, K, c0); c0 += 2 * VLEN; break;
    case 1: shrink_chunk<T, W, MM, 1>(h, Wd, xr, A, K, c0); c0 += VLEN; break;
    default: break;
  }
  for (int m = 0; m < MM; ++m)  // rank columns past the last full vector
    for (int64_t c = c0; c < Wd; ++c) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += to_float(xr[m][k]) * to_float(A[k * Wd + c]);
      h[m * Wd + c] = s;
    }
}

// out[tok[m]][c0 .. c0 + NVV*VLEN] += h[m][q0 .. q0 + r] @ B[q0 .. q0 + r][c0 ..]
template <class T, class W, int MM, int NVV>
static inline void expand_chunk(T* const* orow, const float* h, int64_t Wd, const W* B, int64_t N,
                                int64_t q0, int64_t r, int64_t c0) {
  vfloat acc[MM][NVV];
  for (int m = 0; m < MM; ++m)
    for (int v = 0; v < NVV; ++v) acc[m][v] = vfloat{};
  for (int64_t q = q0; q < q0 + r; ++q) {
    const W* brow = B + q * N + c0;
    vfloat bv[NVV];
    for (int v = 0; v < NVV; ++v) bv[v] = loadw(brow + v * VLEN);
    for (int m = 0; m < MM; ++m) {
      vfloat hv = splat(h[m * Wd + q]);
      for (int v = 0; v < NVV; ++v) acc[m][v] += hv * bv[v];
    }
  }
  for (int m = 0; m < MM; ++m)
    for (int v = 0; v < NVV; ++v) {
      T* p = orow[m] + c0 + v * VLEN;
      storeu(p, loadu(p) + acc[m][v]);
    }
}

template <class T, class W, int MM>
static void expand(T* const* orow, const float* h, int64_t Wd, const W* B, int64_t N, int64_t q0,
                   int64_t r, int64_t lo, int64_t hi) {
  int64_t c0 = lo;
  for (; c0 + NV * VLEN <= hi; c0 += NV * VLEN)
    expand_chunk<T, W, MM, NV>(orow, h, Wd, B, N, q0, r, c0);
  for (; c0 + VLEN <= hi; c0 += VLEN) expand_chunk<T, W, MM, 1>(orow, h, Wd, B, N, q0, r, c0);
  for (int m = 0; m < MM; ++m)  // columns past the last full vector
    for (int64_t c = c0; c < hi; ++c) {
      float s = 0.f;
      for (int64_t q = q0; q < q0 + r; ++q) s += h[m * Wd + q] * to_float(B[q * N + c]);
      store1(orow[m] + c, to_float(orow[m][c]) + s);
    }
}

template <class T, class W, int MM>
static void item(T* out, int64_t os, const T* x, int64_t xs, const W* A, const W* B,
                 const int64_t* tok, int64_t K, int64_t Wd, int64_t N, int64_t r,
                 const int64_t* slice_off, int n, float* h) {
  const T* xr[MM];
  T* orow[MM];
  for (int m = 0; m < MM; ++m) {
    xr[m] = x + tok[m] * xs;
    orow[m] = out + tok[m] * os;
  }
  shrink<T, W, MM>(h, Wd, xr, A, K);
  for (int j = 0; j < n; ++j)
    expand<T, W, MM>(orow, h, Wd, B, N, j * r, r, slice_off[j], slice_off[j + 1]);
}

template <class T, class W>
static void lora(T* out, int64_t os, const T* x, int64_t xs, const W* A, const W* B,
                 const int64_t* order, const int64_t* seg_start, const int64_t* seg_slot,
                 int64_t num_seg, int64_t K, int64_t Wd, int64_t N, int64_t r,
                 const int64_t* slice_off, int n, int num_threads) {
  // Work items: (first position in order, token count <= MT, slot).
  std::vector<int64_t> items;
  for (int64_t g = 0; g < num_seg; ++g)
    for (int64_t p = seg_start[g]; p < seg_start[g + 1]; p += MT)
      items.insert(items.end(), {p, std::min<int64_t>(MT, seg_start[g + 1] - p), seg_slot[g]});
  const int64_t num_items = int64_t(items.size()) / 3;
  const int64_t tokens = seg_start[num_seg] - seg_start[0];
  const bool par = num_threads > 1 && num_items >= 2 &&
                   tokens * (K * Wd + r * N) >= kParallelMacs;
#pragma omp parallel num_threads(num_threads) if (par)
  {
    std::vector<float> h(MT * Wd);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_items; ++i) {
      const int64_t* tok = order + items[3 * i];
      const int mm = int(items[3 * i + 1]);
      const int64_t s = items[3 * i + 2];
      const W* As = A + s * K * Wd;
      const W* Bs = B + s * Wd * N;
      float* hb = h.data();
      switch (mm) {
        case 4: item<T, W, 4>(out, os, x, xs, As, Bs, tok, K, Wd, N, r, slice_off, n, hb); break;
        case 3: item<T, W, 3>(out, os, x, xs, As, Bs, tok, K, Wd, N, r, slice_off, n, hb); break;
        case 2: item<T, W, 2>(out, os, x, xs, As, Bs, tok, K, Wd, N, r, slice_off, n, hb); break;
        default: item<T, W, 1>(out, os, x, xs, As, Bs, tok, K, Wd, N, r, slice_off, n, hb);
      }
    }
  }
}

}  // namespace

extern "C" {
// out: [T, N] rows out_stride apart (+= the delta); x: [T, K] rows x_stride apart; a: [S, K, Wd]
// and b: [S, Wd, N] contiguous slot stacks, Wd = n * r; order: token indices grouped by slot,
// segment g = order[seg_start[g] : seg_start[g + 1]] uses slot seg_slot[g]; slice_off: n + 1
// column offsets of the output slices. x/out dtype and a/b dtype: 0 fp32, 1 bf16 (the two must
// match). Returns 0, or 1 for unsupported dtypes.
int bl_lora_sgmv(void* out, const void* x, const void* a, const void* b, const int64_t* order,
                 const int64_t* seg_start, const int64_t* seg_slot, int64_t num_seg, int64_t K,
                 int64_t Wd, int64_t N, int64_t r, const int64_t* slice_off, int32_t n,
                 int64_t x_stride, int64_t out_stride, int32_t dtype, int32_t w_dtype,
                 int32_t num_threads) {
  if (dtype == kFloat32 && w_dtype == kFloat32)
    lora(static_cast<float*>(out), out_stride, static_cast<const float*>(x), x_stride,
         static_cast<const float*>(a), static_cast<const float*>(b), order, seg_start, seg_slot,
         num_seg, K, Wd, N, r, slice_off, n, num_threads);
  else if (dtype == kBFloat16 && w_dtype == kBFloat16)
    lora(static_cast<bf16_t*>(out), out_stride, static_cast<const bf16_t*>(x), x_stride,
         static_cast<const bf16_t*>(a), static_cast<const bf16_t*>(b), order, seg_start,
         seg_slot, num_seg, K, Wd, N, r, slice_off, n, num_threads);
  else
    return 1;
  return 0;
}
}
