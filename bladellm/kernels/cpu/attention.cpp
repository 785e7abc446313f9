// Paged attention for any mix of decodes, speculative verifications and prefill chunks, reading
// K/V in place from the paged cache (no gather copy). Semantics: kernels/ref.py paged_attention.
//
// Work item = (request, tile of query tokens, range of kv heads[, key partition]). Its rows are
// the tile's tokens x the query heads of those kv heads; each K/V tile of VLEN keys is loaded
// (widened from bf16, or dequantized from int8 rows with their per-row scale) once per kv head
// for all the rows sharing it, then folded into the rows by row_step or lanes_step
// (attention_tiles.h); bf16 on AVX512-BF16 skips the fp32 tile (the pair path, run_*_pairs).
// Decodes take all kv heads in one item: a key's rows for every head are adjacent in the
// cache, so the item streams whole blocks instead of picking 128-byte rows out of them
// (decode is bound by memory latency more than compute).
// Per row: fp32 scores, online softmax in base 2 (running max, running sum, rescale), fp32
// accumulator, one rounding at the end.
#include <omp.h>

#include "attention_tiles.h"

namespace {

// A lane group's view of the features for key tile [kt, kt + n): false when the whole tile
// precedes every lane's window; else each lane's first visible key and ALiBi slope (log2).
static inline bool lane_features(const Features& f, const WorkItem& w, const Geometry& g,
                                 const Scratch& sc, int hh, int grp, int per_head, int kt,
                                 int n, vint pos, vint& lo, vfloat& slope2) {
  // Lane positions grow with the lane: the first lane's window starts first.
  if (f.window > 0 && sc.lane_pos[grp * VLEN] - f.window + 1 > kt + n - 1) return false;
  lo = f.window > 0 ? pos - (f.window - 1) : vint{} + (-0x7fffffff);
  slope2 = vfloat{};
  if (f.slopes != nullptr)
    for (int l = 0; l < VLEN; ++l) {
      const int r = std::min(grp * VLEN + l, per_head - 1);
      slope2[l] = f.slopes[(w.head_begin + hh) * g.G + r % g.G] * 1.4426950408889634f;
    }
  return true;
}

// Lane bookkeeping shared by the lanes paths: zeroed accumulators, max -inf, sums 0, and each
// lane's position (padding lanes copy the last row's).
static inline void init_lanes(Scratch& sc, int lanes, int d, int first_pos, int per_head,
                              int G) {
  std::fill_n(sc.acct.data(), lanes * d, 0.0f);
  std::fill_n(sc.lane_max.data(), lanes, -__builtin_inff());
  std::fill_n(sc.lane_sum.data(), lanes, 0.0f);
  for (int r = 0; r < lanes; ++r) sc.lane_pos[r] = first_pos + std::min(r, per_head - 1) / G;
}

// The lanes' results back to row-major sc.acc / row_max / row_sum, as row_step leaves them.
static inline void lanes_to_rows(Scratch& sc, int heads, int groups, int per_head, int d) {
  for (int hh = 0; hh < heads; ++hh)
    for (int r = 0; r < per_head; ++r) {
      const int idx = (hh * groups + r / VLEN), lane = r % VLEN, m = hh * per_head + r;
      for (int c = 0; c < d; ++c) sc.acc[m * d + c] = sc.acct[(idx * d + c) * VLEN + lane];
      sc.row_max[m] = sc.lane_max[idx * VLEN + lane];
      sc.row_sum[m] = sc.lane_sum[idx * VLEN + lane];
    }
}

// Query row (token t of the item, query head h of kv head hh) as stored.
template <typename T>
static inline const T* query_row(const PagedAttentionArgs& a, const WorkItem& w,
                                 const Geometry& g, int hh, int t, int h) {
  return static_cast<const T*>(a.query) + (g.q_begin_token + t) * a.q_stride_token +
         (int64_t(w.head_begin + hh) * g.G + h) * a.q_stride_head;
}

// The item's rows (already in sc.q, row-major) through lanes_step, VLEN rows per group; the
// results go back to sc.acc / row_max / row_sum, row-major, as row_step leaves them.
template <typename C, int DC, bool kFeat>
static void run_lanes(const PagedAttentionArgs& a, const WorkItem& w, const Geometry& g,
                      Scratch& sc, const int32_t* table, int first_pos, int key_end) {
  const Features f = features_of(a);
  const int d = g.d, heads = w.head_end - w.head_begin, per_head = g.tokens * g.G;
  const int groups = (per_head + VLEN - 1) / VLEN;
  sc.reserve_lanes(heads * groups, d);
  std::fill_n(sc.qt.data(), heads * groups * d * VLEN, 0.0f);  // padding lanes: zero query
  init_lanes(sc, heads * groups * VLEN, d, first_pos, per_head, g.G);
  for (int hh = 0; hh < heads; ++hh)
    for (int r = 0; r < per_head; ++r)
      for (int c = 0; c < d; ++c)
        sc.qt[((hh * groups + r / VLEN) * d + c) * VLEN + r % VLEN] =
            sc.q[(hh * per_head + r) * d + c];
  const float** kp = sc.kp.data();
  const float** vp = sc.vp.data();
  for (int kt = w.key_begin; kt < key_end; kt += VLEN) {
    const int n = std::min(VLEN, key_end - kt);
    if (kt + VLEN < key_end)
      prefetch_kv_tile<C>(a, table, w, kt + VLEN, std::min(VLEN, key_end - kt - VLEN), g);
    load_kv_tile<C, true>(a, table, w, kt, n, g, sc, kp, vp);
    for (int hh = 0; hh < heads; ++hh)
      for (int grp = 0; grp < groups; ++grp) {
        if (sc.lane_pos[grp * VLEN + VLEN - 1] < kt) continue;  // whole tile in their future
        vint pos;
        std::memcpy(&pos, sc.lane_pos.data() + grp * VLEN, sizeof pos);
        const int idx = hh * groups + grp;
        if constexpr (kFeat) {
          vint lo;
          vfloat slope2;
          if (!lane_features(f, w, g, sc, hh, grp, per_head, kt, n, pos, lo, slope2)) continue;
          lanes_step<DC, true>(sc.k.data() + hh * VLEN * d, sc.v.data() + hh * VLEN * d, n, kt,
                               sc.qt.data() + idx * d * VLEN, sc.acct.data() + idx * d * VLEN,
                               sc.lane_max.data() + idx * VLEN, sc.lane_sum.data() + idx * VLEN,
                               pos, d, lo, slope2, f.cap2);
        } else {
          lanes_step<DC>(sc.k.data() + hh * VLEN * d, sc.v.data() + hh * VLEN * d, n, kt,
                         sc.qt.data() + idx * d * VLEN, sc.acct.data() + idx * d * VLEN,
                         sc.lane_max.data() + idx * VLEN, sc.lane_sum.data() + idx * VLEN, pos,
                         d);
        }
      }
  }
  lanes_to_rows(sc, heads, groups, per_head, d);
}

// The item's rows one at a time through row_step, reading sc.q and leaving sc.acc / row_max /
// row_sum.
template <typename C, int DC, bool kFeat>
static void run_rows(const PagedAttentionArgs& a, const WorkItem& w, const Geometry& g,
                     Scratch& sc, const int32_t* table, int first_pos, int key_end) {
  const Features f = features_of(a);
  const float** kp = sc.kp.data();
  const float** vp = sc.vp.data();
  for (int kt = w.key_begin; kt < key_end; kt += VLEN) {
    const int n = std::min(VLEN, key_end - kt);
    if (kt + VLEN < key_end)
      prefetch_kv_tile<C>(a, table, w, kt + VLEN, std::min(VLEN, key_end - kt - VLEN), g);
    load_kv_tile<C, false>(a, table, w, kt, n, g, sc, kp, vp);
    for (int hh = 0; hh < w.head_end - w.head_begin; ++hh)
      for (int t = std::max(0, kt - first_pos); t < g.tokens; ++t) {
        const int valid = std::min(n, first_pos + t - kt + 1);  // causal: keys <= position
        if constexpr (kFeat) {
          const int pos = first_pos + t;
          const int lo = f.window > 0 ? pos - f.window + 1 : -0x7fffffff;
          if (lo > kt + n - 1) break;  // this and every later row: the tile precedes the window
          for (int h = 0; h < g.G; ++h) {
            const int m = g.row(hh, t, h);
            const float slope =
                f.slopes != nullptr ? f.slopes[(w.head_begin + hh) * g.G + h] : 0.0f;
            const RowFeat rf{kt, pos, lo, slope * 1.4426950408889634f, f.cap2};
            row_step<DC, true>(sc.q.data() + m * g.d, sc.acc.data() + m * g.d, sc.row_max[m],
                               sc.row_sum[m], kp + hh * VLEN, vp + hh * VLEN, valid, g.d, &rf);
          }
        } else {
          for (int h = 0; h < g.G; ++h) {
            const int m = g.row(hh, t, h);
            row_step<DC>(sc.q.data() + m * g.d, sc.acc.data() + m * g.d, sc.row_max[m],
                         sc.row_sum[m], kp + hh * VLEN, vp + hh * VLEN, valid, g.d);
          }
        }
      }
  }
}

#if defined(__AVX512BF16__)
// run_lanes on the pair path: the queries taken as stored, K/V tiles by load_pair_tile.
template <int DC, bool kFeat>
static void run_lanes_pairs(const PagedAttentionArgs& a, const WorkItem& w, const Geometry& g,
                            Scratch& sc, const int32_t* table, int first_pos, int key_end,
                            float qscale) {
  const Features f = features_of(a);
  const int d = g.d, heads = w.head_end - w.head_begin, per_head = g.tokens * g.G;
  const int groups = (per_head + VLEN - 1) / VLEN;
  sc.reserve_lanes(heads * groups, d);
  sc.reserve_pairs(heads, heads * groups, d);
  std::fill_n(sc.qt2.data(), heads * groups * d / 2 * VLEN, 0u);  // padding lanes: zero query
  init_lanes(sc, heads * groups * VLEN, d, first_pos, per_head, g.G);
  for (int hh = 0; hh < heads; ++hh)
    for (int r = 0; r < per_head; ++r)
      put_lane_query(sc.qt2.data() + (hh * groups + r / VLEN) * d / 2 * VLEN, r % VLEN,
                     query_row<bf16_t>(a, w, g, hh, r / g.G, r % g.G), d);
  for (int kt = w.key_begin; kt < key_end; kt += VLEN) {
    const int n = std::min(VLEN, key_end - kt);
    if (kt + VLEN < key_end)
      prefetch_kv_tile<bf16_t>(a, table, w, kt + VLEN, std::min(VLEN, key_end - kt - VLEN), g);
    load_pair_tile(a, table, w, kt, n, g, sc);
    for (int hh = 0; hh < heads; ++hh)
      for (int grp = 0; grp < groups; ++grp) {
        if (sc.lane_pos[grp * VLEN + VLEN - 1] < kt) continue;  // whole tile in their future
        vint pos;
        std::memcpy(&pos, sc.lane_pos.data() + grp * VLEN, sizeof pos);
        const int idx = hh * groups + grp;
        const bf16_t* kt_ = sc.kb.data() + hh * VLEN * d;
        const uint32_t* vt_ = sc.vb.data() + hh * VLEN / 2 * d;
        const uint32_t* q2 = sc.qt2.data() + idx * d / 2 * VLEN;
        float* accT = sc.acct.data() + idx * d * VLEN;
        if constexpr (kFeat) {
          vint lo;
          vfloat slope2;
          if (!lane_features(f, w, g, sc, hh, grp, per_head, kt, n, pos, lo, slope2)) continue;
          lanes_pairs<DC, true>(kt_, vt_, n, kt, q2, qscale, accT,
                                sc.lane_max.data() + idx * VLEN, sc.lane_sum.data() + idx * VLEN,
                                pos, d, lo, slope2, f.cap2);
        } else {
          lanes_pairs<DC>(kt_, vt_, n, kt, q2, qscale, accT, sc.lane_max.data() + idx * VLEN,
                          sc.lane_sum.data() + idx * VLEN, pos, d);
        }
      }
  }
  lanes_to_rows(sc, heads, groups, per_head, d);
}

// run_rows on the pair path: queries as stored, K and V rows read in place from the cache.
template <int DC, bool kFeat>
static void run_rows_pairs(const PagedAttentionArgs& a, const WorkItem& w, const Geometry& g,
                           Scratch& sc, const int32_t* table, int first_pos, int key_end,
                           float qscale) {
  const Features f = features_of(a);
  const bf16_t* kc = static_cast<const bf16_t*>(a.k_cache);
  const bf16_t* vc = static_cast<const bf16_t*>(a.v_cache);
  const int heads = w.head_end - w.head_begin;
  const bf16_t* kp[VLEN];
  const bf16_t* vp[VLEN];
  for (int kt = w.key_begin; kt < key_end; kt += VLEN) {
    const int n = std::min(VLEN, key_end - kt);
    if (kt + VLEN < key_end)
      prefetch_kv_tile<bf16_t>(a, table, w, kt + VLEN, std::min(VLEN, key_end - kt - VLEN), g);
    for (int hh = 0; hh < heads; ++hh) {
      int blk = kt / g.bs, off = kt % g.bs;
      for (int j = 0; j < n; ++j) {
        const int64_t row =
            ((int64_t(table[blk]) * g.bs + off) * g.kvh + w.head_begin + hh) * g.d;
        kp[j] = kc + row, vp[j] = vc + row;
        if (++off == g.bs) off = 0, ++blk;
      }
      for (int t = std::max(0, kt - first_pos); t < g.tokens; ++t) {
        const int valid = std::min(n, first_pos + t - kt + 1);  // causal: keys <= position
        const int pos = first_pos + t;
        RowFeat rf[4];
        if constexpr (kFeat) {
          const int lo = f.window > 0 ? pos - f.window + 1 : -0x7fffffff;
          if (lo > kt + n - 1) break;  // this and every later row: the tile precedes the window
          for (int h = 0; h < std::min(4, g.G); ++h) rf[h] = {kt, pos, lo, 0.0f, f.cap2};
        }
        if constexpr (DC != 0) {  // the token's query heads, up to four at a time
          for (int h0 = 0; h0 < g.G; h0 += 4) {
            const int R = std::min(4, g.G - h0), m = g.row(hh, t, h0);
            if constexpr (kFeat)
              for (int r = 0; r < R; ++r)
                rf[r].slope2 = f.slopes != nullptr
                                   ? f.slopes[(w.head_begin + hh) * g.G + h0 + r] *
                                         1.4426950408889634f
                                   : 0.0f;
            const bf16_t* q = query_row<bf16_t>(a, w, g, hh, t, h0);
            float* acc = sc.acc.data() + m * g.d;
            float* mx = sc.row_max.data() + m;
            float* sm = sc.row_sum.data() + m;
            rows_pairs_any<DC, kFeat>(R, q, a.q_stride_head, qscale, acc, mx, sm, kp, vp, valid,
                                      rf);
          }
        } else {
          for (int h = 0; h < g.G; ++h) {
            const int m = g.row(hh, t, h);
            if constexpr (kFeat)
              rf[0].slope2 = f.slopes != nullptr ? f.slopes[(w.head_begin + hh) * g.G + h] *
                                                       1.4426950408889634f
                                                 : 0.0f;
            row_pairs<DC, kFeat>(query_row<bf16_t>(a, w, g, hh, t, h), qscale,
                                 sc.acc.data() + m * g.d, sc.row_max[m], sc.row_sum[m], kp, vp,
                                 valid, g.d, rf);
          }
        }
      }
    }
  }
}
#endif  // __AVX512BF16__

// T: query / output dtype; C: cache element (T, or int8_t for an int8 cache).
template <typename T, typename C, int DC, bool kFeat>
static void run_item(const PagedAttentionArgs& a, const WorkItem& w, Scratch& sc,
                     float* partial) {
  const int d = DC ? DC : a.head_dim;
  const int G = a.num_heads / a.num_kv_heads;
  const int32_t start = a.query_start_loc[w.req];
  const int q_len = a.query_start_loc[w.req + 1] - start;
  const int tokens = w.q_end - w.q_begin;
  const Geometry g{d, G, a.num_kv_heads, a.block_size, start + w.q_begin,
                   a.seq_lens[w.req] - q_len, tokens, item_rows(w, G)};
  sc.reserve(g.rows, w.head_end - w.head_begin, d);
  const T* query = static_cast<const T*>(a.query);
  const float qscale = a.scale * 1.4426950408889634f;  // scores in log2 units: exp2 below
  if constexpr (!kPairPath<T, C>)  // the pair path reads the queries as stored
    for (int hh = 0; hh < w.head_end - w.head_begin; ++hh)
      for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < G; ++h) {
          const T* src = query + (g.q_begin_token + t) * a.q_stride_token +
                         (int64_t(w.head_begin + hh) * G + h) * a.q_stride_head;
          float* dst = sc.q.data() + g.row(hh, t, h) * d;
          for (int c = 0; c < d; c += VLEN) storeu(dst + c, loadu(src + c) * qscale);
        }
  std::fill_n(sc.acc.data(), g.rows * d, 0.0f);
  std::fill_n(sc.row_max.data(), g.rows, -__builtin_inff());
  std::fill_n(sc.row_sum.data(), g.rows, 0.0f);

