// Structured output: a packed grammar token bitmask applied to fp32 logits in place.
// Semantics: kernels/ref.py apply_token_bitmask.
//
// One thread on purpose: the work is a few hundred KB of mask words and -inf stores for the
// banned tokens only, less than what waking the OpenMP team costs on a busy machine (a torch op
// that goes parallel waited up to a scheduler time slice for its second thread while other
// processes held the other core; docs/kernels.md).
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// Bits of `word` cleared -> -inf in out[0..n), n <= 32. Branch-free per element (a JSON string
// state allows about half the vocabulary, so a per-bit branch would mispredict).
static inline void ban_word(float* out, uint32_t word, int n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (word == 0) {
    for (int b = 0; b < n; ++b) out[b] = neg_inf;
    return;
  }
  for (int b = 0; b < n; ++b) out[b] = ((word >> b) & 1u) ? out[b] : neg_inf;
}

}  // namespace

// logits: fp32 rows of `vocab` elements (row r starts at logits + r * row_stride).
// rows[i]: the logits row that bitmask row i (words_per_row int32 words, bit t % 32 of word
// t / 32 set = token t allowed) applies to. Tokens at or past words_per_row * 32 are banned.
// Returns 0, or 1 when a row index is out of [0, num_logit_rows).
extern "C" int bl_apply_token_bitmask(float* logits, int64_t row_stride, int64_t num_logit_rows,
                                      int64_t vocab, const int64_t* rows, int64_t num_rows,
                                      const int32_t* bitmask, int64_t words_per_row) {
  for (int64_t i = 0; i < num_rows; ++i)
    if (rows[i] < 0 || rows[i] >= num_logit_rows) return 1;
  const int64_t words = (vocab + 31) / 32;
  for (int64_t i = 0; i < num_rows; ++i) {
    float* out = logits + rows[i] * row_stride;
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask + i * words_per_row);
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t word = w < words_per_row ? mask[w] : 0u;
      const int64_t base = w * 32;
      const int n = vocab - base < 32 ? int(vocab - base) : 32;
      if (word == 0xFFFFFFFFu) continue;  // all allowed: nothing to write
      ban_word(out + base, word, n);
    }
  }
  return 0;
}
