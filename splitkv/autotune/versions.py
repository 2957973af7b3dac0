"""Which Optuna study a measurement belongs to: its name (GPU, arch, key, bucket) and the versions of
the code it measured, so that a study never mixes figures of programs or plans that differ."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from ..tuned.keys import Bucket, TuneKey, gpu_file_stem


def study_name(prefix: str, gpu_name: str, arch: str, key: TuneKey, bucket: Bucket, version: str = "") -> str:
    """One study per (GPU model, arch, key, bucket, code version), under an optional user prefix."""
    return f"{prefix}{gpu_file_stem(gpu_name)}-{arch}-{key.label}-{bucket.name}" + (f"-{version}" if version else "")


#: Host modules (besides the templates) whose code changes what a measured program does.
_READ_PATH_MODULES = ("tensor_map.py",)


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """8 hex digits of the splitkv version, the templates and the tensor maps' encoding: a study
    measured other programs when they differ (the maps' L2 promotion alone moved NVFP4 by 11%), so
    such a change starts new studies instead of resuming old figures."""
    from .. import __version__

    digest = hashlib.sha256(__version__.encode())
    root = Path(__file__).resolve().parent.parent
    # Every file under templates/, sub-folders included: the kernel bodies are headers there.
    templates = sorted(path for path in (root / "templates").rglob("*") if path.is_file())
    for path in [*templates, *(root / name for name in _READ_PATH_MODULES)]:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:8]


#: The modules whose code decides how a candidate is planned on a bucket (what it launches).
_PLANNER_MODULES = ("plan.py", "planning.py", "work_units.py", "heuristics.py", "runtime.py", "tuned/lookup.py")


@functools.lru_cache(maxsize=1)
def planner_version() -> str:
    """8 hex digits of the planner's code: a confirmed outcome kept in a study stands only while
    the candidates would be planned the same (`splitkv.autotune.studies.saved_outcome`)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for name in _PLANNER_MODULES:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    return digest.hexdigest()[:8]
