"""What a tuned table must be for the runtime to use it, without a GPU: every field of the right
type and range (else one warning and the next table), a file cut at any line refused by the count
and digest of its entries, a file over the size bound refused before it is parsed, older tables
read with one warning and written anew by `writing.rewrite`, and the writer writing nothing the
reader refuses."""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import yaml

from splitkv.autotune import writing
from splitkv.tuned import lookup, tables
from splitkv.work_units import CostModel

from autotune_helpers import ARCH, GPU, KEY, TUNED_DENSE, TUNED_SPLIT, entry, folders, header, save_table  # noqa: F401 - folders: a fixture

SHIPPED = lookup.shipped_dir() / "sm_90" / "NVIDIA_H200.yaml"


def valid_table_data() -> dict:
    """A table as YAML reads it, with every optional field somewhere: unit costs, an exhaustive
    record, plans, a planner, a built-in entry."""
    costs = tables.UnitCosts(CostModel(), 30.0, 31.0, 12, "2026-01-02", ("1 x 6096", "3 x 4096"))
    record = dict(points=252, failed=0, best_us=9.875, trials_to_within_3pct=17, tuned_spec_us=10.0,
                  builtin_spec_us=None)
    entries = (entry("b1-l32k", TUNED_SPLIT, bandwidth_pct=83.1, plan="split: 16 splits", default_plan="split: 8",
                     planner="short-rows", exhaustive=record),
               entry("b32-l4k", TUNED_DENSE), entry("b1-l2k", None, tuned_us=7.5, default_us=7.5))
    return yaml.safe_load(writing.dump(tables.Table(header(), entries, costs)))


def sealed(data: dict) -> dict:
    """``data`` with the count and digest of its entries as they now are, as the writer puts them."""
    entries = data.get("entries", [])
    data.update(entries_count=len(entries), entries_sha256=tables.entries_digest(entries))
    return data


def tuned(data: dict) -> dict:
    """The entry with every optional field (b1-l32k: entry 1, after b1-l2k)."""
    assert data["entries"][1]["bucket"]["name"] == "b1-l32k"
    return data["entries"][1]


def setter(where, **fields):
    """A change of ``data``: ``fields`` set in ``where(data)``."""
    return lambda data: where(data).update(fields)


def remover(where, name):
    return lambda data: where(data).pop(name)


def top(data):
    return data


def key(data):
    return tuned(data)["key"]


def bucket(data):
    return tuned(data)["bucket"]


def spec(data):
    return tuned(data)["spec"]


def exhaustive(data):
    return tuned(data)["exhaustive"]


def unit_costs(data):
    return data["unit_costs"]


def costs(data):
    return data["unit_costs"]["costs"]


