// The exact merge of split partial results, shared by the split decode program (its last CTA
// per row merges in place) and the standalone merge program.
//
// Partial i of a row holds O_i, the softmax-weighted V over its token range already divided by its
// own sum, and lse2_i = log2 of that sum of 2^(logit * log2 e). With m = max_i lse2_i:
//   O = sum_i 2^(lse2_i - m) O_i / sum_i 2^(lse2_i - m),   lse = (m + log2 sum_i 2^(lse2_i - m)) ln 2.
// An attention sink adds 2^(sink2 - m) to the final denominator of O only, so lse stays the
// tokens' own and partials of any token ranges still merge exactly.
// Non-finite inputs follow the float64 math: a NaN partial (a NaN score or value in its range) makes
// the row NaN (the max propagates it), and so does a sum of 0. A merged row has tokens in every
// split it merges (splits_used > 1 needs a length past one split), so its sum is 0 only when every
// score was -inf, where the math gives NaN too (-inf - -inf).
#pragma once
#include "primitives.cuh"

namespace splitkv {

// Where a CTA's rows land in the output and log-sum-exp ([batch][query_tokens][num_qo_heads]): the
// rows of K/V head k are its query heads x query tokens (row R = t x group + h: token t, head h),
// served in row blocks of cta_rows (CTA row y = k x row_blocks + block). With one query token and
// one block, row r of K/V head k is query head k x group + r.
struct OutRows {
    int num_qo_heads, group, query_tokens, row_blocks, cta_rows;
    // The output row of row r of CTA row y of sequence b; -1 for a padding row of the last block.
    __device__ __forceinline__ long long of(int b, int y, int r) const {
        const int kv_head = y / row_blocks, row = (y % row_blocks) * cta_rows + r;
        if (row >= group * query_tokens) return -1;
        return ((long long)b * query_tokens + row / group) * num_qo_heads + kv_head * group + row % group;
    }
    // Its query head (what its sink is indexed by).
    __device__ __forceinline__ int head(int y, int r) const {
        return y / row_blocks * group + ((y % row_blocks) * cta_rows + r) % group;
    }
};

// Attention sinks (gpt-oss): the sink of query head h as a base-2 logit, or -inf without sinks; it
// joins a row's final softmax denominator as sink_weight(.., m) in the units of a sum taken
// relative to the base-2 max m (an empty row, m = -inf, gets an infinite one: its output stays 0).
__device__ __forceinline__ float sink_log2(const float* sinks, int h) {
    return sinks != nullptr ? __ldg(sinks + h) * 1.4426950408889634f : -INFINITY;
}
__device__ __forceinline__ float sink_weight(float sink2, float m) { return sink2 == -INFINITY ? 0.f : exp2_approx(sink2 - m); }

// Sliding window (window_left = w >= 0): the first token of a sequence of `len` tokens that any of
// its `query_tokens` queries sees (the first query, at len - query_tokens, sees w tokens back),
// rounded down to a multiple of `align` (the programs' tiles); 0 without a window. Splits are
// counted from it: every program and the merge count a row's splits alike.
__device__ __forceinline__ int window_begin(int len, int query_tokens, int window_left, int align) {
    if (window_left < 0) return 0;
    const int first = max(len - query_tokens - window_left, 0);
    return first - first % align;
}

// Workspace layout (fp32): partial_o[batch][num_splits][rows_per_slot][HEAD_DIM],
// partial_lse[batch][num_splits][rows_per_slot], a slot's rows being every CTA row's (K/V heads x
// row blocks x cta_rows; with one query token, the query heads). Partials are read with
// ld.global.cg: they were written by other CTAs of this launch, so they must come from L2, never
// from a stale L1 line.
//
// One warp merges elements [d_begin, d_end) of partial row `row` (a span of at most SPAN elements;
// lane takes d_begin + lane + 32 j) into output row `target.out_row()`, and writes the row's
// log-sum-exp when the span starts the row; `target.sink2()`: the row's sink (sink_log2), -inf for
// none; `target.empty_value()` and `target.empty_lse()`: what a row whose weights sum to 0 (every
// state empty) gives. (Asked for after the partials are summed, so that nothing of them is live in
// the loop.)
// Partial i's log-sum-exp is read from slot lse_slot0 + i lse_step (its o from slot i).
template <int HEAD_DIM, int SPAN, typename out_t, class Target>
__device__ __forceinline__ void merge_row_span(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                                               out_t* __restrict__ out, float* __restrict__ lse,
                                               int batch_idx, int row, int rows_per_slot, int num_splits, int splits_used,
                                               int d_begin, int d_end, int lse_slot0, int lse_step, int lane,
                                               const Target& target) {
    constexpr int PER_LANE = (SPAN + 31) / 32;
    // The merge runs at the tail of the launch, so its latency is on the critical path: each group
    // of up to 32 splits costs one round trip to L2, the log-sum-exps (one per lane) and the first
    // BATCH partials being requested together, since the partials do not depend on the weights.
    constexpr int BATCH = 16;
    const size_t split_stride = (size_t)rows_per_slot;
    const float* row_lse = partial_lse + ((size_t)batch_idx * num_splits + lse_slot0) * split_stride + row;
    const float* row_o = partial_o + (((size_t)batch_idx * num_splits) * split_stride + row) * HEAD_DIM;
    auto load_partials = [&](float (&part)[BATCH][PER_LANE], int base, int first, int count) {
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const float* o = row_o + (size_t)(base + min(first + u, count - 1)) * split_stride * HEAD_DIM;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {
                const int d = d_begin + lane + 32 * j;
                part[u][j] = (first + u < count && d < d_end) ? __ldcg(o + d) : 0.f;
            }
        }
    };