  const int32_t* table = a.block_tables + w.req * a.block_table_stride;
  const int first_pos = g.ctx_start + w.q_begin;  // the first token's position
  const int key_end = std::min(w.key_end, g.ctx_start + w.q_end);
  // Lanes pay for VLEN rows whatever the count; from half full on they still win, for decodes
  // with large GQA groups and for short verifications alike (docs/kernels.md).
  const bool lanes = tokens * G >= VLEN / 2;
#if defined(__AVX512BF16__)
  if constexpr (kPairPath<T, C>) {
    if (lanes)
      run_lanes_pairs<DC, kFeat>(a, w, g, sc, table, first_pos, key_end, qscale);
    else
      run_rows_pairs<DC, kFeat>(a, w, g, sc, table, first_pos, key_end, qscale);
  } else
#endif
  if (lanes)
    run_lanes<C, DC, kFeat>(a, w, g, sc, table, first_pos, key_end);
  else
    run_rows<C, DC, kFeat>(a, w, g, sc, table, first_pos, key_end);

  if (partial != nullptr) {  // a key partition: keep (acc, max, sum) for the combine pass
    std::copy_n(sc.acc.data(), g.rows * d, partial);
    std::copy_n(sc.row_max.data(), g.rows, partial + g.rows * d);
    std::copy_n(sc.row_sum.data(), g.rows, partial + g.rows * (d + 1));
    return;
  }
  T* out = static_cast<T*>(a.out);
  for (int hh = 0; hh < w.head_end - w.head_begin; ++hh)
    for (int t = 0; t < tokens; ++t)
      for (int h = 0; h < G; ++h) {
        const int m = g.row(hh, t, h);
        const vfloat inv = splat(1.0f / sc.row_sum[m]);
        T* dst = out + ((g.q_begin_token + t) * int64_t(a.num_heads) +
                        (w.head_begin + hh) * G + h) * d;
        for (int c = 0; c < d; c += VLEN)
          storeu(dst + c, loadu(sc.acc.data() + m * d + c) * inv);
      }
}

