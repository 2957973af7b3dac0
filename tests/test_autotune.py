"""The autotuner without a GPU: its keys, search space and tables, which table the runtime looks up
(and that the runtime then launches what the table says), the Optuna search scored by the cost
model (resumed across processes, and after a kill), and `splitkv-gen --tune`."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import pytest
import yaml

import splitkv
from splitkv import cli
from splitkv.autotune import confirm, costmodel, objective, search, space, studies, versions, writing
from splitkv.tuned import keys, lookup, tables
from splitkv.tuned.keys import BUCKETS_BY_NAME, TuneKey
from splitkv import heuristics
from splitkv.heuristics import default_spec
from splitkv.plan import plan_splits
from splitkv.spec import QUANTIZED_KV_DTYPES, KernelSpec, arch_number
from tests.test_runtime_fake_gpu import _DeviceArray, fake_gpu  # noqa: F401 - fake_gpu: a fixture, used by name

REPO = Path(__file__).resolve().parent.parent
GPU = "NVIDIA Fake GPU"
ARCH = "sm_90"
KEY = TuneKey(128, 4)  # bf16 queries and K/V, contiguous caches
OTHER_KEY = TuneKey(64, 8, "fp16", "fp16")
OTHER_SPLIT = default_spec(ARCH, 64, 8, "fp16", "fp16").replace(cluster=8)
#: A split program the heuristic would not choose: longer chunks, a deeper ring, no cluster.
TUNED_SPLIT = default_spec(ARCH, 128, 4).replace(chunk_size=256, stages=3, cluster=1)
#: A dense program the heuristic would not choose: eight warps of 16-token tiles through cp.async.
TUNED_DENSE = default_spec(ARCH, 128, 4, variant="dense").replace(warps=8, tile_tokens=16, chunk_size=128,
                                                                  stages=3, kv_copy="cp_async")


# ---- helpers ------------------------------------------------------------------------------------

def header(gpu: str = GPU, arch: str = ARCH) -> dict:
    return writing.make_header(gpu, arch, 132, "13.0", "13.0", "0.1.0", date="2026-01-02")


def entry(bucket: str, spec: KernelSpec | None = None, key: TuneKey = KEY, tuned_us: float = 10.0,
          default_us: float = 12.5, **extra) -> tables.Entry:
    return tables.Entry(key, keys.parse_bucket(bucket), spec, tuned_us, default_us, date="2026-01-02", **extra)


def sample_entries() -> list:
    """Entries of two keys: tuned split and dense specs, a built-in choice, and every optional field."""
    return [entry("b1-l32k", TUNED_SPLIT, bandwidth_pct=83.1, trials=40),
            entry("b32-l4k", TUNED_DENSE, tuned_us=50.25, default_us=51.0),
            entry("b1-l2k", None, tuned_us=7.5, default_us=7.5),
            entry("b4-l16k", OTHER_SPLIT, key=OTHER_KEY, trials=12,
                  exhaustive={"best_us": 9.875, "points": 252, "trials_to_within_3pct": 17}),
            entry("b1-l2k", None, key=OTHER_KEY)]


def shuffled(items, seed: int) -> list:
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def save_table(folder: Path, entries, gpu: str = GPU, arch: str = ARCH, header_arch: str | None = None) -> Path:
    """``entries`` saved as the table of ``gpu`` under ``folder/<arch>/`` (its header may claim another arch)."""
    path = tables.table_path(folder, arch, gpu)
    writing.save(path, header(gpu, header_arch or arch), entries)
    return path


def temporary_files(folder: Path) -> list:
    """What `writing.save` may leave behind besides tables and its lock files."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith((".yaml", ".lock")))


def replay(params: dict):
    """An ``ask`` that answers from ``params`` (and fails on a question it has no answer to)."""
    return lambda name, values: params[name]


def memory_study(seed: int = 0):
    return studies.open_study("test", None, seed=seed)


def states(study) -> dict:
    """{trial number: (state, params, value)}."""
    return {t.number: (t.state.name, t.params, t.value) for t in study.get_trials(deepcopy=False)}


class Recording(costmodel.CostModelObjective):
    """The cost model, recording what it is asked to compile and measure (a candidate is its own
    one program); candidates that ``fails`` names (a predicate on the spec) raise TrialFailed, those
    ``refuses`` names fail to compile."""

    jobs = 2

    def __init__(self, key=KEY, bucket="b1-l2k", fails=lambda spec: False, refuses=lambda spec: False):
        super().__init__(key, keys.parse_bucket(bucket), ARCH)
        self.fails, self.refuses = fails, refuses
        self.prepared, self.measured = [], []

    def programs(self, spec) -> list:
        return [spec]

    def compile(self, program) -> None:
        self.prepared.append(program)
        if self.refuses(program):
            raise RuntimeError("refused by the test")

    def measure(self, spec, iters=None):
        self.measured.append(spec)
        if spec is not None and self.fails(spec):
            raise objective.TrialFailed(f"mismatch: {spec.name} is wrong on purpose")
        return super().measure(spec, iters)


