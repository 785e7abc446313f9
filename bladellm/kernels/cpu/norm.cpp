// RMSNorm, (1 + w) RMSNorm and LayerNorm, each with an optional fused residual add (kind:
// RmsNormArgs.kind). RMSNorm semantics of kernels/ref.py rms_norm (which is
// transformers'): residual add rounded to the dtype, normalise in fp32, round, then scale by the
// weight (rounded). Compiled with -ffp-contract=off: every product and sum rounds as in torch.
//
// The sum of squares replays torch's CPU cascade sum (aten/src/ATen/native/cpu/SumKernel.cpp:
// vectorized_inner_sum -> row_sum -> multi_row_sum) in its order and vector width, so the
// variance, and with it every output, is bit-identical to the reference, not merely close.
#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

#include "kernel_args.h"

namespace {

typedef float f8 __attribute__((vector_size(32)));
typedef float f16 __attribute__((vector_size(64)));

template <typename V>
static inline V load_sq(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v * v;  // torch materialises h.pow(2) (= h * h) before summing
}

static int64_t ceil_log2(int64_t x) {  // at::native::utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(uint64_t(x - 1));
}

// torch's row_sum(multi_row_sum<4>) over `size` consecutive V-sized loads of squares.
template <typename V>
static V row_sum(const float* x, int64_t size) {
  constexpr int N = sizeof(V) / sizeof(float);
  constexpr int kLevels = 4, kRows = 4;
  const int64_t size_ilp = size / kRows;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size_ilp) / kLevels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  V acc[kLevels][kRows];
  for (auto& level : acc)
    for (V& v : level) v = V{};
  int64_t i = 0;
  while (i + level_step <= size_ilp) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kRows; ++k) acc[0][k] += load_sq<V>(x + (i * kRows + k) * N);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kRows; ++k) acc[j][k] += acc[j - 1][k], acc[j - 1][k] = V{};
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < kRows; ++k) acc[0][k] += load_sq<V>(x + (i * kRows + k) * N);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kRows; ++k) acc[0][k] += acc[j][k];
  for (int64_t r = size_ilp * kRows; r < size; ++r) acc[0][0] += load_sq<V>(x + r * N);
  for (int k = 1; k < kRows; ++k) acc[0][0] += acc[0][k];
  return acc[0][0];
}

// torch: vectorized_inner_sum when the row holds at least one vector, else scalar_inner_sum.
template <typename V>
static float sum_squares(const float* x, int64_t n) {
  constexpr int N = sizeof(V) / sizeof(float);
  if (n < N) return row_sum<float>(x, n);
  const int64_t vec_size = n / N;
  V v = row_sum<V>(x, vec_size);
  float total = 0.0f;
  for (int64_t k = vec_size * N; k < n; ++k) total += x[k] * x[k];
  for (int k = 0; k < N; ++k) total += v[k];
  return total;
}

static float sum_squares_lanes(const float* x, int64_t n, int lanes) {
  return lanes == 16 ? sum_squares<f16>(x, n) : sum_squares<f8>(x, n);
}

enum NormKind : int32_t { kRms = 0, kRmsUnitOffset = 1, kLayerNorm = 2 };

// LayerNorm of the fp32 row h: two vectorized passes (mean, then the centred variance), then
// torch's form (x * rstd - mean * rstd) * w + b in fp32, one rounding. Agrees with F.layer_norm
// (a Welford pass) to float rounding, not bit for bit.
template <typename T>
static void layer_norm_row(const RmsNormArgs& a, const float* h, const T* w, T* out) {
  const int H = a.hidden;
  vfloat vsum = vfloat{};
  float sum = 0.0f;
  int c = 0;
  for (; c + VLEN <= H; c += VLEN) vsum += loadu(h + c);
  for (; c < H; ++c) sum += h[c];
  const float mean = (hsum(vsum) + sum) / float(H);
  vfloat vsq = vfloat{};
  float sq = 0.0f;
  for (c = 0; c + VLEN <= H; c += VLEN) {
    vfloat d = loadu(h + c) - mean;
    vsq += d * d;
  }
  for (; c < H; ++c) sq += (h[c] - mean) * (h[c] - mean);
  const float rstd = 1.0f / std::sqrt((hsum(vsq) + sq) / float(H) + a.eps);
  const float shift = -mean * rstd;
  const T* b = static_cast<const T*>(a.bias);
  for (c = 0; c + VLEN <= H; c += VLEN) {
    vfloat y = (loadu(h + c) * rstd + shift) * loadu(w + c);
    storeu(out + c, b != nullptr ? y + loadu(b + c) : y);
  }
  for (; c < H; ++c) {
    float y = (h[c] * rstd + shift) * to_float(w[c]);
    store1(out + c, b != nullptr ? y + to_float(b[c]) : y);
  }
}

