// Paged attention for any mix of decodes, speculative verifications and prefill chunks, reading
// K/V in place from the paged cache (no gather copy). Semantics: kernels/ref.py paged_attention.
//
// Work item = (request, tile of query tokens, range of kv heads[, key partition]). Its rows are
// the tile's tokens x the query heads of those kv heads; each K/V tile of VLEN keys is loaded
// (widened from bf16, or dequantized from int8 rows with their per-row scale) once per kv head
// for all the rows sharing it, then folded into the rows by row_step or lanes_step
// (attention_tiles.h). Decodes take all kv heads in one item: a
// key's rows for every head are adjacent in the cache, so the item streams whole blocks instead
// of picking 128-byte rows out of them (decode is bound by memory latency more than compute).
// Per row: fp32 scores, online softmax in base 2 (running max, running sum, rescale), fp32
// accumulator, one rounding at the end.
#include <omp.h>

#include "attention_tiles.h"

namespace {

// The item's rows (already in sc.q, row-major) through lanes_step, VLEN rows per group; the
// results go back to sc.acc / row_max / row_sum, row-major, as row_step leaves them.
template <typename C, int DC>
static void run_lanes(const PagedAttentionArgs& a, const WorkItem& w, const Geometry& g,
                      Scratch& sc, const int32_t* table, int first_pos, int key_end) {
  const int d = g.d, heads = w.head_end - w.head_begin, per_head = g.tokens * g.G;
  const int groups = (per_head + VLEN - 1) / VLEN;
  sc.reserve_lanes(heads * groups, d);
  std::fill_n(sc.qt.data(), heads * groups * d * VLEN, 0.0f);  // padding lanes: zero query
  std::fill_n(sc.acct.data(), heads * groups * d * VLEN, 0.0f);
  std::fill_n(sc.lane_max.data(), heads * groups * VLEN, -__builtin_inff());
  std::fill_n(sc.lane_sum.data(), heads * groups * VLEN, 0.0f);
  for (int r = 0; r < groups * VLEN; ++r)  // padding lanes copy the last row's position
    sc.lane_pos[r] = first_pos + std::min(r, per_head - 1) / g.G;
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
        lanes_step<DC>(sc.k.data() + hh * VLEN * d, sc.v.data() + hh * VLEN * d, n, kt,
                       sc.qt.data() + idx * d * VLEN, sc.acct.data() + idx * d * VLEN,
                       sc.lane_max.data() + idx * VLEN, sc.lane_sum.data() + idx * VLEN, pos,
                       d);
      }
  }
  for (int hh = 0; hh < heads; ++hh)
    for (int r = 0; r < per_head; ++r) {
      const int idx = (hh * groups + r / VLEN), lane = r % VLEN, m = hh * per_head + r;
      for (int c = 0; c < d; ++c) sc.acc[m * d + c] = sc.acct[(idx * d + c) * VLEN + lane];
      sc.row_max[m] = sc.lane_max[idx * VLEN + lane];
      sc.row_sum[m] = sc.lane_sum[idx * VLEN + lane];
    }
}

// The item's rows one at a time through row_step, reading sc.q and leaving sc.acc / row_max /
// row_sum.
template <typename C, int DC>
static void run_rows(const PagedAttentionArgs& a, const WorkItem& w, const Geometry& g,
                     Scratch& sc, const int32_t* table, int first_pos, int key_end) {
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
        for (int h = 0; h < g.G; ++h) {
          const int m = g.row(hh, t, h);
          row_step<DC>(sc.q.data() + m * g.d, sc.acc.data() + m * g.d, sc.row_max[m],
                       sc.row_sum[m], kp + hh * VLEN, vp + hh * VLEN, valid, g.d);
        }
      }
  }
}

// T: query / output dtype; C: cache element (T, or int8_t for an int8 cache).
template <typename T, typename C, int DC>
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
  // Lanes pay for VLEN rows whatever the count; from half full on they still win (decode
  // 32 x 600 bf16, G=8: 7.8 -> 6.2 ms; 4-token verification, G=3: 10.0 -> 6.5 ms).
  if (tokens * G >= VLEN / 2)
    run_lanes<C, DC>(a, w, g, sc, table, first_pos, key_end);
  else
    run_rows<C, DC>(a, w, g, sc, table, first_pos, key_end);

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

