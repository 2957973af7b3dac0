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

}  // namespace splitkv