// Merge the partitions of one split item: rescale each by 2^(max_p - max) and normalise once.
template <typename T>
static void combine_parts(const PagedAttentionArgs& a, const WorkItem& w, const float* partial) {
  const int d = a.head_dim, G = a.num_heads / a.num_kv_heads;
  const int tokens = w.q_end - w.q_begin, rows = item_rows(w, G);
  const int64_t part_size = int64_t(rows) * (d + 2);
  const int32_t first_token = a.query_start_loc[w.req] + w.q_begin;
  std::vector<float> acc(d);
  for (int m = 0; m < rows; ++m) {
    float mx = -__builtin_inff();
    for (int p = 0; p < w.num_parts; ++p)
      mx = std::max(mx, partial[p * part_size + rows * d + m]);
    float sum = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int p = 0; p < w.num_parts; ++p) {
      const float* base = partial + p * part_size;
      const float pm = base[rows * d + m];
      if (pm == -__builtin_inff()) continue;  // this partition lies wholly after the row
      const float f = std::exp2(pm - mx);
      sum += base[rows * (d + 1) + m] * f;
      for (int c = 0; c < d; ++c) acc[c] += base[m * d + c] * f;
    }
    const int hh = m / (tokens * G), t = m / G % tokens, h = m % G;
    T* dst = static_cast<T*>(a.out) +
             ((first_token + t) * int64_t(a.num_heads) + (w.head_begin + hh) * G + h) * d;
    for (int c = 0; c < d; ++c) store1(dst + c, acc[c] / sum);
  }
}