# ---- keys ---------------------------------------------------------------------------------------

def test_parse_bucket_reads_names_and_refuses_junk():
    """Buckets by built-in name or 'b<batch>-l<len>[k|m]'; anything else is a ValueError."""
    assert keys.parse_bucket("b4-l16k") == keys.Bucket("b4-l16k", 4, 16384)
    assert keys.parse_bucket("b2-l1m").seq_len == 1 << 20 and keys.parse_bucket("b3-l100").seq_len == 100
    for name, bucket in BUCKETS_BY_NAME.items():
        assert keys.parse_bucket(name) is bucket
    for junk in ("", "b4", "l16k", "b4-l16x", "b0-l16k", "b4-l0", "4-16k", "b4-l16k-x", "B4_L16K"):
        with pytest.raises(ValueError, match="bucket"):
            keys.parse_bucket(junk)


def test_gpu_file_stem_makes_a_file_name():
    """A driver's device name becomes a file name; one with nothing left is refused."""
    assert keys.gpu_file_stem("NVIDIA H200") == "NVIDIA_H200"
    assert keys.gpu_file_stem(" NVIDIA H100 80GB HBM3 ") == "NVIDIA_H100_80GB_HBM3"
    assert keys.gpu_file_stem("NVIDIA A100-SXM4-40GB") == "NVIDIA_A100-SXM4-40GB"
    with pytest.raises(ValueError):
        keys.gpu_file_stem(" / ")


@pytest.mark.parametrize("key", [KEY, TuneKey(256, 16, "bf16", "fp8_e4m3"), TuneKey(64, 1, "fp16", "fp16", 16),
                                 TuneKey(128, 8, "bf16", "nvfp4", 16, "HND")], ids=lambda k: k.label)
def test_tune_key_round_trips_through_its_dict(key):
    """A key written to a table reads back equal, contiguous or paged (layout 'p16' / 'p16-HND')."""
    data = key.to_dict()
    assert TuneKey.from_dict(data) == key
    assert TuneKey.from_dict(yaml.safe_load(yaml.safe_dump(data))) == key
    if key.page_size:
        assert data["layout"] == f"p16{'-HND' if key.kv_layout == 'HND' else ''}"


def test_tune_key_refuses_what_no_spec_can_be():
    """Unknown fields, layouts and values are refused when a key is read or built."""
    with pytest.raises(ValueError, match="unknown"):
        TuneKey.from_dict({**KEY.to_dict(), "warps": 4})
    with pytest.raises(ValueError, match="layout"):
        TuneKey.from_dict({**KEY.to_dict(), "layout": "paged"})
    with pytest.raises(ValueError, match="group_size"):
        TuneKey(128, 17)
    with pytest.raises(ValueError, match="kv_layout"):
        TuneKey(128, 4, kv_layout="HND")  # contiguous caches are NHD


# ---- tables: YAML round trip --------------------------------------------------------------------

def test_table_round_trips_its_entries(tmp_path):
    """Saved entries (tuned specs and spec=None) load back equal, sorted, under the same header."""
    entries = sample_entries()
    path = save_table(tmp_path, shuffled(entries, 1))
    assert path == tmp_path / "sm_90" / "NVIDIA_Fake_GPU.yaml"
    table = tables.load(path)
    assert table.header == header()
    assert table.entries == tuple(sorted(entries, key=tables.Entry.sort_key))
    assert [e.spec for e in table.for_key(KEY)] == [None, TUNED_SPLIT, TUNED_DENSE]  # b1-l2k, b1-l32k, b32-l4k
    # An entry's spec leaves out what the table's arch and the entry's key already say.
    raw = yaml.safe_load(path.read_text())
    assert all(not {"arch", "head_dim", "group_size", "kv_dtype"} & set(e["spec"] or {}) for e in raw["entries"])


def test_saving_the_same_entries_gives_the_same_bytes(tmp_path):
    """The file depends on the entries, not on the order they were given in, nor on a second save."""
    first = save_table(tmp_path / "a", shuffled(sample_entries(), 1))
    second = save_table(tmp_path / "b", shuffled(sample_entries(), 2))
    text = first.read_bytes()
    assert second.read_bytes() == text
    save_table(tmp_path / "a", shuffled(sample_entries(), 3))
    assert first.read_bytes() == text


