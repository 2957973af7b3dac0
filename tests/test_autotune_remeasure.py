"""`splitkv-gen --tune --remeasure` without a GPU: a table's entries measured again with the cost
model (new figures and date, spec and choice kept, entries outside the selection left as they
were), a tuned spec no longer the margin faster than the built-in choice giving way to it and
flagged with the command that tunes it again, an entry that fails its check kept as it was, the unit costs measured again against the
priors, and what it refuses."""

from __future__ import annotations

import json

import pytest

from splitkv import cli
from splitkv.autotune import costmodel, objective, remeasure, unit_costs, writing
from splitkv.tuned import keys, tables
from splitkv.tuned.lookup import COST_MODEL_GPU
from splitkv.work_units import PRIOR_COSTS, CostModel

from autotune_helpers import GPU, KEY, OTHER_KEY, OTHER_SPLIT, TUNED_SPLIT, entry, save_table

ARGV = ["--arch", "sm90", "--tune", "--remeasure", "--cost-model"]


def _predicted(spec, key, bucket: str) -> float:
    """What the cost model gives ``spec`` (None: the built-in choice) on the bucket, as the table rounds it."""
    return round(costmodel.CostModelObjective(key, keys.parse_bucket(bucket)).measure(spec).us, 3)


def _table(tmp_path, with_costs: bool = False):
    """A cost-model table under tmp_path/t of stale figures: KEY's built-in and tuned entries (the
    tuned split program is faster than the built-in choice at 1 x 32k, slower at 1 x 2k) and
    OTHER_KEY's."""
    out = tmp_path / "t"
    old = [entry("b1-l2k", None, tuned_us=99.0, default_us=99.0, trials=20, plan="old plan"),
           entry("b1-l32k", TUNED_SPLIT, tuned_us=1.0, default_us=2.0, trials=20, planner="waves",
                 default_plan="old default plan", exhaustive=dict(points=3, best_us=1.0)),
           entry("b1-l2k", OTHER_SPLIT, key=OTHER_KEY, tuned_us=5.0, default_us=6.0, trials=7)]
    path = save_table(out, old, gpu=COST_MODEL_GPU)
    if with_costs:
        writing.save(path, tables.load(path).header, [], unit_costs=tables.UnitCosts(
            PRIOR_COSTS, 40.0, 40.0, 7, "2026-01-02", ("1 x 6096",)))
    return out, path, {(e.key, e.bucket.name): e for e in tables.load(path).entries}


def test_the_selected_entries_get_new_figures_and_keep_their_choice(tmp_path, capsys):
    """--head-dim 128: KEY's entries take the cost model's figures (tuned spec and built-in choice)
    and today's date, with their spec, trials and exhaustive record; OTHER_KEY's entry and the
    unit costs are left exactly as they were; the summary shows old and new figures; the report
    holds both."""
    out, path, old = _table(tmp_path, with_costs=True)
    before = tables.load(path)
    assert cli.main([*ARGV, "--head-dim", "128", "--out", str(out), "--report", str(tmp_path / "rep")]) == 0
    table = tables.load(path)
    new = {(e.key, e.bucket.name): e for e in table.entries}
    assert set(new) == set(old)
    for bucket in ("b1-l2k", "b1-l32k"):
        e, was = new[(KEY, bucket)], old[(KEY, bucket)]
        assert e.spec == was.spec and e.trials == was.trials == 20 and e.exhaustive == was.exhaustive
        assert e.date == writing.today() != was.date
        assert e.default_us == _predicted(None, KEY, bucket)
        assert e.tuned_us == _predicted(was.spec, KEY, bucket)
    assert new[(KEY, "b1-l2k")].plan == "old plan"  # the cost model names no plan: the old one stays
    # The tuned split program is planned by its entry's rules; the built-in choice by the current ones.
    assert new[(KEY, "b1-l32k")].planner == "waves" and new[(KEY, "b1-l2k")].planner == tables.CURRENT_PLANNER
    assert new[(KEY, "b1-l32k")].default_plan == costmodel.launched(None, KEY, keys.parse_bucket("b1-l32k"),
                                                                      "sm_90").name
    # Outside the selection: the same entry, field for field, and the unit costs untouched.
    assert new[(OTHER_KEY, "b1-l2k")].to_dict() == old[(OTHER_KEY, "b1-l2k")].to_dict()
    assert table.unit_costs == before.unit_costs
    stdout = capsys.readouterr().out
    assert "old default" in stdout and "new tuned" in stdout and "99.00" in stdout and OTHER_KEY.label not in stdout
    report = json.loads((tmp_path / "rep" / "remeasure.json").read_text())
    assert [r["new"]["tuned_us"] for r in report["entries"]] == [new[(KEY, b)].tuned_us for b in ("b1-l2k", "b1-l32k")]
    assert "new tuned" in (tmp_path / "rep" / "remeasure.md").read_text()


