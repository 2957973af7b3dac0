"""Results files: where a run came from (commit, GPU, software), their names, strict JSON, the
latest file of a folder, and the merge of the files of one sweep split over several calls.

A result is one JSON object (``schema`` 2):

* ``gpu``, ``software``, ``date``, ``timestamp`` (UTC), ``commit``, ``dirty``, ``argv``;
* ``protocol``: the settings of the protocols (rounds, calls per round, flush bytes, ...);
* ``implementations``: per name, its kind (splitkv, peer, floor) and, for splitkv trees, the
  commit each side is (``tree``: this one or a ``--baseline`` checkout);
* ``copy`` (the copy bandwidth), ``floor_sweep`` when asked;
* ``shapes``: per shape its label, token, bytes, serving layers, and per implementation its status
  ('ok', 'wrong': failed its check, 'n/a': could not run), its check and, per protocol, the median
  of every round's samples pooled with p10/p90/min/mean/n and each round's median.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path

from .. import cluster_layout
from ..arch import arch_number

SCHEMA = 2


def repo_root() -> Path | None:
    """The checkout this package runs from, or None when it is installed elsewhere."""
    here = Path(__file__).resolve().parent.parent.parent
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if top.returncode != 0:
        return None
    root = Path(top.stdout.strip())
    # A site-packages that happens to sit inside some other repository is not our checkout.
    return root if (root / "splitkv" / "bench" / "__init__.py").is_file() else None


def git_commit(root: Path | None = None) -> tuple[str, bool]:
    """(short commit, working tree has uncommitted changes); ('unknown', False) outside a checkout."""
    root = root if root is not None else repo_root()
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


def result_filename(gpu_name: str, date: str, commit: str, baseline: str | None = None, part: str | None = None) -> str:
    """'<gpu-name>-<UTC date>-<commit>[-vs-<baseline commit>][-part<i>of<n>].json', e.g.
    'NVIDIA_H200-2026-11-29-c69090d.json'."""
    name = f"{safe_name(gpu_name)}-{date}-{safe_name(commit) or 'unknown'}"
    if baseline:
        name += f"-vs-{safe_name(baseline) or 'unknown'}"
    if part:
        i, _, n = str(part).replace(" ", "").partition("/")
        name += f"-part{i}of{n}"
    return name + ".json"


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
    root = repo_root()
    return (root if root is not None else Path.cwd()) / "bench" / "results"


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


def write_json(result: dict, path: Path) -> Path:
    """Write atomically, so that an interrupted run leaves the previous complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(json_ready(result), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_result(path: Path) -> dict:
    """A results file of this schema; ValueError naming the file otherwise."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a results file of schema {SCHEMA} (older runs have no protocols)")
    return data


def latest_result(directory: Path, gpu: str | None = None, timing: str | None = None) -> Path:
    """The results file of schema 2 in ``directory`` with the latest ``timestamp`` (the file's own
    record: a checkout's file times say nothing), of the GPU named ``gpu`` when given, and with
    ``timing`` 'peers' or 'checkouts' of a run that timed peers (the current figures) or another
    checkout (an A/B)."""
    if timing not in (None, "peers", "checkouts"):
        raise ValueError(f"timing: expected None, 'peers' or 'checkouts', got {timing!r}")
    best = None
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = load_result(path)
        except ValueError:
            continue
        if gpu and data.get("gpu", {}).get("name") != gpu:
            continue
        if timing is not None and not _times(data, "splitkv" if timing == "checkouts" else "peer"):
            continue
        key = (str(data.get("timestamp", "")), path.name)
        if best is None or key > best[0]:
            best = (key, path)
    if best is None:
        raise ValueError(f"{directory}: no results file of schema {SCHEMA}" + (f" for {gpu}" if gpu else ""))
    return best[1]


def _times(result: dict, kind: str) -> bool:
    """Whether the run timed a peer (``kind`` 'peer') or another checkout of splitkv beside this
    tree ('splitkv': ``--baseline``)."""
    return any(impl.get("kind") == kind and (kind != "splitkv" or impl.get("tree") not in (None, "this"))
               for impl in (result.get("implementations") or {}).values())


#: What the files of one sweep must share to be merged.
_SAME = ("gpu", "commit", "implementations", "protocol")


def merge_results(results: list) -> dict:
    """One result of the files of a sweep split by ``--part`` or ``--shapes``: the first file's
    header, every file's shapes in order (a shape timed twice keeps its last figures), and the
    files' timestamps and command lines under ``parts``. Raises ValueError when the files differ in
    GPU, commits, implementations or protocol settings: such figures belong to separate tables."""
    if not results:
        raise ValueError("merge: no results")
    first = results[0]
    for other in results[1:]:
        for key in _SAME:
            a, b = _comparable(first.get(key), key), _comparable(other.get(key), key)
            if a != b:
                raise ValueError(f"merge: the files differ in {key!r}; merge only the parts of one sweep")
    merged = dict(first)
    shapes, order = {}, []
    for result in results:
        for entry in result.get("shapes", []):
            if entry["token"] not in shapes:
                order.append(entry["token"])
            shapes[entry["token"]] = entry
    merged["shapes"] = [shapes[t] for t in order]
    merged["not_run"] = [t for r in results for t in r.get("not_run", []) if t not in shapes]
    merged["parts"] = [{"timestamp": r.get("timestamp"), "argv": r.get("argv")} for r in results]
    merged["timestamp"] = max(str(r.get("timestamp", "")) for r in results)
    return merged


def _comparable(value, key):
    if key == "gpu" and isinstance(value, dict):
        return value.get("name")
    if key == "protocol" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "flush_us"}  # measured, not set
    return value


#: Options whose value is a path on the machine that ran the benchmark.
_PATH_OPTIONS = ("--out", "--markdown", "--baseline")


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


def software_info(torch_mod) -> dict:
    """Versions of what the figures depend on; a package that fails to import is recorded so."""
    from importlib import metadata

    info = {"python": platform.python_version()}
    # A module without __version__ is named by its distribution's version (fa3-fwd has none).
    for mod, dist in (("cupy", "cupy"), ("splitkv", "splitkv"), ("flashinfer", "flashinfer-python"),
                      ("fa3_fwd_interface", "fa3-fwd"), ("triton", "triton")):
        try:
            version = getattr(__import__(mod), "__version__", None)
            if version is None:
                try:
                    version = metadata.version(dist)
                except metadata.PackageNotFoundError:
                    version = "unknown"
            info[mod] = version
        except Exception as exc:  # noqa: BLE001
            info[mod] = None
            info[mod + "_import_error"] = " ".join(str(exc).split())[:200]
    if torch_mod is not None:
        info["torch"] = torch_mod.__version__
        info["torch_cuda"] = torch_mod.version.cuda
        try:
            v = torch_mod.backends.cudnn.version()
            info["cudnn"] = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v and v >= 10000 else v
        except Exception:  # noqa: BLE001
            pass
    return info


def cluster_layout_or_none(arch: str, probe=cluster_layout.probe) -> dict | None:
    """``probe()`` (`cluster_layout.probe`) where the GPU has clusters (sm_90+), else None; a
    probe that fails gives ``{"error": reason}`` and the run goes on. Where thread-block clusters
    land differs between chips of one model, and the whole-row cluster plans with it, so every
    result records it."""
    if arch_number(arch) < 90:
        return None
    try:
        return probe()
    except Exception as exc:  # noqa: BLE001 - a record, not a measurement: it must not end the run
        return {"error": " ".join(f"{type(exc).__name__}: {exc}".split())[:400]}


def describe_cluster_layout(layout: dict) -> str:
    """The cluster layout's line in the output and the markdown (or why there is none)."""
    if "error" in layout:
        return f"Cluster layout not recorded ({layout['error']})"
    return cluster_layout.describe(layout)
