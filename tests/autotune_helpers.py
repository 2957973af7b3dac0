"""What the autotuner's CPU tests (tests/test_autotune_*.py) share: the GPU, arch and keys they tune,
programs the heuristic would not choose, table headers and entries, in-memory studies, and the cost
model as an objective that records what it is asked to compile and measure."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitkv.autotune import costmodel, objective, search, studies, writing
from splitkv.heuristics import default_spec
from splitkv.spec import KernelSpec
from splitkv.tuned import keys, lookup, tables
from splitkv.tuned.keys import TuneKey

GPU = "NVIDIA Fake GPU"
ARCH = "sm_90"
KEY = TuneKey(128, 4)  # bf16 queries and K/V, contiguous caches
OTHER_KEY = TuneKey(64, 8, "fp16", "fp16")
OTHER_SPLIT = default_spec(ARCH, 64, 8, "fp16", "fp16").replace(cluster=8)
#: A split program the heuristic would not choose: longer chunks, a deeper ring, no cluster.
TUNED_SPLIT = default_spec(ARCH, 128, 4).replace(chunk_size=256, stages=3, cluster=1)
#: A dense program the heuristic would not choose: eight warps of 16-token tiles through cp.async.
TUNED_DENSE = default_spec(ARCH, 128, 4, variant="dense").replace(warps=8, tile_tokens=16, chunk_size=128,
                                                                  stages=3, kv_copy="cp_async")


def header(gpu: str = GPU, arch: str = ARCH) -> dict:
    return writing.make_header(gpu, arch, 132, "13.0", "13.0", "0.1.0", date="2026-01-02")


def entry(bucket: str, spec: KernelSpec | None = None, key: TuneKey = KEY, tuned_us: float = 10.0,
          default_us: float = 12.5, **extra) -> tables.Entry:
    extra.setdefault("trials", 20)  # a table's entries record at least one trial
    return tables.Entry(key, keys.parse_bucket(bucket), spec, tuned_us, default_us, date="2026-01-02", **extra)


def save_table(folder: Path, entries, gpu: str = GPU, arch: str = ARCH, header_arch: str | None = None) -> Path:
    """``entries`` saved as the table of ``gpu`` under ``folder/<arch>/`` (its header may claim another arch)."""
    path = tables.table_path(folder, arch, gpu)
    writing.save(path, header(gpu, header_arch or arch), entries)
    return path


def memory_study(seed: int = 0):
    return studies.open_study("test", None, seed=seed)


class Recording(costmodel.CostModelObjective):
    """The cost model, recording what it is asked to compile and measure (a candidate is its own
    one program); candidates that ``fails`` names (a predicate on the spec) raise TrialFailed, those
    ``refuses`` names fail to compile."""

    jobs = 2

    def __init__(self, key=KEY, bucket="b1-l2k", fails=lambda spec: False, refuses=lambda spec: False):
        super().__init__(key, keys.parse_bucket(bucket), ARCH)
        self.fails, self.refuses = fails, refuses
        self.prepared, self.measured = [], []

    def programs(self, spec) -> list:
        return [spec]

    def compile(self, program) -> None:
        self.prepared.append(program)
        if self.refuses(program):
            raise RuntimeError("refused by the test")

    def measure(self, spec, iters=None):
        self.measured.append(spec)
        if spec is not None and self.fails(spec):
            raise objective.TrialFailed(f"mismatch: {spec.name} is wrong on purpose")
        return super().measure(spec, iters)


def searched(trials: int, bucket: str = "b1-l2k", **recording):
    """A fresh study of ``bucket``, the heuristic's programs enqueued, searched for ``trials`` measured
    trials by a Recording (``recording``: its options): (study, objective, trials run)."""
    study, obj = memory_study(), Recording(bucket=bucket, **recording)
    search.enqueue_defaults(study, KEY, keys.parse_bucket(bucket), ARCH)
    done = search.run_trials(study, KEY, ARCH, obj, trials=trials)
    return study, obj, done


@pytest.fixture
def folders(monkeypatch, tmp_path):
    """(user folder, shipped folder), both empty, and nothing remembered from earlier lookups."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    monkeypatch.setattr(lookup, "shipped_dir", lambda: shipped)
    monkeypatch.setenv(lookup.ENV_DIR, str(user))
    lookup.forget()
    yield user, shipped
    lookup.forget()
