"""Tuning in worker processes without a GPU: the compile jobs each worker takes, workers tuning
keys apart and the parent reading their outcomes, the parent tuning what a failed worker left,
and the workers' command lines."""

from __future__ import annotations

import os

import pytest

from splitkv import cli
from splitkv.autotune import confirm, studies, versions
from splitkv.tuned import tables
from splitkv.tuned.keys import BUCKETS_BY_NAME, TuneKey

from autotune_helpers import ARCH, KEY


def test_tuning_compiles_with_jobs_given_or_the_cpus_shared_by_the_workers(monkeypatch, tmp_path):
    """--jobs sets the candidates compiled at a time; without it one process takes every CPU and
    each of N workers on the host 1/N of them (their command lines say so)."""
    from splitkv.autotune import cli as tune_cli
    from splitkv.autotune import tuning, workers

    monkeypatch.setattr(tuning.os, "cpu_count", lambda: 32)
    assert (tuning.compile_jobs(None), tuning.compile_jobs(None, 2), tuning.compile_jobs(None, 64)) == (32, 16, 1)
    assert tuning.compile_jobs(3, 2) == 3
    started = []

    class Exited:
        returncode = 0

        def poll(self):
            return 0

        def wait(self):
            return 0

    monkeypatch.setattr(workers.subprocess, "Popen", lambda argv, **kw: started.append(argv) or Exited())
    monkeypatch.setattr(workers, "count_trials", lambda run, names: 0)
    monkeypatch.setattr(workers.tempfile, "mkdtemp", lambda prefix: str(tmp_path))  # the workers' logs
    for given, want in (([], ["--jobs", "16"]), (["--jobs", "5"], ["--jobs", "5"]), (["--jobs=5"], ["--jobs=5"]),
                        (["-j", "5"], ["-j", "5"])):
        started.clear()
        parser = cli.build_parser()
        args = parser.parse_args(["--arch", "sm90", "--tune", "--devices", "0,1", *given])
        args.argv = ["--arch", "sm90", "--tune", "--devices", "0,1", *given]
        run = tune_cli.run_description(args, parser, ARCH, None, None, None, (0,))
        assert workers.run_workers(run, [0, 1], ["study"]) == 0
        assert len(started) == 2
        for argv in started:  # one --jobs each, the user's when given
            assert "--devices" not in argv and "0,1" not in argv
            assert [a for a in argv if a.startswith("-j") or a.startswith("--jobs")] == [want[0]]
            assert argv[argv.index(want[0]):][:len(want)] == want


def test_workers_tune_keys_apart_and_the_parent_reads_their_outcomes(tmp_path, monkeypatch, capsys):
    """Worker 2 of 2 starts at the second half of the keys, confirms and writes what it tunes, and
    leaves a key another live worker of its run claimed (a claim of an earlier run is stale); the
    parent then takes the worker's saved outcome without confirming again, and tunes only what was
    left. A saved outcome stands only for the trials and settings it was confirmed with."""
    pytest.importorskip("optuna")
    from splitkv.autotune import cli as tune_cli
    from splitkv.autotune import tuning, workers

    out = tmp_path / "t"
    argv = ["--arch", "sm90", "--tune", "--cost-model", "--head-dim", "128", "--group", "1,4", "--dtype", "bf16",
            "--bucket", "b1-l2k", "--trials", "8", "--storage", str(tmp_path / "j.log"), "--out", str(out)]
    g1, g4 = TuneKey(128, 1), TuneKey(128, 4)
    bucket = BUCKETS_BY_NAME["b1-l2k"]

    def study_of(key):
        name = versions.study_name("", "cost model", "sm_90", key, bucket, versions.code_version())
        return studies.open_study(name, str(tmp_path / "j.log"))

    # g1: claimed by a live worker of this run; g4: by a live process of an earlier run (stale).
    study_of(g1).set_user_attr(studies.CLAIM_ATTR, dict(host=studies.HOST, pid=os.getppid(), run="this run"))
    study_of(g4).set_user_attr(studies.CLAIM_ATTR, dict(host=studies.HOST, pid=os.getppid(), run="an old run"))
    monkeypatch.setenv(workers.WORKER_ENV, "2")
    monkeypatch.setenv(workers.WORKERS_ENV, "2")
    monkeypatch.setenv(workers.RUN_ENV, "this run")
    assert cli.main([*argv, workers.WORKER_FLAG]) == 0
    assert len(studies.measured(study_of(g4))) == 8 and studies.OUTCOME_ATTR in study_of(g4).user_attrs
    assert len(studies.measured(study_of(g1))) == 0  # claimed by another live process: left to it
    (written,) = tables.load(out / "sm_90" / "cost_model.yaml").entries
    assert written.key == g4

    finished = []
    real_finish = confirm.finish
    monkeypatch.setattr(confirm, "finish", lambda study, key, *a, **kw: finished.append(key) or
                        real_finish(study, key, *a, **kw))
    monkeypatch.delenv(workers.WORKER_ENV)
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert finished == [g1]  # g4's outcome was the worker's
    summary = capsys.readouterr().out
    assert g1.label in summary and g4.label in summary
    entries = tables.load(out / "sm_90" / "cost_model.yaml").entries
    assert sorted(e.key.group_size for e in entries) == [1, 4]
    assert next(e for e in entries if e.key == g4) == written

    parser = cli.build_parser()
    run = tune_cli.run_description(parser.parse_args(argv), parser, ARCH, [128], [1, 4], ["bf16"], (0,))
    settings = tuning.confirmation_settings(run)
    assert studies.saved_outcome(study_of(g4), ARCH, 8, settings).entry == written
    assert studies.saved_outcome(study_of(g4), ARCH, 9, settings) is None  # more trials asked for
    assert studies.saved_outcome(study_of(g4), ARCH, 8, {**settings, "iters": 99}) is None


def test_the_parent_tunes_what_a_failed_worker_left(tmp_path, monkeypatch, capsys):
    """Workers that exit with an error (killed, say) leave studies untuned: the parent tunes them,
    prints the summary, and still says that something failed."""
    pytest.importorskip("optuna")
    from splitkv.autotune import workers

    monkeypatch.setattr(workers, "run_workers", lambda run, devices, names: 1)
    argv = ["--arch", "sm90", "--tune", "--cost-model", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
            "--bucket", "b1-l2k", "--trials", "6", "--storage", str(tmp_path / "j.log"), "--devices", "0,1",
            "--out", str(tmp_path / "t")]
    assert cli.main(argv) == 1
    assert KEY.label in capsys.readouterr().out
    (written,) = tables.load(tmp_path / "t" / "sm_90" / "cost_model.yaml").entries
    assert written.key == KEY and written.trials == 6


def test_worker_command_lines_drop_devices():
    """A worker runs this command line without --devices, in either spelling."""
    from splitkv.autotune.workers import without_devices

    assert without_devices(["--tune", "--devices", "0,1", "--trials", "4"]) == ["--tune", "--trials", "4"]
    assert without_devices(["--devices=0,0", "--tune"]) == ["--tune"]