// The shared pass of a cascade (SharedPass in attention_tiles.h): keys [0, w.key_end) of the
// members' common blocks against all their query rows, VLEN rows per lane group; each member's
// (acc, max, sum) goes to its slot in `partial`, laid out as its own item's rows.
template <typename T, typename C, int DC>
static void run_shared(const PagedAttentionArgs& a, const WorkItem& w, const SharedPass& sp,
                       Scratch& sc, float* partial) {
  const int d = DC ? DC : a.head_dim;
  const int G = a.num_heads / a.num_kv_heads, heads = w.head_end - w.head_begin;
  const int members = (int)sp.reqs.size(), tokens = sp.tokens;
  const int per_head = members * tokens * G, groups = (per_head + VLEN - 1) / VLEN;
  const Geometry g{d, G, a.num_kv_heads, a.block_size, 0, 0, tokens, heads * per_head};
  sc.reserve(1, heads, d);  // one row of scratch for widening a query
  sc.reserve_lanes(heads * groups, d);
  std::fill_n(sc.acct.data(), heads * groups * d * VLEN, 0.0f);
  std::fill_n(sc.lane_max.data(), heads * groups * VLEN, -__builtin_inff());
  std::fill_n(sc.lane_sum.data(), heads * groups * VLEN, 0.0f);
  const T* query = static_cast<const T*>(a.query);
  const float qscale = a.scale * 1.4426950408889634f;  // log2 units, as in run_item
  const int32_t* table = a.block_tables + int64_t(sp.reqs[0]) * a.block_table_stride;
  const vint after_all = vint{} + 0x7fffffff;  // every shared key precedes every query token
#if defined(__AVX512BF16__)
  if constexpr (kPairPath<T, C>) {  // as run_lanes_pairs
    sc.reserve_pairs(heads, heads * groups, d);
    std::fill_n(sc.qt2.data(), heads * groups * d / 2 * VLEN, 0u);  // padding lanes: zero
    for (int hh = 0; hh < heads; ++hh)
      for (int i = 0; i < members; ++i)
        for (int t = 0; t < tokens; ++t)
          for (int h = 0; h < G; ++h) {
            const int r = (i * tokens + t) * G + h;
            put_lane_query(sc.qt2.data() + (hh * groups + r / VLEN) * d / 2 * VLEN, r % VLEN,
                           query + (a.query_start_loc[sp.reqs[i]] + t) * a.q_stride_token +
                               (int64_t(w.head_begin + hh) * G + h) * a.q_stride_head,
                           d);
          }
    for (int kt = 0; kt < w.key_end; kt += VLEN) {
      const int n = std::min(VLEN, w.key_end - kt);
      if (kt + VLEN < w.key_end)
        prefetch_kv_tile<C>(a, table, w, kt + VLEN, std::min(VLEN, w.key_end - kt - VLEN), g);
      load_pair_tile(a, table, w, kt, n, g, sc);
      for (int hh = 0; hh < heads; ++hh)
        for (int grp = 0; grp < groups; ++grp) {
          const int idx = hh * groups + grp;
          lanes_pairs<DC>(sc.kb.data() + hh * VLEN * d, sc.vb.data() + hh * VLEN / 2 * d, n, kt,
                          sc.qt2.data() + idx * d / 2 * VLEN, qscale,
                          sc.acct.data() + idx * d * VLEN, sc.lane_max.data() + idx * VLEN,
                          sc.lane_sum.data() + idx * VLEN, after_all, d);
        }
    }
  } else
#endif
  {
    std::fill_n(sc.qt.data(), heads * groups * d * VLEN, 0.0f);  // padding lanes: zero query
    for (int hh = 0; hh < heads; ++hh)
      for (int i = 0; i < members; ++i)
        for (int t = 0; t < tokens; ++t)
          for (int h = 0; h < G; ++h) {
            const T* src = query + (a.query_start_loc[sp.reqs[i]] + t) * a.q_stride_token +
                           (int64_t(w.head_begin + hh) * G + h) * a.q_stride_head;
            float* row = sc.q.data();
            for (int c = 0; c < d; c += VLEN) storeu(row + c, loadu(src + c) * qscale);
            const int r = (i * tokens + t) * G + h;
            float* dst = sc.qt.data() + (hh * groups + r / VLEN) * d * VLEN + r % VLEN;
            for (int c = 0; c < d; ++c) dst[c * VLEN] = row[c];
          }
    const float** kp = sc.kp.data();
    const float** vp = sc.vp.data();
    for (int kt = 0; kt < w.key_end; kt += VLEN) {
      const int n = std::min(VLEN, w.key_end - kt);
      if (kt + VLEN < w.key_end)
        prefetch_kv_tile<C>(a, table, w, kt + VLEN, std::min(VLEN, w.key_end - kt - VLEN), g);
      load_kv_tile<C, true>(a, table, w, kt, n, g, sc, kp, vp);
      for (int hh = 0; hh < heads; ++hh)
        for (int grp = 0; grp < groups; ++grp) {
          const int idx = hh * groups + grp;
          lanes_step<DC>(sc.k.data() + hh * VLEN * d, sc.v.data() + hh * VLEN * d, n, kt,
                         sc.qt.data() + idx * d * VLEN, sc.acct.data() + idx * d * VLEN,
                         sc.lane_max.data() + idx * VLEN, sc.lane_sum.data() + idx * VLEN,
                         after_all, d);
        }
    }
  }
  const int rows = heads * tokens * G;  // a member's item: row (hh, t, h) = g.row(hh, t, h)
  for (int i = 0; i < members; ++i) {
    float* dst = partial + sp.slots[i];
    for (int hh = 0; hh < heads; ++hh)
      for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < G; ++h) {
          const int r = (i * tokens + t) * G + h, m = g.row(hh, t, h);
          const int idx = hh * groups + r / VLEN, lane = r % VLEN;
          for (int c = 0; c < d; ++c) dst[m * d + c] = sc.acct[(idx * d + c) * VLEN + lane];
          dst[rows * d + m] = sc.lane_max[idx * VLEN + lane];
          dst[rows * (d + 1) + m] = sc.lane_sum[idx * VLEN + lane];
        }
  }
}

