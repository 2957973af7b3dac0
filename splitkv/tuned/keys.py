"""What a tuned choice is keyed by: the head layout and formats (`TuneKey`), the workload
(`Bucket`), and the GPU (its name, as a table's file name).

A key's fields are the KernelSpec fields a caller fixes (head_dim, group size, dtypes, cache
layout, and the query tokens per sequence, which change the best CTA shape: several tokens fill
the MMA rows that one token leaves to the query heads); everything else in a KernelSpec is a tuning choice (`splitkv.autotune.space`). A bucket is
one representative decode step: ``batch`` sequences of ``seq_len`` tokens with
``REFERENCE_KV_HEADS`` K/V heads each. Lookup takes the bucket nearest to a plan's (rows, longest
length), rows being sequences x K/V heads, in log space: a step of 8 sequences of one K/V head
finds the bucket of one sequence of 8 heads, which runs the same CTAs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from ..choices import HEAD_DIMS, KV_DTYPES, KV_LAYOUTS, MAX_GROUP, MAX_QUERY_TOKENS, PAGE_SIZES, Q_DTYPES

#: K/V heads of every bucket's representative shape (Hq = group x this).
REFERENCE_KV_HEADS = 8
#: A table's largest bucket batch: the launch grid's sequences at most (`DecodeAttention` splits no batch).
MAX_BATCH = 65535
#: A table's longest bucket length: the programs index tokens with int32.
MAX_SEQ_LEN = 2**31 - 1


@dataclass(frozen=True, order=True)
class TuneKey:
    """The caller's fixed choices: one Optuna study per (GPU, key, bucket), one table entry each."""

    head_dim: int
    group_size: int
    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    page_size: int = 0          # 0: contiguous caches
    kv_layout: str = "NHD"
    query_tokens: int = 1       # query tokens per sequence (speculative verification); windows,
    #                             soft-caps and sinks cost the same whatever the shape, and key nothing

    def __post_init__(self):
        for name, allowed in (("head_dim", HEAD_DIMS), ("q_dtype", Q_DTYPES), ("kv_dtype", KV_DTYPES),
                              ("page_size", (0, *PAGE_SIZES)), ("kv_layout", KV_LAYOUTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {list(allowed)}, got {getattr(self, name)!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or not 1 <= self.group_size <= MAX_GROUP:
            raise ValueError(f"group_size: expected an int in 1..{MAX_GROUP}, got {self.group_size!r}")
        if isinstance(self.query_tokens, bool) or not isinstance(self.query_tokens, int) \
                or not 1 <= self.query_tokens <= MAX_QUERY_TOKENS:
            raise ValueError(f"query_tokens: expected an int in 1..{MAX_QUERY_TOKENS}, got {self.query_tokens!r}")

    @property
    def layout(self) -> str:
        """'contiguous' ('contiguous-HND' for [B, Hkv, L, D] caches), or 'p16' / 'p16-HND' for paged caches."""
        if not self.page_size:
            return "contiguous" + ("-HND" if self.kv_layout == "HND" else "")
        return f"p{self.page_size}" + ("-HND" if self.kv_layout == "HND" else "")

    @property
    def label(self) -> str:
        """'d128-g4-bf16-bf16-contiguous' ('...-contiguous-t4' for 4 query tokens): a study name's middle part."""
        tokens = f"-t{self.query_tokens}" if self.query_tokens > 1 else ""
        return f"d{self.head_dim}-g{self.group_size}-{self.q_dtype}-{self.kv_dtype}-{self.layout}{tokens}"

    def with_query_tokens(self, query_tokens: int) -> "TuneKey":
        return dataclasses.replace(self, query_tokens=int(query_tokens))

    def spec_fields(self) -> dict:
        """The KernelSpec fields the key fixes."""
        return dict(head_dim=self.head_dim, group_size=self.group_size, q_dtype=self.q_dtype,
                    kv_dtype=self.kv_dtype, page_size=self.page_size, kv_layout=self.kv_layout,
                    query_tokens=self.query_tokens)

    def to_dict(self) -> dict:
        """The key as a table holds it (``query_tokens`` only where it is more than one)."""
        out = dict(head_dim=self.head_dim, group_size=self.group_size, q_dtype=self.q_dtype,
                   kv_dtype=self.kv_dtype, layout=self.layout)
        if self.query_tokens > 1:
            out["query_tokens"] = self.query_tokens
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "TuneKey":
        unknown = set(data) - {"head_dim", "group_size", "q_dtype", "kv_dtype", "layout", "query_tokens"}
        if unknown:
            raise ValueError(f"key: unknown fields {sorted(unknown)}")
        missing = {"head_dim", "group_size"} - set(data)
        if missing:
            raise ValueError(f"key: lacks {sorted(missing)}")
        # The constructor checks values against their choices, where 128.0 and True pass for ints.
        for name in ("head_dim", "group_size", "query_tokens"):
            if name not in data:
                continue
            if isinstance(data[name], bool) or not isinstance(data[name], int):
                raise ValueError(f"key: {name}: expected an int, got {data[name]!r}")
        for name in ("q_dtype", "kv_dtype", "layout"):
            if name in data and not isinstance(data[name], str):
                raise ValueError(f"key: {name}: expected a name, got {data[name]!r}")
        page_size, kv_layout = parse_layout(data.get("layout", "contiguous"))
        return cls(head_dim=data["head_dim"], group_size=data["group_size"], q_dtype=data.get("q_dtype", "bf16"),
                   kv_dtype=data.get("kv_dtype", "bf16"), page_size=page_size, kv_layout=kv_layout,
                   query_tokens=data.get("query_tokens", 1))


_LAYOUT_RE = re.compile(r"^p(\d+)(-HND|-NHD)?$")


def parse_layout(text: str) -> tuple[int, str]:
    """'contiguous' -> (0, 'NHD'); 'contiguous-HND' -> (0, 'HND'); 'p16' -> (16, 'NHD'); 'p16-HND' -> (16, 'HND')."""
    if text in ("contiguous", "contiguous-HND"):
        return 0, "HND" if text.endswith("HND") else "NHD"
    m = _LAYOUT_RE.match(str(text))
    if not m:
        raise ValueError(f"layout: expected 'contiguous', 'pN' or 'pN-HND', got {text!r}")
    return int(m.group(1)), (m.group(2) or "-NHD")[1:]


@dataclass(frozen=True)
class Bucket:
    """A workload: ``batch`` sequences of ``seq_len`` tokens, REFERENCE_KV_HEADS K/V heads each."""

    name: str
    batch: int
    seq_len: int

    def __post_init__(self):
        for field in ("batch", "seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"bucket {self.name!r}: {field} must be a positive int, got {value!r}")

    def to_dict(self) -> dict:
        return dict(name=self.name, batch=self.batch, seq_len=self.seq_len)

    @classmethod
    def from_dict(cls, data: dict) -> "Bucket":
        """A bucket as a table holds it: its name says its batch and length (`parse_bucket`), and
        the two fields must say the same."""
        if set(data) != {"name", "batch", "seq_len"}:
            raise ValueError(f"bucket: expected the fields ['batch', 'name', 'seq_len'], got {sorted(data)}")
        if not isinstance(data["name"], str):
            raise ValueError(f"bucket: name: expected a name like 'b1-l32k', got {data['name']!r}")
        bucket = cls(data["name"], data["batch"], data["seq_len"])
        for field, most in (("batch", MAX_BATCH), ("seq_len", MAX_SEQ_LEN)):
            value = getattr(bucket, field)
            if value > most:
                raise ValueError(f"bucket {bucket.name!r}: {field} must be at most {most}, got {value}")
        named = parse_bucket(bucket.name)
        if (named.batch, named.seq_len) != (bucket.batch, bucket.seq_len):
            raise ValueError(f"bucket {bucket.name!r}: the name says batch {named.batch}, seq_len {named.seq_len}; "
                             f"the fields say batch {bucket.batch}, seq_len {bucket.seq_len}")
        return bucket

    @property
    def rows(self) -> int:
        return self.batch * REFERENCE_KV_HEADS

    def distance(self, rows: int, max_len: int) -> float:
        """How far a plan of ``rows`` (sequence, K/V head) rows and longest length ``max_len`` is
        from this bucket, in octaves of each."""
        return math.hypot(math.log2(max(rows, 1) / self.rows), math.log2(max(max_len, 1) / self.seq_len))


#: The workloads tuned by default: one sequence short and long (split programs: launch-bound and
#: bandwidth-bound), a few sequences (32 rows: too few to fill the GPU, too many for one cluster of
#: splits each, where the split count is hardest to choose), and a batch that fills the GPU in rows
#: (dense programs).
BUCKETS = (
    Bucket("b1-l2k", 1, 2048),
    Bucket("b1-l32k", 1, 32768),
    Bucket("b4-l8k", 4, 8192),
    Bucket("b32-l4k", 32, 4096),
)
BUCKETS_BY_NAME = {b.name: b for b in BUCKETS}

_BUCKET_RE = re.compile(r"^b(\d+)-l(\d+)([kKmM]?)$")


def parse_bucket(text: str) -> Bucket:
    """A bucket by name: a built-in one, or any 'b<batch>-l<length>[k|m]' ('b4-l16k')."""
    if text in BUCKETS_BY_NAME:
        return BUCKETS_BY_NAME[text]
    m = _BUCKET_RE.match(text)
    if not m:
        raise ValueError(f"bucket: expected a name like 'b1-l32k' (batch, length), got {text!r}")
    scale = {"": 1, "k": 1024, "m": 1 << 20}[m.group(3).lower()]
    return Bucket(text, int(m.group(1)), int(m.group(2)) * scale)


def nearest_bucket(items, rows: int, max_len: int, bucket_of=lambda item: item):
    """The item of ``items`` whose bucket is nearest to (rows, max_len); ties go to the first listed."""
    return min(items, key=lambda item: bucket_of(item).distance(rows, max_len), default=None)


def gpu_file_stem(gpu_name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200': the table's file name, from the driver's device name."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", gpu_name.strip()).strip("_")
    if not stem:
        raise ValueError(f"gpu name: {gpu_name!r} leaves no file name")
    return stem
