// Device primitives shared by the splitkv programs: asynchronous 16-byte copies, ldmatrix,
// the m16n8k16 tensor-core MMA for bf16 and fp16, packing and conversion, a fast exp2.
// Plain CUDA; the programs that include this pick element types with C++ templates.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef INFINITY  // NVRTC has no <cmath>
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif

namespace splitkv {

// NVRTC ships no <cstdint>; the programs only need this one fixed-width type.
using u32 = unsigned int;
static_assert(sizeof(u32) == 4, "u32 is 32 bits");

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that bypasses L1 (K/V are streamed once). src_bytes = 0 reads
// nothing and zero-fills: rows past the end of a sequence become zeros, never stale data.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(src_bytes));
}
// The same for N = 4, 8 or 16 bytes through L1 (the .cg form takes 16 only): NVFP4 block scales.
template <int N>
__device__ __forceinline__ void cp_async_small(void* smem_dst, const void* gmem_src, int src_bytes) {
    static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                 :: "r"(smem_addr(smem_dst)), "l"(gmem_src), "n"(N), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// Barriers for the copy engine's copies (sm_90+): a tensor copy counts the bytes it lands on an
// mbarrier, and a waiter sees them once the barrier's phase completes. No registers or per-16-byte
// instructions are spent on the stream.
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes initialised barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces `bytes` more bytes the phase must receive before it completes.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// The barrier counts an arrival once every cp.async this thread issued before has landed; the
// arrival was counted in the barrier's expected count at init (noinc).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
// A tensor map (CUtensorMap) as the host encodes it: 128 opaque bytes, 64-byte aligned. Passed to
// the kernel by value as a __grid_constant__ parameter, so its address is a valid TMA operand.
struct alignas(64) TensorMap {
    unsigned long long words[16];
};
// One box of a 2-D tensor, starting at element (c0 = column, c1 = row), into shared memory, its
// bytes counted on `bar`. Rows past the tensor's end arrive as zeros (and are counted too).
__device__ __forceinline__ void tensor_copy_2d_to_smem(void* smem_dst, const TensorMap* map, int c0, int c1,
                                                       unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(smem_addr(smem_dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(bar)) : "memory");
}
// Orders this thread's plain shared-memory writes before later copy-engine copies into the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four 8x8 b16 matrices; lane i supplies the row address of matrix i/8, row i%8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// Transposes an 8x8 b16 matrix held one packed pair per lane (lane l: row l/4, columns 2(l%4)
// and 2(l%4)+1, as ldmatrix delivers it): an accumulator fragment becomes an operand fragment.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Thread-block clusters (sm_90+): rank in the cluster, a split cluster barrier (arrive early,
// wait late), and stores into a partner CTA's shared memory.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}
// Relaxed: orders nothing by itself; a fence.mbarrier_init before it publishes barrier inits.
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}
__device__ __forceinline__ u32 cluster_map(const void* local, unsigned rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    return remote;
}
// Stores `value` at `local`'s address in CTA `rank` and counts its 4 bytes on that CTA's barrier at
// `bar`'s address (complete_tx): the barrier's phase completes once every byte it expects has
// landed, so the sender needs neither a fence nor an arrival of its own.
__device__ __forceinline__ void store_async_to_cluster_rank(float* local, unsigned rank, float value,
                                                           unsigned long long* bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n"
                 :: "r"(cluster_map(local, rank)), "f"(value), "r"(cluster_map(bar, rank)) : "memory");
}
// The same for four floats at a 16-byte aligned `local`: one transaction instead of four.
__device__ __forceinline__ void store4_async_to_cluster_rank(float* local, unsigned rank, float4 value,
                                                            unsigned long long* bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
                 :: "r"(cluster_map(local, rank)), "f"(value.x), "f"(value.y), "f"(value.z), "f"(value.w),
                    "r"(cluster_map(bar, rank)) : "memory");
}
// Waits for the phase of parity `parity` to complete, acquiring what its arrivals released.
__device__ __forceinline__ void mbarrier_wait_cluster_acquire(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}

