// Quantized K/V formats (see splitkv/kv_formats.py for the exact layouts): FP8 E4M3 elements, and
// NVFP4 (E2M1 elements two per byte, element 2i in the low nibble, with an E4M3 scale per 16).
// Encoders round to nearest-even and saturate, exactly as the NumPy reference does.
#pragma once
#include <cuda_fp8.h>

namespace splitkv {

// The E4M3 code the quantizers write for a non-finite input (NaN; E4M3 "fn" has no infinity).
constexpr unsigned char E4M3_NAN = 0x7f;

__device__ __forceinline__ unsigned char encode_e4m3(float y) {
    return static_cast<unsigned char>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
}

// Two finite floats as E4M3 codes, the first in the low byte.
__device__ __forceinline__ unsigned short encode_e4m3x2(float lo, float hi) {
    return static_cast<unsigned short>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// An E4M3 code's value; exact (every E4M3 value is an FP16 value).
__device__ __forceinline__ float decode_e4m3(unsigned char code) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3)));
}

// The E2M1 code (sign in bit 3) of finite y: nearest of +-{0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the
// even code (the one whose mantissa bit is 0), saturating at 6. Each comparison is one of the
// seven boundaries between neighbouring values; a tie belongs to the even side.
__device__ __forceinline__ u32 encode_e2m1(float y) {
    const float a = fabsf(y);
    const u32 magnitude = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return magnitude | (signbit(y) ? 8u : 0u);
}

// ---- dequantizing K/V words into fp16 MMA operands ------------------------------------------
// A 32-bit word of K/V (as ldmatrix delivers it) unpacks into 16 / bits packed fp16 pairs out[j],
// each two elements of the word (which two, per format, below); the decode programs gather Q in
// the matching order, so the pairs need no further shuffling. Values come out exact, times a power
// of two (E2M1_UNIT for NVFP4, 1 for FP8) that the programs fold into their fp32 scales.

// FP8: out[j] = elements (2j, 2j + 1). One hardware conversion per pair (sm_89+), NaN kept.
__device__ __forceinline__ void unpack_e4m3x4(u32 w, u32 (&out)[2]) {
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(out[0]), "=r"(out[1]) : "r"(w));
}

// NVFP4 values: out[j] = elements (j, j + 4), nibble j being bits 4j..4j+3.
#if SPLITKV_HARDWARE_E2M1
// Bytes (n0 | n4 << 4, n2 | n6 << 4) and (n1 | n5 << 4, n3 | n7 << 4), each converted in hardware.
constexpr float E2M1_UNIT = 1.f;
__device__ __forceinline__ void unpack_e2m1x8(u32 w, u32 (&out)[4]) {
    const u32 even = (w & 0x0f0f0f0fu) | ((w >> 12) & 0xf0f0f0f0u);
    const u32 odd = ((w >> 4) & 0x0f0f0f0fu) | ((w >> 16) & 0xf0f0f0f0u);
    asm("{\n.reg .b8 e0, e1, e2, e3, o0, o1, o2, o3;\n"
        "mov.b32 {e0, e1, e2, e3}, %4;\nmov.b32 {o0, o1, o2, o3}, %5;\n"
        "cvt.rn.f16x2.e2m1x2 %0, e0;\ncvt.rn.f16x2.e2m1x2 %1, o0;\n"
        "cvt.rn.f16x2.e2m1x2 %2, e1;\ncvt.rn.f16x2.e2m1x2 %3, o1;\n}\n"
        : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3]) : "r"(even), "r"(odd));
}
#else
// No E2M1 conversion below sm_100a: each nibble's sign and (e1 e0 m) bits are moved into an E4M3
// byte (sign at bit 7, e1 e0 m at bits 4..2), which is e2m1 x 2^-6 exactly, the subnormal 0.5
// included, and the E4M3 bytes are converted in hardware. The bytes are first put in the order
// (n0 n1 n4 n5 n2 n3 n6 n7), so that the low nibbles give pairs (n0, n4), (n2, n6) and the high
// ones (n1, n5), (n3, n7). H200, 32/8 64k on 64 CTAs: 61.2 us against 64.1 with integer ops
// alone (bench/ablate.py): the conversion pipe takes work off the integer one.
constexpr float E2M1_UNIT = 1.f / 64.f;
__device__ __forceinline__ void unpack_e2m1x8(u32 w, u32 (&out)[4]) {
    const u32 p = __byte_perm(w, 0u, 0x3120);
    u32 pair[2];
    unpack_e4m3x4(((p << 4) & 0x80808080u) | ((p << 2) & 0x1c1c1c1cu), pair);  // low nibbles n0 n4 n2 n6
    out[0] = pair[0];
    out[2] = pair[1];
    unpack_e4m3x4((p & 0x80808080u) | ((p >> 2) & 0x1c1c1c1cu), pair);  // high nibbles n1 n5 n3 n7
    out[1] = pair[0];
    out[3] = pair[1];
}
#endif

// Two E4M3 codes, byte `lo_sel` of `lo` and byte `hi_sel` of `hi`, as an fp16 pair (NaN kept).
__device__ __forceinline__ u32 e4m3_pair(u32 lo, u32 hi, u32 lo_sel, u32 hi_sel) {
    const u32 two = __byte_perm(lo, hi, lo_sel | ((hi_sel + 4) << 4));
    u32 out;
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(out) : "r"(two));
    return out;
}

__device__ __forceinline__ u32 hmul2_bits(u32 a, u32 b) {
    __half2 x = *reinterpret_cast<__half2*>(&a), y = *reinterpret_cast<__half2*>(&b);
    __half2 p = __hmul2(x, y);
    return *reinterpret_cast<u32*>(&p);
}

}  // namespace splitkv