    // Running over groups of 32 splits: m the max log-sum-exp so far, total the sum of weights
    // 2^(lse2_i - m), acc the weighted sum of partials, both rescaled when m grows.
    float m = -INFINITY, total = 0.f;
    float acc[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) acc[j] = 0.f;
    for (int base = 0; base < splits_used; base += 32) {
        const int count = min(32, splits_used - base);
        const float lse_lane = lane < count ? __ldcg(row_lse + (size_t)(base + lane) * lse_step * split_stride) : -INFINITY;
        float part[BATCH][PER_LANE];
        load_partials(part, base, 0, count);
        float group_max = lse_lane;
        for (int off = 16; off > 0; off >>= 1) group_max = fmax_nan(group_max, __shfl_xor_sync(0xffffffffu, group_max, off));
        const float m_new = fmax_nan(m, group_max);
        if (m_new == -INFINITY) continue;  // every split so far is empty (warp-uniform)
        const float rescale = exp2_approx(m - m_new);  // 2^-inf = 0 on the first non-empty group
        const float w_lane = exp2_approx(lse_lane - m_new);
        float w_sum = w_lane;
        for (int off = 16; off > 0; off >>= 1) w_sum += __shfl_xor_sync(0xffffffffu, w_sum, off);
        total = total * rescale + w_sum;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) acc[j] *= rescale;
        m = m_new;
        for (int first = 0; first < count; first += BATCH) {
            if (first > 0) load_partials(part, base, first, count);
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const float w = __shfl_sync(0xffffffffu, w_lane, (first + u) & 31);
                if (first + u < count) {
#pragma unroll
                    for (int j = 0; j < PER_LANE; ++j) acc[j] += w * part[u][j];
                }
            }
        }
    }
    // NaN total: NaN, as are acc and m. The sink joins the denominator only (lse is the tokens').
    const float inv = total != 0.f ? 1.f / (total + sink_weight(target.sink2(), m)) : 0.f;
    const bool empty = total == 0.f;
    const long long out_row = target.out_row();
    if (out_row < 0) return;  // a padding row of the last row block
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int d = d_begin + lane + 32 * j;
        if (d < d_end) out[out_row * HEAD_DIM + d] = Elem<out_t>::from_float(empty ? target.empty_value() : acc[j] * inv);
    }
    if (lse != nullptr && lane == 0 && d_begin == 0)
        lse[out_row] = empty ? target.empty_lse() : (m + __log2f(total)) * 0.69314718055994531f;
}

// A merged row's place: its output row, and its sink (base 2; -inf for none). A split row has
// tokens in every split it merges, so weights that sum to 0 are every score -inf: NaN, as the
// float64 math gives (-inf - -inf).
struct RowTarget {
    long long row;
    float sink;
    __device__ __forceinline__ long long out_row() const { return row; }
    __device__ __forceinline__ float sink2() const { return sink; }
    __device__ __forceinline__ float empty_value() const { return NAN; }
    __device__ __forceinline__ float empty_lse() const { return NAN; }
};

// One warp merges the whole partial row `row` of sequence b into `target` (see merge_row_span).
template <int HEAD_DIM, typename out_t, class Target>
__device__ __forceinline__ void merge_row(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                                          out_t* __restrict__ out, float* __restrict__ lse,
                                          int batch_idx, int row, int rows_per_slot, int num_splits, int splits_used,
                                          int lane, const Target& target) {
    merge_row_span<HEAD_DIM, HEAD_DIM, out_t>(partial_o, partial_lse, out, lse, batch_idx, row, rows_per_slot,
                                              num_splits, splits_used, 0, HEAD_DIM, 0, 1, lane, target);
}

// The warps of a CTA merge elements [first, end) of the cta_rows x HEAD_DIM block of CTA row y
// (partial rows from y x cta_rows on): one warp per row the range meets, each over that row's part
// of the range, which is at most min(end - first, HEAD_DIM) elements long (SPAN). Log-sum-exps as
// in merge_row_span; padding rows are skipped.
template <int HEAD_DIM, int SPAN, int WARPS, typename out_t>
__device__ __forceinline__ void merge_elements(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                                               out_t* __restrict__ out, float* __restrict__ lse,
                                               int batch_idx, int y, const OutRows& rows, const float* sinks,
                                               int rows_per_slot, int num_splits,
                                               int splits_used, int first, int end, int lse_slot0, int lse_step,
                                               int warp, int lane) {
    const int row_begin = first / HEAD_DIM, row_end = (end - 1) / HEAD_DIM;
    for (int row = row_begin + warp; row <= row_end; row += WARPS) {
        const long long out_row = rows.of(batch_idx, y, row);
        if (out_row < 0) continue;
        const int d_begin = row == row_begin ? first % HEAD_DIM : 0;
        const int d_end = row == row_end ? (end - 1) % HEAD_DIM + 1 : HEAD_DIM;
        merge_row_span<HEAD_DIM, SPAN, out_t>(partial_o, partial_lse, out, lse, batch_idx, y * rows.cta_rows + row,
                                              rows_per_slot, num_splits, splits_used, d_begin, d_end, lse_slot0,
                                              lse_step, lane, RowTarget{out_row, sink_log2(sinks, rows.head(y, row))});
    }
}

}  // namespace splitkv
