// Fused mixture-of-experts MLP (the experts' part; routing stays in Python): tokens grouped by
// expert, then per selected expert gate_up GEMM -> SiLU-and-mul -> down GEMM over just its
// tokens, each output scaled by its routing weight and added into out in ascending expert
// order (the twin, kernels/ref.py fused_moe). Experts no token selected are never touched, so a
// batch-1 step streams top_k experts' weights, not all of them.
//
// The GEMMs are linear.cpp's (bl_linear on [N, K] rows, bl_linear_panel on fp32 panels,
// bl_linear_pairs on bf16 pair panels): one expert's weights are laid out exactly as one
// linear layer's, stacked expert after expert (w13_stride / w2_stride elements apart).
//
// One call is a grouped GEMM: the (token, slot) pairs are sorted by expert (a counting sort),
// x's rows gathered into that order, so each expert multiplies one contiguous block of rows
// (a prefill's hundreds of rows per expert run at the panels' large-M rate, not one small GEMM
// per token). Work items are (expert, block of outputs), handed out dynamically in one OpenMP
// region per call: batch 1's 8 experts still keep both cores streaming weights, and a prefill's
// uneven experts balance. The weighted sum runs per token (tokens split over the threads, one
// vector pass over H per token), in the twin's order and roundings.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel_args.h"
#include "vec.h"

extern "C" {
// MoeArgs::kind: the per-expert weight layout (the values of decoder.cpp's LinearKind).
enum MoeKind : int32_t { kMoeRows = 0, kMoePanel = 2, kMoePairs = 4 };

struct MoeArgs {               // mirrored by kernels/compiled.py; all contiguous
  void* out;                   // [tokens, hidden], the dtype
  const void* x;               // [tokens, hidden], the dtype
  const void* w13;             // expert e at w13 + e * w13_stride elements: [2 * inter, hidden]
  const void* w2;              // expert e at w2 + e * w2_stride elements: [hidden, inter]
  const float* topk_weights;   // [tokens, top_k], values already rounded to the dtype
  const int32_t* topk_ids;     // [tokens, top_k]; ids outside [0, num_experts) are skipped
  int64_t tokens, top_k, num_experts, hidden, inter, w13_stride, w2_stride, silu_chunk;
  int32_t kind, dtype, num_threads;
};

int bl_fused_moe(const MoeArgs* a);
int bl_linear_panel_width();
int bl_linear_pair_panel_width();
}

// The most experts per token the combine step takes (a stack array per token).
constexpr int64_t kMaxTopK = 64;

