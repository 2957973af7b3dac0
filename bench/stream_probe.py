"""Probe: how fast can the decode program's stream alone go? (no softmax, no MMA, no merge)

K and V of [L, H, 128] bf16 (random), 128 CTAs = (K/V head, split), four warps each streaming
every fourth 32-token tile through a two-stage ring in shared memory, timed like the benchmark
(256 MiB memset before each call, CUDA events, median, variants in rotating order) next to the
read floor. Variants: per-lane 16-byte cp.async (the decode's kv_copy='cp_async'), and tensor-map
boxes (kv_copy='tma') with and without the 128-byte swizzle and with each L2 promotion.

    python bench/stream_probe.py L H      e.g. 65536 8, 131072 8, 65536 32
"""
import sys, statistics, itertools
import numpy as np, cupy as cp

SRC = r"""
__device__ __forceinline__ void cp16(void* s, const void* g) {
  unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(g) : "memory"); }
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// CTA blockIdx.x streams one K/V head over one split (ORDER 0: consecutive CTAs take the heads of
// one split; 1: the splits of one head); its warp w takes tiles w, w + WARPS, ...
struct Share { int head, begin, my_tiles; };
__device__ __forceinline__ Share share_of(int H, int tokens_per_split, int warp) {
  const int S = gridDim.x / H;
  const int head = ORDER ? blockIdx.x / S : blockIdx.x % H, split = ORDER ? blockIdx.x % S : blockIdx.x / H;
  const int tiles = tokens_per_split / TILE;
  return {head, split * tokens_per_split, (tiles - warp + WARPS - 1) / WARPS};
}

// K, V: [L, H, 128] bf16 (as 16-bit words).
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) ring_read(const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v, int H, int tokens_per_split, unsigned* sink, int spin) {
  constexpr int D = 128, ROW = D + 8, TILE_ELEMS = TILE * ROW, CH = D / 8;  // 16-byte chunks per row
  constexpr int LOADS = TILE * CH / 32;
  extern __shared__ __align__(16) unsigned short smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Share share = share_of(H, tokens_per_split, warp);
  const int head = share.head, begin = share.begin, my_tiles = share.my_tiles;
  unsigned short* ring = smem + warp * STAGES * 2 * TILE_ELEMS;
  const size_t ts = (size_t)H * D;
  const unsigned short* kh = k + (size_t)head * D;
  const unsigned short* vh = v + (size_t)head * D;
  auto load = [&](int t) {
    if (t < my_tiles) {
      const int first = begin + (warp + t * WARPS) * TILE;
      unsigned short* kt = ring + (t % STAGES) * 2 * TILE_ELEMS;
      unsigned short* vt = kt + TILE_ELEMS;
#pragma unroll
      for (int i = 0; i < LOADS; ++i) { int c = lane + 32 * i, r = c / CH, col = (c % CH) * 8;
        cp16(kt + r * ROW + col, kh + (size_t)(first + r) * ts + col); }
      commit();
#pragma unroll
      for (int i = 0; i < LOADS; ++i) { int c = lane + 32 * i, r = c / CH, col = (c % CH) * 8;
        cp16(vt + r * ROW + col, vh + (size_t)(first + r) * ts + col); }
      commit();
    } else { commit(); commit(); }
  };
  unsigned acc = 0;
  if (MODE == 1) {  // plain loads into registers, a whole tile (K and V) in flight per warp
    for (int t = 0; t < my_tiles; ++t) {
      const int first = begin + (warp + t * WARPS) * TILE;
      uint4 a[LOADS], b[LOADS];
#pragma unroll
      for (int i = 0; i < LOADS; ++i) { int c = lane + 32 * i, r = c / CH, col = (c % CH) * 8;
        a[i] = __ldcs(reinterpret_cast<const uint4*>(kh + (size_t)(first + r) * ts + col));
        b[i] = __ldcs(reinterpret_cast<const uint4*>(vh + (size_t)(first + r) * ts + col)); }
#pragma unroll
      for (int i = 0; i < LOADS; ++i) acc ^= a[i].x ^ a[i].w ^ b[i].y ^ b[i].z;
    }
    if (acc == 0x12345u) sink[blockIdx.x] = acc;
    return;
  }
#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) load(t);
  for (int t = 0; t < my_tiles; ++t) {
    load(t + STAGES - 1);
    wait<2 * STAGES - 2>();
    __syncwarp();
    const unsigned short* kt = ring + (t % STAGES) * 2 * TILE_ELEMS;
    acc += kt[lane * ROW / 4] ^ kt[TILE_ELEMS + lane];
    if (spin) { long long t0 = clock64(); while (clock64() - t0 < spin) {} }
    __syncwarp();
  }
  wait<0>();
  if (acc == 0x12345u) sink[blockIdx.x] = acc;
}

__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;"
               :: "r"((unsigned)__cvta_generic_to_shared(b)), "r"(n) : "memory"); }
__device__ __forceinline__ void mbar_expect(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"((unsigned)__cvta_generic_to_shared(b)), "r"(bytes) : "memory"); }
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
  asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}"
               :: "r"((unsigned)__cvta_generic_to_shared(b)), "r"(parity) : "memory"); }
__device__ __forceinline__ void tma2d(void* dst, const void* map, int c0, int c1, unsigned long long* bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
    :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(map), "r"(c0), "r"(c1),
       "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory"); }

// maps: two CUtensorMaps (K, V) of [L rows][H*128] bf16, box {128, TILE}, in global memory.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) tma_read(const unsigned char* __restrict__ maps, int H,
    int tokens_per_split, unsigned* sink) {
  constexpr int D = 128, TILE_ELEMS = TILE * D;
  extern __shared__ __align__(1024) unsigned short smem2[];
  unsigned short* smem = smem2;
  __shared__ unsigned long long bars[WARPS][STAGES];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Share share = share_of(H, tokens_per_split, warp);
  const int head = share.head, begin = share.begin, my_tiles = share.my_tiles;
  unsigned short* ring = smem + warp * STAGES * 2 * TILE_ELEMS;
  if (lane < STAGES) mbar_init(&bars[warp][lane], 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  auto load = [&](int t) {
    if (t < my_tiles && lane == 0) {
      const int first = begin + (warp + t * WARPS) * TILE;
      unsigned short* kt = ring + (t % STAGES) * 2 * TILE_ELEMS;
      unsigned long long* b = &bars[warp][t % STAGES];
      mbar_expect(b, 2 * TILE_ELEMS * 2);
#pragma unroll
      for (int h = 0; h < D / BOXW; ++h) {
        tma2d(kt + h * TILE * BOXW, maps, head * D + h * BOXW, first, b);
        tma2d(kt + TILE_ELEMS + h * TILE * BOXW, maps + 128, head * D + h * BOXW, first, b); }
    }
  };
#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) load(t);
  unsigned acc = 0;
  for (int t = 0; t < my_tiles; ++t) {
    load(t + STAGES - 1);
    mbar_wait(&bars[warp][t % STAGES], (t / STAGES) & 1);
    const unsigned short* kt = ring + (t % STAGES) * 2 * TILE_ELEMS;
    acc += kt[lane * D / 4] ^ kt[TILE_ELEMS + lane];
    __syncwarp();
  }
  if (acc == 0x12345u) sink[blockIdx.x] = acc;
}
"""