def test_save_merges_into_the_table_there(tmp_path):
    """A second save adds its new entries, replaces those of the same (key, bucket), keeps the rest."""
    old = sample_entries()
    path = save_table(tmp_path, old)
    new = entry("b8-l8k", TUNED_SPLIT, tuned_us=3.25)
    replacing = entry("b1-l32k", None, tuned_us=20.0, default_us=20.0)  # replaces old[0]
    written = writing.save(path, header(), [new, replacing])
    expected = sorted([new, replacing, *old[1:]], key=tables.Entry.sort_key)
    assert list(written.entries) == expected
    assert list(tables.load(path).entries) == expected


def test_save_replaces_the_file_atomically(tmp_path, monkeypatch):
    """No temporary file is left behind, and a save that fails at the rename leaves the old file whole."""
    path = save_table(tmp_path, sample_entries()[:2])
    save_table(tmp_path, sample_entries())
    assert temporary_files(path.parent) == []
    before = path.read_bytes()

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)  # the one os.replace every atomic write goes through
    with pytest.raises(OSError, match="No space"):
        writing.save(path, header(), [entry("b8-l8k", TUNED_SPLIT)])
    assert path.read_bytes() == before
    assert temporary_files(path.parent) == []


def test_save_refuses_to_overwrite_another_gpus_table_or_a_broken_one(tmp_path):
    """save raises TableError, and leaves the file as it was, for another GPU's table or an unreadable one."""
    path = save_table(tmp_path, sample_entries(), gpu="NVIDIA H200")
    before = path.read_bytes()
    with pytest.raises(tables.TableError, match="NVIDIA H200.*NVIDIA H100"):
        writing.save(path, header("NVIDIA H100"), [entry("b8-l8k", TUNED_SPLIT)])
    assert path.read_bytes() == before
    path.write_text("schema: [1\n")
    with pytest.raises(tables.TableError, match=re.escape(str(path))):
        writing.save(path, header("NVIDIA H200"), [entry("b8-l8k", TUNED_SPLIT)])
    assert path.read_text() == "schema: [1\n"


# ---- tables: schema errors ----------------------------------------------------------------------

def _valid_table_data() -> dict:
    return yaml.safe_load(writing.dump(tables.Table(header(), tuple(sample_entries()[:2]))))


def _overflowing_spec(data):
    data["entries"][0]["spec"].update(warps=8, tile_tokens=64, chunk_size=512, stages=4)


def _duplicate_entry(data):
    data["entries"].append(dict(data["entries"][0], tuned_us=1.0))


SCHEMA_ERRORS = {
    "invalid YAML": (None, "not valid YAML"),
    "schema number": (lambda d: d.update(schema=2), "schema 2"),
    "missing header field": (lambda d: d.pop("sm_count"), "header lacks.*sm_count"),
    "unknown entry field": (lambda d: d["entries"][0].update(speed=1.0), "entry 0: unknown entry fields.*speed"),
    "unknown spec field": (lambda d: d["entries"][0]["spec"].update(warpz=4), "entry 0: KernelSpec: unknown.*warpz"),
    "spec refused": (_overflowing_spec, "entry 0: CTA shape needs .* shared memory"),
    # Fields of removed programs load only switched off (see the test below); a removed copy path is refused.
    "retired field on": (lambda d: d["entries"][0]["spec"].update(steal_tiles=2), "entry 0: spec: steal_tiles=2"),
    "retired switch on": (lambda d: d["entries"][0]["spec"].update(span_rows=True), "entry 0: spec: span_rows=True"),
    "retired copy path": (lambda d: d["entries"][0]["spec"].update(kv_copy="bulk"), "entry 0: kv_copy: .*'bulk'"),
    "duplicate entries": (_duplicate_entry, "two entries for d128-g4-bf16-bf16-contiguous"),
}


