"""Decode problems: the ``B:Hq:Hkv:D:L[:FORMAT]`` tokens, their byte accounting, the default set,
and how many layers the serving protocol stacks for one.

Pure: the standard library and `splitkv.choices` only, tested on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from ..choices import kv_token_bytes

#: Bytes per element of the query/output type the benchmark allocates.
DTYPE_BYTES = {"bf16": 2}
#: K/V formats a shape may name (its sixth field; bf16 when absent), and their spelling there.
KV_FORMATS = {"bf16": "bf16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "nvfp4": "nvfp4"}
_FORMAT_TOKENS = {"fp8_e4m3": "fp8", "nvfp4": "nvfp4"}


@dataclass(frozen=True)
class Shape:
    """One decode problem: ``batch`` sequences of ``seq_len`` tokens, ``query_tokens`` query tokens
    each (causal among them), with the attention variants of `splitkv.variants`: a sliding window
    of ``window_left`` tokens (-1: none), a logits ``soft_cap`` (0: none), attention ``sinks``."""

    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    kv_dtype: str = "bf16"
    query_tokens: int = 1
    window_left: int = -1
    soft_cap: float = 0.0
    sinks: bool = False
    deterministic: bool = False  # splitkv's batch-invariant plan (plan(deterministic=True)); no peer has one

    @property
    def has_variant(self) -> bool:
        return self.query_tokens > 1 or self.window_left >= 0 or self.soft_cap > 0 or self.sinks

    @property
    def variant_suffix(self) -> str:
        """The variant's part of a token (':t4:w4095:cap30:sink'), '' for plain attention."""
        parts = []
        if self.query_tokens > 1:
            parts.append(f"t{self.query_tokens}")
        if self.window_left >= 0:
            parts.append(f"w{self.window_left}")
        if self.soft_cap > 0:
            parts.append(f"cap{self.soft_cap:g}")
        if self.sinks:
            parts.append("sink")
        if self.deterministic:
            parts.append("det")
        return "".join(":" + p for p in parts)

    @property
    def attended_len(self) -> int:
        """Tokens of a sequence some query attends to: all of them, or a window's (its first query
        sees window_left tokens back, its last query_tokens - 1 more)."""
        if self.window_left < 0:
            return self.seq_len
        return min(self.seq_len, self.window_left + self.query_tokens)

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def token(self) -> str:
        """The ``--shapes`` token that parses back to this shape."""
        fmt = f":{_FORMAT_TOKENS[self.kv_dtype]}" if self.kv_dtype != "bf16" else ""
        return (f"{self.batch}:{self.num_qo_heads}:{self.num_kv_heads}:{self.head_dim}:"
                f"{format_length(self.seq_len)}{fmt}{self.variant_suffix}")

    @property
    def label(self) -> str:
        """'1, 32/8, 128, 4k': the notation of the reference tables (', fp8' or ', nvfp4' appended
        for a quantized K/V cache)."""
        fmt = f", {_FORMAT_TOKENS[self.kv_dtype]}" if self.kv_dtype != "bf16" else ""
        variant = self.variant_suffix.replace(":", ", ")
        return (f"{self.batch}, {self.num_qo_heads}/{self.num_kv_heads}, {self.head_dim}, "
                f"{format_length(self.seq_len)}{fmt}{variant}")

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "bf16"

    # Byte accounting: what a decode must move at the least. K and V of the attended tokens are read
    # once, in their own format (NVFP4's block scales included); q is read and the output written
    # once (both tiny next to K/V, but counted so that GB/s is honest).
    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.attended_len * self.num_kv_heads * kv_token_bytes(self.head_dim, self.kv_dtype)

    @property
    def cache_bytes(self) -> int:
        """Bytes of a layer's K and V caches in memory (the whole sequence, window or not)."""
        return 2 * self.batch * self.seq_len * self.num_kv_heads * kv_token_bytes(self.head_dim, self.kv_dtype)

    @property
    def q_bytes(self) -> int:
        return self.batch * self.query_tokens * self.num_qo_heads * self.head_dim * DTYPE_BYTES["bf16"]

    @property
    def out_bytes(self) -> int:
        return self.batch * self.query_tokens * self.num_qo_heads * self.head_dim * DTYPE_BYTES["bf16"]

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.q_bytes + self.out_bytes

    def bytes_dict(self) -> dict:
        return {"kv": self.kv_bytes, "q": self.q_bytes, "out": self.out_bytes, "total": self.total_bytes}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_LENGTH_RE = re.compile(r"^(\d+)([kKmM]?)$")


def parse_length(text: str) -> int:
    """'4096' -> 4096, '4k' -> 4096, '1m' -> 1048576 (binary multiples, as in the reference tables)."""
    m = _LENGTH_RE.match(str(text).strip())
    if not m:
        raise ValueError(f"length {text!r}: expected an integer, optionally with a k or m suffix (e.g. 4k)")
    scale = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    return int(m.group(1)) * scale


def format_length(n: int) -> str:
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}m"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


_VARIANT_RE = re.compile(r"^(?:t(\d+)|w(\d+)|cap(\d+(?:\.\d+)?)|(sink)|(det))$")


