"""The GPU objective's parts that run without a GPU: the programs a candidate is compiled with, its
inputs and reference (NumPy in CuPy's place), and the last check a winner runs."""

from __future__ import annotations

import sys

import pytest

from splitkv.autotune import objective
from splitkv.tuned import lookup
from splitkv.tuned.keys import BUCKETS_BY_NAME, TuneKey

from autotune_helpers import ARCH, KEY, TUNED_DENSE, TUNED_SPLIT


def test_candidates_compile_with_what_their_plans_load(monkeypatch):
    """A candidate is compiled with the cluster sizes the planner may fit, the built-in program of
    the other variant and the merge; a companion that fails to compile fails the candidate, with
    the companion named."""
    from splitkv import codegen
    from splitkv.autotune import measure

    split, dense, _ = lookup.programs(None, ARCH, KEY)
    candidate = TUNED_SPLIT.replace(cluster=16)
    names = {s.name for s in measure._companions(candidate, split, dense)}
    assert {candidate.replace(cluster=c).name for c in (1, 2, 4, 8, 16)} <= names and dense.name in names
    assert split.name in {s.name for s in measure._companions(TUNED_DENSE, split, dense)}

    compiled = []
    broken = candidate.replace(cluster=4).name

    def fake_compile(spec):
        compiled.append(spec.name)
        if spec.name == broken:
            raise codegen.CompileError("NVRTC failed", "ptxas error: too many resources", None)
    monkeypatch.setattr(codegen, "compile_cubin", fake_compile)
    objective = object.__new__(measure.GpuObjective)  # no GPU: only what prepare() reads
    objective.jobs, objective.builtin_split, objective.builtin_dense = 2, split, dense
    failures = objective.prepare([candidate, TUNED_DENSE])
    assert list(failures) == [candidate.name]
    assert broken in failures[candidate.name] and "CompileError" in failures[candidate.name]
    assert len(compiled) == len(set(compiled))  # each program once


def _numpy_as_cupy(monkeypatch):
    """NumPy in CuPy's place, for the parts of the GPU objective that are array arithmetic."""
    import types

    import numpy as np

    shim = types.SimpleNamespace(**{name: getattr(np, name) for name in (
        "float16", "float32", "float64", "uint16", "uint32", "nan", "einsum", "exp", "stack", "asarray", "isfinite",
        "abs", "empty_like", "random", "arange", "where", "inf")}, asnumpy=np.asarray)
    monkeypatch.setitem(sys.modules, "cupy", shim)
    return np


@pytest.mark.parametrize("key", [TuneKey(64, 4), TuneKey(128, 8, "fp16", "fp16"), TuneKey(64, 2, page_size=16),
                                 TuneKey(64, 2, page_size=8, kv_layout="HND"), TuneKey(64, 2, query_tokens=4)],
                         ids=lambda k: k.label)
def test_the_objectives_inputs_and_reference(monkeypatch, key):
    """The GPU objective's inputs are random values of the key's type (never zeros), its reference
    is float64 attention over each sequence's own tokens (ragged lengths; with several query
    tokens, causal among them), a paged cache holds the
    same rows behind its block table, and the check passes the reference rounded to the output
    type and fails a poisoned output."""
    np = _numpy_as_cupy(monkeypatch)
    from splitkv.autotune import measure
    from splitkv.paged import gather_pages
    from splitkv.reference import attention_reference

    lens = [37, 100, 64]
    inputs = measure.BucketInputs(key, lens, seed=5)
    q64 = measure._as_f64(inputs.q, key.q_dtype)
    tokens = (key.query_tokens,) if key.query_tokens > 1 else ()
    assert q64.shape == (3, *tokens, 8 * key.group_size, key.head_dim) and np.count_nonzero(q64) == q64.size
    k, v = inputs.k, inputs.v
    if key.page_size:
        k = gather_pages(k, inputs.block_table, lens, key.kv_layout, max(lens))
        v = gather_pages(v, inputs.block_table, lens, key.kv_layout, max(lens))
    k64, v64 = measure._as_f64(np.asarray(k), key.kv_dtype), measure._as_f64(np.asarray(v), key.kv_dtype)
    want, _ = attention_reference(q64, k64, v64, lens)
    np.testing.assert_allclose(inputs.ref, want, rtol=1e-12, atol=1e-12)
    assert inputs.ref.shape == q64.shape
    assert inputs.bytes_moved == 2 * sum(lens) * 8 * key.head_dim * 2 + 2 * q64.size * 2

    rounded = inputs.ref.astype(np.float32)
    inputs.out = (rounded.astype(np.float16) if key.q_dtype == "fp16" else
                  ((rounded.view(np.uint32) + 0x7FFF + ((rounded.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16))
    assert inputs.error() < 1e-2
    inputs.poison_output()
    assert inputs.error() == float("inf")


def test_a_winners_last_check_runs_the_program_it_would_write(monkeypatch):
    """verify() forces a dense winner dense (two ragged sequences alone would be split with the
    built-in program) and runs a split winner planned as usual and as its units program; a
    failure names the lengths and the program."""
    import contextlib

    from splitkv.autotune import measure

    ran = []
    gpu_objective = object.__new__(measure.GpuObjective)  # no GPU: only what verify() reads
    gpu_objective.key, gpu_objective.bucket, gpu_objective.seed = KEY, BUCKETS_BY_NAME["b32-l4k"], 0
    gpu_objective.harness = type("Harness", (), {"active": staticmethod(contextlib.nullcontext)})()
    monkeypatch.setattr(measure, "BucketInputs", lambda key, lens, seed: lens)

    def checked(spec, inputs, variant):
        ran.append((spec.variant, variant, tuple(inputs)))
        if variant == "units" and spec.stages == 3:
            raise objective.TrialFailed("wrong result: max error 0.5")
    gpu_objective._checked = checked
    assert gpu_objective.verify(TUNED_DENSE) is None and ran == [("dense", "dense", (4059, 1370))]
    ran.clear()
    assert gpu_objective.verify(TUNED_SPLIT.replace(stages=2)) is None
    assert [v for _, v, _ in ran] == [None, "units"]
    problem = gpu_objective.verify(TUNED_SPLIT)
    assert "units program" in problem and "4059" in problem and "max error 0.5" in problem
