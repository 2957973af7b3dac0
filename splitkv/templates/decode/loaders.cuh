// splitkv decode program: a warp's K/V tiles into its ring of shared memory, by tensor maps
// (SWIZZLED) or per-lane cp.async, from contiguous or paged caches, with NVFP4's block scales.
#pragma once

namespace splitkv::decode {
namespace {
// tma: the ring stages' barriers (K rows, V rows), per ring. A function's own, so that programs
// that never call it (cp.async) hold no such array.
__device__ __forceinline__ auto stage_barriers() -> unsigned long long (&)[RINGS][STAGES][2] {
    __shared__ unsigned long long stage_full[RINGS][STAGES][2];
    return stage_full;
}

// The warp's t-th tile is tile row_warp + t x ROW_WARPS of the CTA's token range, into ring stage
// t % STAGES. The warps of a ring's row slices copy a share of each tile each (tma: slice 0 asks
// for the whole tile), and each waits for the whole. `begin`, `my_tiles` and `fetch_end` are the kernel's: the range is first taken as if
// the sequence filled the cache (so the first tiles are in flight before the length arrives),
// then trimmed in place.
struct TileLoader {
    // (No lane or warp members: see lane_id.)
    // map_row0 (tma, contiguous caches): the map row of the CTA's row's token 0.
    const int row_warp, map_row0, kv_head, num_kv_heads, table_stride, num_pages;
    unsigned char* const ring;
    const unsigned char* const k_head;         // cp.async: the head's first row of K, of V
    const unsigned char* const v_head;
    const unsigned char* const k_scales_head;  // NVFP4: the block scales of the head's rows
    const unsigned char* const v_scales_head;
    const int* const seq_pages;                // paged: the sequence's row of the block table
    const splitkv::TensorMap* const k_map;     // tma
    const splitkv::TensorMap* const v_map;
    const int& begin;
    const int& my_tiles;
    const int& fetch_end;  // rows past it are not fetched: the speculative end, then the real one
    // Paged: page indices are read a batch ahead: load_tile copies with the batch read when the
    // previous batch's first tile was loaded, so the reads' latency hides behind TILES_PER_BATCH
    // tiles (a single tile where a tile spans 32 pages or more), not behind one.
    int pages_now[PAGE_REGS] = {}, pages_next[PAGE_REGS] = {};

