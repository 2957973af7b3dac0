"""Which tuned table the runtime looks up without a GPU (this GPU's before the arch's, the user's
before the shipped, never another arch's nor the cost model's, a corrupt one skipped), which
programs an entry stands for, and that the runtime, on a fake GPU, then launches what the table
says."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import splitkv
from splitkv import heuristics
from splitkv.autotune import writing
from splitkv.heuristics import default_spec
from splitkv.plan import plan_splits
from splitkv.spec import KernelSpec
from splitkv.tuned import lookup, tables
from splitkv.tuned.keys import TuneKey
from tests.fake_gpu import _DeviceArray, fake_gpu  # noqa: F401 - fake_gpu: a fixture, used by name

from autotune_helpers import (ARCH, GPU, KEY, OTHER_KEY, OTHER_SPLIT, TUNED_DENSE, TUNED_SPLIT, entry,  # noqa: F401
                              folders, header, save_table)  # folders: a fixture, used by name


# ---- lookup --------------------------------------------------------------------------------------

def _found(key=KEY, gpu=GPU, arch=ARCH):
    return lookup.find(arch, gpu, key)


def test_lookup_prefers_this_gpus_table_to_another_of_the_arch(folders):
    """This GPU's own table wins over another table of the same arch, even one sorting first."""
    _, shipped = folders
    exact = save_table(shipped, [entry("b1-l32k", TUNED_SPLIT)])
    save_table(shipped, [entry("b1-l32k", TUNED_DENSE)], gpu="AAA Other GPU")
    found = _found()
    assert found.source.startswith(f"{exact} (exact GPU: {GPU})")
    assert [e.spec for e in found.entries] == [TUNED_SPLIT]


def test_lookup_falls_back_to_another_table_of_the_arch(folders):
    """A same-arch table serves a key this GPU's table lacks; no table with the key: None."""
    _, shipped = folders
    save_table(shipped, [entry("b1-l32k", OTHER_SPLIT, key=OTHER_KEY)])
    other = save_table(shipped, [entry("b1-l32k", TUNED_DENSE)], gpu="NVIDIA Other GPU")
    found = _found()
    assert found.source.startswith(f"{other} (same arch: NVIDIA Other GPU)")
    assert [e.spec for e in found.entries] == [TUNED_DENSE]
    assert _found(key=TuneKey(256, 1)) is None  # the heuristic


def test_lookup_without_tables_is_none(folders):
    """No folder holds anything: the built-in heuristic (None)."""
    assert _found() is None


def test_the_user_folder_wins_over_the_shipped_one(folders):
    """The user's table of this GPU wins; where it lacks the key, the shipped table of this GPU
    comes before other tables of the arch."""
    user, shipped = folders
    mine = save_table(user, [entry("b1-l32k", TUNED_DENSE)])
    shipped_exact = save_table(shipped, [entry("b1-l32k", TUNED_SPLIT), entry("b1-l32k", OTHER_SPLIT, key=OTHER_KEY)])
    save_table(user, [entry("b1-l32k", None, key=OTHER_KEY)], gpu="AAA Other GPU")
    assert _found().source.startswith(f"{mine} (exact GPU")
    assert [e.spec for e in _found().entries] == [TUNED_DENSE]
    found = _found(key=OTHER_KEY)
    assert found.source.startswith(f"{shipped_exact} (exact GPU")