@pytest.mark.parametrize("case", SCHEMA_ERRORS)
def test_load_names_the_file_and_what_is_wrong(tmp_path, case):
    """Every way a table can be wrong is a TableError naming the file and the fault."""
    change, reason = SCHEMA_ERRORS[case]
    path = tmp_path / "sm_90" / "NVIDIA_Fake_GPU.yaml"
    path.parent.mkdir()
    if change is None:
        path.write_text("schema: 1\nentries: [{key: \n")
    else:
        data = _valid_table_data()
        assert tables.parse(data).entries  # the unchanged data is a table
        change(data)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(tables.TableError) as raised:
        tables.load(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: ")
    assert re.search(reason, message), message


def test_a_table_written_before_the_retired_fields_went_still_loads():
    """Older tables hold steal_tiles: 0 and span_rows: false in every spec (fields of programs since
    removed, off): they load as the same programs, and are not written back."""
    data = _valid_table_data()
    specs = [item["spec"] for item in data["entries"] if item["spec"] is not None]
    assert specs
    for spec in specs:
        spec.update(steal_tiles=0, span_rows=False)
    table = tables.parse(data)
    assert table.entries == tables.parse(_valid_table_data()).entries
    assert "steal_tiles" not in writing.dump(table) and "span_rows" not in writing.dump(table)


# ---- lookup -------------------------------------------------------------------------------------

@pytest.fixture
def folders(monkeypatch, tmp_path):
    """(user folder, shipped folder), both empty, and nothing remembered from earlier lookups."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    monkeypatch.setattr(lookup, "shipped_dir", lambda: shipped)
    monkeypatch.setenv(lookup.ENV_DIR, str(user))
    lookup.forget()
    yield user, shipped
    lookup.forget()


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


def test_entry_for_takes_the_nearest_bucket():
    """Rows (sequences x K/V heads) and the longest length pick the nearest bucket, in octaves (rows
    made of sequences or of heads alike: see test_runtime_takes_rows_as_sequences_times_kv_heads)."""
    choices = lookup.TunedChoices(KEY, tuple(entry(b) for b in ("b1-l2k", "b1-l32k", "b32-l4k")), "test")
    assert choices.entry_for(8, 30000).bucket.name == "b1-l32k"
    assert choices.entry_for(256, 4096).bucket.name == "b32-l4k"
    assert choices.entry_for(8, 1500).bucket.name == "b1-l2k"
    assert choices.entry_for(512, 8192).bucket.name == "b32-l4k"
    assert lookup.TunedChoices(KEY, (), "empty").entry_for(8, 1024) is None


# ---- lookup.programs ----------------------------------------------------------------------------

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


# ---- the runtime uses the table -----------------------------------------------------------------

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


def test_an_entry_names_the_planner_it_was_measured_under(tmp_path):
    """Absent means the wave model (tables written before the short-row rule); the tuner's entries
    say 'short-rows'; an unknown name is refused when the table is read."""
    path = tables.table_path(tmp_path, ARCH, GPU)
    writing.save(path, header(), [entry("b1-l2k", TUNED_SPLIT), entry("b4-l8k", TUNED_SPLIT, planner="short-rows")])
    loaded = {e.bucket.name: e for e in tables.load(path).entries}
    assert (loaded["b1-l2k"].planner, loaded["b4-l8k"].planner) == ("waves", "short-rows")
    assert path.read_text().count("planner:") == 1  # the default stays absent
    assert tables.CURRENT_PLANNER in tables.PLANNERS
    with pytest.raises(ValueError, match="planner"):
        entry("b1-l2k", TUNED_SPLIT, planner="greedy")
    path.write_text(path.read_text().replace("planner: short-rows", "planner: greedy"))
    with pytest.raises(tables.TableError, match="planner"):
        tables.load(path)


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


# ---- the search space ---------------------------------------------------------------------------

SPACE_KEYS = [(KEY, "sm_90"), (KEY, "sm_80"), (TuneKey(256, 16, "bf16", "fp8_e4m3"), "sm_90"),
              (TuneKey(64, 1, "bf16", "nvfp4"), "sm_90"), (TuneKey(128, 8, "fp16", "fp16", 16, "HND"), "sm_90")]


@pytest.mark.parametrize("key, arch", SPACE_KEYS, ids=lambda x: getattr(x, "label", x))
def test_enumerated_candidates_are_valid_distinct_and_keep_the_key(key, arch):
    """Every enumerated candidate is a distinct spec KernelSpec accepts, with the key's fixed fields."""
    specs, refused = space.enumerate_specs(key, arch)
    assert specs and refused >= 0
    assert len({s.name for s in specs}) == len(specs) == len(set(specs))
    for s in specs:
        assert isinstance(s, KernelSpec) and KernelSpec.from_dict(s.to_dict()) == s
        assert {f: getattr(s, f) for f in key.spec_fields()} == key.spec_fields() and s.arch == arch
        assert s.chunk_size % (s.warps * s.tile_tokens) == 0
        assert not s.warp_heads
        if arch_number(arch) < 90:
            assert s.cluster == 1 and s.kv_copy == "cp_async"


def _heuristic_keys():
    for arch in ("sm_90", "sm_80", "sm_89", "sm_120"):
        for kv_dtype in ("bf16", "fp16", "fp8_e4m3", "nvfp4"):
            if kv_dtype in QUANTIZED_KV_DTYPES and arch_number(arch) < 89:
                continue  # no such program on sm_80
            for head_dim in (64, 128, 256):
                if kv_dtype == "nvfp4" and head_dim % 64:
                    continue
                for group in (1, 4, 8, 16):
                    yield TuneKey(head_dim, group, kv_dtype if kv_dtype in ("bf16", "fp16") else "bf16", kv_dtype), arch


def test_a_kernelspec_field_joins_the_space_by_one_line(monkeypatch):
    """A KernelSpec field named in FIELD_CHOICES is asked for, enumerated and enqueued with no other
    code: here warp_heads, which the shipped space leaves out (the planner takes it per plan)."""
    key = TuneKey(128, 4)
    before, _ = space.enumerate_specs(key, ARCH)
    monkeypatch.setitem(space.FIELD_CHOICES, "warp_heads", (False, True))
    after, _ = space.enumerate_specs(key, ARCH)
    assert {s.warp_heads for s in after} == {False, True} and len(after) > len(before)
    assert {s.name for s in after if not s.warp_heads} == {s.name for s in before}
    packed = next(s for s in after if s.warp_heads)
    params = space.params_of(packed, key, ARCH)
    assert params["warp_heads"] is True and space.build_spec(replay(params), key, ARCH) == packed


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_89", "sm_120"])
def test_the_heuristics_programs_are_points_of_the_space(arch):
    """params_of(default_spec) rebuilds the heuristic's split and dense programs of every key, also
    where shared memory is small and the heuristic takes fewer warps (sm_89, sm_120)."""
    checked = 0
    for key, key_arch in _heuristic_keys():
        if key_arch != arch:
            continue
        for variant in ("split", "dense"):
            spec = default_spec(arch, key.head_dim, key.group_size, key.q_dtype, key.kv_dtype, variant)
            params = space.params_of(spec, key, arch)
            assert space.build_spec(replay(params), key, arch) == spec, (key.label, variant, params)
            checked += 1
    assert checked == 2 * 12 * (2 if arch == "sm_80" else 4)


def test_build_spec_refuses_an_overflowing_choice():
    """A choice KernelSpec refuses is space.Invalid with KernelSpec's reason; a spec outside the
    space is a ValueError of params_of."""
    answers = dict(variant="dense", warps=8, tile_tokens=64, stages=4, kv_copy="cp_async", mma_m="tokens")
    with pytest.raises(space.Invalid, match="shared memory"):
        space.build_spec(replay(answers), KEY, ARCH)
    with pytest.raises(ValueError, match="warps"):
        space.params_of(default_spec(ARCH, 128, 4).replace(warps=2, chunk_size=64), KEY, ARCH)
    with pytest.raises(ValueError, match="express"):
        space.params_of(default_spec(ARCH, 128, 4, variant="dense").replace(warp_heads=True), KEY, ARCH)


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


# ---- the search, scored by the cost model --------------------------------------------------------

def test_the_cost_model_says_it_is_one():
    """The cost model's figures are named as predictions wherever they appear."""
    name = costmodel.CostModelObjective.name
    assert "cost model" in name and "not measured" in name


def _searched(trials: int, bucket: str = "b1-l2k", **recording):
    study, obj = memory_study(), Recording(bucket=bucket, **recording)
    search.enqueue_defaults(study, KEY, keys.parse_bucket(bucket), ARCH)
    done = search.run_trials(study, KEY, ARCH, obj, trials=trials)
    return study, obj, done


def test_run_trials_stops_at_the_asked_count():
    """run_trials measures exactly the asked number of candidates, counting earlier ones; pruned
    and repeated candidates cost no measurement and are not counted."""
    pytest.importorskip("optuna")
    study, obj, done = _searched(13)
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
    study, _, _ = _searched(10)
    first, second = study.trials[:2]
    assert first.user_attrs["builtin"] == "split" and second.user_attrs["builtin"] == "dense"
    assert first.user_attrs["spec"] == default_spec(ARCH, 128, 4).name
    assert second.user_attrs["spec"] == default_spec(ARCH, 128, 4, variant="dense").name
    assert all("builtin" not in t.user_attrs for t in study.trials[2:])


@pytest.mark.parametrize("bucket", ["b1-l2k", "b1-l32k", "b32-l4k"])
def test_finish_is_never_slower_than_the_default(bucket):
    """The entry finish() writes is at least as fast as the built-in choice on its own figures."""
    pytest.importorskip("optuna")
    study, obj, _ = _searched(24, bucket)
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


def test_a_failing_candidate_is_a_failed_trial_and_never_wins():
    """Candidates whose measurement or compilation fails become FAIL trials with the reason, and
    are never the winner, even where the cost model would rank them first."""
    optuna = pytest.importorskip("optuna")
    fast = _searched(24)
    best = confirm.finish(fast[0], KEY, keys.parse_bucket("b1-l2k"), ARCH, fast[1]).entry.spec
    assert best is not None and best.stages == 3  # what the failures below take away

    study, obj, done = _searched(24, fails=lambda s: s.stages == 3, refuses=lambda s: s.warps == 8)
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


# ---- resuming across processes ------------------------------------------------------------------

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


# ---- splitkv-gen --tune -------------------------------------------------------------------------

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


def test_cli_tune_without_a_gpu_says_so(tmp_path, capsys, monkeypatch):
    """Without --cost-model and no usable GPU: status 2, a message naming the arch, nothing written."""
    pytest.importorskip("optuna")
    import splitkv.timing

    def no_gpu():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    monkeypatch.setattr(splitkv.timing, "gpu_info", no_gpu)
    assert cli.main(_tune_argv(tmp_path, "--out", str(tmp_path / "tables"))) == 2
    err = capsys.readouterr().err
    assert "sm_90" in err and "none is usable" in err and "no CUDA-capable device" in err
    assert not (tmp_path / "tables").exists()


def test_cli_tune_refuses_a_gpu_of_another_arch(tmp_path, capsys, monkeypatch):
    """Tuning sm_90 on an sm_80 GPU is refused (status 2), the message naming both archs."""
    pytest.importorskip("optuna")
    import splitkv.timing

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
])
def test_cli_tune_usage_errors(capsys, argv, message):
    """Workers without shared storage (one worker on another GPU too), no trials, a bad bucket, a
    bad device list, or the compile-only --emit and --list are usage errors (status 2)."""
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


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