    __device__ __forceinline__ int static_first(int t) const { return begin + (row_warp + t * ROW_WARPS) * TILE; }
    // Row of token `token` (on page `page`) past the head's first row (rows of ROW_BYTES values, or
    // of SCALE_ROW block-scale bytes).
    __device__ __forceinline__ size_t token_row(int page, int token) const {
        if constexpr (PAGED) return (size_t)page * PAGE * num_kv_heads + (size_t)(token % PAGE) * (HND ? 1 : num_kv_heads);
        else return (size_t)token * (HND ? 1 : num_kv_heads);
    }
    // Paged: the page indices of the warp's tile batch `b` (see TILES_PER_BATCH), clamped into the
    // cache (and into the table's row), so that no table, however wrong, makes a read leave it.
    __device__ __forceinline__ void batch_pages(int b, int (&pages)[PAGE_REGS]) const {
        if constexpr (PAGED) {
            const int lane = lane_id();
#pragma unroll
            for (int i = 0; i < PAGE_REGS; ++i) {
                const int s = lane + 32 * i;
                const int first = static_first(b * TILES_PER_BATCH + s / TILE_PAGES);
                const int page = __ldg(seq_pages + min(first / PAGE + s % TILE_PAGES, table_stride - 1));
                pages[i] = (int)min((unsigned)page, (unsigned)(num_pages - 1));
            }
        }
    }
    // The page of row r of the tile whose first page is in slot `slot0` (every lane calls it: a
    // shuffle).
    __device__ __forceinline__ int row_page(const int (&pages)[PAGE_REGS], int slot0, int r) const {
        if (!PAGED) return 0;
        const int s = slot0 + (TILE_PAGES > 1 ? r / PAGE : 0);
        int page = 0;
#pragma unroll
        for (int i = 0; i < PAGE_REGS; ++i) {
            const int p = __shfl_sync(0xffffffffu, pages[i], s % 32);
            if (s / 32 == i) page = p;
        }
        return page;
    }
    __device__ __forceinline__ void start() {
        if (PAGED && my_tiles > 0) batch_pages(0, pages_next);
    }
    // NVFP4: the block scales of the tile's rows, a row per lane (per-lane copies and tensor maps
    // alike); rows from valid_end on are zero-filled.
    __device__ __forceinline__ void copy_scales(unsigned char* tile, const unsigned char* head, int valid_end,
                                                int first, int slot0) const {
        if constexpr (NVFP4) {
            const int lane = lane_id();
#pragma unroll
            for (int j = 0; j < (TILE + 31) / 32; ++j) {
                const int r = lane + 32 * j;
                const int page = row_page(pages_now, slot0, min(r, TILE - 1));  // every lane shuffles
                const int token = first + r;
                const bool valid = token < valid_end;
                if (r < TILE)
                    splitkv::cp_async_small<SCALE_COPY>(tile + TILE * ROW + r * SCALE_ROW,
                                                       head + token_row(page, valid ? token : first) * SCALE_ROW,
                                                       valid ? SCALE_COPY : 0);
            }
        }
    }
    // The warp's t-th tile into ring stage t % STAGES.
    __device__ __forceinline__ void load_tile(int t) {
        if (t >= my_tiles) {
            if constexpr (!SWIZZLED) {
                splitkv::cp_async_commit();  // empty groups keep the wait counts uniform
                splitkv::cp_async_commit();
            }
            return;
        }
        const int first = static_first(t);
        if (PAGED && t % TILES_PER_BATCH == 0) {  // a batch's first tile
#pragma unroll
            for (int i = 0; i < PAGE_REGS; ++i) pages_now[i] = pages_next[i];
            if (t + TILES_PER_BATCH < my_tiles) batch_pages(t / TILES_PER_BATCH + 1, pages_next);
        }
        const int slot0 = t % TILES_PER_BATCH * TILE_PAGES;  // the tile's first page
        unsigned char* k_tile = ring + (t % STAGES) * 2 * TILE_BYTES;
        unsigned char* v_tile = k_tile + TILE_BYTES;
        if constexpr (SWIZZLED) copy_by_maps(t, first, slot0, k_tile, v_tile);
        else copy_by_lanes(first, slot0, k_tile, v_tile);
    }
    // One lane asks for the tile's K, then its V, as boxes of BOX_ELEMS elements x TILE tokens. Rows
    // past the fetch end are fetched too: they lie in the cache (or past the tensor, where they
    // arrive as zeros) and are masked, their V rows zeroed, like any row past the length.
    // Paged: the map's rows are a page's tokens (NHD: of every K/V head) or one K/V head's
    // tokens (HND); a tile of several pages comes as a box per page, lane j asking for page j's.
    __device__ __forceinline__ void copy_by_maps(int t, int first, int slot0, unsigned char* k_tile, unsigned char* v_tile) {
        if (slice_id() != 0) return;  // the stage's barriers expect one slice's copies
        const int lane = lane_id();
        unsigned long long* bars = stage_barriers()[ring_id()][t % STAGES];
        if constexpr (ROW_BOXES > 1) {
            if (lane < 2) splitkv::mbarrier_arrive_expect_tx(bars + lane, TILE * ROW_BYTES);
            __syncwarp();
        }
        const int page = PAGED ? row_page(pages_now, slot0, lane * PAGE) : 0;  // lane j: the tile's j-th page
        if (lane < ROW_BOXES) {
            const int row = !PAGED ? map_row0 + first
                          : (HND ? (page * num_kv_heads + kv_head) * PAGE : page * PAGE) + (ROW_BOXES > 1 ? 0 : first % PAGE);
            const int col = HND ? 0 : kv_head * (ROW_BYTES / MAP_ELEM_BYTES);
            auto copy_boxes = [&](unsigned char* tile, const splitkv::TensorMap* map, unsigned long long* bar) {
                if (ROW_BOXES == 1) splitkv::mbarrier_arrive_expect_tx(bar, TILE * ROW_BYTES);
#pragma unroll
                for (int b = 0; b < ROW_BYTES / BOX_BYTES; ++b)
                    splitkv::tensor_copy_2d_to_smem(tile + b * TILE * BOX_BYTES + lane * BOX_ROWS * BOX_BYTES, map,
                                                    col + b * BOX_ELEMS, row, bar);
            };
            copy_boxes(k_tile, k_map, bars);
            copy_boxes(v_tile, v_map, bars + 1);
        }
        if constexpr (NVFP4) {  // the block scales, each lane's copies an arrival on the stage's barriers
            copy_scales(k_tile, k_scales_head, fetch_end, first, slot0);
            splitkv::cp_async_mbarrier_arrive_noinc(bars);
            copy_scales(v_tile, v_scales_head, fetch_end, first, slot0);
            splitkv::cp_async_mbarrier_arrive_noinc(bars + 1);
        }
    }
    // Every lane copies 16-byte pieces of the tile's rows, K and V in cp.async groups of their own;
    // of a ring's row slices, slice s the pieces i = s, s + ROW_SLICES, ... of each lane (and slice 0
    // NVFP4's block scales).
    __device__ __forceinline__ void copy_by_lanes(int first, int slot0, unsigned char* k_tile, unsigned char* v_tile) {
        const int lane = lane_id(), slice = slice_id();
        constexpr int PIECES = (LOADS_PER_LANE + ROW_SLICES - 1) / ROW_SLICES;  // per lane of each slice
        auto piece = [&](int j) { return slice + ROW_SLICES * j; };
        auto has_piece = [&](int j) { return LOADS_PER_LANE % ROW_SLICES == 0 || piece(j) < LOADS_PER_LANE; };
        const unsigned char* const k_src = k_head;
        const unsigned char* const v_src = v_head;
        const unsigned char* const k_scale_src = k_scales_head;
        const unsigned char* const v_scale_src = v_scales_head;
        // The page of the lane's j-th 16-byte piece (row (lane + 32 piece(j)) / ROW_CHUNKS of the tile).
        int piece_page[PIECES];
#pragma unroll
        for (int j = 0; j < PIECES; ++j)
            piece_page[j] = TILE_PAGES == 1 && j > 0 ? piece_page[0]
                          : row_page(pages_now, slot0, min((lane + 32 * piece(j)) / ROW_CHUNKS, TILE - 1));
        auto copy = [&](int j, unsigned char* tile, const unsigned char* head) {  // the lane's j-th 16-byte piece
            if (!has_piece(j)) return;
            const int c = lane + 32 * piece(j), r = c / ROW_CHUNKS, col = (c % ROW_CHUNKS) * 16;
            const int token = first + r;
            const bool valid = token < fetch_end;
            splitkv::cp_async_16(tile + r * ROW + col, head + token_row(piece_page[j], valid ? token : first) * ROW_BYTES + col,
                                 valid ? 16 : 0);
        };
        auto copy_slice_scales = [&](unsigned char* tile, const unsigned char* head) {
            if (slice == 0) copy_scales(tile, head, fetch_end, first, slot0);
        };
        if constexpr (WAIT_V_LATER) {  // K, then V, in groups of their own
#pragma unroll
            for (int j = 0; j < PIECES; ++j) copy(j, k_tile, k_src);
            copy_slice_scales(k_tile, k_scale_src);
            splitkv::cp_async_commit();
#pragma unroll
            for (int j = 0; j < PIECES; ++j) copy(j, v_tile, v_src);
            copy_slice_scales(v_tile, v_scale_src);
            splitkv::cp_async_commit();
        } else {  // K and V interleaved in one group (fewer live addresses), then an empty one
#pragma unroll
            for (int j = 0; j < PIECES; ++j) {
                copy(j, k_tile, k_src);
                copy(j, v_tile, v_src);
            }
            copy_slice_scales(k_tile, k_scale_src);
            copy_slice_scales(v_tile, v_scale_src);
            splitkv::cp_async_commit();
            splitkv::cp_async_commit();
        }
    }
    // Tile t's K rows (kv = 0), or its K and V rows (kv = 1), have landed in its stage, visible to
    // the whole warp (and, copied by several row slices, to each of them). Two groups are committed
    // per tile: after tile t's first come its second and 2 (STAGES - 1) more.
    __device__ __forceinline__ void wait_tile(int t, int kv) const {
        if constexpr (SWIZZLED) {
            for (int j = 0; j <= kv; ++j) splitkv::mbarrier_wait(&stage_barriers()[ring_id()][t % STAGES][j], (t / STAGES) & 1);
        } else {
            if (kv == 0) splitkv::cp_async_wait<2 * STAGES - 1>();
            else splitkv::cp_async_wait<2 * STAGES - 2>();
            stream_sync();
        }
    }
    // Tiles loaded but never waited for land before shared memory is reused.
    __device__ __forceinline__ void drain(int loaded) const {
        if constexpr (SWIZZLED) {
            for (int t = my_tiles; t < loaded; ++t)
                for (int kv = 0; kv < 2; ++kv) splitkv::mbarrier_wait(&stage_barriers()[ring_id()][t % STAGES][kv], (t / STAGES) & 1);
        } else {
            (void)loaded;
            splitkv::cp_async_wait<0>();
        }
    }
};
}  // namespace
}  // namespace splitkv::decode
