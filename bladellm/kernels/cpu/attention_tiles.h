// Per-tile math of paged attention (attention.cpp): loading a tile of VLEN keys from the paged
// cache and folding it into the running softmax of the rows that read it, two ways:
//  - row_step: one query row at a time, keys in the lanes (scores by a transpose-sum). For
//    fewer than VLEN/2 rows per kv head: decodes with small GQA groups.
//  - lanes_step: VLEN query rows in the lanes, keys broadcast. No horizontal reductions, a
//    vectorised softmax: much faster for prefill chunks (docs/kernels.md).
// bf16 query and cache on AVX512-BF16 take the pair path instead (rows_pairs / row_pairs /
// lanes_pairs, at the end): vdpbf16ps on the bf16 as stored, no fp32 tile.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

#include "kernel_args.h"

namespace {

constexpr int kTileRows = 48;      // target rows (tokens x query heads) per kv head and item
constexpr int kItemRows = 64;      // at most this many rows per item when grouping kv heads
constexpr int kItemHeadDims = 256; // and kv heads x head_dim at most this: the K/V tile fits L1
constexpr int kMinPartKeys = 128;  // smallest key range worth a partition of its own

constexpr int kMinSharedKeys = 64; // shortest prefix worth a shared pass (cascade, below)
constexpr int kSharedRows = 64;    // at most this many rows per kv head in one shared pass

struct WorkItem {
  int32_t req, head_begin, head_end;     // kv heads [head_begin, head_end)
  int32_t q_begin, q_end;                // query tokens [q_begin, q_end) of the request
  int32_t key_begin, key_end;            // keys this unit reads (a partition when split)
  int32_t part, num_parts;  // part -1: a shared pass (its results go to its members' slots)
  int64_t cost, partial_offset;  // partial_offset: into the split buffer, -1 if not split
  int32_t shared = -1;           // index of its SharedPass, for a shared pass
};

// Cascade attention for requests whose block tables start with the same blocks (a prompt-cache
// hit on a common prefix): keys [0, key_end) are read once for the query rows of all members,
// VLEN rows in the lanes, instead of once per request through row_step. Every shared key lies
// before every member's first query token, so no causal mask applies. Each member's own item
// reads only the keys after the prefix; the two partial softmaxes merge like key partitions
// (combine_parts), the shared one in the member's last slot.
struct SharedPass {
  int32_t tokens;                 // query tokens per member (all members have the same count)
  std::vector<int32_t> reqs;      // members
  std::vector<int64_t> slots;     // per member: offset of its slot in the partial buffer
};

// bf16 query and cache with AVX512-BF16: the pair path (row_pairs / lanes_pairs, below).
template <typename T, typename C>
constexpr bool kPairPath =
#if defined(__AVX512BF16__)
    std::is_same_v<T, bf16_t> && std::is_same_v<C, bf16_t>;
#else
    false;
#endif

struct Scratch {  // per thread, grown on demand, reused across calls
  std::vector<float> q, acc, row_max, row_sum, k, v;  // row-major rows; K/V tile per kv head
  std::vector<const float*> kp, vp;
  std::vector<float> qt, acct, lane_max, lane_sum;  // lanes_step: groups of VLEN rows, [d][VLEN]
  std::vector<int32_t> lane_pos;
  // Pair path (bf16 caches with AVX512-BF16, below): the K tile copied and the V tile
  // interleaved per head, the lanes' queries as bf16 pairs [d/2][VLEN].
  std::vector<bf16_t> kb;
  std::vector<uint32_t> vb, qt2;
  void reserve_pairs(int heads, int groups, int d) {
    const size_t tile = size_t(heads) * VLEN * d;
    if (kb.size() < tile) kb.resize(tile), vb.resize(tile / 2);
    if (qt2.size() < size_t(groups) * VLEN * d / 2) qt2.resize(size_t(groups) * VLEN * d / 2);
  }
  void reserve(int rows, int heads, int d) {
    if ((int)q.size() < rows * d) q.resize(rows * d), acc.resize(rows * d);
    if ((int)row_max.size() < rows) row_max.resize(rows), row_sum.resize(rows);
    if ((int)k.size() < heads * VLEN * d) k.resize(heads * VLEN * d), v.resize(heads * VLEN * d);
    if ((int)kp.size() < heads * VLEN) kp.resize(heads * VLEN), vp.resize(heads * VLEN);
  }
  void reserve_lanes(int groups, int d) {
    const size_t lanes = size_t(groups) * VLEN;
    if (qt.size() < lanes * d) qt.resize(lanes * d), acct.resize(lanes * d);
    if (lane_max.size() < lanes) lane_max.resize(lanes), lane_sum.resize(lanes);
    if (lane_pos.size() < lanes) lane_pos.resize(lanes);
  }
};

// Per-layer features in the kernel's log2 units (scores are q.k * scale * log2(e)); the plain
// causal kernel is instantiated without them (kFeat = false) and pays nothing.
struct Features {
  int window;           // 0: none
  float cap2;           // soft cap * log2(e); 0: none
  const float* slopes;  // ALiBi slopes per query head (natural units), nullptr: none
};

static inline Features features_of(const PagedAttentionArgs& a) {
  return {a.sliding_window, a.soft_cap * 1.4426950408889634f, a.alibi_slopes};
}

static inline bool has_features(const PagedAttentionArgs& a) {
  return a.sliding_window > 0 || a.soft_cap != 0.0f || a.alibi_slopes != nullptr;
}

// cap2 * tanh(s / cap2), as sign(y) * (1 - e) / (1 + e) with e = exp(-2|y|) <= 1.
static inline vfloat soft_cap(vfloat s, float cap2) {
  const vfloat y = s * (1.0f / cap2);
  const vint sign = bit_cast<vint>(y) & (vint{} + int32_t(0x80000000u));
  const vfloat ay = bit_cast<vfloat>(bit_cast<vint>(y) & (vint{} + 0x7fffffff));
  const vfloat e = exp2_neg(ay * (-2.0f * 1.4426950408889634f));
  const vfloat t = (1.0f - e) / (1.0f + e);
  return bit_cast<vfloat>(bit_cast<vint>(t) | sign) * cap2;
}

// One row's view of the features for a key tile: its position, first visible key, slope.
struct RowFeat {
  int kt, pos, lo;
  float slope2, cap2;  // slope * log2(e)
};

struct Geometry {
  int d, G, kvh, bs, q_begin_token, ctx_start, tokens, rows;
  // Row of (kv head offset hh in the item, token t of the tile, query head g of the group).
  int row(int hh, int t, int g) const { return (hh * tokens + t) * G + g; }
};

static inline int item_rows(const WorkItem& w, int G) {
  return (w.head_end - w.head_begin) * (w.q_end - w.q_begin) * G;
}

// Elements per (slot, kv head) row of a cache of C: the head dim, plus the 4 scale bytes that
// follow each int8 row.
template <typename C>
static inline int row_elems(int d) {
  return std::is_same_v<C, int8_t> ? d + 4 : d;
}

// One cache row into fp32: bf16 widened, int8 times its scale (one fp32 multiply per value,
// as kv_int8.dequantize does).
template <typename C>
static inline void widen_row(const C* src, int d, float* dst) {
  if constexpr (std::is_same_v<C, int8_t>) {
    float s;
    std::memcpy(&s, src + d, sizeof s);
    const vfloat vs = splat(s);
    for (int c = 0; c < d; c += VLEN) storeu(dst + c, loadu(src + c) * vs);
  } else {
    for (int c = 0; c < d; c += VLEN) storeu(dst + c, loadu(src + c));
  }
}

// Pointers to the K/V rows of keys [kt, kt + n) for every kv head of the item, at
// kp[hh * VLEN + j]. fp32 caches are read in place; bf16 and int8 ones are widened (int8:
// dequantized) once into the scratch tile (shared by every row of the head): only the tile in
// use is ever dequantized, never the cache. Walks each block in address order: a slot's rows
// for all the item's heads are adjacent, so this streams (15% faster on cold caches than
// head by head, which hops 128-byte rows at a num_kv_heads stride).
// kCopy (lanes_step): fp32 rows are copied too and rows n..VLEN-1 zeroed, so each head's tile
// is one contiguous [VLEN][d] block.
template <typename C, bool kCopy>
static inline void load_kv_tile(const PagedAttentionArgs& a, const int32_t* table,
                                const WorkItem& w, int kt, int n, const Geometry& g,
                                Scratch& sc, const float** kp, const float** vp) {
  const C* kc = static_cast<const C*>(a.k_cache);
  const C* vc = static_cast<const C*>(a.v_cache);
  const int heads = w.head_end - w.head_begin, rw = row_elems<C>(g.d);
  int blk = kt / g.bs, off = kt % g.bs;
  for (int j = 0; j < n; ++j) {
    const int64_t base = ((int64_t(table[blk]) * g.bs + off) * g.kvh + w.head_begin) * rw;
    for (int hh = 0; hh < heads; ++hh) {
      const int64_t src = base + int64_t(hh) * rw;
      if constexpr (std::is_same_v<C, float> && !kCopy) {
        kp[hh * VLEN + j] = kc + src;
        vp[hh * VLEN + j] = vc + src;
      } else {
        float* kd = sc.k.data() + (hh * VLEN + j) * g.d;
        float* vd = sc.v.data() + (hh * VLEN + j) * g.d;
        widen_row(kc + src, g.d, kd);
        widen_row(vc + src, g.d, vd);
        kp[hh * VLEN + j] = kd;
        vp[hh * VLEN + j] = vd;
      }
    }
    if (++off == g.bs) off = 0, ++blk;
  }
  if constexpr (kCopy) {
    for (int hh = 0; hh < heads && n < VLEN; ++hh) {
      std::fill_n(sc.k.data() + (hh * VLEN + n) * g.d, (VLEN - n) * g.d, 0.0f);
      std::fill_n(sc.v.data() + (hh * VLEN + n) * g.d, (VLEN - n) * g.d, 0.0f);
    }
  }
}

// Pull the next key tile's rows (all the item's heads) towards L2 while this tile computes:
// blocks sit at random places, so the hardware prefetcher loses the stream at every block.
// Into L2, not L1 (prefetcht2): L1-targeted prefetch evicts the tile in use and was slower
// (docs/kernels.md).
template <typename C>
static inline void prefetch_kv_tile(const PagedAttentionArgs& a, const int32_t* table,
                                    const WorkItem& w, int kt, int n, const Geometry& g) {
  const char* kc = static_cast<const char*>(a.k_cache);
  const char* vc = static_cast<const char*>(a.v_cache);
  const int64_t head_bytes = int64_t(row_elems<C>(g.d)) * sizeof(C);
  const int64_t row_bytes = head_bytes * (w.head_end - w.head_begin);
  int blk = kt / g.bs, off = kt % g.bs;
  for (int j = 0; j < n; ++j) {
    const int64_t base =
        ((int64_t(table[blk]) * g.bs + off) * g.kvh + w.head_begin) * head_bytes;
    for (int64_t c = 0; c < row_bytes; c += 64) {
      __builtin_prefetch(kc + base + c, 0, 1);
      __builtin_prefetch(vc + base + c, 0, 1);
    }
    if (++off == g.bs) off = 0, ++blk;
  }
}

// Softmax update and P.V of one row for a key tile, given its scores `s` (log2 units, lanes
// past n ignored). VT: the V rows' element (fp32 scratch rows, or bf16 read from the cache).
// DC is the head dim when known at compile time (unrolled, accumulators in registers), else 0.
template <int DC, bool kFeat, typename VT>
static inline void row_update(vfloat s, float* acc, float& row_max, float& row_sum,
                              const VT* const* vp, int n, int dim, const RowFeat* rf) {
  const int d = DC ? DC : dim;
  if constexpr (kFeat) {
    vint key;
    for (int j = 0; j < VLEN; ++j) key[j] = rf->kt + j;
    if (rf->cap2 != 0.0f) s = soft_cap(s, rf->cap2);
    s += splat(rf->slope2) * __builtin_convertvector(key - rf->pos, vfloat);
    s = key >= rf->lo ? s : splat(-__builtin_inff());
  }
  if (n < VLEN) {
    vint lane;
    for (int j = 0; j < VLEN; ++j) lane[j] = j;
    s = lane < n ? s : splat(-__builtin_inff());
  }
  const float new_max = std::max(row_max, hmax(s));
  if constexpr (kFeat) {
    if (new_max == -__builtin_inff()) return;  // every key of the tile before the window
  }
  const float alpha = std::exp2(row_max - new_max);  // 0 on the first tile (max was -inf)
  const vfloat p = exp2_neg(s - new_max);
  row_sum = row_sum * alpha + hsum(p);
  row_max = new_max;
  float pj[VLEN];
  storeu(pj, p);
  if constexpr (DC != 0) {
    vfloat r[DC / VLEN];
    for (int c = 0; c < DC / VLEN; ++c) r[c] = loadu(acc + c * VLEN) * alpha;
    for (int j = 0; j < n; ++j)
      for (int c = 0; c < DC / VLEN; ++c) r[c] += pj[j] * loadu(vp[j] + c * VLEN);
    for (int c = 0; c < DC / VLEN; ++c) storeu(acc + c * VLEN, r[c]);
  } else {
    for (int c = 0; c < d; c += VLEN) {
      vfloat r = loadu(acc + c) * alpha;
      for (int j = 0; j < n; ++j) r += pj[j] * loadu(vp[j] + c);
      storeu(acc + c, r);
    }
  }
}

// One row against one key tile: scores, online-softmax update, accumulate P.V.
template <int DC, bool kFeat = false>
static inline void row_step(const float* q, float* acc, float& row_max, float& row_sum,
                            const float* const* kp, const float* const* vp, int n, int dim,
                            const RowFeat* rf = nullptr) {
  const int d = DC ? DC : dim;
  vfloat part[VLEN];
  for (int j = 0; j < n; ++j) {
    vfloat s = loadu(q) * loadu(kp[j]);
    for (int c = VLEN; c < d; c += VLEN) s += loadu(q + c) * loadu(kp[j] + c);
    part[j] = s;
  }
  for (int j = n; j < VLEN; ++j) part[j] = vfloat{};
  row_update<DC, kFeat>(transpose_sum(part), acc, row_max, row_sum, vp, n, dim, rf);
}

// The online-softmax update of VLEN lanes for one key tile: s[j] (key kt + j's scores, log2
// units) become the probabilities, masked keys 0; returns the lanes' rescale factor.
template <bool kFeat>
static inline vfloat lanes_softmax(vfloat* s, int n, int kt, float* lane_max, float* lane_sum,
                                   vint pos, vint lo, vfloat slope2, float cap2) {
  const vfloat ninf = splat(-__builtin_inff());
  const vfloat old_max = loadu(lane_max);
  vfloat mx = old_max;
  for (int j = 0; j < VLEN; ++j) {
    if constexpr (kFeat) {
      const vint key = vint{} + (kt + j);
      if (cap2 != 0.0f) s[j] = soft_cap(s[j], cap2);
      s[j] += slope2 * __builtin_convertvector(key - pos, vfloat);
      s[j] = (key >= lo) ? s[j] : ninf;
    }
    s[j] = j >= n ? ninf : (pos >= vint{} + (kt + j)) ? s[j] : ninf;
    mx = mx > s[j] ? mx : s[j];
  }
  const vfloat base = (mx == ninf) ? vfloat{} : mx;  // all-masked lanes: no -inf - -inf
  const vfloat alpha = exp2_neg(old_max - base);
  vfloat sum = loadu(lane_sum) * alpha;
  for (int j = 0; j < VLEN; ++j) {
    s[j] = exp2_neg(s[j] - base);
    sum += s[j];
  }
  storeu(lane_sum, sum);
  storeu(lane_max, mx);
  return alpha;
}

// VLEN rows of one kv head (lane l = row l of the group) against one key tile (keys kt..kt+n-1,
// rows of `kt_`/`vt_` [VLEN][d], zero past n). qT/accT are [d][VLEN]; pos holds each lane's
// position: key kt + j counts for lane l iff kt + j <= pos[l]. A lane that has seen no key yet
// keeps max -inf and sum 0.
// With kFeat, `lo` holds each lane's first visible key and `slope2` its ALiBi slope (log2
// units); cap2 the soft cap (0: none).
template <int DC, bool kFeat = false>
static inline void lanes_step(const float* kt_, const float* vt_, int n, int kt,
                              const float* qT, float* accT, float* lane_max, float* lane_sum,
                              vint pos, int dim, vint lo = vint{}, vfloat slope2 = vfloat{},
                              float cap2 = 0.0f) {
  const int d = DC ? DC : dim;
  vfloat s[VLEN];
  for (int j = 0; j < VLEN; ++j) s[j] = vfloat{};
  for (int c = 0; c < d; ++c) {  // VLEN independent FMA chains, keys broadcast from L1
    const vfloat q = loadu(qT + c * VLEN);
    for (int j = 0; j < VLEN; ++j) s[j] += q * kt_[j * d + c];
  }
  const vfloat alpha = lanes_softmax<kFeat>(s, n, kt, lane_max, lane_sum, pos, lo, slope2, cap2);
  // Four columns at a time, each as two half-sums: eight independent FMA chains.
  for (int c = 0; c < d; c += 4) {
    vfloat lo[4], hi[4];
    for (int i = 0; i < 4; ++i) lo[i] = loadu(accT + (c + i) * VLEN) * alpha, hi[i] = vfloat{};
    for (int j = 0; j < VLEN; j += 2)
      for (int i = 0; i < 4; ++i) {
        lo[i] += s[j] * vt_[j * d + c + i];
        hi[i] += s[j + 1] * vt_[(j + 1) * d + c + i];
      }
    for (int i = 0; i < 4; ++i) storeu(accT + (c + i) * VLEN, lo[i] + hi[i]);
  }
}

#if defined(__AVX512BF16__)
// ---- Pair path: bf16 K/V caches on AVX512-BF16 ----------------------------------------------
// vdpbf16ps multiplies the two bf16 of each 32-bit lane by the two of the other operand's lane
// exactly and adds both into the fp32 lane: 32 multiply-adds per instruction, from bf16 read
// as is. Scores: q and k as stored (the query is not pre-scaled, which would round it again),
// times scale * log2(e) after the dot. lanes_pairs also rounds P to bf16 for its P.V (one
// rounding of a probability in [0, 1], relative error <= 2^-9, summed in fp32); row_pairs keeps
// P in fp32 and widens V in registers.

static inline vfloat dpbf16(vfloat acc, __m512i a, __m512i b) {
  // Vector casts, not bit_cast: its memcpy kept accumulators on the stack (linear.cpp).
  return (vfloat)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}

// 32 bf16 from p; the last 16 of a head dim that is an odd multiple of 16 (masked: zeros,
// never a fault past the row).
static inline __m512i load_pairs(const bf16_t* p, int left) {
  return left >= 32 ? _mm512_loadu_si512(static_cast<const void*>(p))
                    : _mm512_maskz_loadu_epi16(0xffffu, p);
}

static inline __m512i bcast_pair(const void* p) {
  uint32_t u;
  std::memcpy(&u, p, sizeof u);
  return _mm512_set1_epi32(int(u));
}

// One row (bf16 query as stored) against one key tile, K and V rows read from the cache.
template <int DC, bool kFeat = false>
static inline void row_pairs(const bf16_t* q, float qscale, float* acc, float& row_max,
                             float& row_sum, const bf16_t* const* kp, const bf16_t* const* vp,
                             int n, int dim, const RowFeat* rf = nullptr) {
  const int d = DC ? DC : dim;
  constexpr int kVecs = DC ? (DC + 31) / 32 : 8;
  __m512i qv[kVecs];
  const int nv = (d + 31) / 32;
  if (DC == 0 && nv > kVecs) {  // a long generic head dim: q reloaded per key from L1
    vfloat part[VLEN];
    for (int j = 0; j < n; ++j) {
      vfloat s{};
      for (int c = 0; c < d; c += 32)
        s = dpbf16(s, load_pairs(q + c, d - c), load_pairs(kp[j] + c, d - c));
      part[j] = s;
    }
    for (int j = n; j < VLEN; ++j) part[j] = vfloat{};
    row_update<DC, kFeat>(transpose_sum(part) * qscale, acc, row_max, row_sum, vp, n, dim, rf);
    return;
  }
  for (int i = 0; i < nv; ++i) qv[i] = load_pairs(q + 32 * i, d - 32 * i);
  vfloat part[VLEN];
  for (int j = 0; j < n; ++j) {
    vfloat s{};
    for (int i = 0; i < nv; ++i) s = dpbf16(s, qv[i], load_pairs(kp[j] + 32 * i, d - 32 * i));
    part[j] = s;
  }
  for (int j = n; j < VLEN; ++j) part[j] = vfloat{};
  row_update<DC, kFeat>(transpose_sum(part) * qscale, acc, row_max, row_sum, vp, n, dim, rf);
}

// R rows of one token (query heads sharing a kv head: one position, one causal limit n)
// against one key tile, K and V read in place: each K row feeds R dots and each widened V
// vector R FMAs, where row_pairs reloads (and rewidens) them per row. Rows are consecutive:
// query row r at q + r * q_stride, results at acc + r * DC, row_max[r], row_sum[r].
template <int DC, int R, bool kFeat = false>
static inline void rows_pairs(const bf16_t* q, int64_t q_stride, float qscale, float* acc,
                              float* row_max, float* row_sum, const bf16_t* const* kp,
                              const bf16_t* const* vp, int n, const RowFeat* rf = nullptr) {
  static_assert(DC % 32 == 0, "whole pairs of vectors");
  constexpr int NQ = DC / 32, NV = DC / VLEN;
  __m512i qv[R][NQ];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NQ; ++i)
      qv[r][i] = _mm512_loadu_si512(static_cast<const void*>(q + r * q_stride + 32 * i));
  vfloat part[R][VLEN];
  for (int j = 0; j < n; ++j) {
    __m512i kv[NQ];
    for (int i = 0; i < NQ; ++i)
      kv[i] = _mm512_loadu_si512(static_cast<const void*>(kp[j] + 32 * i));
    for (int r = 0; r < R; ++r) {
      vfloat s{};
      for (int i = 0; i < NQ; ++i) s = dpbf16(s, qv[r][i], kv[i]);
      part[r][j] = s;
    }
  }
  float pj[R][VLEN];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    for (int j = n; j < VLEN; ++j) part[r][j] = vfloat{};
    vfloat s = transpose_sum(part[r]) * qscale;
    if constexpr (kFeat) {
      vint key;
      for (int j = 0; j < VLEN; ++j) key[j] = rf[r].kt + j;
      if (rf[r].cap2 != 0.0f) s = soft_cap(s, rf[r].cap2);
      s += splat(rf[r].slope2) * __builtin_convertvector(key - rf[r].pos, vfloat);
      s = key >= rf[r].lo ? s : splat(-__builtin_inff());
    }
    if (n < VLEN) {
      vint lane;
      for (int j = 0; j < VLEN; ++j) lane[j] = j;
      s = lane < n ? s : splat(-__builtin_inff());
    }
    const float new_max = std::max(row_max[r], hmax(s));
    if (kFeat && new_max == -__builtin_inff()) {  // every key of the tile before the window
      alpha[r] = 1.0f;
      storeu(pj[r], vfloat{});
      continue;
    }
    alpha[r] = std::exp2(row_max[r] - new_max);  // 0 on the first tile (max was -inf)
    const vfloat p = exp2_neg(s - new_max);
    row_sum[r] = row_sum[r] * alpha[r] + hsum(p);
    row_max[r] = new_max;
    storeu(pj[r], p);
  }
  // Column chunks that keep R x CH accumulators in registers.
  constexpr int CH = R * NV <= 24 ? NV : 4;
  for (int c0 = 0; c0 < NV; c0 += CH) {
    vfloat o[R][CH];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CH; ++c) o[r][c] = loadu(acc + r * DC + (c0 + c) * VLEN) * alpha[r];
    for (int j = 0; j < n; ++j)
      for (int c = 0; c < CH; ++c) {
        const vfloat v = loadu(vp[j] + (c0 + c) * VLEN);
        for (int r = 0; r < R; ++r) o[r][c] += splat(pj[r][j]) * v;
      }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CH; ++c) storeu(acc + r * DC + (c0 + c) * VLEN, o[r][c]);
  }
}

