// The standalone merge program (configured by merge.cu.j2): one warp per (output row, query head)
// combines that row's fp32 partials with `merge_row` / `merge_row_span` (merge.cuh).
#pragma once

namespace splitkv::merge {
namespace {

// A split plan's rows: [batch][num_splits][num_qo_heads] partials; rows whose sequence needed a
// single split were already written by the decode program and are skipped.
__device__ __forceinline__ void merge_split_rows(const Params& p, int warp_row, int lane) {
    if (warp_row >= p.batch * p.num_qo_heads) return;
    const int batch_idx = warp_row / p.num_qo_heads, head = warp_row % p.num_qo_heads;
    const int len = min(p.seq_lens[batch_idx], p.max_len);  // as the decode program clamps it
    const int splits_used =
        min(len > 0 ? (len + p.tokens_per_split - 1) / p.tokens_per_split : 1, p.num_splits);
    if (splits_used <= 1) return;
    splitkv::merge_row<HEAD_DIM, out_t>(p.partial_o, p.partial_lse, p.out, p.lse, batch_idx, head, p.num_qo_heads,
                                        p.num_splits, splits_used, lane);
}

// A units plan's merge table: merge m combines the num_splits partials from slot first_slot on,
// each [group][HEAD_DIM] fp32 (and [group] base-2 log-sum-exps), of output row (sequence x
// num_kv_heads + K/V head).
__device__ __forceinline__ void merge_unit_rows(const Params& p, int warp_row, int lane) {
    // The fields as restrict-qualified locals, as the old positional arguments were: read through
    // the struct, the compiler keeps more of them live (more registers, the same arithmetic).
    const float* __restrict__ partial_o = p.partial_o;
    const float* __restrict__ partial_lse = p.partial_lse;
    const int* __restrict__ units = p.units;
    out_t* __restrict__ out = p.out;
    float* __restrict__ lse = p.lse;
    const int group = p.group, max_units = p.max_units;
    const int merge = warp_row / group, head = warp_row % group;
    if (merge >= units[1]) return;  // the grid may cover more merges than this plan has
    const int* row = units + UNIT_HEADER + (size_t)max_units * UNIT_FIELDS + (size_t)merge * MERGE_FIELDS;
    const size_t out_row0 = (size_t)row[0] * group;  // the row's first query head: (b Hkv + h) G = b Hq + h G
    const int first_slot = row[1], splits = row[2];
    splitkv::merge_row_span<HEAD_DIM, HEAD_DIM, out_t>(
        partial_o + (size_t)first_slot * group * HEAD_DIM, partial_lse + (size_t)first_slot * group,
        out + out_row0 * HEAD_DIM, lse != nullptr ? lse + out_row0 : nullptr, 0, head, group, splits, splits,
        0, HEAD_DIM, 0, 1, lane);
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
