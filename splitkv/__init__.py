"""splitkv: generated split-KV ("flash-decoding") decode attention for NVIDIA GPUs.

Public API: `decode` (one call), `DecodeAttention` (plan once per step, run once per layer),
`KernelSpec` (every compile-time choice of a program) and `plan_splits` (the host planner).
"""

from .plan import SplitPlan, plan_splits
from .runtime import DecodeAttention, decode
from .spec import KernelSpec, MergeSpec

__version__ = "0.1.0"
__all__ = ["DecodeAttention", "KernelSpec", "MergeSpec", "SplitPlan", "__version__", "decode", "plan_splits"]