def test_the_report_plots_a_bandwidth_sweep(tmp_path):
    """Given a sweep, the report draws % bandwidth against context length and links the plot."""
    pytest.importorskip("optuna")
    pytest.importorskip("matplotlib")
    from splitkv.autotune import report

    outcome = confirm.finish(*_searched(12)[:1], KEY, BUCKETS_BY_NAME["b1-l2k"], ARCH,
                            costmodel.CostModelObjective(KEY, BUCKETS_BY_NAME["b1-l2k"]))
    sweeps = {KEY.label: {"lengths": [1024, 4096], "tuned": [40.0, 70.0], "built-in": [38.0, None],
                          "FlashInfer": [30.0, 55.0]}}
    report.write(tmp_path, [outcome], header("cost model"), sweeps)
    png = tmp_path / f"bandwidth-{KEY.label}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"({png.name})" in (tmp_path / "summary.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["sweeps"] == sweeps


def test_a_cost_model_table_never_serves_another_gpu(folders):
    """Predictions are not measurements: a cost-model table of the arch is not a fallback."""
    _, shipped = folders
    save_table(shipped, [entry("b1-l32k", TUNED_SPLIT)], gpu=lookup.COST_MODEL_GPU)
    assert _found() is None


def test_save_refuses_a_spec_of_another_key_or_arch(tmp_path):
    """An entry whose program is not one of its key on the table's arch never reaches the file."""
    path = tables.table_path(tmp_path, ARCH, GPU)
    with pytest.raises(tables.TableError, match="not a program of that key"):
        writing.save(path, header(), [entry("b1-l32k", OTHER_SPLIT)])
    with pytest.raises(tables.TableError, match="not a program of that key"):
        writing.save(tables.table_path(tmp_path, "sm_80", GPU), header(arch="sm_80"), [entry("b1-l32k", TUNED_SPLIT)])
    assert not path.exists()


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