static std::vector<WorkItem> plan_work(const PagedAttentionArgs& a) {
  const int G = a.num_heads / a.num_kv_heads;
  const int tile_tokens = std::max(1, kTileRows / G);
  std::vector<WorkItem> items;
  for (int r = 0; r < a.num_reqs; ++r) {
    const int q_len = a.query_start_loc[r + 1] - a.query_start_loc[r];
    const int ctx_start = a.seq_lens[r] - q_len;
    for (int q0 = 0; q0 < q_len; q0 += tile_tokens) {
      const int q1 = std::min(q_len, q0 + tile_tokens);
      const int heads = std::max(1, std::min({a.num_kv_heads, kItemRows / ((q1 - q0) * G),
                                              kItemHeadDims / a.head_dim}));
      for (int h = 0; h < a.num_kv_heads; h += heads) {
        const int h1 = std::min(a.num_kv_heads, h + heads);
        const int64_t cost = int64_t(ctx_start + q1) * (q1 - q0) * G * (h1 - h) + 64;
        items.push_back({r, h, h1, q0, q1, 0, ctx_start + q1, 0, 1, cost, -1});
      }
    }
  }
  // Too few items to keep every thread busy (e.g. one long decode): split keys into partitions
  // of whole VLEN tiles, merged after the parallel pass.
  const int nt = a.num_threads;
  if (nt > 1 && !items.empty() && (int)items.size() < nt) {
    std::vector<WorkItem> split;
    int64_t offset = 0;
    const int want = (2 * nt + (int)items.size() - 1) / (int)items.size();
    for (const WorkItem& w : items) {
      const int parts = std::max(1, std::min(want, w.key_end / kMinPartKeys));
      if (parts == 1) {
        split.push_back(w);
        continue;
      }
      const int64_t part_size = int64_t(item_rows(w, G)) * (a.head_dim + 2);
      const int tiles = (w.key_end + VLEN - 1) / VLEN;
      for (int p = 0; p < parts; ++p) {
        WorkItem u = w;
        u.key_begin = tiles * p / parts * VLEN;
        u.key_end = std::min(w.key_end, tiles * (p + 1) / parts * VLEN);
        u.part = p, u.num_parts = parts, u.cost = w.cost / parts;
        u.partial_offset = offset + p * part_size;
        split.push_back(u);
      }
      offset += parts * part_size;
    }
    items.swap(split);
  }
  // Longest first, handed out dynamically: a long prefill tile never starts last.
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return items;
}

template <typename T, typename C, int DC>
static void run_all(const PagedAttentionArgs& a) {
  const std::vector<WorkItem> items = plan_work(a);
  const int G = a.num_heads / a.num_kv_heads;
  int64_t partial_size = 0;
  for (const WorkItem& w : items)
    if (w.partial_offset >= 0)
      partial_size = std::max(partial_size, w.partial_offset +
                                                int64_t(item_rows(w, G)) * (a.head_dim + 2));
  std::vector<float> partial(partial_size);
  const int n = (int)items.size();
  const bool par = a.num_threads > 1 && n > 1;
#pragma omp parallel num_threads(a.num_threads) if (par)
  {
    static thread_local Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) {
      const WorkItem& w = items[i];
      run_item<T, C, DC>(a, w, sc, w.partial_offset >= 0 ? partial.data() + w.partial_offset
                                                      : nullptr);
    }
    if (partial_size > 0) {
#pragma omp for schedule(dynamic, 1)
      for (int i = 0; i < n; ++i)
        if (items[i].part == 0 && items[i].partial_offset >= 0)
          combine_parts<T>(a, items[i], partial.data() + items[i].partial_offset);
    }
  }
}

template <typename T, typename C>
static void dispatch_dim(const PagedAttentionArgs& a) {
  switch (a.head_dim) {
    case 64: return run_all<T, C, 64>(a);
    case 128: return run_all<T, C, 128>(a);
    default: return run_all<T, C, 0>(a);
  }
}

template <typename T>
static void dispatch_cache(const PagedAttentionArgs& a) {
  if (a.kv_int8) return dispatch_dim<T, int8_t>(a);
  return dispatch_dim<T, T>(a);
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

extern "C" int bl_vector_lanes() { return VLEN; }
