"""Probe: does a plain read of 256 MiB go faster over 132 CTAs than over 128?

Static partitions (one contiguous share per CTA, 512 threads, UNROLL 16-byte loads in flight per
thread) over 128 and 132 CTAs, a persistent 132-CTA queue of 256 KB or 1 MB chunks, and the read
floor, timed like the benchmark (256 MiB memset before each call, CUDA events, median, rotating
order); per variant, when the first, median and last CTA finished (µs after the first started).

    python bench/partition_probe.py [UNROLL]      e.g. 4 or 8
"""
import sys, json, statistics
import numpy as np, cupy as cp

SRC = r"""
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned smid() { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }
#define U UNROLL
extern "C" __global__ void __launch_bounds__(512, 1)
static_read(const uint4* __restrict__ src, unsigned long long per_cta,
    unsigned long long n_vec, unsigned* sink, unsigned long long* stamps) {
  unsigned long long t0 = gtime();
  unsigned long long b = blockIdx.x * per_cta, e = min(b + per_cta, n_vec);
  unsigned acc = 0; unsigned long long bd = blockDim.x;
  unsigned long long i = b + threadIdx.x;
  for (; i + (U - 1) * bd < e; i += U * bd) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldcs(src + i + u * bd);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < e; i += bd) { uint4 a = src[i]; acc ^= a.x ^ a.y ^ a.z ^ a.w; }
  acc = __reduce_xor_sync(0xffffffffu, acc);
  __shared__ unsigned w[16];
  if ((threadIdx.x & 31) == 0) w[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) { unsigned t = 0; for (int k = 0; k < blockDim.x / 32; ++k) t ^= w[k]; sink[blockIdx.x] = t;
    stamps[3 * blockIdx.x] = t0; stamps[3 * blockIdx.x + 1] = gtime(); stamps[3 * blockIdx.x + 2] = smid(); }
}
// persistent: grab chunks of chunk_vec vectors from a counter; the next index is fetched one chunk ahead.
extern "C" __global__ void __launch_bounds__(512, 1)
queue_read(const uint4* __restrict__ src, unsigned long long chunk_vec,
    unsigned n_chunks, unsigned* counter, unsigned* sink, unsigned long long* stamps) {
  unsigned long long t0 = gtime();
  __shared__ unsigned next[2];
  if (threadIdx.x == 0) { next[0] = atomicAdd(counter, 1u); }
  __syncthreads();
  unsigned cur = next[0]; int k = 0;
  unsigned acc = 0; unsigned long long bd = blockDim.x; unsigned nd = 0;
  while (cur < n_chunks) {
    if (threadIdx.x == 0) next[(k + 1) & 1] = atomicAdd(counter, 1u);
    unsigned long long b = cur * chunk_vec, e = b + chunk_vec;
    for (unsigned long long i = b + threadIdx.x; i < e; i += U * bd) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldcs(src + i + u * bd);
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    ++nd;
    __syncthreads();
    ++k; cur = next[k & 1];
    __syncthreads();
  }
  acc = __reduce_xor_sync(0xffffffffu, acc);
  __shared__ unsigned w[16];
  if ((threadIdx.x & 31) == 0) w[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) { unsigned t = 0; for (int q = 0; q < blockDim.x / 32; ++q) t ^= w[q]; sink[blockIdx.x] = t;
    stamps[3 * blockIdx.x] = t0; stamps[3 * blockIdx.x + 1] = gtime(); stamps[3 * blockIdx.x + 2] = smid() | (nd << 16);
    if (atomicAdd(counter + 1, 1u) == gridDim.x - 1) { counter[0] = 0; counter[1] = 0; } }
}
"""

def main():
    unroll = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    nbytes = 256 << 20
    n_vec = nbytes // 16
    rng = cp.random.default_rng(1)
    src = rng.integers(0, 2**31, size=nbytes // 4, dtype=cp.int32)
    flush = cp.empty(512 << 20, dtype=cp.uint8)
    sink = cp.zeros(4096, dtype=cp.uint32)
    stamps = cp.zeros(3 * 4096, dtype=cp.uint64)
    counter = cp.zeros(2, dtype=cp.uint32)
    mod = cp.RawModule(code=SRC.replace("UNROLL", str(unroll)), options=("-std=c++17",))
    st = mod.get_function("static_read"); qu = mod.get_function("queue_read");
    variants = {}
    for grid in (128, 132):
        per = -(-n_vec // grid)
        variants[f"static {grid}"] = (st, (grid,), (512,), (src, cp.uint64(per), cp.uint64(n_vec), sink, stamps))
    for chunk_kb in (256, 1024):
        cv = chunk_kb * 1024 // 16
        variants[f"queue 132 x {chunk_kb}KB"] = (qu, (132,), (512,),
                                                 (src, cp.uint64(cv), cp.uint32(n_vec // cv), counter, sink, stamps))
    from splitkv.timing import ReadFloor
    rf = ReadFloor(nbytes).reader(nbytes)
    variants["floor"] = None
    names = list(variants)
    times = {k: [] for k in names}
    spread = {}
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    for it in range(40):
        order = names[it % len(names):] + names[:it % len(names)]
        for name in order:
            flush.fill(it & 0xff)
            if variants[name] is None:
                e0.record(); rf(); e1.record(); e1.synchronize()
                times[name].append(cp.cuda.get_elapsed_time(e0, e1) * 1000)
                continue
            f, g, b, a = variants[name]
            e0.record(); f(g, b, a); e1.record(); e1.synchronize()
            times[name].append(cp.cuda.get_elapsed_time(e0, e1) * 1000)
            if it == 39 or name not in spread:
                s = stamps[:3 * g[0]].get().reshape(-1, 3)
                t0 = s[:, 0].min()
                spread[name] = s
    print(f"{'floor':22s} {statistics.median(times['floor']):7.2f} us")
    for name in names:
        if name == "floor":
            continue
        s = spread[name]
        t0 = s[:, 0].min()
        end = (s[:, 1] - t0) / 1000
        sm = (s[:, 2] & 0xffff).astype(int)
        gp = f"{len(set(sm.tolist()))} SMs"
        extra = ""
        if "queue" in name:
            nd = (s[:, 2] >> 16).astype(int)
            extra = f" chunks per CTA {nd.min()}..{nd.max()}"
        ends = f"{end.min():.1f}/{np.median(end):.1f}/{end.max():.1f}"
        print(f"{name:22s} {statistics.median(times[name]):7.2f} us  end first/med/last {ends}  {gp}{extra}", flush=True)

if __name__ == "__main__":
    main()
