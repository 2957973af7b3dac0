"""The work-unit planner's costs tuned per GPU, without a GPU: the table's ``unit_costs``, which
table the runtime takes them from (and that its units plans follow them), the search of
`splitkv.autotune.unit_costs` scored by a cost model standing in for the GPU, and the CLI flag."""

from __future__ import annotations

import math

import pytest
import yaml

from splitkv import cli
from splitkv.autotune import unit_costs, writing
from splitkv.tuned import lookup, tables
from splitkv.autotune.objective import TrialFailed
from splitkv.work_units import CostModel, choose_kv_splits, predicted_makespan
from tests.fake_gpu import fake_gpu  # noqa: F401 - a fixture, used by name

GPU = "NVIDIA Fake GPU"
ARCH = "sm_90"
#: A GPU model's slots and the units' block, as the runtime plans units for 8 K/V heads of D=128.
SLOTS, BLOCK = 264, 128


def _header(gpu=GPU):
    return writing.make_header(gpu, ARCH, 132, "13.0", "13.0", "0.1.0", date="2026-01-02")


def _unit_costs(costs: CostModel, tuned_us=30.0, default_us=31.0):
    return tables.UnitCosts(costs, tuned_us, default_us, 12, "2026-01-02", ("1 x 6096", "3 x 4096"))


def _table_data(**unit_costs) -> dict:
    """A table of no entries, as YAML reads it, whose unit costs are the priors' with ``unit_costs``
    in place (None: the field left out)."""
    costs = dict(costs=CostModel().as_dict(), tuned_us=1.0, default_us=1.0, trials=3, date="2026-01-02",
                 workloads=["1 x 6096"])
    costs.update(unit_costs)
    costs = {name: value for name, value in costs.items() if value is not None}
    return dict(_header(), entries_count=0, entries_sha256=tables.entries_digest([]), unit_costs=costs, entries=[])


# ---- the table ------------------------------------------------------------------------------


def test_unit_costs_round_trip_through_the_table_and_survive_later_entries(tmp_path):
    path = tables.table_path(tmp_path, ARCH, GPU)
    costs = CostModel(unit_overhead=192, merge_fixed=640, merge_per_partial=24, threshold=0.05)
    writing.save(path, _header(), [], unit_costs=_unit_costs(costs))
    table = tables.load(path)
    assert table.unit_costs == _unit_costs(costs)
    assert writing.dump(table) == path.read_text()
    # Saving kernel entries keeps the costs; saving new costs replaces them.
    writing.save(path, _header(), [])
    assert tables.load(path).unit_costs.costs == costs
    writing.save(path, _header(), [], unit_costs=_unit_costs(CostModel()))
    assert tables.load(path).unit_costs.costs == CostModel()
    assert yaml.safe_load(path.read_text())["unit_costs"]["costs"]["threshold"] == CostModel().threshold


@pytest.mark.parametrize("costs, message", [
    (dict(unit_overhead=64, merge_fixed=128, merge_per_partial=16, threshold=-0.1, max_ways=8), "threshold"),
    (dict(unit_overhead=64, merge_fixed=128, merge_per_partial=16, threshold=0.03), "expected the fields"),
    (dict(unit_overhead=64, merge_fixed=128, merge_per_partial=16, threshold=0.03, max_ways=8, speed=2),
     "expected the fields"),
    (dict(unit_overhead="fast", merge_fixed=128, merge_per_partial=16, threshold=0.03, max_ways=8), "unit_overhead"),
])
def test_a_table_with_bad_unit_costs_is_refused_naming_the_field(tmp_path, costs, message):
    path = tables.table_path(tmp_path, ARCH, GPU)
    data = _table_data(costs=costs)
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(tables.TableError, match=message):
        tables.load(path)


@pytest.mark.parametrize("fields, message", [(dict(tuned_us=None), "lacks \\['tuned_us'\\]"),
                                             (dict(tuned_us="fast"), "tuned_us: expected a finite number")])