def parse_shape(token: str) -> Shape:
    """Parse 'B:Hq:Hkv:D:L' (L may be written 4k), optionally ':fp8' or ':nvfp4' for a quantized
    K/V cache, then the variants: ':t4' (query tokens), ':w4095' (window_left), ':cap30' (soft-cap),
    ':sink', and ':det' (splitkv's batch-invariant plan); raises ValueError naming the bad part."""
    text = str(token).strip()
    parts = text.split(":")
    if len(parts) < 5:
        raise ValueError(f"shape {token!r}: expected B:Hq:Hkv:D:L[:FORMAT][:t4][:w4095][:cap30][:sink], e.g. "
                         "1:32:8:128:4k or 1:32:8:128:4k:fp8")
    kv_dtype = "bf16"
    variant = dict(query_tokens=1, window_left=-1, soft_cap=0.0, sinks=False, deterministic=False)
    for place, extra in enumerate(parts[5:]):
        word = extra.strip().lower()
        m = _VARIANT_RE.match(word)
        if word in KV_FORMATS and place == 0:
            kv_dtype = KV_FORMATS[word]
        elif m:
            tokens, window, cap, sink, det = m.groups()
            if det is not None:
                variant["deterministic"] = True
            elif tokens is not None:
                variant["query_tokens"] = int(tokens)
            elif window is not None:
                variant["window_left"] = int(window)
            elif cap is not None:
                variant["soft_cap"] = float(cap)
            else:
                variant["sinks"] = True
        else:
            raise ValueError(f"shape {token!r}: {extra!r} is neither a format ({sorted(KV_FORMATS)}, first) nor a "
                             "variant (t<tokens>, w<window_left>, cap<soft-cap>, sink, det)")
    names = ("B", "Hq", "Hkv", "D")
    values = []
    for name, part in zip(names, parts[:4]):
        if not part.strip().isdigit():
            raise ValueError(f"shape {token!r}: {name} must be a positive integer, got {part!r}")
        values.append(int(part))
    try:
        seq_len = parse_length(parts[4])
    except ValueError:
        raise ValueError(f"shape {token!r}: L must be a positive integer or e.g. 4k, got {parts[4]!r}") from None
    batch, hq, hkv, head_dim = values
    for name, value in zip(names + ("L",), (batch, hq, hkv, head_dim, seq_len)):
        if value <= 0:
            raise ValueError(f"shape {token!r}: {name} must be positive, got {value}")
    if hq % hkv:
        raise ValueError(f"shape {token!r}: Hq={hq} is not a multiple of Hkv={hkv}")
    if not 1 <= variant["query_tokens"] <= 16 or variant["query_tokens"] > seq_len:
        raise ValueError(f"shape {token!r}: t must be 1..16 query tokens and at most L")
    return Shape(batch, hq, hkv, head_dim, seq_len, kv_dtype, **variant)


def parse_shapes(tokens) -> list[Shape]:
    """Parse tokens that may also hold several shapes separated by commas or spaces."""
    shapes = []
    for token in tokens:
        for piece in re.split(r"[,\s]+", str(token)):
            if piece:
                shapes.append(parse_shape(piece))
    if not shapes:
        raise ValueError("shapes: expected at least one B:Hq:Hkv:D:L token")
    return shapes


#: The BF16 rows of the peers' reference table, in its order.
DEFAULT_SHAPES = parse_shapes([
    "1:32:8:128:1k", "1:32:8:128:4k", "1:32:8:128:16k", "1:32:8:128:64k", "1:32:8:128:128k",
    "1:32:32:128:4k", "1:32:32:128:64k",
    "16:32:8:128:4k", "64:32:8:128:1k",
    "1:64:8:128:32k", "1:16:2:256:16k",
    "1:8:1:128:64k",  # one K/V head per GPU, as 8-way tensor parallelism leaves an 8-K/V-head model
    # The FP8 rows of the reference table (FlashInfer's and FA3's FP8 decodes beside them); NVFP4 on
    # the same shapes, which no peer decodes on Hopper.
    "1:32:8:128:4k:fp8", "1:32:8:128:16k:fp8", "1:32:8:128:64k:fp8", "1:32:8:128:128k:fp8", "16:32:8:128:4k:fp8",
    "1:32:8:128:4k:nvfp4", "1:32:8:128:16k:nvfp4", "1:32:8:128:64k:nvfp4", "1:32:8:128:128k:nvfp4",
    "16:32:8:128:4k:nvfp4",
])
#: One launch-bound, one bandwidth-bound and one batched shape.
QUICK_SHAPES = parse_shapes(["1:32:8:128:4k", "1:32:8:128:64k", "16:32:8:128:4k"])


#: The serving protocol's layers together hold at least this many bytes, so that no layer finds
#: its K/V in the L2 (60 MB on an H200) left there by the layers before it.
SERVING_BYTES = 512 << 20


#: The serving protocol's layers hold at most this many bytes of caches together (a window's
#: layers read a fraction of theirs).
SERVING_MAX_CACHE_BYTES = 24 << 30


def serving_layers(shape: Shape, min_bytes: int = SERVING_BYTES) -> int:
    """Layers of the serving protocol: the fewest whose K/V bytes read together reach ``min_bytes``
    (bounded by `SERVING_MAX_CACHE_BYTES` of caches in memory)."""
    wanted = max(1, math.ceil(min_bytes / shape.kv_bytes))
    return max(1, min(wanted, SERVING_MAX_CACHE_BYTES // max(shape.cache_bytes, 1)))


def shapes_part(shapes: list, part: str) -> list:
    """The ``part`` 'i/n' (1-based) of ``shapes``: the i-th of n contiguous slices of nearly equal
    length, so that n calls of a time-limited host together time every shape once. Contiguous,
    since neighbouring shapes share programs (one compile, one peer JIT per slice)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(part))
    if not m:
        raise ValueError(f"part {part!r}: expected i/n, e.g. 2/3")
    i, n = int(m.group(1)), int(m.group(2))
    if not 1 <= i <= n:
        raise ValueError(f"part {part!r}: expected 1 <= i <= n")
    lo, hi = round((i - 1) * len(shapes) / n), round(i * len(shapes) / n)
    return list(shapes[lo:hi])
