"""The Optuna search scored by the cost model, without a GPU: what run_trials counts, prunes, fails
and measures; the heuristic's programs first; candidates that launch what another did taken as
repeats; errors and a lost GPU context leave no trial running; programs compiled once, and again
after a passing failure; the buckets of a key searched together while programs compile."""

from __future__ import annotations

import pytest

from splitkv.autotune import confirm, costmodel, objective, search, space, studies
from splitkv.heuristics import default_spec
from splitkv.spec import KernelSpec
from splitkv.tuned import keys

from autotune_helpers import ARCH, KEY, Recording, memory_study, searched


# ---- candidates ----------------------------------------------------------------------------------

def test_invalid_candidates_are_never_compiled():
    """The search prunes what KernelSpec refuses before compiling; only valid specs are compiled."""
    optuna = pytest.importorskip("optuna")
    study, obj = memory_study(), Recording()
    search.enqueue_defaults(study, KEY, keys.parse_bucket("b1-l2k"), ARCH)
    assert search.run_trials(study, KEY, ARCH, obj, trials=30) == 30
    pruned = study.get_trials(states=(optuna.trial.TrialState.PRUNED,))
    assert pruned, "the space of d128 bf16 has shapes too big for shared memory; some must be asked"
    assert all(t.user_attrs["reason"].startswith("invalid") for t in pruned)
    assert all("spec" not in t.user_attrs for t in pruned)
    assert obj.prepared and all(isinstance(s, KernelSpec) and KernelSpec.from_dict(s.to_dict()) == s
                                for s in obj.prepared)
    assert {s.name for s in obj.measured if s is not None} <= {s.name for s in obj.prepared}


def test_the_cost_model_says_it_is_one():
    """The cost model's figures are named as predictions wherever they appear."""
    name = costmodel.CostModelObjective.name
    assert "cost model" in name and "not measured" in name


def test_run_trials_stops_at_the_asked_count():
    """run_trials measures exactly the asked number of candidates, counting earlier ones; pruned
    and repeated candidates cost no measurement and are not counted."""
    pytest.importorskip("optuna")
    study, obj, done = searched(13)
    assert done == 13 and len(studies.measured(study)) == 13
    assert len(studies.finished(study)) > 13  # some were invalid combinations, pruned
    assert search.run_trials(study, KEY, ARCH, obj, trials=13) == 0
    assert search.run_trials(study, KEY, ARCH, obj, trials=17) == 4
    assert len(studies.measured(study)) == 17
    names = [t.user_attrs["spec"] for t in studies.measured(study)]
    assert len(names) == len(set(names))  # no candidate measured twice


def test_the_heuristics_programs_are_the_first_trials():
    """Trials 0 and 1 are the heuristic's split and dense programs, marked as built-in."""
    pytest.importorskip("optuna")
    study, _, _ = searched(10)
    first, second = study.trials[:2]
    assert first.user_attrs["builtin"] == "split" and second.user_attrs["builtin"] == "dense"
    assert first.user_attrs["spec"] == default_spec(ARCH, 128, 4).name
    assert second.user_attrs["spec"] == default_spec(ARCH, 128, 4, variant="dense").name
    assert all("builtin" not in t.user_attrs for t in study.trials[2:])


def test_a_candidate_that_launches_what_another_did_is_not_measured_again():
    """Where the planner splits (1 x 2k), a tuned dense program runs the built-in split program: such
    candidates take the built-in's figure as repeats, uncounted and unmeasured, and each trial
    records what it launched."""
    pytest.importorskip("optuna")
    study, obj, _ = searched(16)
    builtin = obj.runs(None)
    first = study.trials[0]
    assert first.user_attrs["runs"] == builtin and "repeat_of" not in first.user_attrs
    dense = [t for t in studies.finished(study) if t.state.name == "COMPLETE" and t.params.get("variant") == "dense"]
    assert dense, "the sampler proposed no dense candidate: nothing was tested"
    for t in dense:
        assert t.user_attrs["runs"] == builtin and t.user_attrs["repeat_of"] == 0 and t.value == first.value
    assert not [s for s in obj.measured if s is not None and s.variant == "dense"]
    runs = [t.user_attrs["runs"] for t in studies.measured(study)]
    assert len(runs) == len(set(runs)) == 16


# ---- failures ------------------------------------------------------------------------------------

def test_a_failing_candidate_is_a_failed_trial_and_never_wins():
    """Candidates whose measurement or compilation fails become FAIL trials with the reason, and
    are never the winner, even where the cost model would rank them first."""
    optuna = pytest.importorskip("optuna")
    fast = searched(24)
    best = confirm.finish(fast[0], KEY, keys.parse_bucket("b1-l2k"), ARCH, fast[1]).entry.spec
    assert best is not None and best.stages == 3  # what the failures below take away

    study, obj, done = searched(24, fails=lambda s: s.stages == 3, refuses=lambda s: s.warps == 8)
    assert done == 24
    failed = study.get_trials(states=(optuna.trial.TrialState.FAIL,))
    reasons = [t.user_attrs.get("reason", "") for t in failed]
    assert any(r.startswith("mismatch:") for r in reasons) and any(r.startswith("compile ") for r in reasons)
    assert all(t.value is None for t in failed)
    outcome = confirm.finish(study, KEY, keys.parse_bucket("b1-l2k"), ARCH, obj)
    winner = outcome.entry.spec
    assert winner is None or (winner.stages != 3 and winner.warps != 8)
    failed_names = {t.user_attrs["spec"] for t in failed}
    assert not failed_names & set(outcome.confirm)


