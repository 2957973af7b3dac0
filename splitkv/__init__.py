"""splitkv: generated split-KV ("flash-decoding") decode attention for NVIDIA GPUs.

Public API: `decode` (one call), `DecodeAttention` (plan once per step, run once per layer),
`KernelSpec` (every compile-time choice of a program), `plan_splits` (the host planner),
`quantize_kv` (BF16/FP16 K/V into FP8 E4M3 or NVFP4; formats in `splitkv.kv_formats`) and
`merge_states` (the exact merge of attention states over disjoint token ranges).
"""

from .gpu import GpuUnavailableError
from .plan import SplitPlan, plan_splits
from .quantize import NonFiniteInputError, QuantizedKV, quantize_kv
from .merge_states import merge_state_list, merge_states
from .oneshot import decode
from .runtime import DecodeAttention
from .spec import KernelSpec, MergeSpec, QuantizeSpec

__version__ = "0.1.0"
__all__ = ["DecodeAttention", "GpuUnavailableError", "KernelSpec", "MergeSpec", "NonFiniteInputError", "QuantizeSpec", "QuantizedKV",
           "SplitPlan", "__version__", "decode", "merge_state_list", "merge_states", "plan_splits", "quantize_kv"]