#: Each kind of bad field: (the change, a regex the refusal must hold). The table is sealed after
#: the change (count and digest as the entries now are), so only the field itself is wrong.
BAD_FIELDS = {
    "schema a bool": (setter(top, schema=True), "schema True"),
    "schema a float": (setter(top, schema=2.0), "schema 2.0"),
    "gpu a number": (setter(top, gpu=200), "gpu: expected a non-empty string"),
    "gpu empty": (setter(top, gpu=" "), "gpu: expected a non-empty string"),
    "arch a number": (setter(top, arch=90), "arch: expected a non-empty string"),
    "arch unknown": (setter(top, arch="sm_91"), "arch: 'sm_91'"),
    "sm_count a string": (setter(top, sm_count="132"), "sm_count: expected an int >= 1"),
    "sm_count a bool": (setter(top, sm_count=True), "sm_count: expected an int >= 1"),
    "sm_count zero": (setter(top, sm_count=0), "sm_count: expected an int >= 1"),
    "cuda_runtime a float": (setter(top, cuda_runtime=13.0), "cuda_runtime: expected a non-empty string"),
    "nvrtc null": (setter(top, nvrtc=None), "nvrtc: expected a non-empty string"),
    "splitkv a list": (setter(top, splitkv=[0, 1]), "splitkv: expected a non-empty string"),
    "date not a date": (setter(top, date="yesterday"), "date: expected a date 'YYYY-MM-DD'"),
    "date no such day": (setter(top, date="2026-02-30"), "date: expected a date"),
    "date a number": (setter(top, date=20260102), "date: expected a date"),
    "unknown header field": (setter(top, owner="me"), "unknown header fields \\['owner'\\]"),
    "entries absent": (remover(top, "entries"), "no 'entries'"),
    "entries a mapping": (setter(top, entries={}), "'entries' must be a list"),
    "key head_dim a string": (setter(key, head_dim="128"), "entry 1: key: head_dim: expected an int"),
    "key head_dim a float": (setter(key, head_dim=128.0), "entry 1: key: head_dim: expected an int"),
    "key group_size a bool": (setter(key, group_size=True), "entry 1: key: group_size: expected an int"),
    "key head_dim unknown": (setter(key, head_dim=100), "entry 1: head_dim: expected one of"),
    "key without head_dim": (remover(key, "head_dim"), "entry 1: key: lacks \\['head_dim'\\]"),
    "key dtype a number": (setter(key, kv_dtype=16), "entry 1: key: kv_dtype: expected a name"),
    "bucket name against its length": (setter(bucket, name="b1-l16k"), (
        "entry 1: bucket 'b1-l16k': the name says batch 1, seq_len 16384; the fields say batch 1, seq_len 32768")),
    "bucket name against its batch": (setter(bucket, batch=2), "the name says batch 1, seq_len 32768"),
    "bucket name junk": (setter(bucket, name="long"), "entry 1: bucket: expected a name like"),
    "bucket name a number": (setter(bucket, name=7), "entry 1: bucket: name: expected a name"),
    "bucket batch a string": (setter(bucket, batch="1"), "entry 1: bucket 'b1-l32k': batch must be a positive int"),
    "bucket batch zero": (setter(bucket, name="b0-l32k", batch=0), "batch must be a positive int"),
    "bucket batch too large": (setter(bucket, name="b70000-l1k", batch=70000, seq_len=1024),
                               "batch must be at most 65535"),
    "bucket length too long": (setter(bucket, name="b1-l2m", seq_len=2**31), "seq_len must be at most 2147483647"),
    "bucket unknown field": (setter(bucket, rows=8), "entry 1: bucket: expected the fields"),
    "spec chunk_size a float": (setter(spec, chunk_size=256.0), "entry 1: chunk_size: expected an int"),
    "spec switch a string": (setter(spec, fused_merge="yes"), "entry 1: fused_merge: expected a bool"),
    "spec warps a string": (setter(spec, warps="4"), "entry 1: warps: expected an int"),
    "tuned_us NaN": (setter(tuned, tuned_us=float("nan")), "entry 1: tuned_us: expected a finite number above 0"),
    "tuned_us infinite": (setter(tuned, tuned_us=float("inf")), "entry 1: tuned_us: expected a finite number"),
    "tuned_us zero": (setter(tuned, tuned_us=0), "entry 1: tuned_us: expected a finite number above 0"),
    "tuned_us negative": (setter(tuned, tuned_us=-3.5), "entry 1: tuned_us: expected a finite number above 0"),
    "tuned_us a string": (setter(tuned, tuned_us="10.0"), "entry 1: tuned_us: expected a finite number"),
    "tuned_us a bool": (setter(tuned, tuned_us=True), "entry 1: tuned_us: expected a finite number"),
    "default_us NaN": (setter(tuned, default_us=float("nan")), "entry 1: default_us: expected a finite number"),
    "bandwidth_pct zero": (setter(tuned, bandwidth_pct=0.0), "entry 1: bandwidth_pct: .* above 0 and at most 150,"),
    "bandwidth_pct past the bound": (setter(tuned, bandwidth_pct=150.5), "entry 1: bandwidth_pct: .*at most 150"),
    "bandwidth_pct a string": (setter(tuned, bandwidth_pct="83%"), "entry 1: bandwidth_pct: expected"),
    "trials zero": (setter(tuned, trials=0), "entry 1: trials: expected an int >= 1"),
    "trials a float": (setter(tuned, trials=40.0), "entry 1: trials: expected an int >= 1"),
    "trials a string": (setter(tuned, trials="40"), "entry 1: trials: expected an int >= 1"),
    "trials absent": (remover(tuned, "trials"), "entry 1: entry lacks \\['trials'\\]"),
    "entry date not a date": (setter(tuned, date="2026-1-2"), "entry 1: date: expected a date"),
    "entry date absent": (remover(tuned, "date"), "entry 1: entry lacks \\['date'\\]"),
    "plan a number": (setter(tuned, plan=12), "entry 1: plan: expected a non-empty string"),
    "default_plan a list": (setter(tuned, default_plan=["split"]), "entry 1: default_plan: expected a non-empty"),
    "planner a number": (setter(tuned, planner=2), "entry 1: planner: expected"),
    "planner unknown": (setter(tuned, planner="greedy"), "entry 1: planner: expected one of"),
    "exhaustive a list": (setter(tuned, exhaustive=[1]), "entry 1: 'exhaustive' must be a mapping"),
    "exhaustive unknown field": (setter(exhaustive, speed=2), "entry 1: exhaustive: unknown fields \\['speed'\\]"),
    "exhaustive figure NaN": (setter(exhaustive, best_us=float("nan")), "entry 1: exhaustive.best_us: .* finite"),
    "exhaustive count negative": (setter(exhaustive, points=-1), "entry 1: exhaustive.points: expected an int >= 0"),
    "unit_costs tuned_us infinite": (setter(unit_costs, tuned_us=float("inf")), "unit_costs.tuned_us: .* finite"),
    "unit_costs trials zero": (setter(unit_costs, trials=0), "unit_costs.trials: expected an int >= 1"),
    "unit_costs date not a date": (setter(unit_costs, date="soon"), "unit_costs.date: expected a date"),
    "unit_costs without a date": (remover(unit_costs, "date"), "unit_costs: lacks \\['date'\\]"),
    "unit_costs workload a number": (setter(unit_costs, workloads=[6096]), "unit_costs.workloads: .* string"),
    "unit_costs cost NaN": (setter(costs, threshold=float("nan")), "unit_costs.costs: threshold: expected a finite"),
    "unit_costs max_ways a bool": (setter(costs, max_ways=True), "unit_costs.costs: max_ways"),
    # The count and digest themselves (not sealed again after the change):
    "entries_count a string": (setter(top, entries_count="3"), "entries_count: expected an int >= 0"),
    "entries_count too few": (setter(top, entries_count=2), "lists 3 entries where its header counts 2"),
    "entries_sha256 another": (setter(top, entries_sha256="0" * 64), "do not match the header's entries_sha256"),
    "entries_sha256 absent": (remover(top, "entries_sha256"), "header lacks \\['entries_sha256'\\]"),
}
UNSEALED = {name for name in BAD_FIELDS if name.startswith(("entries_count", "entries_sha256"))}