def test_a_candidate_that_failed_is_not_measured_or_counted_again():
    """The sampler returns to failed candidates (TPE learns nothing from a failure): such a return
    is told failed at once, as a repeat, and does not count as a measured trial."""
    pytest.importorskip("optuna")
    study, obj = memory_study(), Recording(fails=lambda s: s.stages == 3)
    search.enqueue_defaults(study, KEY, keys.parse_bucket("b1-l2k"), ARCH)
    search.run_trials(study, KEY, ARCH, obj, trials=24)
    counted = [t.user_attrs["spec"] for t in studies.measured(study)]
    assert len(counted) == 24 and len(counted) == len(set(counted))
    failed_names = [s.name for s in obj.measured if s is not None and s.stages == 3]
    assert failed_names and len(failed_names) == len(set(failed_names))  # each failure measured once


def test_an_error_while_measuring_leaves_no_trial_running():
    """Whatever stops the search (here Ctrl-C inside a measurement), the trial being measured and
    those in flight are failed as interrupted: none stays RUNNING, none counts."""
    pytest.importorskip("optuna")
    study, obj = memory_study(), Recording()
    search.enqueue_defaults(study, KEY, keys.parse_bucket("b1-l2k"), ARCH)
    calls = []

    def measure(spec, iters=None):
        calls.append(spec)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return Recording.measure(obj, spec, iters)
    obj.measure = measure
    with pytest.raises(KeyboardInterrupt):
        search.run_trials(study, KEY, ARCH, obj, trials=10)
    assert not [t for t in study.trials if t.state.name == "RUNNING"]
    interrupted = [t for t in study.trials if "interrupted" in t.user_attrs]
    assert interrupted and len(studies.measured(study)) == 2


def test_a_program_that_failed_for_a_passing_reason_is_compiled_again():
    """A compile that failed for good (NVRTC refused) is not tried again; one that failed otherwise
    (a full disk, say) is, for the next candidate that needs it."""
    from splitkv.autotune.compiling import Compiler

    attempts = []

    class Flaky(Recording):
        def compile(self, program):
            attempts.append(program.name)
            raise OSError("no space left") if len(attempts) == 1 else RuntimeError("refused")

        def failure_is_final(self, error):
            return not isinstance(error, OSError)

    spec = default_spec(ARCH, 128, 4)
    with Compiler(Flaky()) as compiler:
        first = compiler.submit(spec)
        assert "OSError" in compiler.failure(first)
        second = compiler.submit(spec)
        assert "RuntimeError" in compiler.failure(second)
        assert "RuntimeError" in compiler.failure(compiler.submit(spec))
    assert attempts == [spec.name, spec.name]


def test_a_lost_gpu_context_stops_the_search_after_recording_its_trial():
    """ContextLost fails the trial that caused it and is raised (the candidates still in flight are
    failed as interrupted: not counted, measured again by a rerun); a rerun goes on past it."""
    pytest.importorskip("optuna")
    study, obj = memory_study(), Recording()
    search.enqueue_defaults(study, KEY, keys.parse_bucket("b1-l2k"), ARCH)
    culprit = default_spec(ARCH, 128, 4).name  # the first trial

    def measure(spec, iters=None):
        if spec is not None and spec.name == culprit:
            raise objective.ContextLost("cudaErrorIllegalAddress")
        return Recording.measure(obj, spec, iters)
    obj.measure = measure
    with pytest.raises(objective.ContextLost):
        search.run_trials(study, KEY, ARCH, obj, trials=10)
    failed = [t for t in study.trials if t.state.name == "FAIL" and "interrupted" not in t.user_attrs]
    assert [t.user_attrs["spec"] for t in failed] == [culprit]
    assert not [t for t in study.trials if t.state.name == "RUNNING"]
    assert "cudaErrorIllegalAddress" in failed[0].user_attrs["reason"]
    obj.measure = lambda spec, iters=None: Recording.measure(obj, spec, iters)
    search.run_trials(study, KEY, ARCH, obj, trials=10)
    assert len(studies.measured(study)) == 10 and culprit not in [s.name for s in obj.measured if s is not None]


# ---- several buckets at once ---------------------------------------------------------------------

def test_the_buckets_of_a_key_are_searched_together_while_programs_compile():
    """run_studies measures a candidate as soon as its programs are compiled, while others still
    compile (the built-in dense program's compile waits here until the built-in split program was
    measured), compiles each program once for all the buckets of the key, and gives every study its
    own trials, scored by its own bucket's objective."""
    import threading

    pytest.importorskip("optuna")
    gated = default_spec(ARCH, 128, 4, variant="dense").name  # the second trial of every study
    measured_first = threading.Event()
    compiled, waited = [], []

    class Pipelined(Recording):
        def compile(self, program):
            if program.name == gated:
                waited.append(measured_first.wait(timeout=10))
            compiled.append(program.name)
            return super().compile(program)

        def measure(self, spec, iters=None):
            measured_first.set()
            return super().measure(spec, iters)

    runs = []
    for bucket in ("b1-l2k", "b1-l32k", "b32-l4k"):
        study = memory_study()
        search.enqueue_defaults(study, KEY, keys.parse_bucket(bucket), ARCH)
        runs.append((study, Pipelined(bucket=bucket), None))
    assert search.run_studies(runs, KEY, ARCH, trials=10) == 30
    assert waited == [True]  # compiled once, after a measurement that did not wait for it
    assert len(compiled) == len(set(compiled))
    for study, obj, _ in runs:
        assert len(studies.measured(study)) == 10
        for t in studies.measured(study):  # every figure is this bucket's own
            spec = space.build_spec(lambda name, values: t.params[name], KEY, ARCH)
            assert t.value == costmodel.predict_us(costmodel.launched(spec, KEY, obj.bucket, ARCH), obj.bucket)
