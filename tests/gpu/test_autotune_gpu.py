"""A short real tuning run on the GPU, end to end: `splitkv-gen --tune` measures candidates, writes a
table, and the runtime then plans with that table's programs, which match the float64 reference
(marker: gpu)."""

from __future__ import annotations

import math

import pytest

cupy = pytest.importorskip("cupy")
pytest.importorskip("optuna")

from splitkv import DecodeAttention, cli  # noqa: E402
from splitkv.tuned import keys, lookup, tables  # noqa: E402
from splitkv.runtime import gpu_name  # noqa: E402

from decode_checks import _rng, check_close, poisoned, random_values, reference  # noqa: E402
from test_quantized_decode_gpu import quantized_inputs  # noqa: E402


def _arch() -> str:
    return "sm_" + cupy.cuda.Device().compute_capability


@pytest.mark.gpu_exclusive  # times kernels: the GPU to itself in a parallel run
def test_a_short_tuning_run_writes_a_table_the_runtime_uses(tmp_path, monkeypatch, capsys):
    """Six trials of one key on a 1 x 4k bucket: the table holds one entry for this GPU, checked
    and timed; DecodeAttention built afterwards finds it and runs its programs correctly."""
    out = tmp_path / "tables"
    rc = cli.main(["--arch", _arch(), "--tune", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
                   "--bucket", "b1-l4k", "--trials", "6", "--iters", "5", "--storage", str(tmp_path / "j.log"),
                   "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    path = tables.table_path(out, _arch(), gpu_name(cupy.cuda.Device().id))
    table = tables.load(path)
    (entry,) = table.entries
    assert entry.bucket.name == "b1-l4k" and entry.trials == 6
    assert 0 < entry.tuned_us <= entry.default_us and 0 < entry.bandwidth_pct < 100
    # A winner records what the built-in choice launched, and launched something else.
    if entry.spec is None:
        assert entry.default_plan is None
    else:
        assert entry.default_plan is not None and entry.plan != entry.default_plan

    monkeypatch.setenv(lookup.ENV_DIR, str(out))
    lookup.forget()
    attn = DecodeAttention(32, 8, 128)
    assert attn.tuned_source is not None and str(path) in attn.tuned_source
    lens = [4096 - 37]  # nearest to the tuned bucket, no multiple of any chunk
    attn.plan(lens)
    assert attn.tuned_entry == entry
    split, dense, dense_only = lookup.programs(entry.spec, attn.arch, entry.key)
    assert (attn.split_spec, attn.dense_spec) == (split, dense)
    assert attn._launch.spec.as_dense() in (split.as_dense(), dense.as_dense())

    seed = int(_rng("autotune", tuple(lens)).integers(2**31))
    q, q64 = random_values((1, 32, 128), "bf16", seed)
    k, k64 = random_values((1, lens[0], 8, 128), "bf16", seed + 1)
    v, v64 = random_values((1, lens[0], 8, 128), "bf16", seed + 2)
    result = poisoned((1, 32, 128), "bf16")
    attn.run(q, k, v, out=result)
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1.0 / math.sqrt(128))
    check_close(result, None, ref_out, ref_lse, lens, "bf16", f"tuned {attn.plan_info}")
    lookup.forget()


@pytest.mark.gpu_exclusive  # times kernels: the GPU to itself in a parallel run
def test_a_short_unit_costs_run_writes_costs_the_runtime_plans_with(tmp_path, monkeypatch, capsys):
    """`splitkv-gen --tune --unit-costs` with 4 distinct plans: every workload's plan is checked and
    timed, the table holds the costs with both figures, and a DecodeAttention built afterwards plans
    its units with them and runs them correctly on a ragged batch."""
    from splitkv.autotune import unit_costs
    from splitkv.work_units import choose_kv_splits

    out = tmp_path / "tables"
    rc = cli.main(["--arch", _arch(), "--tune", "--unit-costs", "--trials", "4", "--iters", "5", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    for name, _ in unit_costs.WORKLOADS:
        assert name in captured.out
    path = tables.table_path(out, _arch(), gpu_name(cupy.cuda.Device().id))
    result = tables.load(path).unit_costs
    assert result is not None and 1 <= result.trials <= 4
    assert 0 < result.tuned_us <= result.default_us
    assert result.workloads == tuple(name for name, _ in unit_costs.WORKLOADS)

    monkeypatch.setenv(lookup.ENV_DIR, str(out))
    lookup.forget()
    attn = DecodeAttention(32, 8, 128)
    assert attn.unit_costs == result.costs and attn.unit_costs_source is not None
    lens = [6096 - 37, 515, 3000]
    plan = attn.plan(lens, variant="units")
    expected = choose_kv_splits(lens, 8, block_size=plan.block_size, slots=plan.slots, costs=result.costs)
    assert (plan.units == expected.units).all() and (plan.merges == expected.merges).all()
    seed = int(_rng("unit costs", tuple(lens)).integers(2**31))
    q, q64 = random_values((3, 32, 128), "bf16", seed)
    k, k64 = random_values((3, max(lens), 8, 128), "bf16", seed + 1)
    v, v64 = random_values((3, max(lens), 8, 128), "bf16", seed + 2)
    result_out = poisoned((3, 32, 128), "bf16")
    attn.run(q, k, v, out=result_out)
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1.0 / math.sqrt(128))
    check_close(result_out, None, ref_out, ref_lse, lens, "bf16", f"unit costs {attn.plan_info}")
    lookup.forget()


@pytest.mark.gpu_exclusive  # times kernels: the GPU to itself in a parallel run
def test_a_winners_last_check_runs_on_the_gpu():
    """verify() passes a correct split program (as planned and as its units program) and a
    correct dense program on a ragged batch, the objective's figures are sane, and runs() names
    what each candidate launches on the bucket."""
    from splitkv.autotune import measure
    from splitkv.tuned.keys import TuneKey, parse_bucket
    from splitkv.heuristics import default_spec

    key, bucket = TuneKey(128, 4), parse_bucket("b1-l4k")
    objective = measure.GpuObjective(key, bucket, iters=5, jobs=4)
    try:
        split = default_spec(_arch(), 128, 4).replace(stages=3)
        dense = default_spec(_arch(), 128, 4, variant="dense")
        assert objective.prepare([split, dense]) == {}
        assert objective.verify(split) is None and objective.verify(dense) is None
        m = objective.measure(split)
        assert 0 < m.us < 1000 and 0 < m.bandwidth_pct < 120 and m.detail["plan"].startswith("split")
        # What a candidate launches: the built-in dense program where the planner splits (one
        # sequence) is the built-in split program, which is also what the built-in choice launches.
        builtin = objective.runs(None)
        assert builtin.startswith("split") and objective.runs(dense) == builtin
        assert objective.runs(default_spec(_arch(), 128, 4)) == builtin
        assert objective.runs(split) == m.detail["plan"] != builtin
    finally:
        objective.close()


@pytest.mark.gpu_exclusive  # times kernels: the GPU to itself in a parallel run
def test_the_bandwidth_sweep_times_tuned_builtin_and_peers():
    """The report's sweep gives a share of the copy bandwidth for the tuned and built-in programs
    at each length (a peer's figure where it is installed and correct)."""
    pytest.importorskip("torch")
    from splitkv.autotune import sweep
    from splitkv.tuned.keys import TuneKey

    result = sweep.sweep(TuneKey(128, 4), lengths=(2048, 8192), iters=10)
    assert result["lengths"] == [2048, 8192]
    for series in ("tuned", "built-in"):
        assert all(v is not None and 0 < v < 120 for v in result[series]), (series, result)


def _shipped_sample(gpu: str = "NVIDIA H200", arch: str = "sm_90") -> list:
    """Of the shipped table of ``gpu``, per (K/V dtype, bucket, one query token or several) the tuned
    entry of the largest gain: the programs furthest from the built-in choice that the runtime
    would launch."""
    path = lookup.shipped_dir() / arch / f"{keys.gpu_file_stem(gpu)}.yaml"
    best = {}
    for e in tables.load(path).entries:
        slot = (e.key.kv_dtype, e.bucket.name, e.key.query_tokens > 1)
        if e.spec is not None and (slot not in best or e.speedup > best[slot].speedup):
            best[slot] = e
    return [best[slot] for slot in sorted(best)]


@pytest.mark.parametrize("entry", _shipped_sample(), ids=lambda e: f"{e.key.label}-{e.bucket.name}")
def test_the_shipped_table_launches_what_was_tuned_and_it_is_right(entry, monkeypatch):
    """On the GPU the table was tuned on, a call of the entry's bucket shape takes that entry, plans
    exactly what the tuner measured (its recorded plan), and matches the float64 reference."""
    if gpu_name(cupy.cuda.Device().id) != "NVIDIA H200":
        pytest.skip("the shipped entries checked here are the H200's")
    monkeypatch.delenv(lookup.ENV_DIR, raising=False)  # the shipped table, nothing before it
    lookup.forget()
    k_, b = entry.key, entry.bucket
    num_kv, num_qo, dim = keys.REFERENCE_KV_HEADS, keys.REFERENCE_KV_HEADS * k_.group_size, k_.head_dim
    lens = [b.seq_len] * b.batch
    attn = DecodeAttention(num_qo, num_kv, dim, q_dtype=k_.q_dtype, kv_dtype=k_.kv_dtype)
    attn.plan(lens, query_tokens=k_.query_tokens)
    assert attn.tuned_entry == entry and attn.plan_info == entry.plan, attn.plan_info

    seed = int(_rng("shipped", k_.label, b.name).integers(2**31))
    if k_.query_tokens > 1:  # the tuner's own inputs and causal float64 reference of T tokens
        from splitkv.autotune.measure import TOLERANCE, BucketInputs

        inp = BucketInputs(k_, lens, seed)
        inp.poison_output()
        attn.run(inp.q, inp.k, inp.v, out=inp.out)
        cupy.cuda.Device().synchronize()
        assert inp.error() <= TOLERANCE, (k_.label, b.name, attn.plan_info, inp.error())
        return
    q, q64 = random_values((b.batch, num_qo, dim), k_.q_dtype, seed)
    if k_.kv_dtype in ("bf16", "fp16"):
        k, k64 = random_values((b.batch, b.seq_len, num_kv, dim), k_.kv_dtype, seed + 1)
        v, v64 = random_values((b.batch, b.seq_len, num_kv, dim), k_.kv_dtype, seed + 2)
    else:
        k, v, k64, v64, _, _ = quantized_inputs(k_.kv_dtype, b.batch, b.seq_len, num_kv, dim, seed + 1)
    out = poisoned((b.batch, num_qo, dim), k_.q_dtype)
    lse = cupy.full((b.batch, num_qo), cupy.nan, dtype=cupy.float32)
    attn.run(q, k, v, out=out, lse=lse)
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1.0 / math.sqrt(dim))
    check_close(out, lse, ref_out, ref_lse, lens, k_.q_dtype, f"{k_.label} {b.name} {attn.plan_info}")