namespace {

// Outputs per block of the layout: a sub-range of an expert's outputs must start on a panel.
int64_t layout_width(int32_t kind) {
  if (kind == kMoePanel) return bl_linear_panel_width();
  if (kind == kMoePairs) return bl_linear_pair_panel_width();
  return 4;  // linear.cpp's rows per block
}

// One row of fp32 x against the outputs [n0, n0 + nn) (n0 on a panel) of an fp32 panel-packed
// weight ([ceil(N / P)][K][P]): the batch-1 path, where every selected expert has one row. The
// same single FMA chain along K per output as bl_linear_panel's tiles, so a token's result is
// bit for bit the one it gets in a larger batch (tested); written out here because going
// through bl_linear_panel per part measured slower at one row: 6 layers x 8 experts of
// qwen3-moe-0.5b streamed from DRAM, 2 threads, 13.8 against 15.6 ms (AVX512-BF16 EPYC).
// Explicit FMAs: this file is compiled with -ffp-contract=off.
constexpr int64_t kPanelW = 4 * VLEN;  // linear.cpp's kPanel (bl_linear_panel_width)
void gemv_panels(float* out, const float* x, const float* wp, int64_t n0, int64_t nn,
                 int64_t K) {
  for (int64_t j0 = 0; j0 < nn; j0 += kPanelW) {
    const float* w = wp + (n0 + j0) * K;
    vfloat acc[4] = {vfloat{}, vfloat{}, vfloat{}, vfloat{}};
    for (int64_t k = 0; k < K; ++k) {
      const float* wk = w + k * kPanelW;
      const vfloat xb = splat(x[k]);
      for (int h = 0; h < 4; ++h) acc[h] = fma_exact(xb, loadu(wk + h * VLEN), acc[h]);
    }
    const int64_t valid = std::min<int64_t>(kPanelW, nn - j0);
    float* o = out + n0 + j0;
    if (valid == kPanelW) {
      for (int h = 0; h < 4; ++h) storeu(o + h * VLEN, acc[h]);
    } else {  // the last, zero-padded panel
      float tmp[kPanelW];
      for (int h = 0; h < 4; ++h) storeu(tmp + h * VLEN, acc[h]);
      for (int64_t j = 0; j < valid; ++j) o[j] = tmp[j];
    }
  }
}

// out[m, n0 + j] = x[m, :] . w[n0 + j, :] for j < nn, on the calling thread: outputs [n0, n0 + nn)
// of one expert's [N, K] weight w (in its layout), x rows K apart, out rows out_stride apart.
template <class T>
int linear_part(const MoeArgs& a, const T* w, int64_t n0, int64_t nn, int64_t K, const T* x,
                int64_t m, T* out, int64_t out_stride) {
  if (a.kind == kMoePanel && m == 1) {
    gemv_panels(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(x),
                reinterpret_cast<const float*>(w), n0, nn, K);
    return 0;
  }
  if (a.kind == kMoePanel)  // [ceil(N / P)][K][P]
    return bl_linear_panel(reinterpret_cast<float*>(out + n0), reinterpret_cast<const float*>(x),
                           w + n0 * K, nullptr, m, nn, K, K, out_stride, kFloat32, 1);
  if (a.kind == kMoePairs) {  // [ceil(N / P)][ceil(K / 2)][P] 32-bit lanes: 2 bf16 per lane
    const int64_t lanes = n0 * ((K + 1) / 2);
    return bl_linear_pairs(reinterpret_cast<uint16_t*>(out + n0),
                           reinterpret_cast<const uint16_t*>(x), w + 2 * lanes, nullptr, m, nn,
                           K, K, out_stride, 1);
  }
  return bl_linear(out + n0, x, w + n0 * K, nullptr, m, nn, K, K, out_stride, a.dtype, 1);
}

// Parts an expert's N outputs are cut into, and their size (a multiple of the layout's width):
// enough work items that every thread has some (batch 1: 8 experts over the threads) and a
// thread that the scheduler sets aside does not hold back the others with a large share.
void split_outputs(int64_t N, int64_t width, int64_t num_active, int threads, int64_t* parts,
                   int64_t* size) {
  const int64_t blocks = (N + width - 1) / width;
  const int64_t want = std::max<int64_t>(1, (4 * int64_t(threads) + num_active - 1) / num_active);
  const int64_t p = std::min(blocks, threads > 1 ? want : 1);
  *size = (blocks + p - 1) / p * width;
  *parts = (N + *size - 1) / *size;
}

// Scratch of the calling thread, kept between calls (a step's buffers are the same size each
// layer; fresh pages for a 2048-token prefill would fault in every call).
unsigned char* scratch(size_t bytes) {
  static thread_local std::vector<unsigned char> buf;
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

template <class T>
int fused_moe(const MoeArgs& a) {
  const int64_t H = a.hidden, I = a.inter, E = a.num_experts, k = a.top_k, n = a.tokens * k;
  // Counting sort of the (token, slot) pairs by expert, stable: pairs of one expert keep
  // their token order, as the twin's stable argsort does. pos: each pair's sorted row (-1:
  // another rank's expert).
  std::vector<int64_t> start(E + 1, 0), pairs(n), pos(n, -1), active;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t e = a.topk_ids[p];
    if (e >= 0 && e < E) ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < n; ++p) {
      const int64_t e = a.topk_ids[p];
      if (e >= 0 && e < E) {
        pos[p] = fill[e];
        pairs[fill[e]++] = p;
      }
    }
  }
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const int64_t rows = start[E], num_active = int64_t(active.size());
  const int threads = std::max(1, int(a.num_threads));
  // Sorted rows: xs (x gathered; reused for y, each pair's unweighted expert output, once the
  // gate_up GEMMs have read it), h (gate_up), act (SiLU(gate) * up).
  T* xs = reinterpret_cast<T*>(scratch(size_t(rows) * (H + 3 * I) * sizeof(T)));
  T* h = xs + rows * H;
  T* act = h + rows * 2 * I;
  T* y = xs;
  const int64_t width = layout_width(a.kind);
  int64_t parts13, size13, parts2, size2;
  split_outputs(2 * I, width, num_active, threads, &parts13, &size13);
  split_outputs(H, width, num_active, threads, &parts2, &size2);
  const T* x = static_cast<const T*>(a.x);
  const T* w13 = static_cast<const T*>(a.w13);
  const T* w2 = static_cast<const T*>(a.w2);
  T* out = static_cast<T*>(a.out);
  int rc = 0;
  // One parallel region per layer, phases separated by the for loops' barriers (y overwrites
  // xs: every gate_up GEMM has read its rows before the SiLU phase starts).
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(xs + r * H, x + (pairs[r] / k) * H, H * sizeof(T));
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_active * parts13; ++i) {
      const int64_t e = active[i / parts13], n0 = (i % parts13) * size13;
      const int err = linear_part<T>(a, w13 + e * a.w13_stride, n0,
                                     std::min(size13, 2 * I - n0), H, xs + start[e] * H,
                                     start[e + 1] - start[e], h + start[e] * 2 * I, 2 * I);
      if (err) {
#pragma omp atomic write
        rc = err;
      }
    }
    constexpr int64_t kSiluRows = 8;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r += kSiluRows) {
      const int err = bl_silu_and_mul(act + r * I, h + r * 2 * I, 2 * I,
                                      std::min(kSiluRows, rows - r), I, a.silu_chunk, a.dtype, 1);
      if (err) {
#pragma omp atomic write
        rc = 10 + err;
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_active * parts2; ++i) {
      const int64_t e = active[i / parts2], n0 = (i % parts2) * size2;
      const int err = linear_part<T>(a, w2 + e * a.w2_stride, n0, std::min(size2, H - n0), I,
                                     act + start[e] * I, start[e + 1] - start[e],
                                     y + start[e] * H, H);
      if (err) {
#pragma omp atomic write
        rc = err;
      }
    }
    // out[t] = sum over t's pairs in ascending expert order of round(y * w): the twin's
    // (y * w) in the dtype, then index_add_ in the dtype. A token's pairs in sorted order are
    // in expert order.
    const int64_t vec_end = H / VLEN * VLEN;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.tokens; ++t) {
      int64_t order[kMaxTopK];
      int64_t cnt = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t q = pos[t * k + j];
        if (q < 0) continue;
        int64_t at = cnt++;
        for (; at > 0 && order[at - 1] > q; --at) order[at] = order[at - 1];
        order[at] = q;
      }
      T* o = out + t * H;
      for (int64_t c = 0; c < vec_end; c += VLEN) {
        vfloat acc = vfloat{};
        for (int64_t j = 0; j < cnt; ++j) {
          const vfloat wv = splat(a.topk_weights[pairs[order[j]]]);
          acc = round_to(acc + round_to(loadu(y + order[j] * H + c) * wv, o), o);
        }
        storeu(o + c, acc);
      }
      for (int64_t c = vec_end; c < H; ++c) {
        float acc = 0.0f;
        for (int64_t j = 0; j < cnt; ++j)
          acc = round_to(acc + round_to(to_float(y[order[j] * H + c]) *
                                        a.topk_weights[pairs[order[j]]], o), o);
        store1(o + c, acc);
      }
    }
  }
  return rc;
}

}  // namespace


// 0: done; 1: unsupported dtype or kind; 2: top_k above kMaxTopK; 10+: silu_and_mul refused
// its arguments.
extern "C" int bl_fused_moe(const MoeArgs* a) {
  if (a->top_k > kMaxTopK || a->top_k < 1) return 2;
  if (a->kind == kMoePairs && a->dtype != kBFloat16) return 1;
  if (a->kind == kMoePanel && (a->dtype != kFloat32 || bl_linear_panel_width() != kPanelW))
    return 1;
  if (a->dtype == kFloat32) return fused_moe<float>(*a);
  if (a->dtype == kBFloat16) return fused_moe<bf16_t>(*a);
  return 1;
}