def test_unit_costs_without_their_figures_are_refused_by_name(tmp_path, fields, message):
    path = tables.table_path(tmp_path, ARCH, GPU)
    data = _table_data(**fields)
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(tables.TableError, match=message):
        tables.load(path)


def test_lookup_takes_the_gpus_own_costs_then_the_same_archs(tmp_path, monkeypatch):
    monkeypatch.setattr(lookup, "shipped_dir", lambda: tmp_path / "shipped")
    monkeypatch.setenv(lookup.ENV_DIR, str(tmp_path / "user"))
    lookup.forget()
    assert lookup.unit_costs(ARCH, GPU) is None
    other = CostModel(threshold=0.07)
    writing.save(tables.table_path(tmp_path / "shipped", ARCH, "NVIDIA Other GPU"), _header("NVIDIA Other GPU"), [],
                unit_costs=_unit_costs(other))
    # A cost-model table is never another GPU's.
    writing.save(tables.table_path(tmp_path / "user", ARCH, lookup.COST_MODEL_GPU), _header(lookup.COST_MODEL_GPU),
                [], unit_costs=_unit_costs(CostModel(threshold=0.11)))
    lookup.forget()
    found, source = lookup.unit_costs(ARCH, GPU)
    assert found.costs == other and "same arch" in source and "NVIDIA Other GPU" in source
    own = CostModel(threshold=0.09)
    writing.save(tables.table_path(tmp_path / "shipped", ARCH, GPU), _header(), [], unit_costs=_unit_costs(own))
    lookup.forget()
    found, source = lookup.unit_costs(ARCH, GPU)
    assert found.costs == own and "exact GPU" in source
    assert lookup.unit_costs("sm_80", GPU) is None


# ---- the runtime ----------------------------------------------------------------------------


def test_units_plans_follow_the_costs_tuned_for_the_gpu(fake_gpu):
    from splitkv import DecodeAttention

    # With the priors, 8 rows of 6096 tokens on 264 slots are split; with a unit overhead that no
    # split can repay, they stay whole.
    assert DecodeAttention(32, 8, 128).plan([6096], variant="units").split
    whole = CostModel(unit_overhead=10**6)
    path = tables.table_path(fake_gpu.tables, ARCH, GPU)
    writing.save(path, _header(), [], unit_costs=_unit_costs(whole))
    lookup.forget()
    attn = DecodeAttention(32, 8, 128)
    assert attn.unit_costs == whole and str(path) in attn.unit_costs_source
    assert not attn.plan([6096], variant="units").split
    # The default planner still routes a long row among short ones to units, as under the priors
    # (the routing was measured with them), and plans the units with the table's costs.
    from splitkv.work_units import UnitPlan

    routed = attn.plan([65536] + [512] * 63)
    assert isinstance(routed, UnitPlan) and not routed.split
    assert DecodeAttention(32, 8, 128, tuned=False).plan([65536] + [512] * 63).split
    # Costs given to the instance win over the table's; tuned=False keeps the priors.
    given = DecodeAttention(32, 8, 128, unit_costs=CostModel())
    assert given.unit_costs_source is None and given.plan([6096], variant="units").split
    assert DecodeAttention(32, 8, 128, tuned=False).plan([6096], variant="units").split
    with pytest.raises(TypeError, match="unit_costs"):
        DecodeAttention(32, 8, 128, unit_costs={"threshold": 0.1})


# ---- the search -----------------------------------------------------------------------------


def _stand_in(true: CostModel, fails=lambda costs: False, calls=None):
    """A GPU stand-in: each workload's time is the makespan, under ``true`` costs, of the plan the
    candidate costs make (so a candidate is faster exactly when it plans better for ``true``)."""
    def measure(costs, iters_scale=1):
        if calls is not None:
            calls.append((costs, iters_scale))
        if fails(costs):
            raise TrialFailed("wrong result")
        per = {}
        for name, lens in unit_costs.WORKLOADS:
            plan = choose_kv_splits(lens, 8, block_size=BLOCK, slots=SLOTS, costs=costs)
            per[name] = predicted_makespan(plan, lens, true) / 64.0
        return math.exp(sum(math.log(t) for t in per.values()) / len(per)), per
    return measure