def test_a_tuned_spec_now_slower_than_the_default_gives_way_to_it(tmp_path, capsys):
    """TUNED_SPLIT at 1 x 2k: more than the confirm margin slower than the built-in choice there,
    so the entry now holds the built-in choice with its figures, and is flagged with the command
    that tunes its key again; the summary and the report keep the tuned spec's measured figures."""
    out, path, _ = _table(tmp_path)
    tuned, built_in = _predicted(TUNED_SPLIT, KEY, "b1-l2k"), _predicted(None, KEY, "b1-l2k")
    assert tuned > built_in * 1.01  # the premise
    writing.save(path, tables.load(path).header, [entry("b1-l2k", TUNED_SPLIT, bandwidth_pct=50.0)])
    assert cli.main([*ARGV, "--bucket", "b1-l2k", "--head-dim", "128", "--out", str(out),
                     "--report", str(tmp_path / "rep")]) == 0
    stdout = capsys.readouterr().out
    assert "FLAGGED" in stdout and f"flagged: {KEY.label} b1-l2k: {TUNED_SPLIT.name}" in stdout
    assert "slower than the built-in choice; the built-in choice takes its place" in stdout
    assert f"{tuned:.2f}" in stdout  # the tuned spec's figure, not only the one written
    assert (f"splitkv-gen --arch sm90 --tune --head-dim 128 --group 4 --dtype bf16 --bucket b1-l2k "
            f"--out {out} --cost-model") in stdout
    e = next(e for e in tables.load(path).entries if (e.key, e.bucket.name) == (KEY, "b1-l2k"))
    assert e.spec is None and e.tuned_us == e.default_us == built_in and e.default_plan is None
    assert e.planner == tables.CURRENT_PLANNER and e.date == writing.today()
    report = json.loads((tmp_path / "rep" / "remeasure.json").read_text())
    assert report["entries"][0]["measured"]["tuned_us"] == tuned and report["entries"][0]["new"]["spec"] is None
    # Only the bucket asked for was measured again.
    e32 = next(e for e in tables.load(path).entries if e.bucket.name == "b1-l32k")
    assert (e32.tuned_us, e32.default_us, e32.date) == (1.0, 2.0, "2026-01-02")


def test_the_built_in_choice_takes_a_tuned_entrys_place_with_its_own_figures():
    """`built_in_instead`: the built-in choice's µs and plan, its bandwidth from the same bytes in
    its time; the search's record (trials, exhaustive) and the date stay."""
    tuned = entry("b1-l32k", TUNED_SPLIT, tuned_us=10.0, default_us=10.05, bandwidth_pct=60.3, trials=20,
                  planner="waves", plan="tuned plan", default_plan="built-in plan", exhaustive=dict(points=3))
    e = remeasure.built_in_instead(tuned)
    assert e.spec is None and e.tuned_us == e.default_us == 10.05 and e.plan == "built-in plan"
    assert e.default_plan is None and e.planner == tables.CURRENT_PLANNER
    assert e.bandwidth_pct == pytest.approx(60.0) and e.trials == 20 and e.exhaustive == dict(points=3)


def test_an_entry_that_fails_its_check_is_kept_as_it_was(tmp_path, capsys, monkeypatch):
    """A tuned spec that fails (a wrong result) leaves its entry as it was, says why, and the run
    ends with status 1; the other entries are written."""
    class Failing(costmodel.CostModelObjective):
        def measure(self, spec, iters=None):
            if spec is not None and spec.name == TUNED_SPLIT.name:
                raise objective.TrialFailed("wrong result: max error 0.5 of max |ref|")
            return super().measure(spec, iters)
    monkeypatch.setattr(costmodel, "CostModelObjective", Failing)
    out, path, old = _table(tmp_path)
    assert cli.main([*ARGV, "--out", str(out)]) == 1
    stdout = capsys.readouterr().out
    assert f"{KEY.label} b1-l32k: {TUNED_SPLIT.name} failed: wrong result" in stdout
    new = {(e.key, e.bucket.name): e for e in tables.load(path).entries}
    assert new[(KEY, "b1-l32k")] == old[(KEY, "b1-l32k")]
    assert new[(KEY, "b1-l2k")].date == new[(OTHER_KEY, "b1-l2k")].date == writing.today()


