"""Confirming the search's winner without a GPU: never slower than the built-in choice, never a
candidate that launches the built-in programs, rounds in alternating order, and a winner only a
margin faster that passes its last check."""

from __future__ import annotations

import warnings

import pytest

from splitkv.autotune import confirm, objective, search, space
from splitkv.heuristics import default_spec
from splitkv.tuned import keys

from autotune_helpers import ARCH, KEY, Recording, memory_study, searched


@pytest.mark.parametrize("bucket", ["b1-l2k", "b1-l32k", "b32-l4k"])
def test_finish_is_never_slower_than_the_default(bucket):
    """The entry finish() writes is at least as fast as the built-in choice on its own figures."""
    pytest.importorskip("optuna")
    study, obj, _ = searched(24, bucket)
    outcome = confirm.finish(study, KEY, keys.parse_bucket(bucket), ARCH, obj)
    e = outcome.entry
    assert e.tuned_us <= e.default_us and e.speedup >= 1
    # 32 x 4k fills the SMs in rows: every split candidate launches the built-in dense program
    # there, so the sampler mostly proposes repeats and the asks run out before 24 are measured.
    assert (e.trials == 24 or bucket == "b32-l4k" and 10 <= e.trials < 24) and e.bucket.name == bucket and e.key == KEY
    assert outcome.objective == obj.name and "built-in" in outcome.confirm
    if e.spec is None:
        assert e.tuned_us == e.default_us == outcome.confirm["built-in"] and e.default_plan is None
    else:  # the final round's figures, the candidate MARGIN faster there
        assert e.default_plan == obj.runs(None) != obj.runs(e.spec)
        assert (e.tuned_us, e.default_us) == (outcome.confirm[f"final {e.spec.name}"], outcome.confirm["final built-in"])
        assert e.tuned_us <= e.default_us * (1 - confirm.MARGIN)
    assert len(outcome.trials) >= 24


def test_finish_takes_no_candidate_that_launches_the_builtin_programs():
    """A candidate launching exactly what the built-in choice launches is the built-in choice, however
    much faster its figures came out (figures of one launch differ by noise alone, and noise must not
    pick a winner); of several candidates that launch one thing, one is confirmed."""
    pytest.importorskip("optuna")

    class Biased(Recording):
        def measure(self, spec, iters=None):
            m = super().measure(spec, iters)
            if spec is not None and self.runs(spec) == self.runs(None):
                return objective.Measurement(m.us * 0.9, m.bandwidth_pct, m.detail)
            return m

    study, obj = memory_study(), Biased(bucket="b1-l2k")
    bucket = keys.parse_bucket("b1-l2k")
    for spec in (default_spec(ARCH, 128, 4, variant="dense"), default_spec(ARCH, 128, 4).replace(stages=3)):
        study.enqueue_trial(space.params_of(spec, KEY, ARCH))
    search.run_trials(study, KEY, ARCH, obj, trials=8)
    outcome = confirm.finish(study, KEY, bucket, ARCH, obj)
    confirmed = [name for name in outcome.confirm if name != "built-in" and not name.startswith("final")]
    launches = [obj.runs(s) for s, _ in confirm.best_specs(study, KEY, ARCH, None) if s.name in confirmed]
    assert obj.runs(None) not in launches and len(launches) == len(set(launches)) == len(confirmed) >= 1
    assert outcome.entry.spec is None or obj.runs(outcome.entry.spec) != obj.runs(None)


def test_confirmation_rounds_alternate_their_order():
    """Every other round runs in reverse, so no candidate (the built-in choice included) is always
    measured first."""
    obj = Recording(bucket="b1-l32k")
    a, b = default_spec(ARCH, 128, 4).replace(stages=3), default_spec(ARCH, 128, 4).replace(warps=8, tile_tokens=16)
    confirm.confirm(obj, [a, b], rounds=3)
    names = [None if s is None else s.name for s in obj.measured]
    assert names == [None, a.name, b.name, b.name, a.name, None, None, a.name, b.name]


class _Scaled(Recording):
    """Every candidate ``factor`` times the built-in choice's predicted µs."""

    def __init__(self, factor, verify_fails=False):
        super().__init__(bucket="b1-l32k")
        self.factor, self.verify_fails = factor, verify_fails

    def measure(self, spec, iters=None):
        m = super().measure(None, iters)
        return m if spec is None else objective.Measurement(m.us * self.factor, m.bandwidth_pct, m.detail)

    def verify(self, spec):
        return "wrong on a ragged batch" if self.verify_fails else None


@pytest.mark.parametrize("factor, verify_fails, tuned", [(0.995, False, False), (0.9, True, False),
                                                         (0.9, False, True)])
def test_a_winner_must_be_a_margin_faster_and_pass_its_last_check(factor, verify_fails, tuned):
    """Within the margin of the built-in choice, or failing the final check, the built-in choice
    stays (spec None, tuned = default); a clear winner is written with the final round's figures."""
    pytest.importorskip("optuna")
    study, obj = memory_study(), _Scaled(factor, verify_fails)
    bucket = keys.parse_bucket("b1-l32k")
    search.enqueue_defaults(study, KEY, bucket, ARCH)
    search.run_trials(study, KEY, ARCH, obj, trials=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry = confirm.finish(study, KEY, bucket, ARCH, obj).entry
    assert (entry.spec is not None) == tuned
    if tuned:
        assert entry.tuned_us < entry.default_us * (1 - confirm.MARGIN)
    else:
        assert entry.tuned_us == entry.default_us
    assert any("ragged" in str(w.message) for w in caught) == verify_fails
