"""Studies and their storage: a study resumed by a second process and after a kill, trials left
running by a dead process failed as interrupted, a confirmed outcome kept for a rerun, the seconds
each phase took, and the code version that names a study."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from splitkv.autotune import confirm, objective, search, studies, versions
from splitkv.tuned import keys
from splitkv.tuned.keys import BUCKETS_BY_NAME

from autotune_helpers import ARCH, KEY, Recording, memory_study

REPO = Path(__file__).resolve().parent.parent


def states(study) -> dict:
    """{trial number: (state, params, value)}."""
    return {t.number: (t.state.name, t.params, t.value) for t in study.get_trials(deepcopy=False)}


# ---- resuming across processes -------------------------------------------------------------------

_WORKER = textwrap.dedent("""
    import sys, time
    from splitkv.autotune import confirm, costmodel, search, studies
    from splitkv.tuned import keys

    journal, trials, sleep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    key, bucket = keys.TuneKey(128, 4), keys.parse_bucket("b1-l2k")

    class Slow(costmodel.CostModelObjective):
        def measure(self, spec, iters=None):
            time.sleep(sleep)
            return super().measure(spec, iters)

    study = studies.open_study("resume", journal, seed=0)
    search.enqueue_defaults(study, key, bucket, "sm_90")
    print("ran", search.run_trials(study, key, "sm_90", Slow(key, bucket, "sm_90"), trials=trials), flush=True)
""")


def _worker(journal: Path, trials: int, sleep: float = 0.0) -> subprocess.Popen:
    """A process that searches the study 'resume' of ``journal`` up to ``trials`` trials, each
    measurement taking ``sleep`` seconds longer."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-c", _WORKER, str(journal), str(trials), str(sleep)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_worker(journal: Path, trials: int) -> str:
    proc = _worker(journal, trials)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out.strip()


def _journal_study(journal: Path):
    return studies.open_study("resume", str(journal))


def _finished_states(study) -> dict:
    done = {t.number for t in studies.finished(study)}
    return {n: s for n, s in states(study).items() if n in done}


def test_a_second_process_resumes_the_study(tmp_path):
    """A second run on the same journal runs only the trials missing from the total, and keeps the
    first run's trials as they were."""
    pytest.importorskip("optuna")
    journal = tmp_path / "j.log"
    assert _run_worker(journal, 7) == "ran 7"
    before = _finished_states(_journal_study(journal))
    assert len(studies.measured(_journal_study(journal))) == 7
    assert _run_worker(journal, 15) == "ran 8"
    study = _journal_study(journal)
    after = _finished_states(study)
    assert len(studies.measured(study)) == 15
    assert {n: after[n] for n in before} == before
    # The built-in programs were enqueued once, not again by the second run.
    assert sorted(t.user_attrs.get("builtin") for t in study.trials if "builtin" in t.user_attrs) == ["dense", "split"]


def test_a_killed_run_loses_nothing_it_finished(tmp_path):
    """SIGKILL mid-run: the trials told before the kill stay, and a rerun completes the total."""
    optuna = pytest.importorskip("optuna")
    journal = tmp_path / "j.log"
    proc = _worker(journal, 200, sleep=0.25)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the worker finished no trials in a minute"
            complete = 0
            if journal.exists():
                try:  # loaded, not created: the worker creates it
                    study = optuna.load_study(study_name="resume", storage=studies.make_storage(str(journal)))
                    complete = sum(t.state.name == "COMPLETE" for t in study.get_trials(deepcopy=False))
                except KeyError:  # not created yet
                    pass
            if complete >= 3:
                break
            time.sleep(0.1)
    finally:
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    before = _finished_states(_journal_study(journal))
    assert sum(state == "COMPLETE" for state, _, _ in before.values()) >= 3
    target = len(studies.measured(_journal_study(journal))) + 6
    assert _run_worker(journal, target) == "ran 6"
    study = _journal_study(journal)
    after = _finished_states(study)
    assert len(studies.measured(study)) == target
    assert {n: after[n] for n in before} == before
    # The trials the killed process was measuring are failed as interrupted, and not counted.
    assert not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    interrupted = [t for t in study.trials if t.user_attrs.get("interrupted")]
    assert interrupted and all(t.state.name == "FAIL" for t in interrupted)


@pytest.mark.parametrize("other_asker", [None, "alive", "elsewhere"])
def test_a_trial_left_naming_no_process_is_failed_once_its_askers_are_gone(other_asker):
    """A run killed between Optuna's ask and the trial's host and pid records leaves a RUNNING trial
    that names no process (or only its host): the kill above lands there now and then. It is failed
    as interrupted when every process that asked for trials of the study is of this host and gone;
    while one may be alive (this one, or one of another host), it may be between those records
    itself, and its trial is left."""
    pytest.importorskip("optuna")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    askers = [(studies.HOST, gone.pid)]
    if other_asker:
        askers.append((studies.HOST, os.getpid()) if other_asker == "alive" else ("another-host", gone.pid))
    study = memory_study()
    for host, pid in askers:
        study.set_user_attr(f"{studies.ASKER_ATTR} {host} {pid}", dict(host=host, pid=pid))
    study.ask()
    study.ask().set_user_attr("host", studies.HOST)
    assert studies.fail_interrupted(study) == (0 if other_asker else 2)
    assert {t.state.name for t in study.trials} == {"RUNNING" if other_asker else "FAIL"}
    assert all(t.user_attrs.get("interrupted") is (None if other_asker else True) for t in study.trials)