// rows_pairs for a run-time R in 1..4.
template <int DC, bool kFeat>
static inline void rows_pairs_any(int R, const bf16_t* q, int64_t q_stride, float qscale,
                                  float* acc, float* row_max, float* row_sum,
                                  const bf16_t* const* kp, const bf16_t* const* vp, int n,
                                  const RowFeat* rf) {
  auto run = [&](auto r) {
    rows_pairs<DC, decltype(r)::value, kFeat>(q, q_stride, qscale, acc, row_max, row_sum, kp,
                                              vp, n, rf);
  };
  switch (R) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    default: return run(std::integral_constant<int, 4>{});
  }
}

// The K/V tile of keys [kt, kt + n) for every kv head of the item, for lanes_pairs: K rows
// copied to sc.kb [head][VLEN][d], V rows interleaved by key pairs into sc.vb
// [head][VLEN/2][d] (lane (jp, c) = (v[2jp][c], v[2jp + 1][c])), zero past n.
static inline void load_pair_tile(const PagedAttentionArgs& a, const int32_t* table,
                                  const WorkItem& w, int kt, int n, const Geometry& g,
                                  Scratch& sc) {
  const bf16_t* kc = static_cast<const bf16_t*>(a.k_cache);
  const bf16_t* vc = static_cast<const bf16_t*>(a.v_cache);
  const int heads = w.head_end - w.head_begin, d = g.d;
  const bf16_t* vrow[VLEN] = {};
  int blk = kt / g.bs, off = kt % g.bs;
  const bf16_t* rows[VLEN] = {};
  for (int j = 0; j < n; ++j) {
    const int64_t base = ((int64_t(table[blk]) * g.bs + off) * g.kvh + w.head_begin) * d;
    rows[j] = kc + base;  // head hh at + hh * d
    vrow[j] = vc + base;
    if (++off == g.bs) off = 0, ++blk;
  }
  for (int hh = 0; hh < heads; ++hh) {
    bf16_t* kd = sc.kb.data() + size_t(hh) * VLEN * d;
    for (int j = 0; j < n; ++j) std::memcpy(kd + j * d, rows[j] + hh * d, d * sizeof(bf16_t));
    if (n < VLEN) std::fill_n(kd + n * d, (VLEN - n) * d, bf16_t(0));
    uint32_t* vd = sc.vb.data() + size_t(hh) * VLEN / 2 * d;
    for (int jp = 0; jp < VLEN / 2; ++jp) {
      const int j0 = 2 * jp, j1 = 2 * jp + 1;
      uint32_t* dst = vd + jp * d;
      if (j0 >= n) {
        std::fill_n(dst, d, 0u);
        continue;
      }
      const bf16_t* v0 = vrow[j0] + hh * d;
      for (int c = 0; c < d; c += VLEN) {
        const vuint lo = bit_cast<vuint>(loadu(v0 + c)) >> 16;
        const vuint hi = j1 < n ? bit_cast<vuint>(loadu(vrow[j1] + hh * d + c)) : vuint{};
        const vuint pair = lo | hi;
        std::memcpy(dst + c, &pair, sizeof pair);
      }
    }
  }
}

