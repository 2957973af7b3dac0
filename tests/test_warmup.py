"""DecodeAttention.warmup: every program a plan of the range may launch is compiled and loaded
ahead, so that no such plan loads anything new (on the fake GPU of tests/fake_gpu.py, with the
compiler stood in for: what is checked is which programs, not their code)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from splitkv import DecodeAttention, runtime, warmup
from splitkv.heuristics import default_spec
from splitkv.tuned import lookup
from tests.fake_gpu import fake_gpu  # noqa: F401 - a fixture, used by name


@pytest.fixture
def compiled(monkeypatch):
    """The specs compile_cubin was asked for (nothing is compiled)."""
    import splitkv.codegen.compile as compile_module

    asked = []

    def compile_cubin(spec):
        asked.append(spec)
        return types.SimpleNamespace(cached=len(asked) % 2 == 0)
    monkeypatch.setattr(compile_module, "compile_cubin", compile_cubin)
    return asked


def _random_plans(attn, rng, max_batch, max_len, count, block_table=None):
    """``count`` plans of random batches in the range, of every variant."""
    for _ in range(count):
        batch = int(rng.integers(1, max_batch + 1))
        kind = rng.random()
        if kind < 0.3:
            lens = np.full(batch, int(rng.integers(1, max_len + 1)))
        elif kind < 0.6:
            lens = rng.integers(0, max_len + 1, size=batch)
        else:
            lens = np.where(rng.random(batch) < 0.2, rng.integers(max_len // 2, max_len + 1, size=batch),
                            rng.integers(0, 2000, size=batch))
        if lens.max() == 0:
            lens[0] = 1
        choice = rng.random()
        args = {}
        if choice < 0.15:
            args = {"variant": "units"}
        elif choice < 0.25:
            args = {"variant": "dense"}
        elif choice < 0.35:
            args = {"variant": "split", "num_splits": int(rng.integers(2, 64))}
        table = None
        if block_table is not None:
            table = np.arange(batch * block_table, dtype=np.int32).reshape(batch, block_table)
        attn.plan(lens.tolist(), block_table=table, **args)


def _check_covers(fake_gpu, attn, report, rng, max_batch, max_len, block_table=None):
    warm = {spec for spec, _ in fake_gpu.loads}
    assert len(warm) == report.programs
    fake_gpu.loads.clear()
    _random_plans(attn, rng, max_batch, max_len, 300, block_table)
    launched = {spec for spec, _ in fake_gpu.loads}
    missing = launched - warm
    assert not missing, f"plans loaded programs the warm-up did not: {sorted(s.name for s in missing)}"
    clusters = {getattr(spec, "cluster", 1) for spec in launched}
    variants = {getattr(spec, "variant", "merge") for spec in launched}
    assert len(clusters) >= 2 and {"dense", "split", "units", "merge"} <= variants, (clusters, variants)
    return launched


def test_a_warm_up_covers_every_plan_of_the_range(fake_gpu, compiled):
    attn = DecodeAttention(32, 8, 128, tuned=False)
    report = attn.warmup(max_len=131072, max_batch=64, jobs=2)
    assert report.programs == len(compiled) == len(set(compiled))
    assert report.compiled == report.programs - report.programs // 2  # the stand-in's cached flags
    assert report.tuned_entries == 0
    _check_covers(fake_gpu, attn, report, np.random.default_rng(1), 64, 131072)


def test_a_warm_up_covers_the_tuned_entries_of_the_range(fake_gpu, compiled, monkeypatch):
    # The shipped H200 table: its entries' programs beside the built-in ones.
    monkeypatch.setattr(runtime, "gpu_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(lookup, "shipped_dir", lambda: lookup.Path(lookup.__file__).parent.parent / "tuned_configs")
    lookup.forget()
    attn = DecodeAttention(32, 8, 128)
    assert attn.tuned_source is not None
    report = attn.warmup(max_len=65536, max_batch=128)
    assert report.tuned_entries > 1
    launched = _check_covers(fake_gpu, attn, report, np.random.default_rng(2), 128, 65536)
    builtin = {default_spec("sm_90", 128, 4, variant=v) for v in ("split", "dense")}
    assert launched - builtin, "the plans ran tuned programs only the table names"


def test_a_small_range_warms_fewer_entries(fake_gpu, compiled, monkeypatch):
    monkeypatch.setattr(runtime, "gpu_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(lookup, "shipped_dir", lambda: lookup.Path(lookup.__file__).parent.parent / "tuned_configs")
    lookup.forget()
    attn = DecodeAttention(32, 8, 128)
    small = attn.warmup(max_len=2048, max_batch=1)
    large = attn.warmup(max_len=131072, max_batch=256)
    assert small.tuned_entries < large.tuned_entries and small.programs <= large.programs


def test_a_paged_quantized_instance(fake_gpu, compiled):
    attn = DecodeAttention(16, 2, 128, kv_dtype="fp8_e4m3", page_size=16, kv_layout="HND", tuned=False)
    report = attn.warmup(max_len=16384, max_batch=16)
    assert all(getattr(spec, "page_size", 16) == 16 for spec in compiled)
    _check_covers(fake_gpu, attn, report, np.random.default_rng(3), 16, 16384, block_table=1024)


def test_an_instance_of_its_own_spec_warms_that_spec(fake_gpu, compiled):
    spec = default_spec("sm_90", 128, 4).replace(cluster=2, stages=3)
    attn = DecodeAttention(32, 8, 128, spec=spec)
    report = attn.warmup(max_len=8192, max_batch=4)
    assert {s.stages for s in compiled if hasattr(s, "stages")} == {3}
    _check_covers(fake_gpu, attn, report, np.random.default_rng(4), 4, 8192)


@pytest.mark.parametrize("args, message", [
    ({"max_len": 0}, "max_len: expected an int of at least 1, got 0"),
    ({"max_len": 2.5}, "max_len: expected an int of at least 1, got 2.5"),
    ({"max_len": 1024, "max_batch": 0}, "max_batch: expected an int of at least 1, got 0"),
    ({"max_len": 2**31}, "max_len: at most 2147483647 tokens"),
])
def test_bad_ranges(fake_gpu, compiled, args, message):
    attn = DecodeAttention(32, 8, 128, tuned=False)
    with pytest.raises(ValueError, match=message):
        attn.warmup(**args)
    assert not compiled


def test_the_list_needs_no_gpu():
    specs, entries = warmup.programs_to_warm("sm_90", "NVIDIA H200", lookup.TuneKey(128, 4, "bf16", "bf16", 0, "NHD"),
                                             8, 256, 131072)
    assert entries > 1 and len(specs) == len(set(specs)) > 10
