// splitkv decode program: the kernel. The rendered config (decode.cu.j2) defines the constants,
// the types and Params, then includes this header; variants are chosen here in C++.
#pragma once

#include "decode/layout.cuh"
#include "decode/hooks.cuh"
#include "decode/loaders.cuh"
#include "decode/softmax_step.cuh"
#include "decode/epilogue.cuh"

namespace splitkv::decode {
namespace {
// The program over the fields of Params (see splitkv/params.py), taken apart so that its pointers
// are restrict parameters: the compiler may then read the inputs through the read-only path.
__device__ __forceinline__ void decode_program(
        const q_t* __restrict__ q, const unsigned char* __restrict__ k, const unsigned char* __restrict__ v,
        const int* __restrict__ seq_lens, out_t* __restrict__ out, float* __restrict__ lse,
        float* __restrict__ partial_o, float* __restrict__ partial_lse, int* __restrict__ counters,
        int max_len, int num_kv_heads, int tokens_per_split, float scale_log2,
        const splitkv::TensorMap& k_map, const splitkv::TensorMap& v_map,
        const float* __restrict__ k_scale, int k_per_head, const float* __restrict__ v_scale, int v_per_head,
        const unsigned char* __restrict__ k_block_scales, const unsigned char* __restrict__ v_block_scales,
        const int* __restrict__ block_table, int table_stride, int num_pages, const int* __restrict__ units,
        const float* __restrict__ sinks, int window_left, float soft_cap_log2, int kv_stride) {
    extern __shared__ __align__(SMEM_ALIGN) unsigned char smem[];
    __shared__ unsigned long long inbox_full;  // cluster: every member has pushed into the inbox
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_qo_heads = num_kv_heads * GROUP;
    // The CTA's split and row (batch_idx, blockIdx.y).
    int split = blockIdx.x, batch_idx = blockIdx.z, row_y = blockIdx.y;
    int unit_first = 0, unit_end = 0, partial_slot = -1;
    if constexpr (UNITS) {
        // The CTA's unit: a token range of one row. The grid may hold more CTAs than the table has
        // units (a plan of fixed sizes, for CUDA graphs): those exit at once.
        if ((int)blockIdx.x >= __ldg(units)) return;
        const int* unit = units + UNIT_HEADER + (size_t)blockIdx.x * UNIT_FIELDS;
        batch_idx = __ldg(unit);
        row_y = __ldg(unit + 1);
        split = 0;  // a whole row's unit writes the output, as split 0 of the dense program does
        unit_first = __ldg(unit + 2) * __ldg(units + 3);
        unit_end = unit_first + __ldg(unit + 3) * __ldg(units + 3);
        partial_slot = __ldg(unit + 4);
    }
    // The CTA's K/V head and row block (its rows: block_row0 .. + ROWS of the head's rows).
    const int kv_head = WARP_HEADS ? row_y * WARPS + warp : row_y / ROW_BLOCKS;
    const int block_row0 = (row_y % ROW_BLOCKS) * ROWS;
    // The warp's token stream among its row's (its ring), and its rows of the CTA's: those of its
    // row slice, from slice_row0 on.
    const int row_warp = WARP_HEADS ? 0 : warp / ROW_SLICES;
    const int slice_row0 = slice_id() * 16;
    const int num_splits = gridDim.x;
    if constexpr (CLUSTER > 1) {
        // The inbox barrier completes when every byte the members push into this CTA's inbox has
        // landed: its one arrival is made here, with the byte count it expects (the members' values
        // of this CTA's slice, and their log-sum-exps). Its initialisation is published to the
        // cluster by the barrier below, whose wait comes only before the first push.
        if (threadIdx.x == 0) {
            const int slice = min(SLICE, max(ROWS * HEAD_DIM - (int)splitkv::cluster_rank() * SLICE, 0));
            splitkv::mbarrier_init(&inbox_full, 1);
            splitkv::mbarrier_arrive_expect_tx(&inbox_full, CLUSTER * (slice + ROWS) * sizeof(float));
            splitkv::mbarrier_init_fence();
        }
        splitkv::cluster_arrive_relaxed();
    }
    // Loaded first and used last: the first K/V tiles and Q are requested while it is in flight.
    const int loaded_len = __ldg(seq_lens + batch_idx);
    // ---- Q as MMA A fragments, held in registers for the whole program ------------------------
    // Requested before the K/V tiles, so that it arrives first; nothing waits for it until the
    // first MMA. a0: row lane/4, k = 2(lane%4)+{0,1}; a1: row +8; a2: k +8; a3: row +8, k +8.
    const int qr = lane / 4, qc = 2 * (lane % 4);
    u32 qa[KSTEPS][4];
    // Quantized K/V take each pair as two 16-bit loads (elements k_slot_dim apart). The second
    // halves wait in q_high and are packed into qa by finish_q, after the first tiles are requested:
    // packed here, the pack's wait for the loads would hold back the tiles' requests.
    u32 q_high[QUANTIZED ? KSTEPS : 1][4];
    // Row r of the CTA: query token t, query head h of the K/V head (row block_row0 + r = t GROUP + h);
    // rows past the head's are padding (Q of zeros). The warp holds rows slice_row0 + qr (+ 8).
    // Validity and address apart: a null pointer as the mark would cost a 64-bit compare per load.
    const q_t* const q_head = q + ((size_t)batch_idx * QUERY_TOKENS * num_qo_heads + (size_t)kv_head * GROUP) * HEAD_DIM;
    auto q_row_valid = [&](int r) {
        return r < ROWS && (QUERY_TOKENS == 1 && ROW_BLOCKS == 1 || block_row0 + r < GROUP * QUERY_TOKENS);
    };
    auto q_row = [&](int r) -> const q_t* {
        if constexpr (QUERY_TOKENS == 1 && ROW_BLOCKS == 1) {
            return q_head + (size_t)r * HEAD_DIM;
        } else {
            const int row = block_row0 + r;
            return q_head + ((size_t)(row / GROUP) * num_qo_heads + row % GROUP) * HEAD_DIM;
        }
    };
    auto load_q = [&]() {  // the CTA's rows of Q
        // k-slots `slot`, slot + 1 of k-step ks of one row, as stored: adjacent elements for 16-bit
        // K/V (both in the value returned), elements k_slot_dim apart for quantized K/V (the second
        // in ``high``).
        auto q_pair = [&](int row, int ks, int slot, u32& high) -> u32 {
            high = 0u;
            if (!q_row_valid(row)) return 0u;
            const q_t* r = q_row(row);
            if constexpr (!QUANTIZED) return *reinterpret_cast<const u32*>(r + ks * 16 + slot);
            const unsigned short* bits = reinterpret_cast<const unsigned short*>(r);
            high = bits[k_slot_dim(ks, slot + 1)];
            return bits[k_slot_dim(ks, slot)];
        };
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            u32 (&high)[4] = q_high[QUANTIZED ? ks : 0];
            qa[ks][0] = q_pair(slice_row0 + qr, ks, qc, high[0]);
            qa[ks][1] = ROWS16 ? q_pair(slice_row0 + qr + 8, ks, qc, high[1]) : (high[1] = 0u);
            qa[ks][2] = q_pair(slice_row0 + qr, ks, qc + 8, high[2]);
            qa[ks][3] = ROWS16 ? q_pair(slice_row0 + qr + 8, ks, qc + 8, high[3]) : (high[3] = 0u);
        }
    };
    load_q();
    // Attention sinks: each row's sink requested now and used at the end (a load at the end puts
    // its latency on the epilogue's path); held raw, so that nothing waits for it here. Where the
    // registers are tight (16 rows at head_dim 256: see WAIT_V_LATER) it is loaded at the end.
    auto load_sink = [&]() { return __ldg(sinks + kv_head * GROUP + (block_row0 + (int)threadIdx.x) % GROUP); };
    [[maybe_unused]] float sink_raw = 0.f;
    if constexpr (SINKS && !WARP_HEADS && WAIT_V_LATER) {
        if (threadIdx.x < ROWS) sink_raw = load_sink();
    }