def _plans(costs):
    return unit_costs.plans_of(costs, [(BLOCK, SLOTS)] * len(unit_costs.WORKLOADS))


def test_each_workload_is_planned_on_its_own_geometry():
    geometry = [(BLOCK, SLOTS)] * len(unit_costs.WORKLOADS)
    fewer = [(BLOCK, SLOTS)] + [(BLOCK, SLOTS // 2)] * (len(unit_costs.WORKLOADS) - 1)
    assert unit_costs.plans_of(CostModel(), geometry)[0] == unit_costs.plans_of(CostModel(), fewer)[0]
    assert unit_costs.plans_of(CostModel(), geometry)[1:] != unit_costs.plans_of(CostModel(), fewer)[1:]
    with pytest.raises(ValueError):
        unit_costs.plans_of(CostModel(), geometry[:-1])  # one geometry per workload


def test_the_search_finds_costs_that_plan_better_when_the_priors_are_off():
    # Units and merges that cost far more than the priors say: the priors split rows that should
    # stay whole (about 4% of the geometric mean on these workloads).
    true = CostModel(unit_overhead=512, merge_fixed=2048, merge_per_partial=128, threshold=0.0)
    calls = []
    measure = _stand_in(true, calls=calls)
    outcome = unit_costs.search(measure, _plans, trials=12, seed=0)
    calls = list(calls)  # the search's calls, before this test's own below
    assert calls[0][0] == CostModel()  # the priors are measured first
    assert outcome.costs != CostModel() and outcome.tuned_us < outcome.default_us * (1 - 0.01)
    assert outcome.tuned_us == pytest.approx(measure(outcome.costs)[0])
    assert outcome.default_us == pytest.approx(measure(CostModel())[0])
    assert outcome.trials <= 12 and set(outcome.workloads_us) == {name for name, _ in unit_costs.WORKLOADS}
    # Distinct plans only are measured (once each, before the confirmation's rounds).
    searched = [_plans(costs) for costs, scale in calls if scale == 1]
    assert len(searched) == len(set(searched)) == outcome.trials
    assert sum(scale == 2 for _, scale in calls) == 2 * unit_costs.CONFIRM_ROUNDS


def test_the_search_keeps_the_priors_when_nothing_beats_them_and_never_keeps_a_failed_plan():
    outcome = unit_costs.search(_stand_in(CostModel()), _plans, trials=8, seed=1)
    assert outcome.costs == CostModel() and outcome.tuned_us == outcome.default_us
    # Every candidate but the priors fails its check: the priors stay.
    true = CostModel(unit_overhead=512, merge_fixed=2048, merge_per_partial=128, threshold=0.0)
    outcome = unit_costs.search(_stand_in(true, fails=lambda costs: costs != CostModel()), _plans, trials=6, seed=2)
    assert outcome.costs == CostModel()
    with pytest.raises(RuntimeError, match="built-in unit costs"):
        unit_costs.search(_stand_in(true, fails=lambda costs: True), _plans, trials=3, seed=3)


def _optimistic_once(true: CostModel, measure_fails=None):
    """A stand-in whose search figures favour every candidate but the priors by 5% (noise a
    minimum picks), while the confirmation's figures are the true ones."""
    honest = _stand_in(true)

    def measure(costs, iters_scale=1):
        if measure_fails is not None and iters_scale == 2 and measure_fails(costs):
            raise TrialFailed("wrong result")
        us, per = honest(costs)
        if iters_scale == 1 and costs != CostModel():
            return us * 0.95, {name: t * 0.95 for name, t in per.items()}
        return us, per
    return measure


def test_a_best_candidate_not_confirmed_against_the_priors_leaves_the_priors():
    outcome = unit_costs.search(_optimistic_once(CostModel()), _plans, trials=6, seed=4)
    assert outcome.costs == CostModel() and outcome.tuned_us == outcome.default_us
    assert outcome.default_us == pytest.approx(_stand_in(CostModel())(CostModel())[0])


def test_a_check_that_fails_in_the_confirmation_keeps_the_priors_or_stops_the_search():
    outcome = unit_costs.search(_optimistic_once(CostModel(), lambda costs: costs != CostModel()), _plans,
                                trials=6, seed=5)
    assert outcome.costs == CostModel()
    with pytest.raises(RuntimeError, match="measured again"):
        unit_costs.search(_optimistic_once(CostModel(), lambda costs: costs == CostModel()), _plans, trials=6, seed=5)


def test_a_lost_gpu_ends_the_search_at_once():
    from splitkv.autotune.objective import ContextLost

    calls = []

    def measure(costs, iters_scale=1):
        calls.append(costs)
        if len(calls) == 3:
            raise ContextLost("illegal address")
        return _stand_in(CostModel())(costs)
    with pytest.raises(ContextLost):
        unit_costs.search(measure, _plans, trials=10, seed=6)
    assert len(calls) == 3


def test_the_kept_costs_are_the_nearest_the_priors_of_those_that_plan_the_same():
    true = CostModel(unit_overhead=512, merge_fixed=2048, merge_per_partial=128, threshold=0.0)
    asked = []

    def plans(costs):
        asked.append(costs)
        return _plans(costs)
    outcome = unit_costs.search(_stand_in(true), plans, trials=12, seed=0)
    kept = _plans(outcome.costs)
    same = [c for c in asked if _plans(c) == kept]
    assert outcome.costs != CostModel() and len(same) > 1  # a choice was made
    distance = unit_costs._distance_from_priors
    assert distance(outcome.costs) == min(distance(c) for c in same)


def test_candidates_are_on_the_grid_and_the_priors_are_one_of_them():
    assert unit_costs.costs_of(unit_costs.params_of(CostModel())) == CostModel()
    for name, (low, high, step) in unit_costs.SPACE.items():
        value = getattr(CostModel(), name)
        assert low <= value <= high and abs(round((value - low) / step) * step + low - value) < 1e-9, name


# ---- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize("extra", [["--cost-model"], ["--exhaustive"], ["--report", "out"],
                                   ["--devices", "0,1", "--storage", "tune.log"], ["--storage", "tune.log"],
                                   ["--timeout", "5"], ["--study", "x"], ["--bucket", "b1-l2k"],
                                   ["--report-from", "t.yaml", "--report", "r", "--storage", "j.log"],
                                   ["--head-dim", "128"], ["--dtype", "fp8_e4m3"]])