// Device-scope atomic add with acquire-release ordering; returns the old value.
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* address, int value) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(address), "r"(value) : "memory");
    return old;
}

// max(a, b), NaN when either is NaN (fmaxf drops a NaN): the merges' max over log-sum-exps, so that
// a row whose partials are all NaN stays NaN rather than reading as empty.
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float y;
    asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(y) : "f"(a), "f"(b));
    return y;
}

// 2^x on the special-function unit; 2^-inf = +0, which the online softmax relies on.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// NVRTC ships no <type_traits>; the programs only need this one.
template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

// Element-type traits: conversion to/from float, packing pairs, and the PTX name of the type as
// an MMA operand.
template <typename T> struct Elem;

template <> struct Elem<__nv_bfloat16> {
    static __host__ __device__ constexpr bool is_bf16() { return true; }
    static __device__ __forceinline__ __nv_bfloat16 from_bits(unsigned bits) { return __ushort_as_bfloat16((unsigned short)bits); }
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<u32*>(&v);
    }
};

template <> struct Elem<__half> {
    static __host__ __device__ constexpr bool is_bf16() { return false; }
    static __device__ __forceinline__ __half from_bits(unsigned bits) { return __ushort_as_half((unsigned short)bits); }
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<u32*>(&v);
    }
};

// The m16n8k16 MMA with fp32 accumulators for operands of type AB ("bf16" or "f16"); PTX names
// the type inside the instruction, so the two types differ only in this string.
#define SPLITKV_MMA_16816(AB) "mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 "

// D = A(16x16, row) * B(16x8, col) + D: d0,d1 hold row lane/4, d2,d3 row lane/4 + 8.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#define SPLITKV_MMA_FULL(AB)                                                              \
    asm volatile(SPLITKV_MMA_16816(AB) "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
    if constexpr (Elem<T>::is_bf16()) SPLITKV_MMA_FULL("bf16"); else SPLITKV_MMA_FULL("f16");
#undef SPLITKV_MMA_FULL
}

// The same MMA when only rows 0..7 carry data (group size <= 8): the upper accumulators are
// throw-away PTX registers, so they never occupy registers across loop iterations.
template <typename T>
__device__ __forceinline__ void mma_rows8(float (&d)[2], u32 a0, u32 a2, u32 b0, u32 b1) {
#define SPLITKV_MMA_ROWS8(AB)                                                             \
    asm volatile("{\n.reg .f32 hi0, hi1;\n" SPLITKV_MMA_16816(AB)                         \
                 "{%0,%1,hi0,hi1}, {%2,%3,%4,%3}, {%5,%6}, {%7,%8,%9,%9};\n}\n"            \
                 : "=f"(d[0]), "=f"(d[1])                                                 \
                 : "r"(a0), "r"(0u), "r"(a2), "r"(b0), "r"(b1), "f"(d[0]), "f"(d[1]), "f"(0.f))
    if constexpr (Elem<T>::is_bf16()) SPLITKV_MMA_ROWS8("bf16"); else SPLITKV_MMA_ROWS8("f16");
#undef SPLITKV_MMA_ROWS8
}

// ---- warpgroup MMAs (sm_90a: wgmma.mma_async) ------------------------------------------------
// A shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format") of an operand laid out in
// 128-byte swizzle atoms (8 rows x 128 bytes, as the tensor maps' SWIZZLE_128B writes them): start
// address, leading and stride byte offsets in 16-byte units, layout type 1 (128-byte swizzle). The
// atoms start on 1024-byte boundaries, so the base offset is 0.
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(const void* p, u32 leading_bytes, u32 stride_bytes) {
    return (unsigned long long)((smem_addr(p) & 0x3ffffu) >> 4) | ((unsigned long long)(leading_bytes >> 4) << 16)
           | ((unsigned long long)(stride_bytes >> 4) << 32) | (1ull << 62);
}
// Registers an MMA reads or accumulates into were written before: ordered before the warpgroup's MMAs.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// The accumulators an MMA in flight writes: the compiler may not move their reads or writes across
// this point (the asynchronous MMA's asm statement names them, but its wait does not).
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j]) :: "memory");
}

}  // namespace splitkv
