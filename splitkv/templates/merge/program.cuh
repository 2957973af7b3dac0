// The standalone merge program (configured by merge.cu.j2): one warp per (output row, query head)
// combines that row's fp32 partials with `merge_row` / `merge_row_span` (merge.cuh).
#pragma once

namespace splitkv::merge {
namespace {

// Where the rows land in the output (merge.cuh).
__device__ __forceinline__ splitkv::OutRows out_rows(const Params& p) {
    return splitkv::OutRows{p.num_qo_heads, p.group, p.query_tokens, p.row_blocks, p.cta_rows};
}

// Where partial row `row` (CTA row row / cta_rows, its row row % cta_rows) of sequence b goes, read
// from the struct once the row is merged (nothing of it live while the partials are summed).
struct Target {
    const Params& p;
    int batch_idx, row;
    __device__ __forceinline__ long long out_row() const {
        return out_rows(p).of(batch_idx, row / p.cta_rows, row % p.cta_rows);
    }
    __device__ __forceinline__ float sink2() const {
        return splitkv::sink_log2(p.sinks, out_rows(p).head(row / p.cta_rows, row % p.cta_rows));
    }
    // Weights that sum to 0: NaN for a decode's split rows (see merge.cuh's RowTarget); with
    // empty_states, states of no tokens (merge_states), an empty result: zeros and -inf.
    __device__ __forceinline__ float empty_value() const { return p.empty_states ? 0.f : NAN; }
    __device__ __forceinline__ float empty_lse() const { return p.empty_states ? -INFINITY : NAN; }
};

// A split plan's rows: [batch][num_splits][rows_per_slot] partials (a slot's rows: K/V heads x row
// blocks x cta_rows); rows whose sequence needed a single split were already written by the decode
// program and are skipped, as are padding rows.
__device__ __forceinline__ void merge_split_rows(const Params& p, int warp_row, int lane) {
    const int rows_per_slot = p.rows_per_slot;
    if (warp_row >= p.batch * rows_per_slot) return;
    const int batch_idx = warp_row / rows_per_slot, row = warp_row % rows_per_slot;
    const int len = min(p.seq_lens[batch_idx], p.max_len);  // as the decode program clamps it
    const int span = len - splitkv::window_begin(len, p.query_tokens, p.window_left, p.window_align);
    const int splits_used =
        min(span > 0 ? (span + p.tokens_per_split - 1) / p.tokens_per_split : 1, p.num_splits);
    if (splits_used <= 1) return;
    splitkv::merge_row<HEAD_DIM, out_t>(p.partial_o, p.partial_lse, p.out, p.lse, batch_idx, row, rows_per_slot,
                                        p.num_splits, splits_used, lane, Target{p, batch_idx, row});
}

// A units plan's merge table: merge m combines the num_splits partials from slot first_slot on,
// each [cta_rows][HEAD_DIM] fp32 (and [cta_rows] base-2 log-sum-exps: a K/V head's rows, in one
// block), of CTA row (sequence x num_kv_heads + K/V head).
__device__ __forceinline__ void merge_unit_rows(const Params& p, int warp_row, int lane) {
    // The fields as restrict-qualified locals, as the old positional arguments were: read through
    // the struct, the compiler keeps more of them live (more registers, the same arithmetic).
    const float* __restrict__ partial_o = p.partial_o;
    const float* __restrict__ partial_lse = p.partial_lse;
    const int* __restrict__ units = p.units;
    out_t* __restrict__ out = p.out;
    float* __restrict__ lse = p.lse;
    const int cta_rows = p.cta_rows, max_units = p.max_units;
    const int merge = warp_row / cta_rows, r = warp_row % cta_rows;
    if (merge >= units[1]) return;  // the grid may cover more merges than this plan has
    const int* row = units + UNIT_HEADER + (size_t)max_units * UNIT_FIELDS + (size_t)merge * MERGE_FIELDS;
    const int num_kv_heads = p.num_qo_heads / p.group;
    const int batch_idx = row[0] / num_kv_heads, kv_head = row[0] % num_kv_heads;
    if (r >= p.group * p.query_tokens) return;  // padding
    const int first_slot = row[1], splits = row[2];
    splitkv::merge_row_span<HEAD_DIM, HEAD_DIM, out_t>(
        partial_o + (size_t)first_slot * cta_rows * HEAD_DIM, partial_lse + (size_t)first_slot * cta_rows,
        out, lse, 0, r, cta_rows, splits, splits, 0, HEAD_DIM, 0, 1, lane, Target{p, batch_idx, kv_head * cta_rows + r});
}

}  // namespace
}  // namespace splitkv::merge

extern "C" __global__ void __launch_bounds__(splitkv::merge::WARPS * 32)
splitkv_merge(const __grid_constant__ splitkv::merge::Params p) {
    const int warp_row = blockIdx.x * splitkv::merge::WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if constexpr (splitkv::merge::TABLES) {
        splitkv::merge::merge_unit_rows(p, warp_row, lane);
    } else {
        splitkv::merge::merge_split_rows(p, warp_row, lane);
    }
}
