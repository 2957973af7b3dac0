"""The work-unit planner's costs tuned per GPU, without a GPU: the table's ``unit_costs``, which
table the runtime takes them from (and that its units plans follow them), the search of
`splitkv.autotune.unit_costs` scored by a cost model standing in for the GPU, and the CLI flag."""

from __future__ import annotations

import math

import pytest
import yaml

from splitkv import cli
from splitkv.autotune import lookup, tables, unit_costs
from splitkv.autotune.objective import TrialFailed
from splitkv.work_units import CostModel, choose_kv_splits, predicted_makespan
from tests.test_runtime_fake_gpu import fake_gpu  # noqa: F401 - a fixture, used by name

GPU = "NVIDIA Fake GPU"
ARCH = "sm_90"
#: A GPU model's slots and the units' block, as the runtime plans units for 8 K/V heads of D=128.
SLOTS, BLOCK = 264, 128


def _header(gpu=GPU):
    return tables.make_header(gpu, ARCH, 132, "13.0", "13.0", "0.1.0", date="2026-01-02")


def _unit_costs(costs: CostModel, tuned_us=30.0, default_us=31.0):
    return tables.UnitCosts(costs, tuned_us, default_us, 12, "2026-01-02", ("1 x 6096", "3 x 4096"))


# ---- the table ------------------------------------------------------------------------------


def test_unit_costs_round_trip_through_the_table_and_survive_later_entries(tmp_path):
    path = tables.table_path(tmp_path, ARCH, GPU)
    costs = CostModel(unit_overhead=192, merge_fixed=640, merge_per_partial=24, threshold=0.05)
    tables.save(path, _header(), [], unit_costs=_unit_costs(costs))
    table = tables.load(path)
    assert table.unit_costs == _unit_costs(costs)
    assert tables.dump(table) == path.read_text()
    # Saving kernel entries keeps the costs; saving new costs replaces them.
    tables.save(path, _header(), [])
    assert tables.load(path).unit_costs.costs == costs
    tables.save(path, _header(), [], unit_costs=_unit_costs(CostModel()))
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
    data = dict(_header(), unit_costs=dict(costs=costs, tuned_us=1.0, default_us=1.0), entries=[])
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
    tables.save(tables.table_path(tmp_path / "shipped", ARCH, "NVIDIA Other GPU"), _header("NVIDIA Other GPU"), [],
                unit_costs=_unit_costs(other))
    # A cost-model table is never another GPU's.
    tables.save(tables.table_path(tmp_path / "user", ARCH, lookup.COST_MODEL_GPU), _header(lookup.COST_MODEL_GPU),
                [], unit_costs=_unit_costs(CostModel(threshold=0.11)))
    lookup.forget()
    assert lookup.unit_costs(ARCH, GPU).costs == other
    own = CostModel(threshold=0.09)
    tables.save(tables.table_path(tmp_path / "shipped", ARCH, GPU), _header(), [], unit_costs=_unit_costs(own))
    lookup.forget()
    assert lookup.unit_costs(ARCH, GPU).costs == own
    assert lookup.unit_costs("sm_80", GPU) is None


# ---- the runtime ----------------------------------------------------------------------------


def test_units_plans_follow_the_costs_tuned_for_the_gpu(fake_gpu):
    from splitkv import DecodeAttention

    # With the priors, 8 rows of 6096 tokens on 264 slots are split; with a unit overhead that no
    # split can repay, they stay whole.
    assert DecodeAttention(32, 8, 128).plan([6096], variant="units").split
    whole = CostModel(unit_overhead=10**6)
    tables.save(tables.table_path(fake_gpu.tables, ARCH, GPU), _header(), [], unit_costs=_unit_costs(whole))
    lookup.forget()
    attn = DecodeAttention(32, 8, 128)
    assert attn.unit_costs == whole and "tuned for this GPU" in attn.unit_costs_source
    assert not attn.plan([6096], variant="units").split
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
    return unit_costs.plans_of(costs, BLOCK, SLOTS)


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


def test_candidates_are_on_the_grid_and_the_priors_are_one_of_them():
    assert unit_costs.costs_of(unit_costs.params_of(CostModel())) == CostModel()
    for name, (low, high, step) in unit_costs.SPACE.items():
        value = getattr(CostModel(), name)
        assert low <= value <= high and abs(round((value - low) / step) * step + low - value) < 1e-9, name


# ---- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize("extra", [["--cost-model"], ["--exhaustive"], ["--report", "out"],
                                   ["--devices", "0,1", "--storage", "tune.log"]])
def test_unit_costs_refuses_the_flags_of_the_kernel_search(extra, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--arch", "sm90", "--tune", "--unit-costs", *extra])
    assert "does not go with --unit-costs" in capsys.readouterr().err
