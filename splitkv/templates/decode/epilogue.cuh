// splitkv decode program: the CTA's result once its warps have streamed their tiles: the warps'
// states combined (or, with warp_heads, each warp's own row written), then the output, a partial
// for the global merge (fused: the row's last CTA merges), or a cluster's merge through
// distributed shared memory.
#pragma once

namespace splitkv::decode {
namespace {
// The pointers and sizes the epilogue writes through, and the CTA's place.
struct ResultTarget {
    out_t* out;
    float* lse;
    float* partial_o;
    float* partial_lse;
    int* counters;
    const float* sinks;  // SINKS: [num_qo_heads] (warp_heads reads them there)
    const float* row_sinks;  // SINKS: the CTA's rows' sinks, base 2 (WarpStates::row_sink2)
    int num_kv_heads, num_qo_heads, num_splits;
    int batch_idx, kv_head;  // (the warp and lane: see lane_id)
    int row_y;  // the CTA's row of the grid: K/V head x ROW_BLOCKS + row block
    // The CTA's tokens end past token 0. A CTA that writes a final result starts at token 0 (a
    // dense row, split 0, a whole-row unit), so this says whether its sequence has tokens.
    bool row_has_tokens;

    // Rows of a workspace slot (merge.cuh): every CTA row's ROWS rows.
    __device__ __forceinline__ int rows_per_slot() const { return num_kv_heads * ROW_BLOCKS * ROWS; }
    __device__ __forceinline__ splitkv::OutRows out_rows() const {
        return splitkv::OutRows{num_qo_heads, GROUP, QUERY_TOKENS, ROW_BLOCKS, ROWS};
    }
    // The output row of the CTA's row r (-1: a padding row); query head kv_head x GROUP + r with one
    // query token.
    __device__ __forceinline__ long long out_row(int r) const {
        if constexpr (QUERY_TOKENS == 1 && ROW_BLOCKS == 1) return (long long)batch_idx * num_qo_heads + kv_head * GROUP + r;
        else return out_rows().of(batch_idx, row_y, r);
    }
    // The sink of the CTA's row r (base 2), -inf without sinks.
    __device__ __forceinline__ float sink2(int r) const {
        if constexpr (SINKS) return row_sinks[r];
        else return -INFINITY;
    }
};

// A merged row's place (merge.cuh's merge_row_span), asked for once its partials are summed.
struct MergedRow {
    const ResultTarget& at;
    int row;
    __device__ __forceinline__ long long out_row() const { return at.out_row(row); }
    __device__ __forceinline__ float sink2() const { return at.sink2(row); }
    __device__ __forceinline__ float empty_value() const { return NAN; }  // see merge.cuh's RowTarget
    __device__ __forceinline__ float empty_lse() const { return NAN; }
};

static_assert(!WARP_HEADS || QUERY_TOKENS == 1, "warp_heads: one query token per sequence");

// What a result whose softmax sum is 0 holds, when it is final (partials with a sum of 0 are empty:
// zeros that weigh nothing). A sequence of length 0 gives zeros and lse -inf; one with tokens sums
// to 0 only when all its scores are -inf, and the float64 math gives NaN there (-inf - -inf), as it
// does for a NaN score or value, whose NaN sums propagate on their own (the tests compare with
// `l != 0`, which a NaN passes, never `l > 0`).
__device__ __forceinline__ float final_empty(const ResultTarget& at) { return at.row_has_tokens ? NAN : 0.f; }
__device__ __forceinline__ float final_empty_lse(const ResultTarget& at) { return at.row_has_tokens ? NAN : -INFINITY; }

// The warps' states have been stored into the shared memory at `smem` (WarpStates); `split`,
// `splits_used`: the CTA's split and the row's splits in use; `partial_slot`: units, the slot of a
// piece of a split row (or -1).
__device__ __forceinline__ void write_result(const ResultTarget& at, unsigned char* smem, unsigned long long& inbox_full,
                                             int split, int splits_used, int partial_slot) {
    out_t* const out = at.out;
    float* const lse = at.lse;
    float* const partial_o = at.partial_o;
    float* const partial_lse = at.partial_lse;
    int* const counters = at.counters;
    const int num_splits = at.num_splits, rows_per_slot = at.rows_per_slot();
    const int warp = warp_id(), lane = lane_id(), batch_idx = at.batch_idx, row_y = at.row_y;
    // Per row of `states` (threads < ROWS): the CTA's max m, each token stream's weight 2^(m_w - m),
    // the CTA's sum, log-sum-exp and final denominator (with the row's sink).
    auto combine_warps = [&](WarpStates states) {
        float* warp_m = states.m();
        float* warp_l = states.l();
        float* row_l = states.row_l();
        float* row_lse2 = states.row_lse2();
        if (threadIdx.x < ROWS) {
            const int row = threadIdx.x;
            float m = -INFINITY;
            for (int w = 0; w < ROW_WARPS; ++w) m = fmaxf(m, warp_m[WarpStates::at(w, row)]);
            float l = 0.f;
            for (int w = 0; w < ROW_WARPS; ++w) {
                const float weight = m == -INFINITY ? 0.f : splitkv::exp2_approx(warp_m[WarpStates::at(w, row)] - m);
                warp_m[WarpStates::at(w, row)] = weight;
                l += weight * warp_l[WarpStates::at(w, row)];
            }
            row_l[row] = l;
            row_lse2[row] = l != 0.f ? m + __log2f(l) : -INFINITY;
            // The sink joins the final denominator only (a sum of 0 stays 0: see final_empty).
            if constexpr (SINKS) states.row_den()[row] = l != 0.f ? l + splitkv::sink_weight(at.sink2(row), m) : 0.f;
        }
    };
    // The CTA's result for output element idx (row idx / HEAD_DIM) from the combined states,
    // divided by the row's sum (a partial's) or, `final`, by its final denominator; `empty` where
    // that is 0.
    auto cta_value_of = [&](WarpStates states, int idx, float empty, bool final) {
        const float* weight = states.m();
        const float* warp_o = states.o();
        const int row = idx / HEAD_DIM;
        float acc = 0.f;
#pragma unroll
        for (int w = 0; w < ROW_WARPS; ++w) acc += weight[WarpStates::at(w, row)] * warp_o[(size_t)w * ROWS * HEAD_DIM + idx];
        const float l = (SINKS && final ? states.row_den() : states.row_l())[row];
        return l != 0.f ? __fdividef(acc, l) : empty;  // branch-free: see the warp_heads epilogue
    };
    // The CTA's fp32 partial from the combined `states`, into slot `slot` of sequence b.
    auto write_partial = [&](int b, int slot, WarpStates states) {
        const size_t slot_row0 = ((size_t)b * num_splits + slot) * rows_per_slot + (size_t)row_y * ROWS;
        for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += WARPS * 32)
            partial_o[slot_row0 * HEAD_DIM + idx] = cta_value_of(states, idx, 0.f, false);
        if (threadIdx.x < ROWS) partial_lse[slot_row0 + threadIdx.x] = states.row_lse2()[threadIdx.x];
    };
    // Counts the CTA on its row's merge counter `which`, once its partials are written. True for
    // the last of `arrivals`, which also resets the counter (for the next launch, and for CUDA-graph
    // replays).
    __shared__ int is_last;
    auto count_last = [&](int which, int arrivals) {
        __syncthreads();  // the CTA's partials are written before thread 0 counts it
        if (threadIdx.x == 0) {
            // acq_rel: releases the partials this thread synchronised with above, and acquires those
            // of the CTAs counted before it; the barrier below passes both to the whole CTA.
            const int cta_rows = at.num_kv_heads * ROW_BLOCKS;
            int* counter = counters + ((size_t)batch_idx * cta_rows + row_y) * ROW_COUNTERS + which;
            is_last = splitkv::atomic_add_acq_rel_gpu(counter, 1) == arrivals - 1;
            if (is_last) *counter = 0;
        }
        __syncthreads();
        return is_last != 0;
    };
    // The row's last CTA of `arrivals` merges the first `slots_used` slots, a warp per row.
    auto count_and_merge = [&](int arrivals, int slots_used) {
        if (!count_last(0, arrivals)) return;
        for (int row = warp; row < ROWS; row += WARPS) {
            if (at.out_row(row) < 0) continue;  // a padding row
            splitkv::merge_row<HEAD_DIM, out_t>(partial_o, partial_lse, out, lse, batch_idx, row_y * ROWS + row,
                                                rows_per_slot, num_splits, slots_used, lane, MergedRow{at, row});
        }
    };
    const WarpStates combined{reinterpret_cast<float*>(smem)};
    if constexpr (WARP_HEADS) {
        // Each warp's state is the result for its own K/V head, whose query heads follow those of
        // the warp before: the CTA's WARPS x GROUP output rows are consecutive, in the order of
        // the states' accumulators.
        // Unrolled, with a division that does not branch, so that each thread's loads, divisions
        // and stores overlap: element after element, the loop was a chain of latencies that kept
        // the last CTA longer than the one-row program's epilogue.
        const size_t first_row = (size_t)batch_idx * at.num_qo_heads + (size_t)blockIdx.y * WARPS * GROUP;
        // The row's final denominator: its sum, and its sink's weight.
        auto denominator = [&](int w, int row) {
            const float l = combined.l()[WarpStates::at(w, row)];
            if constexpr (!SINKS) return l;
            const float sink2 = splitkv::sink_log2(at.sinks, (blockIdx.y * WARPS + w) * GROUP + row);
            return l != 0.f ? l + splitkv::sink_weight(sink2, combined.m()[WarpStates::at(w, row)]) : 0.f;
        };
        constexpr int PER_THREAD = GROUP * HEAD_DIM / 32;  // WARPS x GROUP x HEAD_DIM over WARPS x 32 threads
        static_assert(GROUP * HEAD_DIM % 32 == 0, "every thread writes the same number of outputs");
#pragma unroll 8
        for (int i = 0; i < PER_THREAD; ++i) {
            const int idx = threadIdx.x + i * WARPS * 32;
            const int w = idx / (GROUP * HEAD_DIM), row = idx / HEAD_DIM % GROUP;
            const float l = denominator(w, row);
            out[first_row * HEAD_DIM + idx] = splitkv::Elem<out_t>::from_float(l != 0.f ? __fdividef(combined.o()[idx], l) : final_empty(at));
        }
        if (lse != nullptr && threadIdx.x < WARPS * GROUP) {
            const int w = threadIdx.x / GROUP, row = threadIdx.x % GROUP;
            const float l = combined.l()[WarpStates::at(w, row)];
            lse[first_row + threadIdx.x] = l != 0.f ? (combined.m()[WarpStates::at(w, row)] + __log2f(l)) * LN2 : final_empty_lse(at);
        }
        return;
    }
    const float* row_lse2 = combined.row_lse2();
    combine_warps(combined);
    __syncthreads();
    auto cta_value = [&](int idx) { return cta_value_of(combined, idx, 0.f, false); };  // a partial's

