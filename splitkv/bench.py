"""Decode-attention benchmark: splitkv beside its peers, the read floor and the copy bandwidth.

    python -m splitkv.bench                       # every shape of the reference table
    python -m splitkv.bench --quick               # three shapes
    python -m splitkv.bench --shapes 1:32:8:128:4k 16:32:8:128:4k --specs warps=8,tile_tokens=16

Every implementation is timed the same way, in the same process, on one stream: warm-up calls,
then for each timed call an L2 flush (a memset of at least twice the L2, outside the timed region,
repeated when the implementation's host path is slower than one memset, so that the GPU never waits
for a launch inside the timed region) followed by CUDA events around the call alone; the median of
``--iters`` calls is the figure, with p10/p90 beside it. The copy bandwidth and the read floor
(see `splitkv.floor`) are measured in the same run with the same protocol.

The pure parts (shape parsing, statistics, byte accounting, spec overrides, file naming, JSON and
table rendering) import nothing beyond the standard library and `splitkv.spec`, and are tested on
CPU; CuPy, torch and the peers are imported only when a run starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import cluster_layout
from .spec import KernelSpec, arch_number, kv_token_bytes

# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------

#: Bytes per element of the query/output type the benchmark allocates.
DTYPE_BYTES = {"bf16": 2}
#: K/V formats a shape may name (its sixth field; bf16 when absent), and their spelling there.
KV_FORMATS = {"bf16": "bf16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "nvfp4": "nvfp4"}
_FORMAT_TOKENS = {"fp8_e4m3": "fp8", "nvfp4": "nvfp4"}


@dataclass(frozen=True)
class Shape:
    """One decode problem: ``batch`` sequences of ``seq_len`` tokens, one query token each."""

    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    kv_dtype: str = "bf16"

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def token(self) -> str:
        """The ``--shapes`` token that parses back to this shape."""
        fmt = f":{_FORMAT_TOKENS[self.kv_dtype]}" if self.kv_dtype != "bf16" else ""
        return (f"{self.batch}:{self.num_qo_heads}:{self.num_kv_heads}:{self.head_dim}:"
                f"{format_length(self.seq_len)}{fmt}")

    @property
    def label(self) -> str:
        """'1, 32/8, 128, 4k': the notation of the reference tables (', fp8' or ', nvfp4' appended
        for a quantized K/V cache)."""
        fmt = f", {_FORMAT_TOKENS[self.kv_dtype]}" if self.kv_dtype != "bf16" else ""
        return (f"{self.batch}, {self.num_qo_heads}/{self.num_kv_heads}, {self.head_dim}, "
                f"{format_length(self.seq_len)}{fmt}")

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "bf16"

    # Byte accounting: what a decode must move at the least. K and V are read once, in their own
    # format (NVFP4's block scales included); q is read and the output written once (both tiny next
    # to K/V, but counted so that GB/s is honest).
    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.seq_len * self.num_kv_heads * kv_token_bytes(self.head_dim, self.kv_dtype)

    @property
    def q_bytes(self) -> int:
        return self.batch * self.num_qo_heads * self.head_dim * DTYPE_BYTES["bf16"]

    @property
    def out_bytes(self) -> int:
        return self.batch * self.num_qo_heads * self.head_dim * DTYPE_BYTES["bf16"]

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


def parse_shape(token: str) -> Shape:
    """Parse 'B:Hq:Hkv:D:L' (L may be written 4k), optionally ':fp8' or ':nvfp4' for a quantized
    K/V cache; raises ValueError naming the bad part."""
    text = str(token).strip()
    parts = text.split(":")
    if len(parts) not in (5, 6):
        raise ValueError(f"shape {token!r}: expected B:Hq:Hkv:D:L[:FORMAT], e.g. 1:32:8:128:4k or 1:32:8:128:4k:fp8")
    kv_dtype = "bf16"
    if len(parts) == 6:
        kv_dtype = KV_FORMATS.get(parts[5].strip().lower())
        if kv_dtype is None:
            raise ValueError(f"shape {token!r}: format must be one of {sorted(KV_FORMATS)}, got {parts[5]!r}")
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
    return Shape(batch, hq, hkv, head_dim, seq_len, kv_dtype)


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


#: The BF16 rows of the peers' reference table (shared/anchors.md), in its order.
DEFAULT_SHAPES = parse_shapes([
    "1:32:8:128:1k", "1:32:8:128:4k", "1:32:8:128:16k", "1:32:8:128:64k", "1:32:8:128:128k",
    "1:32:32:128:4k", "1:32:32:128:64k",
    "16:32:8:128:4k", "64:32:8:128:1k",
    "1:64:8:128:32k", "1:16:2:256:16k",
    "1:8:1:128:64k",  # one K/V head per GPU, as 8-way tensor parallelism leaves an 8-K/V-head model
    # The FP8 rows of the reference table (FlashInfer FP8 beside them), 16k for the 1.8x claim; NVFP4
    # on the same shapes, which no peer decodes on Hopper.
    "1:32:8:128:4k:fp8", "1:32:8:128:16k:fp8", "1:32:8:128:64k:fp8", "1:32:8:128:128k:fp8", "16:32:8:128:4k:fp8",
    "1:32:8:128:4k:nvfp4", "1:32:8:128:16k:nvfp4", "1:32:8:128:64k:nvfp4", "1:32:8:128:128k:nvfp4",
    "16:32:8:128:4k:nvfp4",
])
#: One launch-bound, one bandwidth-bound and one batched shape.
QUICK_SHAPES = parse_shapes(["1:32:8:128:4k", "1:32:8:128:64k", "16:32:8:128:4k"])

# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    data = sorted(float(v) for v in values)
    if not data:
        raise ValueError("percentile: no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


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


def derived_figures(shape: Shape, time_us: float, floor_us: float | None, copy_gbps: float | None) -> dict:
    """GB/s, % of the copy bandwidth and the ratio to the read floor for one timed shape."""
    rate = gbps(shape.total_bytes, time_us)
    return {
        "gbps": rate,
        "pct_copy_bw": (100.0 * rate / copy_gbps) if copy_gbps else None,
        "x_floor": (time_us / floor_us) if floor_us else None,
    }

# ---------------------------------------------------------------------------------------------
# KernelSpec overrides (--specs)
# ---------------------------------------------------------------------------------------------

#: Filled from the shape under test; an override may not set them.
SHAPE_FIELDS = ("head_dim", "group_size", "q_dtype", "kv_dtype")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_spec_override(text: str) -> dict:
    """'warps=8,tile_tokens=16,stages=2' -> {'warps': 8, 'tile_tokens': 16, 'stages': 2}.

    Values are converted to the KernelSpec field's type; unknown fields, fields that come from the
    shape and malformed pairs raise ValueError.
    """
    fields = {f.name: f for f in dataclasses.fields(KernelSpec)}
    out: dict = {}
    for pair in str(text).split(","):
        pair = pair.strip()
        if not pair:
            continue
        key, sep, raw = pair.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key or not raw:
            raise ValueError(f"spec {text!r}: expected field=value pairs separated by commas, got {pair!r}")
        if key not in fields:
            raise ValueError(f"spec {text!r}: unknown KernelSpec field {key!r} (known: {sorted(fields)})")
        if key in SHAPE_FIELDS:
            raise ValueError(f"spec {text!r}: {key} comes from the shape and cannot be overridden")
        if key in out:
            raise ValueError(f"spec {text!r}: {key} given twice")
        annotation = fields[key].type
        kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
        if kind == "int":
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"spec {text!r}: {key} must be an integer, got {raw!r}") from None
        elif kind == "bool":
            if raw.lower() in _TRUE:
                value = True
            elif raw.lower() in _FALSE:
                value = False
            else:
                raise ValueError(f"spec {text!r}: {key} must be true or false, got {raw!r}")
        else:
            value = raw
        out[key] = value
    if not out:
        raise ValueError(f"spec {text!r}: no field=value pairs")
    return out


def spec_label(overrides: dict) -> str:
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items())


def builtin_spec(shape: Shape, arch: str) -> KernelSpec:
    """splitkv's own CTA shape for this shape when it can be asked, else KernelSpec's defaults.

    Overrides are applied on top of it, so that ``warps=8`` changes the warps of what splitkv
    would have run and nothing else.
    """
    key = dict(head_dim=shape.head_dim, group_size=shape.group_size, q_dtype="bf16", kv_dtype=shape.kv_dtype)
    try:
        from .heuristics import default_spec

        return default_spec(arch=arch, **key)
    except (ImportError, AttributeError, TypeError, ValueError):
        return KernelSpec(arch=arch, **key)


def spec_for_shape(overrides: dict, shape: Shape, arch: str, base: KernelSpec | None = None) -> KernelSpec:
    """The KernelSpec an override means for one shape: ``base`` (KernelSpec's defaults with the
    shape's head_dim, group and dtypes when None) with the overridden fields replaced. ``variant``
    is left out: it goes to plan(), which builds each program's spec from this one (a dense
    program, say, without the split program's cluster). Raises ValueError when the result is
    invalid."""
    overrides = {key: value for key, value in overrides.items() if key != "variant"}
    if base is None:
        fields = dict(arch=arch, head_dim=shape.head_dim, group_size=shape.group_size,
                      q_dtype="bf16", kv_dtype=shape.kv_dtype)
        return KernelSpec(**{**fields, **overrides})
    return base.replace(**overrides)

# ---------------------------------------------------------------------------------------------
# Provenance, file naming and JSON
# ---------------------------------------------------------------------------------------------


def _repo_root() -> Path | None:
    """The checkout this package runs from, or None when it is installed elsewhere."""
    here = Path(__file__).resolve().parent.parent
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if top.returncode != 0:
        return None
    root = Path(top.stdout.strip())
    # A site-packages that happens to sit inside some other repository is not our checkout.
    return root if (root / "splitkv" / "bench.py").is_file() else None


def git_commit(root: Path | None = None) -> tuple[str, bool]:
    """(short commit, working tree has uncommitted changes); ('unknown', False) outside a checkout."""
    root = root if root is not None else _repo_root()
    if root is None:
        return "unknown", False
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown", False
    return head.stdout.strip(), bool(status.returncode == 0 and status.stdout.strip())


def safe_name(text: str) -> str:
    """A file-name-safe form of a device name: spaces to '_', anything unusual dropped."""
    name = re.sub(r"\s+", "_", str(text).strip())
    name = re.sub(r"[^A-Za-z0-9._+-]", "", name)
    return name or "unknown-gpu"


def result_filename(gpu_name: str, date: str, commit: str) -> str:
    """'<gpu-name>-<UTC date>-<git short commit>.json', e.g. 'NVIDIA_H200-2026-11-29-c69090d.json'."""
    return f"{safe_name(gpu_name)}-{date}-{safe_name(commit) or 'unknown'}.json"


def unique_path(directory: Path, filename: str) -> Path:
    """``directory/filename``, or with -2, -3, ... before the suffix when a run already used it."""
    path = Path(directory) / filename
    stem, suffix = path.stem, path.suffix
    n = 2
    while path.exists():
        path = Path(directory) / f"{stem}-{n}{suffix}"
        n += 1
    return path


def default_results_dir() -> Path:
    root = _repo_root()
    return (root if root is not None else Path.cwd()) / "bench" / "results"


def write_json(result: dict, path: Path) -> Path:
    """Write atomically, so that an interrupted run leaves the previous complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(json_ready(result), f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def json_ready(obj):
    """A copy that strict JSON accepts: NaN/inf become null, paths and array scalars plain values."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):  # NumPy / CuPy / torch scalars
        return json_ready(obj.item())
    return str(obj)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

#: Display names of the peers, in column order.
PEER_NAMES = {
    "sdpa-flash": "SDPA-flash",
    "sdpa-cudnn": "cuDNN SDPA",
    "flashinfer-single": "FlashInfer single",
    "flashinfer-single-tc": "FlashInfer single-tc",
    "flashinfer-paged": "FlashInfer paged",
    "flashinfer-paged-tc": "FlashInfer paged-tc",
}
#: Peer columns of the table: SDPA backends each, FlashInfer as its best variant.
PEER_COLUMNS = ("sdpa-flash", "sdpa-cudnn", "flashinfer")
#: A peer whose output differs from splitkv's by more than this fraction of the output's largest
#: magnitude is marked with '!' (bf16 rounding alone stays well under 1%).
DIFF_FLAG_REL = 0.05
NA_WIDTH = 40
#: A call whose host time exceeds this fraction of the flush's GPU time may have left the GPU idle
#: inside its timed region; its figure is marked '~' (an upper bound).
HOST_BOUND_FRACTION = 0.8
#: The flush is repeated until its GPU time exceeds the warm-up's p90 host time by this factor...
HOST_MARGIN = 1.5
#: ...but not beyond this many memsets per timed call.
MAX_FLUSH_REPS = 16


def _fmt_us(x) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _time(entry: dict) -> str:
    """The median, with '~' when the call may have been host-bound (see HOST_BOUND_FRACTION)."""
    return _fmt_us(entry["median_us"]) + ("~" if entry.get("host_bound") else "")


def _na(entry: dict | None, width: int = NA_WIDTH) -> str:
    reason = (entry or {}).get("reason") or "not run"
    text = f"n/a: {reason}"
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _ok(entry) -> bool:
    return bool(entry) and entry.get("status") == "ok" and entry.get("median_us") is not None


def _peer_cell(entry: dict | None, variant: str | None = None) -> str:
    if not _ok(entry):
        return _na(entry)
    text = _time(entry)
    notes = []
    if variant:
        notes.append(variant)
    if entry.get("gqa") == "repeat kv":
        notes.append("rep")
    if notes:
        text += f" ({', '.join(notes)})"
    if suspect(entry):
        text += " !"
    return text


def suspect(entry: dict | None) -> bool:
    """True when a checked output disagreed with the one it was checked against, or was not finite."""
    if not entry:
        return False
    if entry.get("nonfinite_output"):
        return True
    rel = entry.get("rel_diff")
    return rel is not None and rel > DIFF_FLAG_REL


def best_of(peers: dict, prefix: str = "") -> str | None:
    """Key of the fastest successful peer whose key starts with ``prefix``."""
    ok = [(v["median_us"], k) for k, v in peers.items() if k.startswith(prefix) and _ok(v)]
    return min(ok)[1] if ok else None


def table_rows(result: dict) -> list[list[str]]:
    """Header plus one row per shape: the table printed on stdout and written as markdown."""
    spec_labels = list(result.get("specs") or [])
    header = ["shape (B, Hq/Hkv, D, L)", "splitkv µs", "GB/s", "% copy bw", "floor µs", "x floor",
              "best peer µs", "speedup", "SDPA-flash µs", "cuDNN SDPA µs", "FlashInfer µs"]
    header += [f"spec {label} µs" for label in spec_labels]
    rows = [header]
    for entry in result.get("shapes", []):
        sk = entry.get("splitkv") or {}
        floor = entry.get("floor") or {}
        peers = entry.get("peers") or {}
        row = [entry["label"]]
        if _ok(sk):
            row += [_time(sk) + (" !" if suspect(sk) else ""), f"{sk['gbps']:.0f}",
                    "-" if sk.get("pct_copy_bw") is None else f"{sk['pct_copy_bw']:.0f}"]
        else:
            row += [_na(sk), "-", "-"]
        row.append(_fmt_us(floor["median_us"]) if _ok(floor) else _na(floor))
        row.append(f"{sk['x_floor']:.2f}" if _ok(sk) and sk.get("x_floor") else "-")
        best = entry.get("best_peer")
        if best:
            row.append(f"{PEER_NAMES.get(best, best)} {_time(peers[best])}" + (" !" if suspect(peers[best]) else ""))
            row.append(f"{peers[best]['median_us'] / sk['median_us']:.2f}x" if _ok(sk) else "-")
        else:
            row += ["-", "-"]
        row.append(_peer_cell(peers.get("sdpa-flash")))
        row.append(_peer_cell(peers.get("sdpa-cudnn")))
        fi = best_of(peers, "flashinfer")
        if fi:
            row.append(_peer_cell(peers[fi], PEER_NAMES[fi].replace("FlashInfer ", "")))
        else:
            fi_entries = [v for k, v in peers.items() if k.startswith("flashinfer")]
            row.append(_na(fi_entries[0] if fi_entries else None))
        for label in spec_labels:
            row.append(_peer_cell((entry.get("specs") or {}).get(label)))
        rows.append(row)
    return rows


def render_text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append(" | ".join(cells).rstrip())
        if n == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(result: dict) -> str:
    """A self-contained BENCHMARKS.md section: GPU, date, commit, setup, the table, notes."""
    gpu = result.get("gpu", {})
    sw = result.get("software", {})
    proto = result.get("protocol", {})
    copy = result.get("copy") or {}
    commit = result.get("commit", "unknown") + (" (uncommitted changes)" if result.get("dirty") else "")
    lines = [f"## {gpu.get('name', 'unknown GPU')}, {result.get('date', '?')}, commit {commit}", ""]
    setup = [f"{gpu.get('sm_count', '?')} SMs",
             f"driver {gpu.get('driver_version') or '?'} (CUDA {gpu.get('driver_cuda_version') or '?'})",
             f"CUDA runtime {gpu.get('cuda_runtime_version') or '?'}"]
    for key, name in (("torch", "torch"), ("cudnn", "cuDNN"), ("cupy", "CuPy"), ("flashinfer", "FlashInfer")):
        if sw.get(key):
            setup.append(f"{name} {sw[key]}")
    lines.append(", ".join(setup) + ".")
    if copy.get("gbps"):
        lines.append(f"Copy bandwidth (device-to-device, {copy.get('bytes', 0) / 2**30:.0f} GiB, "
                     f"read + written): {copy['gbps']:.0f} GB/s.")
    if gpu.get("cluster_layout"):
        lines.append(describe_cluster_layout(gpu["cluster_layout"]) + ".")
    lines.append(f"Timing: CUDA events around each call on one stream, L2 flushed "
                 f"({proto.get('flush_bytes', 0) / 2**20:.0f} MiB memset) before every call, "
                 f"median of {proto.get('iters', '?')} calls after {proto.get('warmup', '?')} warm-up "
                 f"calls; floor = a plain 16-byte streaming read of the same bytes, same protocol.")
    lines.append("")
    rows = table_rows(result)
    lines.append("| " + " | ".join(_md_cell(c) for c in rows[0]) + " |")
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(rows[0]))) + "|")
    for row in rows[1:]:
        lines.append("| " + " | ".join(_md_cell(c) for c in row) + " |")
    lines.append("")
    notes = ["speedup = best peer µs / splitkv µs; (rep) = K/V repeated to Hq heads because SDPA "
             f"refused enable_gqa; ! = output differs from splitkv's by more than "
             f"{DIFF_FLAG_REL:.0%} of its largest magnitude; ~ = the call's host time exceeded "
             f"{HOST_BOUND_FRACTION:.0%} of the flushes' GPU time, so the GPU may have waited for the launch "
             f"inside the timed region (an upper bound)."]
    reasons = {}
    for entry in result.get("shapes", []):
        candidates = [("splitkv", entry.get("splitkv"))]
        candidates += [(PEER_NAMES.get(k, k), v) for k, v in (entry.get("peers") or {}).items()]
        candidates += [(f"spec {k}", v) for k, v in (entry.get("specs") or {}).items()]
        for name, e in candidates:
            if e and e.get("status") != "ok" and e.get("reason"):
                reasons.setdefault((name, " ".join(str(e["reason"]).split())), []).append(entry["label"])
    for (name, reason), labels in reasons.items():
        where = "all shapes" if len(labels) == len(result.get("shapes", [])) else "; ".join(labels)
        notes.append(f"{name} n/a ({where}): {reason}")
    lines += [f"- {_md_cell(n)}" for n in notes]
    lines.append("")
    return "\n".join(lines)


def write_markdown(result: dict, path: Path) -> Path:
    """Append the section to ``path`` (created when missing), separated by a blank line."""
    path = Path(path)
    section = render_markdown(result)
    if path.exists() and path.stat().st_size > 0:
        existing = path.read_text(encoding="utf-8")
        sep = "" if existing.endswith("\n\n") else ("\n" if existing.endswith("\n") else "\n\n")
        with open(path, "a", encoding="utf-8") as f:
            f.write(sep + section)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(section, encoding="utf-8")
    return path


def _check_text(entry: dict, label: str) -> str:
    """The output check of one figure: its max abs difference, and '!' when it is suspect."""
    text = f" {label} {entry['max_abs_diff']:.2g}" if entry.get("max_abs_diff") is not None else ""
    return text + (" !" if suspect(entry) else "")


def progress_line(index: int, total: int, entry: dict) -> str:
    """One line per finished shape: splitkv's figures, the floor, the best peer and every check."""
    sk = entry.get("splitkv") or {}
    parts = [f"[{index}/{total}] {entry['label']}:"]
    if _ok(sk):
        text = f"splitkv {_time(sk)} µs ({sk['gbps']:.0f} GB/s"
        if sk.get("pct_copy_bw") is not None:
            text += f", {sk['pct_copy_bw']:.0f}% copy bw"
        if sk.get("x_floor"):
            text += f", {sk['x_floor']:.2f}x floor"
        if sk.get("host_us") is not None:
            text += f", host {sk['host_us']:.0f} µs"
        text += ")"
        parts.append(text + _check_text(sk, "|d| vs fp32"))
    else:
        parts.append("splitkv " + _na(sk, 120))
    floor = entry.get("floor") or {}
    parts.append(f"floor {_fmt_us(floor['median_us'])} µs" if _ok(floor) else "floor " + _na(floor))
    for label, e in (entry.get("specs") or {}).items():
        parts.append(f"[{label}] " + (f"{_time(e)} µs" if _ok(e) else _na(e)))
    for key, e in (entry.get("peers") or {}).items():
        name = PEER_NAMES.get(key, key)
        if _ok(e):
            parts.append(f"{name} {_time(e)} µs" + _check_text(e, "|d|"))
        else:
            parts.append(f"{name} {_na(e)}")
    return " ".join(parts[:2]) + "; " + "; ".join(parts[2:])

# ---------------------------------------------------------------------------------------------
# GPU side: timing harness
# ---------------------------------------------------------------------------------------------


class Unavailable(RuntimeError):
    """An implementation that cannot run this shape; its message is already the whole reason."""


def _reason(exc: BaseException, caught=()) -> str:
    """One line: the exception, plus what the library warned about while failing (torch's SDPA
    explains why a backend was refused only in warnings)."""
    text = str(exc) if isinstance(exc, Unavailable) else f"{type(exc).__name__}: {exc}".strip()
    extra = []
    for w in caught:
        msg = " ".join(str(w.message).split())
        if msg and msg not in extra:
            extra.append(msg)
    if extra:
        text += " [" + "; ".join(extra[:3]) + "]"
    text = " ".join(text.split())
    return text[:400]


def _cupy_view_of(cupy, torch_stream):
    """A CuPy stream object for a torch stream (the same CUDA stream, owned by torch)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(torch_stream)
        except TypeError:  # a torch without the CUDA stream protocol
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(torch_stream.cuda_stream)


class Harness:
    """One stream shared by CuPy and torch, an L2 flush buffer, and the timing protocol."""

    def __init__(self, iters: int, warmup: int, flush_bytes: int, torch_mod=None):
        import cupy

        self.cupy = cupy
        self.torch = torch_mod
        self.iters = iters
        self.warmup = warmup
        if torch_mod is not None:
            # torch owns the stream and CuPy wraps it, so splitkv (whichever framework it asks for
            # the current stream), the peers, the flush and the events all share one queue.
            self.torch_stream = torch_mod.cuda.Stream()
            self.stream = _cupy_view_of(cupy, self.torch_stream)
        else:
            self.torch_stream = None
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.flush_bytes = int(flush_bytes)
        self._flush_buf = cupy.empty(self.flush_bytes, dtype=cupy.uint8)
        self.flush_us = None
        self.last_host_us = []
        self.last_flush_reps = 1

    @contextlib.contextmanager
    def active(self):
        """Make the benchmark stream current for both CuPy and torch."""
        with contextlib.ExitStack() as stack:
            if self.torch_stream is not None:
                stack.enter_context(self.torch.cuda.stream(self.torch_stream))
            stack.enter_context(self.stream)
            yield

    def flush_l2(self):
        runtime = self.cupy.cuda.runtime
        runtime.memsetAsync(self._flush_buf.data.ptr, 0, self.flush_bytes, self.stream.ptr)

    def synchronize(self):
        self.stream.synchronize()

    def time(self, fn, iters: int | None = None, context=None) -> list[float]:
        """Per-call times in µs: warm-up, then flush + event + call + event, ``iters`` times.

        The flush must take longer on the GPU than one iteration takes on the host, so that the
        queue stays ahead of the GPU and host-side launch overhead stays out of the figure. The
        warm-up calls measure that host time, and the flush is repeated as often as it takes
        (``last_flush_reps``): one flush or several leave the L2 in the same state. The host time
        of every timed call is kept in ``last_host_us`` to show when the queue ran dry anyway.
        """
        cupy = self.cupy
        n = int(iters or self.iters)
        clock = time.perf_counter
        host = [0.0] * n
        with (context() if context is not None else contextlib.nullcontext()):
            warm_host = []
            for _ in range(max(self.warmup, 3)):
                t0 = clock()
                fn()
                warm_host.append(clock() - t0)
            self.synchronize()
            reps = 1
            if self.flush_us:
                needed_us = HOST_MARGIN * percentile(warm_host, 90) * 1e6
                reps = min(MAX_FLUSH_REPS, max(1, math.ceil(needed_us / self.flush_us)))
            self.last_flush_reps = reps
            starts = [cupy.cuda.Event() for _ in range(n)]
            ends = [cupy.cuda.Event() for _ in range(n)]
            for i in range(n):
                for _ in range(reps):
                    self.flush_l2()
                starts[i].record(self.stream)
                t0 = clock()
                fn()
                host[i] = clock() - t0
                ends[i].record(self.stream)
            self.synchronize()
        self.last_host_us = [h * 1e6 for h in host]
        return [cupy.cuda.get_elapsed_time(s, e) * 1000.0 for s, e in zip(starts, ends)]

    def flush_time_us(self) -> float:
        """Median GPU time of one L2 flush: the host time an iteration may take unnoticed."""
        self.flush_l2()
        self.synchronize()
        samples = []
        for _ in range(20):
            start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
            start.record(self.stream)
            self.flush_l2()
            end.record(self.stream)
            end.synchronize()
            samples.append(self.cupy.cuda.get_elapsed_time(start, end) * 1000.0)
        return percentile(samples, 50)

# ---------------------------------------------------------------------------------------------
# GPU side: inputs, reference and implementations
# ---------------------------------------------------------------------------------------------


class Inputs:
    """q [B, Hq, D], k and v [B, L, Hkv, D] (contiguous), random normal bf16, never zeros. For a
    quantized shape, ``k`` and ``v`` are the bf16 values quantized on the GPU (`splitkv.QuantizedKV`,
    per-tensor scales) and ``k_bf16``, ``v_bf16`` the values they came from: `reference_output`
    reads those (the error end to end, the format's included), `kernel_reference` the dequantized
    cache (the programs' own error, which the check flags)."""

    def __init__(self, shape: Shape, seed: int, torch_mod=None):
        self.shape = shape
        self.torch = torch_mod
        b, hq, hkv, d, n = shape.batch, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.seq_len
        if torch_mod is not None:
            gen = torch_mod.Generator(device="cuda")
            gen.manual_seed(seed)
            opts = dict(device="cuda", dtype=torch_mod.bfloat16, generator=gen)
            self.q = torch_mod.randn((b, hq, d), **opts)
            self.k = torch_mod.randn((b, n, hkv, d), **opts)
            self.v = torch_mod.randn((b, n, hkv, d), **opts)
        else:
            import cupy

            rng = cupy.random.default_rng(seed)
            self.q = _cupy_bf16_randn(rng, (b, hq, d))
            self.k = _cupy_bf16_randn(rng, (b, n, hkv, d))
            self.v = _cupy_bf16_randn(rng, (b, n, hkv, d))
        self.k_bf16, self.v_bf16 = self.k, self.v
        if shape.quantized:
            import splitkv

            self.k = splitkv.quantize_kv(self.k_bf16, shape.kv_dtype)
            self.v = splitkv.quantize_kv(self.v_bf16, shape.kv_dtype)

    def empty_out(self):
        if self.torch is not None:
            return self.torch.empty_like(self.q)
        import cupy

        return cupy.empty_like(self.q)


def _cupy_bf16_randn(rng, shape):
    """Random normal values rounded to bf16 (round to nearest even), stored as uint16 bits."""
    import cupy

    bits = rng.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32)
    bits = (bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) >> 16
    return bits.astype(cupy.uint16)


def random_bf16_qkv(shape: Shape, seed: int = 0):
    """CuPy q [B, Hq, D], k and v [B, L, Hkv, D] of random bf16 values (uint16 bits), and an empty
    out like q: the inputs of the tools that time splitkv alone (bench/ablate.py and others)."""
    import cupy

    rng = cupy.random.default_rng(seed)
    b, hq, hkv, d, n = shape.batch, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.seq_len
    q = _cupy_bf16_randn(rng, (b, hq, d))
    k, v = _cupy_bf16_randn(rng, (b, n, hkv, d)), _cupy_bf16_randn(rng, (b, n, hkv, d))
    return q, k, v, cupy.empty_like(q)


def random_qkv(shape: Shape, seed: int = 0):
    """As random_bf16_qkv, with k and v quantized on the GPU into the shape's K/V format (as the
    benchmark does) when it is not bf16."""
    q, k, v, out = random_bf16_qkv(shape, seed)
    if shape.quantized:
        from .quantize import quantize_kv

        k, v = quantize_kv(k, shape.kv_dtype), quantize_kv(v, shape.kv_dtype)
    return q, k, v, out


def reference_output(inputs: Inputs, k=None, v=None):
    """fp32 attention of the bf16 inputs (torch only), query head h reading K/V head h // group;
    over ``k``, ``v`` (torch tensors) instead of the bf16 K/V when given."""
    torch = inputs.torch
    if torch is None:
        return None
    s = inputs.shape
    k = inputs.k_bf16 if k is None else k
    v = inputs.v_bf16 if v is None else v
    q = inputs.q.float().view(s.batch, s.num_kv_heads, s.group_size, s.head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", q, k.float()) * (1.0 / math.sqrt(s.head_dim))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v.float())
    return out.reshape(s.batch, s.num_qo_heads, s.head_dim)


def kernel_reference(inputs: Inputs):
    """For a quantized shape, the fp32 reference over the values the programs read (the cache
    dequantized on the host): what a program's own error is checked against, the format's rounding
    left out (`reference_output` keeps it: the error end to end). None for other shapes, or without
    torch."""
    torch = inputs.torch
    if torch is None or not inputs.shape.quantized:
        return None
    return reference_output(inputs, *(torch.from_numpy(c.dequantize_reference()).float().cuda()
                                      for c in (inputs.k, inputs.v)))


def compare(out, ref) -> dict:
    """max |out - ref| and that over max |ref|; both torch tensors, or both CuPy bf16 bit arrays."""
    if out is None or ref is None:
        return {}
    if hasattr(out, "float"):  # torch
        o = out.float().reshape(ref.shape)
        r = ref.float()
        diff = (o - r).abs().max().item()
        scale = r.abs().max().item()
    else:
        import cupy

        def to_f32(x):
            if x.dtype == cupy.uint16:  # bf16 bits: the high half of a float32
                return (x.astype(cupy.uint32) << 16).view(cupy.float32)
            return x.astype(cupy.float32)

        o = to_f32(out).reshape(ref.shape)
        r = to_f32(ref)
        diff = float(cupy.abs(o - r).max())
        scale = float(cupy.abs(r).max())
    if not (math.isfinite(diff) and math.isfinite(scale)):
        return {"max_abs_diff": None, "rel_diff": None, "nonfinite_output": True}
    return {"max_abs_diff": diff, "rel_diff": diff / scale if scale > 0 else None}


@dataclass
class Case:
    """A ready-to-time implementation: ``fn`` launches one call, ``output()`` returns its result."""

    fn: object
    output: object
    context: object = None
    info: dict = dataclasses.field(default_factory=dict)
    keep: object = None  # buffers the launches read that nothing else holds


def splitkv_case(inputs: Inputs, spec=None, variant: str | None = None, tuned: bool = True) -> Case:
    """``variant`` (from a --specs override) is handed to plan(), since the planner, not the spec,
    decides between dense and split. Without ``spec``, the programs come from this GPU's tuned
    table (``tuned=False``: the built-in heuristic's)."""
    import splitkv

    s = inputs.shape
    attn = splitkv.DecodeAttention(s.num_qo_heads, s.num_kv_heads, s.head_dim,
                                   q_dtype="bf16", kv_dtype=s.kv_dtype, spec=spec, tuned=tuned)
    if variant is None:
        attn.plan([s.seq_len] * s.batch, s.seq_len)
    else:
        attn.plan([s.seq_len] * s.batch, s.seq_len, variant=variant)
    out = inputs.empty_out()
    q, k, v = inputs.q, inputs.k, inputs.v

    def fn():
        attn.run(q, k, v, out=out)

    info = {"plan_info": str(getattr(attn, "plan_info", ""))}
    if spec is not None:
        info["spec_name"] = spec.name
    if attn.tuned_entry is not None:
        info["tuned_bucket"] = attn.tuned_entry.bucket.name
    return Case(fn, lambda: out, None, info)


def sdpa_case(inputs: Inputs, backend: str) -> Case:
    """torch SDPA restricted to one backend; GQA through enable_gqa, else K/V repeated to Hq heads."""
    torch = inputs.torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s = inputs.shape
    if s.quantized:
        raise Unavailable(f"SDPA reads bf16/fp16 K/V, not {s.kv_dtype}")
    which = getattr(SDPBackend, backend)

    def context():
        return sdpa_kernel(which)

    q4 = inputs.q.view(s.batch, s.num_qo_heads, 1, s.head_dim)
    # SDPA's native layout, made contiguous outside timing so that no hidden copy is timed.
    k4 = inputs.k.transpose(1, 2).contiguous()
    v4 = inputs.v.transpose(1, 2).contiguous()

    def attempt(k_, v_, **kw):
        with warnings.catch_warnings(record=True) as caught, context():
            warnings.simplefilter("always")
            try:
                result = F.scaled_dot_product_attention(q4, k_, v_, **kw)
                torch.cuda.current_stream().synchronize()
                return result, None
            except Exception as exc:  # noqa: BLE001 - a refused backend must not end the run
                return None, _reason(exc, caught)

    if s.group_size == 1:
        _, err = attempt(k4, v4)
        if err:
            raise Unavailable(err)
        mode, kw = "mha", {}
    else:
        _, err = attempt(k4, v4, enable_gqa=True)
        if err is None:
            mode, kw = "enable_gqa", {"enable_gqa": True}
        else:
            k4 = k4.repeat_interleave(s.group_size, dim=1)
            v4 = v4.repeat_interleave(s.group_size, dim=1)
            _, err2 = attempt(k4, v4)
            if err2:
                raise Unavailable(f"enable_gqa: {err}; repeated K/V: {err2}")
            mode, kw = "repeat kv", {}

    holder = {}

    def fn():
        holder["out"] = F.scaled_dot_product_attention(q4, k4, v4, **kw)

    def output():
        return holder["out"].view(s.batch, s.num_qo_heads, s.head_dim)

    info = {"gqa": mode}
    if mode == "repeat kv":
        info["gqa_refused"] = err
    return Case(fn, output, context, info)


def flashinfer_single_case(inputs: Inputs, use_tensor_cores: bool) -> Case:
    import flashinfer

    s = inputs.shape
    if s.batch != 1:
        raise ValueError("single-request decode only (B=1)")
    k, v, scales = _flashinfer_kv(inputs)
    q, k, v = inputs.q[0], k[0], v[0]  # [Hq, D] and [L, Hkv, D]: NHD, no copies
    holder = {}

    def fn():
        holder["out"] = flashinfer.single_decode_with_kv_cache(
            q, k, v, kv_layout="NHD", use_tensor_cores=use_tensor_cores, **scales)

    return Case(fn, lambda: holder["out"].unsqueeze(0), None, {"kv_layout": "NHD"})


def _flashinfer_kv(inputs: Inputs):
    """K and V as FlashInfer takes them: the bf16 tensors, or an FP8 cache's very bytes as
    float8_e4m3fn with its per-tensor scales (keyword arguments of the decode call); FlashInfer has
    no NVFP4 decode on Hopper."""
    s = inputs.shape
    if not s.quantized:
        return inputs.k, inputs.v, {}
    if s.kv_dtype != "fp8_e4m3":
        raise Unavailable(f"FlashInfer has no {s.kv_dtype} K/V decode for this GPU")
    torch = inputs.torch
    k, v = (c.values.view(torch.float8_e4m3fn) for c in (inputs.k, inputs.v))
    return k, v, {"k_scale": float(inputs.k.scale[0]), "v_scale": float(inputs.v.scale[0])}


PAGE_SIZE = 16


def flashinfer_paged_case(inputs: Inputs, use_tensor_cores: bool) -> Case:
    import flashinfer

    torch = inputs.torch
    s = inputs.shape
    k, v, scales = _flashinfer_kv(inputs)
    pages_per_seq = -(-s.seq_len // PAGE_SIZE)
    if s.seq_len % PAGE_SIZE == 0:
        # [B, L, Hkv, D] contiguous already is a page pool [B*L/16, 16, Hkv, D]: the same bytes.
        k_cache = k.view(s.batch * pages_per_seq, PAGE_SIZE, s.num_kv_heads, s.head_dim)
        v_cache = v.view(s.batch * pages_per_seq, PAGE_SIZE, s.num_kv_heads, s.head_dim)
    else:
        padded = (s.batch, pages_per_seq * PAGE_SIZE, s.num_kv_heads, s.head_dim)
        k_cache = torch.empty(padded, dtype=k.dtype, device="cuda")
        v_cache = torch.empty(padded, dtype=v.dtype, device="cuda")
        k_cache[:, : s.seq_len].copy_(k)
        v_cache[:, : s.seq_len].copy_(v)
        k_cache = k_cache.view(s.batch * pages_per_seq, PAGE_SIZE, s.num_kv_heads, s.head_dim)
        v_cache = v_cache.view(s.batch * pages_per_seq, PAGE_SIZE, s.num_kv_heads, s.head_dim)
    dev = "cuda"
    indptr = torch.arange(s.batch + 1, dtype=torch.int32, device=dev) * pages_per_seq
    indices = torch.arange(s.batch * pages_per_seq, dtype=torch.int32, device=dev)
    last_len = s.seq_len - (pages_per_seq - 1) * PAGE_SIZE
    last_page_len = torch.full((s.batch,), last_len, dtype=torch.int32, device=dev)
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
    wrapper.plan(indptr, indices, last_page_len, s.num_qo_heads, s.num_kv_heads, s.head_dim, PAGE_SIZE,
                 q_data_type=torch.bfloat16, kv_data_type=k.dtype)
    q = inputs.q
    out = torch.empty_like(q)
    cache = (k_cache, v_cache)
    try:
        wrapper.run(q, cache, out=out, **scales)
        takes_out = True
    except TypeError:
        takes_out = False
    holder = {"out": out}

    if takes_out:
        def fn():
            wrapper.run(q, cache, out=out, **scales)
    else:
        def fn():
            holder["out"] = wrapper.run(q, cache, **scales)

    info = {"page_size": PAGE_SIZE, "kv_layout": "NHD", "out_preallocated": takes_out}
    return Case(fn, lambda: holder["out"], None, info, keep=(workspace, indptr, indices, last_page_len, wrapper))


PEER_SETUPS = {
    "sdpa-flash": lambda inputs: sdpa_case(inputs, "FLASH_ATTENTION"),
    "sdpa-cudnn": lambda inputs: sdpa_case(inputs, "CUDNN_ATTENTION"),
    "flashinfer-single": lambda inputs: flashinfer_single_case(inputs, False),
    "flashinfer-single-tc": lambda inputs: flashinfer_single_case(inputs, True),
    "flashinfer-paged": lambda inputs: flashinfer_paged_case(inputs, False),
    "flashinfer-paged-tc": lambda inputs: flashinfer_paged_case(inputs, True),
}
#: --peers groups
PEER_GROUPS = {
    "sdpa": ("sdpa-flash", "sdpa-cudnn"),
    "flashinfer": ("flashinfer-single", "flashinfer-single-tc", "flashinfer-paged", "flashinfer-paged-tc"),
}


def parse_peers(text: str) -> list[str]:
    """'all', 'none', or a comma list of peer names and groups (sdpa, flashinfer)."""
    text = str(text).strip().lower()
    if text in ("all", ""):
        return list(PEER_SETUPS)
    if text == "none":
        return []
    chosen = []
    for name in text.split(","):
        name = name.strip()
        if not name:
            continue
        names = PEER_GROUPS.get(name, (name,))
        for n in names:
            if n not in PEER_SETUPS:
                raise ValueError(f"peers: unknown peer {name!r} (known: {sorted(PEER_SETUPS)} "
                                 f"and groups {sorted(PEER_GROUPS)})")
            if n not in chosen:
                chosen.append(n)
    return chosen


def measure_case(harness: Harness, setup, ref=None) -> tuple[dict, object]:
    """Set up, run once and check against ``ref``, then time. Never raises: a failure is an entry
    {'status': 'n/a', 'reason': ...}. Returns (entry, the case's output or None)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            case = setup()
            with (case.context() if case.context is not None else contextlib.nullcontext()):
                case.fn()  # compiles / JIT-builds outside timing
            harness.synchronize()
            out = case.output()
    except Exception as exc:  # noqa: BLE001 - report, never crash the run
        return {"status": "n/a", "reason": _reason(exc, caught)}, None
    entry = {"status": "ok"}
    entry.update(case.info)
    entry.update(compare(out, ref))
    try:
        times = harness.time(case.fn, context=case.context)
    except Exception as exc:  # noqa: BLE001
        return {"status": "n/a", "reason": "while timing: " + _reason(exc)}, out
    entry.update(summarize(times))
    entry["host_us"] = percentile(harness.last_host_us, 50)
    entry["flush_reps"] = harness.last_flush_reps
    if harness.flush_us and entry["host_us"] > HOST_BOUND_FRACTION * harness.flush_us * harness.last_flush_reps:
        # The GPU may have waited for the launch inside the timed region.
        entry["host_bound"] = True
    return entry, out


def copy_bandwidth(harness: Harness, nbytes: int, iters: int | None = None) -> dict:
    """The copy ceiling: timings of a device-to-device copy of ``nbytes`` (``gbps`` counts the
    bytes read and written); its buffers are freed on return."""
    from .floor import DeviceCopy

    copier = DeviceCopy(nbytes)
    stats = summarize(harness.time(copier, iters))
    stats.update(bytes=copier.nbytes, bytes_moved=copier.bytes_moved, gbps=gbps(copier.bytes_moved, stats["median_us"]))
    return stats


def _free_memory(torch_mod):
    import gc

    import cupy

    gc.collect()
    if torch_mod is not None:
        torch_mod.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()


def bench_shape(harness: Harness, floor, shape: Shape, peers: list[str], spec_overrides: list[dict],
                arch: str, copy_gbps: float | None, seed: int, torch_error: str | None = None) -> dict:
    torch = harness.torch
    entry = {"shape": shape.to_dict(), "label": shape.label, "token": shape.token,
             "bytes": shape.bytes_dict()}
    inputs = Inputs(shape, seed, torch)
    end_to_end = reference_output(inputs)  # quantized shapes: over the values before quantization
    kernel_ref = kernel_reference(inputs)
    ref = kernel_ref if kernel_ref is not None else end_to_end  # what outputs are checked against

    floor_entry, _ = measure_case(harness, lambda: Case(floor.reader(shape.total_bytes), lambda: None))
    floor_us = floor_entry.get("median_us") if floor_entry["status"] == "ok" else None
    if floor_us:
        floor_entry["gbps"] = gbps(shape.total_bytes, floor_us)
    entry["floor"] = floor_entry

    sk, sk_out = measure_case(harness, lambda: splitkv_case(inputs), ref)
    if sk["status"] == "ok":
        sk.update(derived_figures(shape, sk["median_us"], floor_us, copy_gbps))
    if kernel_ref is not None and sk_out is not None:  # what the format costs, reported, not flagged
        sk["end_to_end_rel_diff"] = compare(sk_out, end_to_end).get("rel_diff")
    entry["splitkv"] = sk

    specs = {}
    base = builtin_spec(shape, arch) if spec_overrides else None
    for overrides in spec_overrides:
        label = spec_label(overrides)
        try:
            spec = spec_for_shape(overrides, shape, arch, base)
        except (ValueError, TypeError) as exc:
            specs[label] = {"status": "n/a", "reason": _reason(exc)}
            continue
        variant = overrides.get("variant")
        e, _ = measure_case(harness, lambda: splitkv_case(inputs, spec, variant),
                            sk_out if sk_out is not None else ref)
        if e["status"] == "ok":
            e.update(derived_figures(shape, e["median_us"], floor_us, copy_gbps))
        specs[label] = e
    if spec_overrides:
        entry["specs"] = specs

    # Peers are checked against splitkv's output; against the fp32 reference if splitkv failed.
    check = sk_out if sk_out is not None else ref
    peer_entries = {}
    for name in peers:
        if torch is None:
            peer_entries[name] = {"status": "n/a", "reason": f"torch unavailable: {torch_error}"}
            continue
        if name.startswith("flashinfer-single") and shape.batch != 1:
            continue  # single-request API: B=1 only, not a failure
        e, _ = measure_case(harness, lambda: PEER_SETUPS[name](inputs), check)
        if sk_out is None and e.get("max_abs_diff") is not None:
            e["checked_against"] = "fp32 reference"
        if e["status"] == "ok":
            e["gbps"] = gbps(shape.total_bytes, e["median_us"])
        peer_entries[name] = e
    entry["peers"] = peer_entries
    entry["best_flashinfer"] = best_of(peer_entries, "flashinfer")
    entry["best_peer"] = best_of(peer_entries)

    del inputs, ref, kernel_ref, end_to_end, sk_out
    _free_memory(torch)
    return entry

# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


def _version_text(v: int) -> str:
    """CUDA's integer versions: 12080 -> '12.8'."""
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "?"


def gpu_info() -> dict:
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    attrs = dev.attributes
    info = {
        "name": name,
        "sm_count": int(attrs["MultiProcessorCount"]),
        "arch": "sm_" + dev.compute_capability,
        "l2_bytes": int(attrs.get("L2CacheSize", 0)),
        "memory_bytes": int(props.get("totalGlobalMem", 0)),
        "driver_cuda_version": _version_text(cupy.cuda.runtime.driverGetVersion()),
        "cuda_runtime_version": _version_text(cupy.cuda.runtime.runtimeGetVersion()),
        "driver_version": None,
        "nvrtc_version": None,
    }
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
        info["nvrtc_version"] = f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                              f"--id={dev.id}"], capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            info["driver_version"] = smi.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def cluster_layout_or_none(arch: str, probe=cluster_layout.probe) -> dict | None:
    """``probe()`` (`cluster_layout.probe`) where the GPU has clusters (sm_90+), else None; a
    probe that fails gives ``{"error": reason}`` and the run goes on. Where thread-block clusters
    land differs between chips of one model, and the whole-row cluster plans with it
    (BENCHMARKS.md), so every result records it."""
    if arch_number(arch) < 90:
        return None
    try:
        return probe()
    except Exception as exc:  # noqa: BLE001 - a record, not a measurement: it must not end the run
        return {"error": _reason(exc)}


def describe_cluster_layout(layout: dict) -> str:
    """The cluster layout's line in the output and the markdown (or why there is none)."""
    if "error" in layout:
        return f"Cluster layout not recorded ({layout['error']})"
    return cluster_layout.describe(layout)


def software_info(torch_mod) -> dict:
    import cupy

    info = {"python": platform.python_version(), "cupy": cupy.__version__, "torch": None, "torch_cuda": None,
            "cudnn": None, "flashinfer": None, "triton": None, "splitkv": None}
    try:
        import splitkv

        info["splitkv"] = getattr(splitkv, "__version__", None)
    except Exception:  # noqa: BLE001
        pass
    if torch_mod is not None:
        info["torch"] = torch_mod.__version__
        info["torch_cuda"] = torch_mod.version.cuda
        try:
            v = torch_mod.backends.cudnn.version()
            info["cudnn"] = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v and v >= 10000 else v
        except Exception:  # noqa: BLE001
            pass
    for mod in ("flashinfer", "triton"):
        try:
            info[mod] = getattr(__import__(mod), "__version__", "unknown")
        except Exception as exc:  # noqa: BLE001
            info[mod + "_import_error"] = _reason(exc)[:200]
    return info


def _import_torch():
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return None, _reason(exc)
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return torch, None

# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m splitkv.bench",
        description="Time splitkv decode attention beside torch SDPA (flash, cuDNN) and FlashInfer, "
                    "against the read floor and the device copy bandwidth measured in the same run.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--shapes", nargs="+", metavar="B:Hq:Hkv:D:L",
                       help="shapes to time instead of the default table (L may be written 4k)")
    which.add_argument("--quick", action="store_true", help="a 3-shape subset of the default table")
    p.add_argument("--iters", type=int, default=200, help="timed calls per figure (default 200; >= 100 advised)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before timing (default 10)")
    p.add_argument("--specs", nargs="+", action="extend", default=[], metavar="FIELD=V,...",
                   help="KernelSpec overrides to time beside splitkv's own choice, e.g. "
                        "warps=8,tile_tokens=16,stages=2: fields replaced in splitkv's built-in CTA shape "
                        "(head_dim, group and dtypes come from the shape; variant= is handed to plan())")
    p.add_argument("--peers", default="all",
                   help="peers to run: all (default), none, or a comma list of "
                        + ", ".join(list(PEER_SETUPS) + list(PEER_GROUPS)))
    p.add_argument("--flush-mb", type=int, default=256,
                   help="L2 flush buffer in MiB (default 256; raised to 2x the L2 when smaller)")
    p.add_argument("--copy-mb", type=int, default=1024,
                   help="device-to-device copy size for the bandwidth ceiling in MiB (default 1024)")
    p.add_argument("--floor-sweep", action="store_true",
                   help="also time an empty kernel and the read floor at 1 MiB .. 1 GiB")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="directory for the JSON result (default bench/results/ of the checkout)")
    p.add_argument("--no-json", action="store_true", help="do not write the JSON result")
    p.add_argument("--commit", default=None,
                   help="commit to record when running from a copy of the checkout without git "
                        "(default: git rev-parse --short HEAD, or 'unknown')")
    p.add_argument("--markdown", type=Path, default=None, metavar="FILE",
                   help="append a markdown section (GPU, date, commit, table) to FILE, e.g. BENCHMARKS.md")
    return p


#: Options whose value is a path on the machine that ran the benchmark.
_PATH_OPTIONS = ("--out", "--markdown")


def portable_argv(argv) -> list:
    """The command line as recorded in the result: path options keep only their last component,
    so that a result file names no directory of the machine that produced it."""
    out, argv = [], [str(a) for a in argv]
    for i, arg in enumerate(argv):
        option, eq, value = arg.partition("=")
        if eq and option in _PATH_OPTIONS:
            arg = f"{option}={Path(value).name}"
        elif i > 0 and argv[i - 1] in _PATH_OPTIONS:
            arg = Path(arg).name
        out.append(arg)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.shapes:
            args.shape_list = parse_shapes(args.shapes)
        elif args.quick:
            args.shape_list = list(QUICK_SHAPES)
        else:
            args.shape_list = list(DEFAULT_SHAPES)
        args.spec_overrides = [parse_spec_override(s) for s in args.specs]
        args.peer_list = parse_peers(args.peers)
    except ValueError as exc:
        parser.error(str(exc))
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be non-negative")
    if args.flush_mb < 1 or args.copy_mb < 1:
        parser.error("--flush-mb and --copy-mb must be positive")
    return args


def _print(text: str = ""):
    print(text, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(AttributeError, ValueError):
        # A console that cannot encode 'µ' must not end a run minutes in.
        sys.stdout.reconfigure(errors="replace")
    if args.iters < 100:
        _print(f"note: --iters {args.iters} is below the protocol's 100 timed calls")

    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device().attributes  # noqa: B018 - fails early without a usable GPU
    except Exception as exc:  # noqa: BLE001
        _print(f"error: no usable CUDA device through CuPy ({_reason(exc)})")
        return 1

    from . import floor as floor_mod

    torch, torch_error = _import_torch()
    now = _dt.datetime.now(_dt.timezone.utc)
    commit, dirty = (args.commit, None) if args.commit else git_commit()
    gpu = gpu_info()
    gpu["cluster_layout"] = cluster_layout_or_none(gpu["arch"])
    flush_bytes = max(args.flush_mb * 2**20, 2 * gpu["l2_bytes"])
    result = {
        "schema": 1,
        "gpu": gpu,
        "software": software_info(torch),
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.isoformat(timespec="seconds"),
        "commit": commit,
        "dirty": dirty,
        "argv": portable_argv(sys.argv[1:] if argv is None else argv),
        "protocol": {"iters": args.iters, "warmup": args.warmup, "flush_bytes": flush_bytes,
                     "timer": "CUDA events around each call, one stream, L2 flushed (memset) before each call",
                     "seed": args.seed, "dtype": "bf16"},
        "torch_error": torch_error,
        "specs": [spec_label(o) for o in args.spec_overrides],
        "copy": None,
        "shapes": [],
    }
    json_path = None
    if not args.no_json:
        out_dir = args.out if args.out is not None else default_results_dir()
        json_path = unique_path(out_dir, result_filename(gpu["name"], result["date"], commit))

    def save():
        if json_path is not None:
            write_json(result, json_path)

    _print(f"{gpu['name']}: {gpu['sm_count']} SMs, {gpu['arch']}, L2 {gpu['l2_bytes'] / 2**20:.0f} MiB, "
           f"driver {gpu['driver_version'] or '?'} (CUDA {gpu['driver_cuda_version']}); commit {commit}"
           + (" (uncommitted changes)" if dirty else ""))
    if gpu["cluster_layout"] is not None:
        _print(describe_cluster_layout(gpu["cluster_layout"]))
    if torch is None:
        _print(f"torch unavailable ({torch_error}): CuPy inputs, no peers")

    harness = Harness(args.iters, args.warmup, flush_bytes, torch)
    with harness.active():
        harness.flush_us = harness.flush_time_us()
        result["protocol"]["flush_us"] = harness.flush_us
        # Copy ceiling first, then free its 2 GiB before the shapes allocate.
        try:
            result["copy"] = copy_bandwidth(harness, args.copy_mb * 2**20)
        except Exception as exc:  # noqa: BLE001
            result["copy"] = {"status": "n/a", "reason": _reason(exc)}
        _free_memory(torch)
        copy_gbps = (result["copy"] or {}).get("gbps")
        if copy_gbps:
            _print(f"copy bandwidth: {copy_gbps:.0f} GB/s ({args.copy_mb} MiB device-to-device, read + written, "
                   f"median of {args.iters})")
        else:
            _print(f"copy bandwidth: {_na(result['copy'], 200)}")

        capacity = max([s.total_bytes for s in args.shape_list] + ([2**30] if args.floor_sweep else []))
        floor = floor_mod.ReadFloor(capacity, gpu["sm_count"])

        if args.floor_sweep:
            sweep = []
            empty, _ = measure_case(harness, lambda: Case(floor.empty(), lambda: None))
            sweep.append(dict(empty, bytes=0, what="empty kernel"))
            for mib in (1, 4, 16, 64, 256, 1024):
                e, _ = measure_case(harness, lambda: Case(floor.reader(mib * 2**20), lambda: None))
                if e["status"] == "ok":
                    e["gbps"] = gbps(mib * 2**20, e["median_us"])
                sweep.append(dict(e, bytes=mib * 2**20, what=f"read {mib} MiB"))
            result["floor_sweep"] = sweep
            _print("read floor: " + "; ".join(
                f"{e['what']} {_fmt_us(e['median_us'])} µs" if _ok(e) else f"{e['what']} {_na(e)}" for e in sweep))
        save()

        total = len(args.shape_list)
        for i, shape in enumerate(args.shape_list, 1):
            try:
                entry = bench_shape(harness, floor, shape, args.peer_list, args.spec_overrides,
                                    gpu["arch"], copy_gbps, args.seed, torch_error)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory making the inputs
                entry = {"shape": shape.to_dict(), "label": shape.label, "token": shape.token,
                         "bytes": shape.bytes_dict(), "splitkv": {"status": "n/a", "reason": _reason(exc)},
                         "floor": None, "peers": {}, "best_peer": None, "best_flashinfer": None}
                _free_memory(torch)
            result["shapes"].append(entry)
            save()
            _print(progress_line(i, total, entry))

    _print()
    _print(render_text_table(table_rows(result)))
    if json_path is not None:
        _print(f"\nresults: {json_path}")
    if args.markdown is not None:
        write_markdown(result, args.markdown)
        _print(f"markdown section appended to {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
