// The K/V quantizer (configured by quantize.cu.j2). Bit-exact with
// splitkv.kv_formats.quantize_reference: every float operation below is an IEEE-rounded float32
// operation that the reference performs in the same order.
#pragma once

namespace splitkv::quantize {
constexpr int GROUP = 16;                          // elements per thread
constexpr int GROUPS = HEAD_DIM / GROUP;           // per token row of one head
constexpr int VALUE_BYTES = NVFP4 ? HEAD_DIM / 2 : HEAD_DIM;  // stored bytes per token row
constexpr float E2M1_MAX = 6.0f;
// status bits, ORed in by any thread that sees the case
constexpr int NONFINITE_INPUT = 1;
constexpr int POSITION_OUT_OF_RANGE = 2;
constexpr int PAGE_OUT_OF_RANGE = 4;
static_assert(HEAD_DIM % GROUP == 0, "head_dim must be a multiple of 16");
}  // namespace splitkv::quantize

extern "C" __global__ void __launch_bounds__(splitkv::quantize::THREADS)
splitkv_quantize(const __grid_constant__ splitkv::quantize::Params p) {
    using namespace splitkv::quantize;
    // The fields as restrict-qualified locals, as the kernel's arguments were before it took one struct.
    const in_t* __restrict__ x = p.x;                     // [batch][tokens][num_kv_heads][HEAD_DIM]
    unsigned char* __restrict__ values = p.values;        // [batch][cache_len][num_kv_heads][VALUE_BYTES], or pages
    unsigned char* __restrict__ block_scales = p.block_scales;  // nvfp4: [batch][cache_len][num_kv_heads][GROUPS], or pages
    const float* __restrict__ scale = p.scale;            // [1], or [num_kv_heads] when per_head
    const int* __restrict__ positions = p.positions;      // [batch]: cache row of each sequence's first token, or null: 0
    int* __restrict__ status = p.status;                  // bits NONFINITE_INPUT, POSITION_OUT_OF_RANGE, PAGE_OUT_OF_RANGE
    const long long num_groups = p.num_groups;
    const int tokens = p.tokens, num_kv_heads = p.num_kv_heads, cache_len = p.cache_len, per_head = p.per_head;
    // Paged caches (page_size > 0): [num_pages][page_size][num_kv_heads] rows, or
    // [num_pages][num_kv_heads][page_size] (hnd); position q of sequence b is row q % page_size of
    // page block_table[b][q / page_size] (cache_len = table_stride x page_size).
    const int* __restrict__ block_table = p.block_table;
    const int table_stride = p.table_stride, page_size = p.page_size, hnd = p.hnd, num_pages = p.num_pages;
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= num_groups) return;
    const int group = (int)(g % GROUPS);
    const long long row = g / GROUPS;  // (batch, token, head) in x's order
    const int head = (int)(row % num_kv_heads);
    const int token = (int)(row / num_kv_heads % tokens);
    const long long batch = row / num_kv_heads / tokens;
    const int position = (positions ? positions[batch] : 0) + token;
    if (position < 0 || position >= cache_len) {
        atomicOr(status, POSITION_OUT_OF_RANGE);
        return;
    }
    long long out_row = (batch * cache_len + position) * num_kv_heads + head;
    if (page_size > 0) {
        const int page = block_table[batch * table_stride + position / page_size];
        if (page < 0 || page >= num_pages) {
            atomicOr(status, PAGE_OUT_OF_RANGE);
            return;
        }
        const int row_in_page = position % page_size;
        out_row = hnd ? ((long long)page * num_kv_heads + head) * page_size + row_in_page
                      : ((long long)page * page_size + row_in_page) * num_kv_heads + head;
    }

    // 16 inputs: two 16-byte loads.
    float v[GROUP];
    const uint4* src = reinterpret_cast<const uint4*>(x + row * HEAD_DIM + group * GROUP);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const uint4 raw = src[half];
        const in_t* e = reinterpret_cast<const in_t*>(&raw);
        #pragma unroll
        for (int i = 0; i < 8; ++i) v[half * 8 + i] = static_cast<float>(e[i]);
    }
    bool finite = true;
    #pragma unroll
    for (int i = 0; i < GROUP; ++i) finite &= isfinite(v[i]);
    if (!finite) atomicOr(status, NONFINITE_INPUT);
    const float s = scale[per_head ? head : 0];

    if constexpr (!NVFP4) {
        // FP8: x x (1 / scale), rounded to nearest-even and saturated; a non-finite input becomes
        // NaN. One division per thread, not one per element: sixteen IEEE divisions made the
        // quantizer issue-bound (NVFP4 whole caches ran at 34% of the copy bandwidth).
        const float inv = __fdiv_rn(1.0f, s);
        splitkv::u32 word[GROUP / 4];
        #pragma unroll
        for (int i = 0; i < GROUP; i += 2) {
            unsigned short pair = splitkv::encode_e4m3x2(__fmul_rn(v[i], inv), __fmul_rn(v[i + 1], inv));
            if (!isfinite(v[i])) pair = (pair & 0xff00) | splitkv::E4M3_NAN;
            if (!isfinite(v[i + 1])) pair = (pair & 0x00ff) | (splitkv::E4M3_NAN << 8);
            if (i % 4 == 0) word[i / 4] = pair;
            else word[i / 4] |= (splitkv::u32)pair << 16;
        }
        *reinterpret_cast<uint4*>(values + out_row * VALUE_BYTES + group * GROUP) =
            make_uint4(word[0], word[1], word[2], word[3]);
    } else {
        // NVFP4: the block's scale is its largest magnitude over 6, in units of the scale, as E4M3;
        // the elements are multiplied by 1 / (block scale x scale) and rounded to E2M1. A block
        // with a non-finite element gets the NaN block scale and zero elements.
        float amax = 0.0f;
        #pragma unroll
        for (int i = 0; i < GROUP; ++i) amax = fmaxf(amax, fabsf(v[i]));
        unsigned char block = splitkv::encode_e4m3(__fdiv_rn(amax, __fmul_rn(E2M1_MAX, s)));
        const float divisor = __fmul_rn(splitkv::decode_e4m3(block), s);
        const float inv = finite && divisor > 0.0f ? __fdiv_rn(1.0f, divisor) : 0.0f;
        splitkv::u32 lo = 0, hi = 0;  // elements 0..7 and 8..15, element 2i in the low nibble of byte i
        #pragma unroll
        for (int i = 0; i < GROUP; ++i) {
            const float y = finite ? __fmul_rn(v[i], inv) : 0.0f;  // NaN x 0 would be NaN
            const splitkv::u32 code = splitkv::encode_e2m1(y) << (4 * (i % 8));
            if (i < 8) lo |= code;
            else hi |= code;
        }
        if (!finite) block = splitkv::E4M3_NAN;
        *reinterpret_cast<uint2*>(values + out_row * VALUE_BYTES + group * (GROUP / 2)) = make_uint2(lo, hi);
        block_scales[out_row * GROUPS + group] = block;
    }
}
