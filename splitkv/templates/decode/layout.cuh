// splitkv decode program: the constants derived from the rendered configuration, and where K/V
// tiles, their block scales and the warps' states lie in shared memory and in the MMA fragments.
#pragma once

namespace splitkv::decode {
namespace {
// A 32-bit word an ldmatrix delivers unpacks into W fp16 pairs in registers (kv_formats.cuh), so
// one ldmatrix feeds W times the MMAs it feeds for 16-bit K/V.
constexpr bool QUANTIZED = KV_BITS < 16;
constexpr bool NVFP4 = KV_BITS == 4;
constexpr int W = 16 / KV_BITS;
// Merge counters per row: one per cluster rank, since with several clusters per row the members of
// one rank merge their slice of the row's output together (see epilogue.cuh).
constexpr int ROW_COUNTERS = CLUSTER;
// Token streams: the rings of a row's tiles (warp_heads: a warp's own row), each read by the
// ROW_SLICES warps of a row slice group, warp w being slice w % ROW_SLICES of stream w / ROW_SLICES.
constexpr int ROW_WARPS = WARP_HEADS ? 1 : WARPS / ROW_SLICES;
constexpr int WARP_ROWS = ROW_SLICES > 1 ? 16 : ROWS;  // the rows one warp's MMAs carry
// Per-row entries of the combine's state (WarpStates): every slice's 16.
constexpr int ROW_SLOTS = 16 * ROW_SLICES;
static_assert(WARPS % ROW_SLICES == 0 && ROWS <= ROW_SLOTS, "row slices of 16 rows");

constexpr bool ROWS16 = WARP_ROWS > 8;        // MMA rows 8..15 carry rows too
constexpr int KSTEPS = HEAD_DIM / 16;         // k-steps of S = Q K^T
constexpr int D_BLOCKS = HEAD_DIM / 8;        // n-blocks of O = P V
constexpr int T_BLOCKS = TILE / 8;            // n-blocks of S
constexpr int ROW_BYTES = HEAD_DIM * KV_BITS / 8;    // one token's K (or V) values
constexpr int ROW = ROW_BYTES + SMEM_PAD;     // smem row in bytes (padded)
// NVFP4: one token's E4M3 block scales; in shared memory they follow the tile's value rows.
constexpr int SCALE_ROW = NVFP4 ? HEAD_DIM / 16 : 0;
// Bytes of a block-scale copy: NVFP4 alone issues them; 4 only lets the copy compile for the others.
constexpr int SCALE_COPY = NVFP4 ? SCALE_ROW : 4;
constexpr int BOX_ELEMS = BOX_BYTES / MAP_ELEM_BYTES;  // tma: a box row's map elements
// tma: a stage's barrier completes on its boxes (one arrival, with their bytes) and, for NVFP4, on
// every lane's block-scale copies (an arrival each).
constexpr unsigned STAGE_ARRIVALS = 1u + (SWIZZLED && NVFP4 ? 32u : 0u);
constexpr int ROW_CHUNKS = ROW_BYTES / 16;          // 16-byte chunks per token row
// Token t of sequence b lies on page block_table[b][t / PAGE], at row t % PAGE; a contiguous cache
// (PAGE = 0) is one page of max_len tokens per sequence, in NHD order.
constexpr bool PAGED = PAGE > 0;
// Pages one tile covers (1 with pages of a tile or more). A warp reads its tiles' page indices a
// batch of TILES_PER_BATCH tiles at a time into PAGE_REGS registers of 32 slots: slot s (lane
// s % 32 of register s / 32) holds page s % TILE_PAGES of the batch's tile s / TILE_PAGES.
constexpr int TILE_PAGES = PAGED && PAGE < TILE ? TILE / PAGE : 1;
constexpr int PAGE_REGS = (TILE_PAGES + 31) / 32;
constexpr int TILES_PER_BATCH = TILE_PAGES < 32 ? 32 / TILE_PAGES : 1;
constexpr int ROW_BOXES = TILE / BOX_ROWS;    // tma: boxes per tile and box column
constexpr int LOADS_PER_LANE = TILE * ROW_CHUNKS / 32;
// The fp32 multiples the unpacked K and V values stand for: the E2M1 decode's power of two.
constexpr float KV_UNIT = NVFP4 ? splitkv::E2M1_UNIT : 1.f;
// S and the softmax run while V is still landing, except where the registers this keeps live
// across the wait would spill (16-row MMAs at head_dim 256): there the tile is awaited whole.
constexpr bool WAIT_V_LATER = !(WARP_ROWS > 8 && HEAD_DIM > 128);
constexpr float LN2 = 0.69314718055994531f;
// tma: the swizzle pattern repeats every 1024 bytes and is taken from the address bits, so the
// rings start on a 1024-byte boundary.
constexpr int SMEM_ALIGN = SWIZZLED ? 1024 : 16;
// S's accumulators per tile and O's per warp: 16-token blocks and 16-dim blocks (tokens), or
// 8-token n-blocks and 8-dim n-blocks (heads).
constexpr int S_BLOCKS = MMA_TOKENS ? TILE / 16 : T_BLOCKS;
constexpr int O_BLOCKS = MMA_TOKENS ? HEAD_DIM / 16 : D_BLOCKS;

static_assert(KSTEPS % 2 == 0 && D_BLOCKS % 2 == 0, "head_dim must be a multiple of 32");
static_assert(ROW_BYTES % 32 == 0, "one ldmatrix.x4 reads 32 bytes of each of 16 rows");
static_assert(SCALE_ROW % 4 == 0, "NVFP4 block scales are copied and read as 32-bit words");
static_assert(TILE_BYTES >= TILE * (ROW + SCALE_ROW), "a tile holds its rows and block-scale rows");
static_assert(!SWIZZLED || TILE_BYTES % (8 * BOX_BYTES) == 0, "tiles start on the swizzle's period");
static_assert(TILE % 16 == 0, "a tile is a whole number of 16-token MMA k-steps");
static_assert((TILE * ROW_CHUNKS) % 32 == 0, "every lane issues the same number of copies");
static_assert(STAGES >= 2, "one tile computes while the next one loads");
static_assert(!WARPGROUP || (ROW_SLICES % 4 == 0 && SWIZZLED && BOX_BYTES == 128 && !QUANTIZED && !MMA_TOKENS),
              "warpgroup MMAs: row slices of whole warpgroups, 16-bit K/V in 128-byte swizzled boxes");

using E = splitkv::Elem<mma_t>;
using splitkv::u32;

// The thread's lane and warp, read from the thread index where they are used, not held as members
// of the structs below nor handed to them as arguments. Derived from the thread index in the step
// itself, the ldmatrix and copy offsets, the swizzle XORs and the mask offsets are recomputed inside
// the main loop or hoisted once each; derived from a struct's copy of the lane, they are all hoisted
// before the loop, some twice (the swizzle of each 16-token block), and each holds a register across
// it (three times the loop's live-in values at head_dim 64 with per-lane copies, and occupancy lost
// where registers bound it).
__device__ __forceinline__ int lane_id() { return threadIdx.x % 32; }
__device__ __forceinline__ int warp_id() { return threadIdx.x / 32; }
// The warp's ring (its token stream's; warp_heads: its own) and its row slice in the stream.
constexpr int RINGS = WARP_HEADS ? WARPS : ROW_WARPS;
__device__ __forceinline__ int ring_id() { return WARP_HEADS ? warp_id() : warp_id() / ROW_SLICES; }
__device__ __forceinline__ int slice_id() { return WARP_HEADS ? 0 : warp_id() % ROW_SLICES; }

// Byte c (a multiple of 16: one 16-byte chunk) of token r's row of a K or V tile in shared memory.
// Padded rows of ROW bytes; or (tma) ROW_BYTES / BOX_BYTES boxes of TILE rows of BOX_BYTES one after
// the other, the copy engine's swizzle XOR-ing a row's 16-byte chunk index with bits 7.. of the
// row's offset (bits 7-9 for 128-byte rows: chunk j of row r at j ^ (r % 8); 7-8 for 64-byte rows,
// j ^ (r / 2 % 4); bit 7 for 32-byte rows), so the eight rows an ldmatrix reads still fall in
// distinct banks.
__device__ __forceinline__ unsigned char* kv_at(unsigned char* tile, int r, int c) {
    if constexpr (SWIZZLED)
        return tile + (c / BOX_BYTES) * (TILE * BOX_BYTES) + r * BOX_BYTES
               + ((((c % BOX_BYTES) / 16) ^ ((r * BOX_BYTES / 128) % (BOX_BYTES / 16))) * 16);
    else
        return tile + r * ROW + c;
}
// NVFP4: the 32-bit word of token r's block scales that holds block 4i..4i+3.
__device__ __forceinline__ u32 scale_word(const unsigned char* tile, int r, int i) {
    return *reinterpret_cast<const u32*>(tile + TILE * ROW + r * SCALE_ROW + 4 * i);
}

// Quantized K/V: which element of the head a k-step's k-slot (0..15) reads, the same for Q and K.
// k-step ks reads 16-byte chunk ks / (W/2) of the row (W/2 k-steps per chunk); slots 2t, 2t+1
// and 2t+8, 2t+9 of lane t come from pairs 2u and 2u+1 (u = ks % (W/2)) of its word, bytes 4t..4t+3
// of the chunk (kv_formats.cuh: FP8 pair j is elements 2j, 2j+1 of the word, NVFP4 pair j is j, j+4).
__device__ __forceinline__ constexpr int k_slot_dim(int ks, int slot) {
    constexpr int STEPS_PER_CHUNK = W > 1 ? W / 2 : 1;  // (no division by 0 where 16-bit K/V leave it unused)
    const int chunk = ks / STEPS_PER_CHUNK, pair = 2 * (ks % STEPS_PER_CHUNK) + slot / 8, t = slot % 8 / 2, e = slot % 2;
    const int in_word = NVFP4 ? pair + 4 * e : 2 * pair + e;
    return chunk * 8 * W + t * 2 * W + in_word;
}
// Quantized K: lane t's word of token r's 16-byte chunk `chunk` (bytes 4t..4t+3, as ldmatrix gives
// it) as N = W fp16 pairs for k_slot_dim; NVFP4 values times their block scale (one per word).
// (16-bit K/V instantiate it with N = 1 in a branch they never take; it then does nothing.)
template <int N>
__device__ __forceinline__ void unpack_k(u32 w, u32 (&out)[N], const unsigned char* tile, int r, int chunk) {
    static_assert(N == W, "unpack_k: one pair per MMA operand register the word feeds");
    if constexpr (N == 2) {  // FP8
        splitkv::unpack_e4m3x4(w, out);
    } else if constexpr (N == 4) {  // NVFP4
        splitkv::unpack_e2m1x8(w, out);
        const u32 block = 2 * (chunk % 2) + (threadIdx.x % 4) / 2;  // in the scale word of chunk / 2 (lane % 4: t)
        const u32 word = scale_word(tile, r, chunk / 2);
        const u32 scale = splitkv::e4m3_pair(word, word, block, block);
#pragma unroll
        for (int j = 0; j < N; ++j) out[j] = splitkv::hmul2_bits(out[j], scale);
    }
}
// Quantized V: a word of ldmatrix.trans, bytes 2g, 2g+1 (g = lane/4) of chunk `chunk` of tokens r
// and r + 1, as W fp16 pairs (token r, token r + 1) of one element each: pair j is element 2g + j
// (FP8) or 4g + j (NVFP4, times the two tokens' block scales) of the chunk.
template <int N>
__device__ __forceinline__ void unpack_v(u32 w, u32 (&out)[N], const unsigned char* tile, int r, int chunk) {
    static_assert(N == W, "unpack_v: one pair per MMA operand register the word feeds");
    if constexpr (N == 2) {  // FP8
        splitkv::unpack_e4m3x4(__byte_perm(w, 0u, 0x3120), out);  // bytes (r, r + 1) of each element together
    } else if constexpr (N == 4) {  // NVFP4
        splitkv::unpack_e2m1x8(w, out);
        const u32 block = 2 * (chunk % 2) + (threadIdx.x % 32) / 16;  // 4g / 16, in the scale word
        const u32 scale = splitkv::e4m3_pair(scale_word(tile, r, chunk / 2), scale_word(tile, r + 1, chunk / 2), block, block);
#pragma unroll
        for (int j = 0; j < N; ++j) out[j] = splitkv::hmul2_bits(out[j], scale);
    }
}

// Element of the head that output accumulator m = W i + j holds at MMA row or column x (0..15): pair
// j of every word of the accumulator's chunks_per_m 16-byte chunks from chunks_per_m x i on (2 for
// the 16-row accumulators of the tokens layout, 1 for the 8-column ones of the heads layout), x / 8
// being the chunk and x % 8 the word's place in it (16-bit K/V: W = 1, accumulator m holds elements
// 16m..16m+15, or 8m..8m+7).
__device__ __forceinline__ constexpr int o_dim(int m, int x, int chunks_per_m) {
    return (m / W * chunks_per_m + x / 8) * 8 * W + (x % 8) * W + m % W;
}

// The warps' states in the layout the final combine reads (fp32), from one base address: per token
// stream a max (which the combine turns into the weight 2^(m_w - m)) and a sum per row slot (its
// slices' warps fill them), the CTA's sum, base-2 log-sum-exp and final denominator (the sum, plus
// the sink's weight with SINKS) per row, the rows' sinks (base 2), then per stream its ROWS x
// HEAD_DIM accumulator. (warp_heads: a stream per warp.)
struct WarpStates {
    float* base;
    __device__ float* m() const { return base; }                                 // [WARPS / ROW_SLICES][ROW_SLOTS]
    __device__ float* l() const { return base + WARPS * 16; }                    // [WARPS / ROW_SLICES][ROW_SLOTS]
    __device__ float* row_l() const { return base + 2 * WARPS * 16; }            // [ROW_SLOTS]
    __device__ float* row_lse2() const { return row_l() + ROW_SLOTS; }           // [ROW_SLOTS]
    __device__ float* row_den() const { return row_l() + 2 * ROW_SLOTS; }        // [ROW_SLOTS]
    __device__ float* row_sink2() const { return row_l() + 3 * ROW_SLOTS; }      // [ROW_SLOTS] SINKS: base 2
    __device__ float* o() const { return row_l() + 4 * ROW_SLOTS; }              // [WARPS / ROW_SLICES][ROWS][HEAD_DIM]
    // Where stream s's state of row r lies in m() and l().
    __device__ static int at(int s, int r) { return s * ROW_SLOTS + r; }
};

// The warps of the calling warp's ring (with one slice, the warp alone) meet: what each wrote to
// shared memory before is visible to all after. Named barrier 1 + ring (0 is __syncthreads's).
__device__ __forceinline__ void stream_sync() {
    if constexpr (ROW_SLICES == 1) {
        __syncwarp();
    } else {
        asm volatile("bar.sync %0, %1;" :: "r"(1 + ring_id()), "r"(32 * ROW_SLICES) : "memory");
    }
}

// Tiles of [begin, end) that the row's w-th warp streams: w, w + ROW_WARPS, w + 2 ROW_WARPS, ...
__device__ __forceinline__ int tiles_of_warp(int begin, int end, int w) {
    const int num_tiles = (end - begin + TILE - 1) / TILE;
    return num_tiles > w ? (num_tiles - w + ROW_WARPS - 1) / ROW_WARPS : 0;
}
}  // namespace
}  // namespace splitkv::decode