def bad_table(folder, case: str):
    """This GPU's table under ``folder``, the valid table with the field of ``case`` made wrong."""
    change, _ = BAD_FIELDS[case]
    data = sealed(valid_table_data())
    assert tables.parse(data).entries  # the unchanged data is a table
    change(data)
    if case not in UNSEALED:
        sealed(data)
    path = tables.table_path(folder, ARCH, GPU)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def one_warning(found) -> str:
    """The text of the one RuntimeWarning ``found()`` gives, called three times; and its result."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [found() for _ in range(3)]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert results[1:] == results[:1] * 2
    return messages[0], results[0]


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_a_bad_field_is_refused_by_name_with_one_warning_and_the_next_table(folders, case):
    """Each kind of bad field: load raises TableError naming the file and the field; the lookup
    warns once (however often it is asked) and serves from the next table."""
    user, shipped = folders
    broken = bad_table(user, case)
    reason = BAD_FIELDS[case][1]
    with pytest.raises(tables.TableError, match=reason) as raised:
        tables.load(broken)
    assert str(raised.value).startswith(f"{broken}: ")
    fallback = save_table(shipped, [entry("b1-l32k", TUNED_SPLIT)])
    message, found = one_warning(lambda: lookup.find(ARCH, GPU, KEY))
    assert message.startswith(f"splitkv: ignoring tuned table {broken}: ") and str(raised.value) in message
    assert found.source.startswith(f"{fallback} (exact GPU") and [e.spec for e in found.entries] == [TUNED_SPLIT]


def test_without_another_table_a_bad_one_leaves_the_built_in_choice(folders):
    """The last fallback: no other table, so the heuristic (None), after one warning."""
    user, _ = folders
    broken = bad_table(user, "tuned_us NaN")
    message, found = one_warning(lambda: lookup.find(ARCH, GPU, KEY))
    assert str(broken) in message and "tuned_us" in message
    assert found is None


def test_an_unquoted_iso_date_is_a_date():
    """YAML reads `date: 2026-01-02` as a date, not a string: it is taken as that date."""
    data = valid_table_data()
    text = writing.dump(tables.parse(sealed(data))).replace("date: '2026-01-02'", "date: 2026-01-02")
    assert "date: 2026-01-02" in text
    table = tables.parse_text(text, "unquoted")
    assert table.header["date"] == "2026-01-02" and {e.date for e in table.entries} == {"2026-01-02"}
    with pytest.raises(tables.TableError, match="unquoted: not valid YAML"):
        tables.parse_text(text.replace("date: 2026-01-02", "date: 2026-13-02", 1), "unquoted")


# ---- a file cut short ----------------------------------------------------------------------------

SHIPPED_LINES = SHIPPED.read_text().splitlines(keepends=True)
SLICES = 4  # the cuts in four tests, which a parallel run spreads over its processes


@pytest.mark.parametrize("part", range(SLICES))
def test_the_shipped_table_cut_at_any_line_is_refused(part):
    """The shipped table cut after any of its lines (a quarter of the cuts per test) is refused:
    it lacks header fields or its entries, lists fewer than its header counts, or the entries
    left do not match the header's digest. Uncut, it is the whole table."""
    count = len(SHIPPED_LINES)
    for cut in range(part, count, SLICES):
        with pytest.raises(tables.TableError):
            tables.parse_text("".join(SHIPPED_LINES[:cut]), f"cut after line {cut}")
    assert len(tables.parse_text("".join(SHIPPED_LINES), "whole").entries) == yaml.safe_load(
        SHIPPED.read_text())["entries_count"]