def test_unit_costs_refuses_the_flags_of_the_kernel_search(extra, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--arch", "sm90", "--tune", "--unit-costs", *extra])
    assert "does not go with --unit-costs" in capsys.readouterr().err


def test_a_unit_costs_run_merges_its_costs_into_the_table_and_keeps_its_header(tmp_path, monkeypatch, capsys):
    from splitkv.autotune import cli as tune_cli

    true = CostModel(unit_overhead=512, merge_fixed=2048, merge_per_partial=128, threshold=0.0)

    class StandIn:  # the GPU measurement, as the search sees it
        def __init__(self, iters, seed):
            self.measure = _stand_in(true)

        def __call__(self, costs, iters_scale=1):
            return self.measure(costs, iters_scale)

        def plans(self, costs):
            return _plans(costs)

        def close(self):
            pass
    monkeypatch.setattr(unit_costs, "GpuMeasure", StandIn)
    monkeypatch.setattr(tune_cli, "_check_gpu", lambda arch, cost_model: dict(
        name=GPU, sm_count=132, cuda_runtime="13.9", nvrtc="13.9"))
    path = tables.table_path(tmp_path, ARCH, GPU)
    writing.save(path, _header(), [])  # an older run's table: its header names that run
    assert cli.main(["--arch", "sm90", "--tune", "--unit-costs", "--trials", "12", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name, _ in unit_costs.WORKLOADS)
    table = tables.load(path)
    assert table.header == _header() and table.unit_costs.costs != CostModel()
    assert table.unit_costs.tuned_us < table.unit_costs.default_us and table.unit_costs.trials <= 12