def test_a_corrupt_table_warns_once_and_is_skipped(folders):
    """A table that cannot be read gives one RuntimeWarning naming it, however often it is looked
    up, and the lookup goes on with the next table."""
    user, shipped = folders
    broken = tables.table_path(user, ARCH, GPU)
    broken.parent.mkdir(parents=True)
    broken.write_text("schema: [1\n")
    fallback = save_table(shipped, [entry("b1-l32k", TUNED_SPLIT)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second, third = _found(), _found(), _found(key=OTHER_KEY)
    relevant = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(relevant) == 1, [str(w.message) for w in caught]
    assert str(broken) in str(relevant[0].message)
    assert first.source.startswith(str(fallback)) and second.source == first.source
    assert third is None


def test_tables_of_another_arch_are_not_used(folders):
    """A table in another arch's folder, or one whose header says another arch, is not used."""
    user, shipped = folders
    sm80_split = default_spec("sm_80", 128, 4).replace(chunk_size=256)
    save_table(shipped, [entry("b1-l32k", sm80_split)], arch="sm_80")
    save_table(user, [entry("b1-l32k", TUNED_SPLIT.replace(arch="sm_100"))], header_arch="sm_100")
    assert _found() is None
    sm80 = _found(arch="sm_80")
    assert sm80.source.startswith(str(tables.table_path(shipped, "sm_80", GPU)))
    assert [e.spec for e in sm80.entries] == [sm80_split]


def test_a_cost_model_table_never_serves_another_gpu(folders):
    """Predictions are not measurements: a cost-model table of the arch is not a fallback."""
    _, shipped = folders
    save_table(shipped, [entry("b1-l32k", TUNED_SPLIT)], gpu=lookup.COST_MODEL_GPU)
    assert _found() is None


def test_entry_for_takes_the_nearest_bucket():
    """Rows (sequences x K/V heads) and the longest length pick the nearest bucket, in octaves (rows
    made of sequences or of heads alike: see test_runtime_takes_rows_as_sequences_times_kv_heads)."""
    choices = lookup.TunedChoices(KEY, tuple(entry(b) for b in ("b1-l2k", "b1-l32k", "b32-l4k")), "test")
    assert choices.entry_for(8, 30000).bucket.name == "b1-l32k"
    assert choices.entry_for(256, 4096).bucket.name == "b32-l4k"
    assert choices.entry_for(8, 1500).bucket.name == "b1-l2k"
    assert choices.entry_for(512, 8192).bucket.name == "b32-l4k"
    assert lookup.TunedChoices(KEY, (), "empty").entry_for(8, 1024) is None


# ---- lookup.programs -----------------------------------------------------------------------------

def test_programs_of_an_entry():
    """spec None: the heuristic's programs; a split spec replaces the split program, a dense spec
    the dense one and makes the bucket dense only."""
    builtin_split, builtin_dense = default_spec(ARCH, 128, 4), default_spec(ARCH, 128, 4, variant="dense")
    assert builtin_split != TUNED_SPLIT and builtin_dense != TUNED_DENSE
    assert lookup.programs(None, ARCH, KEY) == (builtin_split, builtin_dense, False)
    assert lookup.programs(TUNED_SPLIT, ARCH, KEY) == (TUNED_SPLIT, builtin_dense, False)
    assert lookup.programs(TUNED_DENSE, ARCH, KEY) == (builtin_split, TUNED_DENSE, True)
    paged = TuneKey(128, 4, page_size=16)
    split, dense, dense_only = lookup.programs(TUNED_SPLIT, ARCH, paged)
    assert split == TUNED_SPLIT.replace(page_size=16) and dense == default_spec(ARCH, 128, 4, variant="dense",
                                                                                   page_size=16)
    assert not dense_only


# ---- the runtime uses the table ------------------------------------------------------------------

def _runtime_table(record) -> Path:
    return save_table(record.tables, [entry("b1-l32k", TUNED_SPLIT), entry("b32-l4k", TUNED_DENSE),
                                      entry("b1-l2k", None)])


def _shape(spec):
    return (spec.variant, spec.chunk_size, spec.warps, spec.tile_tokens, spec.stages, spec.kv_copy, spec.mma_m)


def _launched(record, attn, lens) -> KernelSpec:
    """The program the first launch of run() uses after plan(lens); it was loaded, too."""
    attn.plan(lens)
    first = len(record.launches)
    cache = (len(lens), max(lens), attn.num_kv_heads, attn.head_dim)
    bf16 = "<u2"  # bf16 bits, as CuPy carries them
    attn.run(_DeviceArray((len(lens), attn.num_qo_heads, attn.head_dim), bf16), _DeviceArray(cache, bf16),
             _DeviceArray(cache, bf16))
    spec = record.launches[first].spec
    assert spec == attn._launch.spec and any(loaded == spec for loaded, _ in record.loads)
    return spec


def test_runtime_launches_the_tuned_split_program(fake_gpu):
    """A long single sequence runs the table's split program of bucket b1-l32k."""
    path = _runtime_table(fake_gpu)
    attn = splitkv.DecodeAttention(32, 8, 128)
    assert attn.tuned_source is not None and attn.tuned_source.startswith(f"{path} (exact GPU: {GPU})")
    assert attn.tuned_entry is None  # nothing planned yet
    launched = _launched(fake_gpu, attn, [32768])
    assert attn._launch.plan.variant == "split"
    assert attn.tuned_entry.bucket.name == "b1-l32k" and attn.tuned_entry.spec == TUNED_SPLIT
    assert _shape(launched) == _shape(TUNED_SPLIT) and launched.cluster == 1


def test_a_windowed_plan_takes_the_entry_of_the_windows_length(fake_gpu):
    """A window streams its own tokens only: 1 x 32k with a 1k window is looked up as 1 x 1k (the
    b1-l2k entry, the built-in programs), the same sequence without one as 1 x 32k."""
    _runtime_table(fake_gpu)
    attn = splitkv.DecodeAttention(32, 8, 128)
    attn.plan([32768], window_left=1023)
    assert attn.tuned_entry.bucket.name == "b1-l2k" and attn.tuned_entry.spec is None
    attn.plan([32768])
    assert attn.tuned_entry.bucket.name == "b1-l32k" and attn.tuned_entry.spec == TUNED_SPLIT


@pytest.mark.parametrize("planner", tables.PLANNERS)
def test_runtime_plans_a_tuned_program_by_the_rules_it_was_measured_under(fake_gpu, planner):
    """Short rows (3 x 8 rows of 4096 tokens) on the table's split program: an entry measured under
    the wave model alone is planned by it (the shipped entries tuned before the short-row rule
    launch what was measured); one measured with the short-row rule takes its fewest splits."""
    writing.save(tables.table_path(fake_gpu.tables, ARCH, GPU), header(),
                [entry("b4-l8k", TUNED_SPLIT, planner=planner)])
    attn = splitkv.DecodeAttention(32, 8, 128)
    _launched(fake_gpu, attn, [4096] * 3)
    assert attn.tuned_entry.spec == TUNED_SPLIT and attn.tuned_entry.planner == planner
    # The fake GPU's programs take 96 registers; TUNED_SPLIT has no cluster, so no resplit follows.
    common = dict(chunk_size=TUNED_SPLIT.chunk_size, num_sms=132,
                  ctas_per_sm=heuristics.resident_ctas_per_sm(TUNED_SPLIT, 96))
    waves = plan_splits([4096] * 3, 8, **common)
    short = plan_splits([4096] * 3, 8, **common, saturating_ctas=heuristics.saturating_ctas(TUNED_SPLIT),
                        kv_bytes_per_token=TUNED_SPLIT.kv_bytes_per_token)
    assert waves.num_splits != short.num_splits  # the two rules differ here, so the check can fail
    assert attn._launch.plan == (waves if planner == "waves" else short)


def test_runtime_launches_the_tuned_dense_program(fake_gpu):
    """Batches nearest bucket b32-l4k whose rows fill the GPU run the table's dense program, never
    split; nearer batches of fewer rows than SMs are left to the planner, which splits them with
    the built-in split program or runs them dense with the built-in dense program."""
    _runtime_table(fake_gpu)
    attn = splitkv.DecodeAttention(32, 8, 128)
    launched = _launched(fake_gpu, attn, [4096] * 32)
    assert attn._launch.plan.variant == "dense" and attn.tuned_entry.bucket.name == "b32-l4k"
    assert _shape(launched) == _shape(TUNED_DENSE)
    # 17 x 8 rows fill the 132 SMs: the tuned dense program.
    launched = _launched(fake_gpu, attn, [8192] * 17)
    assert attn.tuned_entry.bucket.name == "b32-l4k"
    assert attn._launch.plan.variant == "dense" and _shape(launched) == _shape(TUNED_DENSE)
    # 8 x 16k (64 rows) is nearest that bucket too, but leaves SMs idle unsplit: the planner splits.
    launched = _launched(fake_gpu, attn, [16384] * 8)
    assert attn.tuned_entry.bucket.name == "b32-l4k"
    assert attn._launch.plan.variant == "split" and _shape(launched) == _shape(default_spec(ARCH, 128, 4))
    # 16 x 8 rows, nearest it as well, nearly fill the SMs: the planner runs them dense, one CTA per
    # SM, a regime the tuned program was not measured in: the built-in dense program.
    launched = _launched(fake_gpu, attn, [4096] * 16)
    assert attn.tuned_entry.bucket.name == "b32-l4k" and attn._launch.plan.variant == "dense"
    assert _shape(launched) == _shape(default_spec(ARCH, 128, 4, variant="dense"))
    # A built-in entry (b1-l2k) puts the heuristic's programs back.
    launched = _launched(fake_gpu, attn, [2048])
    assert attn.tuned_entry.spec is None
    assert _shape(launched) == _shape(default_spec(ARCH, 128, 4))


def test_a_tuned_dense_program_leaves_a_long_row_among_short_ones_to_the_units(fake_gpu):
    """The table's dense program serves the bucket's equal rows; a batch nearest it whose one long
    row would end the call alone on a CTA (64k among 32 of 512, 8 K/V heads) is routed to the
    units as the built-in planner routes it."""
    from splitkv.work_units import UnitPlan

    _runtime_table(fake_gpu)
    attn = splitkv.DecodeAttention(32, 8, 128)
    plan = attn.plan([65536] + [512] * 32)
    assert attn.tuned_entry.bucket.name == "b32-l4k" and attn.tuned_entry.spec == TUNED_DENSE
    assert isinstance(plan, UnitPlan) and plan.split and attn._launch.spec.variant == "units", attn.plan_info


def test_the_builtin_choice_and_its_programs_given_launch_alike(fake_gpu):
    """The tuner measures the built-in choice as DecodeAttention(tuned=False) and candidates with
    their programs given: for the built-in programs both launch the same program on the same grid,
    so a gap between their figures is the measurement's, not the launch's."""
    for head_dim, group, lens in ((64, 1, [4096] * 32), (128, 4, [2048]), (128, 4, [32768]), (256, 8, [4096] * 4)):
        split, dense, _ = lookup.programs(None, ARCH, TuneKey(head_dim, group))
        builtin = splitkv.DecodeAttention(8 * group, 8, head_dim, tuned=False)
        given = splitkv.DecodeAttention(8 * group, 8, head_dim, spec=split, dense_spec=dense)
        assert _launched(fake_gpu, builtin, lens) == _launched(fake_gpu, given, lens)
        assert builtin.plan_info == given.plan_info and builtin._launch.grid == given._launch.grid


def test_runtime_takes_rows_as_sequences_times_kv_heads(fake_gpu):
    """Eight sequences of one K/V head are eight rows, the bucket of one sequence of eight heads."""
    _runtime_table(fake_gpu)
    attn = splitkv.DecodeAttention(4, 1, 128)  # group 4: the same key
    launched = _launched(fake_gpu, attn, [32768] * 8)
    assert attn.tuned_entry.bucket.name == "b1-l32k"
    assert _shape(launched) == _shape(TUNED_SPLIT)


def test_what_plans_keep_of_the_split_program_follows_the_tuned_entry(fake_gpu, monkeypatch):
    """plan() keeps what it derives from the split program (the program in clusters of each size,
    and how many such clusters are resident) between plans; when the nearest tuned entry changes
    the split program, all of it follows. Here the table's split program (b1-l32k) takes more
    shared memory than the built-in one (b1-l2k) and none of its clusters fit, so its plans take no
    cluster while the built-in program's take whole-row clusters: plans alternating between the
    two must not take each other's clusters, nor the other program in clusters."""
    from splitkv.codegen import occupancy

    builtin = default_spec(ARCH, 128, 4)
    wide = TUNED_SPLIT.replace(cluster=16)  # clusters allowed, but a deeper ring than the built-in one's
    sizes = range(1, 17)
    fits_below = max(builtin.replace(cluster=c).smem_bytes for c in sizes) + 1
    assert min(wide.replace(cluster=c).smem_bytes for c in sizes) >= fits_below
    monkeypatch.setattr(occupancy, "max_active_clusters",
                        lambda function, cluster, threads, smem: 132 // cluster if smem < fits_below else 0)
    save_table(fake_gpu.tables, [entry("b1-l32k", wide), entry("b1-l2k", None)])
    attn = splitkv.DecodeAttention(32, 8, 128)
    for _ in range(2):
        tuned = _launched(fake_gpu, attn, [32768])
        assert attn.tuned_entry.spec == wide and tuned == wide.replace(cluster=1)
        clustered = _launched(fake_gpu, attn, [2048])
        assert attn.tuned_entry.spec is None and clustered == builtin.replace(cluster=8)


def test_runtime_ignores_the_table_when_told_or_given_programs(fake_gpu):
    """tuned=False, or a spec= given, keeps the table out: no source, the heuristic's or the given shapes."""
    _runtime_table(fake_gpu)
    builtin = splitkv.DecodeAttention(32, 8, 128, tuned=False)
    assert builtin.tuned_source is None
    assert _shape(_launched(fake_gpu, builtin, [32768])) == _shape(default_spec(ARCH, 128, 4))
    assert builtin.tuned_entry is None
    given = default_spec(ARCH, 128, 4).replace(chunk_size=64, tile_tokens=16)
    mine = splitkv.DecodeAttention(32, 8, 128, spec=given)
    assert mine.tuned_source is None
    assert _shape(_launched(fake_gpu, mine, [32768])) == _shape(given)
    assert mine.tuned_entry is None
    with pytest.raises(TypeError, match="tuned"):
        splitkv.DecodeAttention(32, 8, 128, tuned="yes")


# ---- keys of several query tokens ----------------------------------------------------------------

def test_query_token_keys_round_trip_and_name_themselves():
    four = TuneKey(128, 4, query_tokens=4)
    assert four.label == "d128-g4-bf16-bf16-contiguous-t4" and KEY.label == "d128-g4-bf16-bf16-contiguous"
    assert four.to_dict()["query_tokens"] == 4 and "query_tokens" not in KEY.to_dict()
    assert TuneKey.from_dict(four.to_dict()) == four and TuneKey.from_dict(KEY.to_dict()) == KEY
    assert KEY.with_query_tokens(4) == four and four != KEY
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match="query_tokens"):
            TuneKey(128, 4, query_tokens=bad)
    with pytest.raises(ValueError, match="query_tokens"):
        TuneKey.from_dict({**KEY.to_dict(), "query_tokens": "4"})


def test_builtin_programs_of_several_query_tokens():
    """Several tokens: twice the warps on half the tiles; rows past one MMA tile: no clusters; rows
    past 8: the query heads x tokens on the MMA rows. The programs carry the tokens compiled in."""
    plain = default_spec(ARCH, 128, 4)
    two, four, eight = (default_spec(ARCH, 128, 4, query_tokens=t) for t in (2, 4, 8))
    assert (plain.warps, plain.tile_tokens, plain.mma_m, plain.query_tokens) == (4, 32, "tokens", 1)
    assert (two.warps, two.tile_tokens, two.mma_m, two.query_tokens, two.cluster) == (8, 16, "tokens", 2, 16)
    assert (four.warps, four.tile_tokens, four.mma_m, four.cluster, four.row_blocks) == (8, 16, "heads", 16, 1)
    assert (eight.cluster, eight.row_blocks, eight.row_slices, eight.stages) == (1, 1, 2, 4)
    assert eight.ring_bytes == four.ring_bytes  # two slices per ring, each twice as deep
    assert two.smem_bytes <= plain.smem_bytes + 4096  # the ring's bytes the same
    split, dense, _ = lookup.programs(None, ARCH, KEY.with_query_tokens(4))
    assert split == four and dense == default_spec(ARCH, 128, 4, "bf16", "bf16", "dense", query_tokens=4)
    assert lookup.programs(TUNED_SPLIT.with_variant(4), ARCH, KEY.with_query_tokens(4))[0] == TUNED_SPLIT.with_variant(4)


def _launched_tokens(record, attn, lens, tokens) -> KernelSpec:
    attn.plan(lens, query_tokens=tokens)
    first = len(record.launches)
    cache = (len(lens), max(lens), attn.num_kv_heads, attn.head_dim)
    bf16 = "<u2"
    q = (len(lens), tokens, attn.num_qo_heads, attn.head_dim) if tokens > 1 else (len(lens), attn.num_qo_heads,
                                                                                  attn.head_dim)
    attn.run(_DeviceArray(q, bf16), _DeviceArray(cache, bf16), _DeviceArray(cache, bf16))
    return record.launches[first].spec


def test_runtime_takes_the_entry_of_the_plans_query_tokens(fake_gpu):
    """A plan of 4 query tokens runs the table's entry of the 4-token key; of 2 tokens (no entry) the
    built-in 2-token program; of one token the one-token entry, whatever was planned before."""
    four_tokens = TUNED_SPLIT.replace(warps=8, tile_tokens=16, chunk_size=256).with_variant(4)
    save_table(fake_gpu.tables, [entry("b1-l32k", TUNED_SPLIT),
                                 entry("b1-l32k", four_tokens, key=KEY.with_query_tokens(4))])
    attn = splitkv.DecodeAttention(32, 8, 128)
    launched = _launched_tokens(fake_gpu, attn, [32768], 4)
    assert _shape(launched) == _shape(four_tokens) and launched.query_tokens == 4
    assert attn.tuned_entry.key == KEY.with_query_tokens(4)
    launched = _launched_tokens(fake_gpu, attn, [32768], 2)
    builtin_two = default_spec(ARCH, 128, 4, query_tokens=2)
    assert _shape(launched) == _shape(builtin_two) and launched.query_tokens == 2 and attn.tuned_entry is None
    launched = _launched_tokens(fake_gpu, attn, [32768], 1)
    assert _shape(launched) == _shape(TUNED_SPLIT) and launched.query_tokens == 1


def test_without_tables_plans_of_one_token_after_several_run_the_one_token_program(fake_gpu):
    attn = splitkv.DecodeAttention(32, 8, 128, tuned=False)
    assert _launched_tokens(fake_gpu, attn, [4096], 4).query_tokens == 4
    launched = _launched_tokens(fake_gpu, attn, [4096], 1)
    assert launched.query_tokens == 1 and _shape(launched) == _shape(default_spec(ARCH, 128, 4))
    # A program given with a variant compiled in is taken for its CTA shape: plans bring the tokens.
    given = splitkv.DecodeAttention(32, 8, 128, spec=default_spec(ARCH, 128, 4, query_tokens=4))
    assert _launched_tokens(fake_gpu, given, [4096], 1).query_tokens == 1