struct Plan {
  std::vector<WorkItem> items;
  std::vector<SharedPass> shared;
  int64_t partial_size = 0;
};

// Groups of requests that read the same leading blocks. Candidates: requests of one query tile
// (decodes, verifications) with at least kMinSharedKeys keys of full blocks before their first
// query token. Sorted by query length, then block table in trie post-order (lexicographic, a
// table before any table it is a prefix of), a group's first member shares a non-increasing
// number of blocks with each next one; a group takes the first k of those that maximise
// (k - 1) x shared blocks (the blocks not read again), the rest start the next group.
struct SharedGroup {
  int begin, end, blocks;  // order[begin, end) share their first `blocks` blocks
};

static std::vector<SharedGroup> find_shared(const PagedAttentionArgs& a, int tile_tokens,
                                            std::vector<int>& order) {
  const int bs = a.block_size, min_blocks = (kMinSharedKeys + bs - 1) / bs;
  auto q_len = [&](int r) { return a.query_start_loc[r + 1] - a.query_start_loc[r]; };
  auto full_blocks = [&](int r) { return (a.seq_lens[r] - q_len(r)) / bs; };  // before queries
  auto row = [&](int r) { return a.block_tables + int64_t(r) * a.block_table_stride; };
  auto common = [&](int x, int y, int cap) {
    int n = 0;
    while (n < cap && row(x)[n] == row(y)[n]) ++n;
    return n;
  };
  order.clear();
  for (int r = 0; r < a.num_reqs; ++r)
    if (q_len(r) >= 1 && q_len(r) <= tile_tokens && full_blocks(r) >= min_blocks)
      order.push_back(r);
  std::vector<SharedGroup> groups;
  if (order.size() < 2) return groups;
  std::sort(order.begin(), order.end(), [&](int x, int y) {
    if (q_len(x) != q_len(y)) return q_len(x) < q_len(y);
    const int nx = full_blocks(x), ny = full_blocks(y), n = common(x, y, std::min(nx, ny));
    if (n < std::min(nx, ny)) return row(x)[n] < row(y)[n];
    return nx != ny ? nx > ny : x < y;  // one is a prefix of the other: the longer first
  });
  std::vector<int> shared;  // shared[k]: blocks order[i] shares with order[i + k]
  for (int i = 0; i + 1 < (int)order.size();) {
    const int first = order[i];
    shared.assign(1, full_blocks(first));
    for (int j = i + 1; j < (int)order.size() && q_len(order[j]) == q_len(first); ++j) {
      const int n = common(first, order[j], std::min(shared.back(), full_blocks(order[j])));
      if (n < min_blocks) break;
      shared.push_back(n);
    }
    if (shared.size() < 2) {  // nobody shares enough with order[i]
      ++i;
      continue;
    }
    int best = 1;  // the group order[i .. i + best]: best x shared[best] blocks not read again
    for (int k = 2; k < (int)shared.size(); ++k)
      if (int64_t(k) * shared[k] > int64_t(best) * shared[best]) best = k;
    groups.push_back({i, i + best + 1, shared[best]});
    i += best + 1;
  }
  return groups;
}

