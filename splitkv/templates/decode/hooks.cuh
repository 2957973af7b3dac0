// splitkv decode program: the attention variants, at the softmax step's hook points. Each is
// compiled in only where its constant says (decode.cu.j2), so plain attention pays nothing:
//   QUERY_TOKENS > 1  several query tokens per sequence, causal among themselves: query token t
//                     sits at position len - QUERY_TOKENS + t and sees the positions up to its own;
//   WINDOW            a sliding window: the query at position p sees positions p - window_left .. p;
//   SOFT_CAP          a logits soft-cap: a scaled score s becomes cap x tanh(s / cap);
//   SINKS             attention sinks: a logit per query head in the final softmax denominator only
//                     (epilogue.cuh and merge.cuh: sink_weight), so partials merge as before.
#pragma once

namespace splitkv::decode {
namespace {
// Whether a token's probability depends on its query token (causal order, window), not only on the
// length: such tiles take a mask per row.
constexpr bool ROW_MASKS = QUERY_TOKENS > 1 || WINDOW;

// The variant's state in one lane: the soft-cap, and the tokens its two rows (MMA rows row_of(0),
// row_of(1), see WarpSoftmax) keep. Built once the sequence's length is known.
struct Variant {
    float cap2 = 0.f, tanh_scale = 0.f;  // SOFT_CAP: the cap in the scores' base-2 units; 2 log2(e) / it
    int lo[2] = {0, 0}, hi[2] = {0, 0};  // ROW_MASKS: row h keeps tokens lo[h] .. hi[h]
    // Tiles of tokens from no_mask_lo to no_mask_hi are kept whole by every row (the first query's
    // position, the last query's window start), so only tiles that cross them take the row masks.
    int no_mask_lo = 0, no_mask_hi = 0;

    // `block_row0`: the CTA's first row of its K/V head (row block x ROWS); `row(h)` the lane's row h.
    template <class RowOf>
    __device__ __forceinline__ Variant(int len, int window_left, float soft_cap_log2, int block_row0, RowOf row) {
        if constexpr (SOFT_CAP) {
            cap2 = soft_cap_log2;
            tanh_scale = 2.f * 1.4426950408889634f / soft_cap_log2;
        }
        if constexpr (ROW_MASKS) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // Padding rows (past the head's rows) are never written: they take the last query's.
                const int t = min((block_row0 + row(h)) / GROUP, QUERY_TOKENS - 1);
                hi[h] = len - QUERY_TOKENS + t;
                lo[h] = WINDOW ? hi[h] - window_left : 0;
            }
            no_mask_hi = len - QUERY_TOKENS;
            no_mask_lo = WINDOW ? len - 1 - window_left : 0;
        }
    }
    // Score transform: a score in base 2 (Q.K times the softmax scale and log2 e, and the K scale
    // for quantized K/V); cap x tanh(s / cap) holds in any base, the cap taken in the same one.
    // tanh(x) = 1 - 2 / (e^2x + 1), from the exp2 unit (relative error 2^-22): within 1e-6 of the
    // cap, where tanh.approx's 2^-11 would move a capped logit by 5e-4 of the cap. The stream is
    // memory-bound, so the second special-function op per score costs nothing measurable.
    __device__ __forceinline__ float transform_score(float score) const {
        if constexpr (SOFT_CAP) {
            const float e = splitkv::exp2_approx(score * tanh_scale);  // e^(2 s / cap); inf and 0 at the ends
            return cap2 - __fdividef(2.f * cap2, e + 1.f);
        } else {
            return score;
        }
    }
    // Whether the tile of TILE tokens from `first` needs the rows' masks.
    __device__ __forceinline__ bool masks_tile(int first) const {
        return ROW_MASKS && (first < no_mask_lo || first + TILE - 1 > no_mask_hi);
    }
    // Mask: whether row h keeps token `token` (in a tile that masks_tile).
    __device__ __forceinline__ bool keep_token(int h, int token) const {
        return !ROW_MASKS || (token <= hi[h] && token >= lo[h]);
    }
};
}  // namespace
}  // namespace splitkv::decode
