"""`splitkv-gen --tune` without a GPU: tuning with the cost model (resumed from the journal), a report
written afterwards from the table and the storage, the exhaustive comparison, what it says without
a usable GPU, on another arch or an unwritable folder, usage errors, a broken study that does not
end the run, and the report's bandwidth plot."""

from __future__ import annotations

import dataclasses
import json

import pytest

from splitkv import cli
from splitkv.autotune import confirm, costmodel, space, studies, versions, writing
from splitkv.tuned import keys, tables
from splitkv.tuned.keys import BUCKETS_BY_NAME

from autotune_helpers import ARCH, KEY, header, searched


def _tune_argv(tmp_path, *extra) -> list:
    return ["--arch", "sm90", "--tune", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
            "--bucket", "b1-l2k", "--trials", "12", "--storage", str(tmp_path / "j.log"), *extra]


def test_cli_tunes_with_the_cost_model(tmp_path, capsys):
    """--tune --cost-model writes a one-entry table, prints the summary, writes the report, and a
    rerun resumes from the journal instead of searching again."""
    pytest.importorskip("optuna")
    pytest.importorskip("matplotlib")
    out, rep = tmp_path / "tables", tmp_path / "rep"
    argv = _tune_argv(tmp_path, "--cost-model", "--out", str(out), "--report", str(rep))
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "speedup" in stdout and KEY.label in stdout and "b1-l2k" in stdout
    assert "a dry run: every µs above is the cost model's prediction" in stdout
    table = tables.load(out / "sm_90" / "cost_model.yaml")
    (e,) = table.entries
    assert (e.key, e.bucket.name, e.trials) == (KEY, "b1-l2k", 12) and e.tuned_us <= e.default_us
    assert table.gpu == "cost model" and table.arch == "sm_90"
    assert "speedup" in (rep / "summary.md").read_text()
    results = json.loads((rep / "results.json").read_text())
    assert len(results["studies"]) == 1 and len(results["studies"][0]["trials"]) >= 12
    assert "cost model" in results["objective"]
    (png,) = rep.glob("chunk-*.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert cli.main(argv) == 0  # resumed: the study already holds its trials
    name = versions.study_name("", "cost model", "sm_90", KEY, keys.parse_bucket("b1-l2k"), versions.code_version())
    assert len(studies.measured(studies.open_study(name, str(tmp_path / "j.log")))) == 12


def test_a_report_is_written_afterwards_from_the_table_and_the_storage(tmp_path, capsys):
    """--report-from TABLE: a run stopped before its report gets it from the table and the journal,
    without measuring (no GPU): every trial of the study, the entry as written; an entry whose study
    is not in the storage is named and left out; --report and --storage are required."""
    pytest.importorskip("optuna")
    out = tmp_path / "tables"
    assert cli.main(_tune_argv(tmp_path, "--cost-model", "--out", str(out))) == 0
    path = out / "sm_90" / "cost_model.yaml"
    (written,) = tables.load(path).entries
    other = dataclasses.replace(written, bucket=BUCKETS_BY_NAME["b32-l4k"])  # tuned elsewhere: no study here
    writing.save(path, tables.load(path).header, [other])
    capsys.readouterr()

    rep = tmp_path / "rep"
    argv = ["--arch", "sm90", "--tune", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
            "--storage", str(tmp_path / "j.log"), "--report-from", str(path), "--report", str(rep)]
    assert cli.main(argv) == 0
    assert "b32-l4k: no study of it" in capsys.readouterr().err
    results = json.loads((rep / "results.json").read_text())
    (study,) = results["studies"]
    assert study["entry"] == written.to_dict() and study["confirm"] == {}
    name = versions.study_name("", "cost model", "sm_90", KEY, BUCKETS_BY_NAME["b1-l2k"], versions.code_version())
    trials = studies.open_study(name, str(tmp_path / "j.log")).trials
    assert [t["number"] for t in study["trials"]] == [t.number for t in trials] and len(trials) >= 12
    assert "cost model" in results["objective"] and KEY.label in (rep / "summary.md").read_text()
    # The time the run took per phase comes from the storage too.
    assert set(study["seconds"]) == set(studies.PHASES) and all(v >= 0 for v in study["seconds"].values())
    assert "s sample/compile/measure/confirm" in (rep / "summary.md").read_text()

    with pytest.raises(SystemExit):
        cli.main([a for a in argv if a != str(rep) and a != "--report"])
    capsys.readouterr()
    assert cli.main([*argv[:-4], "--report-from", str(tmp_path / "absent.yaml"), "--report", str(rep)]) == 2
    assert "--report-from" in capsys.readouterr().err
    missing = [a if a != str(tmp_path / "j.log") else str(tmp_path / "typo.log") for a in argv]
    assert cli.main(missing) == 2 and "no journal file" in capsys.readouterr().err
    assert not (tmp_path / "typo.log").exists()


def test_the_search_is_compared_with_the_exhaustive_figures(tmp_path, capsys):
    """--exhaustive measures every candidate of the space; the entry records the space's best, the
    tuned program's own figure there, and the first trial within 3% of the best; the report shows it."""
    pytest.importorskip("optuna")
    small = ["--head-dim", "256", "--group", "4", "--dtype", "bf16", "--bucket", "b1-l32k"]
    argv = ["--arch", "sm90", "--tune", "--cost-model", *small, "--trials", "30", "--exhaustive",
            "--out", str(tmp_path / "t"), "--report", str(tmp_path / "rep")]
    assert cli.main(argv) == 0
    (e,) = tables.load(tmp_path / "t" / "sm_90" / "cost_model.yaml").entries
    specs, _ = space.enumerate_specs(e.key, ARCH)
    bucket = BUCKETS_BY_NAME["b1-l32k"]
    def predicted(spec):  # what the cost model's objective measures: the program the candidate launches
        return costmodel.predict_us(costmodel.launched(spec, e.key, bucket, ARCH), bucket)

    best = min(predicted(s) for s in specs)
    x = e.exhaustive
    assert x["points"] == len(specs) and x["failed"] == 0 and x["best_us"] == pytest.approx(best, abs=1e-3)
    assert 1 <= x["trials_to_within_3pct"] <= 30
    if e.spec is not None:
        assert x["tuned_spec_us"] == pytest.approx(predicted(e.spec), abs=1e-3)
    builtin = costmodel.launched(None, e.key, bucket, ARCH)
    assert x["builtin_spec_us"] == pytest.approx(predicted(builtin), abs=1e-3)
    assert "Against exhaustive search" in (tmp_path / "rep" / "summary.md").read_text()


def test_a_study_that_breaks_does_not_end_the_run(tmp_path, capsys, monkeypatch):
    """An objective that cannot be built for one bucket (out of memory, say) is reported for that
    study; the others are tuned and written, and the status says something failed."""
    pytest.importorskip("optuna")

    class Broken(costmodel.CostModelObjective):
        def __init__(self, key, bucket, arch):
            if bucket.name == "b1-l32k":
                raise MemoryError("no room for this bucket's inputs")
            super().__init__(key, bucket, arch)
    monkeypatch.setattr(costmodel, "CostModelObjective", Broken)
    argv = _tune_argv(tmp_path, "--cost-model", "--bucket", "b1-l32k,b32-l4k", "--out", str(tmp_path / "t"))
    assert cli.main(argv) == 1
    assert "b1-l32k: MemoryError: no room" in capsys.readouterr().err
    written = tables.load(tmp_path / "t" / "sm_90" / "cost_model.yaml").entries
    assert sorted(e.bucket.name for e in written) == ["b1-l2k", "b32-l4k"]


# ---- what it refuses -----------------------------------------------------------------------------

def test_cli_tune_without_a_gpu_says_so(tmp_path, capsys, monkeypatch):
    """Without --cost-model and no usable GPU: status 2, a message naming the arch, nothing written."""
    pytest.importorskip("optuna")
    import splitkv.autotune.cli
    import splitkv.timing

    def no_gpu():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    monkeypatch.setattr(splitkv.autotune.cli, "unavailable_reason", lambda device=None: None)  # a driver, a device
    monkeypatch.setattr(splitkv.timing, "gpu_info", no_gpu)
    assert cli.main(_tune_argv(tmp_path, "--out", str(tmp_path / "tables"))) == 2
    err = capsys.readouterr().err
    assert "sm_90" in err and "none is usable" in err and "no CUDA-capable device" in err
    assert not (tmp_path / "tables").exists()


def test_cli_tune_refuses_a_gpu_of_another_arch(tmp_path, capsys, monkeypatch):
    """Tuning sm_90 on an sm_80 GPU is refused (status 2), the message naming both archs."""
    pytest.importorskip("optuna")
    import splitkv.autotune.cli
    import splitkv.timing

    monkeypatch.setattr(splitkv.autotune.cli, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(splitkv.timing, "gpu_info", lambda: dict(
        name="NVIDIA A100-SXM4-40GB", arch="sm_80", sm_count=108, cuda_runtime_version="13.0", nvrtc_version="13.0"))
    assert cli.main(_tune_argv(tmp_path, "--out", str(tmp_path / "tables"))) == 2
    err = capsys.readouterr().err
    assert "sm_90" in err and "sm_80" in err and "NVIDIA A100-SXM4-40GB" in err
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize("argv, message", [
    (["--arch", "sm90", "--tune", "--cost-model", "--devices", "0,1"], "--storage"),
    (["--arch", "sm90", "--tune", "--cost-model", "--devices", "1"], "--storage"),
    (["--arch", "sm90", "--tune", "--cost-model", "--bucket", "b1-32k"], "--bucket"),
    (["--arch", "sm90", "--tune", "--cost-model", "--trials", "0"], "--trials"),
    (["--arch", "sm90", "--tune", "--cost-model", "--devices", "0,x", "--storage", "j.log"], "--devices"),
    (["--arch", "sm90", "--tune", "--cost-model", "--emit", "kernels"], "--emit does not go with --tune"),
    (["--arch", "sm90", "--tune", "--cost-model", "--list"], "--list does not go with --tune"),
    (["--arch", "sm90", "--tune", "--cost-model", "--query-tokens", "0"], "--query-tokens"),
    (["--arch", "sm90", "--tune", "--cost-model", "--query-tokens", "2,x"], "--query-tokens"),
])
def test_cli_tune_usage_errors(capsys, argv, message):
    """Workers without shared storage (one worker on another GPU too), no trials, a bad bucket, a
    bad device list, or the compile-only --emit and --list are usage errors (status 2)."""
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_says_so_when_the_table_cannot_be_written(tmp_path, capsys):
    """A table folder that cannot be written ends the run with status 2 and a message naming it."""
    pytest.importorskip("optuna")
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert cli.main(_tune_argv(tmp_path, "--cost-model", "--out", str(blocked))) == 2
    assert "cannot write the table" in capsys.readouterr().err


# ---- the report ----------------------------------------------------------------------------------

def test_the_report_plots_a_bandwidth_sweep(tmp_path):
    """Given a sweep, the report draws % bandwidth against context length and links the plot."""
    pytest.importorskip("optuna")
    pytest.importorskip("matplotlib")
    from splitkv.autotune import report

    outcome = confirm.finish(*searched(12)[:1], KEY, BUCKETS_BY_NAME["b1-l2k"], ARCH,
                            costmodel.CostModelObjective(KEY, BUCKETS_BY_NAME["b1-l2k"]))
    sweeps = {KEY.label: {"lengths": [1024, 4096], "tuned": [40.0, 70.0], "built-in": [38.0, None],
                          "FlashInfer": [30.0, 55.0]}}
    report.write(tmp_path, [outcome], header("cost model"), sweeps)
    png = tmp_path / f"bandwidth-{KEY.label}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"({png.name})" in (tmp_path / "summary.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["sweeps"] == sweeps


def test_query_tokens_are_keys_of_their_own(tmp_path, capsys):
    """--query-tokens 1,4 tunes a key per count; the table holds both, the 4-token one named so."""
    pytest.importorskip("optuna")
    out = tmp_path / "tables"
    assert cli.main(_tune_argv(tmp_path, "--cost-model", "--out", str(out), "--trials", "4",
                               "--query-tokens", "4,1")) == 0
    assert KEY.with_query_tokens(4).label in capsys.readouterr().out
    table = tables.load(out / "sm_90" / "cost_model.yaml")
    assert sorted(e.key.query_tokens for e in table.entries) == [1, 4]
    (four,) = table.for_key(KEY.with_query_tokens(4))
    assert four.spec is None or four.spec.query_tokens == 4