static Plan plan_work(const PagedAttentionArgs& a) {
  const int G = a.num_heads / a.num_kv_heads;
  const int tile_tokens = std::max(1, kTileRows / G);
  Plan plan;
  // Units: (request, query tile, kv heads), each with its output rows.
  std::vector<WorkItem> units;
  std::vector<int> first_unit(a.num_reqs + 1);
  for (int r = 0; r < a.num_reqs; ++r) {
    first_unit[r] = (int)units.size();
    const int q_len = a.query_start_loc[r + 1] - a.query_start_loc[r];
    const int ctx_start = a.seq_lens[r] - q_len;
    for (int q0 = 0; q0 < q_len; q0 += tile_tokens) {
      const int q1 = std::min(q_len, q0 + tile_tokens);
      const int heads = std::max(1, std::min({a.num_kv_heads, kItemRows / ((q1 - q0) * G),
                                              kItemHeadDims / a.head_dim}));
      for (int h = 0; h < a.num_kv_heads; h += heads) {
        const int h1 = std::min(a.num_kv_heads, h + heads);
        // A window: keys before the tile's first query's window are never read (the KV
        // manager may have freed their blocks).
        const int key0 = a.sliding_window > 0 ? std::max(0, ctx_start + q0 - a.sliding_window + 1)
                                              : 0;
        const int64_t cost = int64_t(ctx_start + q1 - key0) * (q1 - q0) * G * (h1 - h) + 64;
        units.push_back({r, h, h1, q0, q1, key0, ctx_start + q1, 0, 1, cost, -1});
      }
    }
  }
  first_unit[a.num_reqs] = (int)units.size();

  // Cascade: shared passes over common prefixes; their members' units keep the rest.
  std::vector<char> has_shared_slot(units.size(), 0);
  std::vector<WorkItem> shared_items;
  std::vector<std::vector<int>> pass_units;  // per pass: the member unit of each member
  std::vector<int> order;
  // No cascade with features: a shared pass has no per-row positions (ALiBi, window).
  const std::vector<SharedGroup> shared_groups =
      has_features(a) ? std::vector<SharedGroup>{} : find_shared(a, tile_tokens, order);
  for (const SharedGroup& sg : shared_groups) {
    const int members = sg.end - sg.begin, keys = sg.blocks * a.block_size;
    const int tokens = a.query_start_loc[order[sg.begin] + 1] - a.query_start_loc[order[sg.begin]];
    // Chunks of members so that a pass holds at most kSharedRows rows per kv head.
    const int chunks = (members * tokens * G + kSharedRows - 1) / kSharedRows;
    const int per_chunk = (members + chunks - 1) / chunks;
    // Same-length single-tile requests have the same kv-head split: walk it on the first.
    const int r0 = order[sg.begin];
    for (int u = first_unit[r0]; u < first_unit[r0 + 1]; ++u) {
      for (int c0 = 0; c0 < members; c0 += per_chunk) {
        SharedPass sp;
        sp.tokens = tokens;
        std::vector<int> mine;
        for (int i = c0; i < std::min(members, c0 + per_chunk); ++i) {
          const int r = order[sg.begin + i], mu = first_unit[r] + (u - first_unit[r0]);
          sp.reqs.push_back(r);
          mine.push_back(mu);
          units[mu].key_begin = keys;
          units[mu].cost = int64_t(units[mu].key_end - keys) * item_rows(units[mu], G) + 64;
          has_shared_slot[mu] = 1;
        }
        WorkItem w{r0, units[u].head_begin, units[u].head_end, 0, tokens, 0, keys, -1, 1,
                   // lanes_step does several row_steps' work in the time of one (weighted
                   // 1/4 here): cost in row_step units
                   int64_t(keys) * (int)sp.reqs.size() * tokens * G *
                       (units[u].head_end - units[u].head_begin) / 4 + 64, -1};
        w.shared = (int)plan.shared.size();
        plan.shared.push_back(std::move(sp));
        pass_units.push_back(std::move(mine));
        shared_items.push_back(w);
      }
    }
  }

  // Too few items to keep every thread busy (e.g. one long decode): split a unit's keys into
  // partitions of whole VLEN tiles, merged after the parallel pass.
  const int nt = a.num_threads;
  const int count = (int)(units.size() + shared_items.size());
  const int want = nt > 1 && count > 0 && count < nt ? (2 * nt + count - 1) / count : 1;
  std::vector<int64_t> slot_of(units.size(), -1);  // a member unit's shared slot
  int64_t offset = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const WorkItem& w = units[u];
    const int own = std::max(1, std::min(want, (w.key_end - w.key_begin) / kMinPartKeys));
    const int parts = own + has_shared_slot[u];
    if (parts == 1) {
      plan.items.push_back(w);
      continue;
    }
    const int64_t part_size = int64_t(item_rows(w, G)) * (a.head_dim + 2);
    const int first_tile = w.key_begin / VLEN, tiles = (w.key_end + VLEN - 1) / VLEN - first_tile;
    for (int p = 0; p < own; ++p) {
      WorkItem v = w;
      v.key_begin = std::max(w.key_begin, (first_tile + tiles * p / own) * VLEN);
      v.key_end = std::min(w.key_end, (first_tile + tiles * (p + 1) / own) * VLEN);
      v.part = p, v.num_parts = parts, v.cost = w.cost / own;
      v.partial_offset = offset + p * part_size;
      plan.items.push_back(v);
    }
    if (has_shared_slot[u]) slot_of[u] = offset + own * part_size;
    offset += parts * part_size;
  }
  for (size_t i = 0; i < shared_items.size(); ++i) {
    for (int mu : pass_units[i]) plan.shared[i].slots.push_back(slot_of[mu]);
    plan.items.push_back(shared_items[i]);
  }
  plan.partial_size = offset;
  // Longest first, handed out dynamically: a long prefill tile never starts last.
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return plan;
}

