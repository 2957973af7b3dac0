// splitkv decode program: one warp's step over a tile: scores S = Q K^T, the online-softmax update
// of its running state, and O += P V, in either MMA orientation (MMA_TOKENS: S^T = K Q^T with the
// tokens as the M rows; else the query heads as the M rows).
#pragma once

namespace splitkv::decode {
namespace {
// One online-softmax update of one row (MMA row `h` of the lane's two, see WarpSoftmax) over the
// COUNT scores of it this lane holds: scale into base 2, apply the variant's transform, and in a
// `masked` tile its row mask and the tail mask past `end`; take the tile's max over the lanes that
// share the row (xor shuffles SHUFFLE_FIRST, 2 SHUFFLE_FIRST, ... SHUFFLE_LAST), turn the scores
// into probabilities and fold them into (m_run, l_run). Returns the factor the row's O accumulators
// are to be rescaled by. `score(i)` is the lane's i-th score of the row (a reference), `token(i)`
// its token.
template <int COUNT, int SHUFFLE_FIRST, int SHUFFLE_LAST, class Score, class Token>
__device__ __forceinline__ float online_softmax_update(float& m_run, float& l_run, Score score, Token token,
                                                       const Variant& variant, int h, bool masked, int end,
                                                       float s_factor) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < COUNT; ++i) {
        float x = variant.transform_score(score(i) * s_factor);
        if (masked && (token(i) >= end || !variant.keep_token(h, token(i)))) x = -INFINITY;
        score(i) = x;
        tile_max = fmaxf(tile_max, x);
    }
#pragma unroll
    for (int mask = SHUFFLE_FIRST; mask <= SHUFFLE_LAST; mask *= 2)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, mask));
    const float m_new = fmaxf(m_run, tile_max);
    const float ref = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen only masked tokens
    const float alpha = splitkv::exp2_approx(m_run - ref);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < COUNT; ++i) {
        const float p = splitkv::exp2_approx(score(i) - ref);
        score(i) = p;
        sum += p;
    }
    l_run = l_run * alpha + sum;
    m_run = m_new;
    return alpha;
}

// A warp's online-softmax state and its step over a tile. Tokens: rows are query heads 2(lane%4)
// ([0]) and 2(lane%4) + 1 ([1]), O held transposed (o[mb] has dims mb*16 + lane/4, and + 8).
// Heads: rows lane/4 ([0]) and lane/4 + 8 ([1]). l is this lane's partial sum over its tokens.
// (No lane members: each step reads the lane as lane_id says, with qr = lane/4 and qc = 2(lane%4).)
// Rows are the warp's rows of the CTA's (query tokens x query heads, see decode.cu.j2's ROWS): its
// row slice's 16.
struct WarpSoftmax {
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float o[O_BLOCKS][4];

    __device__ __forceinline__ WarpSoftmax() {
#pragma unroll
        for (int mb = 0; mb < O_BLOCKS; ++mb) o[mb][0] = o[mb][1] = o[mb][2] = o[mb][3] = 0.f;
    }
    // The MMA row of state h: its query head within the group.
    __device__ __forceinline__ static int row_of(int h) { return MMA_TOKENS ? 2 * (lane_id() % 4) + h : lane_id() / 4 + 8 * h; }