    // ---- this warp's tiles: those of its token stream w, w + ROW_WARPS, w + 2 ROW_WARPS, ... of the
    // CTA's token range (every tile of its own row with warp_heads) ---------------------------
    // The range is first taken as if the sequence filled the cache, so the first tiles are in
    // flight before the length arrives from memory; once it has, the range is trimmed. Tiles start
    // at the same tokens either way, and every fetched row lies inside the cache (< max_len).
    // With a window the range starts at the window (merge.cuh: window_begin), so the length is
    // waited for first: tiles before the window are never loaded.
    const int window_first = WINDOW && !UNITS ? splitkv::window_begin(min(loaded_len, max_len), QUERY_TOKENS, window_left, TILE) : 0;
    int begin = window_first, end = max_len;
    if (SPLIT) {
        begin = min(window_first + split * tokens_per_split, max_len);
        end = min(begin + tokens_per_split, max_len);
    }
    if constexpr (UNITS) {
        begin = min(unit_first, max_len);
        end = min(unit_end, max_len);
    }
    int my_tiles = tiles_of_warp(begin, end, row_warp);
    // Token t of the CTA's row lies at row head_row0 + token_row(page, t) of the cache. A contiguous
    // cache holds kv_stride tokens per sequence (NHD: [batch][kv_stride][heads]) or per head (HND:
    // [batch][heads][kv_stride]), of which the first max_len are the cache's.
    const size_t head_row0 = PAGED ? (HND ? (size_t)kv_head * PAGE : (size_t)kv_head)
                           : HND   ? ((size_t)batch_idx * num_kv_heads + kv_head) * kv_stride
                                   : (size_t)batch_idx * kv_stride * num_kv_heads + kv_head;
    if constexpr (SWIZZLED) {  // the ring's stage barriers, by its first slice's warp
        if (slice_id() == 0 && lane < 2 * STAGES)
            splitkv::mbarrier_init(&stage_barriers()[ring_id()][lane / 2][lane % 2], STAGE_ARRIVALS);
        splitkv::mbarrier_init_fence();
        stream_sync();
    }
    int fetch_end = end;
    // tma: a contiguous cache's map rows are [batch x kv_stride] tokens (NHD, a row holding every
    // K/V head) or [batch x heads x kv_stride] (HND).
    const int map_row0 = HND ? (batch_idx * num_kv_heads + kv_head) * kv_stride : batch_idx * kv_stride;
    TileLoader loader{row_warp, map_row0, kv_head, num_kv_heads, table_stride, num_pages,
                      smem + (size_t)ring_id() * STAGES * 2 * TILE_BYTES,
                      k + head_row0 * ROW_BYTES, v + head_row0 * ROW_BYTES,
                      k_block_scales + head_row0 * SCALE_ROW, v_block_scales + head_row0 * SCALE_ROW,
                      block_table + (size_t)batch_idx * table_stride, &k_map, &v_map, begin, my_tiles, fetch_end};
    loader.start();
    auto load_tile = [&](int t) { loader.load_tile(t); };
    auto wait_tile = [&](int t, int kv) { loader.wait_tile(t, kv); };
    auto drain = [&](int loaded) { loader.drain(loaded); };

#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) load_tile(t);
    const int prefetched = min(STAGES - 1, my_tiles);

