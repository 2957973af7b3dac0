"""Statistics of timed calls: percentiles, the summary every figure carries, and GB/s.

Pure Python: no GPU, no NumPy, so that the benchmark's and the tuner's figures are reduced by the
same code and tested on CPU.
"""

from __future__ import annotations

import math


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (NumPy's
    default, 'linear')."""
    data = sorted(float(v) for v in values)
    if not data:
        raise ValueError("percentile: no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values) -> float:
    return percentile(values, 50.0)


def summarize(times_us) -> dict:
    """Median, p10, p90, min, mean and count of a list of per-call times in microseconds."""
    data = [float(t) for t in times_us]
    if not data:
        raise ValueError("summarize: no timings")
    return {
        "median_us": percentile(data, 50.0),
        "p10_us": percentile(data, 10.0),
        "p90_us": percentile(data, 90.0),
        "min_us": min(data),
        "mean_us": sum(data) / len(data),
        "n": len(data),
    }


def gbps(nbytes: int, time_us: float) -> float:
    """Decimal GB/s (1e9 bytes per second), the unit of the reference tables."""
    return nbytes / (time_us * 1e-6) / 1e9
