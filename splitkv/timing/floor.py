"""The read floor and the copy ceiling that decode-attention figures are judged against.

Decode attention is memory-bound, so two measurements frame every result:

* the *read floor*: how long a kernel that does nothing but stream the same number of bytes from
  device memory takes, launch included. The gap to it is the room left for improvement (a decode
  can come in under it where the floor kernel's own launch and drain cost more than its reads);
* the *copy bandwidth*: a large device-to-device ``cudaMemcpyAsync``, counted as bytes read plus
  bytes written over the time. It is the practical ceiling the "% of copy bandwidth" column uses.

The pure helpers (`vec_count`, `grid_size`, `SOURCE`) need no GPU; `ReadFloor` and `DeviceCopy`
allocate on the current CuPy device and launch on the current CuPy stream.
"""

from __future__ import annotations

THREADS = 256
#: 8 CTAs of 256 threads is 2048 threads per SM, the occupancy limit on sm_80/sm_90: every SM
#: keeps as many 16-byte loads in flight as it can.
CTAS_PER_SM = 8
#: Bytes one load moves; the kernel reads 16-byte vectors only.
VEC_BYTES = 16

READ_KERNEL = "splitkv_floor_stream_read"
EMPTY_KERNEL = "splitkv_floor_empty"

SOURCE = r"""
// Streams n_vec 16-byte vectors from src and keeps nothing but an XOR of their words. XOR is
// cheaper than any floating-point reduction and cannot trap on NaN bit patterns; writing the
// per-CTA result to sink makes every load observable, so the compiler cannot drop any of them.
extern "C" __global__ void __launch_bounds__(256)
splitkv_floor_stream_read(const uint4* __restrict__ src,
                          unsigned long long n_vec,
                          unsigned int* __restrict__ sink)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0u;

    // Four independent loads are issued before any is consumed, so a thread has 64 bytes in
    // flight; each of the four is still coalesced across the warp (consecutive lanes, consecutive
    // vectors).
    for (; i + 3 * stride < n_vec; i += 4 * stride) {
        const uint4 a = src[i];
        const uint4 b = src[i + stride];
        const uint4 c = src[i + 2 * stride];
        const uint4 d = src[i + 3 * stride];
        acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w)
             ^ (c.x ^ c.y ^ c.z ^ c.w) ^ (d.x ^ d.y ^ d.z ^ d.w);
    }
    for (; i < n_vec; i += stride) {
        const uint4 a = src[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }

    for (int offset = 16; offset > 0; offset >>= 1) {
        acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
    }
    __shared__ unsigned int warp_acc[256 / 32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_acc[warp] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int total = 0u;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
            total ^= warp_acc[w];
        }
        sink[blockIdx.x] = total;
    }
}

// The cost of a launch that does nothing: the fixed part of every short decode.
extern "C" __global__ void splitkv_floor_empty() {}
"""


