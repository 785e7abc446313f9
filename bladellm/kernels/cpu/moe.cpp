// Fused mixture-of-experts MLP (the experts' part; routing stays in Python): tokens grouped by
// expert, then per selected expert gate_up GEMM -> SiLU-and-mul -> down GEMM over just its
// tokens, each output scaled by its routing weight and added into out in ascending expert
// order (the twin, kernels/ref.py fused_moe). Experts no token selected are never touched, so a
// batch-1 step streams top_k experts' weights, not all of them.
//
// The GEMMs are linear.cpp's (bl_linear on [N, K] rows, bl_linear_panel on fp32 panels,
// bl_linear_pairs on bf16 pair panels): one expert's weights are laid out exactly as one
// linear layer's, stacked expert after expert (w13_stride / w2_stride elements apart).
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
}

namespace {

template <class T>
int linear(const MoeArgs& a, const void* w, void* out, const void* x, int64_t M, int64_t N,
           int64_t K, int32_t threads) {
  if (a.kind == kMoePanel)
    return bl_linear_panel(static_cast<float*>(out), static_cast<const float*>(x), w, nullptr,
                           M, N, K, K, N, kFloat32, threads);
  if (a.kind == kMoePairs)
    return bl_linear_pairs(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), w,
                           nullptr, M, N, K, K, N, threads);
  return bl_linear(out, x, w, nullptr, M, N, K, K, N, a.dtype, threads);
}

// One expert's rows: y[m, H] = down(silu(gate_up(x rows of its pairs))), unweighted.
template <class T>
int expert_rows(const MoeArgs& a, int64_t e, const int64_t* group, int64_t m, T* xs, T* h,
                T* act, T* y, int32_t threads) {
  const int64_t H = a.hidden, I = a.inter;
  const T* x = static_cast<const T*>(a.x);
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(xs + r * H, x + (group[r] / a.top_k) * H, H * sizeof(T));
  int rc = linear<T>(a, static_cast<const T*>(a.w13) + e * a.w13_stride, h, xs, m, 2 * I, H,
                     threads);
  if (rc) return rc;
  rc = bl_silu_and_mul(act, h, 2 * I, m, I, a.silu_chunk, a.dtype, threads);
  if (rc) return 10 + rc;
  return linear<T>(a, static_cast<const T*>(a.w2) + e * a.w2_stride, y, act, m, H, I, threads);
}

template <class T>
int fused_moe(const MoeArgs& a) {
  const int64_t H = a.hidden, I = a.inter, E = a.num_experts, n = a.tokens * a.top_k;
  // Counting sort of the (token, slot) pairs by expert, stable: pairs of one expert keep
  // their token order, as the twin's stable argsort does.
  std::vector<int64_t> start(E + 1, 0), pairs(n);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t e = a.topk_ids[p];
    if (e >= 0 && e < E) ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), active;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t e = a.topk_ids[p];
    if (e >= 0 && e < E) pairs[fill[e]++] = p;
  }
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) {
    most = std::max(most, start[e + 1] - start[e]);
    if (start[e + 1] > start[e]) active.push_back(e);
  }
  // y: every pair's unweighted expert output, in sorted (expert) order.
  std::vector<T> y(start[E] * H);
  const int64_t num_active = int64_t(active.size());
  const int threads = std::max(1, int(a.num_threads));
  int rc = 0;
  if (threads > 1 && num_active >= threads) {
    // Experts spread over the threads, each expert's GEMMs on one thread: a step then opens
    // one parallel region per layer instead of three per expert (waking pooled threads costs
    // more than a small expert's GEMM on a busy machine).
#pragma omp parallel num_threads(threads)
    {
      std::vector<T> xs(most * H), h(most * 2 * I), act(most * I);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < num_active; ++i) {
        const int64_t e = active[i], m = start[e + 1] - start[e];
        const int err = expert_rows<T>(a, e, pairs.data() + start[e], m, xs.data(), h.data(),
                                       act.data(), y.data() + start[e] * H, 1);
        if (err) {
#pragma omp atomic write
          rc = err;
        }
      }
    }
  } else {
    std::vector<T> xs(most * H), h(most * 2 * I), act(most * I);
    for (int64_t i = 0; i < num_active && rc == 0; ++i) {
      const int64_t e = active[i], m = start[e + 1] - start[e];
      rc = expert_rows<T>(a, e, pairs.data() + start[e], m, xs.data(), h.data(), act.data(),
                          y.data() + start[e] * H, threads);
    }
  }
  if (rc) return rc;
  // out[t] += round(y * w) in ascending expert order: the twin's (y * w) in the dtype, then
  // index_add_ in the dtype.
  T* out = static_cast<T*>(a.out);
  for (int64_t i = 0; i < a.tokens * H; ++i) store1(out + i, 0.0f);
  for (int64_t p = 0; p < start[E]; ++p) {
    const float w = a.topk_weights[pairs[p]];
    T* o = out + (pairs[p] / a.top_k) * H;
    const T* yr = y.data() + p * H;
    for (int64_t j = 0; j < H; ++j)
      store1(o + j, to_float(o[j]) + round_to(to_float(yr[j]) * w, o));
  }
  return 0;
}

}  // namespace

// 0: done; 1: unsupported dtype or kind; 10+: silu_and_mul refused its arguments.
extern "C" int bl_fused_moe(const MoeArgs* a) {
  if (a->kind == kMoePairs && a->dtype != kBFloat16) return 1;
  if (a->kind == kMoePanel && a->dtype != kFloat32) return 1;
  if (a->dtype == kFloat32) return fused_moe<float>(*a);
  if (a->dtype == kBFloat16) return fused_moe<bf16_t>(*a);
  return 1;
}