def test_candidates_compile_with_what_their_plans_load(monkeypatch):
    """A candidate is compiled with the cluster sizes the planner may fit, the built-in program of
    the other variant and the merge; a companion that fails to compile fails the candidate, with
    the companion named."""
    from splitkv import codegen
    from splitkv.autotune import measure

    split, dense, _ = lookup.programs(None, ARCH, KEY)
    candidate = TUNED_SPLIT.replace(cluster=16)
    names = {s.name for s in measure._companions(candidate, split, dense)}
    assert {candidate.replace(cluster=c).name for c in (1, 2, 4, 8, 16)} <= names and dense.name in names
    assert split.name in {s.name for s in measure._companions(TUNED_DENSE, split, dense)}

    compiled = []
    broken = candidate.replace(cluster=4).name

    def fake_compile(spec):
        compiled.append(spec.name)
        if spec.name == broken:
            raise codegen.CompileError("NVRTC failed", "ptxas error: too many resources", None)
    monkeypatch.setattr(codegen, "compile_cubin", fake_compile)
    objective = object.__new__(measure.GpuObjective)  # no GPU: only what prepare() reads
    objective.jobs, objective.builtin_split, objective.builtin_dense = 2, split, dense
    failures = objective.prepare([candidate, TUNED_DENSE])
    assert list(failures) == [candidate.name]
    assert broken in failures[candidate.name] and "CompileError" in failures[candidate.name]
    assert len(compiled) == len(set(compiled))  # each program once