    // S of the tile in `k_tile`. Tokens: 16 tokens x 16 dims of K are the A operand (one
    // ldmatrix.x4), Q the B operand (its fragments of rows 0..7 are B fragments with the query
    // head as n); one ldmatrix.x4 reads 32 bytes of each of the 16 tokens: a[0], a[1] chunk 2 cg of
    // tokens lane/4 and lane/4 + 8, a[2], a[3] chunk 2 cg + 1. Heads: one ldmatrix.x4 gives the B
    // fragments of two k-steps for 8 tokens.
    __device__ __forceinline__ void scores(float (&s)[S_BLOCKS][4], unsigned char* k_tile, const u32 (&qa)[KSTEPS][4]) const {
        [[maybe_unused]] const int lane = lane_id(), qr = lane / 4, qc = 2 * (lane % 4);
        if constexpr (MMA_TOKENS) {
#pragma unroll
            for (int kb = 0; kb < TILE / 16; ++kb) {
                s[kb][0] = s[kb][1] = s[kb][2] = s[kb][3] = 0.f;
#pragma unroll
                for (int cg = 0; cg < ROW_BYTES / 32; ++cg) {
                    u32 a[4];
                    splitkv::ldmatrix_x4(a, kv_at(k_tile, kb * 16 + ((lane / 8) & 1) * 8 + lane % 8, cg * 32 + (lane / 16) * 16));
                    if constexpr (!QUANTIZED) {
                        splitkv::mma<mma_t>(s[kb], a, qa[cg][0], qa[cg][2]);
                    } else {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            u32 lo[W], hi[W];  // tokens lane/4 and lane/4 + 8
                            unpack_k(a[2 * h], lo, k_tile, kb * 16 + qr, 2 * cg + h);
                            unpack_k(a[2 * h + 1], hi, k_tile, kb * 16 + qr + 8, 2 * cg + h);
#pragma unroll
                            for (int u = 0; u < W / 2; ++u) {
                                const int ks = (2 * cg + h) * (W / 2) + u;
                                const u32 frag[4] = {lo[2 * u], hi[2 * u], lo[2 * u + 1], hi[2 * u + 1]};
                                splitkv::mma<mma_t>(s[kb], frag, qa[ks][0], qa[ks][2]);
                            }
                        }
                    }
                }
            }
        } else if constexpr (WARPGROUP) {
            // S (the warpgroup's 64 rows x TILE tokens) = Q K^T in KSTEPS MMAs of 16 dims, K-major:
            // k-step ks reads 32 bytes of every token's row, in box column ks / 4 (64 dims per 128-byte
            // box) at byte 32 (ks % 4) of its swizzle atoms, which lie 1024 bytes (8 tokens) apart.
            splitkv::wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                const unsigned char* b = k_tile + (ks * 32 / BOX_BYTES) * (TILE * BOX_BYTES) + ks * 32 % BOX_BYTES;
                wgmma_scores(s, qa[ks], splitkv::wgmma_desc_sw128(b, 0, 8 * BOX_BYTES), ks > 0);
            }
            splitkv::wgmma_commit();
            splitkv::wgmma_wait<0>();
            splitkv::fence_accumulators(s);
        } else {
#pragma unroll
            for (int nb = 0; nb < T_BLOCKS; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
            // S[:, n-block nb] += Q (k-step ks) x the B fragment (b0, b1) of K.
            auto mma_s = [&](int nb, int ks, u32 b0, u32 b1) {
                if (ROWS16) {
                    splitkv::mma<mma_t>(s[nb], qa[ks], b0, b1);
                } else {
                    float d[2] = {s[nb][0], s[nb][1]};
                    splitkv::mma_rows8<mma_t>(d, qa[ks][0], qa[ks][2], b0, b1);
                    s[nb][0] = d[0];
                    s[nb][1] = d[1];
                }
            };
            if constexpr (!QUANTIZED) {
#pragma unroll
                for (int ks2 = 0; ks2 < KSTEPS; ks2 += 2) {
#pragma unroll
                    for (int nb = 0; nb < T_BLOCKS; ++nb) {
                        u32 b[4];
                        splitkv::ldmatrix_x4(b, kv_at(k_tile, nb * 8 + lane % 8, ks2 * 32 + (lane / 8) * 16));
                        mma_s(nb, ks2, b[0], b[1]);
                        mma_s(nb, ks2 + 1, b[2], b[3]);
                    }
                }
            } else {
                // Quantized: one ldmatrix.x4 reads 32 bytes of 16 tokens: b[0], b[1] chunks 2 cg, 2 cg + 1
                // of n-block 2 nb2, b[2], b[3] those of n-block 2 nb2 + 1.
#pragma unroll
                for (int cg = 0; cg < ROW_BYTES / 32; ++cg) {
#pragma unroll
                    for (int nb2 = 0; nb2 < T_BLOCKS / 2; ++nb2) {
                        u32 b[4];
                        splitkv::ldmatrix_x4(b, kv_at(k_tile, nb2 * 16 + (lane / 16) * 8 + lane % 8, cg * 32 + ((lane / 8) & 1) * 16));
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int nb = 2 * nb2 + i / 2, chunk = 2 * cg + i % 2;
                            u32 x[W];
                            unpack_k(b[i], x, k_tile, nb * 8 + qr, chunk);
#pragma unroll
                            for (int u = 0; u < W / 2; ++u) mma_s(nb, chunk * (W / 2) + u, x[2 * u], x[2 * u + 1]);
                        }
                    }
                }
            }
        }
    }

    // The online-softmax update of every row the lane holds, with the tile's first token `first`,
    // the tail from `end` masked (`partial_tile`: the tile crosses it) and the variant's masks where
    // the tile crosses them; rescales O. Tokens: s[kb][2 hi + j] is token kb*16 + lane/4
    // + 8 hi of head 2(lane%4) + j, the row's other lanes those of lane ^ 4, ^ 8, ^ 16. Heads:
    // s[nb][2 h + e] is token nb*8 + 2(lane%4) + e of row lane/4 + 8 h, the others lane ^ 1, ^ 2.
    __device__ __forceinline__ void update(float (&s)[S_BLOCKS][4], int first, int end, bool partial_tile,
                                           float s_factor, const Variant& variant) {
        [[maybe_unused]] const int lane = lane_id(), qr = lane / 4, qc = 2 * (lane % 4);
        constexpr int COUNT = 2 * S_BLOCKS;
        const bool masked = partial_tile || variant.masks_tile(first);
#pragma unroll
        for (int h = 0; h < (MMA_TOKENS || ROWS16 ? 2 : 1); ++h) {
            if constexpr (MMA_TOKENS) {
                const float alpha = online_softmax_update<COUNT, 4, 16>(
                    m_run[h], l_run[h], [&](int i) -> float& { return s[i / 2][2 * (i % 2) + h]; },
                    [&](int i) { return first + (i / 2) * 16 + 8 * (i % 2) + qr; }, variant, h, masked, end, s_factor);
#pragma unroll
                for (int mb = 0; mb < O_BLOCKS; ++mb) {
                    o[mb][h] *= alpha;
                    o[mb][2 + h] *= alpha;
                }
            } else {
                const float alpha = online_softmax_update<COUNT, 1, 2>(
                    m_run[h], l_run[h], [&](int i) -> float& { return s[i / 2][2 * h + i % 2]; },
                    [&](int i) { return first + (i / 2) * 8 + qc + i % 2; }, variant, h, masked, end, s_factor);
#pragma unroll
                for (int nd = 0; nd < O_BLOCKS; ++nd) {
                    o[nd][2 * h] *= alpha;
                    o[nd][2 * h + 1] *= alpha;
                }
            }
        }
    }

    // O += P V of the tile in `v_tile`, P the probabilities `update` left in s. Tokens: O^T += V^T
    // P^T, 16 dims x 16 tokens of V^T the A operand (ldmatrix.trans of V rows), P^T the B operand:
    // P's accumulators, packed and transposed in registers by movmatrix. Heads: P's accumulators
    // become A fragments in registers; V's B fragments come from ldmatrix.trans (V is stored
    // [token][dim], B wants k = token).
    __device__ __forceinline__ void accumulate(const float (&s)[S_BLOCKS][4], unsigned char* v_tile) {
        [[maybe_unused]] const int lane = lane_id(), qr = lane / 4, qc = 2 * (lane % 4);
        if constexpr (MMA_TOKENS) {
#pragma unroll
            for (int kb = 0; kb < TILE / 16; ++kb) {
                const u32 pb0 = splitkv::movmatrix_trans(E::pack(s[kb][0], s[kb][1]));  // tokens 0..7 of the block
                const u32 pb1 = splitkv::movmatrix_trans(E::pack(s[kb][2], s[kb][3]));  // tokens 8..15
                const int mi = lane / 8;  // ldmatrix matrix: token half mi >> 1, 16-byte chunk mi & 1
                const int vr = kb * 16 + (mi >> 1) * 8 + lane % 8;
#pragma unroll
                for (int cg = 0; cg < ROW_BYTES / 32; ++cg) {
                    u32 a[4];
                    splitkv::ldmatrix_x4_trans(a, kv_at(v_tile, vr, cg * 32 + (mi & 1) * 16));
                    if constexpr (!QUANTIZED) {
                        splitkv::mma<mma_t>(o[cg], a, pb0, pb1);
                    } else {
                        // a[i]: tokens 8 (i / 2) + 2(lane%4), +1 of chunk 2 cg + i % 2; pair j of each is
                        // the A fragment (rows: elements) of accumulator cg W + j (o_dim).
                        u32 x[4][W];
#pragma unroll
                        for (int i = 0; i < 4; ++i) unpack_v(a[i], x[i], v_tile, kb * 16 + (i / 2) * 8 + qc, 2 * cg + i % 2);
#pragma unroll
                        for (int j = 0; j < W; ++j) {
                            const u32 frag[4] = {x[0][j], x[1][j], x[2][j], x[3][j]};
                            splitkv::mma<mma_t>(o[cg * W + j], frag, pb0, pb1);
                        }
                    }
                }
            }
        } else if constexpr (WARPGROUP) {
            // O (the warpgroup's 64 rows x HEAD_DIM) += P V in TILE / 16 MMAs of 16 tokens, V N-major
            // (transposed): k-step kt reads tokens 16 kt.. (two swizzle atoms of 8 tokens, 1024 bytes
            // apart), each 64 dims of them a box column (TILE x BOX_BYTES apart). P's accumulators
            // are the A fragments, as for the warp MMAs below.
            u32 p[TILE / 16][4];
#pragma unroll
            for (int kt = 0; kt < TILE / 16; ++kt) {
                p[kt][0] = E::pack(s[2 * kt][0], s[2 * kt][1]);
                p[kt][1] = E::pack(s[2 * kt][2], s[2 * kt][3]);
                p[kt][2] = E::pack(s[2 * kt + 1][0], s[2 * kt + 1][1]);
                p[kt][3] = E::pack(s[2 * kt + 1][2], s[2 * kt + 1][3]);
            }
            splitkv::fence_accumulators(o);
            splitkv::wgmma_fence();
#pragma unroll
            for (int kt = 0; kt < TILE / 16; ++kt)
                wgmma_pv(o, p[kt], splitkv::wgmma_desc_sw128(v_tile + kt * 16 * BOX_BYTES, TILE * BOX_BYTES, 8 * BOX_BYTES), 1);
            splitkv::wgmma_commit();
            splitkv::wgmma_wait<0>();
            splitkv::fence_accumulators(o);
        } else {
#pragma unroll
            for (int kt = 0; kt < TILE / 16; ++kt) {
                const u32 pa0 = E::pack(s[2 * kt][0], s[2 * kt][1]);
                const u32 pa2 = E::pack(s[2 * kt + 1][0], s[2 * kt + 1][1]);
                const u32 pa1 = ROWS16 ? E::pack(s[2 * kt][2], s[2 * kt][3]) : 0u;
                const u32 pa3 = ROWS16 ? E::pack(s[2 * kt + 1][2], s[2 * kt + 1][3]) : 0u;
                const u32 pa[4] = {pa0, pa1, pa2, pa3};
                const int mi = lane / 8;
                const int vr = kt * 16 + (mi & 1) * 8 + lane % 8;
                auto mma_pv = [&](int nd, u32 b0, u32 b1) {  // O[:, n-block nd] += P x (b0, b1)
                    if (ROWS16) {
                        splitkv::mma<mma_t>(o[nd], pa, b0, b1);
                    } else {
                        float d[2] = {o[nd][0], o[nd][1]};
                        splitkv::mma_rows8<mma_t>(d, pa0, pa2, b0, b1);
                        o[nd][0] = d[0];
                        o[nd][1] = d[1];
                    }
                };
                // b[0], b[1]: tokens 2(lane%4) (+1) and + 8 of chunk 2 cg; b[2], b[3]: of chunk 2 cg + 1.
#pragma unroll
                for (int cg = 0; cg < ROW_BYTES / 32; ++cg) {
                    u32 b[4];
                    splitkv::ldmatrix_x4_trans(b, kv_at(v_tile, vr, cg * 32 + (mi >> 1) * 16));
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if constexpr (!QUANTIZED) {
                            mma_pv(2 * cg + h, b[2 * h], b[2 * h + 1]);
                        } else {  // pair j of chunk c feeds accumulator c W + j (o_dim)
                            u32 x0[W], x1[W];
                            unpack_v(b[2 * h], x0, v_tile, kt * 16 + qc, 2 * cg + h);
                            unpack_v(b[2 * h + 1], x1, v_tile, kt * 16 + 8 + qc, 2 * cg + h);
#pragma unroll
                            for (int j = 0; j < W; ++j) mma_pv((2 * cg + h) * W + j, x0[j], x1[j]);
                        }
                    }
                }
            }
        }
    }

    // The lanes that share a row (query head) hold parts of its sum: added up in place, before the
    // state is stored (and then only reset or stored).
    __device__ __forceinline__ void sum_lanes() {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int mask = MMA_TOKENS ? 4 : 1; mask <= (MMA_TOKENS ? 16 : 2); mask *= 2)
                l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], mask);
        }
    }
    // The warp's part of `states`: its rows from `row0` on (its row slice's) of token stream
    // `stream`, O times `o_factor`.
    __device__ __forceinline__ void store(WarpStates states, int stream, int row0, float o_factor) const {
        [[maybe_unused]] const int lane = lane_id(), qr = lane / 4, qc = 2 * (lane % 4);
        float* warp_m = states.m();
        float* warp_l = states.l();
        float* warp_o = states.o();
        if constexpr (MMA_TOKENS) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int row = row0 + qc + j;  // query head 2(lane%4) + j
                if (row < ROWS) {
                    if (lane < 4) {
                        warp_m[WarpStates::at(stream, row)] = m_run[j];
                        warp_l[WarpStates::at(stream, row)] = l_run[j];
                    }
#pragma unroll
                    for (int mb = 0; mb < HEAD_DIM / 16; ++mb) {
                        float* dst = warp_o + ((size_t)stream * ROWS + row) * HEAD_DIM;
                        dst[o_dim(mb, qr, 2)] = o[mb][j] * o_factor;
                        dst[o_dim(mb, qr + 8, 2)] = o[mb][2 + j] * o_factor;
                    }
                }
            }
        } else {
#pragma unroll
            for (int h = 0; h < (ROWS16 ? 2 : 1); ++h) {
                const int row = row0 + qr + 8 * h;
                if (row < ROWS) {
                    if (lane % 4 == 0) {
                        warp_m[WarpStates::at(stream, row)] = m_run[h];
                        warp_l[WarpStates::at(stream, row)] = l_run[h];
                    }
#pragma unroll
                    for (int nd = 0; nd < D_BLOCKS; ++nd) {
                        float* dst = warp_o + ((size_t)stream * ROWS + row) * HEAD_DIM;
                        if constexpr (W == 1) {  // columns qc, qc + 1 are adjacent elements
                            *reinterpret_cast<float2*>(dst + nd * 8 + qc) = make_float2(o[nd][2 * h] * o_factor, o[nd][2 * h + 1] * o_factor);
                        } else {
                            dst[o_dim(nd, qc, 1)] = o[nd][2 * h] * o_factor;
                            dst[o_dim(nd, qc + 1, 1)] = o[nd][2 * h + 1] * o_factor;
                        }
                    }
                }
            }
        }
    }
};
}  // namespace
}  // namespace splitkv::decode