def test_the_shipped_table_cut_inside_a_line_of_its_last_entry_is_refused():
    """A cut inside a line (here, mid-line in each line of the last entry) is refused too."""
    text = SHIPPED.read_text()
    last = text.rindex("\n- key:") + 1
    for line_end in [i for i in range(last, len(text)) if text[i] == "\n"]:
        line_start = text.rindex("\n", 0, line_end) + 1
        cut = (line_start + line_end) // 2
        with pytest.raises(tables.TableError):
            tables.parse_text(text[:cut], f"cut at byte {cut}")


def test_a_cut_between_entries_says_so(tmp_path):
    """A cut at an entry's end names the count: fewer entries than the header says."""
    path = tmp_path / "cut.yaml"
    text = SHIPPED.read_text()
    path.write_text(text[:text.rindex("\n- key:") + 1])
    count = len(tables.load(SHIPPED).entries)
    with pytest.raises(tables.TableError,
                       match=f"lists {count - 1} entries where its header counts {count}: the file was cut"):
        tables.load(path)


# ---- the size bound ------------------------------------------------------------------------------

def test_a_file_over_the_bound_is_refused_before_it_is_read(folders):
    """A table file of 100 MB (sparse: nothing to read) is refused at once, by its size, with one
    warning; the lookup goes on with the next table."""
    user, shipped = folders
    huge = tables.table_path(user, ARCH, GPU)
    huge.parent.mkdir(parents=True)
    with open(huge, "wb") as f:
        f.truncate(100 << 20)
    start = time.perf_counter()
    with pytest.raises(tables.TableError, match=f"{104857600} bytes or more, over the {tables.MAX_TABLE_BYTES}"):
        tables.load(huge)
    assert time.perf_counter() - start < 0.1  # parsing 100 MB of YAML takes minutes
    fallback = save_table(shipped, [entry("b1-l32k", TUNED_SPLIT)])
    message, found = one_warning(lambda: lookup.find(ARCH, GPU, KEY))
    assert str(huge) in message and "MAX_TABLE_BYTES" in message
    assert found.source.startswith(str(fallback))


def test_a_file_growing_past_the_bound_as_it_is_read_is_refused(tmp_path, monkeypatch):
    """The size a file has when opened does not let more than the bound through: at most one byte
    past it is read, and refused. Here the file is a pipe, of size 0 when opened, that a writer
    fills with more than the bound."""
    path = tmp_path / "grows.yaml"
    os.mkfifo(path)
    monkeypatch.setattr(tables, "MAX_TABLE_BYTES", 100)

    def fill():
        with open(path, "w") as f:
            f.write("schema: 2\n" + "#" * 1000 + "\n")

    writer = threading.Thread(target=fill)
    writer.start()
    try:
        with pytest.raises(tables.TableError, match="101 bytes or more, over the 100"):
            tables.load(path)
    finally:
        writer.join(timeout=10)