def test_a_lost_gpu_stops_the_run_and_keeps_what_was_measured(tmp_path, capsys, monkeypatch):
    """A lost context at KEY's second entry: status 75, the entries measured before it written
    (KEY's first one too, though its key was not finished), the rest as they were."""
    class Lost(costmodel.CostModelObjective):
        def measure(self, spec, iters=None):
            if self.bucket.name == "b1-l32k":
                raise objective.ContextLost("an illegal address")
            return super().measure(spec, iters)
    monkeypatch.setattr(costmodel, "CostModelObjective", Lost)
    out, path, old = _table(tmp_path)
    assert cli.main([*ARGV, "--out", str(out)]) == 75
    assert "an illegal address" in capsys.readouterr().err
    new = {(e.key, e.bucket.name): e for e in tables.load(path).entries}
    assert new[(KEY, "b1-l32k")] == old[(KEY, "b1-l32k")]
    assert new[(KEY, "b1-l2k")].date == new[(OTHER_KEY, "b1-l2k")].date == writing.today()


#: Tuned unit costs of the tests below (not the priors).
COSTS = CostModel(unit_overhead=192, merge_fixed=640, merge_per_partial=24, threshold=0.05)


def _unit_costs_table(tmp_path, monkeypatch, tuned_us: float, prior_us: float, asked: list):
    """A table holding COSTS, on a GPU whose measurement gives ``tuned_us`` for COSTS and
    ``prior_us`` for any other costs (each call recorded in ``asked``)."""
    from splitkv.autotune import cli as tune_cli

    class StandIn:
        def __init__(self, iters, seed):
            pass

        def __call__(self, c, iters_scale=1):
            asked.append((c, iters_scale))
            us = tuned_us if c == COSTS else prior_us
            return us, {name: us for name, _ in unit_costs.WORKLOADS}

        def close(self):
            pass
    monkeypatch.setattr(unit_costs, "GpuMeasure", StandIn)
    monkeypatch.setattr(tune_cli, "_check_gpu", lambda arch, cost_model: dict(
        name=GPU, sm_count=132, cuda_runtime="13.9", nvrtc="13.9"))
    path = save_table(tmp_path, [entry("b1-l2k")])
    writing.save(path, tables.load(path).header, [], unit_costs=tables.UnitCosts(
        COSTS, 10.0, 11.0, 9, "2026-01-02", ("1 x 6096",)))
    return path