def vec_count(nbytes: int) -> int:
    """16-byte vectors needed to cover ``nbytes`` (a partial last vector is read whole)."""
    if nbytes < 0:
        raise ValueError(f"nbytes: expected a non-negative int, got {nbytes!r}")
    return -(-int(nbytes) // VEC_BYTES)


def grid_size(n_vec: int, sm_count: int, ctas_per_sm: int = CTAS_PER_SM, threads: int = THREADS) -> int:
    """CTAs for a read of ``n_vec`` vectors: enough to fill every SM, but no CTA without a vector.

    CTAs that would find no work are not launched: they only add launch and drain time to small
    reads, which is exactly the regime where the floor matters most.
    """
    if sm_count <= 0:
        raise ValueError(f"sm_count: expected a positive int, got {sm_count!r}")
    needed = -(-int(n_vec) // threads)
    return max(1, min(sm_count * ctas_per_sm, needed))


def _compile(name: str):
    import cupy

    return cupy.RawKernel(SOURCE, name, options=("-std=c++17",))


def _sm_count() -> int:
    import cupy

    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def _patterned_bytes(nbytes: int):
    """A device buffer of at least ``nbytes`` bytes holding a non-constant pattern.

    Generated in place from an index ramp (no host copy, no temporary larger than the buffer), so
    that the measured traffic is the traffic of real, varying data rather than of zeros.
    """
    import cupy

    words = max(1, -(-int(nbytes) // 4))
    buf = cupy.arange(words, dtype=cupy.uint32)
    buf *= cupy.uint32(2654435761)  # Knuth's multiplicative hash: spreads the ramp over all bits
    return buf.view(cupy.uint8)


class ReadFloor:
    """Streams the first ``nbytes`` of a preallocated buffer with the floor kernel.

    ``capacity_bytes`` is the largest read that will be asked for; the buffer is allocated once.
    """

    def __init__(self, capacity_bytes: int, sm_count: int | None = None):
        import cupy

        self.sm_count = int(sm_count) if sm_count else _sm_count()
        self.capacity_vecs = max(1, vec_count(capacity_bytes))
        self._buf = _patterned_bytes(self.capacity_vecs * VEC_BYTES)
        self._sink = cupy.zeros(self.sm_count * CTAS_PER_SM, dtype=cupy.uint32)
        self._read = _compile(READ_KERNEL)
        self._empty = _compile(EMPTY_KERNEL)

    def reader(self, nbytes: int, offset: int = 0):
        """A no-argument callable that launches one read of ``nbytes`` on the current stream,
        starting ``offset`` bytes into the buffer (a multiple of 16: each layer of the serving
        protocol reads bytes of its own)."""
        import numpy

        n_vec = vec_count(nbytes)
        if offset < 0 or offset % VEC_BYTES:
            raise ValueError(f"offset: expected a non-negative multiple of {VEC_BYTES}, got {offset!r}")
        first = offset // VEC_BYTES
        if first + n_vec > self.capacity_vecs:
            raise ValueError(f"nbytes: {nbytes} at offset {offset} exceeds this floor's capacity of "
                             f"{self.capacity_vecs * VEC_BYTES} bytes")
        grid = (grid_size(n_vec, self.sm_count),)
        block = (THREADS,)
        args = (self._buf[offset:], numpy.uint64(n_vec), self._sink)
        kernel = self._read

        def launch():
            kernel(grid, block, args)

        return launch

    def empty(self):
        """A no-argument callable that launches one empty kernel (1 CTA of 32 threads)."""
        kernel = self._empty

        def launch():
            kernel((1,), (32,), ())

        return launch


class DeviceCopy:
    """One ``cudaMemcpyAsync`` device-to-device of ``nbytes`` on the current stream.

    ``bytes_moved`` counts both directions (read + written), the convention of the bandwidth
    ceiling in the benchmark tables.
    """

    def __init__(self, nbytes: int = 1 << 30):
        import cupy

        if nbytes <= 0:
            raise ValueError(f"nbytes: expected a positive int, got {nbytes!r}")
        self.nbytes = int(nbytes)
        self.bytes_moved = 2 * self.nbytes
        self._src = _patterned_bytes(self.nbytes)
        self._dst = cupy.empty(self.nbytes, dtype=cupy.uint8)

    def __call__(self):
        import cupy

        runtime = cupy.cuda.runtime
        runtime.memcpyAsync(self._dst.data.ptr, self._src.data.ptr, self.nbytes,
                            runtime.memcpyDeviceToDevice, cupy.cuda.get_current_stream().ptr)


def copy_bandwidth(harness, nbytes: int, iters: int | None = None) -> dict:
    """The copy ceiling: timings of a device-to-device copy of ``nbytes`` with the flush protocol
    of ``harness`` (`splitkv.timing.Harness`); ``gbps`` counts the bytes read and written. Its
    buffers are freed on return."""
    from .stats import gbps, summarize

    copier = DeviceCopy(nbytes)
    stats = summarize(harness.time(copier, iters))
    stats.update(bytes=copier.nbytes, bytes_moved=copier.bytes_moved, gbps=gbps(copier.bytes_moved, stats["median_us"]))
    return stats