    // Q's pairs packed (quantized K/V), and Q of another type than the MMAs' converted once, so that
    // both MMA operands share the type. (16-bit K/V of Q's type need neither, so Q's arrival stays
    // off the path to the first tile's wait.)
    auto finish_q = [&]() {
        if constexpr (QUANTIZED) {
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
                for (int i = 0; i < 4; ++i) qa[ks][i] |= q_high[ks][i] << 16;
        }
        if constexpr (!splitkv::same_type<q_t, mma_t>::value) {
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    qa[ks][i] = E::pack(splitkv::Elem<q_t>::to_float(splitkv::Elem<q_t>::from_bits(qa[ks][i] & 0xffffu)),
                                        splitkv::Elem<q_t>::to_float(splitkv::Elem<q_t>::from_bits(qa[ks][i] >> 16)));
        }
    };
    finish_q();
    // The fp32 factors of S (into base 2) and of O: the softmax scale, and for quantized K/V the
    // tensor's (or K/V head's) scales over the unit of the unpacked values.
    auto k_factor = [&](int head) { return QUANTIZED ? scale_log2 * (k_scale[head * k_per_head] / KV_UNIT) : scale_log2; };
    auto v_factor = [&](int head) { return QUANTIZED ? v_scale[head * v_per_head] / KV_UNIT : 1.f; };
    float s_factor = k_factor(kv_head), o_factor = v_factor(kv_head);