def defines(**values) -> str:
    return "".join(f"#define {name} {value}\n" for name, value in values.items())


def encode_map(ptr, rows, cols, box_cols, box_rows, swz=0, prom=2):
    """A CUtensorMap for a row-major bf16 [rows][cols] matrix, box {box_cols, box_rows}."""
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    m = (ctypes.c_uint8 * 128)()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols * 2)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    es = (ctypes.c_uint32 * 2)(1, 1)
    f = lib.cuTensorMapEncodeTiled
    f.restype = ctypes.c_int
    r = f(m, 9, 2, ctypes.c_void_p(ptr), dims, strides, box, es, 0, swz, prom, 0)
    assert r == 0, r
    return bytes(m)


def main():
    L, H = int(sys.argv[1]), int(sys.argv[2])
    D = 128
    nbytes = L * H * D * 2
    rng = cp.random.default_rng(1)
    k = rng.integers(0, 2**16, size=L * H * D, dtype=cp.int32).astype(cp.uint16)
    v = rng.integers(0, 2**16, size=L * H * D, dtype=cp.int32).astype(cp.uint16)
    flush = cp.empty(512 << 20, dtype=cp.uint8)
    sink = cp.zeros(4096, dtype=cp.uint32)
    from splitkv.timing import ReadFloor
    rf = ReadFloor(2 * nbytes).reader(2 * nbytes)
    configs = []
    variants = {"floor": lambda: rf()}
    # mode 0: per-lane cp.async ring; mode 1: plain loads into registers, a whole tile in flight per warp
    for warps, tile, stages, mode, order, h in [(4, 32, 2, 0, 1, 8), (4, 32, 2, 1, 1, 8), (8, 16, 2, 1, 1, 8)]:
        smem = warps * stages * 2 * tile * (D + 8) * 2 if mode == 0 else 0
        src = defines(BOXW=64, WARPS=warps, TILE=tile, STAGES=stages, MODE=mode, ORDER=order) + SRC
        f = cp.RawModule(code=src, options=("-std=c++17",)).get_function("ring_read")
        if smem > 48 * 1024:
            f.max_dynamic_shared_size_bytes = smem
        name = f"{'cp.async' if mode == 0 else 'registers'} {warps}w x {tile} x {stages}st order {order}"
        def launch(f=f, smem=smem, warps=warps):
            f((128,), (32 * warps,), (k, v, cp.int32(H), cp.int32(L * H // 128), sink, cp.int32(0)), shared_mem=smem)
        variants[name] = launch
    # (warps, tile, stages, order, box width, swizzle: 0 none / 3 128B, L2 promotion: 0 none / 2 128B / 3 256B)
    for warps, tile, stages, order, boxw, swz, prom in [(4, 32, 2, 1, 128, 0, 2), (4, 32, 2, 1, 64, 3, 3),
                                                        (4, 32, 2, 1, 64, 3, 2), (4, 32, 2, 1, 64, 3, 0),
                                                        (4, 32, 2, 0, 64, 3, 3), (4, 32, 3, 1, 64, 3, 3)]:
        smem = warps * stages * 2 * tile * D * 2
        if smem > 227 * 1024:
            continue
        src = defines(BOXW=boxw, WARPS=warps, TILE=tile, STAGES=stages, MODE=0, ORDER=order) + SRC
        f = cp.RawModule(code=src, options=("-std=c++17",)).get_function("tma_read")
        f.max_dynamic_shared_size_bytes = smem + 1024
        both = b"".join(encode_map(t.data.ptr, L, H * D, boxw, tile, swz, prom) for t in (k, v))
        maps = cp.asarray(np.frombuffer(both, dtype=np.uint8))
        name = f"TMA {warps}w x {tile} x {stages}st order {order} box {boxw} swz {swz} prom {prom}"
        def launch(f=f, smem=smem, maps=maps, warps=warps):
            f((128,), (32 * warps,), (maps, cp.int32(H), cp.int32(L * H // 128), sink), shared_mem=smem + 1024)
        variants[name] = launch
    names = list(variants)
    times = {n: [] for n in names}
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    for it in range(30):
        order = names[it % len(names):] + names[:it % len(names)]
        for n in order:
            flush.fill(it & 0xff)
            e0.record(); variants[n](); e1.record(); e1.synchronize()
            times[n].append(cp.cuda.get_elapsed_time(e0, e1) * 1000)
    for n in names:
        print(f"{n:28s} {statistics.median(times[n]):7.2f} us", flush=True)

if __name__ == "__main__":
    main()