def test_the_unit_costs_are_measured_again_against_the_priors(tmp_path, capsys, monkeypatch):
    """--unit-costs: the table's costs and the priors measured in alternating rounds, their new
    figures written under the table's header, the entries left as they were."""
    asked = []
    path = _unit_costs_table(tmp_path, monkeypatch, 30.0, 33.0, asked)
    before = tables.load(path)
    assert cli.main(["--arch", "sm90", "--tune", "--remeasure", "--unit-costs", "--out", str(tmp_path)]) == 0
    table = tables.load(path)
    assert table.header == before.header and table.entries == before.entries
    u = table.unit_costs
    assert (u.costs, u.tuned_us, u.default_us, u.trials, u.date) == (COSTS, 30.0, 33.0, 9, writing.today())
    assert u.workloads == tuple(name for name, _ in unit_costs.WORKLOADS)
    assert [c == COSTS for c, _ in asked] == [True, False, False, True] * (unit_costs.CONFIRM_ROUNDS // 2)
    assert {scale for _, scale in asked} == {2}
    assert "unit_costs" in capsys.readouterr().out


def test_unit_costs_no_longer_the_margin_faster_give_way_to_the_priors(tmp_path, capsys, monkeypatch):
    """Tuned unit costs measured within 1% of the priors: the priors take their place (as a search
    keeps them), with the priors' figure, flagged with the command that tunes them again."""
    path = _unit_costs_table(tmp_path, monkeypatch, 32.9, 33.0, [])
    assert cli.main(["--arch", "sm90", "--tune", "--remeasure", "--unit-costs", "--out", str(tmp_path)]) == 0
    u = tables.load(path).unit_costs
    assert (u.costs, u.tuned_us, u.default_us) == (PRIOR_COSTS, 33.0, 33.0)
    stdout = capsys.readouterr().out
    assert "flagged: unit_costs 0.3% faster than the built-in costs; the built-in costs take their place" in stdout
    assert "--tune --unit-costs" in stdout


def test_a_tuned_spec_that_launches_the_built_in_programs_gives_way_to_them(tmp_path, capsys):
    """A tuned spec that now launches what the built-in choice launches is the built-in choice
    measured twice (as a search counts it): the entry holds the built-in choice, flagged."""
    from splitkv.tuned import lookup

    out, path, _ = _table(tmp_path)
    built_in_split = lookup.programs(None, "sm_90", KEY)[0]
    writing.save(path, tables.load(path).header, [entry("b1-l2k", built_in_split, tuned_us=1.0, default_us=2.0)])
    assert cli.main([*ARGV, "--bucket", "b1-l2k", "--head-dim", "128", "--out", str(out)]) == 0
    assert "launches what the built-in choice launches; the built-in choice takes its place" in capsys.readouterr().out
    e = next(e for e in tables.load(path).entries if (e.key, e.bucket.name) == (KEY, "b1-l2k"))
    assert e.spec is None and e.tuned_us == e.default_us


def test_the_margin_is_judged_on_the_figures_as_the_table_records_them():
    from splitkv.autotune.confirm import beats_built_in

    # 10.0606 is 1% below 10.1623 unrounded, but the table records 10.061 and 10.162: not kept.
    assert 10.0606 <= 10.1623 * 0.99 and not beats_built_in(10.0606, 10.1623)
    assert beats_built_in(10.0, 10.2) and not beats_built_in(10.2, 10.0)


def test_a_built_in_choice_failing_while_confirmed_is_named_as_the_one_that_failed(tmp_path, capsys, monkeypatch):
    """confirm() raises only for the built-in choice (a failing candidate is left out): the reason
    names the built-in choice, not the entry's tuned spec."""
    def failing_confirm(measured, candidates, iters=None):
        raise objective.TrialFailed("wrong result: max error 0.5 of max |ref|")
    monkeypatch.setattr(remeasure, "confirm", failing_confirm)
    out, path, _ = _table(tmp_path)
    assert cli.main([*ARGV, "--bucket", "b1-l32k", "--head-dim", "128", "--out", str(out)]) == 1
    assert f"{KEY.label} b1-l32k: the built-in choice failed: wrong result" in capsys.readouterr().out


def test_costs_that_are_the_priors_are_measured_once_a_round():
    asked = []

    def measure(c, iters_scale=1):
        asked.append(c)
        return 20.0 + len(asked), {"w": 20.0 + len(asked)}
    tuned, default, per = unit_costs.against_priors(measure, PRIOR_COSTS)
    assert asked == [PRIOR_COSTS] * unit_costs.CONFIRM_ROUNDS and tuned == default and per["w"][0] == per["w"][1]


# ---- what it refuses -----------------------------------------------------------------------------

@pytest.mark.parametrize("where, message", [
    ("none", "no tuned table of cost model (sm_90)"),
    ("empty", "no table of cost model (sm_90) under --out"),
    ("unmatched", "no entry of"),
])
def test_nothing_to_measure_is_one_line_and_status_2(tmp_path, capsys, where, message):
    """No table for this GPU (none the runtime would load, none under --out) or no entry the
    selection matches: one line on stderr, status 2, nothing written."""
    argv = list(ARGV)
    if where == "empty":
        argv += ["--out", str(tmp_path / "empty")]
    elif where == "unmatched":
        out, path, _ = _table(tmp_path)
        argv += ["--out", str(out), "--head-dim", "256"]
        text = path.read_text()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    if where == "unmatched":
        assert path.read_text() == text
    assert not (tmp_path / "empty").exists()


@pytest.mark.parametrize("argv, message", [
    (["--arch", "sm90", "--remeasure"], "--remeasure goes with --tune"),
    ([*ARGV, "--storage", "j.log"], "--storage does not go with --remeasure"),
    ([*ARGV, "--devices", "0,1"], "--devices does not go with --remeasure"),
    ([*ARGV, "--exhaustive"], "--exhaustive does not go with --remeasure"),
    ([*ARGV, "--unit-costs", "--head-dim", "128"], "--head-dim with --unit-costs does not go with --remeasure"),
])
def test_remeasure_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 2 and message in capsys.readouterr().err


def test_the_runtime_table_is_the_one_measured_without_out(tmp_path, monkeypatch):
    """Without --out, the table is this GPU's in SPLITKV_TUNED_CONFIG_DIR before the shipped one."""
    from splitkv.autotune.tuning import TuneRun
    from splitkv.tuned import lookup

    path = save_table(tmp_path, [entry("b1-l2k")])
    monkeypatch.setenv(lookup.ENV_DIR, str(tmp_path))
    run = TuneRun(arch="sm_90", keys=(), buckets=(), trials=1, iters=1)
    assert remeasure.table_file(run, dict(name=GPU)) == path
    with pytest.raises(remeasure.Refused, match="no tuned table of NVIDIA Other"):
        remeasure.table_file(run, dict(name="NVIDIA Other"))
