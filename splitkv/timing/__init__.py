"""The measuring primitives of the benchmark and the tuner.

* `Harness` (`events`): one stream shared by CuPy and torch, CUDA events around each call, the L2
  flushed before each (the flush protocol);
* `capture_graph`, `time_replays`, `time_back_to_back` (`sequences`): a sequence of calls, one per
  layer, in a CUDA graph (the serving protocol) or from the host (the eager protocol);
* `ReadFloor`, `DeviceCopy`, `copy_bandwidth` (`floor`): the read floor and the copy ceiling;
* `percentile`, `median`, `summarize`, `gbps` (`stats`);
* `gpu_info` (`device`) and `random_bf16` (`inputs`).

This package imports nothing else of splitkv: the runtime, the tuner and the benchmark all sit
above it. CuPy and torch are imported only when something is measured.
"""

from .device import gpu_info, version_text
from .events import HOST_BOUND_FRACTION, Harness, cupy_stream_of
from .floor import DeviceCopy, ReadFloor, copy_bandwidth
from .inputs import random_bf16
from .sequences import back_to_back_count, capture_graph, time_back_to_back, time_replays
from .stats import gbps, median, percentile, summarize

__all__ = ["DeviceCopy", "HOST_BOUND_FRACTION", "Harness", "ReadFloor", "back_to_back_count", "capture_graph",
           "copy_bandwidth", "cupy_stream_of", "gbps", "gpu_info", "median", "percentile", "random_bf16",
           "summarize", "time_back_to_back", "time_replays", "version_text"]
