// The exact merge of split partial results, shared by the split decode program (its last CTA
// per row merges in place) and the standalone merge program.
//
// Partial i of a row holds O_i, the softmax-weighted V over its token range already divided by its
// own sum, and lse2_i = log2 of that sum of 2^(logit * log2 e). With m = max_i lse2_i:
//   O = sum_i 2^(lse2_i - m) O_i / sum_i 2^(lse2_i - m),   lse = (m + log2 sum_i 2^(lse2_i - m)) ln 2.
// Rows whose partials are all empty (lse2 = -inf) give O = 0 and lse = -inf.
#pragma once
#include "primitives.cuh"

namespace splitkv {

// Workspace layout (fp32): partial_o[batch][num_splits][num_qo_heads][HEAD_DIM],
// partial_lse[batch][num_splits][num_qo_heads]. Partials are read with ld.global.cg: they were
// written by other CTAs of this launch, so they must come from L2, never from a stale L1 line.
template <int HEAD_DIM, typename out_t>
__device__ __forceinline__ void merge_row(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                                          out_t* __restrict__ out, float* __restrict__ lse,
                                          int batch_idx, int head, int num_qo_heads, int num_splits, int splits_used,
                                          int lane) {
    constexpr int PER_LANE = (HEAD_DIM + 31) / 32;
    // Partial loads in flight per lane: the merge runs at the tail of the launch, so its latency
    // is on the critical path; eight independent L2 reads hide most of it.
    constexpr int BATCH = 8;
    const size_t split_stride = (size_t)num_qo_heads;
    const float* row_lse = partial_lse + ((size_t)batch_idx * num_splits) * split_stride + head;
    const float* row_o = partial_o + (((size_t)batch_idx * num_splits) * split_stride + head) * HEAD_DIM;

    // Lanes over splits: the row's max and sum of weights.
    float m = -INFINITY;
    for (int i = lane; i < splits_used; i += 32) m = fmaxf(m, __ldcg(row_lse + i * split_stride));
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float total = 0.f;
    if (m != -INFINITY)
        for (int i = lane; i < splits_used; i += 32) total += exp2_approx(__ldcg(row_lse + i * split_stride) - m);
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);

    // Lanes over head_dim: sum of weighted partials, 32 splits' weights at a time from the lanes.
    float acc[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) acc[j] = 0.f;
    if (m != -INFINITY) {
        for (int base = 0; base < splits_used; base += 32) {
            const int mine = base + lane;
            const float w_lane = mine < splits_used ? exp2_approx(__ldcg(row_lse + mine * split_stride) - m) : 0.f;
            const int count = min(32, splits_used - base);
            for (int first = 0; first < count; first += BATCH) {
                float part[BATCH][PER_LANE];
#pragma unroll
                for (int u = 0; u < BATCH; ++u) {
                    const float* o = row_o + (size_t)(base + min(first + u, count - 1)) * split_stride * HEAD_DIM;
#pragma unroll
                    for (int j = 0; j < PER_LANE; ++j) {
                        const int d = lane + 32 * j;
                        part[u][j] = d < HEAD_DIM ? __ldcg(o + d) : 0.f;
                    }
                }
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
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const size_t out_row = (size_t)batch_idx * num_qo_heads + head;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < HEAD_DIM) out[out_row * HEAD_DIM + d] = Elem<out_t>::from_float(acc[j] * inv);
    }
    if (lse != nullptr && lane == 0)
        lse[out_row] = total > 0.f ? (m + __log2f(total)) * 0.69314718055994531f : -INFINITY;
}

}  // namespace splitkv