# ---- saved outcomes ------------------------------------------------------------------------------

def test_a_study_whose_asks_ran_out_keeps_its_confirmed_outcome():
    """A study that ends below --trials because its asks ran out (few candidates launch anything
    new) keeps its saved outcome for a rerun with the same trials; more trials asked for, or
    another planner, confirm it again."""
    pytest.importorskip("optuna")
    bucket = BUCKETS_BY_NAME["b32-l4k"]
    study, obj = memory_study(), Recording(bucket="b32-l4k")
    search.enqueue_defaults(study, KEY, bucket, ARCH)
    search.run_trials(study, KEY, ARCH, obj, trials=40)
    count = len(studies.measured(study))
    assert count < 40 and len(studies.finished(study)) >= studies.MAX_ASKS * 40  # its asks ran out
    outcome = confirm.finish(study, KEY, bucket, ARCH, obj)
    settings = dict(iters=20, planner="a")
    studies.save_outcome(study, outcome, settings, 40)
    assert studies.saved_outcome(study, ARCH, 40, settings).entry.to_dict() == outcome.entry.to_dict()
    assert studies.saved_outcome(study, ARCH, 41, settings) is None
    assert studies.saved_outcome(study, ARCH, 40, dict(settings, planner="b")) is None


# ---- the seconds of each phase -------------------------------------------------------------------

def test_a_study_keeps_the_seconds_each_phase_took():
    """run_trials and finish add this process's seconds per phase to the study (so a report written
    later from the storage has them, and a worker's time is never overwritten by another's); the
    summary shows them when given."""
    pytest.importorskip("optuna")
    from splitkv.autotune import report

    class Slow(Recording):  # a compile and a measurement that take measurable time
        def compile(self, program):
            time.sleep(0.05)
            return super().compile(program)

        def measure(self, spec, iters=None):
            time.sleep(0.005)
            return super().measure(spec, iters)

    study, obj = memory_study(), Slow(bucket="b1-l2k")
    search.run_trials(study, KEY, ARCH, obj, trials=6)
    spent = studies.study_seconds(study)
    assert set(spent) == {"sample", "compile", "measure"}
    assert spent["compile"] >= 0.05 and spent["measure"] >= 0.005 * 6
    outcome = confirm.finish(study, KEY, keys.parse_bucket("b1-l2k"), ARCH, obj)
    assert set(outcome.seconds) == set(studies.PHASES) and outcome.seconds["confirm"] >= 0.005 * 4
    assert outcome.seconds["compile"] == pytest.approx(spent["compile"], abs=1e-3)  # finish compiles nothing
    study.set_user_attr(f"{studies.SECONDS_ATTR} another-host 1", {"compile": 2.5})  # a second worker
    assert studies.study_seconds(study)["compile"] == pytest.approx(outcome.seconds["compile"] + 2.5)
    timed = report.format_summary([outcome.entry], [outcome.seconds]).splitlines()
    assert timed[0].endswith("s sample/compile/measure/confirm")
    assert timed[1].endswith("/".join(f"{outcome.seconds[p]:.1f}" for p in studies.PHASES))
    assert report.format_summary([outcome.entry]).splitlines()[0].endswith("tuned program")


def test_recording_the_seconds_never_hides_the_error_that_ended_the_phase():
    """A storage that refuses the seconds gives a warning, so a lost GPU context raised inside a
    timed phase reaches the caller as itself; a confirmation that fails still records its time."""
    pytest.importorskip("optuna")

    class Refusing:
        user_attrs: dict = {}

        def set_user_attr(self, name, value):
            raise OSError("disk full")

    clock = studies.PhaseClock(Refusing())
    with pytest.warns(RuntimeWarning, match="disk full"), pytest.raises(objective.ContextLost):
        try:
            with clock.phase("measure"):
                raise objective.ContextLost("illegal address")
        finally:
            clock.flush()

    class BuiltinFails(Recording):
        def measure(self, spec, iters=None):
            if spec is None and self.measured:  # the built-in choice fails when confirmed
                raise objective.TrialFailed("mismatch")
            return super().measure(spec, iters)

    study, obj = memory_study(), BuiltinFails(bucket="b1-l2k")
    search.run_trials(study, KEY, ARCH, obj, trials=4)
    with pytest.raises(objective.TrialFailed):
        confirm.finish(study, KEY, keys.parse_bucket("b1-l2k"), ARCH, obj)
    assert "confirm" in studies.study_seconds(study)


# ---- the code version ----------------------------------------------------------------------------

def test_the_code_version_follows_the_templates_and_the_tensor_maps_encoding(monkeypatch):
    # A study resumes only figures measured with the same programs: a change of a template or of the
    # tensor maps' encoding (the L2 promotion, say) must start new studies.
    read = Path.read_bytes
    before = versions.code_version.__wrapped__()
    for changed in ("decode.cu.j2", "kv_formats.cuh", "tensor_map.py"):
        monkeypatch.setattr(Path, "read_bytes", lambda self, name=changed: read(self) + (b"//" if self.name == name else b""))
        assert versions.code_version.__wrapped__() != before, changed
    monkeypatch.setattr(Path, "read_bytes", read)
    assert versions.code_version.__wrapped__() == before