template <typename T, typename C, int DC, bool kFeat>
static void run_all(const PagedAttentionArgs& a) {
  const Plan plan = plan_work(a);
  const std::vector<WorkItem>& items = plan.items;
  std::vector<float> partial(plan.partial_size);
  const int n = (int)items.size();
  const bool par = a.num_threads > 1 && n > 1;
#pragma omp parallel num_threads(a.num_threads) if (par)
  {
    static thread_local Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) {
      const WorkItem& w = items[i];
      if (w.shared >= 0)
        run_shared<T, C, DC>(a, w, plan.shared[w.shared], sc, partial.data());
      else
        run_item<T, C, DC, kFeat>(a, w, sc, w.partial_offset >= 0 ? partial.data() + w.partial_offset
                                                        : nullptr);
    }
    if (plan.partial_size > 0) {
#pragma omp for schedule(dynamic, 1)
      for (int i = 0; i < n; ++i)
        if (items[i].part == 0 && items[i].partial_offset >= 0)
          combine_parts<T>(a, items[i], partial.data() + items[i].partial_offset);
    }
  }
}

template <typename T, typename C, bool kFeat>
static void dispatch_dim(const PagedAttentionArgs& a) {
  switch (a.head_dim) {
    case 64: return run_all<T, C, 64, kFeat>(a);
    case 128: return run_all<T, C, 128, kFeat>(a);
    default: return run_all<T, C, 0, kFeat>(a);
  }
}