    if constexpr (UNITS) {
        if (partial_slot >= 0) {  // a piece of a split row: its partial into slot [partial_slot][ROWS][HEAD_DIM]
            for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += WARPS * 32)
                partial_o[(size_t)partial_slot * ROWS * HEAD_DIM + idx] = cta_value(idx);
            if (threadIdx.x < ROWS) partial_lse[(size_t)partial_slot * ROWS + threadIdx.x] = row_lse2[threadIdx.x];
            return;
        }
    }
    if (!SPLIT || splits_used == 1) {  // the row has one split: its CTA writes the final output
        if constexpr (CLUSTER > 1) splitkv::cluster_wait();  // pairs with the arrival at the start
        if (split == 0) {
            const float empty = final_empty(at);
            for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += WARPS * 32) {
                const long long out_row = at.out_row(idx / HEAD_DIM);
                if (out_row >= 0)
                    out[out_row * HEAD_DIM + idx % HEAD_DIM] = splitkv::Elem<out_t>::from_float(cta_value_of(combined, idx, empty, true));
            }
            if (lse != nullptr && threadIdx.x < ROWS) {
                const long long out_row = at.out_row(threadIdx.x);
                const float l = combined.row_l()[threadIdx.x];
                if (out_row >= 0) lse[out_row] = l != 0.f ? row_lse2[threadIdx.x] * LN2 : final_empty_lse(at);
            }
        }
        return;
    }

    // Partials through global memory fill slots [batch][slot][row]: one slot per split without
    // clusters, merged by the row's last CTA to arrive; one per cluster with several clusters per
    // row, merged slice by slice (below).
    int slot = split, slots_used = splits_used;
    if constexpr (CLUSTER > 1) {
        // The row's splits are one cluster, or several (num_splits a multiple of CLUSTER). Member r
        // merges elements [r SLICE, (r + 1) SLICE) of its cluster's splits: every member pushes
        // its partial's elements of that range, and its log-sum-exps, into member r's inbox with
        // asynchronous stores that count their bytes on r's barrier, so no member fences or waits
        // for its own stores. Nothing is read remotely and no member waits for another to finish
        // reading, so each one leaves as soon as its own slice is written: to the output when the
        // cluster is the whole row, else as the slice of the cluster's partial.
        float* inbox_o = reinterpret_cast<float*>(smem + INBOX_OFFSET);  // [CLUSTER][SLICE]
        float* inbox_lse2 = inbox_o + CLUSTER * SLICE;                    // [CLUSTER][ROW_SLOTS]
        const int rank = (int)splitkv::cluster_rank();
        const bool whole_row = num_splits == CLUSTER;
        slot = split / CLUSTER;
        slots_used = (splits_used + CLUSTER - 1) / CLUSTER;
        splitkv::cluster_wait();  // every member's inbox barrier is initialised
        // Four elements per store: SLICE and HEAD_DIM are multiples of 4, so the four belong to one
        // member and one row, and land 16-byte aligned.
        for (int idx = 4 * threadIdx.x; idx < ROWS * HEAD_DIM; idx += 4 * WARPS * 32) {
            const float4 value = make_float4(cta_value(idx), cta_value(idx + 1), cta_value(idx + 2), cta_value(idx + 3));
            splitkv::store4_async_to_cluster_rank(inbox_o + rank * SLICE + idx % SLICE, idx / SLICE, value, &inbox_full);
        }
        for (int i = threadIdx.x; i < CLUSTER * ROWS; i += WARPS * 32)
            splitkv::store_async_to_cluster_rank(inbox_lse2 + rank * ROW_SLOTS + i % ROWS, i / ROWS, row_lse2[i % ROWS],
                                                 &inbox_full);
        splitkv::mbarrier_wait_cluster_acquire(&inbox_full, 0);  // every member's pushes have landed
        if (slot >= slots_used) return;  // a cluster wholly past the length: its partial is never read
        const size_t slot_row0 = ((size_t)batch_idx * num_splits + slot) * rows_per_slot + (size_t)row_y * ROWS;
        const size_t split_row0 = ((size_t)batch_idx * num_splits + split) * rows_per_slot + (size_t)row_y * ROWS;
        for (int e = threadIdx.x; e < SLICE && rank * SLICE + e < ROWS * HEAD_DIM; e += WARPS * 32) {
            const int idx = rank * SLICE + e, row = idx / HEAD_DIM;
            float m = -INFINITY;
#pragma unroll
            for (int j = 0; j < CLUSTER; ++j) m = splitkv::fmax_nan(m, inbox_lse2[j * ROW_SLOTS + row]);
            float total = 0.f, acc = 0.f;
            if (m != -INFINITY) {
#pragma unroll
                for (int j = 0; j < CLUSTER; ++j) {
                    const float w = splitkv::exp2_approx(inbox_lse2[j * ROW_SLOTS + row] - m);
                    total += w;
                    acc += w * inbox_o[j * SLICE + e];
                }
            }
            // A cluster that is the whole row has tokens in it (splits_used > 1): a sum of 0 is
            // every score -inf (see final_empty); a cluster's partial of 0 is empty.
            const bool summed = total != 0.f;
            // The final output's denominator takes the row's sink; a partial's does not.
            const float den = whole_row && SINKS ? total + splitkv::sink_weight(at.sink2(row), m) : total;
            const float value = summed ? __fdividef(acc, den) : (whole_row ? NAN : 0.f);
            const float lse2 = summed ? m + __log2f(total) : (whole_row ? NAN : -INFINITY);
            if (whole_row) {
                const long long out_row = at.out_row(row);
                if (out_row >= 0) {
                    out[out_row * HEAD_DIM + idx % HEAD_DIM] = splitkv::Elem<out_t>::from_float(value);
                    if (lse != nullptr && idx % HEAD_DIM == 0) lse[out_row] = lse2 * LN2;
                }
            } else {
                partial_o[slot_row0 * HEAD_DIM + idx] = value;
                // Each rank's merger reads the log-sum-exps of the rows its slice meets, written
                // by the members of its own rank: in slot `split` = slot x CLUSTER + rank.
                if (idx % HEAD_DIM == 0 || e == 0) partial_lse[split_row0 + row] = lse2;
            }
        }
        if (whole_row) return;
        // Several clusters per row: the members of rank r (one per cluster) have each written slice
        // r of their cluster's partial, and the last of them to arrive merges slice r of the row.
        // Every slice has its own counter and merger, so the row's final merge runs on CLUSTER
        // CTAs at once instead of on the row's last CTA alone.
        const int slice_end = min((rank + 1) * SLICE, ROWS * HEAD_DIM);
        if (!FUSED_MERGE || rank * SLICE >= slice_end) return;  // an empty slice (SLICE rounds up)
        if (!count_last(rank, slots_used)) return;
        constexpr int SPAN = SLICE < HEAD_DIM ? SLICE : HEAD_DIM;
        splitkv::merge_elements<HEAD_DIM, SPAN, WARPS, out_t>(partial_o, partial_lse, out, lse, batch_idx, row_y,
                                                              at.out_rows(), SINKS ? at.sinks : nullptr,
                                                              rows_per_slot, num_splits, slots_used,
                                                              rank * SLICE, slice_end, rank, CLUSTER, warp, lane);
    } else {
        write_partial(batch_idx, slot, combined);  // without clusters: into the split's slot
        if (!FUSED_MERGE) return;
        count_and_merge(splits_used, slots_used);
    }
}
}  // namespace
}  // namespace splitkv::decode