// Two probabilities per lane rounded to bf16 (to nearest even, as vcvtne2ps2bf16 rounds; p is
// finite, >= 0 and 0 or normal) as a pair: lo in the low half. Integer ops rather than
// vcvtne2ps2bf16 + vpermw: as fast here, and SIMDe (the emulated test build) lacks the former.
static inline __m512i pair_bf16(vfloat lo, vfloat hi) {
  const vuint a = bit_cast<vuint>(lo), b = bit_cast<vuint>(hi);
  const vuint ra = a + 0x7fffu + ((a >> 16) & 1u), rb = b + 0x7fffu + ((b >> 16) & 1u);
  return (__m512i)((ra >> 16) | (rb & 0xffff0000u));
}

// The lanes' queries as bf16 pairs: lane l of qT2[c2] = (q_l[2 c2], q_l[2 c2 + 1]).
static inline void put_lane_query(uint32_t* qT2, int lane, const bf16_t* q, int d) {
  for (int c2 = 0; c2 < d / 2; ++c2) std::memcpy(qT2 + c2 * VLEN + lane, q + 2 * c2, 4);
}

// lanes_step on the pair path: kt_ [VLEN][d] bf16, vt_ [VLEN/2][d] pairs (load_pair_tile),
// qT2 [d/2][VLEN] pairs; the rest as lanes_step.
template <int DC, bool kFeat = false>
static inline void lanes_pairs(const bf16_t* kt_, const uint32_t* vt_, int n, int kt,
                               const uint32_t* qT2, float qscale, float* accT, float* lane_max,
                               float* lane_sum, vint pos, int dim, vint lo = vint{},
                               vfloat slope2 = vfloat{}, float cap2 = 0.0f) {
  const int d = DC ? DC : dim;
  vfloat s[VLEN];
  for (int j = 0; j < VLEN; ++j) s[j] = vfloat{};
  for (int c2 = 0; c2 < d / 2; ++c2) {  // VLEN independent chains, key pairs broadcast
    const __m512i q = _mm512_loadu_si512(static_cast<const void*>(qT2 + c2 * VLEN));
    for (int j = 0; j < VLEN; ++j) s[j] = dpbf16(s[j], q, bcast_pair(kt_ + j * d + 2 * c2));
  }
  for (int j = 0; j < VLEN; ++j) s[j] *= qscale;
  const vfloat alpha =
      lanes_softmax<kFeat>(s, n, kt, lane_max, lane_sum, pos, lo, slope2, cap2);
  // P as bf16 pairs per lane: (p[2jp], p[2jp + 1]), the layout of vt_'s lanes.
  __m512i p[VLEN / 2];
  for (int jp = 0; jp < VLEN / 2; ++jp) p[jp] = pair_bf16(s[2 * jp], s[2 * jp + 1]);
  // Eight columns at a time: eight independent chains of VLEN/2 pair steps.
  for (int c = 0; c < d; c += 8) {
    vfloat r[8];
    for (int i = 0; i < 8; ++i) r[i] = loadu(accT + (c + i) * VLEN) * alpha;
    for (int jp = 0; jp < VLEN / 2; ++jp)
      for (int i = 0; i < 8; ++i) r[i] = dpbf16(r[i], p[jp], bcast_pair(vt_ + jp * d + c + i));
    for (int i = 0; i < 8; ++i) storeu(accT + (c + i) * VLEN, r[i]);
  }
}
#endif  // __AVX512BF16__

}  // namespace
