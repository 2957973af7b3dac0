"""The tuner's keys and tables without a GPU: buckets, GPU file names and keys read and refused, a
table saved and loaded (byte for byte, merged, atomically, never over another GPU's), every way a
table can be wrong, the optional fields of an entry, and the table that ships for the H200."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest
import yaml

from splitkv.autotune import confirm, writing
from splitkv.heuristics import default_spec
from splitkv.tuned import keys, lookup, tables
from splitkv.tuned.keys import BUCKETS_BY_NAME, TuneKey

from autotune_helpers import (ARCH, GPU, KEY, OTHER_KEY, OTHER_SPLIT, TUNED_DENSE, TUNED_SPLIT, entry, header,
                              save_table)


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


def temporary_files(folder: Path) -> list:
    """What `writing.save` may leave behind besides tables and its lock files."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith((".yaml", ".lock")))


# ---- keys ----------------------------------------------------------------------------------------

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
        TuneKey(128, 4, kv_layout="NDH")
    # Contiguous caches in transformers' [B, Hkv, L, D] order have a key (and no shipped table) of their own.
    hnd = TuneKey(128, 4, kv_layout="HND")
    assert hnd.layout == "contiguous-HND" and TuneKey.from_dict(hnd.to_dict()) == hnd


# ---- tables: YAML round trip ---------------------------------------------------------------------

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


def test_save_refuses_a_spec_of_another_key_or_arch(tmp_path):
    """An entry whose program is not one of its key on the table's arch never reaches the file."""
    path = tables.table_path(tmp_path, ARCH, GPU)
    with pytest.raises(tables.TableError, match="not a program of that key"):
        writing.save(path, header(), [entry("b1-l32k", OTHER_SPLIT)])
    with pytest.raises(tables.TableError, match="not a program of that key"):
        writing.save(tables.table_path(tmp_path, "sm_80", GPU), header(arch="sm_80"), [entry("b1-l32k", TUNED_SPLIT)])
    assert not path.exists()


# ---- tables: schema errors -----------------------------------------------------------------------

def sealed(data: dict) -> dict:
    """``data`` with the count and digest of its entries as they now are, as the writer puts them."""
    data.update(entries_count=len(data["entries"]), entries_sha256=tables.entries_digest(data["entries"]))
    return data


def as_schema_1(data: dict) -> dict:
    """``data`` as a table written before schema 2: no count or digest of its entries."""
    for name in tables.CHECK_FIELDS:
        data.pop(name)
    data["schema"] = 1
    return data


def _valid_table_data() -> dict:
    return yaml.safe_load(writing.dump(tables.Table(header(), tuple(sample_entries()[:2]))))


def _overflowing_spec(data):
    data["entries"][0]["spec"].update(warps=8, tile_tokens=64, chunk_size=512, stages=4)


def _duplicate_entry(data):
    data["entries"].append(dict(data["entries"][0], tuned_us=1.0))


SCHEMA_ERRORS = {
    "invalid YAML": (None, "not valid YAML"),
    "schema number": (lambda d: d.update(schema=3), "schema 3"),
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
        path.write_text(yaml.safe_dump(sealed(data), sort_keys=False))
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
    table = tables.parse(as_schema_1(data))
    assert table.entries == tables.parse(_valid_table_data()).entries
    assert "steal_tiles" not in writing.dump(table) and "span_rows" not in writing.dump(table)


# ---- tables: what an entry records ---------------------------------------------------------------

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


# ---- the shipped table ---------------------------------------------------------------------------

def test_the_shipped_h200_table():
    """The table that ships for the H200 loads, covers head_dim 64/128/256 x group 1/4/8 x every K/V
    dtype in the default buckets (and several query tokens on a few keys), and holds only programs the rules let in: valid specs of their key,
    each at least the margin faster than the built-in choice on its own figures. Where the exhaustive
    search was run, the entry's program is within 3% of the space's best."""
    path = lookup.shipped_dir() / "sm_90" / "NVIDIA_H200.yaml"
    table = tables.load(path)
    assert (table.gpu, table.arch, table.header["sm_count"]) == ("NVIDIA H200", "sm_90", 132)
    want = {(TuneKey(d, g, q, kv), b) for d in (64, 128, 256) for g in (1, 4, 8)
            for kv, q in (("bf16", "bf16"), ("fp16", "fp16"), ("fp8_e4m3", "bf16"), ("nvfp4", "bf16"))
            for b in BUCKETS_BY_NAME}
    # and head_dim 128 x group 4/8 x BF16/FP8 caches for 2, 4, 8 and 16 query tokens per sequence.
    want |= {(TuneKey(128, g, "bf16", kv, query_tokens=t), b) for g in (4, 8) for kv in ("bf16", "fp8_e4m3")
             for t in (2, 4, 8, 16) for b in BUCKETS_BY_NAME}
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
        if e.exhaustive:  # the search's own winner (a re-measure may have put the built-in choice back since)
            ex = e.exhaustive
            chosen = ex["tuned_spec_us"] if ex.get("tuned_spec_us") is not None else ex["builtin_spec_us"]
            assert chosen <= ex["best_us"] * 1.03 and ex["trials_to_within_3pct"] <= e.trials
    assert sum(bool(e.exhaustive) for e in table.entries) >= 4
    assert writing.dump(table) == path.read_text()  # written by writing.save: sorted, nothing hand-edited