def test_the_writer_writes_no_table_over_the_bound(tmp_path, monkeypatch):
    """save refuses a table the reader would refuse for its size, and leaves the old file."""
    path = save_table(tmp_path, [entry("b1-l32k", TUNED_SPLIT)])
    before = path.read_bytes()
    monkeypatch.setattr(writing, "MAX_TABLE_BYTES", len(before) + 10)
    with pytest.raises(tables.TableError, match="not written: .* bytes, over the"):
        writing.save(path, header(), [entry("b32-l4k", TUNED_DENSE)])
    assert path.read_bytes() == before


def test_the_shipped_table_is_well_inside_the_bound():
    assert SHIPPED.stat().st_size * 20 < tables.MAX_TABLE_BYTES


# ---- older tables, hand edits, the writer --------------------------------------------------------

def schema_1_text() -> str:
    """The shipped table as schema 1 wrote it: no count or digest."""
    assert SHIPPED_LINES[0] == "schema: 2\n" and SHIPPED_LINES[1].startswith("entries_count: ")
    assert SHIPPED_LINES[2].startswith("entries_sha256: ")
    return "schema: 1\n" + "".join(SHIPPED_LINES[3:])


def test_a_schema_1_table_is_used_with_one_warning_and_rewritten_as_schema_2(folders):
    """The shipped table as schema 1 reads as the same table; the lookup uses it, warning once
    that a cut one cannot be told; rewrite gives the shipped file byte for byte."""
    user, _ = folders
    old = tables.table_path(user, ARCH, "NVIDIA H200")
    old.parent.mkdir(parents=True)
    old.write_text(schema_1_text())
    shipped = tables.load(SHIPPED)
    read = tables.load(old)
    assert read.entries == shipped.entries and read.unit_costs == shipped.unit_costs
    assert read.header == {**shipped.header, "schema": 1}
    message, found = one_warning(lambda: lookup.find(ARCH, "NVIDIA H200", KEY))
    assert message.startswith(f"splitkv: the tuned table {old} is of schema 1") and "rewrite" in message
    assert found.source.startswith(f"{old} (exact GPU") and found.entries == tuple(shipped.for_key(KEY))
    writing.rewrite(old)
    assert old.read_bytes() == SHIPPED.read_bytes()


def test_a_schema_1_table_cut_short_cannot_be_told():
    """Why schema 2: the same cut between entries, which schema 2 refuses, reads as a smaller table."""
    text = schema_1_text()
    cut = text[:text.rindex("\n- key:") + 1]
    assert len(tables.parse_text(cut, "schema 1 cut").entries) == len(tables.load(SHIPPED).entries) - 1


def test_an_entry_edited_by_hand_is_refused_until_rewritten(tmp_path):
    """A changed figure no longer matches the digest; rewrite takes the table as it now is."""
    path = tmp_path / "sm_90" / "NVIDIA_H200.yaml"
    path.parent.mkdir()
    text = SHIPPED.read_text()
    assert text.count("tuned_us: 28.56\n") == 1
    path.write_text(text.replace("tuned_us: 28.56\n", "tuned_us: 28.0\n"))
    with pytest.raises(tables.TableError, match="do not match the header's entries_sha256"):
        tables.load(path)
    writing.rewrite(path)
    assert 28.0 in {e.tuned_us for e in tables.load(path).entries}


def test_the_writer_writes_nothing_the_reader_refuses(tmp_path):
    """An entry whose figures the reader would refuse never reaches the file: save raises
    TableError naming the field, and the old file stays."""
    path = save_table(tmp_path, [entry("b1-l32k", TUNED_SPLIT)])
    before = path.read_bytes()
    for bad in (entry("b32-l4k", TUNED_DENSE, trials=0), entry("b32-l4k", TUNED_DENSE, tuned_us=float("nan")),
                entry("b32-l4k", TUNED_DENSE, bandwidth_pct=400.0)):
        with pytest.raises(tables.TableError, match=f"{path} \\(not written\\): entry 1: "):
            writing.save(path, header(), [bad])
        assert path.read_bytes() == before


def test_the_header_leads_with_the_count_and_digest_of_the_entries(tmp_path):
    """The writer puts them right after the schema, before everything they cover."""
    path = save_table(tmp_path, [entry("b1-l32k", TUNED_SPLIT), entry("b1-l2k")])
    lines = path.read_text().splitlines()
    data = yaml.safe_load(path.read_text())
    assert lines[:3] == [f"schema: {tables.SCHEMA}", "entries_count: 2",
                         f"entries_sha256: {tables.entries_digest(data['entries'])}"]