def test_an_entry_keeps_the_plan_its_program_ran(tmp_path):
    """The optional plans (what the winner and the built-in choice ran on the bucket's shape) survive
    a save and a load."""
    path = tables.table_path(tmp_path, ARCH, GPU)
    ran = "dense: 1 split(s) of 4096 tokens, 256 CTAs on 132 SMs; " + TUNED_DENSE.name
    builtin = "split: 3 split(s) of 1408 tokens, 768 CTAs on 132 SMs; " + default_spec(ARCH, 128, 4).name
    writing.save(path, header(), [entry("b32-l4k", TUNED_DENSE, plan=ran, default_plan=builtin), entry("b1-l2k")])
    loaded = {e.bucket.name: e for e in tables.load(path).entries}
    assert (loaded["b32-l4k"].plan, loaded["b32-l4k"].default_plan) == (ran, builtin)
    assert loaded["b1-l2k"].plan is None and loaded["b1-l2k"].default_plan is None
    assert "plan:" not in path.read_text().split("b1-l2k")[1].split("- key")[0]  # absent stays absent


def test_cli_says_so_when_the_table_cannot_be_written(tmp_path, capsys):
    """A table folder that cannot be written ends the run with status 2 and a message naming it."""
    pytest.importorskip("optuna")
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert cli.main(_tune_argv(tmp_path, "--cost-model", "--out", str(blocked))) == 2
    assert "cannot write the table" in capsys.readouterr().err


def _numpy_as_cupy(monkeypatch):
    """NumPy in CuPy's place, for the parts of the GPU objective that are array arithmetic."""
    import types

    import numpy as np

    shim = types.SimpleNamespace(**{name: getattr(np, name) for name in (
        "float16", "float32", "float64", "uint16", "uint32", "nan", "einsum", "exp", "stack", "asarray", "isfinite",
        "abs", "empty_like", "random")}, asnumpy=np.asarray)
    monkeypatch.setitem(sys.modules, "cupy", shim)
    return np


@pytest.mark.parametrize("key", [TuneKey(64, 4), TuneKey(128, 8, "fp16", "fp16"), TuneKey(64, 2, page_size=16),
                                 TuneKey(64, 2, page_size=8, kv_layout="HND")], ids=lambda k: k.label)