    const int len = min(loaded_len, max_len);  // never read past the cache, whatever the lengths
    int splits_used = 1;
    if (SPLIT) {
        // Clamped so that lengths beyond what the plan covers can never index past the workspace.
        const int span = len - window_first;
        splits_used = min(span > 0 ? (span + tokens_per_split - 1) / tokens_per_split : 1, num_splits);
        begin = min(begin, len);
    }
    if (UNITS) begin = min(begin, len);  // a unit past the length streams nothing
    end = min(end, len);
    my_tiles = tiles_of_warp(begin, end, row_warp);
    fetch_end = end;
    // CTAs past the row's last split exit, except in a cluster, whose CTAs all join its barriers.
    if (SPLIT && CLUSTER == 1 && split >= splits_used) {
        drain(prefetched);
        return;
    }
    WarpSoftmax softmax;
    const Variant variant(len, window_left, soft_cap_log2, block_row0 + slice_row0, [](int h) { return WarpSoftmax::row_of(h); });
    for (int t = 0; t < my_tiles; ++t) {
        load_tile(t + STAGES - 1);  // its stage was consumed in iteration t - 1
        wait_tile(t, WAIT_V_LATER ? 0 : 1);
        unsigned char* k_tile = loader.ring + (t % STAGES) * 2 * TILE_BYTES;
        unsigned char* v_tile = k_tile + TILE_BYTES;
        const int first = loader.static_first(t);
        const bool partial_tile = first + TILE > end;
        // Rows past the end hold tokens beyond the length, or stale rows: their probabilities are
        // zero, but 0 x NaN is NaN on the tensor cores, so their V rows become zeros (once V has landed).
        auto zero_v_tail = [&]() {
            if (!partial_tile) return;
            for (int c = lane; c < TILE * ROW_CHUNKS; c += 32) {
                const int r = c / ROW_CHUNKS;
                if (first + r >= end) *reinterpret_cast<uint4*>(kv_at(v_tile, r, (c % ROW_CHUNKS) * 16)) = make_uint4(0u, 0u, 0u, 0u);
            }
            // NVFP4: their block scales too, since 0 x NaN is NaN (a stale scale may be 0x7f).
            if constexpr (NVFP4) {
                for (int c = lane; c < TILE * SCALE_ROW / 4; c += 32) {
                    const int r = c / (SCALE_ROW / 4);
                    if (first + r >= end) reinterpret_cast<u32*>(v_tile + TILE * ROW)[c] = 0u;
                }
            }
            // Ordered before the async proxy's next use of the stage: a bulk copy refilling it, or
            // (warpgroup) the MMA reading it.
            if constexpr (SWIZZLED) splitkv::fence_proxy_async_smem();
            __syncwarp();
        };
        if constexpr (!WAIT_V_LATER) zero_v_tail();

        // S = Q K^T (tokens: S^T = K Q^T), then the online-softmax update of the running state.
        float s[S_BLOCKS][4];
        softmax.scores(s, k_tile, qa);
        softmax.update(s, first, end, partial_tile, s_factor, variant);

        if constexpr (WAIT_V_LATER) {
            wait_tile(t, 1);
            zero_v_tail();
        }

        // O += P V (tokens: O^T += V^T P^T)
        softmax.accumulate(s, v_tile);
        stream_sync();  // every lane of the ring's warps has read this stage before it is refilled
    }
    drain(prefetched);  // the rings are reused below: nothing may still be landing in them

    // ---- combine the warps' states: shared memory is free now that the rings are drained -----
    softmax.sum_lanes();
    __syncthreads();
    const WarpStates states{reinterpret_cast<float*>(smem)};
    softmax.store(states, ring_id(), slice_row0, o_factor);  // its ring's state (warp_heads: its own)
    if constexpr (SINKS && !WARP_HEADS) {
        if (threadIdx.x < ROWS) states.row_sink2()[threadIdx.x] = (WAIT_V_LATER ? sink_raw : load_sink()) * 1.4426950408889634f;
    }
    __syncthreads();
    write_result(ResultTarget{out, lse, partial_o, partial_lse, counters, sinks, states.row_sink2(), num_kv_heads, num_qo_heads, num_splits,
                              batch_idx, kv_head, row_y, end > 0},
                 smem, inbox_full, split, splits_used, partial_slot);
}

// A field of the kernel's argument, read on its own. The compiler merges the reads of adjacent
// fields into vector loads of the parameter bank, and a vector's values then stay in registers for
// the whole kernel, where a field read alone (as a scalar kernel parameter is) is re-read from the
// constant bank where it is used. The output and workspace pointers are used only once the tiles
// are done, so they are read alone: held from the entry, they cost registers in the main loop and
// in the fused merge (which spilled at head_dim 256, group 16, on 99 KB GPUs). The empty asm with a
// memory clobber keeps the reads apart; no memory access precedes them at the kernel's entry.
template <class T>
__device__ __forceinline__ T param_field(const T& field) {
    const T value = field;
    asm volatile("" ::: "memory");
    return value;
}
}  // namespace
}  // namespace splitkv::decode

extern "C" __global__ void __launch_bounds__(splitkv::decode::WARPS * 32, 1) SPLITKV_DECODE_CLUSTER_DIMS
splitkv_decode(const __grid_constant__ splitkv::decode::Params p) {
    using splitkv::decode::param_field;
    splitkv::decode::decode_program(
        p.q, p.k, p.v, p.seq_lens, param_field(p.out), param_field(p.lse), param_field(p.partial_o),
        param_field(p.partial_lse), param_field(p.counters), p.max_len, p.num_kv_heads, p.tokens_per_split,
        p.scale_log2, p.k_map, p.v_map, p.k_scale, p.k_per_head, p.v_scale, p.v_per_head, p.k_block_scales,
        p.v_block_scales, p.block_table, p.table_stride, p.num_pages, p.units, p.sinks, p.window_left,
        p.soft_cap_log2, p.kv_stride);
}