template <typename T, typename C>
static void dispatch_features(const PagedAttentionArgs& a) {
  if (has_features(a)) return dispatch_dim<T, C, true>(a);
  return dispatch_dim<T, C, false>(a);
}

template <typename T>
static void dispatch_cache(const PagedAttentionArgs& a) {
  if (a.kv_int8) return dispatch_features<T, int8_t>(a);
  return dispatch_features<T, T>(a);
}

}  // namespace

// 0: done; 1: head_dim not a multiple of VLEN; 2: unsupported dtype; 3: bad head counts.
extern "C" int bl_paged_attention(const PagedAttentionArgs* a) {
  if (a->head_dim % VLEN != 0 || a->head_dim <= 0) return 1;
  if (a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads != 0) return 3;
  if (a->dtype == kFloat32) return dispatch_cache<float>(*a), 0;
  if (a->dtype == kBFloat16) return dispatch_cache<bf16_t>(*a), 0;
  return 2;
}

// The plan a call would run, for tests and benchmarks: counts[0] work items, counts[1] shared
// passes (cascade), counts[2] requests that read a prefix through one. Returns as above.
extern "C" int bl_paged_attention_plan(const PagedAttentionArgs* a, int32_t* counts) {
  if (a->head_dim % VLEN != 0 || a->head_dim <= 0) return 1;
  if (a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads != 0) return 3;
  const Plan plan = plan_work(*a);
  std::vector<char> member(a->num_reqs, 0);
  for (const SharedPass& sp : plan.shared)
    for (int32_t r : sp.reqs) member[r] = 1;
  counts[0] = (int32_t)plan.items.size();
  counts[1] = (int32_t)plan.shared.size();
  counts[2] = (int32_t)std::count(member.begin(), member.end(), 1);
  return 0;
}

extern "C" int bl_vector_lanes() { return VLEN; }