def test_the_objectives_inputs_and_reference(monkeypatch, key):
    """The GPU objective's inputs are random values of the key's type (never zeros), its reference
    is float64 attention over each sequence's own tokens (ragged lengths), a paged cache holds the
    same rows behind its block table, and the check passes the reference rounded to the output
    type and fails a poisoned output."""
    np = _numpy_as_cupy(monkeypatch)
    from splitkv.autotune import measure
    from splitkv.paged import gather_pages
    from splitkv.reference import attention_reference

    lens = [37, 100, 64]
    inputs = measure.BucketInputs(key, lens, seed=5)
    q64 = measure._as_f64(inputs.q, key.q_dtype)
    assert q64.shape == (3, 8 * key.group_size, key.head_dim) and np.count_nonzero(q64) == q64.size
    k, v = inputs.k, inputs.v
    if key.page_size:
        k = gather_pages(k, inputs.block_table, lens, key.kv_layout, max(lens))
        v = gather_pages(v, inputs.block_table, lens, key.kv_layout, max(lens))
    k64, v64 = measure._as_f64(np.asarray(k), key.kv_dtype), measure._as_f64(np.asarray(v), key.kv_dtype)
    want, _ = attention_reference(q64, k64, v64, lens)
    np.testing.assert_allclose(inputs.ref, want, rtol=1e-12, atol=1e-12)
    assert inputs.bytes_moved == 2 * sum(lens) * 8 * key.head_dim * 2 + 2 * q64.size * 2

    rounded = inputs.ref.astype(np.float32)
    inputs.out = (rounded.astype(np.float16) if key.q_dtype == "fp16" else
                  ((rounded.view(np.uint32) + 0x7FFF + ((rounded.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16))
    assert inputs.error() < 1e-2
    inputs.poison_output()
    assert inputs.error() == float("inf")


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


def test_a_candidate_that_launches_what_another_did_is_not_measured_again():
    """Where the planner splits (1 x 2k), a tuned dense program runs the built-in split program: such
    candidates take the built-in's figure as repeats, uncounted and unmeasured, and each trial
    records what it launched."""
    pytest.importorskip("optuna")
    study, obj, _ = _searched(16)
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


def test_the_shipped_h200_table():
    """The table that ships for the H200 loads, covers head_dim 64/128/256 x group 1/4/8 x every K/V
    dtype in the default buckets, and holds only programs the rules let in: valid specs of their key,
    each at least the margin faster than the built-in choice on its own figures. Where the exhaustive
    search was run, the entry's program is within 3% of the space's best."""
    path = lookup.shipped_dir() / "sm_90" / "NVIDIA_H200.yaml"
    table = tables.load(path)
    assert (table.gpu, table.arch, table.header["sm_count"]) == ("NVIDIA H200", "sm_90", 132)
    want = {(TuneKey(d, g, q, kv), b) for d in (64, 128, 256) for g in (1, 4, 8)
            for kv, q in (("bf16", "bf16"), ("fp16", "fp16"), ("fp8_e4m3", "bf16"), ("nvfp4", "bf16"))
            for b in BUCKETS_BY_NAME}
    assert {(e.key, e.bucket.name) for e in table.entries} == want
    for e in table.entries:
        assert e.bucket == BUCKETS_BY_NAME[e.bucket.name] and e.trials > 0 and 0 < e.bandwidth_pct < 120
        if e.spec is None:
            assert e.tuned_us == e.default_us
        else:
            assert lookup.programs(e.spec, "sm_90", e.key) != lookup.programs(None, "sm_90", e.key)
            assert e.tuned_us <= e.default_us * (1 - confirm.MARGIN), (e.key.label, e.bucket.name)
            # What it launched (the plan it records) is not what the built-in choice launched. An
            # entry that does not record the latter launches none of the built-in programs.
            assert e.plan, (e.key.label, e.bucket.name)
            if e.default_plan:
                assert e.plan != e.default_plan, (e.key.label, e.bucket.name, e.plan)
            else:
                split, dense, _ = lookup.programs(None, "sm_90", e.key)
                builtin = {dense.name} | {split.replace(cluster=c).name for c in (1, 2, 4, 8, 16)}
                assert e.plan.rsplit("; ", 1)[-1] not in builtin, (e.key.label, e.bucket.name, e.plan)
        if e.exhaustive:
            chosen = e.exhaustive["tuned_spec_us" if e.spec else "builtin_spec_us"]
            assert chosen <= e.exhaustive["best_us"] * 1.03 and e.exhaustive["trials_to_within_3pct"] <= e.trials
    assert sum(bool(e.exhaustive) for e in table.entries) >= 4
    assert writing.dump(table) == path.read_text()  # written by writing.save: sorted, nothing hand-edited


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


def test_a_winners_last_check_runs_the_program_it_would_write(monkeypatch):
    """verify() forces a dense winner dense (two ragged sequences alone would be split with the
    built-in program) and runs a split winner planned as usual and as its units program; a
    failure names the lengths and the program."""
    import contextlib

    from splitkv.autotune import measure

    ran = []
    gpu_objective = object.__new__(measure.GpuObjective)  # no GPU: only what verify() reads
    gpu_objective.key, gpu_objective.bucket, gpu_objective.seed = KEY, BUCKETS_BY_NAME["b32-l4k"], 0
    gpu_objective.harness = type("Harness", (), {"active": staticmethod(contextlib.nullcontext)})()
    monkeypatch.setattr(measure, "BucketInputs", lambda key, lens, seed: lens)

    def checked(spec, inputs, variant):
        ran.append((spec.variant, variant, tuple(inputs)))
        if variant == "units" and spec.stages == 3:
            raise objective.TrialFailed("wrong result: max error 0.5")
    gpu_objective._checked = checked
    assert gpu_objective.verify(TUNED_DENSE) is None and ran == [("dense", "dense", (4059, 1370))]
    ran.clear()
    assert gpu_objective.verify(TUNED_SPLIT.replace(stages=2)) is None
    assert [v for _, v, _ in ran] == [None, "units"]
    problem = gpu_objective.verify(TUNED_SPLIT)
    assert "units program" in problem and "4059" in problem and "max error 0.5" in problem


def test_tune_on_devices_that_are_not_usable_says_so(monkeypatch, tmp_path, capsys):
    import cupy

    def no_device(ordinal=None):
        raise cupy.cuda.runtime.CUDARuntimeError(100)  # cudaErrorNoDevice
    monkeypatch.setattr(cupy.cuda, "Device", no_device)
    rc = cli.main(["--arch", "sm90", "--tune", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
                   "--storage", str(tmp_path / "j.log"), "--devices", "0,1"])
    assert rc == 2 and "GPU 0 is not usable here" in capsys.readouterr().err


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