template <typename T>
static void norm_row(const RmsNormArgs& a, int64_t row, float* h) {
  const int H = a.hidden;
  const int64_t o = row / a.inner, i = row % a.inner;
  const T* x = static_cast<const T*>(a.x) + o * a.x_outer_stride + i * a.x_inner_stride;
  if (a.residual != nullptr) {  // h = round(x + residual), also the new residual
    const T* r = static_cast<const T*>(a.residual) + o * a.r_outer_stride +
                 i * a.r_inner_stride;
    T* ro = static_cast<T*>(a.residual_out) + row * H;
    int c = 0;
    for (; c + VLEN <= H; c += VLEN) {
      vfloat s = round_to(loadu(x + c) + loadu(r + c), ro);
      storeu(h + c, s);
      storeu(ro + c, s);
    }
    for (; c < H; ++c) {
      h[c] = round_to(to_float(x[c]) + to_float(r[c]), ro);
      store1(ro + c, h[c]);
    }
  } else {
    int c = 0;
    for (; c + VLEN <= H; c += VLEN) storeu(h + c, loadu(x + c));
    for (; c < H; ++c) h[c] = to_float(x[c]);
  }
  const T* w = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + row * H;
  if (a.kind == kLayerNorm) return layer_norm_row(a, h, w, out);
  const float mean = sum_squares_lanes(h, H, a.sum_lanes) / float(H);
  const float inv = 1.0f / std::sqrt(mean + a.eps);
  int c = 0;
  if (a.kind == kRmsUnitOffset) {  // everything in fp32, one rounding
    const vfloat one = splat(1.0f);
    for (; c + VLEN <= H; c += VLEN)
      storeu(out + c, (loadu(h + c) * inv) * (one + loadu(w + c)));
    for (; c < H; ++c) store1(out + c, (h[c] * inv) * (1.0f + to_float(w[c])));
    return;
  }
  for (; c + VLEN <= H; c += VLEN)
    storeu(out + c, loadu(w + c) * round_to(loadu(h + c) * inv, out));
  for (; c < H; ++c) store1(out + c, to_float(w[c]) * round_to(h[c] * inv, out));
}

template <typename T>
static void run(const RmsNormArgs& a) {
  const int64_t rows = a.outer * a.inner;
  // A parallel region costs a few microseconds: only worth it for prefill-sized inputs.
  const bool par = a.num_threads > 1 && rows > 1 && rows * a.hidden >= (1 << 15);
#pragma omp parallel num_threads(a.num_threads) if (par)
  {
    std::vector<float> h(a.hidden);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) norm_row<T>(a, row, h.data());
  }
}

}  // namespace

// 0: done; 2: unsupported dtype.
extern "C" int bl_rms_norm(const RmsNormArgs* a) {
  if (a->dtype == kFloat32) return run<float>(*a), 0;
  if (a->dtype == kBFloat16) return run<bf16_t>(*a), 0;
  return 2;
}

// Sums of squares of `rows` contiguous rows of n floats with `lanes`-wide vectors: lets the
// wrapper find which width reproduces torch's sums in this process (see compiled.py).
extern "C" void bl_sum_squares(const float* x, int64_t rows, int64_t n, int32_t lanes,
                               float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = sum_squares_lanes(x + r * n, n, lanes);
}
